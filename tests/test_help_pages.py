"""Each command's -h: the name the user typed, the basic flags before the advanced groups, and example commands
at the end."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import run_forked

pytestmark = pytest.mark.slow  # end to end: every command's help, each in its own process

ROOT = Path(__file__).resolve().parents[1]

# how a user types each command in a checkout (docs/make_cli.py's forms): the usage line must say the same
COMMANDS = ["in9_eval.py", "challenge_eval.py", "train.py", "-m tools.data", "-m tools.zoo", "-m tools.merge",
            "-m tools.results.report", "-m tools.results.analysis", "-m tools.demo"]


@pytest.fixture(scope="module")
def pages() -> dict:
    """Each command's `-h`, as `python COMMAND -h` prints it (tests.helpers.run_forked: one start-up for all)."""
    done = run_forked([[*command.split(), "-h"] for command in COMMANDS], ROOT, {**os.environ, "OMP_NUM_THREADS": "1"})
    return dict(zip(COMMANDS, done))


def help_page(pages: dict, command: str) -> str:
    proc = pages[command]
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_command_typed_and_ends_with_examples(command, pages):
    page = help_page(pages, command)
    typed = command if command.endswith(".py") else f"python {command}"
    assert page.startswith(f"usage: {typed} "), page[:200]
    examples = page.split("\nexamples:\n")
    assert len(examples) == 2, page[-600:]
    lines = examples[1].strip().splitlines()
    usage = page.split("\n\n", 1)[0]  # the usage line names what cannot be left out, and says where the rest is
    assert len(usage.splitlines()) <= 3 and "[options]" in usage and "--log-level" not in usage, usage
    assert 1 <= len(lines) <= 2 and all(line.strip().startswith(f"python {command.removeprefix('-m ')}")
                                        or line.strip().startswith(typed) for line in lines), lines


def test_challenge_help_shows_the_basics_first_in_its_own_words(pages):
    page = help_page(pages, "challenge_eval.py")
    body = page.split("\noptions:\n", 1)[1].split("\nexamples:\n")[0]
    titles = [line[:-1] for line in body.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[-2:] == ["model: LoRA state dicts and remote code", "several processes (torchrun, shards)"], titles
    for flag, group in (("--lora-alpha", titles[-2]), ("--trust-remote-code", titles[-2]),
                        ("--dist-timeout", titles[-1])):
        assert body.index(f"  {flag}") > body.index(f"\n{group}:"), flag
    batch = body[body.index("  --batch-size"):body.index("  --workers")]
    assert "in9_eval" not in batch and "composite" in batch


def test_the_zoo_examples_use_the_default_data_folder(pages):
    page = help_page(pages, "-m tools.zoo")
    assert "--data-path bg_challenge" not in page
