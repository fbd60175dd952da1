"""The training loop, checked on the CPU for what a GPU enforces: a step launches without reading anything back
from the device (a read waits for the device to finish, so the host could not gather the next batch meanwhile).

A step runs on the meta device, where tensors have shapes and no values: any read of one raises (a ResNet with
BatchNorm, the optimisers' foreach path as on CUDA; not autocast, nor the CUDA copies' side stream). The whole loop
runs on the CPU with every op between two loader batches recorded, and every read of a tensor made there: none.
Not seen by either: a copy from unpinned host memory (which can wait on CUDA), kernels that wait inside CUDA."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.weak import WeakTensorKeyDictionary

from tests.test_device_loop import SYNCS, RecordsOps
from tools.data.hashing import read_and_fingerprint
from tools.in9 import IN9_MEAN, IN9_STD
from tools.models.architectures import SMALL_CNN, build_architecture
from tools.provenance import TRAINING_LOG
from tools.runtime import Runtime
from tools.training import loop, resample
from tools.training.adapters import TrainingModel
from tools.training.config import Method, Optimizer, TrainConfig
from tools.training.data import StepSampler, decoded_store, list_training_data, make_loader
from tools.training.methods import WeightAveraging, batch_mixer

META = torch.device("meta")
BATCH = 6

SETTINGS = {
    "erm": {},
    "erm-no-augment-sgd": {"augment": False, "optimizer": Optimizer.SGD},
    "bg-swap-half": {"methods": [Method.BG_SWAP], "swap_prob": 0.5},  # some images keep their own background
    "mixup+cutmix": {"methods": [Method.MIXUP, Method.CUTMIX]},
    "bg-swap+mixup-swa": {"methods": [Method.BG_SWAP, Method.MIXUP], "swa": True, "swa_start_epoch": 0},
}


class RecordsReads(RecordsOps):
    """Also the devices whose values ops read on the host ("cpu" alone is no wait: AdamW's step counts and MixUp's
    draws are host tensors wherever the model runs; a meta tensor's read raises), and the ops that made float64
    tensors on the device (MPS has no float64)."""

    def __init__(self):
        super().__init__()
        self.devices_read: set[str] = set()
        self.float64_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNCS:
            self.devices_read |= {a.device.type for a in args if isinstance(a, torch.Tensor)}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" and t.dtype == torch.float64
               for t in pytree.tree_leaves(out)):
            self.float64_ops.add(func._schema.name)
        return out


# Tensor methods that hand a tensor's values to Python: on a GPU each waits for the device
HOST_READS = {"tolist", "numpy", "cpu", "item", "__bool__", "__float__", "__int__", "__index__", "__array__",
              "__repr__", "__str__", "__format__"}


class RecordsHostReads(TorchFunctionMode):
    """The reads (HOST_READS, and indexing with a boolean mask, whose result's size is a read) of tensors made
    inside the recording, where the ops alone do not show them on the CPU (`.cpu()` of a CPU tensor, `.tolist()`
    and `.numpy()` dispatch nothing); tensors made before (the loader's batch, on the host) may be read."""

    def __init__(self):
        super().__init__()
        self.made = WeakTensorKeyDictionary()
        self.reads: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        tensors = [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        if name in HOST_READS and tensors and tensors[0] in self.made:
            self.reads.add(name)
        if name in ("__getitem__", "__setitem__") and any(t.dtype == torch.bool and t in self.made
                                                          for t in tensors[1:]):
            self.reads.add(f"{name} with a boolean mask")
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not any(tensor is t for t in tensors):  # `.to` of its own device
                self.made[tensor] = True
        return out


def _cpu_batches(config: TrainConfig, steps: int) -> tuple[StepSampler, list[dict]]:
    """The loader's first `steps` batches, gathered on the CPU as train.py gathers them."""
    data = list_training_data(config)
    fingerprint, _, hashes = read_and_fingerprint(data.root, data.relpaths(), 1)
    store = decoded_store(data, fingerprint, 0, False, hashes)
    sampler = StepSampler(len(data), config.batch_size, config.seed, 0, end_epoch=config.epochs)
    return sampler, list(itertools.islice(make_loader(data, config, sampler, False, store), steps))


def _meta_steps(name: str, data, out) -> RecordsReads:
    """Three steps of SETTINGS[name] on the meta device, batches gathered on the CPU; what they ran and read."""
    config = TrainConfig(data, out, arch=SMALL_CNN, weights="none", batch_size=BATCH, lr=0.01, epochs=2,
                         device="cpu", workers=0, progress=False, **SETTINGS[name])
    sampler, batches = _cpu_batches(config, 3)
    torch.manual_seed(0)
    # a model with BatchNorm, uint8 in as train() wraps it; the optimiser's foreach path, CUDA's default
    net = TrainingModel(build_architecture("resnet18", 9), IN9_MEAN, IN9_STD).to(META).train()
    optimizer = loop._optimizer(net.parameters(), config)
    for group in optimizer.param_groups:
        group["foreach"] = True
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, loop.warmup_cosine(6, 1))
    swa = WeightAveraging(net, config, 3) if config.swa else None
    run_step = loop.StepRunner(net, optimizer, schedule, swa, batch_mixer(config), torch.nn.CrossEntropyLoss(
        label_smoothing=config.label_smoothing), Runtime(META), sampler, config.augment)
    steps_log = loop.StepLog(loop.JsonLog(out / "log.jsonl", False, None), None, META, 0.0)
    with RecordsReads() as recorder:
        for step, batch in enumerate(batches):
            logits, loss, labels = run_step(batch, step, 0)
            steps_log.add(logits, loss, labels, step=step + 1, epoch=0, lr=optimizer.param_groups[0]["lr"])
    assert logits.device == loss.device == labels.device == META and logits.shape == (BATCH, 9)
    assert all(p.device == META for p in net.parameters()) and len(steps_log.pending) == 3
    return recorder


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.slow
def test_a_step_launches_on_the_meta_device_reading_nothing_back(name, tiny, tmp_path, one_thread):
    """Device batch (swap, crops, flips), mixing, forward, loss, backward, optimiser, learning rate and SWA's rate,
    and the step's logged sums, on tensors without values: the same code a CUDA run launches."""
    recorder = _meta_steps(name, tiny, tmp_path)
    assert "aten::convolution_backward" in recorder.ops  # the step ran, on values nobody can read
    assert any(op.startswith("aten::_foreach_") for op in recorder.ops)  # the optimiser's CUDA path
    if SETTINGS[name].get("augment", True):
        assert "aten::bmm" in recorder.ops  # the device's batched crops, not the CPU's loop
    assert recorder.devices_read <= {"cpu"}, recorder.devices_read


class RecordsBetweenBatches:
    """Stands in for the loop's `islice`: records the ops and host reads of everything the loop does with a batch
    until it asks for the next one (the loader's own gathering, on the host, is left out)."""

    def __init__(self):
        self.ops: set[str] = set()
        self.reads: set[str] = set()
        self.batches = 0
        self.recorders: tuple[RecordsOps, RecordsHostReads] | None = None

    def __call__(self, iterable, stop):
        for batch in itertools.islice(iterable, stop):
            self.recorders = RecordsOps(), RecordsHostReads()
            for recorder in self.recorders:
                recorder.__enter__()
            yield batch
            self.stop()
            self.batches += 1

    def stop(self) -> None:
        if self.recorders is not None:
            ops, reads = self.recorders
            reads.__exit__(None, None, None)
            ops.__exit__(None, None, None)
            self.ops |= ops.ops
            self.reads |= reads.reads
            self.recorders = None


def _loop_ops(methods, data, out, monkeypatch) -> RecordsBetweenBatches:
    """train() on the CPU for two epochs of three steps, no log block nor save due within an epoch."""
    monkeypatch.setattr(loop, "LOG_EVERY", 10**6)
    between = RecordsBetweenBatches()
    monkeypatch.setattr(loop, "islice", between)
    try:
        # SGD: AdamW reads its step counts, host tensors wherever the model runs, indistinguishable here
        loop.train(TrainConfig(data, out, methods=methods, arch=SMALL_CNN, weights="none", batch_size=BATCH,
                               lr=0.01, epochs=2, device="cpu", workers=0, progress=False, save_every=10**6,
                               optimizer=Optimizer.SGD))
    finally:
        between.stop()  # a step that raised left its recorders on
    assert _get_current_dispatch_mode() is None
    return between


@pytest.mark.parametrize("methods", [[Method.ERM], [Method.BG_SWAP]])
def test_the_loop_reads_the_device_only_to_log_and_save(methods, tiny, tmp_path, monkeypatch, one_thread):
    """train() on the CPU (its crops are the host's own kernel; the meta test above covers the device's): between
    one batch and the next, within an epoch, no op reads a value and no tensor made there is read."""
    between = _loop_ops(methods, tiny, tmp_path, monkeypatch)
    assert between.batches == 6 and "aten::convolution_backward" in between.ops
    assert not between.ops & SYNCS, between.ops & SYNCS
    assert not between.reads, between.reads
    # each epoch's end is timed once its steps are read back (bench_train's mean ends there): after its steps
    lines = [json.loads(line) for line in (tmp_path / TRAINING_LOG).read_text().splitlines()]
    ends = [i for i, line in enumerate(lines) if line.get("event") == "epoch_end"]
    assert len(ends) == 2 and all(lines[i]["time_s"] >= lines[i - 1]["time_s"] > 0 for i in ends)


@pytest.mark.parametrize("read", ["item", "cpu-numpy", "tolist", "mask"])
@pytest.mark.slow
def test_the_checks_see_a_read(read, tiny, tmp_path, monkeypatch, one_thread):
    """The checks above can fail: a read of the step's results raises on the meta device and is seen on the CPU."""
    step = loop.training_step

    def reading(*args):
        logits, loss = step(*args)
        {"item": lambda: loss.item(), "cpu-numpy": lambda: loss.detach().cpu().numpy(),
         "tolist": lambda: logits.tolist(), "mask": lambda: logits[logits > 0]}[read]()
        return logits, loss

    monkeypatch.setattr(loop, "training_step", reading)
    with pytest.raises((RuntimeError, NotImplementedError)):
        _meta_steps("erm", tiny, tmp_path / "meta")
    between = _loop_ops([Method.ERM], tiny, tmp_path / "cpu", monkeypatch)
    assert between.reads or between.ops & SYNCS


@pytest.mark.slow
def test_a_step_on_a_device_without_float64_makes_none(tiny, tmp_path, monkeypatch, one_thread):
    """MPS has no float64: on such a device (the meta device standing in) a step makes no float64 tensor there,
    the crops' weights computed in float32 and the logged numbers read as float32."""
    monkeypatch.setattr(resample, "NO_FLOAT64", frozenset({"meta"}))
    for name in ("erm", "bg-swap+mixup-swa"):
        recorder = _meta_steps(name, tiny, tmp_path / name)
        assert "aten::bmm" in recorder.ops and not recorder.float64_ops, recorder.float64_ops
