"""The rules a GPU or an Apple MPS device would apply, checked on the CPU: what each torch release can run on MPS
(anti-aliased resizing), the precision that really runs when torch turns autocast off, the training default
precision per CUDA compute capability, and no host synchronisation per training step."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import train
from tests.helpers import run_in_process
from tools import runtime
from tools.data import synthetic
from tools.errors import UserError
from tools.models.architectures import SMALL_CNN
from tools.models.sources import load_model
from tools.provenance import TRAINING_LOG
from tools.runtime import Precision, Runtime
from tools.training import data as training_data
from tools.training import loop
from tools.training.config import Method, TrainConfig

MPS = torch.device("mps")


@pytest.fixture
def mps_here(monkeypatch):
    """This machine claims an MPS device (nothing is ever placed on it: the checks refuse first)."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.delenv("PYTORCH_ENABLE_MPS_FALLBACK", raising=False)


@pytest.fixture
def torch_version(monkeypatch):
    def set_version(version: str) -> None:
        monkeypatch.setattr(torch, "__version__", version)
    return set_version


@pytest.mark.parametrize("device, mode, version, refused", [
    ("mps", "bilinear", "2.6.0", True), ("mps", "bilinear", "2.7.0", False), ("mps", "bilinear", "2.7.1", False),
    ("mps", "bicubic", "2.7.1", True), ("mps", "bicubic", "2.8.0", False),
    ("mps", "bicubic", "2.10.0.dev20251201", False),
    ("cpu", "bicubic", "2.6.0", False), ("cuda", "bilinear", "2.6.0+cu124", False)])
def test_antialiased_resizing_per_device_and_torch_release(device, mode, version, refused):
    device = torch.device(device)
    if refused:
        with pytest.raises(UserError, match=rf"--device mps needs torch>=2\.[78] for the anti-aliased {mode}"):
            runtime.check_antialias(device, mode, "the test", version, cpu_fallback=False)
    else:
        runtime.check_antialias(device, mode, "the test", version, cpu_fallback=False)


def test_torchs_mps_cpu_fallback_turns_the_refusal_into_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        runtime.check_antialias(MPS, "bicubic", "the test", "2.7.0", cpu_fallback=True)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "runs on the CPU" in caplog.text


@pytest.mark.slow
def test_training_on_mps_before_torch_2_7_is_one_error_line_at_start_up(tmp_path, capsys, mps_here, torch_version):
    torch_version("2.6.0")
    root = tmp_path / "in9"
    synthetic.generate(root, per_class=1, seed=0, split="train")
    argv = ["--data-path", root, "--weights", "none", "--arch", SMALL_CNN, "--device", "mps", "--no-progress",
            "--workers", "0", "--batch-size", "3", "--output-dir", tmp_path / "out"]
    code, _, err = run_in_process(train.main, [str(a) for a in argv],
                                  capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: --device mps needs torch>=2.7 for the anti-aliased bilinear resizing of train.py's random resized "
        "crops (--augment) (this is torch 2.6.0); upgrade torch, set PYTORCH_ENABLE_MPS_FALLBACK=1 to run it on the "
        "CPU, or use --device cpu"]


def test_clip_resizing_its_inputs_on_mps_before_torch_2_8_is_refused_before_any_work(tiny_clip, mps_here,
                                                                                       torch_version):
    torch_version("2.7.1")  # bilinear is there, bicubic is not
    with pytest.raises(UserError, match=r"torch>=2\.8 for the anti-aliased bicubic resizing of clip:.*32x32"):
        load_model(tiny_clip, runtime=Runtime(MPS))


class RefusedAutocast:
    """torch.autocast as torch behaves where a device cannot run the dtype (MPS bf16 before macOS 14, say):
    it warns and leaves autocast off."""

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        warnings.warn("In MPS autocast, but the target dtype is not supported. Disabling autocast.", stacklevel=2)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_refused_autocast_is_recorded_as_the_fp32_that_runs(monkeypatch, caplog):
    monkeypatch.setattr(torch, "autocast", RefusedAutocast)
    with caplog.at_level(logging.WARNING):
        refused = Runtime(torch.device("cpu"), Precision.BF16)
    layer = torch.nn.Linear(4, 3)
    with refused.autocast():
        ran = layer(torch.randn(2, 4)).dtype
    assert ran == torch.float32
    assert refused.describe()["precision"] == "fp32" and refused.exact
    assert len(caplog.records) == 1 and "bf16 autocast does not run on cpu here" in caplog.text


def test_an_autocast_that_runs_is_recorded_as_asked():
    asked = Runtime(torch.device("cpu"), Precision.BF16)
    with asked.autocast():
        assert torch.nn.Linear(4, 3)(torch.randn(2, 4)).dtype == torch.bfloat16
    assert asked.describe()["precision"] == "bf16"


