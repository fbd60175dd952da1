"""What training must leave as it found it: the starting point the report evaluates (in9_eval.py on the starting
file gives the report's start column), the frozen parts of a linear probe or of an adapted model (their weights
and BatchNorm statistics), and a resume state that `torch.load(weights_only=True)` reads on every torch."""

from __future__ import annotations

import json

import pytest
import torch

import in9_eval
from conftest import run_in_process
from test_bad_input import check_error
from test_train import TINY, run_train, tiny, weights  # noqa: F401 (tiny is a fixture)
from tools import cli
from tools.in9 import VARIATIONS
from tools.models import SMALL_CNN
from tools.report import percent
from tools.training import loop
from tools.training.checkpoint import CHECKPOINT_NAME, STATE_NAME
from tools.training.config import TrainConfig


@pytest.fixture(scope="module")
def trained_start(tiny, tmp_path_factory):
    """A 9-class checkpoint that has learnt something (so its accuracies are not all 1 in 9), from train()."""
    out = tmp_path_factory.mktemp("trained_start")
    config = TrainConfig(data_path=tiny, weights="none", arch=SMALL_CNN, epochs=10, batch_size=6, lr=1e-2,
                         device="cpu", workers=0, progress=False, output_dir=out)
    return loop.train(config).checkpoint


@pytest.mark.parametrize("swa", [False, True], ids=["plain", "swa"])
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
        lambda a: cli.run_main(in9_eval.build_parser(), in9_eval.main, a),
        ["--data-path", str(tiny), "--checkpoint", str(trained_start), "--eval-dataset", "all", "--device", "cpu",
         "--no-progress", "--results-file", str(reference)], capsys)
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


def test_swa_resume_reads_a_scheduler_state_holding_a_function_as_older_torch_saves_it(tiny, tmp_path, capsys,
                                                                                        monkeypatch, one_thread):
    """Before torch fixed it (Sept 2025), SWALR.state_dict() held its annealing function; the resume state is
    read with weights_only=True, which refuses functions. A run interrupted during its averaged epochs resumes
    and ends where the uninterrupted run does."""
    from torch.optim import swa_utils
    data_only = swa_utils.SWALR.state_dict

    def as_older_torch(self):
        return {**data_only(self), "anneal_func": swa_utils.SWALR._cosine_anneal}

    monkeypatch.setattr(swa_utils.SWALR, "state_dict", as_older_torch)
    common = ["--data-path", tiny, "--weights", "none", "--epochs", 3, "--batch-size", 6,
              "--swa", "--swa-start-epoch", 1, "--save-every", 1, *TINY]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    code, _, err = run_train([*common, "--output-dir", whole], capsys)
    assert code == 0, err
    step = loop.training_step
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # the third step of the first averaged epoch (3 steps an epoch)
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(loop, "training_step", interrupted)
    code, _, err = run_train([*common, "--output-dir", resumed], capsys)
    assert code == cli.EXIT_INTERRUPTED, err
    monkeypatch.setattr(loop, "training_step", step)
    code, _, err = run_train([*common, "--output-dir", resumed, "--resume"], capsys)
    assert code == 0, err
    a, b = weights(whole / CHECKPOINT_NAME), weights(resumed / CHECKPOINT_NAME)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_state_holding_a_function_is_one_error_line(tiny, tmp_path, capsys, one_thread):
    """One left by an earlier version of this toolkit under an older torch: refused, not a traceback."""
    from torch.optim import swa_utils
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"step": 3, "swa": {"scheduler": {"anneal_func": swa_utils.SWALR._cosine_anneal}}}, out / STATE_NAME)
    code, stdout, err = run_train([*TINY, "--data-path", tiny, "--weights", "none", "--batch-size", 6,
                                   "--output-dir", out, "--resume"], capsys)
    line = check_error(code, stdout, err, lines=None)
    assert str(out / STATE_NAME) in line and "rerun without --resume" in line
