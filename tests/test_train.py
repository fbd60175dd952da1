"""train.py end to end on generated data: bg-swap measurably removes background reliance that erm learns;
every method leaves a checkpoint both evaluation scripts load; kill -9 then --resume equals the uninterrupted
run bit for bit; two torchrun processes on gloo equal one process (under tests.collective_guard), draw their
own dropout masks and the one-process mixing, and SWA's BatchNorm statistics come from both."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import challenge_eval
import in9_eval
from tests import collective_guard
from tests.helpers import TINY, run_in_process, run_in_processes, run_train, weights
from tools import distributed
from tools.data import synthetic
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.checkpoints import TRAINED_FORMAT
from tools.training import loop
from tools.training.checkpoint import CHECKPOINT_NAME, STATE_NAME
from tools.training.config import Method, TrainConfig
from tools.training.data import derived_seed
from tools.training.methods import WeightAveraging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def imagenet_start(tmp_path_factory):
    """A 1000-class small CNN state dict: a stand-in for pretrained ImageNet weights."""
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("start") / "small_cnn_1000.pth"
    torch.save(SmallCNN(1000).state_dict(), path)
    return path


def in9_results(directory: Path) -> dict:
    return json.loads((directory / "in9.json").read_text())


@pytest.mark.slow
def test_bg_swap_removes_the_background_reliance_erm_learns(tmp_path, capsys, one_thread):
    # Every class has its own foreground colour and its own background colour: erm learns both cues,
    # bg-swap (foregrounds pasted on random classes' backgrounds) can only learn the foreground.
    root = tmp_path / "in9"
    synthetic.generate(root, per_class=16, seed=0, split="train")
    synthetic.generate(root, per_class=8, seed=1)
    results = {}
    for method in ("erm", "bg-swap"):
        out = tmp_path / method
        code, _, err = run_train(["--data-path", root, "--method", method, "--weights", "none", "--epochs", 10,
                                  "--batch-size", 16, "--lr", 1e-2, "--eval-data", root, "--output-dir", out, *TINY],
                                 capsys)
        assert code == 0, err
        results[method] = in9_results(out / "eval_trained")
        report = (out / "report.md").read_text()
        assert f"Method `{method}`" in report
        assert f"| **BG-gap** (points) | – | {results[method]['bg_gap']:.2f} | – |" in report
    erm, swap = results["erm"], results["bg-swap"]
    assert erm["original"]["accuracy"] > 85 and swap["original"]["accuracy"] > 85
    # erm: backgrounds alone are mostly enough, and a foreign background costs a lot
    assert erm["only_bg_t"]["accuracy"] > 60
    assert erm["bg_gap"] > 30
    # bg-swap: backgrounds alone are near chance (11.1%), and the gap is several times smaller
    assert swap["only_bg_t"]["accuracy"] < 30
    assert abs(swap["bg_gap"]) * 4 < erm["bg_gap"]
    assert swap["mixed_rand"]["accuracy"] > erm["mixed_rand"]["accuracy"] + 30


METHODS = {
    "mixup+cutmix": ["--method", "mixup", "cutmix"],
    "bg-swap+cutmix+swa": ["--method", "bg-swap", "cutmix", "--swa", "--swa-start-epoch", "1",
                           "--swap-same-class-prob", "0.5"],
    "erm+lora": ["--peft", "lora", "--lora-rank", "2", "--peft-modules", "features.2", "features.6"],
    "erm+oft": ["--peft", "oft", "--oft-block-size", "4", "--peft-modules", "features.6"],
}


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.slow
def test_each_method_leaves_a_checkpoint_both_scripts_load(name, tiny, tmp_path, capsys, one_thread):
    if "lora" in name or "oft" in name:
        pytest.importorskip("peft")
    out = tmp_path / "run"
    code, stdout, err = run_train(["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6,
                                   "--output-dir", out, *METHODS[name], *TINY], capsys)
    assert code == 0, err
    assert f"checkpoint: {out / CHECKPOINT_NAME}" in stdout
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert saved["format"] == TRAINED_FORMAT and saved["arch"] == SMALL_CNN and saved["num_classes"] == 9
    assert saved["method"] == name
    assert sorted(saved["model"]) == sorted(SmallCNN(9).state_dict())  # adapters merged: a plain state dict
    if "lora" in name or "oft" in name:  # only the adapted modules and the head moved from the initial weights
        torch.manual_seed(derived_seed(0, "init"))
        initial = SmallCNN(9).state_dict()
        adapted = {"features.2", "features.6"} if "lora" in name else {"features.6"}
        should_move = {f"{module}.weight" for module in adapted} | {"fc.weight", "fc.bias"}  # adapters: no biases
        moved = {key for key, value in saved["model"].items() if not torch.equal(value, initial[key])}
        assert moved == should_move
    assert saved["train_args"]["epochs"] == 2 and len(saved["data"]["sha256"]) == 64
    assert saved["train_args"]["batch_size"] == 6 and saved["train_args"]["lr"] == 1e-3 * 6 / 32  # scaled to the batch
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 7))  # 18 images, batch 6: 3 steps x 2 epochs
    # both evaluation scripts, with no model flags at all: architecture and normaliser come from the file
    code, stdout, err = run_in_process(
        in9_eval.main,
        ["--data-path", str(tiny), "--checkpoint", str(out / CHECKPOINT_NAME), "--eval-dataset", "mixed_rand",
         "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "e1")], capsys)
    assert code == 0, err
    assert stdout.startswith("Accuracy on mixed_rand is ")
    code, stdout, err = run_in_process(
        challenge_eval.main,
        ["--data-path", str(tiny), "--checkpoint", str(out / CHECKPOINT_NAME), "--device", "cpu", "--no-progress",
         "--no-cache", "--output-dir", str(tmp_path / "e2")], capsys)
    assert code == 0, err
    assert "Challenge accuracy:" in stdout


def test_linear_probe_from_a_1000_class_model_trains_a_new_head_alone(tiny, imagenet_start, tmp_path, capsys,
                                                                      one_thread):
    out = tmp_path / "probe"
    code, stdout, err = run_train(["--data-path", tiny, "--checkpoint", imagenet_start, "--freeze", "backbone",
                                   "--epochs", 1, "--batch-size", 6, "--lr", 0.05, "--eval-data", tiny,
                                   "--eval-challenge", "--output-dir", out, *TINY], capsys)
    assert code == 0, err
    start, trained = torch.load(imagenet_start, weights_only=True), weights(out / CHECKPOINT_NAME)
    for key, value in trained.items():
        if key.startswith("fc."):
            assert value.shape[0] == 9  # the new head
        else:
            assert torch.equal(value, start[key]), key  # the backbone is untouched
    saved = torch.load(out / CHECKPOINT_NAME, weights_only=True)
    assert saved["mean"] == pytest.approx([0.485, 0.456, 0.406])  # the starting point's ImageNet normalisation
    report = (out / "report.md").read_text()
    assert "Starting point" in report and "linear-probe" in report
    challenge = json.loads((out / "eval_trained" / "challenge.json").read_text())
    assert f"| {challenge['challenge_accuracy']:.2f}% |" in report.split("**Challenge accuracy**")[1].splitlines()[0]
    # the 1000-class start was evaluated too, through the ImageNet -> IN-9 map
    assert in9_results(out / "eval_start")["provenance"]["num_classes"] == 1000


def _train_command(data: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "--data-path", str(data), "--weights", "none", "--output-dir",
            str(out), "--method", "bg-swap", "mixup", "--swa", "--swa-start-epoch", "2", "--epochs", "4",
            "--batch-size", "2", *TINY, *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_kill_9_then_resume_equals_the_uninterrupted_run(tiny, tmp_path, capsys, one_thread):
    """Only the killed run is a process of its own (one thread, as this process under `one_thread`); the
    uninterrupted run and the resumed one run train.py's main here."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run_train(_train_command(tiny, whole)[2:], capsys)[0] == 0
    process = subprocess.Popen(_train_command(tiny, killed, "--save-every", "1"), env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, deadline = killed / STATE_NAME, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:  # kill once a mid-run state exists (36 steps in all)
            if state.is_file() and torch.load(state, weights_only=True)["step"] >= 5:
                break
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (killed / CHECKPOINT_NAME).exists(), "the run finished before it was killed"
    interrupted_at = torch.load(state, weights_only=True)["step"]
    assert 5 <= interrupted_at < 36
    assert run_train(_train_command(tiny, killed, "--resume")[2:], capsys)[0] == 0
    a, b = weights(whole / CHECKPOINT_NAME), weights(killed / CHECKPOINT_NAME)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (killed / "train_log.jsonl").read_text().splitlines()
             if "loss" in line]
    assert steps == list(range(1, 37))  # the log, too, reads as one run


