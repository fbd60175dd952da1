"""The decoded-data cache on disk, shared by every command: decoded rows (image pixels, masks ready for
compositing) keyed by the SHA-256 of their file, never its name, in packs (`pack_name`) looked up per image,
proved before use (`tools.data.cache_checks`) and published whole (`tools.data.temporary`); `CacheEntry` holds
single arrays (CLIP's text heads). See docs/how-it-works.md, Decoding."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import PIL
from PIL import features

from tools.data.cache_checks import (
    DIGEST_BYTES,
    ROW_DIGESTS,
    RowChecks,
    first_foreign,
    make_private,
    map_rows,
    others_can_write,
    read_regular,
    row_digest,
    spot_check,
)
from tools.data.temporary import publish, remove_stale_entries, temporary_entry
from tools.errors import NUMPY_READ_ERRORS, option
from tools.provenance import read_npy

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/bg-challenge-toolkit, else ~/.cache/bg-challenge-toolkit."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bg-challenge-toolkit"


@dataclasses.dataclass(frozen=True)
class DecodedCache:
    """The decoded-data cache a run reads and writes. Private (the default): only this user's packs, in a folder
    only this user can write; `shared` (--shared-cache): any user's, checked alike, written with the umask's mode."""

    folder: Path
    shared: bool = False

    def describe(self) -> dict:
        """What the provenance records of it."""
        return {"folder": str(self.folder), "shared": self.shared}


STORE_VERSION = 2  # of the packs' format (2: rows_sha256.npy)
PACK_NAME = re.compile(r"(?P<kind>[a-z]+(?:-[a-z]+)*)-[0-9a-f]{24}-v(?P<version>\d+)")  # as `pack_name` names them
PACK_FILES = ("rows.npy", "hashes.npy", ROW_DIGESTS, "meta.json")
CHECKED_ROWS = 8  # rows of a torchvision-decoded pack re-decoded by Pillow before the pack is kept
USE_MARK_INTERVAL_S = 24 * 3600  # a cache entry's use is recorded at most this often (`mark_used`)

_row_checks = RowChecks()  # rows found equal to their digests in this process
_refused: dict[tuple, str] = {}  # packs (by identity) and folders this process passed over, said once each
_replaceable: set[str] = set()  # packs found damaged, which this process may write over
_written: dict[tuple[str, Path], int] = {}  # bytes this process wrote, per kind and folder (`take_written`)


def reference_build() -> str:
    """The reference decoder's build (Pillow and its libjpeg): a pack made by another is not read."""
    return f"Pillow {PIL.__version__}, libjpeg {features.version('jpg')}"


def pack_name(kind: str, meta: dict, hashes: Sequence[str]) -> str:
    """The folder name of a pack of `kind` with this meta (less its count) and these file hashes, in order."""
    digest = hashlib.sha256(json.dumps({**meta, "hashes": list(hashes)}).encode()).hexdigest()
    return f"{kind}-{digest[:24]}-v{meta['version']}"


def take_written() -> dict[tuple[str, Path], int]:
    """The bytes this process wrote into the cache since the last call, per (kind, folder)."""
    written = dict(_written)
    _written.clear()
    return written


def forget_checks() -> None:
    """Check every pack again, and say again what is wrong with one, as a new process would (the bench's runs)."""
    _row_checks.forget()
    _refused.clear()


def _warn_once(key: tuple, message: str) -> None:
    if key not in _refused:
        _refused[key] = message
        log.warning("%s", message)


def mark_used(folder: Path, now: float | None = None) -> None:
    """Mark the entry `folder` used: its meta.json's mtime set to now where older than `USE_MARK_INTERVAL_S` (atime
    is unreliable: noatime, relatime). What cannot be marked (read-only, another user's, removed) is left as it is."""
    meta = Path(folder) / "meta.json"
    now = time.time() if now is None else now
    try:
        if now - meta.stat().st_mtime > USE_MARK_INTERVAL_S:
            os.utime(meta)
    except OSError:
        pass


