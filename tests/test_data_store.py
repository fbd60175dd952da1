"""The decoded-data cache shared by in9, the challenge and training (tools.data.store): a second run decodes
nothing, keys are the files' content (a file rewritten under its name misses, a renamed one hits), the challenge
reuses what in9 decoded, a pack that is not Pillow's pixels is never kept, and a cached run's predictions are a
streamed run's, bit for bit."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import challenge_eval
import in9_eval
from tests.helpers import run_in_process, save_torchscript
from tests.test_in9_evaluate import tiny_cnn
from tools.challenge import ChallengeConfig, run_challenge
from tools.challenge.data import list_challenge_files, load_challenge_data
from tools.data import cache_admin, decoders, image_sets, store, synthetic
from tools.data.cache_checks import OWNERS_CHECKED, ROW_DIGESTS, SPOT_CHECK_ROWS
from tools.data.compositing import MaskArithmetic
from tools.data.decoders import Decoder
from tools.data.store import DecodedCache
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.sources import load_model
from tools.runtime import Runtime


@pytest.fixture
def data(tmp_path):
    return synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=5).root


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache_model") / "cnn.ts"
    save_torchscript(tiny_cnn(9, seed=2), path)
    return load_model(trust=True, checkpoint=path)


@pytest.fixture
def decodes(monkeypatch):
    """Every file decoded (`decode_bytes`, the one conversion of bytes into pixels), by name."""
    seen: list[str] = []
    real = image_sets.decode_bytes

    def counting(data, name, *args, **kwargs):
        seen.append(str(name))
        return real(data, name, *args, **kwargs)

    monkeypatch.setattr(image_sets, "decode_bytes", counting)
    return seen


def in9(model, root, cache_dir, decoder: Decoder | None = None, batch_size: int = 5, shared: bool = False):
    files = list_in9_files(root, VARIATIONS, 2, DecodedCache(cache_dir, shared) if cache_dir is not None else None)
    if decoder is not None:
        files.image_set.decoder = decoder
    run = run_in9(model, Runtime(torch.device("cpu")), files, In9Config(batch_size=batch_size, workers=2,
                                                                        progress=False))
    return {name: (r.accuracy, r.predictions.tolist()) for name, r in run.results.items()}


def packs(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


@pytest.mark.slow
def test_second_in9_run_decodes_nothing_and_predicts_the_same(model, data, tmp_path, decodes):
    cache = tmp_path / "cache"
    streamed = in9(model, data, None)
    images = len(decodes)
    assert images == 8 * 9
    cold = in9(model, data, cache)
    assert len(decodes) == 2 * images
    assert [p.split("-")[0] for p in packs(cache)] == ["image"]
    in9(model, data, cache, batch_size=7)  # another batch shape: the cache is per image
    assert len(decodes) == 2 * images
    assert streamed == cold
    assert in9(model, data, cache) == streamed  # at the cold run's batch size: bit for bit


@pytest.mark.slow
def test_a_file_rewritten_under_its_name_misses_and_a_renamed_one_hits(model, data, tmp_path, decodes):
    cache = tmp_path / "cache"
    in9(model, data, cache)
    decodes.clear()
    target = sorted((data / "mixed_rand" / "val").rglob("*.JPEG"))[0]
    source = sorted((data / "original" / "val").rglob("*.JPEG"))[-1]
    shutil.copyfile(source, target)  # the same name, other bytes: new data; its content is cached already
    rotated = sorted((data / "no_fg" / "val").rglob("*.JPEG"))[0]
    with Image.open(source) as image:
        image.convert("RGB").rotate(90).save(rotated, "JPEG")
    changed = in9(model, data, cache)
    assert len(decodes) == 1  # the rotated one alone: the copied one was decoded from `source` before
    assert changed == in9(model, data, None)
    decodes.clear()
    folder = sorted((data / "only_fg" / "val").iterdir())[0]
    first = sorted(folder.iterdir())[0]
    first.rename(folder / f"zz_{first.name}")  # renamed: the same content, found by its hash
    in9(model, data, cache)
    assert decodes == []


@pytest.mark.slow
def test_challenge_after_in9_decodes_no_image(model, data, tmp_path, decodes, monkeypatch):
    cache = tmp_path / "cache"
    in9(model, data, cache)
    decodes.clear()
    reads = []  # masks read from their files, per call
    real = image_sets.load_masks
    monkeypatch.setattr(image_sets, "load_masks",
                        lambda root, relpaths, *rest: reads.append(len(relpaths)) or real(root, relpaths, *rest))
    cold = load_challenge_data(list_challenge_files(data, 2, DecodedCache(cache)), 2, progress=False)
    assert decodes == [] and reads == [9]  # foregrounds (original) and backgrounds (only_bg_t) came from in9
    warm = load_challenge_data(list_challenge_files(data, 2, DecodedCache(cache)), 2, progress=False)
    spot_checked = [1] * SPOT_CHECK_ROWS  # a few cached masks are read again, one at a time, to check the pack
    assert decodes == [] and reads == [9, *spot_checked, 0]  # the masks too, now
    plain = load_challenge_data(list_challenge_files(data, 2), 2, progress=False)
    original = load_challenge_data(list_challenge_files(data, 2, DecodedCache(cache)), 2, progress=False,
                                   arithmetic=MaskArithmetic.ORIGINAL)
    assert reads == [9, *spot_checked, 0, 9, 9]  # another arithmetic: other mask rows
    for got in (cold, warm):
        assert torch.equal(got.fg_images, plain.fg_images) and torch.equal(got.bg_images, plain.bg_images)
        assert torch.equal(got.masks, plain.masks)
    assert torch.equal(original.masks.bool(), plain.masks.bool())


def test_torchvision_pixels_that_differ_from_pillow_are_not_cached(model, data, tmp_path, monkeypatch, caplog):
    real = decoders._torchvision_rgb

    def brighter(raw):
        rgb = real(raw)
        return None if rgb is None else np.minimum(rgb.astype(np.int16) + 1, 255).astype(np.uint8)

    monkeypatch.setattr(decoders, "_torchvision_rgb", brighter)
    cache = tmp_path / "cache"
    in9(model, data, cache, decoder=Decoder.TORCHVISION)
    assert "may differ from the reference decoder's" in caplog.text
    assert packs(cache) == []
    monkeypatch.setattr(decoders, "_torchvision_rgb", real)
    in9(model, data, cache, decoder=Decoder.TORCHVISION)  # equal: kept
    assert len(packs(cache)) == 1


def test_a_stream_left_early_or_failing_leaves_no_pack(data, tmp_path):
    cache = tmp_path / "cache"
    files = list_in9_files(data, ["original"], 1)
    relpaths = [r.relpath for r in files.listings["original"]]
    images = image_sets.ImageSet(data, hashes=files.image_set.hashes, cache=DecodedCache(cache))
    batches = image_sets.iter_decoded_batches(images, relpaths, 4, 1)
    next(batches)
    batches.close()
    assert packs(cache) == []
    (data / relpaths[-1]).write_bytes(b"not an image")
    with pytest.raises(Exception, match="cannot read image"):
        list(image_sets.iter_decoded_batches(images, relpaths, 4, 1))
    assert packs(cache) == []


def test_the_same_pack_written_twice_keeps_one(tmp_path):
    rows = store.Packs(DecodedCache(tmp_path), "mask-binary", (4,))
    writers = [rows.writer(["a" * 64, "b" * 64]) for _ in range(2)]
    for writer in writers:
        writer.put(0, np.arange(4))
        writer.put(1, np.arange(4) + 1)
    first, second = (w.commit() for w in writers)
    assert first == second and packs(tmp_path) == [first.name]
    (hit_a, row_a), (hit_b, row_b) = rows.lookup(["a" * 64, "b" * 64], lambda i: np.arange(4) + i)
    assert hit_a[row_a].tolist() == [0, 1, 2, 3] and hit_b[row_b].tolist() == [1, 2, 3, 4]
    assert store.Packs(DecodedCache(tmp_path), "mask-original", (4,)).lookup(["a" * 64], lambda i: None) == [None]
    incomplete = rows.writer(["c" * 64])
    assert incomplete.commit() is None and packs(tmp_path) == [first.name]


def test_the_rule_for_keeping_decoded_data_on_the_device():
    cuda = torch.device("cuda")
    gib = 1 << 30
    assert image_sets.fits_on_device(4 * gib, cuda, free=16 * gib)  # 4.9 GB of in9 `all` on a free H100: kept
    assert not image_sets.fits_on_device(4 * gib + 1, cuda, free=16 * gib)
    assert not image_sets.fits_on_device(1, torch.device("cpu"), free=16 * gib)  # the CPU streams, as before
    assert not image_sets.fits_on_device(1, None, free=16 * gib)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cached_run_on_the_device_is_kept_there_and_predicts_the_same(model, data, tmp_path, decodes, caplog):
    def run(cache_dir):
        run = run_in9(model, Runtime(torch.device("cuda")),
                      list_in9_files(data, VARIATIONS, 2, DecodedCache(cache_dir) if cache_dir is not None else None),
                      In9Config(batch_size=5, workers=2, progress=False))
        return {name: (r.accuracy, r.predictions.tolist()) for name, r in run.results.items()}

    cache = tmp_path / "cache"
    streamed, cold = run(None), run(cache)
    decodes.clear()
    with caplog.at_level("INFO", logger="tools.data.image_sets"):
        resident = run(cache)
    assert decodes == [] and "kept on cuda" in caplog.text
    assert streamed == cold == resident


def test_a_pack_is_given_its_disk_space_when_it_is_made(tmp_path):
    """Rows go into a mapped file: a sparse one would meet a full disk as a SIGBUS on a later write, killing the
    run; the space is taken when the pack is made, where a full disk is an OSError (a warning)."""
    writer = store.Packs(DecodedCache(tmp_path), "image", (224, 224, 3)).writer([f"{i:064x}" for i in range(20)])
    rows = writer.tmp / "rows.npy"
    assert os.stat(rows).st_blocks * 512 >= os.stat(rows).st_size
    writer.abort()


FULL_DISK = """
import sys, numpy as np
from pathlib import Path
from tools.data import store
packs = store.Packs(store.DecodedCache(Path(sys.argv[1])), "image", (224, 224, 3))
writer = packs.writer([f"{i:064x}" for i in range(40)])
for i in range(40):
    writer.put(i, np.full((224, 224, 3), i, np.uint8))
