"""What listing considers a data file, and files that cannot be read: a FIFO or a link to a device among the data
is never opened (it hung the scripts and `verify`, or read /dev/zero until memory ran out); a link loop, an
unreadable file or folder, a name that is not UTF-8 and an .npz where a mask belongs are one `error:` line each;
files reached through links out of the data folder are read, said once and recorded in the provenance.

Running as root, permissions do not stop a read, so an unreadable file or folder is the operating system refusing
it: `open` (and `os.open`) or `os.scandir` raising PermissionError for that one path, in this process."""

from __future__ import annotations

import builtins
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import challenge_eval
import in9_eval
from tests.helpers import TINY, check_error, run_in_process, run_train, save_torchscript
from tools.data import cli as data_cli
from tools.data import synthetic
from tools.training.checkpoint import CHECKPOINT_NAME

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--device", "cpu", "--no-progress", "--no-cache", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("special")
    data = synthetic.generate(root / "bg", per_class=2, seed=4).root
    model = root / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), model)
    return data, model


def class_dir(data: Path, folder: str, index: int = 0) -> Path:
    return data / folder / "val" / sorted(os.listdir(data / folder / "val"))[index]


def copy(data: Path, tmp_path: Path) -> Path:
    shutil.copytree(data, tmp_path / "bg", symlinks=True)
    return tmp_path / "bg"


def in9(capsys, data, model, *extra):
    """in9_eval.py on `original`, its state beside the data folder."""
    return run_in_process(in9_eval.main, ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint",
                                          "--eval-dataset",
                                          "original", "--output-dir", str(data.parent / "in9_out"),
                                          *[a for a in QUIET if a != "--no-cache"], *map(str, extra)], capsys)


def challenge(capsys, data, model, *extra):
    """challenge_eval.py, its state beside the data folder."""
    return run_in_process(challenge_eval.main, ["--data-path", str(data), "--checkpoint", str(model),
                                                "--trust-checkpoint", "--output-dir",
                                                str(data.parent / "challenge_out"), *QUIET, *map(str, extra)], capsys)


def verify(capsys, data):
    return run_in_process(data_cli.main, ["verify", "--data-path", str(data), "--full"], capsys)


# Both scripts and `verify --full`, on the clean data and on the data with special files, in one process of
# bounded memory (4 GiB of data: reading /dev/zero runs out of it) and time (a FIFO blocks its reader forever).
RUN_ALL = r"""
import contextlib, io, json, sys
import challenge_eval, in9_eval
from tools.data import cli
out = []
for data in sys.argv[3:]:
    for main, argv in [(in9_eval.main, ["--eval-dataset", "original", "--checkpoint", sys.argv[1],
                                        "--trust-checkpoint"]),
                       (challenge_eval.main, ["--no-cache", "--checkpoint", sys.argv[1], "--trust-checkpoint"]),
                       (cli.main, ["verify", "--full"])]:
        if main is not cli.main:
            argv += ["--device", "cpu", "--no-progress"]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main([*argv, "--data-path", data])
        out.append([code, stdout.getvalue(), stderr.getvalue()])
with open(sys.argv[2], "w") as fh:
    json.dump(out, fh)
"""


def limited():
    resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))


@pytest.mark.slow
def test_fifos_and_links_to_devices_are_never_opened(setup, tmp_path):
    data, model = setup
    special = copy(data, tmp_path)
    os.mkfifo(class_dir(special, "original") / "zz_fifo.JPEG")
    os.mkfifo(class_dir(special, "fg_mask", 1) / "zz_fifo.npy")
    (class_dir(special, "only_bg_t", 2) / "zz_zero.JPEG").symlink_to("/dev/zero")
    (class_dir(special, "original", 3) / "zz_zero.JPEG").symlink_to("/dev/zero")
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-c", RUN_ALL, str(model), str(results), str(data), str(special)],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert proc.returncode == 0, proc.stderr[-3000:]
    clean, found = (json.loads(results.read_text())[i:i + 3] for i in (0, 3))
    for (code, _out, err), (clean_code, _clean_out, _) in zip(found, clean):
        assert code == clean_code == 0, err
        assert "Traceback" not in err
    in9_run, challenge_run, verified = found
    assert in9_run[1] == clean[0][1] and challenge_run[1] == clean[1][1]  # the same numbers: nothing more was read
    assert "never opened: zz_fifo.JPEG" in in9_run[2] and "never opened: zz_zero.JPEG" in in9_run[2]
    assert all(f"never opened: {name}" in challenge_run[2] for name in ("zz_fifo.JPEG", "zz_fifo.npy", "zz_zero.JPEG"))
    assert verified[1].count("never opened") == 4, verified[1]


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_link_loop_is_one_error_line(what, setup, tmp_path, capsys):
    data, model = setup
    broken = copy(data, tmp_path)
    loop = class_dir(broken, "original") / ("zz_loop.JPEG" if what == "file" else "zz_loop")
    loop.symlink_to(loop)
    for code, out, err in (in9(capsys, broken, model), challenge(capsys, broken, model), verify(capsys, broken)):
        line = check_error(code, out, err, lines=None)
        assert str(loop) in line and "link loop" in line


def test_a_name_that_is_not_utf8_is_one_error_line(setup, tmp_path, capsys):
    data, model = setup
    broken = copy(data, tmp_path)
    image = sorted(class_dir(broken, "original").iterdir())[0]
    os.rename(image, os.path.join(os.fsencode(image.parent), b"caf\xe9.JPEG"))
    for code, out, err in (in9(capsys, broken, model), challenge(capsys, broken, model), verify(capsys, broken)):
        assert "not UTF-8 (b'caf\\xe9.JPEG')" in check_error(code, out, err, lines=None)