@pytest.mark.slow
def test_two_gloo_processes_equal_one(tiny, tmp_path, capsys, one_thread):
    # SmallCNN has no BatchNorm, so the per-process batches see the same normalisation as the whole batch.
    common = ["--method", "bg-swap", "--epochs", "2", "--batch-size", "6", "--lr", "0.01"]
    single, double = tmp_path / "one", tmp_path / "two"
    # one DataLoader worker per process: decoding in other processes must not change a batch either
    script = [str(REPO / "train.py"), "--data-path", str(tiny), "--weights", "none", *common, *TINY, "--workers", "1"]
    # the one-process reference in this process (one thread, as each torchrun process)
    assert run_train([*script[1:], "--output-dir", single], capsys)[0] == 0
    result = collective_guard.launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                      "2", "-m", "tests.collective_guard", *script, "--output-dir", str(double),
                                      "--eval-data", str(tiny), "--eval-challenge"], env=_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    # rank 0 evaluates alone after training: the report is written, and no process waits in a collective
    assert f"report: {double / 'report.md'}" in result.stdout and (double / "report.md").is_file()
    # each process took its half of every global batch: 3 + 3 images per step, 6 in all
    log = [json.loads(line) for line in (double / "train_log.jsonl").read_text().splitlines() if "loss" in line]
    assert [r["images"] for r in log] == [6] * 6
    a, b = weights(single / CHECKPOINT_NAME), weights(double / CHECKPOINT_NAME)
    # AdamW divides by the root of the squared gradients' average, which scales the summation order's rounding
    # in a near-zero gradient up: a few weights of the 4,608 move by up to about 1e-5 (the logged losses agree)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=2e-5)


