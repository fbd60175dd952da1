"""Content hashes: of one file, and of every file a run reads (the data's identity; see docs/how-it-works.md,
"Which data was read"), in threads (hashlib releases the GIL). Only regular files are read (`open_regular`);
files reached through links outside the data folder are read as data, said once and recorded."""

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
    """`path` opened for reading (links followed); OSError unless a regular file. A FIFO is opened without waiting
    for a writer and a device without reading it."""
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
    """{files, bytes, sha256, method, folders} over the content of `relpaths` (relative to `root`); `folders`: the
    same digest per top-level folder."""
    return read_and_fingerprint(root, relpaths, workers)[0]


def _hash_and_keep(path: Path, keep: bool, root: str,
                   folders: dict[str, str]) -> tuple[str, bytes | None, str | None]:
    """The file's SHA-256, its bytes when kept, and its real path when outside the data folder `root`."""
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
    """The fingerprint's record of the files read from outside `root`: how many, and their folders (the first ten);
    None for none. Said once, as a warning."""
    note = outside_note(root, targets)
    if note is None:
        return None
    log.warning("%s, and the provenance records it (data.outside)", note)
    return {"files": len(targets), "folders": sorted({os.path.dirname(t) for t in targets})[:10]}


def read_and_fingerprint(root: Path | str, relpaths: Sequence[str], workers: int = 4,
                         keep: Collection[str] = ()) -> tuple[dict, dict[str, bytes], dict[str, str]]:
    """`fingerprint`, the bytes of the files in `keep`, and every file's SHA-256 by relative path (the cache's keys),
    each file read once: a run decodes the very bytes it hashed."""
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