print("kept:", writer.commit())
"""


@pytest.mark.skipif(subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0
                    if shutil.which("unshare") else True, reason="needs unshare to mount a small tmpfs")
def test_a_full_disk_is_a_warning_not_a_bus_error(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(FULL_DISK)
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "{small}" && '
                           f'"{sys.executable}" "{script}" "{small}/cache"'],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr
    assert "kept: None" in done.stdout and "continuing without it" in done.stderr


def test_a_pack_is_readable_as_the_umask_allows(tmp_path):
    """A cache folder shared by users (--cache-dir on a group folder): a pack's folder gets the umask's mode, as
    a folder made by mkdir, not a private temporary folder's 0700."""
    umask = os.umask(0o022)
    try:
        writer = store.Packs(DecodedCache(tmp_path), "mask-binary", (4,)).writer(["a" * 64])
        writer.put(0, np.arange(4))
        folder = writer.commit()
    finally:
        os.umask(umask)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in folder.iterdir())


def test_a_file_rewritten_after_it_was_hashed_is_not_cached_under_the_old_hash(data, tmp_path):
    """Files listed (hashed) once and decoded later from disk (a listing's bytes already given back, as after a
    first run, or training's hashing pass): a file rewritten in between must not put its pixels under the hash
    of the bytes it held when listed, where a later run with those bytes would find them."""
    cache = tmp_path / "cache"
    files = list_challenge_files(data, 1)
    files.image_set.contents.clear()
    image, mask = data / files.foregrounds[0].image_relpath, data / files.foregrounds[0].mask_relpath
    kept_image, kept_mask = image.read_bytes(), mask.read_bytes()
    shutil.copyfile(data / files.backgrounds[0].relpath, image)
    np.save(mask, ~np.load(mask).astype(bool))
    files.image_set.cache = DecodedCache(cache)
    load_challenge_data(files, 1, progress=False)
    image.write_bytes(kept_image)
    mask.write_bytes(kept_mask)
    cached = load_challenge_data(list_challenge_files(data, 1, DecodedCache(cache)), 1, progress=False)
    plain = load_challenge_data(list_challenge_files(data, 1), 1, progress=False)
    assert torch.equal(cached.fg_images, plain.fg_images) and torch.equal(cached.masks, plain.masks)


