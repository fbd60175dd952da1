"""Temporary folders and files renamed into place once complete: a build's output and an extraction
(`temporary_folder`), the cache's entries (`temporary_entry`, `publish`, `remove_entry`), every output file
(`atomic_names`). Each is named after its host and process; one whose process died is removed by the next
command that looks there (`remove_stale`), only where its name matches a writer's pattern exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

STALE_AFTER_S = 24 * 3600  # a temporary unchanged this long is stale, whatever its host (a writer changes it)


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


@dataclasses.dataclass(frozen=True)
class TemporaryNames:
    """The names one kind of writer gives its temporaries: `<prefix><host><sep><pid><sep><random><suffix>`, `random`
    a regular expression; `legacy`: an older version's whole name, without host or process (stale by age alone)."""

    prefix: str
    sep: str
    random: str
    suffix: str = ""
    legacy: str | None = None

    def make(self, token: str, pid: int | None = None) -> str:
        return f"{self.owned_by(pid)}{token}{self.suffix}"

    def owned_by(self, pid: int | None = None) -> str:
        """How the names of process `pid`'s temporaries (by default this process's) begin."""
        return f"{self.prefix}{socket.gethostname()}{self.sep}{os.getpid() if pid is None else pid}{self.sep}"

    def owner(self, name: str) -> tuple[str, int] | tuple[None, None] | None:
        """(host, pid) of the temporary `name`; (None, None) for a legacy name; None for any other name."""
        sep = re.escape(self.sep)
        host = "[^/]+" if self.sep == "-" else f"[^/{sep}]+"  # host names hold dashes, never an @
        match = re.fullmatch(f"{re.escape(self.prefix)}(?P<host>{host}){sep}(?P<pid>[0-9]+){sep}(?:{self.random})"
                             f"{re.escape(self.suffix)}", name)
        if match is not None:
            return match["host"], int(match["pid"])
        if self.legacy is not None and re.fullmatch(self.legacy, name):
            return None, None
        return None


def newest_change(path: Path) -> float:
    """The newest modification time of `path` and everything under it (links not followed)."""
    info = os.lstat(path)
    newest = info.st_mtime
    if stat.S_ISDIR(info.st_mode):
        for parent, folders, files in os.walk(path):
            for name in folders + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
    return newest


def is_stale(path: Path, owner: tuple, now: float | None = None) -> bool:
    """Whether the temporary `path` of `owner` ((host, pid), (None, None) if legacy) was left behind: this host's
    with its process gone, or, whatever its host, unchanged for `STALE_AFTER_S` (a container's host name changes on
    every start)."""
    host, pid = owner
    if host == socket.gethostname() and not is_running(pid):
        return True
    try:
        return (time.time() if now is None else now) - newest_change(path) > STALE_AFTER_S
    except OSError:  # gone meanwhile
        return False


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def remove_stale(parent: Path, names: TemporaryNames, looks_right: Callable[[Path], bool] | None = None,
                 folders: bool = True) -> list[Path]:
    """Remove the stale temporaries (`is_stale`) in `parent` whose names are exactly `names`' (folders, or with
    `folders=False` files; neither links) and, with `looks_right`, whose content it accepts; returns them."""
    parent = Path(parent)
    removed = []
    for entry in sorted(parent.iterdir()) if parent.is_dir() else []:
        owner = names.owner(entry.name)
        try:
            kind = entry.lstat().st_mode if owner is not None else 0
        except FileNotFoundError:  # removed meanwhile
            continue
        if owner is None or not (stat.S_ISDIR(kind) if folders else stat.S_ISREG(kind)):
            continue
        if looks_right is not None and not looks_right(entry):
            continue
        if is_stale(entry, owner):
            _delete(entry)
            log.info("removed %s, left by a process that stopped (or unchanged for a day)", entry)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def temporary_folder(parent: Path, prefix: str) -> Iterator[Path]:
    """A new folder `<parent>/<prefix><host>-<pid>-<random>` (stale ones removed first), removed on leaving unless
    the work moved it away; any exception, Ctrl-C and SIGTERM (`tools.cli.Terminated`) included."""
    parent = Path(parent)
    names = TemporaryNames(prefix, "-", "[0-9a-f]{8}")
    remove_stale(parent, names)
    folder = parent / names.make(secrets.token_hex(4))
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # already gone when the work renamed it into place


def atomic_names(path: Path) -> TemporaryNames:
    """The temporaries `tools.provenance.atomic_write` writes `path` through: `.NAME.HOST@PID@<random>.tmp`."""
    prefix = f".{Path(path).name}."
    return TemporaryNames(prefix, "@", "[0-9a-f]{12}", ".tmp", legacy=f"{re.escape(prefix)}[0-9a-f]{{12}}\\.tmp")


# A cache entry being written: .tmp-HOST@PID@<random> (no host name holds an @), or being removed:
# .tmp-HOST@PID@removing-<random>; older versions wrote through mkdtemp's .tmp-<8 characters>.
REMOVING = "removing-"  # what follows `ENTRY_NAMES.owned_by(pid)` in the name of an entry being removed
ENTRY_NAMES = TemporaryNames(".tmp-", "@", f"[0-9a-f]{{16}}|{REMOVING}[0-9a-f]{{8}}", legacy=r"\.tmp-[a-z0-9_]{8}")
ENTRY_PREFIX = ENTRY_NAMES.prefix


def holds_entry_files(folder: Path) -> bool:
    """Whether `folder` holds only what the cache's writers write: regular files named `meta.json` or `*.npy`."""
    try:
        return all(stat.S_ISREG(child.lstat().st_mode) and (child.name == "meta.json" or child.suffix == ".npy")
                   and not child.name.startswith(".") for child in folder.iterdir())
    except OSError:
        return False


def entry_temporary(path: Path) -> tuple | None:
    """The owner of the cache temporary `path` (`TemporaryNames.owner`); None where name, content or a link says
    it is not one."""
    owner = ENTRY_NAMES.owner(path.name)
    if owner is None or path.is_symlink() or not path.is_dir() or not holds_entry_files(path):
        return None
    return owner


def remove_stale_entries(cache_dir: Path) -> None:
    """`remove_stale` for the cache entries being written in `cache_dir`; a folder that cannot be read is left."""
    try:
        remove_stale(cache_dir, ENTRY_NAMES, holds_entry_files)
    except OSError:
        return


def temporary_entry(parent: Path) -> Path:
    """A new folder in `parent` to write a cache entry into (for `publish`; the caller removes it if still there);
    the umask's mode, since mkdtemp's 0700 would shut out the other users of a shared cache."""
    parent.mkdir(parents=True, exist_ok=True)
    folder = parent / ENTRY_NAMES.make(secrets.token_hex(8))
    folder.mkdir()
    return folder


def remove_entry(path: Path) -> None:
    """Remove a cache entry safely for its readers: renamed to this process's temporary name, then deleted; one
    gone already is no error. OSError where some of it cannot be deleted: renamed back where nothing was, else left
    under its removing name."""
    doomed = path.parent / ENTRY_NAMES.make(REMOVING + secrets.token_hex(4))
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
    already there is kept (same content), unless `replace` (one its reader found broken): then removed first by
    `remove_entry`. One another process renamed there meanwhile is kept, `tmp` left for the caller."""
    if replace and holds_entry_files(folder):
        remove_entry(folder)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "meta.json").is_file():
            raise
        log.info("the same %s was cached meanwhile at %s", what, folder)  # another process, same content
        return False
    return True
