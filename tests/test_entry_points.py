"""Every command installs as a console script ([project.scripts]) whose `main(argv=None)` runs in this process,
and each root script is the original's interface to that same `main`."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make_cli():
    yield load_script(ROOT / "docs" / "make_cli.py")
    sys.modules.pop("make_cli", None)


def entry_point(target: str):
    module_name, function = target.split(":")
    return getattr(importlib.import_module(module_name), function)


def test_every_command_is_a_console_script(make_cli):
    scripts = make_cli.entry_points()
    assert {"bgc-in9", "bgc-challenge", "bgc-train", "bgc-data", "bgc-zoo", "bgc-merge", "bgc-report",
            "bgc-analysis", "bgc-demo"} <= set(scripts), scripts


def test_every_console_script_takes_argv_and_answers_help(make_cli, capsys):
    scripts = make_cli.entry_points()
    assert scripts
    for script, target in scripts.items():
        main = entry_point(target)
        assert callable(main), script
        argv = inspect.signature(main).parameters.get("argv")
        assert argv is not None and argv.default is None, f"{script}: {target} has no argv=None parameter"
        with pytest.raises(SystemExit) as exc:
            main(["-h"])
        out, _ = capsys.readouterr()
        assert exc.value.code == 0, script
        assert out.startswith("usage:"), f"{script}: {out[:200]!r}"


def test_each_root_script_calls_a_console_script_main(make_cli):
    mains = {entry_point(target): script for script, target in make_cli.entry_points().items()}
    root_scripts = make_cli.read_pyproject()["tool"]["setuptools"]["py-modules"]
    assert sorted(root_scripts) == ["challenge_eval", "in9_eval", "train"]
    for name in root_scripts:
        module = importlib.import_module(name)
        assert module.main in mains, f"{name}.py does not call any [project.scripts] main"
        assert module.build_parser is importlib.import_module(module.main.__module__).build_parser


def test_the_reference_page_names_each_command_both_ways(make_cli):
    commands = {c.script: c.name for c in make_cli.load_commands()}
    assert commands["bgc-in9"] == "python in9_eval.py"
    assert commands["bgc-challenge"] == "python challenge_eval.py"
    assert commands["bgc-train"] == "python train.py"
    assert commands["bgc-data fetch"] == "python -m tools.data fetch"
    assert commands["bgc-zoo"] == "python -m tools.zoo"
    assert {script.split()[0] for script in commands} == set(make_cli.entry_points())
