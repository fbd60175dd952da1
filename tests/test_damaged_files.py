"""Every file the toolkit reads back (masks, the resume states of both scripts and of train.py, the --full
matrix, the decoded-data cache; the shard files in test_shards.py), when empty or truncated, ends in one `error:`
line (the cache: a warning and a fresh decode), never a traceback. numpy raises EOFError for an empty file and
zipfile.BadZipFile for a truncated .npz, which are neither OSError nor ValueError."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import challenge_eval
import in9_eval
from tests.helpers import run_in_process, save_torchscript
from tools.challenge.state import SearchState
from tools.data import builder, synthetic
from tools.data.boxes import CropGeometry
from tools.data.image_sets import read_mask
from tools.errors import UserError
from tools.results import analysis, matrix
from tools.results.report import cli as report_cli
from tools.shards import read_challenge_arrays


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    data = synthetic.generate(root / "bg", per_class=2, seed=3).root
    model = root / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), model)
    return data, model


def empty(path: Path) -> None:
    path.write_bytes(b"")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def deeply_nested(path: Path) -> None:
    """JSON nested deeper than Python's parser goes: a RecursionError, neither OSError nor ValueError."""
    path.write_text("[" * 100_000 + "]" * 100_000)


def challenge(capsys, data, model, *args):
    argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", *map(str, args)]
    return run_in_process(challenge_eval.main, argv, capsys)


def in9(capsys, data, model, *args):
    argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", *map(str, args)]
    return run_in_process(in9_eval.main, argv, capsys)


def one_error_line(err: str, *names: str) -> str:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert all(name in errors[0] for name in names), errors[0]
    return errors[0]


@pytest.mark.parametrize("damage", [empty, truncate])
def test_a_damaged_mask_is_one_error_line(damage, setup, tmp_path, capsys):
    data, model = setup
    copy = tmp_path / "bg"
    shutil.copytree(data, copy)
    mask = sorted((copy / "fg_mask").rglob("*.npy"))[0]
    damage(mask)
    code, _, err = challenge(capsys, copy, model, "--no-cache", "--output-dir", tmp_path / "out")
    assert code == 2
    one_error_line(err, mask.name)
    with pytest.raises(UserError, match=f"cannot read mask {mask}"):
        read_mask(mask)
    with pytest.raises(UserError, match=f"cannot read mask {mask}"):
        builder.load_user_mask(mask, CropGeometry.for_image(224, 224))


@pytest.mark.parametrize("damage", [empty, truncate])
@pytest.mark.slow
def test_a_damaged_resume_state_is_one_error_line(damage, setup, tmp_path, capsys):
    data, model = setup
    out = tmp_path / "out"
    code, _, err = challenge(capsys, data, model, "--no-cache", "--output-dir", out)
    assert code == 0, err
    damage(out / "challenge_state.npz")
    code, _, err = challenge(capsys, data, model, "--no-cache", "--output-dir", out, "--resume")
    assert code == 2
    one_error_line(err, "challenge_state.npz", "rerun without --resume")


@pytest.mark.parametrize("damage", [empty, truncate, deeply_nested])
@pytest.mark.slow
def test_a_damaged_in9_resume_state_is_one_error_line(damage, setup, tmp_path, capsys):
    data, model = setup
    out = tmp_path / "out"
    code, _, err = in9(capsys, data, model, "--eval-dataset", "all", "--output-dir", out)
    assert code == 0, err
    damage(out / "in9_state.json")
    code, _, err = in9(capsys, data, model, "--eval-dataset", "all", "--output-dir", out, "--resume")
    assert code == 2
    one_error_line(err, "in9_state.json", "rerun without --resume")


@pytest.mark.parametrize("damage", [empty, truncate])
@pytest.mark.slow
def test_a_damaged_saved_matrix_is_one_error_line(damage, setup, tmp_path, capsys):
    data, model = setup
    out = tmp_path / "out"
    code, _, err = challenge(capsys, data, model, "--no-cache", "--full", "--output-dir", out)
    assert code == 0, err
    damage(out / matrix.PREDICTIONS_FILE)
    code, _, err = run_in_process(analysis.main, [str(out)], capsys)
    assert code == 2
    one_error_line(err, matrix.PREDICTIONS_FILE, "rerun challenge_eval.py --full")


@pytest.mark.slow
def test_json_results_nested_too_deep_are_one_error_line(setup, tmp_path, capsys):
    """A results file (report), the --full matrix's description (analysis): each JSON the toolkit reads back."""
    data, model = setup
    out = tmp_path / "out"
    code, _, err = challenge(capsys, data, model, "--no-cache", "--full", "--output-dir", out)
    assert code == 0, err
    deeply_nested(out / matrix.META_FILE)
    code, _, err = run_in_process(analysis.main, [str(out)], capsys)
    assert code == 2
    one_error_line(err, matrix.META_FILE, "nested deeper")
    deeply_nested(tmp_path / "in9.json")
    code, _, err = run_in_process(report_cli.main, ["--in9", str(tmp_path / "in9.json"),
                                                    "--output", str(tmp_path / "report.md")], capsys)
    assert code == 2
    one_error_line(err, "in9.json", "nested deeper")


