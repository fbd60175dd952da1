"""Progress bars in a log are lines: where standard error is not a terminal, a bar writes a whole line when it
starts, now and then, and when it ends, never a carriage return; on a terminal it is tqdm's bar. Every bar of
the toolkit is made in one place, tools.progress."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

import in9_eval
from tests.helpers import run_in_process
from tools import progress
from tools.data import synthetic
from tools.models.architectures import SMALL_CNN, SmallCNN

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_bar_is_a_line_at_its_start_and_its_end(monkeypatch):
    log = io.StringIO()
    with progress.progress_bar(total=1000, desc="evaluating", unit="img", file=log, dynamic_ncols=True) as bar:
        for _ in range(1000):
            bar.update(1)
        bar.set_postfix(acc="50%")  # a refresh outside the interval writes nothing
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert len(lines) == 2, lines  # within the interval (30 s): the start and the end
    assert lines[0].startswith("evaluating:   0%") and "0/1000" in lines[0]
    assert lines[1].startswith("evaluating: 100%") and "1000/1000" in lines[1] and "acc=50%" in lines[1]


def test_in_a_log_a_long_bar_writes_a_line_per_interval_and_a_transient_one_its_last(monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)  # every display is due
    log = io.StringIO()
    for _ in progress.progress_bar(range(5), desc="hashing", file=log, leave=False):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("hashing:   0%") and lines[-1].startswith("hashing: 100%") and "5/5" in lines[-1]
    assert 2 <= len(lines) <= 7


def test_on_a_terminal_a_bar_is_tqdms_own():
    screen = Terminal()
    with progress.progress_bar(total=3, desc="evaluating", file=screen) as bar:
        bar.update(3)
    assert type(bar) is tqdm and "\r" in screen.getvalue()
    assert isinstance(progress.progress_bar(total=1, file=io.StringIO(), disable=True), progress.LogLines)


@pytest.mark.slow
def test_an_evaluation_logged_to_a_file_writes_lines(tmp_path, capsys, one_thread):
    """in9_eval.py with its bars on and standard error captured (not a terminal): every line of standard error
    is a short, whole line; the demo's log was one line of 19,731 characters, carriage returns between bars."""
    data = synthetic.generate(tmp_path / "in9", per_class=2, seed=1).root
    torch.manual_seed(0)
    torch.save(SmallCNN(9).state_dict(), tmp_path / "model.pth")
    code, _, err = run_in_process(in9_eval.main, ["--data-path", str(data), "--arch", SMALL_CNN, "--checkpoint",
                                                  str(tmp_path / "model.pth"), "--eval-dataset", "all", "--device",
                                                  "cpu", "--no-cache", "--output-dir", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert "\r" not in err
    bars = [line for line in err.splitlines() if line.startswith("evaluating:")]
    assert bars and bars[-1].startswith("evaluating: 100%")
    assert max(len(line) for line in err.splitlines()) < 200


@pytest.mark.slow
def test_the_challenges_search_bar_ends_at_its_total(tmp_path, capsys, one_thread):
    """The search's last line counts every foreground: those found robust by the last round (their backgrounds all
    tried) were left out of it, so a finished search's log ended at, say, "searching:  89%| 16/18"."""
    import challenge_eval  # noqa: PLC0415
    data = synthetic.generate(tmp_path / "in9", per_class=2, seed=1).root
    torch.manual_seed(0)
    torch.save(SmallCNN(9).state_dict(), tmp_path / "model.pth")
    results = tmp_path / "challenge.json"
    code, _, err = run_in_process(challenge_eval.main, ["--data-path", str(data), "--arch", SMALL_CNN, "--checkpoint",
                                                        str(tmp_path / "model.pth"), "--device", "cpu", "--no-cache",
                                                        "--output-dir", str(tmp_path / "out"), "--results-file",
                                                        str(results)], capsys)
    assert code == 0, err
    found = json.loads(results.read_text())
    assert 0 < found["vulnerable"] < found["total"]  # some foregrounds are robust
    bars = [line for line in err.splitlines() if line.startswith("searching:")]
    total = found["total"]
    assert bars and bars[-1].startswith("searching: 100%") and f" {total}/{total} " in bars[-1], bars


def test_every_bar_of_the_toolkit_is_made_by_progress_bar():
    """No module of tools/ but tools/progress.py imports tqdm's bar (cli.py's logging redirect aside)."""
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in ("tqdm", "tqdm.auto", "tqdm.std"):
                offenders.append(path.relative_to(ROOT).as_posix())
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tqdm" for a in node.names):
                offenders.append(path.relative_to(ROOT).as_posix())
    assert offenders == ["tools/progress.py"], offenders
