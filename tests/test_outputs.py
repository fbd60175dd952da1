"""Every output path is checked before any work; outputs are written whole or not at all; a write that fails
late keeps what was computed; SIGTERM is handled like Ctrl-C; the decoded-data cache leaves no temporaries."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import challenge_eval
import in9_eval
import train
from tests.helpers import run_in_process, save_torchscript
from tools import challenge, merge, prepared_run, zoo
from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge
from tools.data import cli as data_cli
from tools.data import store, synthetic
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.sources import load_model
from tools.results import analysis, leaderboard, publish, report
from tools.results.matrix import write_matrix
from tools.results.publish import publish_in9
from tools.results.report import cli as report_cli
from tools.runtime import Runtime
from tools.training.checkpoint import STATE_NAME, save_atomic

REPO = Path(__file__).resolve().parents[1]
CPU = Runtime(torch.device("cpu"))


def one_error_line(code: int, err: str) -> str:
    """Exit code 2 and exactly one stderr line, `error: ...`, with no traceback; returns it."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ----------------------------------------------------------------------------------------------------------
# Every command with an impossible output path: one error line, exit 2, before any model or data

COMMANDS = {
    "in9_eval": (in9_eval.main, ["--data-path", "{missing}/data", "--checkpoint", "{missing}/model.pt",
                                 "--device", "cpu", "--output-dir", "{tmp}/out"]),
    "challenge_eval": (challenge_eval.main, ["--data-path", "{missing}/data", "--checkpoint",
                                             "{missing}/model.pt", "--device", "cpu", "--output-dir", "{tmp}/out"]),
    "train": (train.main, ["--data-path", "{missing}/data", "--arch", "resnet18", "--weights", "none",
                           "--device", "cpu"]),
    "tools.zoo": (zoo.main, ["--models", "file:{missing}/model.pt", "--data-path", "{missing}/data",
                             "--device", "cpu"]),
    "tools.merge": (merge.main, ["{missing}/shards"]),
    "tools.results.report": (report_cli.main, ["--in9", "{missing}/in9.json"]),
    "tools.data build": (data_cli.main, ["build", "--images", "{missing}/images", "--boxes", "{missing}/boxes.csv"]),
}

# (command, output flag, what is impossible about it)
CASES = [
    ("in9_eval", "--results-file", "under a file"), ("in9_eval", "--results-file", "a folder"),
    ("in9_eval", "--report", "under a file"), ("in9_eval", "--output-dir", "a file"),
    ("challenge_eval", "--results-file", "a folder"), ("challenge_eval", "--per-foreground-csv", "a folder"),
    ("challenge_eval", "--report", "under a file"), ("challenge_eval", "--output-dir", "a file"),
    ("train", "--output-dir", "under a file"), ("train", "--output-dir", "a file"),
    ("tools.zoo", "--output-dir", "a file"), ("tools.zoo", "--output-dir", "under a file"),
    ("tools.zoo", "--leaderboard-only", "a file"),
    ("tools.merge", "--results-file", "under a file"), ("tools.merge", "--output-dir", "a file"),
    ("tools.merge", "--per-foreground-csv", "a folder"), ("tools.merge", "--report", "a folder"),
    ("tools.results.report", "--output", "a folder"), ("tools.results.report", "--output", "under a file"),
    ("in9_eval", "--html", "under a file"), ("challenge_eval", "--html", "a folder"),
    ("tools.merge", "--html", "a folder"), ("tools.results.report", "--html", "a folder"),
    ("tools.data build", "--out", "under a file"), ("tools.data build", "--out", "a file"),
]


