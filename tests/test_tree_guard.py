"""The suite fails when its run leaves a new path in the checkout (tests/tree_guard.py), on a throw-away git
repository with the same hooks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

GUARD = Path(__file__).with_name("tree_guard.py")


@pytest.fixture
def checkout(pytester) -> Path:
    """A git repository with the guard in its conftest.py (beside it, pytester's own temporary folders)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = pytester.mkdir("repo")
    (repo / "conftest.py").write_text(GUARD.read_text())
    (repo / "pytest.ini").write_text("[pytest]\n")
    (repo / ".gitignore").write_text("bg_results/\n")
    subprocess.run(["git", "init", "-q", "."], cwd=repo, check=True)
    return repo


def test_a_run_that_writes_into_the_checkout_fails_naming_the_path(pytester, checkout):
    (checkout / "test_writes.py").write_text(
        "from pathlib import Path\n\n\n"
        "def test_default_output_folder():  # as a command's default --output-dir, run from the checkout's root\n"
        "    (Path(__file__).parent / 'bg_results').mkdir()\n"
        "    (Path(__file__).parent / 'bg_results' / 'in9_state.json').write_text('{}')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*the test run left 1 new, changed or removed path(s) in the checkout*",
                                 "*bg_results/in9_state.json"])
    result.assert_outcomes(passed=1)


def test_a_run_that_writes_under_tmp_path_passes(pytester, checkout):
    (checkout / "test_clean.py").write_text(
        "def test_tmp(tmp_path):\n"
        "    (tmp_path / 'in9_state.json').write_text('{}')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()


def test_a_file_that_was_there_before_and_is_written_again_fails_the_run(pytester, checkout):
    """A user who ran in9_eval in the checkout already has bg_results/in9_state.json: a test that writes it again
    leaves the same git status line, and must still be caught."""
    (checkout / "bg_results").mkdir()
    (checkout / "bg_results" / "in9_state.json").write_text("{}")
    (checkout / "test_rewrites.py").write_text(
        "from pathlib import Path\n\n\n"
        "def test_default_output_folder():\n"
        "    (Path(__file__).parent / 'bg_results' / 'in9_state.json').write_text('{\"done\": 1}')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*bg_results*"])