def _recorded_draws(data: Path, out: Path) -> dict:
    """One epoch of mixup training (in this process, or as a rank of the group its environment names), with each
    step's random draws recorded: the mask a Dropout(0.5) over 64 features would draw first in the forward pass,
    and the smaller of the mixed targets' two weights (MixUp's λ or 1 - λ)."""
    masks, mixing = [], []
    step = loop.training_step

    def recording(model, images, targets, *rest):
        with torch.random.fork_rng(devices=[]):
            masks.append(torch.nn.functional.dropout(torch.ones(64), 0.5) > 0)
        mixed = targets[(targets > 0).sum(1) == 2]  # images mixed with one of another class
        mixing.append(round(float(mixed.min()), 6) if len(mixed) else None)
        return step(model, images, targets, *rest)

    loop.training_step = recording
    try:
        loop.train(TrainConfig(data, out, methods=[Method.MIXUP], arch=SMALL_CNN, weights="none", batch_size=6,
                               device="cpu", workers=0, progress=False))
    finally:
        loop.training_step = step
    return {"masks": torch.stack(masks), "mixing": mixing}


@pytest.mark.slow
def test_each_process_draws_its_own_dropout_masks_and_the_one_process_mixing(tiny, tmp_path, one_thread):
    one = _recorded_draws(tiny, tmp_path / "one")
    ranks = run_in_processes(_recorded_draws, 2, tmp_path, tiny, tmp_path / "two")
    assert len(one["mixing"]) == 3 and all(len(r["mixing"]) == 3 for r in ranks)  # 18 images, 6 per step
    for step in range(3):  # dropout: a mask for each process's share of the batch
        assert not torch.equal(ranks[0]["masks"][step], ranks[1]["masks"][step]), f"step {step}: the same masks"
    # MixUp's λ (CutMix's box likewise): one draw per global batch, in every process the one-process run's
    assert None not in one["mixing"] and ranks[0]["mixing"] == ranks[1]["mixing"] == one["mixing"]