def _make_folder(folder: Path, shared: bool) -> None:
    """`folder` (and its parents) where missing; a private cache's own folder writable by this user alone."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(mode=0o777 if shared else 0o755, exist_ok=True)


def _private_folder(folder: Path, what: str) -> bool:
    """Whether the private cache folder `folder` is this user's alone (said once where not)."""
    try:
        problem = others_can_write(folder, follow=True)
    except OSError as exc:
        problem = f"it cannot be looked at ({exc.strerror or exc})"
    if problem is not None:
        _warn_once(("folder", str(folder)), f"not using the {what} in {folder}: {problem}; a private cache is used "
                   f"only where nobody else can write it: make it yours alone (chmod go-w), choose another "
                   f"{option('--cache-dir')}, or pass {option('--shared-cache')} to use a cache other users write")
    return problem is None


class CacheEntry:
    """Arrays on disk (CLIP's text heads) in `cache_dir` (None: unused), in a folder named by `key`, a digest of
    their inputs; `meta` and each array's SHA-256 must match on reading, under a private cache's rules. `load` gives
    None on a miss or (with a warning) a broken or foreign entry; `save` replaces only an entry `load` found broken."""

    def __init__(self, cache_dir: Path | None, key: str, meta: dict, what: str, shared: bool = False):
        self.folder = Path(cache_dir) / key if cache_dir is not None else None
        self.meta = meta
        self.what = what
        self.shared = shared
        self.broken = False  # `load` found an entry it cannot use, which `save` replaces

    def _usable(self, folder: Path) -> bool:
        return self.shared or _private_folder(folder, f"{self.what} cache")

    def load(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        if self.folder is None or not self.folder.parent.is_dir() or not self._usable(self.folder.parent):
            return None
        remove_stale_entries(self.folder.parent)
        if not (self.folder / "meta.json").is_file():
            return None
        try:
            problem = first_foreign([self.folder, *sorted(self.folder.iterdir())], owners=not self.shared)
            if problem is not None:
                _warn_once(("entry", str(self.folder)), f"not using the {self.what} cached at {problem}")
                return None
            stored = json.loads(read_regular(self.folder / "meta.json"))
            digests = stored.pop("sha256", None) if isinstance(stored, dict) else None
            if stored != self.meta or not isinstance(digests, dict):
                self.broken = True
                return None
            arrays = {}
            for name in names:
                data = read_regular(self.folder / f"{name}.npy")
                if hashlib.sha256(data).hexdigest() != digests[name]:
                    raise ValueError(f"{name}.npy does not match its SHA-256")
                arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
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
            _make_folder(self.folder.parent.parent, self.shared)
            _make_folder(self.folder.parent, self.shared)
            if not self._usable(self.folder.parent):
                return
            tmp = temporary_entry(self.folder.parent)
            digests = {}
            for name, array in arrays.items():
                buffer = io.BytesIO()
                np.save(buffer, array)
                (tmp / f"{name}.npy").write_bytes(buffer.getvalue())
                digests[name] = hashlib.sha256(buffer.getvalue()).hexdigest()
            (tmp / "meta.json").write_text(json.dumps({**self.meta, "sha256": digests}))
            if not self.shared:
                make_private([tmp, *tmp.iterdir()])
            size = sum(path.stat().st_size for path in tmp.iterdir())
            if publish(tmp, self.folder, self.what, replace=self.broken):
                log.debug("%s cached at %s", self.what, self.folder)
                place = (self.what, self.folder.parent)
                _written[place] = _written.get(place, 0) + size
        except OSError as exc:
            log.warning("could not write the %s cache at %s (%s); continuing without it", self.what, self.folder, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already where it was renamed into place


class Packs:
    """The packs of one kind of row (`kind`: "image" or "mask-<arithmetic>", of shape `row_shape` and `dtype`)
    in `cache`; None: no cache (every lookup misses, nothing is written)."""

    def __init__(self, cache: DecodedCache | None, kind: str, row_shape: tuple[int, ...], dtype=np.uint8):
        self.cache = cache
        self.dir = cache.folder if cache is not None else None
        self.kind, self.row_shape, self.dtype = kind, tuple(row_shape), np.dtype(dtype)
        self.meta = {"kind": kind, "row_shape": list(self.row_shape), "dtype": self.dtype.str,
                     "version": STORE_VERSION, "reference": reference_build()}

    def usable(self) -> bool:
        """Whether the cache folder may be used: any, shared; in a private cache, one only this user can write."""
        return self.cache.shared or _private_folder(self.dir, "decoded-data cache")

    def _folders(self) -> list[Path]:
        if self.dir is None:
            return []
        try:
            if not self.dir.is_dir() or not self.usable():  # is_dir raises where it may not be entered (< 3.12)
                return []
            remove_stale_entries(self.dir)
            return sorted(p for p in self.dir.iterdir() if _pack_of(p.name) == (self.kind, STORE_VERSION)
                          and stat.S_ISDIR(p.lstat().st_mode))
        except OSError as exc:
            log.warning("cannot read the cache at %s (%s); continuing without it", self.dir, exc)
            return []

    def lookup(self, hashes: Sequence[str],
               reference: Callable[[int], np.ndarray | None]) -> list[tuple[np.ndarray, int] | None]:
        """Per file hash: (the mapped read-only rows of a pack holding it, its row there), or None; `reference(i)`: the
        row of `hashes[i]`'s file decoded again, for the spot check (None: not checked)."""
        wanted: dict[str, int] = {}
        for index, name in enumerate(hashes):
            wanted.setdefault(name, index)
        found: dict[str, tuple[np.ndarray, int]] = {}
        used = []
        for folder in self._folders():
            if len(found) == len(wanted):
                break
            try:
                hits = self._hits(folder, wanted, found, reference)
            except (*NUMPY_READ_ERRORS, KeyError, ValueError) as exc:
                if isinstance(exc, FileNotFoundError) and not folder.exists():  # removed (tools.data.cache_admin)
                    log.info("the cache pack %s was removed while it was read; decoding what it held", folder)
                else:
                    log.warning("ignoring an unreadable cache pack at %s (%s)", folder, exc)
                continue
            found.update(hits)
            used += [folder] if hits else []
        for folder in used:
            mark_used(folder)
        return [found.get(h) for h in hashes]

    def _hits(self, folder: Path, wanted: dict[str, int], found: dict,
              reference: Callable[[int], np.ndarray | None]) -> dict[str, tuple[np.ndarray, int]]:
        """The rows of `wanted` hashes not yet `found` that `folder` holds, where it passes every check of
        docs/how-it-works.md (meta, owner, name, row digests, spot check); else nothing, said once per pack."""
        info = os.stat(folder / "rows.npy")
        identity = (str(folder), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if identity in _refused:
            return {}
        foreign = first_foreign([folder, *(folder / name for name in PACK_FILES)], owners=not self.cache.shared)
        if foreign is not None:
            advice = "" if self.cache.shared else (f"; a private cache uses only the packs this user wrote "
                                                   f"({option('--shared-cache')}: any user's, each checked)")
            return self._refuse(identity, foreign + advice, damaged=False)
        special = next((name for name in PACK_FILES if not stat.S_ISREG(os.lstat(folder / name).st_mode)), None)
        if special is not None:  # a FIFO would be waited on forever: every file is read as a regular file alone
            return self._refuse(identity, f"its {special} is not a regular file (a FIFO, a device?), which the cache "
                                          f"never writes", damaged=False)
        meta = json.loads(read_regular(folder / "meta.json"))
        if not isinstance(meta, dict) or {k: v for k, v in meta.items() if k != "count"} != self.meta:
            return {}  # another decoder build's: another install reads it
        names = read_npy(folder / "hashes.npy")
        if names.ndim != 1 or names.dtype.kind != "S":  # damaged: not the file hashes a pack is written with
            raise ValueError(f"its hashes are {names.dtype} of shape {names.shape}, not a list of hashes")
        names = [name.decode() for name in names.tolist()]
        if folder.name != pack_name(self.kind, self.meta, names):
            return self._refuse(identity, "its name is not the digest of what it holds (a copy under another name, "
                                          "or an edited list of files)")
        used = list({name: (wanted[name], row) for row, name in enumerate(names)
                     if name in wanted and name not in found}.values())
        if not used:
            return {}
        rows = map_rows(folder / "rows.npy")
        digests = read_npy(folder / ROW_DIGESTS)
        if rows.shape != (len(names), *self.row_shape) or rows.dtype != self.dtype or \
                digests.shape != (len(names), DIGEST_BYTES) or digests.dtype != np.uint8:
            return self._refuse(identity, "its rows or their digests do not match its meta")
        failing = _row_checks.failing(identity, rows, digests, [row for _, row in used])
        if failing:
            return self._refuse(identity, f"{len(failing)} of the {len(used)} row(s) used do not match their SHA-256 "
                                          f"(damaged: a bad copy, a failing disk, an edit)")
        differing = spot_check(rows, used, reference)
        if differing is not None:
            return self._refuse(identity, f"its row {differing} is not what its file decodes to (its rows belong to "
                                          f"other files than its list says)")
        return {names[row]: (rows, row) for _, row in used}

    def _refuse(self, identity: tuple, why: str, damaged: bool = True) -> dict:
        _warn_once(identity, f"ignoring the cache pack {identity[0]}: {why}; decoding its images instead")
        if damaged:
            _replaceable.add(identity[0])
        return {}

    def writer(self, hashes: Sequence[str], check: Callable[[int, np.ndarray], bool] | None = None) -> PackWriter:
        """A pack to fill with the rows of `hashes` (in that order); `check(i, row)`: whether row i is the
        reference's, asked of a few rows before the pack is kept (None: all are)."""
        return PackWriter(self, list(hashes), check)


def _pack_of(name: str) -> tuple[str, int] | None:
    """(kind, format version) of a pack's folder name; None for any other name."""
    match = PACK_NAME.fullmatch(name)
    return None if match is None else (match["kind"], int(match["version"]))


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
    """One pack being written: `put` (any thread, one row each) into a temporary folder, `commit` renames it into
    place once every row is in, `abort` removes it. Does nothing without a `Packs.usable` folder or rows."""

    def __init__(self, packs: Packs, hashes: list[str], check: Callable[[int, np.ndarray], bool] | None):
        self.packs, self.hashes, self.check = packs, hashes, check
        self.tmp: Path | None = None
        self.rows: np.ndarray | None = None
        self.digests = np.zeros((len(hashes), DIGEST_BYTES), np.uint8)
        self.filled = np.zeros(len(hashes), bool)
        if packs.dir is None or not hashes:
            return
        try:
            _make_folder(packs.dir, packs.cache.shared)
            if not packs.usable():
                return
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
            self.digests[index] = row_digest(self.rows[index])
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
            np.save(self.tmp / ROW_DIGESTS, self.digests)
            (self.tmp / "meta.json").write_text(json.dumps({**packs.meta, "count": len(self.hashes)}))
            if not packs.cache.shared:
                make_private([self.tmp, *self.tmp.iterdir()])
            folder = packs.dir / pack_name(packs.kind, packs.meta, self.hashes)
            size = sum(p.stat().st_size for p in self.tmp.iterdir())
            if publish(self.tmp, folder, "pack", replace=str(folder) in _replaceable):
                log.debug("%d decoded %s row(s) cached at %s", len(self.hashes), packs.kind, folder)
                _replaceable.discard(str(folder))
                place = ("decoded data", packs.dir)
                _written[place] = _written.get(place, 0) + size
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
