"""What training must leave as it found it: the starting point the report evaluates (in9_eval.py on the starting
file gives the report's start column), the frozen parts of a linear probe or of an adapted model (their weights
and BatchNorm statistics), and a resume state that `torch.load(weights_only=True)` reads on every torch."""

from __future__ import annotations

import pytest
import torch

from test_bad_input import check_error
from test_train import TINY, run_train, tiny, weights  # noqa: F401 (tiny is a fixture)
from tools import cli
from tools.training import loop
from tools.training.checkpoint import CHECKPOINT_NAME, STATE_NAME



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