def _batch_norm_after_swa(batches: list[torch.Tensor], world_size: int) -> dict:
    """SWA's finish (update_bn) over this process's share of each batch, for a convolution + BatchNorm model
    built alike everywhere; the BatchNorm statistics it leaves."""
    rank = distributed.setup(torch.device("cpu")).rank
    torch.manual_seed(0)
    config = TrainConfig(Path("data"), Path("out"), swa=True, epochs=2)
    config.settle(torch.device("cpu"))  # the batch size and learning rate, as train() decides them
    averaging = WeightAveraging(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), config, len(batches))
    norm = averaging.finish(iter([b[rank::world_size] for b in batches]), torch.device("cpu"))[1]
    return {"mean": norm.running_mean.clone(), "var": norm.running_var.clone()}


def test_swa_batch_norm_statistics_come_from_every_process(tmp_path, one_thread):
    batches = list(torch.rand(3, 6, 3, 5, 5, generator=torch.Generator().manual_seed(1)))
    one = _batch_norm_after_swa(batches, 1)
    ranks = run_in_processes(_batch_norm_after_swa, 2, tmp_path, batches, 2)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 1)
    with torch.no_grad():  # brute force: every process's share of every batch, through the convolution
        shares = [conv(b[r::2]) for b in batches for r in range(2)]
    share_means = torch.stack([s.mean((0, 2, 3)) for s in shares]).mean(0)
    share_vars = torch.stack([s.var((0, 2, 3)) for s in shares]).mean(0)
    for rank, stats in enumerate(ranks):
        torch.testing.assert_close(stats["mean"], share_means, msg=f"rank {rank}")
        torch.testing.assert_close(stats["var"], share_vars, msg=f"rank {rank}")
    torch.testing.assert_close(ranks[0]["mean"], one["mean"])  # the means are the one-process run's


def test_ranks_share_out_exactly_the_one_process_batches():
    from tools.training.data import StepSampler  # noqa: PLC0415
    whole = list(StepSampler(23, 6, seed=1, epoch=2))
    assert len(whole) == 3 and all(len(b) == 6 for b in whole)  # 23 // 6 steps, the rest dropped
    shards = [list(StepSampler(23, 6, seed=1, epoch=2, rank=r, world_size=3)) for r in range(3)]
    for step, batch in enumerate(whole):
        assert sorted(i for shard in shards for i in shard[step]) == sorted(batch)
    assert list(StepSampler(23, 6, seed=1, epoch=2, start_step=1)) == whole[1:]  # resuming mid-epoch
    assert list(StepSampler(23, 6, seed=1, epoch=3)) != whole  # a new order every epoch


def test_one_sampler_over_the_run_gives_each_epoch_its_own_batches():
    from tools.training.data import StepSampler  # noqa: PLC0415
    for rank in range(2):
        per_epoch = [batch for epoch in range(2, 5)
                     for batch in StepSampler(23, 6, seed=1, epoch=epoch, start_step=1 if epoch == 2 else 0,
                                              rank=rank, world_size=2)]
        run = StepSampler(23, 6, seed=1, epoch=2, start_step=1, rank=rank, world_size=2, end_epoch=5)
        assert len(run) == len(per_epoch) == 8 and list(run) == per_epoch