class Stop(Exception):
    pass


@pytest.mark.parametrize("capability, precision", [((7, 0), Precision.FP32), ((7, 5), Precision.FP32),
                                                   ((8, 0), Precision.BF16), ((9, 0), Precision.BF16)])
def test_training_defaults_to_bf16_only_where_the_gpu_computes_it_natively(capability, precision, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen = []

    def start(device, precision, *args, **kwargs):  # where the run would start allocating on the GPU
        chosen.append((device.type, precision))
        raise Stop

    monkeypatch.setattr(loop, "Runtime", start)
    with pytest.raises(Stop):
        loop.train(TrainConfig(data_path=tmp_path, output_dir=tmp_path, arch=SMALL_CNN, weights="none", device="cuda"))
    assert chosen == [("cuda", precision)]


@pytest.mark.parametrize("asked", [Precision.FP32, Precision.BF16])
def test_a_precision_asked_for_is_kept_whatever_the_gpu(asked, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    config = TrainConfig(data_path=tmp_path, output_dir=tmp_path, precision=asked)
    assert config.precision_on(torch.device("cuda")) is asked and config.precision_on(torch.device("cpu")) is asked


class HostReads:
    """Counts, inside a training run, what would make the host wait for a GPU: reading a tensor's values
    (item, tolist, cpu, numpy, bool, int, float, index) and copying a tensor to the device without
    non_blocking other than through `tools.runtime.to_device` (which copies from pinned memory without waiting
    on CUDA: tests/test_copies.py). Tensors that live on the host in a GPU run are not counted: what the DataLoader
    yields (its reads are host reads; the copies of it to the device are) and torch's optimiser step counters (kept
    on the host unless capturable)."""

    READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count, self.loading, self.host, self.optimizers, self.copying = 0, False, set(), [], False
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        original_to, runtime_to_device = torch.Tensor.to, training_data.to_device

        def to(tensor, *args, **kwargs):
            to_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
            if (to_device and not self.loading and not self.copying and id(tensor) in self.host
                    and not kwargs.get("non_blocking", False)):
                self.count += 1  # a blocking copy of loader data to the device
            return original_to(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)

        def runtime_copy(tensor, device):
            self.copying = True
            try:
                return runtime_to_device(tensor, device)
            finally:
                self.copying = False

        monkeypatch.setattr(training_data, "to_device", runtime_copy)
        make_loader, make_optimizer = loop.make_loader, loop._optimizer
        store = loop.decoded_store

        def decoded(*args, **kwargs):  # decoding on the host, before any step: host data, not device reads
            self.loading = True
            try:
                return store(*args, **kwargs)
            finally:
                self.loading = False

        monkeypatch.setattr(loop, "decoded_store", decoded)
        monkeypatch.setattr(loop, "make_loader", lambda *a, **k: self._uncounted(make_loader(*a, **k)))
        monkeypatch.setattr(loop, "_optimizer", lambda *a, **k: self.optimizers.append(make_optimizer(*a, **k))
                            or self.optimizers[-1])

    def _is_host(self, tensor) -> bool:
        if self.loading or id(tensor) in self.host:
            return True
        return any(tensor is state.get("step") for optimizer in self.optimizers for state in optimizer.state.values())

    def _counted(self, method):
        def read(tensor, *args, **kwargs):
            if not self._is_host(tensor):
                self.count += 1
            return method(tensor, *args, **kwargs)
        return read

    def _uncounted(self, loader):
        batches = iter(loader)
        while True:
            self.loading = True
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.loading = False
            self.host = {id(value) for value in batch.values() if isinstance(value, torch.Tensor)}
            yield batch


@pytest.mark.slow
def test_training_reads_from_the_device_per_log_block_not_per_step(tmp_path, monkeypatch, one_thread):
    root = tmp_path / "in9"
    synthetic.generate(root, per_class=2, seed=0, split="train")  # 18 images
    counts = {}
    for batch_size in (6, 3):  # 3 steps, then 6 steps, in one log block
        reads = HostReads(monkeypatch)
        loop.train(TrainConfig(data_path=root, output_dir=tmp_path / str(batch_size), methods=[Method.BG_SWAP],
                               arch=SMALL_CNN, weights="none", batch_size=batch_size, device="cpu", workers=0,
                               progress=False))
        counts[batch_size] = reads.count
        monkeypatch.undo()
    assert counts[3] == counts[6], counts
    log = [line for line in (tmp_path / "3" / TRAINING_LOG).read_text().splitlines() if '"loss"' in line]
    assert len(log) == 6  # every step still has its line
