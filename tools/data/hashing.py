"""Content hashes: of one file, and of every file a run reads (the data's identity).

A run's data is identified by what its files hold, not by their names and sizes: every file is read and
hashed with SHA-256 (streamed, in threads, since hashlib releases the GIL on large buffers), and the
fingerprint is a SHA-256 over the sorted (relative path, file hash) lines. Provenance carries it, both
scripts' resume keys are keyed by it and the decoded-data cache by the file hashes themselves, so a file rewritten in place with the
same name, size and even modification time is still seen as different data. The same digest per top-level
folder (`original`, `only_bg_t`, ...) lets runs that read different sets of folders, such as in9_eval.py's
and challenge_eval.py's, be checked to have read the same data where they overlap.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Collection, Sequence

from tools.threads import ContextThreadPool, stop_point

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
FINGERPRINT_METHOD = "sha256 of each file's content, then sha256 over sorted 'path<TAB>hash' lines"


def sha256_file(path: Path | str) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(root: Path | str, relpaths: Sequence[str], workers: int = 4) -> dict:
    """{files, bytes, sha256, method, folders} over the content of every file in `relpaths` (relative to
    `root`); `folders` holds the same digest over the files of each top-level folder alone."""
    return read_and_fingerprint(root, relpaths, workers)[0]


def _hash_and_keep(path: Path, keep: bool) -> tuple[str, bytes | None]:
    stop_point()
    if not keep:
        return sha256_file(path), None
    with open(path, "rb") as fh:
        data = fh.read()
    return hashlib.sha256(data).hexdigest(), data


def read_and_fingerprint(root: Path | str, relpaths: Sequence[str], workers: int = 4,
                         keep: Collection[str] = ()) -> tuple[dict, dict[str, bytes], dict[str, str]]:
    """`fingerprint`, the bytes of the files named in `keep`, and every file's SHA-256 (by relative path: the
    decoded-data cache's keys), each file read once: a run decodes the very bytes it hashed, without reading them
    again."""
    root = Path(root)
    ordered = sorted(relpaths)
    keep = set(keep)
    start = time.perf_counter()
    with ContextThreadPool(max_workers=max(1, workers), thread_name_prefix="hash") as pool:
        read = list(pool.map(lambda rel: _hash_and_keep(root / rel, rel in keep), ordered, chunksize=64))
    hashes = [file_hash for file_hash, _ in read]
    contents = {rel: data for rel, (_, data) in zip(ordered, read) if data is not None}
    digest = hashlib.sha256()
    folders: dict = {}  # top-level folder: its running digest
    for rel, file_hash in zip(ordered, hashes):
        line = f"{rel}\t{file_hash}\n".encode()
        digest.update(line)
        folders.setdefault(Path(rel).parts[0], hashlib.sha256()).update(line)
    total = sum((root / rel).stat().st_size for rel in ordered)
    log.debug("hashed %d files (%.1f MB) in %.2f s", len(ordered), total / 1e6, time.perf_counter() - start)
    return {"files": len(ordered), "bytes": total, "sha256": digest.hexdigest(), "method": FINGERPRINT_METHOD,
            "folders": {name: folder.hexdigest() for name, folder in sorted(folders.items())}}, contents, \
        dict(zip(ordered, hashes))
