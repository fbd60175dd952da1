"""The decoded-data cache on disk, shared by every command: decoded rows (an image's uint8 HxWx3 pixels, a mask
made ready for compositing) keyed by the content hash of the file they came from, never by its name.

Rows are written in packs, one per run and kind (all the images a run decoded, in one `rows.npy`, beside
`hashes.npy`, the SHA-256 of each row's file, and `meta.json`), since one small file per image would make a
cache of 30,000 images slow to read and write. Lookups are per image: the packs of a kind are indexed by
file hash, so a run finds each of its images wherever an earlier run (in9, the challenge, training) decoded it,
and decodes only what no pack holds; the packs a lookup used are marked so (`mark_used`), for `python -m
tools.data cache` to remove the least recently used (`tools.data.cache_admin`). A pack is named by a digest of
its kind, row size, format version, the reference decoder's build and its ordered file hashes; its meta must
match on reading.

Single entries of arrays (CLIP's text heads: `CacheEntry`) live in a folder named by a digest of their inputs.
Packs and entries alike are written into a temporary folder named by host and process, with the umask's mode,
and renamed into place (`tools.data.temporary.temporary_entry` and `publish`): an error, Ctrl-C or SIGTERM
leaves no half entry, a folder a killed process left is removed by the next use, and an entry already there,
written by another process from the same content, is kept and ours dropped.

Image rows are Pillow's pixels: Pillow decodes them, or torchvision's `decode_jpeg` where the run's probe found
it bit-equal (`decoders.choose_decoder`); a pack decoded by torchvision is checked against Pillow on a few of
its rows before it is kept, and a mismatch keeps nothing."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import PIL
from PIL import features

from tools.data.temporary import publish, remove_stale_entries, temporary_entry
from tools.errors import NUMPY_READ_ERRORS

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where the toolkit's caches live unless told otherwise: $XDG_CACHE_HOME/bg-challenge-toolkit, else
    ~/.cache/bg-challenge-toolkit."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bg-challenge-toolkit"


STORE_VERSION = 1  # of the packs' format
CHECKED_ROWS = 8  # rows of a torchvision-decoded pack re-decoded by Pillow before the pack is kept
USE_MARK_INTERVAL_S = 24 * 3600  # a cache entry's use is recorded at most this often (`mark_used`)


def reference_build() -> str:
    """The reference decoder's build (Pillow and its libjpeg): a pack made by another is not read."""
    return f"Pillow {PIL.__version__}, libjpeg {features.version('jpg')}"


def mark_used(folder: Path, now: float | None = None) -> None:
    """Record that the cache entry `folder` was used: its meta.json's mtime is set to now where it is older than
    `USE_MARK_INTERVAL_S` (one stat, and a write at most once a day), since atime is unreliable (noatime and
    relatime mounts). What cannot be marked (a read-only cache, another user's entry, one removed meanwhile) is
    left as it is: `tools.data.cache_admin` then takes it as used when last marked or written."""
    meta = Path(folder) / "meta.json"
    now = time.time() if now is None else now
    try:
        if now - meta.stat().st_mtime > USE_MARK_INTERVAL_S:
            os.utime(meta)
    except OSError:
        pass


