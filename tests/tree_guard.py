"""The suite's rule that tests never write into the checkout: the files git sees (untracked and ignored ones
included, Python's byte-code caches aside) are listed when the session starts and again when it ends, and a
session that leaves a new, rewritten or removed path fails, naming them (a path's status, size and modification
time are compared, so a file that was there before the run and is written again counts). Outside a git checkout there is nothing to check.

tests/conftest.py imports these hooks; tests/test_tree_guard.py runs them on a throw-away repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

CACHES = ("__pycache__/", ".pytest_cache/")  # what running Python and pytest writes by itself
KEY = pytest.StashKey[dict]()


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
    if after is None:
        return
    left = sorted(path for path in after.keys() | before.keys() if after.get(path) != before.get(path))
    if not left:
        return
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "files left in the checkout", red=True)
        reporter.write_line(f"the test run left {len(left)} new, changed or removed path(s) in the checkout "
                            f"{session.config.rootpath} (tests must write under tmp_path):", red=True)
        for path in left:
            reporter.write_line(f"    {path}", red=True)
