"""The CI script's browser install, on a PATH of stubs: a failed install ends in its own clear line (not a bare exit
under `set -e`), sudo is used without a prompt and only where it exists, apt waits for its lock, and a browser
installed as `chromium-browser` counts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILED = "CI: chromium could not be installed"
BASH = shutil.which("bash")


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


def run_ci(tmp_path: Path, uid: int, **stubs: str) -> tuple[subprocess.CompletedProcess, str]:
    """`.ci/run` (a copy) with only bash, chmod, dirname, env and the given stubs on PATH (`id -u` says `uid`; `python`
    records its call and succeeds); (the process, the calls the stubs recorded)."""
    repo, bin_dir, calls = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir.mkdir()
    for tool in ("bash", "chmod", "dirname", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    record = f'echo "$(basename "$0") $*" >> {calls}'
    stub(bin_dir, "basename", "echo \"${1##*/}\"")
    stub(bin_dir, "id", f"echo {uid}")
    stub(bin_dir, "python", record)
    for name, body in stubs.items():
        stub(bin_dir, name.replace("_", "-"), f"{record}\n{body}")
    done = subprocess.run([BASH, str(repo / ".ci" / "run")], env={"PATH": str(bin_dir)}, capture_output=True,
                          text=True, timeout=60)
    return done, calls.read_text() if calls.exists() else ""


@pytest.mark.skipif(BASH is None, reason="no bash")
@pytest.mark.parametrize("uid, stubs", [
    (1000, {}),  # not root, and no sudo
    (1000, {"sudo": 'echo "sudo: a password is required" >&2; exit 1'}),
    (0, {"apt_get": 'echo "E: Could not get lock /var/lib/apt/lists/lock" >&2; exit 100'}),
    (0, {"apt_get": "exit 0"}),  # apt-get succeeds but installs no browser
], ids=["no-sudo", "sudo-wants-a-password", "apt-lock", "nothing-installed"])
def test_a_failed_install_ends_in_one_clear_line(tmp_path, uid, stubs):
    done, calls = run_ci(tmp_path, uid, **stubs)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(FAILED), done.stderr
    assert "python" not in calls


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_the_install_waits_for_apt_without_a_prompt_and_chromium_browser_counts(tmp_path):
    installs = f'case "$*" in *install*) printf "#!{BASH}\\n" > "$(dirname "$0")/chromium-browser"; ' \
               f'chmod 755 "$(dirname "$0")/chromium-browser";; esac'
    done, calls = run_ci(tmp_path, 1000, sudo='[ "$1" = -n ] && shift; "$@"', apt_get=installs)
    assert done.returncode == 0, done.stderr
    sudo = [line for line in calls.splitlines() if line.startswith("sudo ")]
    assert len(sudo) == 2 and all(line.startswith("sudo -n ") and "DPkg::Lock::Timeout=120" in line for line in sudo)
    assert "python -m pytest -q" in calls
    done, calls = run_ci(tmp_path / "again", 0, chromium_browser="", apt_get="exit 1")
    assert done.returncode == 0 and "apt-get" not in calls  # already installed under its other name
