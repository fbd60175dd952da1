"""`python -m tools.data cache` (tools.data.cache_admin) on caches the real writers filled: the listing's numbers,
the least recently used removed first (readers mark what they use), --clear, the packs this version cannot read,
the temporary folders of running writers kept and of stopped ones removed, a pack removed under a reader's feet a
miss and never a half pack, and bad input in one line."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import check_error, run_in_process
from tools.data import cache_admin, image_sets, store, synthetic, temporary
from tools.data.cli import main
from tools.data.store import DecodedCache
from tools.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DAY = 24 * 3600


def hashes(*names: str) -> list[str]:
    return [hashlib.sha256(name.encode()).hexdigest() for name in names]


def write_pack(cache: Path, kind: str, names: list[str], row_shape=(16,)) -> Path:
    """A pack written by the store's own writer, row i filled with i."""
    writer = store.Packs(DecodedCache(cache), kind, row_shape).writer(hashes(*names))
    for i in range(len(names)):
        writer.put(i, np.full(row_shape, i, np.uint8))
    folder = writer.commit()
    assert folder is not None
    return folder


def unchecked(index: int) -> None:
    """The spot check's reference where these tests look packs up: none (their rows are no files' pixels; the checks
    a pack passes are tested in test_data_store.py)."""
    return None


def files_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def used_days_ago(folder: Path, days: float) -> None:
    when = time.time() - days * DAY
    os.utime(folder / "meta.json", (when, when))


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True).stdout)


def listing(cache: Path, capsys, *flags: str) -> list[str]:
    code, out, err = run_in_process(main, ["cache", "--cache-dir", str(cache), *flags], capsys)
    assert code == 0, err
    return out.splitlines()


def row_of(lines: list[str], kind: str) -> list[str]:
    """The cells of the table's line for `kind` (the kind's words, then its numbers)."""
    found = [line for line in lines if line.startswith(kind + "  ")]
    assert len(found) == 1, lines
    return found[0][len(kind):].split()


def test_the_listing_counts_what_real_runs_cached(tmp_path, capsys):
    data = synthetic.generate(tmp_path / "data", per_class=1, seed=3).root
    images = sorted(p.relative_to(data).as_posix() for p in (data / "original").rglob("*.JPEG"))
    masks = sorted(p.relative_to(data).as_posix() for p in (data / "fg_mask").rglob("*.npy"))
    cache = tmp_path / "cache"
    image_sets.decode_cached(image_sets.ImageSet(data, cache=DecodedCache(cache)), {"original": images}, masks,
                             workers=1, progress=False)
    store.CacheEntry(cache / "clip-heads", "a" * 32, {"format": 1}, "CLIP text head").save(
        {"head": np.zeros((9, 8), np.float32)})
    store.CacheEntry(cache, "b" * 24 + "-binary-v4", {"fingerprint": "f"}, "decoded data").save({"masks": np.zeros(3)})
    contents = cache_admin.survey(cache)
    by_kind = {}
    for entry in contents.entries:
        by_kind.setdefault(entry.kind, []).append(entry)
    assert sorted(by_kind) == ["clip-heads", "image", "mask-binary", cache_admin.EARLIER_KIND]
    [image], [mask], [head], [earlier] = (by_kind[k] for k in ("image", "mask-binary", "clip-heads",
                                                               cache_admin.EARLIER_KIND))
    assert image.rows == len(images) == 9 and mask.rows == len(masks) == 9 and head.rows is None
    assert image.size == files_size(image.path) > 9 * 224 * 224 * 3 and mask.size == files_size(mask.path)
    assert image.readable and mask.readable and head.readable and not earlier.readable
    assert contents.size == files_size(cache)
    lines = listing(cache, capsys)
    assert lines[0] == f"decoded-data cache at {cache}"
    assert row_of(lines, "image") == ["1", "9", cache_admin.format_size(image.size), time.strftime("%Y-%m-%d")]
    assert row_of(lines, "mask-binary")[:2] == ["1", "9"] and row_of(lines, "clip-heads")[:2] == ["1", "-"]
    assert row_of(lines, f"{cache_admin.EARLIER_KIND} (unreadable*)")[:2] == ["1", "-"]
    assert row_of(lines, "total")[:3] == ["4", "18", cache_admin.format_size(files_size(cache))]
    assert any(line.startswith("* damaged, or of a version before packs") for line in lines)


