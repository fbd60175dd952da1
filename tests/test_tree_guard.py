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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_run_that_writes_under_tmp_path_passes(pytester, checkout):
    (checkout / "test_clean.py").write_text(
        "def test_tmp(tmp_path):\n"
        "    (tmp_path / 'in9_state.json').write_text('{}')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()


@pytest.mark.slow
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


@pytest.fixture
def user_home(tmp_path, monkeypatch) -> Path:
    """A home folder for the run inside, whose caches are where the libraries' defaults put them (none of the
    variables that move them set), as on a user's machine."""
    home = tmp_path / "home"
    (home / ".cache" / "huggingface" / "hub").mkdir(parents=True)  # a hub cache the user had before
    (home / ".cache" / "huggingface" / "hub" / "version.txt").write_text("1")
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_MODULES_CACHE",
                 "TRANSFORMERS_CACHE", "TORCH_HOME"):
        monkeypatch.delenv(name, raising=False)
    return home


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.slow
def test_the_libraries_caches_go_to_a_folder_of_the_session(pytester, checkout, user_home):
    """What the tests write through the variables that place the caches (the remote-code test's module folder,
    the decoded-data cache, torch's hub) lands in a folder of the session, removed at its end; the user's caches
    are as they were."""
    before = listing(user_home)
    (checkout / "test_caches.py").write_text(
        "import os\nfrom pathlib import Path\n\n\n"
        "def test_writes_through_the_variables():\n"
        "    home = Path(os.path.expanduser('~'))\n"
        "    hf = Path(os.environ.get('HF_HOME') or Path(os.environ.get('XDG_CACHE_HOME') or home / '.cache') / "
        "'huggingface')\n"
        "    modules = Path(os.environ.get('HF_MODULES_CACHE') or hf / 'modules') / 'transformers_modules' / 'x'\n"
        "    xdg = Path(os.environ.get('XDG_CACHE_HOME') or home / '.cache')\n"
        "    torch_home = Path(os.environ.get('TORCH_HOME') or xdg / 'torch')\n"
        "    for folder in (modules, xdg / 'bg-challenge-toolkit' / 'image-pack', torch_home / 'hub'):\n"
        "        folder.mkdir(parents=True)\n"
        "        (folder / 'written.py').write_text('')\n"
        "        assert not folder.is_relative_to(home), folder\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert listing(user_home) == before


@pytest.mark.slow
def test_a_run_that_writes_into_the_users_caches_fails_naming_the_path(pytester, checkout, user_home):
    """A test that writes where a library's default puts its cache, whatever the variables say (the user's
    ~/.cache/huggingface here): the session fails, naming what changed."""
    (checkout / "test_writes_home.py").write_text(
        "import os\nfrom pathlib import Path\n\n\n"
        "def test_hard_coded_cache():\n"
        "    modules = Path(os.path.expanduser('~')) / '.cache' / 'huggingface' / 'modules'\n"
        "    modules.mkdir()\n"
        "    (modules / '__init__.py').write_text('')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "repo")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*the test run left 3 new, changed or removed path(s) in the user's caches*",
                                 f"*{user_home / '.cache' / 'huggingface' / 'modules' / '__init__.py'}"])
    result.assert_outcomes(passed=1)