@pytest.mark.slow
def test_a_fifo_where_a_results_file_is_named_is_never_waited_on(tmp_path):
    """A FIFO named as a results file blocked the report forever (a FIFO among files copied from elsewhere)."""
    os.mkfifo(tmp_path / "in9.json")
    proc = subprocess.run([sys.executable, "-c", "import sys; from tools.results.report import cli as report_cli; "
                           "sys.exit(report_cli.main(sys.argv[1:]))", "--in9", str(tmp_path / "in9.json"),
                           "--output", str(tmp_path / "report.md")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    one_error_line(proc.stderr, "in9.json", "not a regular file")


@pytest.mark.parametrize("damage", [empty, truncate])
@pytest.mark.slow
def test_a_damaged_cache_is_decoded_afresh(damage, setup, tmp_path, capsys):
    data, model = setup
    cache, out = tmp_path / "cache", tmp_path / "out"
    code, first, err = challenge(capsys, data, model, "--cache-dir", cache, "--output-dir", out)
    assert code == 0, err
    cached = sorted(cache.rglob("*.npy"))
    assert cached
    for path in cached:
        damage(path)
    code, again, err = challenge(capsys, data, model, "--cache-dir", cache, "--output-dir", out)
    assert code == 0 and "Traceback" not in err
    assert "ignoring an unreadable cache" in err
    assert again == first


def _tensor_instead(path: Path) -> None:
    import torch  # noqa: PLC0415

    torch.save(torch.zeros(3), path)


@pytest.mark.parametrize("damage", [empty, truncate, _tensor_instead])
def test_a_damaged_training_resume_state_is_one_error_line(damage, tmp_path, capsys):
    import train  # noqa: PLC0415
    from tools.training.checkpoint import STATE_NAME  # noqa: PLC0415

    data = synthetic.generate(tmp_path / "train", per_class=1, seed=3, split="train").root
    out = tmp_path / "out"
    argv = ["--data-path", str(data), "--arch", "toolkit:small_cnn", "--weights", "none", "--device", "cpu",
            "--no-progress", "--workers", "0", "--epochs", "1", "--batch-size", "3", "--output-dir", str(out)]
    run = train.main
    code, _, err = run_in_process(run, argv, capsys)
    assert code == 0, err
    damage(out / STATE_NAME)
    code, _, err = run_in_process(run, [*argv, "--resume"], capsys)
    assert code == 2, err
    one_error_line(err, STATE_NAME, "rerun without --resume")


@pytest.mark.parametrize("script", [in9, challenge])
@pytest.mark.parametrize("arch", [[], ["--arch", "resnet18"]])
def test_an_empty_checkpoint_is_one_error_line(script, arch, setup, tmp_path, capsys):
    """torch.load raises a bare EOFError (no message) on an empty file: the line names its type."""
    data, _ = setup
    model = tmp_path / "model.pt"
    empty(model)
    code, _, err = script(capsys, data, model, *arch)
    assert code == 2, err
    assert "EOFError" in one_error_line(err, "model.pt")


def test_a_checkpoint_with_a_damaged_zip_directory_is_one_error_line(setup, tmp_path, capsys):
    """zipfile.is_zipfile reads only the end record; a damaged central directory fails when it is listed."""
    data, model = setup
    damaged = tmp_path / "damaged.ts"
    content = bytearray(model.read_bytes())
    start = content.index(b"PK\x01\x02")  # the first entry of the central directory
    content[start + 3] = 0x07
    damaged.write_bytes(bytes(content))
    code, _, err = in9(capsys, data, damaged)
    assert code == 2, err
    assert "zip directory is damaged" in one_error_line(err, "damaged.ts")


def test_a_checkpoint_whose_zip_names_a_member_in_bytes_that_are_not_utf8_is_one_error_line(setup, tmp_path, capsys):
    """A member name flagged UTF-8 that is not (Python's zipfile raises UnicodeDecodeError listing it)."""
    data, model = setup
    damaged = tmp_path / "damaged.ts"
    content = bytearray(model.read_bytes())
    start = content.index(b"PK\x01\x02")  # the first entry of the central directory: flag UTF-8, name not
    content[start + 9] |= 0x08  # general purpose flag bit 11
    content[start + 46:start + 48] = b"\xff\xfe"
    damaged.write_bytes(bytes(content))
    code, _, err = in9(capsys, data, damaged)
    assert code == 2, err
    assert "zip directory is damaged" in one_error_line(err, "damaged.ts")


def test_an_npy_array_where_an_npz_archive_belongs_is_one_error(tmp_path):
    """A .npy file (one array, not an archive) under the name of a resume state or a shard's arrays: refused with
    the same error as a damaged one (np.load gives an array, which is not a context manager: a TypeError)."""
    state = tmp_path / "state.npz"
    np.save(tmp_path / "array.npy", np.zeros(3))
    (tmp_path / "array.npy").rename(state)
    with pytest.raises(UserError, match="cannot read the saved state"):
        SearchState.load(state, "key", 1, 1, full=False)
    shutil.copy(state, tmp_path / "challenge-shard-1-of-2.npz")
    with pytest.raises(UserError, match="cannot read"):
        read_challenge_arrays(tmp_path / "challenge-shard-1-of-2.json", {"shard": [1, 2], "key": "key"})