def test_one_loader_with_workers_over_two_epochs_gives_the_per_epoch_batches(tiny, one_thread):
    """train() iterates one DataLoader (persistent workers) over the whole run; its batches are those of a
    fresh worker-less loader per epoch, as before."""
    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training.data import StepSampler, decoded_store, list_training_data, make_loader  # noqa: PLC0415
    config = TrainConfig(data_path=tiny, output_dir=tiny.parent / "unused", methods=[Method.BG_SWAP], batch_size=4,
                         seed=3, workers=2, progress=False)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 1, False)
    loader = make_loader(data, config, StepSampler(len(data), 4, 3, 0, 1, end_epoch=2), False, store)
    assert loader.persistent_workers
    run = list(loader)
    config.workers = 0
    before = [b for epoch in range(2)
              for b in make_loader(data, config, StepSampler(len(data), 4, 3, epoch, 1 if epoch == 0 else 0), False,
                                   store)]
    assert len(run) == len(before) == 7
    for a, b in zip(run, before):
        assert a.keys() == b.keys()
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_workers_give_way_where_shared_memory_is_short(tiny, tmp_path, monkeypatch, caplog):
    """A container's small /dev/shm cannot hold what DataLoader workers keep in flight (they would die of a bus
    error mid-run): the batches are then gathered in the training process, with one warning; elsewhere the
    workers asked for start. The batches are the same either way (test_one_loader_with_workers_...)."""
    import collections  # noqa: PLC0415

    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training import data as training_data  # noqa: PLC0415
    from tools.training.data import StepSampler, decoded_store, list_training_data, make_loader  # noqa: PLC0415
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(training_data, "SHARED_MEMORY", tmp_path)
    config = TrainConfig(tiny, tmp_path / "out", methods=[Method.BG_SWAP], batch_size=6, workers=2, progress=False)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 0, False)
    in_flight = 2 * 4 * 6 * (3 * 224 * 224 + 224 * 224 + 3 * 224 * 224)  # workers x prefetch x images x bytes
    for free, workers in [(64 << 20, 2), (2 * in_flight - 1, 0), (2 * in_flight, 2)]:
        monkeypatch.setattr(training_data.shutil, "disk_usage", lambda path, free=free: Usage(free, 0, free))
        caplog.clear()
        loader = make_loader(data, config, StepSampler(len(data), 6, 0, 0), False, store)
        assert loader.num_workers == workers
        assert ("gathering the batches in the training process" in caplog.text) == (workers == 0)
    monkeypatch.setattr(training_data, "SHARED_MEMORY", tmp_path / "none")  # no /dev/shm (macOS, Windows)
    loader = make_loader(data, config, StepSampler(len(data), 6, 0, 0), False, store)
    assert loader.num_workers == 2
    if sys.platform.startswith("linux"):  # forked, sharing the store, whatever Python's default (3.14: forkserver)
        assert loader.multiprocessing_context.get_start_method() == "fork"


def test_batch_size_and_learning_rate_defaults_per_device():
    """256 images a step on a CUDA GPU, 32 elsewhere; without --lr the peak rate is 0.001 x batch / 32, whether
    the batch is the device's default or given, and an explicit --lr is kept as given. The run's record holds
    the values decided. (The device is only named: settle decides the defaults from it, no GPU is needed.)"""
    from tools.training.config import build_parser, config_from_args  # noqa: PLC0415

    def settled(device: str, *flags: str) -> TrainConfig:
        config = config_from_args(build_parser().parse_args(["--data-path", "d", "--output-dir", "o", *flags]))
        config.settle(torch.device(device))
        return config

    for device, batch in (("cuda", 256), ("cpu", 32), ("mps", 32)):
        config = settled(device)
        assert (config.batch_size, config.lr) == (batch, 1e-3 * batch / 32)
        assert (config.to_record()["batch_size"], config.to_record()["lr"]) == (batch, 1e-3 * batch / 32)
        assert (settled(device, "--lr", "0.01").batch_size, settled(device, "--lr", "0.01").lr) == (batch, 0.01)
        # the same batch given explicitly: the same rate as the device's default batch
        assert settled(device, "--batch-size", str(batch)).lr == config.lr
    assert settled("cpu", "--batch-size", "256").lr == settled("cuda").lr == 0.008
    assert settled("cuda", "--batch-size", "64").lr == 0.002
    assert (settled("cuda", "--batch-size", "64", "--lr", "0.5").batch_size, settled("cpu", "--lr", "0.5").lr) == \
        (64, 0.5)
    config = TrainConfig(Path("d"), Path("o"))
    assert config.settle(torch.device("cuda")) == ("global batch 256 (the default on cuda), peak learning rate 0.008 "
                                                   "(0.001 x 256 / 32, scaled with the batch)")


