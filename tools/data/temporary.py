"""Temporary folders renamed into place once their content is complete: a build's output, an archive's extraction
(`temporary_folder`) and the decoded-data cache's entries (`temporary_entry`, `publish`). Each is made beside
where its content goes, with the umask's mode, named after the host and process that own it, removed when the
work fails or is interrupted, and, when its process died without removing it (SIGKILL, a crash, a power cut),
by the next command that looks in the same place (`remove_stale`)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-"


def is_running(pid: int) -> bool:
    """Whether a process of this id runs on this machine (where that cannot be asked, it is taken to run)."""
    if os.name != "posix":  # os.kill(pid, 0) would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(parent: Path, prefix: str, sep: str = "-") -> list[Path]:
    """Remove the `prefix` folders in `parent` (named `<prefix><host><sep><pid><sep><random>`) left by a process of
    this host that no longer runs; returns them.

    Folders of another host (a shared file system) or of a running process are left alone."""
    parent, host = Path(parent), socket.gethostname()
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if not entry.name.startswith(prefix):
            continue
        owner_host, _, pid_text = entry.name[len(prefix):].rpartition(sep)[0].rpartition(sep)
        pid = int(pid_text) if pid_text.isdigit() else None
        if entry.is_dir() and owner_host == host and pid is not None and not is_running(pid):
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, left by process %d, which no longer runs", entry, pid)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def temporary_folder(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder `<parent>/<prefix><host>-<pid>-<random>`, removed on leaving unless the work moved it away.

    Stale ones of the same prefix (see `remove_stale`) are removed first. Any exception, Ctrl-C's
    KeyboardInterrupt and SIGTERM's `tools.cli.Terminated` included, removes the folder before it
    goes on."""
    parent = Path(parent)
    remove_stale(parent, prefix)
    folder = parent / f"{prefix}{_owner()}{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # already gone when the work renamed it into place


ENTRY_PREFIX, ENTRY_SEP = ".tmp-", "@"  # a cache entry being written: .tmp-HOST@PID@<random> (no host name holds an @)


def temporary_prefix(pid: int | None = None) -> str:
    """`.tmp-HOST@` starts the names of the cache entries being written on this machine, `.tmp-HOST@PID@` those
    of process PID."""
    host = f"{ENTRY_PREFIX}{socket.gethostname()}{ENTRY_SEP}"
    return host if pid is None else f"{host}{pid}{ENTRY_SEP}"


def remove_stale_entries(cache_dir: Path) -> None:
    """`remove_stale` for the cache entries being written in `cache_dir`; a folder that cannot be read is left."""
    try:
        remove_stale(cache_dir, ENTRY_PREFIX, ENTRY_SEP)
    except OSError:
        return


def temporary_entry(parent: Path) -> Path:
    """A new folder in `parent` (made if need be) to write a cache entry into, which `publish` renames into place
    and the caller removes where it is still there; with the umask's mode, as the cache's other folders (mkdtemp's
    0700 would shut out the other users of a shared cache folder)."""
    parent.mkdir(parents=True, exist_ok=True)
    folder = parent / f"{temporary_prefix(os.getpid())}{secrets.token_hex(8)}"
    folder.mkdir()
    return folder


def publish(tmp: Path, folder: Path, what: str, replace: bool = False) -> bool:
    """Rename the complete entry `tmp` (its `meta.json` written last) to `folder`; whether ours went in. An entry
    already at `folder` is kept (named by its content, it is the same), unless `replace` (an entry found broken):
    then it is removed first. One that another process renamed there meanwhile is kept, and `tmp` left for the
    caller to remove."""
    if replace and folder.exists():
        shutil.rmtree(folder)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "meta.json").is_file():
            raise
        log.info("the same %s was cached meanwhile at %s", what, folder)  # another process, same content
        return False
    return True
