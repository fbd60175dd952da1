"""The temporary folders of the data commands (a build's output, an archive's extraction): made beside where their
content goes, named after the host and process that own them, removed when the work fails or is interrupted, and,
when their process died without removing them (SIGKILL, a crash, a power cut), by the next command that makes one
in the same place."""

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
    return f"{socket.gethostname()}-{os.getpid()}"


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


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove the `prefix` folders in `parent` left by a process of this host that no longer runs; returns them.

    Folders of another host (a shared file system) or of a running process are left alone."""
    parent, host = Path(parent), socket.gethostname()
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if not entry.name.startswith(prefix):
            continue
        owner_host, _, pid_text = entry.name[len(prefix):].rpartition("-")[0].rpartition("-")  # <host>-<pid>-<random>
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
    folder = parent / f"{prefix}{_owner()}-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # already gone when the work renamed it into place
