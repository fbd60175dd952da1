"""What training must leave as it found it: the starting point the report evaluates (in9_eval.py on the starting
file gives the report's start column), the frozen parts of a linear probe or of an adapted model (their weights
and BatchNorm statistics), and a resume state that `torch.load(weights_only=True)` reads on every torch."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

import in9_eval
from tests.helpers import TINY, check_error, run_in_process, run_train, weights
from tools import cli
from tools.in9 import VARIATIONS
from tools.models.architectures import SMALL_CNN, build_architecture
from tools.provenance import WriteError
from tools.results.report import percent
from tools.training import loop
from tools.training.checkpoint import CHECKPOINT_NAME, STATE_NAME
from tools.training.config import TrainConfig

BATCH_NORM_ARCH = "mobilenet_v3_small"  # BatchNorm throughout, a dropout before its head, and cheap on the CPU


@pytest.fixture(scope="module")
def trained_start(tiny, tmp_path_factory):
    """A 9-class checkpoint that has learnt something (so its accuracies are not all 1 in 9), from train()."""
    out = tmp_path_factory.mktemp("trained_start")
    config = TrainConfig(data_path=tiny, weights="none", arch=SMALL_CNN, epochs=10, batch_size=6, lr=1e-2,
                         device="cpu", workers=0, progress=False, output_dir=out)
    return loop.train(config).checkpoint


@pytest.mark.parametrize("swa", [False, True], ids=["plain", "swa"])
@pytest.mark.slow
def test_report_start_column_is_in9_eval_on_the_starting_file(swa, trained_start, tiny, tmp_path, capsys, one_thread):
    before = trained_start.read_bytes()
    out = tmp_path / "run"
    code, _, err = run_train([*TINY, "--data-path", tiny, "--checkpoint", trained_start, "--method", "bg-swap",
                              "--epochs", 3, "--batch-size", 6, "--lr", 0.01, "--eval-data", tiny, "--output-dir", out,
                              *(["--swa", "--swa-start-epoch", 1] if swa else [])], capsys)
    assert code == 0, err
    assert trained_start.read_bytes() == before
    reference = tmp_path / "reference.json"
    code, _, err = run_in_process(
        in9_eval.main,
        ["--data-path", str(tiny), "--checkpoint", str(trained_start), "--eval-dataset", "all", "--device", "cpu",
         "--no-progress", "--results-file", str(reference), "--output-dir", str(tmp_path / "o")], capsys)
    assert code == 0, err
    expected = json.loads(reference.read_text())
    start = json.loads((out / "eval_start" / "in9.json").read_text())
    trained = json.loads((out / "eval_trained" / "in9.json").read_text())
    assert any(trained[name]["correct"] != expected[name]["correct"] for name in VARIATIONS), \
        "training changed no accuracy, so this run cannot tell the starting point from the trained model"
    for name in VARIATIONS:
        assert start[name]["confusion"] == expected[name]["confusion"], name
    assert start["bg_gap"] == expected["bg_gap"]
    report = (out / "report.md").read_text()
    start_column = {line.split(" | ")[0].strip("| `"): line.split(" | ")[1]
                    for line in report.splitlines() if line.startswith("| `")}
    assert start_column == {name: percent(expected[name]["accuracy"]) for name in VARIATIONS}
    assert f"| **BG-gap** (points) | {expected['bg_gap']:.2f} |" in report


@pytest.fixture(scope="module")
def batch_norm_start(tmp_path_factory):
    """A 9-class MobileNetV3-Small state dict whose BatchNorm statistics are not the initial zeros and ones."""
    torch.manual_seed(12)
    model = build_architecture(BATCH_NORM_ARCH, 9).train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.rand(8, 3, 224, 224))
    path = tmp_path_factory.mktemp("bn_start") / "mobilenet9.pth"
    torch.save(model.state_dict(), path)
    return path


HEAD = {"classifier.3.weight", "classifier.3.bias"}
ADAPTED = ["features.12.0", "classifier.0"]  # a 1x1 convolution (bias-free) and a linear module (with a bias)
FROZEN_CASES = {
    "linear-probe": (["--freeze", "backbone"], HEAD),
    "linear-probe+swa": (["--freeze", "backbone", "--swa", "--swa-start-epoch", "1"], HEAD),
    "lora": (["--peft", "lora", "--lora-rank", "2", "--peft-modules", *ADAPTED],
             HEAD | {f"{name}.weight" for name in ADAPTED}),  # merged adapters change weights, never biases
    "oft": (["--peft", "oft", "--oft-block-size", "4", "--peft-modules", *ADAPTED],
            HEAD | {f"{name}.weight" for name in ADAPTED}),
}


@pytest.mark.parametrize("case", sorted(FROZEN_CASES))
@pytest.mark.slow
def test_only_the_trained_tensors_move_and_frozen_batch_norm_keeps_its_statistics(case, batch_norm_start, tiny,
                                                                                  tmp_path, capsys, one_thread):
    flags, should_move = FROZEN_CASES[case]
    if "--peft" in flags:
        pytest.importorskip("peft")
    out = tmp_path / "run"
    code, _, err = run_train([*TINY, "--data-path", tiny, "--arch", BATCH_NORM_ARCH, "--checkpoint", batch_norm_start,
                              "--epochs", 2, "--batch-size", 6, "--lr", 0.01, "--output-dir", out, *flags], capsys)
    assert code == 0, err
    start, trained = torch.load(batch_norm_start, weights_only=True), weights(out / CHECKPOINT_NAME)
    assert sorted(trained) == sorted(start)
    moved = {key for key in start if not torch.equal(trained[key], start[key])}
    assert moved == should_move


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.drop = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.norm(self.conv(x)))


class _Net(nn.Module):
    """A frozen block (convolution, BatchNorm, dropout), then a dropout and a linear head of its own."""

    def __init__(self):
        super().__init__()
        self.block, self.pool, self.drop, self.fc = _Block(), nn.AdaptiveAvgPool2d(1), nn.Dropout(0.5), nn.Linear(4, 9)

    def forward(self, x):
        return self.fc(self.drop(self.pool(self.block(x)).flatten(1)))


def test_frozen_modules_run_as_at_evaluation_whatever_train_is_called_on():
    from torch.optim.swa_utils import AveragedModel  # noqa: PLC0415

    from tools.training.adapters import TrainingModel  # noqa: PLC0415
    net = _Net()
    net.block.requires_grad_(False)
    model = TrainingModel(net, (0.5,) * 3, (0.25,) * 3)
    averaged = AveragedModel(model)  # SWA's copy
    for outer, inner in ((model, model), (nn.Sequential(model), model), (averaged, averaged.module)):  # as DDP wraps
        outer.train()
        frozen = inner.classifier.block
        assert not frozen.training and not frozen.norm.training and not frozen.drop.training
        assert inner.training and inner.classifier.training
        assert inner.classifier.drop.training and inner.classifier.fc.training  # the head's dropout stays on
        outer.eval()
        assert not any(m.training for m in inner.modules())
    statistics = {k: v.clone() for k, v in net.block.norm.state_dict().items()}
    model.train()(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8))
    assert all(torch.equal(v, net.block.norm.state_dict()[k]) for k, v in statistics.items())


def interrupt_at_step(n: int, argv: list, capsys, monkeypatch) -> None:
    """train.py run with `argv` and stopped (as by Ctrl-C) at its n-th training step, leaving its resume state."""
    step, calls = loop.training_step, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "training_step", interrupted)
    code, _, err = run_train(argv, capsys)
    assert code == cli.EXIT_INTERRUPTED, err
    monkeypatch.setattr(loop, "training_step", step)


def test_swa_resume_reads_a_scheduler_state_holding_a_function_as_older_torch_saves_it(tiny, tmp_path, capsys,
                                                                                        monkeypatch, one_thread):
    """Before torch fixed it (Sept 2025), SWALR.state_dict() held its annealing function; the resume state is
    read with weights_only=True, which refuses functions. A run interrupted during its averaged epochs resumes
    and ends where the uninterrupted run does."""
    from torch.optim import swa_utils  # noqa: PLC0415
    data_only = swa_utils.SWALR.state_dict

    def as_older_torch(self):
        return {**data_only(self), "anneal_func": swa_utils.SWALR._cosine_anneal}

    monkeypatch.setattr(swa_utils.SWALR, "state_dict", as_older_torch)
    common = ["--data-path", tiny, "--weights", "none", "--epochs", 3, "--batch-size", 6,
              "--swa", "--swa-start-epoch", 1, "--save-every", 1, *TINY]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    code, _, err = run_train([*common, "--output-dir", whole], capsys)
    assert code == 0, err
    interrupt_at_step(6, [*common, "--output-dir", resumed], capsys, monkeypatch)  # 3rd of the 1st averaged epoch
    code, _, err = run_train([*common, "--output-dir", resumed, "--resume"], capsys)
    assert code == 0, err
    a, b = weights(whole / CHECKPOINT_NAME), weights(resumed / CHECKPOINT_NAME)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_state_holding_a_function_is_one_error_line(tiny, tmp_path, capsys, one_thread):
    """One left by an earlier version of this toolkit under an older torch: refused, not a traceback."""
    from torch.optim import swa_utils  # noqa: PLC0415
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"step": 3, "swa": {"scheduler": {"anneal_func": swa_utils.SWALR._cosine_anneal}}}, out / STATE_NAME)
    code, stdout, err = run_train([*TINY, "--data-path", tiny, "--weights", "none", "--batch-size", 6,
                                   "--output-dir", out, "--resume"], capsys)
    line = check_error(code, stdout, err, lines=None)
    assert str(out / STATE_NAME) in line and "rerun without --resume" in line


def test_a_log_line_cut_short_is_dropped_on_resume(tmp_path):
    """A kill during an append leaves half a line at the end of train_log.jsonl: a resume drops it (and the
    steps past the resumed one) instead of failing to parse it."""
    from tools.training.loop import JsonLog  # noqa: PLC0415

    path = tmp_path / "train_log.jsonl"
    lines = [json.dumps({"step": 1, "loss": 2.0}), json.dumps({"step": 2, "loss": 1.5}),
             json.dumps({"step": 2, "event": "epoch_end"}), json.dumps({"step": 3, "loss": 1.2})]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')
    JsonLog(path, True, resume_step=2)
    assert path.read_text().splitlines() == lines[:3]


@pytest.mark.parametrize("missing", [("start",), ("start", "precision")])
def test_a_state_saved_before_the_key_held_the_precision_resumes(missing, tiny, tmp_path, capsys, monkeypatch,
                                                                 one_thread):
    """Resume keys name the precision that ran since it may differ from the one asked for, and the starting
    model's identity; a state saved by a version before, whose key has neither (or no starting model), resumes
    where that version's default is the precision that runs now (fp32 on the CPU) and ends where the
    uninterrupted run does."""
    common = ["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6, "--save-every", 1, *TINY]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    code, _, err = run_train([*common, "--output-dir", whole], capsys)
    assert code == 0, err
    interrupt_at_step(4, [*common, "--output-dir", resumed], capsys, monkeypatch)
    state = torch.load(resumed / STATE_NAME, weights_only=True)
    popped = {key: state["run_key"].pop(key) for key in missing}
    assert popped == {key: {"start": None, "precision": "fp32"}[key] for key in missing}
    torch.save(state, resumed / STATE_NAME)  # as a version before wrote it
    code, _, err = run_train([*common, "--output-dir", resumed, "--resume"], capsys)
    assert code == 0, err
    a, b = weights(whole / CHECKPOINT_NAME), weights(resumed / CHECKPOINT_NAME)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_state_of_another_starting_model_is_refused(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """The starting checkpoint rewritten in place between a run and its --resume: the saved state is of training
    another model, and the run's evaluation of its starting point would be of this one; refused in one line."""
    start = tmp_path / "start.pt"
    torch.save(build_architecture(SMALL_CNN, 9).state_dict(), start)
    common = ["--data-path", tiny, "--checkpoint", start, "--epochs", 2, "--batch-size", 6, "--save-every", 1, *TINY]
    interrupt_at_step(4, [*common, "--output-dir", tmp_path / "run"], capsys, monkeypatch)
    torch.save(build_architecture(SMALL_CNN, 9).state_dict(), start)  # other random weights, the same path
    code, out, err = run_train([*common, "--output-dir", tmp_path / "run", "--resume"], capsys)
    assert "starting model" in check_error(code, out, err, lines=None)


