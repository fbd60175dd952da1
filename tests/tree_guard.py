"""The suite's rule that tests write nothing where a user does not look: neither into the checkout nor into the
user's caches.

The checkout: the files git sees (untracked and ignored ones included, Python's byte-code caches aside) are listed
when the session starts and again when it ends, and a session that leaves a new, rewritten or removed path fails,
naming them (a path's status, size and modification time are compared, so a file that was there before the run and
is written again counts). Outside a git checkout there is nothing to check.

The user's caches (the toolkit's decoded-data cache, Hugging Face's hub and remote-code modules, torch's hub,
open_clip's downloads): every variable that places them (`ISOLATED`) points into a temporary folder for the whole
session, set before any test module is imported (huggingface_hub and transformers read theirs on import) and put
back at the end; and where they would otherwise be (`user_caches`) is listed at the start and at the end, a change
failing the session like a path left in the checkout (another program using those caches meanwhile shows there
too).

tests/conftest.py imports these hooks; tests/test_tree_guard.py runs them on a throw-away repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CACHES = ("__pycache__/", ".pytest_cache/")  # what running Python and pytest writes by itself
KEY = pytest.StashKey[dict]()
USER_KEY = pytest.StashKey[dict]()  # the user's caches as they were when the session started
ISOLATED_KEY = pytest.StashKey[tuple]()  # the session's cache folder, and the variables as they were
# The variables that place the user's caches: XDG's (the toolkit's own, and the default of the others), Hugging
# Face's (HF_HOME, its hub and the remote-code modules transformers writes; the older names too) and torch's.
ISOLATED = ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_MODULES_CACHE",
            "TRANSFORMERS_CACHE", "TORCH_HOME")
READ_ON_IMPORT = ("huggingface_hub.constants", "transformers")  # modules that fix their cache folders on import


def user_caches(environ=os.environ) -> list[Path]:
    """Where the toolkit and its libraries would write their caches for the user of `environ`."""
    home = Path(os.path.expanduser("~"))
    bases = {Path(environ.get("XDG_CACHE_HOME") or home / ".cache"), home / ".cache"}
    places = {base / name for base in bases for name in ("bg-challenge-toolkit", "huggingface", "torch", "clip")}
    places |= {Path(environ[name]) for name in ISOLATED[1:] if environ.get(name)}
    return sorted(places)


def _listing(place: Path) -> dict[str, tuple]:
    """`place` and every path under it (links not followed) with its size (None: a folder) and modification time;
    {} where it is missing."""
    try:
        found = {".": (None, os.lstat(place).st_mtime_ns)}
    except OSError:
        return {}
    for parent, folders, files in os.walk(place):
        for name in folders + files:
            path = os.path.join(parent, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            found[os.path.relpath(path, place)] = (info.st_size if name in files else None, info.st_mtime_ns)
    return found


def pytest_configure(config: pytest.Config) -> None:
    imported = [name for name in READ_ON_IMPORT if name in sys.modules]
    if imported:
        raise pytest.UsageError(f"{', '.join(imported)} imported before the tests' caches were isolated: they would "
                                f"write into the user's; import them in the tests, not at conftest's top")
    config.stash[USER_KEY] = {place: _listing(place) for place in user_caches()}
    folder = Path(tempfile.mkdtemp(prefix="tests-caches-"))
    config.stash[ISOLATED_KEY] = (folder, {name: os.environ.get(name) for name in ISOLATED})
    for name in ISOLATED:
        os.environ[name] = str(folder / name.lower())


def pytest_unconfigure(config: pytest.Config) -> None:
    folder, before = config.stash.get(ISOLATED_KEY, (None, {}))
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _user_caches_changed(config: pytest.Config) -> list[str]:
    changed = []
    for place, before in config.stash.get(USER_KEY, {}).items():
        after = _listing(place)
        changed += [str(place / path) for path in sorted(after.keys() | before.keys())
                    if after.get(path) != before.get(path)]
    return changed


def _signature(path: Path) -> tuple:
    """What a rewrite changes: a file's size and modification time; a folder's (git lists an ignored folder
    whole), its files' count, total size and newest modification time; () for a path that is gone."""
    try:
        if path.is_dir():
            files = [p.stat() for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
            return (len(files), sum(f.st_size for f in files), max((f.st_mtime_ns for f in files), default=0))
        info = path.stat()
        return (info.st_size, info.st_mtime_ns)
    except OSError:
        return ()


def tree_status(root: Path) -> dict[str, tuple] | None:
    """Every changed, untracked or ignored path under `root` as git lists it, with its status and `_signature`;
    None if `root` is not a git checkout. Any other failure of git is a failure of the guard, said in the run."""
    try:
        proc = subprocess.run(["git", "-c", f"safe.directory={root}", "status", "--porcelain", "--untracked-files=all",
                               "--ignored", "."], cwd=root, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the checkout's tree could not be listed: {exc}") from exc
    if proc.returncode != 0:
        if "not a git repository" in proc.stderr:
            return None
        raise RuntimeError(f"the checkout's tree could not be listed: git status: {proc.stderr.strip()}")
    lines = [line for line in proc.stdout.splitlines()
             if not any(cache in line or line.endswith(cache.rstrip("/")) for cache in CACHES)
             and not line.endswith(".pyc")]
    return {line[3:]: (line[:2], _signature(root / line[3:].strip('"'))) for line in lines}


def pytest_sessionstart(session: pytest.Session) -> None:
    before = tree_status(session.config.rootpath)
    if before is not None:
        session.stash[KEY] = before


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.stash.get(KEY, None)
    after = tree_status(session.config.rootpath) if before is not None else None
    left = [] if after is None else sorted(path for path in after.keys() | before.keys()
                                           if after.get(path) != before.get(path))
    caches = _user_caches_changed(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for paths, title, what in ((left, "files left in the checkout", f"in the checkout {session.config.rootpath}"),
                               (caches, "files left in the user's caches", "in the user's caches")):
        if not paths:
            continue
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", title, red=True)
            reporter.write_line(f"the test run left {len(paths)} new, changed or removed path(s) {what} (tests must "
                                f"write under tmp_path):", red=True)
            for path in paths:
                reporter.write_line(f"    {path}", red=True)
