"""What an entry of the decoded-data cache must show before a process uses it (`tools.data.store`): who could
have written it (`others_can_write`: by default only what this user wrote and nobody else can change is used), that
its rows are the bytes written (`RowChecks`: each row's SHA-256, stored with the pack, checked once per process
before the row is first used), and that a few of the rows it gives are what their files decode to now
(`spot_check`, on every use); and it reads them only as regular files (`read_regular`, `map_rows`: a FIFO, which
any user of a shared cache can make, is refused, not waited on).

The digests catch damage (a bad copy, a failing disk, a file edited by mistake); the spot check catches rows that
are intact but belong to other files (a pack rebuilt with its rows reordered, its digests made to match); the owner
check keeps other users' packs out of a private cache, where neither of the others could stop a forgery of a single
row. Where there are no POSIX owners (Windows), the owner check is not made: the cache folder's place in the
user's profile is what keeps other users out there."""

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
    """Why a user other than this one could have written `path` or could change it (a symbolic link where `follow`
    is off; with `owners`, another owner or a mode that lets its group or everyone write); None where only this
    user can, and where there are no POSIX owners. OSError where it cannot be looked at."""
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
    """Take the group's and everyone's write permission from `paths` (what the umask left them): a private cache's
    entries are this user's alone."""
    for path in paths:
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file `path` (`open_regular`: a FIFO or a device is refused, not waited on)."""
    with open_regular(path) as fh:
        return fh.read()


def map_rows(path: Path) -> np.ndarray:
    """The array of the .npy file `path`, mapped read-only from the regular file opened (`open_regular`), so that
    what is mapped is what was checked."""
    with open_regular(path) as fh:
        shape, fortran, dtype = npy_header(fh, os.fstat(fh.fileno()).st_size)
        return np.memmap(fh, dtype=dtype, mode="r", offset=fh.tell(), shape=shape, order="F" if fortran else "C")


def row_digest(row: np.ndarray) -> np.ndarray:
    """The SHA-256 of one row's bytes, as the 32 uint8 a pack stores."""
    return np.frombuffer(hashlib.sha256(np.ascontiguousarray(row)).digest(), np.uint8)


class RowChecks:
    """Which rows of each pack this process has found equal to their digests, by the pack's identity (its rows
    file's device, inode, size and modification time: a pack replaced or rewritten is checked again); `hashed`:
    how many rows it hashed."""

    def __init__(self):
        self._checked: dict[tuple, np.ndarray] = {}
        self.hashed = 0

    def failing(self, identity: tuple, rows: np.ndarray, digests: np.ndarray, wanted: Sequence[int],
                workers: int | None = None) -> list[int]:
        """The rows of `wanted` whose bytes are not their digest's, each hashed at most once per identity, in
        `workers` threads (hashlib lets go of the GIL)."""
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
    """Compare up to `SPOT_CHECK_ROWS` rows of `used` ((index in the lookup, row of the pack) pairs), picked at
    random (unpredictably, so that no pack can be made to pass by its choice), with `reference(index)`: the row as
    its file decodes now (None: that file cannot be checked, e.g. changed since it was listed). The first row that
    differs, or None."""
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
