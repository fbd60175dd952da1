"""Write docs/cli.md, the reference of every command line, from the argparse parsers themselves.

    python docs/make_cli.py            # rewrite docs/cli.md
    python docs/make_cli.py --check    # exit 1 if docs/cli.md differs from what the parsers say

The commands are the console scripts of pyproject.toml's [project.scripts], in its order: each `module:main`
has a `build_parser()` beside it. A command is shown as it is typed in a checkout (the root script that calls the
same `main`, else `python -m`) and by its console-script name.

The parsers are read through their objects (groups, actions, sub-commands), never through --help text, so
the page shows exactly the flags, metavars, choices and help strings the commands accept. Defaults that
depend on the machine (CPU count, home folder) are written as the rule that computes them, so the page is
the same wherever it is generated.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
    import tomli as tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "cli.md"
REGENERATE = "python docs/make_cli.py"

PYPROJECT = ROOT / "pyproject.toml"

# Flags whose default is computed on the machine that builds the parser: the rule, written instead of the value.
MACHINE_DEFAULTS = {
    "workers": "min(8, CPUs)",
    "cache_dir": "$XDG_CACHE_HOME/bg-challenge-toolkit, else ~/.cache/bg-challenge-toolkit",
}

HELP_FLAGS = {"-h", "--help"}


@dataclass
class Command:
    name: str  # as typed in a checkout
    parser: argparse.ArgumentParser | None  # None: its module does not exist (yet)
    missing: str = ""
    script: str | None = None  # the console script's name


def read_pyproject(pyproject: Path = PYPROJECT) -> dict:
    with open(pyproject, "rb") as fh:
        return tomllib.load(fh)


def entry_points(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """[project.scripts]: {console script: "module:function"}, in the file's order."""
    return read_pyproject(pyproject)["project"].get("scripts", {})


def commands_from_entry_points(pyproject: Path = PYPROJECT) -> list[tuple[str, str, str]]:
    """(how the command is typed, "module:build_parser", console script) for every entry point."""
    root_scripts = read_pyproject(pyproject).get("tool", {}).get("setuptools", {}).get("py-modules", [])
    return [(typed_form(target, root_scripts), f"{target.split(':')[0]}:build_parser", script)
            for script, target in entry_points(pyproject).items()]


def typed_form(target: str, root_scripts: list[str]) -> str:
    """`python SCRIPT.py` for the root script (of `root_scripts`) whose `main` is this entry point's; else
    `python -m` the module, or its package where the module is the package's `cli` and the package has a
    `__main__`."""
    module_name, function = target.split(":")
    if not in_this_checkout(module_name):
        return f"python -m {module_name}"
    entry = getattr(importlib.import_module(module_name), function)
    for script in root_scripts:
        if in_this_checkout(script) and getattr(importlib.import_module(script), "main", None) is entry:
            return f"python {script}.py"
    package, _, last = module_name.rpartition(".")
    if last == "cli" and importlib.util.find_spec(f"{package}.__main__") is not None:
        return f"python -m {package}"
    return f"python -m {module_name}"


def load_command(name: str, target: str, script: str | None = None) -> list[Command]:
    """Import the parser builder lazily; only a module that does not exist at all is skipped, with a note.

    A parser with sub-commands gives one `Command` per sub-command (and one for its own flags, if any)."""
    module_name, function = target.split(":")
    if not in_this_checkout(module_name):
        return [Command(name, None, missing=module_name, script=script)]
    module = importlib.import_module(module_name)  # a missing import inside it is a real error, raised
    parser = getattr(module, function)()
    subcommands = subparsers_of(parser)
    if not subcommands:
        return [Command(name, parser, script=script)]
    own = [Command(name, parser, script=script)] if documented_actions(parser) else []
    return own + [Command(f"{name} {sub}", subparser, script=script and f"{script} {sub}")
                  for sub, subparser in subcommands.items()]


def in_this_checkout(module_name: str) -> bool:
    """Whether the module exists in this checkout (not merely in another installed copy of the toolkit)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        spec = importlib.util.find_spec(module_name)
    except ModuleNotFoundError as exc:  # a parent package is missing
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return False
        raise
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(ROOT)


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def load_commands(commands=None) -> list[Command]:
    commands = commands_from_entry_points() if commands is None else commands
    return [command for spec in commands for command in load_command(*spec)]


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every argument a user can pass, in the parser's order (-h/--help and sub-command choosers aside)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and not HELP_FLAGS.intersection(a.option_strings)]


def metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return " ".join(action.metavar) if isinstance(action.metavar, tuple) else action.metavar
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest.upper() if action.option_strings else action.dest


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        text = parser._get_formatter()._expand_help(action)
    rule = MACHINE_DEFAULTS.get(action.dest)
    if rule is not None:
        text = text.replace(f"(default: {action.default})", f"(default: {rule})")
    return " ".join(text.split())


def escape(text: str) -> str:
    """Table-cell safe: no pipes breaking the row, no <word> swallowed as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def describe(parser: argparse.ArgumentParser) -> list[str]:
    text = (parser.description or "").strip("\n")
    if not text:
        return []
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter) and "\n" in text:
        return ["```text", text.rstrip(), "```", ""]
    return [escape(" ".join(text.split())), ""]


def render_command(command: Command) -> list[str]:
    lines = [f"## `{command.name}`", ""]
    if command.script is not None:
        lines += [f"Installed as `{command.script}`.", ""]
    if command.parser is None:
        return lines + [f"Not documented yet: the module `{command.missing}` is not in this checkout.", ""]
    parser = command.parser
    lines += describe(parser)
    actions = set(documented_actions(parser))
    for group in parser._action_groups:
        rows = [a for a in group._group_actions if a in actions]
        if not rows:
            continue
        lines += [f"**{group.title}**", "", "| flag | value | meaning |", "| --- | --- | --- |"]
        for action in rows:
            flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{metavar(action)}` (positional)"
            value = f"`{metavar(action)}`" if metavar(action) and action.option_strings else ""
            lines.append(f"| {flags} | {value} | {escape(help_text(parser, action))} |")
        lines.append("")
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    return lines


def render(commands=None) -> str:
    loaded = load_commands(commands)
    lines = ["# Command-line reference", "",
             f"Generated from the argparse parsers by `{REGENERATE}`; do not edit by hand "
             "(`tests/test_docs.py` fails when this page is out of date). Every command also takes `-h`/`--help`.",
             "", "Commands:", ""]
    lines += [f"- [`{c.name}`](#{anchor(c.name)})" + (f" (`{c.script}`)" if c.script else "") for c in loaded]
    lines.append("")
    for command in loaded:
        lines += render_command(command)
    return "\n".join(lines).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    """GitHub's heading anchor for a heading `title` in backticks."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare instead of writing; exit 1 when the file is out of date (default: write)")
    parser.add_argument("--output", type=Path, default=OUTPUT, metavar="PATH",
                        help="the Markdown file (default: docs/cli.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.is_file() else None
        if current != text:
            print(f"{args.output} is out of date: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