@pytest.mark.parametrize("command, flag, impossible", CASES, ids=[f"{c}{f}-{i.replace(' ', '-')}" for c, f, i in CASES])
def test_impossible_output_path_is_refused_before_any_work(command, flag, impossible, tmp_path, capsys):
    """The inputs do not exist either: if the command read its data or built its model before checking the
    output path, the error would be about those instead."""
    main, argv = COMMANDS[command]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (tmp_path / "a-folder").mkdir()
    bad = {"under a file": blocker / "out", "a folder": tmp_path / "a-folder", "a file": blocker}[impossible]
    argv = [a.replace("{missing}", str(tmp_path / "missing")).replace("{tmp}", str(tmp_path)) for a in argv]
    if flag in argv:
        argv[argv.index(flag) + 1] = str(bad)
    else:
        argv += [flag, str(bad)]
    code, out, err = run_in_process(main, argv, capsys)
    line = one_error_line(code, err)
    assert flag in line and str(bad) in line, line
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder"]  # nothing made, nothing left


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run_in_process(report_cli.main, ["--in9", str(tmp_path / "absent.json"), "--output",
                                                    str(locked / "sub" / "report.md")], capsys)
    finally:
        locked.chmod(0o700)
    assert "--output" in one_error_line(code, err)


OUTPUT_FLAG = {"in9_eval": "--results-file", "challenge_eval": "--results-file", "train": "--output-dir",
               "tools.zoo": "--output-dir", "tools.merge": "--results-file", "tools.results.report": "--output",
               "tools.data build": "--out"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_output_path_that_cannot_be_looked_at_is_one_error_line(command, tmp_path, capsys, monkeypatch):
    """Another user's private folder: stat itself is refused (EACCES; pathlib's exists/is_dir raise it on Python
    3.10-3.13). Root is never refused, so the refusal is simulated in Path.stat (which Python 3.10's pathlib
    reaches through an accessor bound to os.stat at import, so os.stat cannot be patched for it)."""
    locked = tmp_path / "locked"
    real_stat = Path.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(str(locked)):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    main, argv = COMMANDS[command]
    argv = [a.replace("{missing}", str(tmp_path / "missing")).replace("{tmp}", str(tmp_path)) for a in argv]
    flag, bad = OUTPUT_FLAG[command], locked / "sub" / "out"
    if flag in argv:
        argv[argv.index(flag) + 1] = str(bad)
    else:
        argv += [flag, str(bad)]
    code, _, err = run_in_process(main, argv, capsys)
    line = one_error_line(code, err)
    assert flag in line and "cannot be checked" in line, line


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    same = tmp_path / "results.json"
    code, _, err = run_in_process(merge.main, [str(tmp_path / "missing"), "--results-file", str(same), "--report",
                                               str(same)], capsys)
    line = one_error_line(code, err)
    assert "--results-file" in line and "--report" in line and str(same) in line


# ----------------------------------------------------------------------------------------------------------
# A write that fails late (a full disk, a folder gone) is one line, and keeps what is already computed

@pytest.mark.parametrize("lost", ["per-foreground csv", "results file"])
@pytest.mark.slow
def test_a_late_write_failure_keeps_the_other_outputs(lost, dataset, color_ts, tmp_path, capsys, monkeypatch,
                                                      one_thread):
    """The folder of one output becomes a file while the challenge runs: the other output is still written, and
    the failure is one line naming the lost file and how to go on."""
    outputs = {"per-foreground csv": tmp_path / "tables" / "per_fg.csv",
               "results file": tmp_path / "results" / "challenge.json"}
    real = prepared_run.run_challenge

    def run_then_block(*args, **kwargs):
        result = real(*args, **kwargs)
        outputs[lost].parent.write_text("the folder is gone")
        return result

    monkeypatch.setattr(prepared_run, "run_challenge", run_then_block)
    argv = ["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device",
            "cpu", "--no-progress",
            "--no-cache", "--workers", "1", "--output-dir", str(tmp_path / "out"), "--per-foreground-csv",
            str(outputs["per-foreground csv"]), "--results-file", str(outputs["results file"]),
            "--log-level", "WARNING"]
    code, out, err = run_in_process(challenge_eval.main, argv, capsys)
    line = one_error_line(code, err)
    assert str(outputs[lost]) in line and "--resume" in line
    assert out.startswith("Summary: ") and "Challenge accuracy: " in out  # the numbers are printed all the same
    if lost == "per-foreground csv":
        results = json.loads(outputs["results file"].read_text())
        assert results["total"] == len(dataset.images) and 0 <= results["challenge_accuracy"] <= 100
    else:
        rows = outputs["per-foreground csv"].read_text().splitlines()
        assert rows[0].startswith("stem,class,vulnerable") and len(rows) == 1 + len(dataset.images)


def test_in9_accuracies_are_printed_when_the_results_file_cannot_be_written(dataset, color_ts, tmp_path, capsys,
                                                                           monkeypatch, one_thread):
    results = tmp_path / "results" / "in9.json"
    real = prepared_run.run_in9

    def run_then_block(*args, **kwargs):
        run = real(*args, **kwargs)
        results.parent.write_text("the folder is gone")
        return run

    monkeypatch.setattr(prepared_run, "run_in9", run_then_block)
    argv = ["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device",
            "cpu", "--no-progress",
            "--workers", "1", "--results-file", str(results), "--log-level", "WARNING", "--output-dir",
            str(tmp_path / "out")]
    code, out, err = run_in_process(in9_eval.main, argv, capsys)
    assert str(results) in one_error_line(code, err)
    assert out.startswith("Accuracy on original is ")


# ----------------------------------------------------------------------------------------------------------
# Outputs are written whole or not at all

@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writing past `limit` bytes of any file fails with EFBIG, as a full disk would, mid-file."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@pytest.fixture(scope="module")
def full_run(dataset, color_ts, tmp_path_factory):
    """A --full challenge result and an in9 `all` run on the generated data."""
    loaded = load_model(checkpoint=color_ts[9], trust=True)
    out = tmp_path_factory.mktemp("full-run")
    result = run_challenge(loaded, CPU, list_challenge_files(dataset.root, 1),
                           ChallengeConfig(full=True, progress=False, batch_size=64),
                           output_dir=out / "state", workers=1)
    in9 = run_in9(loaded, CPU, list_in9_files(dataset.root, VARIATIONS, 1),
                  In9Config(VARIATIONS, 64, 1, progress=False))
    return result, in9


WRITERS = {
    "report": lambda r, in9, folder, data: report.write_report(folder / "report.md", challenge=r.to_json()),
    "per-foreground csv": lambda r, in9, folder, data: r.write_per_foreground_csv(folder / "per_fg.csv"),
    "full matrix and index files": lambda r, in9, folder, data: write_matrix(folder, r, data, 9),
    "analysis files": lambda r, in9, folder, data: analysis.write_analysis(folder, data, 2),
    "analysis figure": lambda r, in9, folder, data: analysis.draw_top_backgrounds(
        analysis.analyze(analysis.load_matrix(folder), 2)[0], data, folder / "figure.png"),
    "in9 report": lambda r, in9, folder, data: publish_in9(in9, True, None, folder / "in9.md"),
    "leaderboard plot": lambda r, in9, folder, data: leaderboard.draw_plot(
        leaderboard.sort_rows(leaderboard.published_rows()), folder / "board.png"),
    "leaderboard": lambda r, in9, folder, data: leaderboard.build_leaderboard(folder),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.slow
def test_a_write_that_fails_midway_leaves_the_old_files(writer, full_run, dataset, tmp_path):
    result, in9 = full_run
    write = WRITERS[writer]
    write_matrix(tmp_path, result, dataset.root, 9)  # what the analysis reads, and a zoo result for the board
    (tmp_path / leaderboard.MODELS_FOLDER).mkdir()
    (tmp_path / leaderboard.MODELS_FOLDER / "m.json").write_text(json.dumps(
        {"model": "m", "source": "file", "arch": "a", "weights": None, "in9": in9.to_json(),
         "challenge": result.to_json()}))
    write(result, in9, tmp_path, dataset.root)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert len(before) >= 2
    with pytest.raises(Exception), file_size_limit(64):  # noqa: B017 (whatever the full disk raises)
        write(result, in9, tmp_path, dataset.root)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert sorted(after) == sorted(before), "a temporary file was left behind"
    changed = [p.name for p in before if after[p] != before[p]]
    assert not changed, f"half-written: {changed}"


@pytest.mark.slow
def test_the_analysis_of_a_run_analyses_its_matrix_not_the_file_it_wrote(full_run, dataset, tmp_path, monkeypatch):
    """--analysis analyses the matrix the run holds in memory: a predictions.npy changed after it was written (here
    all -1) changes nothing in the analysis; `python -m tools.results.analysis` reads the changed file."""
    result, _ = full_run
    publish.publish_challenge(result, tmp_path / "kept", dataset.root, 9, analysis=True, top_k=2)
    kept = json.loads((tmp_path / "kept" / analysis.SUMMARY_FILE).read_text())

    def write_then_change(folder, *args):
        written = write_matrix(folder, *args)
        np.save(folder / "predictions.npy", np.full_like(result.state.matrix, -1))
        return written

    monkeypatch.setattr(publish, "write_matrix", write_then_change)
    publish.publish_challenge(result, tmp_path / "changed", dataset.root, 9, analysis=True, top_k=2)
    changed = json.loads((tmp_path / "changed" / analysis.SUMMARY_FILE).read_text())
    assert changed["per_class"] == kept["per_class"]
    assert changed["fooled_into_bg_class"] == kept["fooled_into_bg_class"] > 0
    assert analysis.write_analysis(tmp_path / "changed", dataset.root, 2)["fooled_into_bg_class"] == 0


KILLED_WHILE_WRITING = """
import os, signal, sys
from tools.provenance import atomic_write
with atomic_write(sys.argv[1], "wb") as fh:
    fh.write(b"half a state")
    fh.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_what_a_write_killed_midway_leaves_is_removed_by_the_next_write(tmp_path):
    """`kill -9` of train.py during a state write left a `.resume_state.pt.<hex>.tmp` that no later run removed: the
    next write of the same file removes its own pattern's temporaries whose process is gone (this host), or that
    nobody changed for a day (any host: a container's name changes on every start); a user's files stay."""
    state = tmp_path / STATE_NAME
    for _ in range(2):  # the second write, killed too, removes the first's before it starts
        killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, str(state)], cwd=REPO)
        assert killed.returncode == -signal.SIGKILL
        [left] = tmp_path.iterdir()
        assert left.name.startswith(f".{STATE_NAME}.") and left.name.endswith(".tmp")
    long_ago = time.time() - 2 * 24 * 3600
    aged = [tmp_path / f".{STATE_NAME}.{'0a1b2c3d4e5f'}.tmp",  # an older version's name: no host, no process
            tmp_path / f".{STATE_NAME}.b1946ac92492@{os.getpid()}@{'0a1b2c3d4e5f'}.tmp"]  # a container's, long gone
    young = tmp_path / f".{STATE_NAME}.other-host@1@{'0a1b2c3d4e5f'}.tmp"  # another host, writing now
    mine = [tmp_path / f".{STATE_NAME}.notes.tmp", tmp_path / f".{STATE_NAME}.{socket.gethostname()}@1@notes.tmp"]
    for path in [*aged, young, *mine]:
        path.write_bytes(b"x")
    for path in [*aged, *mine]:
        os.utime(path, (long_ago, long_ago))
    save_atomic({"step": 1}, state)
    assert sorted(tmp_path.iterdir()) == sorted([state, young, *mine])
    assert torch.load(state, weights_only=True) == {"step": 1}


# Writers that may write in place: they fill a folder that only a finished run renames into place, or append.
IN_PLACE_WRITERS = {
    "tools/provenance.py": {"atomic_write"},  # the helper itself
    "tools/data/store.py": {"save", "commit", "_allocate"},  # cache entries and packs, written inside a temporary
    # folder renamed into place (a pack's rows file too)
    "tools/training/loop.py": {"write"},  # train_log.jsonl, appended to one line at a time
    "tools/results/figures.py": {"data_uri"},  # an image encoded into memory (io.BytesIO), no file
    "tools/models/torchscript.py": {"rewritten"},  # a program copied through memory (io.BytesIO), no file
    "tools/data/synthetic.py": None,  # a generated data set (the whole module)
    "tools/data/builder.py": None,  # a built data set
    "tools/data/download.py": None,  # a resumable download, extracted into a temporary folder
}
SAVE_FUNCTIONS = {("np", "save"): 0, ("np", "savez"): 0, ("np", "savez_compressed"): 0, ("torch", "save"): 1,
                  ("jit", "save"): 1}


def _writes_in_place(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, enclosing function, call) of every call in the module that writes a file other than through
    the handle of `with atomic_write(...) as fh`."""
    found = []

    def visit(node, function: str, handles: frozenset):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function, handles = node.name, frozenset()
        if isinstance(node, ast.With):
            bound = {item.optional_vars.id for item in node.items
                     if isinstance(item.optional_vars, ast.Name) and isinstance(item.context_expr, ast.Call)
                     and getattr(item.context_expr.func, "id", getattr(item.context_expr.func, "attr", None))
                     == "atomic_write"}
            handles = handles | bound
        if isinstance(node, ast.Call):
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            owner = getattr(getattr(func, "value", None), "id", None) or getattr(getattr(func, "value", None),
                                                                                  "attr", None)
            target = None
            if name in ("open", "fdopen") and isinstance(func, ast.Name | ast.Attribute):
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "mode"), None)
                if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                    found.append((node.lineno, function, ast.unparse(node)[:80]))
            elif name in ("write_text", "write_bytes"):
                found.append((node.lineno, function, ast.unparse(node)[:80]))
            elif (owner, name) in SAVE_FUNCTIONS:
                position = SAVE_FUNCTIONS[(owner, name)]
                target = node.args[position] if len(node.args) > position else None
            elif name == "save" and any(k.arg == "format" for k in node.keywords):  # Pillow
                target = node.args[0] if node.args else None
            if target is not None and not (isinstance(target, ast.Name) and target.id in handles):
                found.append((node.lineno, function, ast.unparse(node)[:80]))
        for child in ast.iter_child_nodes(node):
            visit(child, function, handles)

    visit(tree, "<module>", frozenset())
    return found


@pytest.mark.slow
def test_every_output_is_written_through_the_atomic_helper():
    offenders = []
    for path in sorted((REPO / "tools").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        allowed = IN_PLACE_WRITERS.get(rel, set())
        if allowed is None:
            continue
        for line, function, call in _writes_in_place(ast.parse(path.read_text(encoding="utf-8"))):
            if function not in allowed:
                offenders.append(f"{rel}:{line} in {function}: {call}")
    assert not offenders, "outputs written in place:\n" + "\n".join(offenders)


def test_the_guard_sees_writes_in_place():
    """The guard above finds each kind of in-place write, and accepts writes through atomic_write's handle."""
    source = '''
def bad(path, matrix, canvas, text):
    open(path, "w").write(text)
    path.write_text(text)
    np.save(path, matrix)
    torch.save(matrix, path)
    canvas.save(path, format="PNG")
def good(path, matrix, canvas):
    with atomic_write(path, "wb") as fh:
        np.save(fh, matrix)
        canvas.save(fh, format="PNG")
    with open(path) as fh:
        fh.read()
'''
    found = _writes_in_place(ast.parse(source))
    assert [(function, line) for line, function, _ in found] == [("bad", 3), ("bad", 4), ("bad", 5), ("bad", 6),
                                                                 ("bad", 7)]


# ----------------------------------------------------------------------------------------------------------
# SIGTERM is handled like Ctrl-C

@pytest.mark.slow
def test_sigterm_is_an_interruption_with_exit_143(tmp_path):
    """A command that receives SIGTERM runs its clean-up, says it was stopped, and exits with 128 + 15."""
    program = f"""
import argparse, os, signal, sys
from pathlib import Path
from tools import cli
def main(args):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        import time; time.sleep(30)
    finally:
        Path({str(tmp_path / 'cleaned')!r}).write_text('yes')
parser = argparse.ArgumentParser()
cli.add_log_level_argument(parser)
sys.exit(cli.run_main(parser, main, [], on_interrupt="rerun the same command"))
"""
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert proc.stderr.strip().splitlines() == ["terminated: rerun the same command"]
    assert (tmp_path / "cleaned").read_text() == "yes"


@pytest.mark.slow
def test_sigterm_mid_challenge_keeps_the_state_and_resumes(tmp_path, capsys, one_thread):
    """challenge_eval.py sent SIGTERM mid-search: exit 143, one line saying how to go on, the saved state kept
    (and no temporary file); resumed (in this process), it gives the uninterrupted run's summary."""
    data = synthetic.generate(tmp_path / "bg", per_class=2, seed=3).root
    slow = tmp_path / "slow.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, trunk_width=8, trunk_scale=1e-4), slow)
    argv = ["--data-path", str(data), "--checkpoint", str(slow), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", "--no-cache",
            "--batch-size", "4", "--save-every", "0", "--workers", "1", "--log-level", "WARNING"]
    state = tmp_path / "stopped" / challenge.STATE_NAME
    proc = subprocess.Popen([sys.executable, "challenge_eval.py", *argv, "--output-dir", str(state.parent)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be stopped; use a slower model"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == [f"terminated: progress so far is saved under {state.parent}; rerun with "
                                        f"--resume to continue"]
    assert "Summary" not in out
    assert state.is_file() and sorted(p.name for p in state.parent.iterdir()) == [state.name]
    whole = run_in_process(challenge_eval.main, argv + ["--output-dir", str(tmp_path / "whole")], capsys)
    resumed = run_in_process(challenge_eval.main, argv + ["--output-dir", str(state.parent), "--resume",
                                                              "--log-level", "INFO"], capsys)
    assert whole[0] == resumed[0] == 0
    assert "resuming from" in resumed[2] and "Summary" in whole[1] and resumed[1] == whole[1]


# ----------------------------------------------------------------------------------------------------------
# A cache entry (CLIP's text heads; the packs: test_data_store.py) leaves no temporary folder behind

def _cache(folder: Path) -> store.CacheEntry:
    return store.CacheEntry(folder, "entry", {"fingerprint": "f"}, "CLIP text head")


ARRAYS = {"a": np.arange(10), "b": np.ones((3, 3)), "masks": np.zeros(4, np.uint8)}


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError])
def test_cache_save_that_fails_leaves_no_temporary_folder(failure, tmp_path, monkeypatch, caplog):
    real, calls = np.save, []

    def failing_save(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise failure(28, "No space left on device") if failure is OSError else failure()
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "save", failing_save)
    if failure is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            _cache(tmp_path).save(ARRAYS)
    else:
        _cache(tmp_path).save(ARRAYS)  # a warning, and the run goes on without the cache
        assert "could not write the CLIP text head cache" in caplog.text
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_stale_cache_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tmp-{host}@{dead.pid}@{os.urandom(8).hex()}"
    running = tmp_path / f".tmp-{host}@{os.getpid()}@{os.urandom(8).hex()}"  # this process: an entry being written
    elsewhere = tmp_path / f".tmp-{host}-2@{dead.pid}@{os.urandom(8).hex()}"  # of another machine sharing the folder
    older = tmp_path / ".tmp-k2v9x_q1"  # an older version's killed writer (mkdtemp's name: no host, no process)
    for folder in (stale, running, elsewhere, older):
        folder.mkdir()
        (folder / "a.npy").write_bytes(b"x" * 1000)
    long_ago = time.time() - 2 * 24 * 3600  # the older version's: untouched for two days
    os.utime(older / "a.npy", (long_ago, long_ago))
    os.utime(older, (long_ago, long_ago))
    cache = _cache(tmp_path)
    assert cache.load(["a"]) is None
    assert not stale.exists() and not older.exists() and running.is_dir() and elsewhere.is_dir()
    cache.save(ARRAYS)
    assert cache.load(list(ARRAYS)) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry", running.name, elsewhere.name])


@pytest.mark.parametrize("damage", ["a value changed", "group-writable", "another user's"])
def test_a_cache_entry_that_is_damaged_or_others_could_write_is_not_used(damage, tmp_path, caplog):
    """CLIP's text heads live in the decoded-data cache too: an entry whose array no longer matches the SHA-256
    written with it (one value changed, still a valid .npy) is recomputed and replaced; one that another user
    could have written is not used (and left as it is)."""
    if damage == "another user's" and os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    _cache(tmp_path).save(ARRAYS)
    array = tmp_path / "entry" / "a.npy"
    if damage == "a value changed":
        np.save(array, ARRAYS["a"] + np.eye(1, 10, 3, dtype=ARRAYS["a"].dtype)[0])
    elif damage == "group-writable":
        array.chmod(0o664)
    else:
        os.chown(array, 65534, -1)
    with caplog.at_level("WARNING"):
        assert _cache(tmp_path).load(["a"]) is None
    assert "SHA-256" in caplog.text if damage == "a value changed" else "not using the CLIP text head" in caplog.text
    entry = _cache(tmp_path)
    entry.load(["a"])
    entry.save(ARRAYS)
    replaced = _cache(tmp_path).load(["a"])
    assert (replaced is not None and replaced["a"].tolist() == ARRAYS["a"].tolist()) == (damage == "a value changed")


def test_a_cache_entry_is_readable_as_the_umask_allows(tmp_path):
    """A cache folder shared by users: an entry (CLIP's text head) gets the umask's mode, as the packs do, not a
    private temporary folder's 0700."""
    umask = os.umask(0o022)
    try:
        _cache(tmp_path).save(ARRAYS)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "entry").stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in (tmp_path / "entry").iterdir())


