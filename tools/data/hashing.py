"""Content hashes: of one file, and of every file a run reads (the data's identity).

A run's data is identified by what its files hold, not by their names and sizes: every file is read and
hashed with SHA-256 (streamed, in threads, since hashlib releases the GIL on large buffers), and the
fingerprint is a SHA-256 over the sorted (relative path, file hash) lines. Provenance carries it, both
scripts' resume keys are keyed by it and the decoded-data cache by the file hashes themselves, so a file rewritten
in place with the same name, size and even modification time is still seen as different data. The same digest per
top-level folder (`original`, `only_bg_t`, ...) lets runs that read different sets of folders, such as
in9_eval.py's and challenge_eval.py's, be checked to have read the same data where they overlap.

Only regular files are read (`open_regular`: a FIFO or a device is refused, never waited on or read without end).
Files that lie outside the data folder, reached through links (a data folder assembled from links into a shared
store), are read as data, said once and recorded in the fingerprint (`outside`), which their content identifies
like any other's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from tools.data.layout import outside, outside_note
from tools.errors import UserError
from tools.threads import ContextThreadPool, stop_point

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
FINGERPRINT_METHOD = "sha256 of each file's content, then sha256 over sorted 'path<TAB>hash' lines"


def open_regular(path: Path | str):
    """`path` opened for reading (links followed), refused with an OSError unless it is a regular file: a FIFO is
    opened without waiting for a writer and a device without reading it, and neither is read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file (a FIFO, a device or a socket?)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: Path | str) -> str:
    """The SHA-256 of a regular file's bytes, read in 1 MiB chunks (`open_regular`)."""
    digest = hashlib.sha256()
    with open_regular(path) as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(root: Path | str, relpaths: Sequence[str], workers: int = 4) -> dict:
    """{files, bytes, sha256, method, folders} over the content of every file in `relpaths` (relative to
    `root`); `folders` holds the same digest over the files of each top-level folder alone."""
    return read_and_fingerprint(root, relpaths, workers)[0]


def _hash_and_keep(path: Path, keep: bool, root: str,
                   folders: dict[str, str]) -> tuple[str, bytes | None, str | None]:
    """The file's SHA-256, its bytes when kept, and where it really is when that is outside the data folder whose
    real path is `root` (`layout.outside`, `folders` its memo of real folder paths)."""
    stop_point()
    try:
        if not keep:
            digest, data = sha256_file(path), None
        else:
            with open_regular(path) as fh:
                data = fh.read()
            digest = hashlib.sha256(data).hexdigest()
        real = outside(root, path, folders)
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc}); make it readable, or replace or remove it") \
            from None
    return digest, data, real


def _outside_record(root: Path, targets: list[str]) -> dict | None:
    """The fingerprint's record of the files read from outside the data folder `root` (their real paths): how
    many, and the folders they are in (the first ten); None when there are none. Said once, as a warning."""
    note = outside_note(root, targets)
    if note is None:
        return None
    log.warning("%s, and the provenance records it (data.outside)", note)
    return {"files": len(targets), "folders": sorted({os.path.dirname(t) for t in targets})[:10]}


def read_and_fingerprint(root: Path | str, relpaths: Sequence[str], workers: int = 4,
                         keep: Collection[str] = ()) -> tuple[dict, dict[str, bytes], dict[str, str]]:
    """`fingerprint`, the bytes of the files named in `keep`, and every file's SHA-256 (by relative path: the
    decoded-data cache's keys), each file read once: a run decodes the very bytes it hashed, without reading them
    again."""
    root = Path(root)
    ordered = sorted(relpaths)
    keep = set(keep)
    start = time.perf_counter()
    real_root, folders = os.path.realpath(root), {}
    with ContextThreadPool(max_workers=max(1, workers), thread_name_prefix="hash") as pool:
        read = list(pool.map(lambda rel: _hash_and_keep(root / rel, rel in keep, real_root, folders), ordered,
                             chunksize=64))
    hashes = [file_hash for file_hash, _, _ in read]
    contents = {rel: data for rel, (_, data, _) in zip(ordered, read) if data is not None}
    outside_links = _outside_record(root, [real for _, _, real in read if real is not None])
    digest = hashlib.sha256()
    folders: dict = {}  # top-level folder: its running digest
    for rel, file_hash in zip(ordered, hashes):
        line = f"{rel}\t{file_hash}\n".encode()
        digest.update(line)
        folders.setdefault(Path(rel).parts[0], hashlib.sha256()).update(line)
    total = sum((root / rel).stat().st_size for rel in ordered)
    log.debug("hashed %d files (%.1f MB) in %.2f s", len(ordered), total / 1e6, time.perf_counter() - start)
    found = {"files": len(ordered), "bytes": total, "sha256": digest.hexdigest(), "method": FINGERPRINT_METHOD,
             "folders": {name: folder.hexdigest() for name, folder in sorted(folders.items())}}
    if outside_links is not None:
        found["outside"] = outside_links
    return found, contents, dict(zip(ordered, hashes))