def test_packs_of_another_build_or_version_are_kept_apart_and_only_what_none_reads_is_unreadable(tmp_path, monkeypatch,
                                                                                                capsys):
    """Another install sharing the cache (another venv's Pillow, an older or newer toolkit) still reads the packs of
    its decoder build or format version: they are listed apart and evicted by last use; `--unreadable` removes only
    the damaged packs and the pre-pack entries, which no version reads."""
    cache = tmp_path / "cache"
    current = write_pack(cache, "image", ["a", "b"])
    with monkeypatch.context() as patch:
        patch.setattr(store, "reference_build", lambda: "Pillow 9.0.0, libjpeg 8d")  # another decoder build
        other_build = write_pack(cache, "image", ["c"])
    with monkeypatch.context() as patch:
        patch.setattr(store, "STORE_VERSION", store.STORE_VERSION + 1)  # a later format
        later = write_pack(cache, "mask-binary", ["d"])
    damaged = write_pack(cache, "image", ["e"])
    (damaged / "meta.json").write_text("{")
    earlier = store.CacheEntry(cache, "b" * 24 + "-binary-v4", {"fingerprint": "f"}, "decoded data")
    earlier.save({"masks": np.zeros(3)})
    # the marking agrees with what the reader reads
    found = store.Packs(DecodedCache(cache), "image", (16,)).lookup(hashes("a", "c", "e"), unchecked)
    assert [hit is not None for hit in found] == [True, False, False]
    assert row_of(listing(cache, capsys), "image (unreadable*)")[:2] == ["1", "0"]  # a damaged pack's rows unknown
    lines = listing(cache, capsys, "--unreadable")
    assert sorted(p.name for p in cache.iterdir()) == sorted([current.name, other_build.name, later.name])
    assert lines[0].startswith("removed 1 pack(s), 1 other entry")
    assert row_of(lines, "image (other build/version**)")[:2] == ["1", "1"]
    assert row_of(lines, "mask-binary (other build/version**)")[:2] == ["1", "1"]
    entries = {e.path.name: (e.readable, e.unreadable) for e in cache_admin.survey(cache).entries}
    assert entries == {current.name: (True, False), other_build.name: (False, False), later.name: (False, False)}
    # --max-size: by last use alone; the other build's pack, used today, outlives this build's older one
    used_days_ago(current, 3)
    used_days_ago(later, 5)
    lines = listing(cache, capsys, "--max-size", str(files_size(other_build)))
    assert sorted(p.name for p in cache.iterdir()) == [other_build.name]
    with monkeypatch.context() as patch:
        patch.setattr(store, "reference_build", lambda: "Pillow 9.0.0, libjpeg 8d")  # the other install reads it
        assert store.Packs(DecodedCache(cache), "image", (16,)).lookup(hashes("c"), unchecked)[0] is not None


def test_max_size_removes_the_least_recently_used_as_readers_mark_them(tmp_path, capsys):
    cache = tmp_path / "cache"
    packs = {name: write_pack(cache, "image", [name], row_shape=(4096,)) for name in "abcd"}
    for name, days in zip("abcd", (3, 10, 5, 20)):  # written long ago, in another order than the names'
        used_days_ago(packs[name], days)
    store.Packs(DecodedCache(cache), "image", (4096,)).lookup(hashes("d"), unchecked)  # d, the oldest, is read today
    assert time.time() - (packs["d"] / "meta.json").stat().st_mtime < 60
    sizes = {name: files_size(folder) for name, folder in packs.items()}
    # least recently used first: b (10 days), c (5), a (3), d (today); room for two packs
    order = [e.path for e in cache_admin.eviction_order(cache_admin.survey(cache).entries)]
    assert order == [packs[name] for name in "bcad"]
    bound = sizes["a"] + sizes["d"]
    lines = listing(cache, capsys, "--max-size", str(bound))
    assert lines[0].startswith("removed 2 pack(s)")
    assert sorted(p.name for p in cache.iterdir()) == sorted([packs["a"].name, packs["d"].name])
    assert cache_admin.survey(cache).size <= bound
    listing(cache, capsys, "--max-size", "1G")  # fits: nothing removed
    assert len(list(cache.iterdir())) == 2


