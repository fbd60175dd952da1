"""What an entry of the decoded-data cache must show before a process uses it: only this user could have written
it (`others_can_write`, private cache), its rows are the bytes written (`RowChecks`) and a few equal their files
decoded now (`spot_check`); read only as regular files (a shared cache's FIFO would hang a reader). Why each
check: docs/how-it-works.md, "A pack proves itself". No owner check without POSIX owners."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tools.data.hashing import open_regular
from tools.provenance import npy_header
from tools.threads import ContextThreadPool, default_workers

ROW_DIGESTS = "rows_sha256.npy"  # in a pack: row i's SHA-256, (rows, 32) uint8
DIGEST_BYTES = 32
SPOT_CHECK_ROWS = 2  # rows of a pack decoded again on each use, chosen at random among those used
CHECK_CHUNK_ROWS = 64  # rows per hashing job
OWNERS_CHECKED = hasattr(os, "geteuid")  # POSIX owners and modes; not on Windows


def others_can_write(path: Path, follow: bool = False, owners: bool = True) -> str | None:
    """Why a user other than this one could have written or could change `path` (a link unless `follow`; with
    `owners`, another owner or group/other write); None where none could. OSError where it cannot be looked at."""
    info = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link, which the cache never writes"
    if not owners or not OWNERS_CHECKED:
        return None
    if info.st_uid != os.geteuid():
        return f"it belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or everyone may write it (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def first_foreign(paths: Sequence[Path], owners: bool = True) -> str | None:
    """`others_can_write` of the first of `paths` that others could write, naming it; None where none."""
    for path in paths:
        problem = others_can_write(path, owners=owners)
        if problem is not None:
            return f"{path}: {problem}"
    return None


def make_private(paths: Sequence[Path]) -> None:
    """Take group and other write permission from `paths`: a private cache's entries are this user's alone."""
    for path in paths:
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file `path` (`open_regular`: a FIFO or a device is refused, not waited on)."""
    with open_regular(path) as fh:
        return fh.read()


def map_rows(path: Path) -> np.ndarray:
    """The .npy file `path` mapped read-only from the regular file opened, so what is mapped is what was checked."""
    with open_regular(path) as fh:
        shape, fortran, dtype = npy_header(fh, os.fstat(fh.fileno()).st_size)
        return np.memmap(fh, dtype=dtype, mode="r", offset=fh.tell(), shape=shape, order="F" if fortran else "C")


def row_digest(row: np.ndarray) -> np.ndarray:
    """The SHA-256 of one row's bytes, as the 32 uint8 a pack stores."""
    return np.frombuffer(hashlib.sha256(np.ascontiguousarray(row)).digest(), np.uint8)


class RowChecks:
    """Which rows of each pack this process found equal to their digests, by the pack's identity (its rows file's
    device, inode, size, mtime: a pack rewritten is checked again); `hashed`: rows hashed."""

    def __init__(self):
        self._checked: dict[tuple, np.ndarray] = {}
        self.hashed = 0

    def failing(self, identity: tuple, rows: np.ndarray, digests: np.ndarray, wanted: Sequence[int],
                workers: int | None = None) -> list[int]:
        """The rows of `wanted` whose bytes are not their digest's, each hashed at most once per identity, in `workers`
        threads (hashlib lets go of the GIL)."""
        checked = self._checked.setdefault(identity, np.zeros(len(rows), bool))
        todo = sorted({int(i) for i in wanted if not checked[i]})
        self.hashed += len(todo)
        chunks = [todo[at:at + CHECK_CHUNK_ROWS] for at in range(0, len(todo), CHECK_CHUNK_ROWS)]

        def bad_rows(chunk: list[int]) -> list[int]:
            return [i for i in chunk if not np.array_equal(row_digest(rows[i]), digests[i])]

        workers = default_workers() if workers is None else workers
        if len(chunks) > 1 and workers > 1:
            with ContextThreadPool(workers, thread_name_prefix="pack-check") as pool:
                failing = [i for bad in pool.map(bad_rows, chunks) for i in bad]
        else:
            failing = [i for chunk in chunks for i in bad_rows(chunk)]
        checked[todo] = True
        checked[failing] = False
        return failing

    def forget(self) -> None:
        """Check every pack again, as a new process would (the bench's runs with the check)."""
        self._checked.clear()


def spot_check(rows: np.ndarray, used: Sequence[tuple[int, int]],
               reference: Callable[[int], np.ndarray | None]) -> int | None:
    """The first of up to `SPOT_CHECK_ROWS` rows of `used` ((lookup index, pack row) pairs), picked unpredictably,
    that differs from `reference(index)`, its file decoded now (None: not checkable); None where all match."""
    order = list(used)
    secrets.SystemRandom().shuffle(order)
    checked = 0
    for index, row in order[:4 * SPOT_CHECK_ROWS]:  # a few files that cannot be checked are passed over
        if checked == SPOT_CHECK_ROWS:
            break
        expected = reference(index)
        if expected is None:
            continue
        checked += 1
        if not np.array_equal(np.asarray(rows[row]), expected.reshape(rows.shape[1:])):
            return row
    return None