LOCKED = """
import os, sys
from pathlib import Path
import numpy as np
from tools.data import store
if os.geteuid() == 0:  # root reads everything: look as nobody
    os.setgid(65534)
    os.setuid(65534)
packs = store.Packs(store.DecodedCache(Path(sys.argv[1])), "image", (2,))
print("found:", packs.lookup(["a" * 64], lambda i: None))
writer = packs.writer(["a" * 64])
writer.put(0, np.zeros(2))
print("kept:", writer.commit())
"""


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX permissions")
def test_a_cache_folder_that_cannot_be_reached_is_a_warning(tmp_path):
    """--cache-dir under a folder the user may not enter: `is_dir` raises there before Python 3.12."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    locked.chmod(0)
    script = tmp_path / "look.py"
    script.write_text(LOCKED)
    try:
        done = subprocess.run([sys.executable, str(script), str(locked / "cache")], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    finally:
        locked.chmod(0o700)
    assert done.returncode == 0, done.stderr
    assert "found: [None]" in done.stdout and "kept: None" in done.stdout
    assert "continuing without it" in done.stderr


@pytest.mark.parametrize("code, kept", [(errno.ENOSPC, False), (errno.EOPNOTSUPP, True)])
def test_a_file_system_without_fallocate_still_caches(tmp_path, monkeypatch, code, kept):
    """Where the space cannot be taken ahead (musl's posix_fallocate on a file system without it), the pack is
    written as before; a full disk is still no pack."""
    def refuse(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse, raising=False)
    writer = store.Packs(DecodedCache(tmp_path), "mask-binary", (4,)).writer(["a" * 64])
    writer.put(0, np.arange(4))
    assert (writer.commit() is not None) == kept


@pytest.mark.parametrize("names", [np.arange(2), np.array(["a" * 64, "b" * 64]), np.zeros((2, 2), "S64"),
                                   np.array(b"a" * 64)], ids=["ints", "unicode", "2-d", "0-d"])
def test_a_pack_whose_hashes_are_not_a_list_of_hashes_is_ignored_with_a_warning(names, tmp_path, caplog):
    """A damaged pack (its hashes.npy readable, but not the 1-d bytes array a pack writes) is passed over with a
    warning, as an unreadable one is, not a traceback."""
    rows = store.Packs(DecodedCache(tmp_path), "mask-binary", (4,))
    writer = rows.writer(["a" * 64, "b" * 64])
    writer.put(0, np.arange(4))
    writer.put(1, np.arange(4))
    folder = writer.commit()
    np.save(folder / "hashes.npy", names)
    with caplog.at_level("WARNING", logger="tools.data.store"):
        assert rows.lookup(["a" * 64], lambda i: np.arange(4)) == [None]
    assert "ignoring" in caplog.text and folder.name in caplog.text


# ----------------------------------------------------------------------------------------------------------
# A pack proves itself before its rows are used: its owner, its name, its rows' digests, a spot check


def original_images(data: Path, cache_dir: Path | None, shared: bool = False) -> torch.Tensor:
    """`original`'s images as a run decodes them, through the decoded-data cache in `cache_dir` (None: none)."""
    files = list_in9_files(data, ["original"], 1)
    images = image_sets.ImageSet(data, hashes=files.image_set.hashes,
                                 cache=DecodedCache(cache_dir, shared) if cache_dir is not None else None)
    return image_sets.decode_images(images, [r.relpath for r in files.listings["original"]], 1, progress=False)


def the_pack(cache: Path) -> Path:
    [pack] = [p for p in cache.iterdir() if p.name.startswith("image-")]
    return pack


def reverse_rows(pack: Path) -> None:
    """The pack's rows in reverse order, and their digests with them, as a forger who knows the format writes it."""
    for name in ("rows.npy", ROW_DIGESTS):
        np.save(pack / name, np.load(pack / name)[::-1].copy())


def new_process() -> None:
    store.forget_checks()  # every pack checked again, as by a new process


def warnings_naming(caplog, folder: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and str(folder) in r.getMessage()]


def test_a_pack_copied_under_a_name_that_sorts_first_is_ignored_with_one_warning(model, data, tmp_path, caplog):
    """A copy of a pack, its rows (and their digests) reversed, under a name that sorts before the real one: it
    gave in9's `original` 11.11% instead of 100.00% without a word. Its name is not the digest of its content."""
    cache = tmp_path / "cache"
    streamed = in9(model, data, None)
    plain = original_images(data, None)
    in9(model, data, cache)
    pack, copy = the_pack(cache), cache / f"image-{'0' * 24}-v{store.STORE_VERSION}"
    shutil.copytree(pack, copy)
    reverse_rows(copy)
    assert copy.name < pack.name and not np.array_equal(np.load(copy / "rows.npy"), np.load(pack / "rows.npy"))
    new_process()
    with caplog.at_level("WARNING"):
        assert in9(model, data, cache) == streamed
        assert torch.equal(original_images(data, cache), plain)
    [warning] = warnings_naming(caplog, copy)
    assert "its name is not the digest of what it holds" in warning


def test_a_pack_forged_with_matching_digests_fails_the_spot_check_and_is_written_over(data, tmp_path, caplog,
                                                                                      decodes):
    """The pack itself rewritten, rows and digests reversed alike: name and digests agree, but a few rows decoded
    again from their files do not. The run decodes the images, and its own pack replaces the forged one."""
    cache = tmp_path / "cache"
    plain = original_images(data, None)
    original_images(data, cache)
    reverse_rows(the_pack(cache))
    new_process()
    decodes.clear()
    with caplog.at_level("WARNING"):
        assert torch.equal(original_images(data, cache), plain)
    [warning] = warnings_naming(caplog, the_pack(cache))
    assert "is not what its file decodes to" in warning and len(decodes) == len(plain)
    new_process()
    decodes.clear()
    caplog.clear()
    assert torch.equal(original_images(data, cache), plain) and decodes == []  # the pack written over it
    assert not warnings_naming(caplog, the_pack(cache))


def test_zeroed_bytes_in_a_packs_rows_are_never_served(data, tmp_path, caplog):
    """1,000 zeroed bytes inside `rows.npy` (a bad copy, bit rot) were served on every read: the rows no longer
    match their digests, so the pack is ignored with one warning and the images decoded."""
    cache = tmp_path / "cache"
    plain = original_images(data, None)
    original_images(data, cache)
    pack = the_pack(cache)
    with open(pack / "rows.npy", "r+b") as fh:
        np.lib.format.read_magic(fh)
        np.lib.format.read_array_header_1_0(fh)
        fh.seek(fh.tell() + 3 * plain[0].numel() + 5000)
        fh.write(bytes(1000))
    new_process()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert torch.equal(original_images(data, cache), plain)
    [warning] = warnings_naming(caplog, pack)
    assert "1 of the 9 row(s) used do not match their SHA-256" in warning


FOREIGN = {"rows file writable by its group": lambda cache, pack: (pack / "rows.npy").chmod(0o664),
           "pack writable by everyone": lambda cache, pack: pack.chmod(0o777),
           "cache folder writable by its group": lambda cache, pack: cache.chmod(0o775),
           "another user's pack": lambda cache, pack: os.chown(pack / "hashes.npy", 65534, -1)}


@pytest.mark.skipif(not OWNERS_CHECKED, reason="POSIX owners and modes")
@pytest.mark.parametrize("how", FOREIGN)
@pytest.mark.slow
def test_what_another_user_could_have_written_is_used_only_in_a_shared_cache(how, data, tmp_path, caplog, decodes):
    if how == "another user's pack" and os.geteuid() != 0:
        pytest.skip("only root can give a file away")
    cache = tmp_path / "cache"
    plain = original_images(data, None)
    original_images(data, cache)
    FOREIGN[how](cache, the_pack(cache))
    before = packs(cache)
    new_process()
    decodes.clear()
    with caplog.at_level("WARNING"):
        assert torch.equal(original_images(data, cache), plain)
    assert len(decodes) == len(plain) and packs(cache) == before  # nothing read, nothing written beside it
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "--shared-cache" in warning and str(cache) in warning
    new_process()
    decodes.clear()
    assert torch.equal(original_images(data, cache, shared=True), plain) and decodes == []


def test_a_private_cache_is_written_for_this_user_alone_and_a_shared_one_as_the_umask_says(data, tmp_path):
    """A user whose umask lets the group write (Debian's default for user-private groups): a private cache's new
    folder and packs are not group-writable, so they pass the owner check; a shared cache's keep the umask's mode."""
    umask = os.umask(0o002)
    try:
        for shared in (False, True):
            cache = tmp_path / f"cache-{shared}"
            original_images(data, cache, shared)
            modes = {stat.S_IMODE(p.stat().st_mode) for p in [cache, the_pack(cache), *the_pack(cache).iterdir()]}
            assert modes == ({0o755, 0o644} if not shared else {0o775, 0o664}), (shared, modes)
    finally:
        os.umask(umask)


@pytest.mark.slow
def test_the_provenance_records_the_cache_and_whether_it_is_shared(model, data, tmp_path):
    files = list_in9_files(data, ["original"], 1)
    for cache in (None, DecodedCache(tmp_path / "cache"), DecodedCache(tmp_path / "cache", shared=True)):
        files.image_set.cache = cache
        run = run_in9(model, Runtime(torch.device("cpu")), files, In9Config(("original",), 5, 1, progress=False))
        assert run.provenance["decoded_cache"] == (None if cache is None else
                                                   {"folder": str(tmp_path / "cache"), "shared": cache.shared})
        loaded = load_challenge_data(list_challenge_files(data, 1, cache), 1, progress=False)
        challenge = run_challenge(model, Runtime(torch.device("cpu")), loaded, ChallengeConfig(batch_size=9,
                                                                                                progress=False))
        assert loaded.image_set.cache is cache
        assert challenge.provenance["decoded_cache"] == run.provenance["decoded_cache"]


@pytest.mark.slow
def test_a_command_that_writes_to_the_cache_says_once_where_and_how_much(data, color_ts, tmp_path, capsys):
    """in9_eval fills the cache with its images, challenge_eval then adds its masks (its images are in9's), a
    second in9_eval adds nothing: each says once, at the end, how much it wrote and where."""
    cache = tmp_path / "cache"
    argv = ["--data-path", str(data), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device", "cpu",
            "--no-progress",
            "--workers", "1", "--cache-dir", str(cache)]
    sizes = []
    for main, extra in ((in9_eval.main, ["--eval-dataset", "all", "--output-dir", str(tmp_path / "in9")]),
                        (challenge_eval.main, ["--output-dir", str(tmp_path / "challenge")]),
                        (in9_eval.main, ["--eval-dataset", "all", "--output-dir", str(tmp_path / "again")])):
        code, _, err = run_in_process(main, [*argv, *extra], capsys)
        assert code == 0, err
        sizes.append(cache_admin.survey(cache).size - sum(sizes))
        said = [line for line in err.splitlines() if "decoded data cached" in line]
        assert said == ([f"INFO: decoded data cached: {cache_admin.format_size(sizes[-1])} in {cache} (`python -m "
                         f"tools.data cache` lists the cache, `--max-size` bounds it; --no-cache skips it)"]
                        if sizes[-1] else []), err
        assert not said or err.rstrip().splitlines()[-1] == said[0]  # at the end
    assert sizes[0] > 72 * 224 * 224 * 3 and 0 < sizes[1] < 9 * 224 * 224 and sizes[2] == 0


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.slow
def test_a_pack_whose_rows_are_a_link_is_used_in_no_cache(shared, data, tmp_path, caplog, decodes):
    """The cache never writes a link: a pack's rows file that is one (to rows kept elsewhere, here another
    pack's, reversed) is not read, shared cache or not, and is not removed by the cache command either."""
    cache = tmp_path / "cache"
    plain = original_images(data, None)
    original_images(data, cache, shared)
    pack = the_pack(cache)
    elsewhere = tmp_path / "elsewhere.npy"
    np.save(elsewhere, np.load(pack / "rows.npy")[::-1].copy())
    (pack / "rows.npy").unlink()
    (pack / "rows.npy").symlink_to(elsewhere)
    new_process()
    decodes.clear()
    with caplog.at_level("WARNING"):
        assert torch.equal(original_images(data, cache, shared), plain)
    [warning] = warnings_naming(caplog, pack)
    assert "symbolic link" in warning and len(decodes) == len(plain)
    with pytest.raises(UserError, match="does not look like the decoded-data cache"):
        cache_admin.clear(cache)
    assert (pack / "rows.npy").is_symlink() and elsewhere.is_file()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
@pytest.mark.parametrize("name", store.PACK_FILES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.slow
def test_a_pack_file_that_is_a_fifo_is_refused_not_waited_on(shared, name, data, tmp_path, caplog, decodes):
    """A pack's file replaced by a FIFO (in a shared cache, any user can make one): opening it to read would wait
    for a writer forever, hanging every run that looks in the cache. It is not read: the images are decoded."""
    import threading  # noqa: PLC0415
    cache = tmp_path / "cache"
    plain = original_images(data, None)
    original_images(data, cache, shared)
    pack = the_pack(cache)
    (pack / name).unlink()
    os.mkfifo(pack / name)
    new_process()
    decodes.clear()
    got = []
    with caplog.at_level("WARNING"):
        reader = threading.Thread(target=lambda: got.append(original_images(data, cache, shared)), daemon=True)
        reader.start()
        reader.join(timeout=60)
        if reader.is_alive():  # let it go: a writer that closes at once ends its read
            os.close(os.open(pack / name, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(timeout=10)
            pytest.fail(f"the run waited on the FIFO {name}")
    assert torch.equal(got[0], plain) and len(decodes) == len(plain)
    assert any(name in message and "regular file" in message for message in warnings_naming(caplog, pack))