def test_an_npz_where_a_mask_belongs_is_one_error_line(setup, tmp_path, capsys):
    data, model = setup
    broken = copy(data, tmp_path)
    mask = sorted(class_dir(broken, "fg_mask").iterdir())[0]
    with open(mask.with_suffix(".tmp"), "wb") as fh:
        np.savez(fh, mask=np.load(mask))
    os.replace(mask.with_suffix(".tmp"), mask)
    line = check_error(*challenge(capsys, broken, model), lines=None)
    assert mask.name in line and ".npz archive" in line
    code, out, err = verify(capsys, broken)
    assert code == 2 and "Traceback" not in err and ".npz archive" in out


@pytest.fixture
def refused(monkeypatch):
    """Make the operating system refuse to open (or list) the paths added to the returned set, as it does a file
    or folder without read permission for anyone but root."""
    denied: set[str] = set()
    real_open, real_os_open, real_scandir = builtins.open, os.open, os.scandir

    def check(path):
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) in denied:
            raise PermissionError(13, "Permission denied", os.fspath(path))

    def fake_open(file, *args, **kwargs):
        check(file)
        return real_open(file, *args, **kwargs)

    def fake_os_open(path, *args, **kwargs):
        check(path)
        return real_os_open(path, *args, **kwargs)

    def fake_scandir(path="."):
        check(path)
        return real_scandir(path)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "scandir", fake_scandir)
    return denied


@pytest.mark.parametrize("what", ["second image", "second mask", "class folder", "val folder"])
def test_an_unreadable_file_or_folder_is_one_error_line(what, setup, refused, capsys):
    data, model = setup
    path = {"second image": lambda: sorted(class_dir(data, "only_bg_t", 1).iterdir())[1],  # the first: sampled
            "second mask": lambda: sorted(class_dir(data, "fg_mask", 1).iterdir())[1],
            "class folder": lambda: class_dir(data, "only_bg_t", 4),
            "val folder": lambda: data / "fg_mask" / "val"}[what]()
    refused.add(str(path))
    line = check_error(*challenge(capsys, data, model), lines=None)
    assert str(path) in line and "Permission denied" in line


def test_eval_data_is_checked_before_training_and_a_failure_after_it_keeps_the_model(setup, tiny, tmp_path,
                                                                                      refused, capsys):
    data, _ = setup
    broken = copy(data, tmp_path)
    image = sorted(class_dir(broken, "mixed_rand").iterdir())[0]
    os.rename(image, os.path.join(os.fsencode(image.parent), b"caf\xe9.JPEG"))
    out = tmp_path / "out"
    argv = ["--data-path", tiny, "--weights", "none", "--epochs", 1, "--batch-size", 6, "--output-dir", out, *TINY]
    line = check_error(*run_train([*argv, "--eval-data", broken], capsys), lines=None)
    assert "not UTF-8" in line and not (out / CHECKPOINT_NAME).exists()  # refused before any training
    unreadable = sorted(class_dir(data, "mixed_rand", 2).iterdir())[-1]  # past the quick check's sample
    refused.add(str(unreadable))
    code, stdout, err = run_train([*argv, "--eval-data", data], capsys)
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(unreadable) in line and str(out / CHECKPOINT_NAME) in line
    assert line.count(" is saved") == 1, line  # said once (the evaluation and the command each said it)
    assert (out / CHECKPOINT_NAME).is_file()  # the trained model is kept


def test_files_reached_through_links_out_of_the_data_folder_are_said_once_and_recorded(setup, tmp_path, capsys):
    """A data folder assembled from links into a shared store (a class folder, an image) is read as data: one
    warning says how many files and where, the provenance records it, and the numbers are the copy's."""
    data, model = setup
    linked, store = copy(data, tmp_path), tmp_path / "store"
    store.mkdir()
    folder = class_dir(linked, "only_bg_t", 1)
    shutil.move(folder, store / folder.name)
    folder.symlink_to(store / folder.name)
    image = sorted(class_dir(linked, "original").iterdir())[0]
    shutil.move(image, store / image.name)
    image.symlink_to(store / image.name)
    code, plain, _ = challenge(capsys, data, model, "--results-file", tmp_path / "plain.json")
    assert code == 0
    code, out, err = challenge(capsys, linked, model, "--results-file", tmp_path / "linked.json")
    assert code == 0 and out == plain
    warnings = [line for line in err.splitlines() if "outside the data folder" in line]
    assert len(warnings) == 1 and "3 file(s)" in warnings[0] and str(store) in warnings[0], err
    recorded = json.loads((tmp_path / "linked.json").read_text())["provenance"]["data"]
    assert recorded["outside"] == {"files": 3, "folders": sorted([str(store), str(store / folder.name)])}
    assert recorded["sha256"] == json.loads((tmp_path / "plain.json").read_text())["provenance"]["data"]["sha256"]
    assert "outside" not in json.loads((tmp_path / "plain.json").read_text())["provenance"]["data"]


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
@pytest.mark.slow
def test_a_special_file_where_the_build_summary_goes_is_never_opened(kind, setup, tmp_path):
    """`verify` reads the build's summary beside the folders: a FIFO there blocked it forever, a link to /dev/zero
    read until memory ran out; it is no summary."""
    data, _ = setup
    special = copy(data, tmp_path)
    summary = special / "build_summary.json"
    if kind == "fifo":
        os.mkfifo(summary)
    else:
        summary.symlink_to("/dev/zero")
    proc = subprocess.run([sys.executable, "-m", "tools.data", "verify", "--data-path", str(special)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120, preexec_fn=limited)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