def test_a_state_saved_with_the_per_sample_draws_is_refused(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """The epoch's draws changed (one table per epoch, not a generator per sample): a state saved by the version
    that drew per sample (its key names no draws) would go on with other crops and swaps than it began with, a
    run equal to no uninterrupted one; it is refused in one line."""
    common = ["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6, "--save-every", 1, *TINY]
    resumed = tmp_path / "resumed"
    interrupt_at_step(4, [*common, "--output-dir", resumed], capsys, monkeypatch)
    state = torch.load(resumed / STATE_NAME, weights_only=True)
    state["run_key"].pop("draws", None)
    torch.save(state, resumed / STATE_NAME)  # as the version before wrote it
    code, _, err = run_train([*common, "--output-dir", resumed, "--resume"], capsys)
    assert code == 2 and "other settings" in err, err


def test_a_run_hashes_its_files_once(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """The run's fingerprint and the decoded-data cache's keys come from one read of the files: the cache is given
    the hashes listing made, not left to read every file again."""
    from tools.data import image_sets  # noqa: PLC0415

    def again(*args, **kwargs):
        raise AssertionError("the files were hashed a second time")

    monkeypatch.setattr(image_sets, "read_and_fingerprint", again)  # decoding hashes only where not given hashes
    code, _, err = run_train(["--data-path", tiny, "--weights", "none", "--epochs", 1, "--batch-size", 6, *TINY,
                              "--output-dir", tmp_path / "out"], capsys)
    assert code == 0, err


def test_the_loop_goes_on_while_the_resume_state_is_written(tiny, tmp_path, monkeypatch, one_thread):
    """A slow write of the resume state (step 2 of 3) does not hold the loop: step 3 runs to its end while the
    write is in flight, and the file written holds the weights as they were at the save, not as step 3 left them."""
    save, step, seen = torch.save, loop.training_step, {}
    stepped = threading.Event()

    def counted_step(model, *args, **kwargs):
        seen["calls"] = seen.get("calls", 0) + 1
        if seen["calls"] == 3:
            seen["at_save"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result = step(model, *args, **kwargs)
        if seen["calls"] == 3:
            stepped.set()
        return result

    def slow_save(payload, fh, *args, **kwargs):
        if isinstance(payload, dict) and payload.get("step") == 2:
            seen["went_on"] = stepped.wait(timeout=10)  # the old loop waited here for the write: no step 3
            seen["written"] = payload["model"]
        return save(payload, fh, *args, **kwargs)

    monkeypatch.setattr(loop, "training_step", counted_step)
    monkeypatch.setattr(torch, "save", slow_save)
    config = TrainConfig(data_path=tiny, weights="none", arch=SMALL_CNN, epochs=1, batch_size=6, lr=1e-2,
                         device="cpu", workers=0, progress=False, output_dir=tmp_path, save_every=2)
    result = loop.train(config)
    assert seen["went_on"], "the loop waited for the write of the resume state"
    assert seen["written"].keys() == seen["at_save"].keys()
    assert all(torch.equal(seen["written"][k], v) for k, v in seen["at_save"].items())
    assert result.steps == 3 and torch.load(tmp_path / STATE_NAME, weights_only=True)["step"] == 3


def test_a_failed_write_of_the_resume_state_is_one_error(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """The writer thread's error reaches train()'s caller, once and as itself (train.py: one error line, exit 2);
    no writer is left running."""
    import logging  # noqa: PLC0415

    # a handler an earlier in-process run left on the root logger may hold a stream pytest has closed since: its
    # "--- Logging error ---" report would be this test's stderr
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    save = torch.save

    def full_disk(payload, fh, *args, **kwargs):
        if isinstance(payload, dict) and "run_key" in payload:
            raise OSError(28, "No space left on device")
        return save(payload, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    config = TrainConfig(data_path=tiny, weights="none", arch=SMALL_CNN, epochs=2, batch_size=6, lr=1e-2,
                         device="cpu", workers=0, progress=False, output_dir=tmp_path / "direct", save_every=1)
    with pytest.raises(WriteError, match="No space left") as failure:
        loop.train(config)
    assert type(failure.value.__context__) is OSError  # the disk's error only, not one error raised over another
    assert not any(t.name == "checkpoint-writer" for t in threading.enumerate())
    out = tmp_path / "script"
    code, stdout, err = run_train([*TINY, "--data-path", tiny, "--weights", "none", "--batch-size", 6,
                                   "--save-every", 1, "--output-dir", out], capsys)
    line = check_error(code, stdout, err)
    assert f"cannot write {out / STATE_NAME}: No space left on device" in line
    assert not (out / STATE_NAME).exists() and not (out / CHECKPOINT_NAME).exists()