def test_the_same_cache_entry_written_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch, caplog):
    """Two processes writing the same entry (same key, same content): the second rename finds the first's entry,
    keeps it and drops its own, without a warning."""
    real = os.replace
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    _cache(elsewhere).save({"a": ARRAYS["a"]})  # the other process's entry, written as every entry is

    def another_process_first(src, dst):
        if Path(dst) == cache / "entry" and not Path(dst).exists():
            real(elsewhere / "entry", dst)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", another_process_first)
    with caplog.at_level("INFO"):
        _cache(cache).save(ARRAYS)
    assert "could not write" not in caplog.text and "meanwhile" in caplog.text
    assert sorted(p.name for p in cache.iterdir()) == ["entry"]
    assert _cache(cache).load(["a"])["a"].tolist() == ARRAYS["a"].tolist()


def test_two_processes_that_missed_the_same_entry_keep_the_first_ones_and_replace_only_a_broken_one(tmp_path, caplog):
    """Both missed, both save: the second keeps the first's entry (a reader of it never sees it half removed). An
    entry that `load` found broken is replaced, renamed away first, so no reader sees meta.json without its
    arrays."""
    first, second = _cache(tmp_path), _cache(tmp_path)
    assert first.load(["a"]) is None and second.load(["a"]) is None
    first.save(ARRAYS)
    written = (tmp_path / "entry" / "meta.json").stat().st_ino
    with caplog.at_level("INFO"):
        second.save(ARRAYS)
    assert "meanwhile" in caplog.text
    assert (tmp_path / "entry" / "meta.json").stat().st_ino == written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    (tmp_path / "entry" / "a.npy").write_bytes(b"damaged")
    broken = _cache(tmp_path)
    assert broken.load(list(ARRAYS)) is None and "ignoring an unreadable cache" in caplog.text
    renamed = []
    real_rename = os.rename

    def watched(src, dst):
        renamed.append((Path(src).name, Path(dst).name))
        return real_rename(src, dst)

    os.rename = watched
    try:
        broken.save(ARRAYS)
    finally:
        os.rename = real_rename
    assert any(src == "entry" and "@removing-" in dst for src, dst in renamed), renamed
    assert _cache(tmp_path).load(list(ARRAYS))["a"].tolist() == ARRAYS["a"].tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
