"""The data's identity is its content: a file rewritten in place, with the same name, size and modification
time, is seen as other data by the decoded-data cache, by --resume and in the provenance, in both scripts."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import challenge_eval
import in9_eval
from tests.helpers import run_in_process
from tools.data import synthetic


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("identity") / "bg", per_class=2, seed=21).root


@pytest.fixture
def data(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "bg"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.helpers import save_torchscript  # noqa: PLC0415
    path = tmp_path_factory.mktemp("identity-model") / "color9.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), path)
    return path


def jpeg_of_size(pixels: np.ndarray, size: int) -> bytes:
    """A JPEG of these pixels padded to exactly `size` bytes with a comment segment after the start marker."""
    for quality in range(95, 5, -5):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
        encoded = buffer.getvalue()
        pad = size - len(encoded)
        if pad >= 4:
            comment = b"\xff\xfe" + (pad - 2).to_bytes(2, "big") + b"x" * (pad - 4)
            return encoded[:2] + comment + encoded[2:]
    raise AssertionError("could not encode a small enough JPEG")


def rewrite_in_place(path: Path, content: bytes) -> None:
    """New bytes in the same file (same inode), same size, and the old modification time put back."""
    before = path.stat()
    assert len(content) == before.st_size
    with open(path, "r+b") as fh:
        fh.write(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def change(data: Path, what: str) -> Path:
    """Rewrite one file so that the model's answers on it change: a mask, a foreground image or a background."""
    if what == "mask":
        path = sorted((data / "fg_mask" / "val").rglob("*.npy"))[0]
        mask = np.load(path)
        buffer = io.BytesIO()
        np.save(buffer, ~mask.astype(bool) if mask.dtype == bool else (1 - mask).astype(mask.dtype))
        rewrite_in_place(path, buffer.getvalue())
        return path
    folder = "original" if what == "image" else "only_bg_t"
    files = sorted((data / folder / "val").rglob("*.JPEG"))
    path, donor = files[0], files[-1]  # the first class's file gets the last class's pixels
    with Image.open(donor) as img:
        pixels = np.asarray(img.convert("RGB"))
    rewrite_in_place(path, jpeg_of_size(pixels, path.stat().st_size))
    return path


def challenge(capsys, data: Path, model: Path, out: Path, *extra: str):
    argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", "--full",
            "--output-dir", str(out), "--results-file", str(out / "results.json"), "--log-level", "WARNING", *extra]
    code, stdout, err = run_in_process(challenge_eval.main,
                                       argv, capsys)
    return code, stdout, err


def in9(capsys, data: Path, model: Path, out: Path, *extra: str):
    argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress",
            "--eval-dataset", "all", "--output-dir", str(out), "--results-file", str(out / "results.json"),
            "--log-level", "WARNING", *extra]
    return run_in_process(in9_eval.main, argv, capsys)


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("what", ["mask", "image", "background"])
@pytest.mark.slow
def test_challenge_sees_a_file_rewritten_in_place(what, capsys, data, model, tmp_path):
    cache = tmp_path / "cache"
    code, _, err = challenge(capsys, data, model, tmp_path / "first", "--cache-dir", str(cache))
    assert code == 0, err
    before = np.load(tmp_path / "first" / "predictions.npy")
    old_hash = results(tmp_path / "first")["provenance"]["data"]["sha256"]
    packs = {p for p in cache.iterdir() if not p.name.startswith(".")}

    change(data, what)
    # the cache: the rewritten data is decoded afresh, and the run equals one without any cache
    code, _, err = challenge(capsys, data, model, tmp_path / "second", "--cache-dir", str(cache))
    assert code == 0, err
    after = np.load(tmp_path / "second" / "predictions.npy")
    code, _, err = challenge(capsys, data, model, tmp_path / "fresh", "--no-cache")
    assert code == 0, err
    assert np.array_equal(after, np.load(tmp_path / "fresh" / "predictions.npy"))
    assert not np.array_equal(after, before)  # the change matters, so a stale cache would have shown
    # one new pack in the cache, of the one rewritten file's row
    (new,) = {p for p in cache.iterdir() if not p.name.startswith(".")} - packs
    assert json.loads((new / "meta.json").read_text())["count"] == 1
    # the provenance
    new_hash = results(tmp_path / "second")["provenance"]["data"]["sha256"]
    assert new_hash != old_hash
    # --resume refuses the state computed on the old data
    code, out, err = challenge(capsys, data, model, tmp_path / "first", "--cache-dir", str(cache), "--resume")
    assert code == 2 and "belongs to another run" in err.splitlines()[-1]


@pytest.mark.slow
def test_in9_sees_an_image_rewritten_in_place(capsys, data, model, tmp_path):
    code, _, err = in9(capsys, data, model, tmp_path / "first")
    assert code == 0, err
    old = results(tmp_path / "first")
    change(data, "background")  # an only_bg_t image, read by the in9 run too
    code, _, err = in9(capsys, data, model, tmp_path / "second")
    assert code == 0, err
    new = results(tmp_path / "second")
    assert new["provenance"]["data"]["sha256"] != old["provenance"]["data"]["sha256"]
    assert new["provenance"]["data"]["files"] == old["provenance"]["data"]["files"]
    code, _, err = in9(capsys, data, model, tmp_path / "first", "--resume")
    assert code == 2 and "was written for another model, data or setting" in err.splitlines()[-1]


@pytest.mark.parametrize("arithmetic", ["binary", "original"])
def test_the_cache_returns_exactly_what_was_decoded(arithmetic, pristine, tmp_path):
    import torch  # noqa: PLC0415

    from tools.challenge import list_challenge_files, load_challenge_data  # noqa: PLC0415
    from tools.data.compositing import MaskArithmetic  # noqa: PLC0415
    from tools.data.store import DecodedCache  # noqa: PLC0415

    files = list_challenge_files(pristine, workers=1)
    mode = MaskArithmetic(arithmetic)
    files.image_set.cache = DecodedCache(tmp_path / "cache")
    fresh = load_challenge_data(files, 1, progress=False, arithmetic=mode)
    files.image_set.cache = DecodedCache(tmp_path / "cache")
    cached = load_challenge_data(files, 1, progress=False, arithmetic=mode)
    files.image_set.cache = None
    uncached = load_challenge_data(files, 1, progress=False, arithmetic=mode)
    for name in ("fg_images", "masks", "bg_images"):
        assert torch.equal(getattr(fresh, name), getattr(cached, name)), name
        assert torch.equal(getattr(uncached, name), getattr(cached, name)), name
    # written once: a pack of masks, and one of images per group decoded (foregrounds, backgrounds)
    kinds = sorted(p.name.rsplit("-", 2)[0] for p in (tmp_path / "cache").iterdir())
    assert kinds == ["image", "image", f"mask-{arithmetic}"]
