"""What a new user meets in the first hour of a fresh clone: the README's test command comes with the install that
makes it work, and the folders the commands write by default are no clutter for git."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import challenge_eval
import in9_eval
import train
from tools import demo, zoo
from tools.data.layout import DEFAULT_DATA_ROOT

ROOT = Path(__file__).resolve().parents[1]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def test_the_readme_test_command_comes_with_the_install_it_needs():
    """`python -m pytest` fails with "No module named pytest" without the test extra: the block that gives the
    command installs the extra first, and the project is installed in it."""
    blocks = [block for block in code_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
              if "python -m pytest" in block]
    assert len(blocks) == 1, "the README gives its test command once, in a block of its own"
    lines = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.strip()]
    install = next(i for i, line in enumerate(lines) if re.fullmatch(r"""pip install -e ["']?\.\[test\]["']?""", line))
    assert install < next(i for i, line in enumerate(lines) if line.startswith("python -m pytest"))
    extras = re.search(r'^test = \[(.*)\]$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), flags=re.M)
    assert extras and '"pytest' in extras.group(1)  # the extra does bring pytest


def default_output_folders() -> list[Path]:
    """The folders the commands write into the current directory when no path is given: the data, the results,
    the training runs, the zoo's and the demo's."""
    folders = [DEFAULT_DATA_ROOT.parts[0]]
    for parser in (in9_eval.build_parser(), challenge_eval.build_parser(), train.build_parser(), zoo.build_parser(),
                   demo.build_parser()):
        for action in parser._actions:
            if action.dest in ("output_dir", "out") and action.default is not None:
                folders.append(Path(action.default).parts[0])
    return sorted({Path(folder) for folder in folders})


def test_what_the_commands_write_by_default_is_ignored_by_git(tmp_path):
    """Run in the checkout (as the README's commands are), each command's default folder would show up in `git
    status`; the .gitignore keeps them out, at the top of the checkout only (tools/data/ is code)."""
    git = shutil.which("git")
    if git is None or subprocess.run([git, "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    folders = default_output_folders()
    assert {Path("data"), Path("demo"), Path("train_runs")} <= set(folders)
    probes = [f"{folder}/x" for folder in folders] + ["tools/data/x.py", "tools/demo.py", "docs/data.md"]
    found = subprocess.run([git, "-C", str(ROOT), "check-ignore", "--no-index", *probes], capture_output=True,
                           text=True).stdout.split()
    assert found == [f"{folder}/x" for folder in folders]
