"""Temporary folders renamed into place once their content is complete: a build's output, an archive's extraction
(`temporary_folder`) and the decoded-data cache's entries (`temporary_entry`, `publish`, and their removal,
`remove_entry`). Each is made beside where its content goes, with the umask's mode, named after the host and
process that own it, removed when the work fails or is interrupted, and, when its process died without removing
it (SIGKILL, a crash, a power cut), by the next command that looks in the same place (`remove_stale`)."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import sys
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


def is_stale(name: str, prefix: str, sep: str, host: str) -> bool:
    """Whether the temporary folder `name` (`<prefix><host><sep><pid><sep><random>`) was left by a process of `host`
    that no longer runs. A cache entry's (`ENTRY_PREFIX`) without `ENTRY_SEP` is an older version's (mkdtemp's
    `.tmp-<random>`, which no writer makes any more): stale too."""
    rest = name[len(prefix):]
    if prefix == ENTRY_PREFIX and ENTRY_SEP not in rest:
        return True
    owner_host, _, pid_text = rest.rpartition(sep)[0].rpartition(sep)
    return owner_host == host and pid_text.isdigit() and not is_running(int(pid_text))


def remove_stale(parent: Path, prefix: str, sep: str = "-") -> list[Path]:
    """Remove the `prefix` folders in `parent` (named `<prefix><host><sep><pid><sep><random>`) left by a process of
    this host that no longer runs; returns them.

    Folders of another host (a shared file system) or of a running process are left alone."""
    parent, host = Path(parent), socket.gethostname()
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        if not entry.name.startswith(prefix):
            continue
        if entry.is_dir() and is_stale(entry.name, prefix, sep, host):
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed %s, left by a process that no longer runs", entry)
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


REMOVING = "removing-"  # what follows `temporary_prefix(pid)` in the name of an entry being removed


def remove_entry(path: Path) -> None:
    """Remove a cache entry safely for its readers: renamed to a temporary name of this process (so that no reader
    takes it for an entry any more, and what a killed removal leaves goes as a dead writer's), then deleted.
    A folder already gone is no error. OSError where some of it cannot be deleted (another user's files, an
    immutable flag): the entry is renamed back where nothing of it was deleted yet, else left under its removing
    name (removed by a later use, where it can be)."""
    doomed = path.parent / f"{temporary_prefix(os.getpid())}{REMOVING}{secrets.token_hex(4)}"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    before = sorted(p.relative_to(doomed) for p in doomed.rglob("*"))
    errors: list[BaseException] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(doomed, onexc=lambda function, name, exc: errors.append(exc))
    else:
        shutil.rmtree(doomed, onerror=lambda function, name, info: errors.append(info[1]))
    errors = [e for e in errors if not isinstance(e, FileNotFoundError)]  # gone meanwhile: removed all the same
    if not errors:
        return
    if sorted(p.relative_to(doomed) for p in doomed.rglob("*")) == before:
        with contextlib.suppress(OSError):  # nothing deleted: readers may have it again
            os.rename(doomed, path)
    raise errors[0] if isinstance(errors[0], OSError) else OSError(str(errors[0]))


def publish(tmp: Path, folder: Path, what: str, replace: bool = False) -> bool:
    """Rename the complete entry `tmp` (its `meta.json` written last) to `folder`; whether ours went in. An entry
    already at `folder` is kept (named by its content, it is the same), unless `replace` (an entry its reader found
    broken): then it is removed first by `remove_entry` (renamed away, so no reader sees half of it). One that
    another process renamed there meanwhile is kept, and `tmp` left for the caller to remove."""
    if replace:
        remove_entry(folder)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "meta.json").is_file():
            raise
        log.info("the same %s was cached meanwhile at %s", what, folder)  # another process, same content
        return False
    return True