class CacheEntry:
    """Arrays on disk (CLIP's text heads) in `cache_dir`, in a folder named by `key`, a digest of their inputs'
    content; `meta` (JSON) says what they were made from and must match on reading.

    `load` gives None on a miss, and on a broken or foreign entry (with a warning), and marks a hit used
    (`mark_used`); `save` writes through `temporary_entry` and `publish`, so an error, Ctrl-C or SIGTERM leaves no
    half entry, and `load` removes what a killed process left. `save` replaces only an entry its `load` found broken
    (renamed away, then deleted); one that another process wrote after this one missed is kept."""

    def __init__(self, cache_dir: Path | None, key: str, meta: dict, what: str):
        self.folder = Path(cache_dir) / key if cache_dir is not None else None
        self.meta = meta
        self.what = what
        self.broken = False  # `load` found an entry it cannot use, which `save` replaces

    def load(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        if self.folder is None:
            return None
        remove_stale_entries(self.folder.parent)
        if not (self.folder / "meta.json").is_file():
            return None
        try:
            if json.loads((self.folder / "meta.json").read_text()) != self.meta:
                self.broken = True
                return None
            arrays = {name: np.load(self.folder / f"{name}.npy", allow_pickle=False) for name in names}
        except (*NUMPY_READ_ERRORS, KeyError) as exc:
            log.warning("ignoring an unreadable cache at %s (%s)", self.folder, exc)
            self.broken = True
            return None
        log.info("%s read from the cache %s", self.what, self.folder)
        mark_used(self.folder)  # for `python -m tools.data cache --max-size`, which removes the least recently used
        return arrays

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        if self.folder is None:
            return
        tmp = None
        try:
            tmp = temporary_entry(self.folder.parent)
            for name, array in arrays.items():
                np.save(tmp / f"{name}.npy", array)
            (tmp / "meta.json").write_text(json.dumps(self.meta))
            if publish(tmp, self.folder, self.what, replace=self.broken):
                log.info("%s cached at %s", self.what, self.folder)
        except OSError as exc:
            log.warning("could not write the %s cache at %s (%s); continuing without it", self.what, self.folder, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already where it was renamed into place


class Packs:
    """The packs of one kind of row (`kind`: "image" or "mask-<arithmetic>", of shape `row_shape` and `dtype`)
    under `cache_dir`; None: no cache (every lookup misses, nothing is written)."""

    def __init__(self, cache_dir: Path | None, kind: str, row_shape: tuple[int, ...], dtype=np.uint8):
        self.dir = Path(cache_dir) if cache_dir is not None else None
        self.kind, self.row_shape, self.dtype = kind, tuple(row_shape), np.dtype(dtype)
        self.meta = {"kind": kind, "row_shape": list(self.row_shape), "dtype": self.dtype.str,
                     "version": STORE_VERSION, "reference": reference_build()}

    def _folders(self) -> list[Path]:
        if self.dir is None:
            return []
        try:
            if not self.dir.is_dir():  # raises where it may not be entered, before Python 3.12
                return []
            remove_stale_entries(self.dir)
            return sorted(p for p in self.dir.iterdir() if p.name.startswith(f"{self.kind}-")
                          and p.name.endswith(f"-v{STORE_VERSION}") and p.is_dir())
        except OSError as exc:
            log.warning("cannot read the cache at %s (%s); continuing without it", self.dir, exc)
            return []

    def lookup(self, hashes: Sequence[str]) -> list[tuple[np.ndarray, int] | None]:
        """Per file hash: (the rows of a pack holding it, read-only and mapped, its row there), or None."""
        wanted = set(hashes)
        found: dict[str, tuple[np.ndarray, int]] = {}
        used = []
        for folder in self._folders():
            if len(found) == len(wanted):
                break
            before = len(found)
            try:
                meta = json.loads((folder / "meta.json").read_text())
                if not isinstance(meta, dict) or {k: v for k, v in meta.items() if k != "count"} != self.meta:
                    continue
                names = np.load(folder / "hashes.npy", allow_pickle=False)
                if names.ndim != 1 or names.dtype.kind != "S":  # damaged: not the file hashes a pack is written with
                    raise ValueError(f"its hashes are {names.dtype} of shape {names.shape}, not a list of hashes")
                rows = None
                for row, name in enumerate(names.tolist()):
                    name = name.decode()
                    if name in wanted and name not in found:
                        rows = np.load(folder / "rows.npy", mmap_mode="r") if rows is None else rows
                        if rows.shape != (len(names), *self.row_shape) or rows.dtype != self.dtype:
                            log.warning("ignoring the cache pack %s: its rows do not match its meta", folder)
                            break
                        found[name] = (rows, row)
                used += [folder] if len(found) > before else []
            except (*NUMPY_READ_ERRORS, KeyError, ValueError) as exc:
                if isinstance(exc, FileNotFoundError) and not folder.exists():  # removed (tools.data.cache_admin)
                    log.info("the cache pack %s was removed while it was read; decoding what it held", folder)
                else:
                    log.warning("ignoring an unreadable cache pack at %s (%s)", folder, exc)
        for folder in used:
            mark_used(folder)
        return [found.get(h) for h in hashes]

    def writer(self, hashes: Sequence[str], check: Callable[[int, np.ndarray], bool] | None = None) -> "PackWriter":
        """A pack to fill with the rows of `hashes` (in that order); `check(i, row)`: whether row i is the
        reference's, asked of a few rows before the pack is kept (None: all are)."""
        return PackWriter(self, list(hashes), check)


def _allocate(path: Path) -> None:
    """Take the disk space of a mapped file now: a full disk is then an OSError here, where a sparse file would
    meet it as a SIGBUS on a write to the mapping, killing the process."""
    if hasattr(os, "posix_fallocate"):
        with open(path, "r+b") as fh:
            try:
                os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)
            except OSError as exc:  # a file system that cannot (musl does not emulate it): sparse, as it was
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise


class PackWriter:
    """One pack being written: rows go straight into its file in a temporary folder (`put`, from any thread,
    one row each), and `commit` renames it into place once every row is in; `abort` (or an incomplete pack)
    removes it. Without a cache folder, or with no rows, it does nothing."""

    def __init__(self, packs: Packs, hashes: list[str], check: Callable[[int, np.ndarray], bool] | None):
        self.packs, self.hashes, self.check = packs, hashes, check
        self.tmp: Path | None = None
        self.rows: np.ndarray | None = None
        self.filled = np.zeros(len(hashes), bool)
        if packs.dir is None or not hashes:
            return
        try:
            self.tmp = temporary_entry(packs.dir)
            self.rows = np.lib.format.open_memmap(self.tmp / "rows.npy", mode="w+", dtype=packs.dtype,
                                                  shape=(len(hashes), *packs.row_shape))
            _allocate(self.tmp / "rows.npy")
        except OSError as exc:
            log.warning("could not write to the cache at %s (%s); continuing without it", packs.dir, exc)
            self.abort()

    def put(self, index: int, row: np.ndarray) -> None:
        if self.rows is not None:
            self.rows[index] = row
            self.filled[index] = True

    def commit(self) -> Path | None:
        """Keep the pack (when every row is in and the checked rows are the reference's); where it went."""
        if self.rows is None or not self.filled.all():
            self.abort()
            return None
        packs = self.packs
        try:
            if self.check is not None:
                picks = np.unique(np.linspace(0, len(self.hashes) - 1, CHECKED_ROWS).astype(int))
                if not all(self.check(int(i), np.asarray(self.rows[i])) for i in picks):
                    log.warning("torchvision's decode_jpeg gave other pixels than Pillow's on this data, where the "
                                "start-up probe found them equal: this run's numbers may differ from the reference "
                                "decoder's (its provenance names the decoder used); not caching them")
                    self.abort()
                    return None
            self.rows.flush()
            self.rows = None
            np.save(self.tmp / "hashes.npy", np.array(self.hashes, dtype="S64"))
            (self.tmp / "meta.json").write_text(json.dumps({**packs.meta, "count": len(self.hashes)}))
            digest = hashlib.sha256(json.dumps({**packs.meta, "hashes": self.hashes}).encode()).hexdigest()
            folder = packs.dir / f"{packs.kind}-{digest[:24]}-v{STORE_VERSION}"
            if publish(self.tmp, folder, "pack"):
                log.info("%d decoded %s row(s) cached at %s", len(self.hashes), packs.kind, folder)
            return folder
        except OSError as exc:
            log.warning("could not write the cache at %s (%s); continuing without it", packs.dir, exc)
            return None
        finally:
            self.abort()

    def abort(self) -> None:
        self.rows = None
        if self.tmp is not None and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None
