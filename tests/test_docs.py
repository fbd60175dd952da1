"""docs/cli.md is what the parsers say: regenerated, it is unchanged; it names every flag; it does not depend on
the machine; a stale page is caught; only a command whose module does not exist yet is skipped."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

REPO = Path(__file__).resolve().parents[1]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def make_cli():
    yield load_script(ROOT / "docs" / "make_cli.py")
    sys.modules.pop("make_cli", None)


def sections(text: str) -> dict[str, str]:
    """The page cut at its `## ` headings, keyed by the command in the heading."""
    parts = text.split("\n## `")[1:]
    return {part.split("`", 1)[0]: part for part in parts}


def test_committed_page_is_current(make_cli):
    committed = make_cli.OUTPUT.read_text(encoding="utf-8")
    assert make_cli.render() == committed, f"docs/cli.md is out of date: run `{make_cli.REGENERATE}`"


def test_every_flag_of_every_parser_is_on_the_page(make_cli):
    page = sections(make_cli.OUTPUT.read_text(encoding="utf-8"))
    commands = make_cli.load_commands()
    assert [c.name for c in commands] == list(page)
    checked = 0
    for command in commands:
        if command.parser is None:
            continue
        for action in make_cli.documented_actions(command.parser):
            names = action.option_strings or [make_cli.metavar(action)]
            for name in names:
                assert f"`{name}`" in page[command.name], f"{name} of {command.name} is missing from docs/cli.md"
                checked += 1
    assert checked > 60  # the two scripts alone have more than 50


def test_page_does_not_depend_on_the_machine(make_cli, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    page = make_cli.render()
    assert page == make_cli.OUTPUT.read_text(encoding="utf-8")
    assert str(tmp_path) not in page and "(default: 3)" not in page


def test_check_fails_on_a_stale_page_and_passes_on_a_fresh_one(make_cli, tmp_path, capsys):
    page = tmp_path / "cli.md"
    page.write_text(make_cli.OUTPUT.read_text(encoding="utf-8").replace("--top-k", "--top-n"), encoding="utf-8")
    assert make_cli.main(["--check", "--output", str(page)]) == 1
    assert make_cli.REGENERATE in capsys.readouterr().err
    assert make_cli.main(["--output", str(page)]) == 0
    assert make_cli.main(["--check", "--output", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == make_cli.OUTPUT.read_text(encoding="utf-8")


def test_sub_commands_get_one_section_each(make_cli):
    names = [c.name for c in make_cli.load_command("python -m tools.data", "tools.data.cli:build_parser")]
    assert names == ["python -m tools.data fetch", "python -m tools.data verify", "python -m tools.data build",
                     "python -m tools.data provenance", "python -m tools.data cache"]


def test_a_command_whose_module_does_not_exist_is_skipped_with_a_note(make_cli):
    [command] = make_cli.load_command("python -m tools.not_written_yet", "tools.not_written_yet:build_parser")
    assert command.parser is None
    assert "`tools.not_written_yet` is not in this checkout" in "\n".join(make_cli.render_command(command))


def test_a_module_with_a_missing_import_is_an_error_not_a_skip(make_cli, tmp_path, monkeypatch):
    (tmp_path / "broken_cli_module.py").write_text("import no_such_dependency_anywhere\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(make_cli, "ROOT", tmp_path)  # the module is part of "this checkout"
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_anywhere"):
        make_cli.load_command("python -m broken_cli_module", "broken_cli_module:build_parser")
    sys.modules.pop("broken_cli_module", None)


def test_a_module_found_only_outside_this_checkout_is_skipped(make_cli, tmp_path, monkeypatch):
    """As when the toolkit is also installed (editable) from another checkout that has the module."""
    (tmp_path / "elsewhere_cli_module.py").write_text("raise AssertionError('must not be imported')\n",
                                                      encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    [command] = make_cli.load_command("python -m elsewhere_cli_module", "elsewhere_cli_module:build_parser")
    assert command.parser is None and command.missing == "elsewhere_cli_module"


def _documented_names() -> set[str]:
    """Every dotted `tools.…` name and every `from tools… import …` in the README, docs/ and bench/RESULTS.md,
    less placeholders in capitals (`tools.MODULE`)."""
    names = set()
    for page in [REPO / "README.md", REPO / "bench" / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        names |= set(re.findall(r"(?<![\w/.])tools(?:\.\w+)+", text))
        for module, imported in re.findall(r"from (tools(?:\.\w+)*) import ([\w, ]+)", text):
            names |= {f"{module}.{name.strip()}" for name in imported.split(",") if name.strip()}
    return {name for name in names if not any(part.isupper() for part in name.split("."))}  # not placeholders


def test_every_name_the_docs_give_exists():
    """A documented module, function or attribute that a refactor moved must be renamed in the docs too."""
    missing = []
    for name in sorted(_documented_names()):
        parts = name.split(".")
        for split in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                target = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            try:
                for attribute in parts[split:]:
                    target = getattr(target, attribute)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, missing