def test_a_reader_marks_a_pack_at_most_once_a_day_and_never_fails_to(tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    folder = write_pack(cache, "image", ["a"])
    rows = store.Packs(DecodedCache(cache), "image", (16,))

    def last_used() -> float:
        return (folder / "meta.json").stat().st_mtime

    used_days_ago(folder, 0.5)
    before = last_used()
    assert rows.lookup(hashes("a"), unchecked)[0] is not None
    assert last_used() == before  # marked within the day: not again
    used_days_ago(folder, 1.5)
    before = last_used()
    assert rows.lookup(hashes("b"), unchecked) == [None] and last_used() == before  # a pack that gave nothing: unused
    rows.lookup(hashes("a"), unchecked)
    assert time.time() - last_used() < 60

    def read_only(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    used_days_ago(folder, 2)
    monkeypatch.setattr(store.os, "utime", read_only)
    with caplog.at_level(logging.INFO, logger="tools.data.store"):
        hit = rows.lookup(hashes("a"), unchecked)[0]
    assert hit is not None and hit[0][hit[1]].tolist() == [0] * 16 and "WARNING" not in caplog.text


def aged(folder: Path, days: float) -> Path:
    """`folder` and everything in it last changed `days` ago."""
    when = time.time() - days * DAY
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (when, when))
    return folder


def writer_folder(parent: Path, host: str, pid: int) -> Path:
    """A cache writer's temporary folder, named as `temporary.temporary_entry` names them, holding a rows file."""
    folder = parent / f".tmp-{host}@{pid}@{os.urandom(8).hex()}"
    folder.mkdir()
    (folder / "rows.npy").write_bytes(b"\0" * 1000)
    return folder


def test_clear_keeps_the_folder_and_running_writers_and_removes_stopped_ones(tmp_path, capsys):
    """Stopped: a writer of this host whose process is gone; any writer, of whatever host, unchanged for more than a
    day (a killed run in a container, whose host name changes on every start; an older version's, named without
    host or process). Kept: this host's running writers, and another host's that still changes."""
    cache = tmp_path / "cache"
    write_pack(cache, "image", ["a"])
    write_pack(cache, "mask-original", ["a"])
    store.CacheEntry(cache / "clip-heads", "c" * 32, {"format": 1}, "CLIP text head").save({"head": np.ones(3)})
    host = socket.gethostname()
    running = [writer_folder(cache, host, os.getpid()), writer_folder(cache / "clip-heads", host, os.getpid())]
    running.append(aged(writer_folder(cache, host, os.getpid()), 0.5))  # writing still, untouched for hours
    stopped = [writer_folder(cache, host, dead_pid()), writer_folder(cache / "clip-heads", host, dead_pid())]
    stopped.append(aged(writer_folder(cache, "b1946ac92492", dead_pid()), 1.5))  # a container's, a run ago
    legacy = cache / ".tmp-k2v9x_q1"  # an older version's writer (mkdtemp's name, no host or process)
    legacy.mkdir()
    (legacy / "rows.npy").write_bytes(b"\0" * 1000)
    stopped.append(aged(legacy, 2))
    elsewhere = [writer_folder(cache, "other-host", dead_pid())]  # a shared disk: a writer that still changes
    contents = cache_admin.survey(cache)
    assert sorted(t.path for t in contents.temporaries if t.live) == sorted(running + elsewhere)
    assert sorted(t.path for t in contents.temporaries if not t.live) == sorted(stopped)
    lines = listing(cache, capsys)
    assert "4 writer(s) at work, kept (3.9K, in the total)" in lines
    lines = listing(cache, capsys, "--clear")
    assert lines[0] == "removed 2 pack(s), 1 other entry and 4 stopped writer folder(s): " + \
        cache_admin.format_size(contents.size - 4000)
    left = sorted(p for p in cache.rglob("*") if p.is_dir())
    assert left == sorted([cache / "clip-heads", *running, *elsewhere])
    assert row_of(lines, "total") == ["0", "0", "3.9K", "-"]
    gone = aged(writer_folder(cache, "f3a8c1d09e77", dead_pid()), 3)  # an ordinary run removes them too
    store.Packs(DecodedCache(cache), "image", (16,)).lookup(hashes("a"), unchecked)
    assert not gone.exists() and all(folder.exists() for folder in running + elsewhere)


def test_a_pack_removed_while_a_reader_looks_it_up_is_a_miss_and_decoded_again(tmp_path, monkeypatch, caplog):
    data = synthetic.generate(tmp_path / "data", per_class=1, seed=4).root
    relpaths = sorted(p.relative_to(data).as_posix() for p in (data / "original").rglob("*.JPEG"))
    content = {rel: hashlib.sha256((data / rel).read_bytes()).hexdigest() for rel in relpaths}
    cache = tmp_path / "cache"

    def decoded() -> torch.Tensor:
        images = image_sets.ImageSet(data, hashes=content, cache=DecodedCache(cache))
        return torch.cat([b for _, b in image_sets.iter_decoded_batches(images, relpaths, 4, 1)])

    expected = decoded()
    [pack] = [p for p in cache.iterdir()]
    mapped = store.Packs(DecodedCache(cache), "image", (224, 224, 3)).lookup([content[relpaths[0]]], unchecked)[0]
    real_load = np.load
    for moment in ("listed", "hashes read"):
        def remove_then(*args, **kwargs):  # the pack is removed after its folder was listed, or its hashes read
            if moment == "hashes read":  # noqa: B023
                value = real_load(*args, **kwargs)
                cache_admin.remove_entry(pack)  # noqa: B023
                return value
            cache_admin.remove_entry(pack)  # noqa: B023
            return real_load(*args, **kwargs)

        monkeypatch.setattr(store.np, "load", remove_then)
        with caplog.at_level(logging.INFO, logger="tools.data.store"):
            again = decoded()
        monkeypatch.setattr(store.np, "load", real_load)
        assert torch.equal(again, expected), moment
        assert "removed while it was read" in caplog.text and "WARNING" not in caplog.text, caplog.text
        caplog.clear()
        [pack] = [p for p in cache.iterdir()]  # what this reader decoded again, cached
    # rows mapped before their pack was removed stay readable (a removed file lives on while mapped)
    cache_admin.remove_entry(pack)
    rows, row = mapped
    assert not pack.exists() and np.array_equal(rows[row], expected[0].permute(1, 2, 0).numpy())


def test_a_removal_renames_first_and_what_a_killed_one_leaves_goes_as_a_dead_writers(tmp_path):
    cache = tmp_path / "cache"
    pack = write_pack(cache, "image", ["a"])
    code = ("import os, shutil, sys; from pathlib import Path; from tools.data import cache_admin\n"
            "shutil.rmtree = lambda path, **kw: os._exit(9)  # killed between the rename and the delete\n"
            "cache_admin.remove_entry(Path(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-c", code, str(pack)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    [left] = list(cache.iterdir())
    assert not pack.exists() and (left / "rows.npy").is_file()
    assert temporary.ENTRY_NAMES.owner(left.name)[0] == socket.gethostname() and "@removing-" in left.name
    assert store.Packs(DecodedCache(cache), "image", (16,)).lookup(hashes("a"), unchecked) == [None]  # not a pack;
    assert list(cache.iterdir()) == []  # and removed by this use, as a dead writer's folder


@pytest.mark.parametrize("deletable", [0, 1])  # files deleted before the failure
def test_a_pack_that_cannot_be_deleted_is_reported_and_put_back_where_nothing_went(deletable, tmp_path, monkeypatch,
                                                                                   capsys):
    """Another user's files, an immutable flag: the removal fails. It is reported (exit 1), not counted as
    removed; a pack of which nothing was deleted is renamed back and still read; a half-deleted one is left under
    the removing name, listed as a stopped writer's folder, not as a writer at work."""
    cache = tmp_path / "cache"
    pack = write_pack(cache, "image", ["a", "b"])
    real_unlink, deleted = os.unlink, []

    def refused(path, *args, **kwargs):
        if len(deleted) >= deletable:
            raise PermissionError(1, "Operation not permitted", str(path))
        deleted.append(path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refused)
    code, out, err = run_in_process(main, ["cache", "--cache-dir", str(cache), "--clear"], capsys)
    monkeypatch.setattr(os, "unlink", real_unlink)
    lines = out.splitlines()
    assert code == 1, err
    assert lines[0].startswith("removed 0 pack(s)"), lines
    assert any(line.startswith(f"could not remove {pack}: ") and "Operation not permitted" in line
               for line in lines), lines
    assert not any("writer(s) at work" in line for line in lines), lines
    if deletable == 0:
        assert [p.name for p in cache.iterdir()] == [pack.name]
        assert store.Packs(DecodedCache(cache), "image", (16,)).lookup(hashes("a"), unchecked)[0] is not None
    else:
        [left] = [p for p in cache.iterdir() if p.name.startswith(temporary.ENTRY_PREFIX)]
        assert "@removing-" in left.name and "1 folder(s) of stopped writers" in " ".join(lines)
        assert [p.name for p in cache.iterdir()] == [left.name]


def test_a_cache_folder_that_may_not_be_looked_at_is_one_line(tmp_path, monkeypatch, capsys):
    """`--cache-dir /root/x` for a user who may not enter /root: Path.exists raises PermissionError."""
    cache = tmp_path / "locked" / "cache"
    real_stat = Path.stat

    def refused(self, *args, **kwargs):
        if self == cache:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", refused)
    for flags in ([], ["--clear"]):
        line = check_error(*run_in_process(main, ["cache", "--cache-dir", str(cache), *flags], capsys))
        assert f"cannot read the cache folder {cache}" in line and "Permission denied" in line, line


@pytest.mark.parametrize("text, size", [("20G", 20 * 2**30), ("500M", 500 * 2**20), ("1.5K", 1536), ("1024", 1024),
                                        ("2GiB", 2 * 2**30), ("3gb", 3 * 2**30), ("0", 0), (".5T", 2**39)])
def test_sizes_read_as_du_writes_them(text, size):
    assert cache_admin.parse_size(text) == size
    assert cache_admin.parse_size(cache_admin.format_size(size)) == size if size in (0, 1024, 1536) else True


@pytest.mark.parametrize("argv, says", [
    (["--max-size", "20X"], "argument --max-size: '20X' is not a size such as 20G"),
    (["--max-size=-1G"], "argument --max-size: '-1G' is not a size"),
    (["--max-size", "9" * 400], "is not a size"),  # beyond a float: an OverflowError traceback before
    (["--clear", "--max-size", "1G"], "not allowed with argument --clear"),
])
def test_bad_flags_are_one_line(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cache", "--cache-dir", str(tmp_path), *argv])
    line = check_error(exc.value.code, *capsys.readouterr())
    assert says in line and line.endswith(" cache -h`"), line


def test_a_folder_that_is_not_a_cache_is_refused_and_left_alone(tmp_path, capsys):
    home = tmp_path / "home"
    write_pack(home, "image", ["a"])
    (home / "notes.txt").write_text("mine")
    (home / "photos").mkdir()
    (home / "photos" / "cat.jpg").write_bytes(b"x")
    for flags in ([], ["--clear"], ["--max-size", "0"]):
        line = check_error(*run_in_process(main, ["cache", "--cache-dir", str(home), *flags], capsys))
        assert f"{home} does not look like the decoded-data cache: it holds {home / 'notes.txt'} and 1 more" in line
    assert len(list(home.iterdir())) == 3
    line = check_error(*run_in_process(main, ["cache", "--cache-dir", str(home / "notes.txt")], capsys))
    assert "is not a folder" in line
    assert listing(tmp_path / "never-made", capsys)[0].endswith("(not made yet: empty)")
    with pytest.raises(UserError, match="does not look like"):
        cache_admin.clear(home)


def project_folder(home: Path) -> dict[Path, bytes]:
    """What a user keeps in an ordinary folder that a mistyped --cache-dir names: a project with a meta.json and its
    sources, a `.tmp-notes/` folder, and folders that take the cache's temporary names but hold the user's files;
    with every file's content, to see that none went."""
    host = socket.gethostname()
    files = {home / "myproject" / "meta.json": b'{"name": "mine"}', home / "myproject" / "src" / "main.py": b"print()",
             home / ".tmp-notes" / "notes.txt": b"keep", home / ".tmp-notes2" / "todo.npy": b"mine",
             home / f".tmp-{host}@{dead_pid()}@{'0' * 16}" / "src" / "main.py": b"not the cache's",
             home / f".tmp-{host}@{dead_pid()}@{'0' * 16}" / "notes.txt": b"not the cache's"}
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    for path in files:
        aged(path.parent, 30)  # untouched for a month: stale, were they the cache's
    return files


def left_alone(files: dict[Path, bytes]) -> bool:
    return all(path.is_file() and path.read_bytes() == content for path, content in files.items())


@pytest.mark.parametrize("flags", [[], ["--clear"], ["--max-size", "0"], ["--unreadable"]])
@pytest.mark.slow
def test_an_ordinary_folder_is_refused_and_nothing_in_it_removed(flags, tmp_path, capsys):
    """`cache --clear` on a folder that is not the cache (a project with a meta.json, a `.tmp-notes/`, folders
    named like the cache's temporaries but holding other files): one error line, nothing removed, though some
    packs are there too."""
    home = tmp_path / "home"
    pack = write_pack(home, "image", ["a"])
    files = project_folder(home)
    line = check_error(*run_in_process(main, ["cache", "--cache-dir", str(home), *flags], capsys))
    assert f"{home} does not look like the decoded-data cache: it holds " in line, line
    assert left_alone(files) and (pack / "rows.npy").is_file()


@pytest.mark.slow
def test_a_run_with_its_cache_in_an_ordinary_folder_removes_nothing_of_it(tmp_path):
    """An in9 run, a challenge run and CLIP's text heads with --cache-dir on a user's folder: they add their packs
    and entries, and remove nothing of the user's, whatever its names."""
    data = synthetic.generate(tmp_path / "data", per_class=1, seed=3).root
    home = tmp_path / "home"
    files = project_folder(home)
    files.update(project_folder(home / "clip-heads"))
    relpaths = sorted(p.relative_to(data).as_posix() for p in (data / "original").rglob("*.JPEG"))
    masks = sorted(p.relative_to(data).as_posix() for p in (data / "fg_mask").rglob("*.npy"))
    for _ in range(2):  # writing, then reading
        image_sets.decode_cached(image_sets.ImageSet(data, cache=DecodedCache(home)), {"original": relpaths}, masks,
                                 workers=1, progress=False)
        entry = store.CacheEntry(home / "clip-heads", "c" * 32, {"format": 1}, "CLIP text head")
        if entry.load(["head"]) is None:
            entry.save({"head": np.ones(3)})
    assert left_alone(files)
    assert len([p for p in home.iterdir() if cache_admin.PACK_NAME.fullmatch(p.name)]) == 2  # images and masks


@pytest.mark.parametrize("prefix", [".extract-", ".built.building-"])
def test_a_temporary_folder_left_alone_unless_its_name_is_exactly_a_writers(prefix, tmp_path):
    """The build's and the extraction's clean-up removes a dead writer's folder, named `<prefix><host>-<pid>-<8
    hex>`, and nothing else that starts with its prefix."""
    host = socket.gethostname()
    dead = tmp_path / f"{prefix}{host}-{dead_pid()}-0a1b2c3d"
    mine = [tmp_path / f"{prefix}notes", tmp_path / f"{prefix}{host}-{dead_pid()}-notes",
            tmp_path / f"{prefix}{host}-{dead_pid()}-0a1b2c3d-old"]
    for folder in [dead, *mine]:
        (folder / "kept.txt").parent.mkdir(parents=True)
        (folder / "kept.txt").write_text("mine")
        aged(folder, 30)
    with temporary.temporary_folder(tmp_path, prefix) as folder:
        assert folder.is_dir()
    assert not dead.exists() and all((folder / "kept.txt").is_file() for folder in mine)