def test_the_logged_rate_is_the_rate_each_step_used(tiny, tmp_path, capsys, one_thread):
    """train_log.jsonl (and the report's curves, which read it) give each step the rate its optimiser step used,
    as the optimiser saw it (a hook on every optimiser step): the warm-up's first rate first, the peak, and the
    cosine decay's last non-zero rate last; the start-up line says the batch and the rate."""
    used = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: used.append(optimizer.param_groups[0]["lr"]))
    try:
        out = tmp_path / "run"
        code, _, err = run_train(["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6,
                                  "--lr", 0.003, "--warmup-epochs", 1, "--output-dir", out, *TINY,
                                  "--log-level", "INFO"], capsys)
    finally:
        hook.remove()
    assert code == 0, err
    logged = [r["lr"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "lr" in r]
    peak = 0.003
    # 18 images, batch 6: 3 steps an epoch, 6 in all; a warm-up of 3 steps to the peak, then the cosine to 0
    expected = [peak / 3, peak * 2 / 3, peak, peak, peak * 0.75, peak * 0.25]
    assert used == pytest.approx(expected, rel=1e-12)
    assert logged == used
    assert "global batch 6 (--batch-size), peak learning rate 0.003 (--lr)" in err


def test_process_group_from_torchrun_environment(monkeypatch):
    from tools import distributed  # noqa: PLC0415
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.from_environment() == distributed.ProcessGroup(0, 1, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    group = distributed.from_environment()
    assert (group.rank, group.world_size, group.local_rank, group.is_main, group.distributed) == (5, 8, 1, False, True)
    assert group.device(torch.device("cuda")) == torch.device("cuda", 1)
    assert group.device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_channels_last_training_on_the_gpu_loads_on_the_cpu(tiny, tmp_path, capsys):
    out = tmp_path / "gpu"
    argv = ["--data-path", tiny, "--weights", "none", "--method", "bg-swap", "mixup", "--epochs", 2, "--batch-size", 6,
            "--channels-last", "--output-dir", out, *TINY, "--device", "cuda"]
    code, _, err = run_train(argv, capsys)
    assert code == 0, err
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert saved["train_args"]["precision"] is None  # the default: bf16 autocast on CUDA
    assert all(v.device.type == "cpu" and torch.isfinite(v).all() for v in saved["model"].values())


@pytest.mark.parametrize("float64", [True, False])
def test_batched_resized_crops_are_torchvisions_within_one_level(float64, monkeypatch):
    """One batched antialiased crop-and-resize (two matmuls with per-box weights) against torchvision's
    per-image resized_crop(antialias=True) on smooth and noisy images, boxes from downscales to upscales; with the
    weights in float64, and in float32 as on a device without float64 (MPS)."""
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415

    from tools.training import resample  # noqa: PLC0415
    from tools.training.draws import crop_boxes, epoch_uniforms  # noqa: PLC0415
    from tools.training.resample import resized_crops  # noqa: PLC0415

    if not float64:
        monkeypatch.setattr(resample, "NO_FLOAT64", frozenset({"cpu"}))

    gen = torch.Generator().manual_seed(0)
    noisy = torch.randint(0, 256, (6, 3, 224, 224), dtype=torch.uint8, generator=gen)
    smooth = nn.functional.avg_pool2d(noisy[:6].float(), 7, 1, 3).to(torch.uint8)
    images = torch.cat([noisy, smooth])
    boxes = crop_boxes(epoch_uniforms(0, 0, len(images)), 0.08)
    boxes[:4] = torch.tensor([[0, 0, 224, 224], [10, 20, 100, 50], [0, 150, 224, 74], [200, 0, 24, 224]])
    expected = torch.stack([F.resized_crop(image, *box.tolist(), [224, 224], antialias=True)
                            for image, box in zip(images, boxes)])
    difference = (resized_crops(images, boxes, 224).int() - expected.int()).abs()
    assert difference.max() <= 1
    assert (difference > 0).float().mean() < 0.3
    # the training store is channels-last: the same products in any layout
    assert torch.equal(resized_crops(images.contiguous(memory_format=torch.channels_last), boxes, 224),
                       resized_crops(images, boxes, 224))


def test_decoded_store_is_made_once_and_keyed_by_content(tmp_path, monkeypatch):
    """The second run on the same files reads the store back without decoding; changed bytes decode afresh; the
    store holds what Pillow decodes and the masks as loaded."""
    from tools.data import image_sets  # noqa: PLC0415
    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training import data as training_data  # noqa: PLC0415

    root = tmp_path / "d"
    synthetic.generate(root, per_class=2, seed=0, split="train")
    config = TrainConfig(data_path=root, output_dir=tmp_path / "o", methods=[Method.BG_SWAP], weights="none")
    records = training_data.list_training_data(config)
    first = training_data.decoded_store(records, fingerprint(root, records.relpaths(), 1), 1, False)
    assert torch.equal(first.images[3],
                       torch.from_numpy(image_sets.decode_rgb(root / records.images[3]).copy()).permute(2, 0, 1))
    assert torch.equal(first.masks[3], torch.from_numpy(image_sets.load_mask(root / records.masks[3])))
    assert torch.equal(first.backgrounds[5],
                       torch.from_numpy(image_sets.decode_rgb(root / records.backgrounds[5]).copy()).permute(2, 0, 1))

    def refuse(*args, **kwargs):
        raise AssertionError("decoded again")

    with monkeypatch.context() as patch:
        patch.setattr(image_sets, "decode_bytes", refuse)
        again = training_data.decoded_store(records, fingerprint(root, records.relpaths(), 1), 1, False)
    assert torch.equal(again.images, first.images) and torch.equal(again.masks, first.masks)
    shutil.copyfile(root / records.backgrounds[0], root / records.images[0])
    changed = training_data.decoded_store(records, fingerprint(root, records.relpaths(), 1), 1, False)
    assert torch.equal(changed.images[0], first.backgrounds[0])


def test_compile_runs_every_step_through_the_compiled_model(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """--compile: the model (not the loss or optimiser) goes through torch.compile, here with a backend that runs
    each graph as it is and counts it: one graph, every step through it, the same weights as an eager run, and
    a checkpoint with the plain model's keys. A resume state of a compiled run is refused by an eager resume."""
    graphs, calls, real_compile = [], [], torch.compile

    def backend(graph, example_inputs):
        graphs.append(tuple(example_inputs[0].shape) if example_inputs else ())

        def run(*args):
            calls.append(1)
            return graph.forward(*args)
        return run

    def counting_compile(model, **options):
        assert isinstance(model, nn.Module) and not isinstance(model, nn.CrossEntropyLoss)
        return real_compile(model, backend=backend, dynamic=options.get("dynamic"))

    monkeypatch.setattr(torch, "compile", counting_compile)
    torch._dynamo.reset()
    common = ["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6, "--lr", 0.01, *TINY]
    code, _, err = run_train([*common, "--output-dir", tmp_path / "eager"], capsys)
    assert code == 0, err
    assert not graphs  # without --compile nothing is compiled
    code, _, err = run_train([*common, "--compile", "--output-dir", tmp_path / "compiled"], capsys)
    assert code == 0, err
    assert len(graphs) == 1 and len(calls) == 6  # 18 images, batch 6: 3 steps x 2 epochs, one graph
    a, b = weights(tmp_path / "eager" / CHECKPOINT_NAME), weights(tmp_path / "compiled" / CHECKPOINT_NAME)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    saved = torch.load(tmp_path / "compiled" / CHECKPOINT_NAME, weights_only=True)
    assert saved["train_args"]["compile"] is True
    code, stdout, err = run_train([*common, "--output-dir", tmp_path / "compiled", "--resume"], capsys)
    assert code == 2 and "other settings" in err
    torch._dynamo.reset()
