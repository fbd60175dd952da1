"""The suite's rule that tests never write into the checkout: the files git sees (untracked and ignored ones
included, Python's byte-code caches aside) are listed when the session starts and again when it ends, and a
session that leaves a new or changed path fails, naming them. Outside a git checkout there is nothing to check.

tests/conftest.py imports these hooks; tests/test_tree_guard.py runs them on a throw-away repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

CACHES = ("__pycache__/", ".pytest_cache/")  # what running Python and pytest writes by itself
KEY = pytest.StashKey[frozenset]()


def tree_status(root: Path) -> frozenset[str] | None:
    """git's one-line status of every changed, untracked or ignored path under `root`; None if not a checkout."""
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--ignored", "."], cwd=root,
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return frozenset(line for line in proc.stdout.splitlines()
                     if not any(cache in line or line.endswith(cache.rstrip("/")) for cache in CACHES)
                     and not line.endswith(".pyc"))


def pytest_sessionstart(session: pytest.Session) -> None:
    before = tree_status(session.config.rootpath)
    if before is not None:
        session.stash[KEY] = before


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.stash.get(KEY, None)
    after = tree_status(session.config.rootpath) if before is not None else None
    left = sorted(after - before) if after is not None else []
    if not left:
        return
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("=", "files left in the checkout", red=True)
        reporter.write_line(f"the test run left {len(left)} new or changed path(s) in the checkout "
                            f"{session.config.rootpath} (tests must write under tmp_path):", red=True)
        for line in left:
            reporter.write_line(f"    {line[3:]}", red=True)
