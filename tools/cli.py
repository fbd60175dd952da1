"""The command-line surface every command shares: the --log-level flag, logging set up once, turning user errors
into one line, and stopping cleanly on Ctrl-C or SIGTERM. It loads neither torch nor any model code."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from tools import EXIT_INTERRUPTED, interrupted_while_loading
from tools.errors import UserError, mismatched_torchvision

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, a timeout, `kill`), raised where Ctrl-C's KeyboardInterrupt would be, so every
    clean-up written for Ctrl-C runs for it too."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class BooleanFlag(argparse.BooleanOptionalAction):
    """`--name/--no-name` with its help as written (Python 3.10's BooleanOptionalAction appends its default)."""

    def __init__(self, *args, help: str | None = None, **kwargs):  # noqa: A002 (argparse's keyword)
        super().__init__(*args, **kwargs)
        self.help = help


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help text as written where it spans lines, wrapped where it is one line."""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: a command-line mistake is one `error:` line (the closest valid choice, a pointer to
    -h) and exit code 2; named as the user typed it; the basic groups of flags shown before the advanced ones."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        if kwargs.get("prog") is None and not args:
            kwargs["prog"] = typed_name(sys._getframe(1).f_globals.get("__name__"))
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def add_argument_group(self, *args, advanced: bool = False, **kwargs):
        """A named group of flags; `advanced` ones (adapters, several processes, ...) are shown after the basics."""
        group = super().add_argument_group(*args, **kwargs)
        group.advanced = advanced
        return group

    def format_help(self) -> str:
        groups = self._action_groups
        self._action_groups = sorted(groups, key=lambda group: getattr(group, "advanced", False))  # stable
        try:
            with self._compact_usage():
                return super().format_help()
        finally:
            self._action_groups = groups

    def format_usage(self) -> str:
        with self._compact_usage():
            return super().format_usage()

    @contextlib.contextmanager
    def _compact_usage(self) -> Iterator[None]:
        """A usage line of what cannot be left out and `[options]` (one of every flag ran to 20 lines)."""
        if self.usage is not None:
            yield
            return
        flags = [action for action in self._actions if action.option_strings and action.required]
        positionals = [action for action in self._actions if not action.option_strings]
        parts = ["%(prog)s [-h]", self._usage_of(flags), "[options]", self._usage_of(positionals)]
        self.usage = " ".join(part for part in parts if part)
        try:
            yield
        finally:
            self.usage = None

    def _usage_of(self, actions: list) -> str:
        if not actions:
            return ""
        formatter = self._get_formatter()
        formatter.add_usage(None, actions, [], prefix="")
        return formatter.format_help().strip().removeprefix(self.prog).strip().replace("%", "%%")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flag = next((arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")), None)
            hint = closest(flag, self._every_flag()) if flag else ""
            self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed

    def _every_flag(self) -> list[str]:
        """This parser's flags and its sub-commands' (an unknown flag after a sub-command comes back up here)."""
        flags = []
        for action in self._actions:
            flags.extend(flag for flag in action.option_strings if flag.startswith("--"))
            for sub in (action.choices or {}).values() if isinstance(action, argparse._SubParsersAction) else ():
                flags.extend(sub._every_flag() if isinstance(sub, ArgumentParser) else [])
        return list(dict.fromkeys(flags))

    def error(self, message: str):
        message = " ".join(message.split())
        self.exit(EXIT_USER_ERROR, f"error: {message}; see `{self.prog} -h`\n")

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError:
            if action.choices is None:
                raise
            raise argparse.ArgumentError(action, _invalid_choice(arg_string, action.choices)) from None

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, _invalid_choice(value, action.choices))


def _invalid_choice(value, choices) -> str:
    """'invalid choice 'mixed_sam'; did you mean mixed_same? (valid: ...)': enum members shown by their value."""
    names = [str(getattr(choice, "value", choice)) for choice in choices]
    text = str(getattr(value, "value", value))
    return f"invalid choice {text!r}{closest(text, names)} (valid: {', '.join(names)})"


# argv[0] of an interpreter that is not running a command: `python -c`, an interactive session, a notebook kernel
NOT_A_COMMAND = ("", "-c", "-m", "ipykernel_launcher.py", "__main__.py")


def typed_name(module: str | None = None) -> str:
    """The command's name as the user typed it (in9_eval.py, `python -m PACKAGE`); where the interpreter runs no
    command of the toolkit (`python -c`, a notebook), `python -m MODULE` of the parser's `module`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # `python -m NAME` (a script by path: no spec)
        name = spec.name.removesuffix(".__main__")
        if module is None or name.startswith("tools") or not module.startswith("tools"):
            return f"python -m {name}"
    typed = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if typed in NOT_A_COMMAND or (spec is not None and module is not None and module.startswith("tools")):
        return f"python -m {module}" if module else "python"
    return typed


def reword(parser: argparse.ArgumentParser, dest: str, help: str) -> None:  # noqa: A002 (argparse's word)
    """Give a shared flag this command's own help text."""
    for action in parser._actions:
        if action.dest == dest:
            action.help = help


def examples(*commands: str) -> str:
    """A command's epilog: the example command lines it ends its -h with."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)


def closest(text: str, options) -> str:
    """'; did you mean X?' for the option closest to a mistyped `text`, case aside (ANY -> any), else ''."""
    by_folded = {}
    for option in map(str, options):
        by_folded.setdefault(option.casefold(), option)
    close = difflib.get_close_matches(text.casefold(), list(by_folded), n=1, cutoff=0.5)
    return f"; did you mean {by_folded[close[0]]}?" if close else ""


def positive_number(unit: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number of `unit` (seconds, minutes)."""
    return number(0, unit=unit, above=True)


def number(minimum: float, maximum: float | None = None, unit: str | None = None, above: bool = False,
           below: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number from `minimum` (excluded with `above`) to `maximum` (excluded with
    `below`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low_ok = value > minimum if above else value >= minimum
        high_ok = maximum is None or (value < maximum if below else value <= maximum)
        if not (math.isfinite(value) and low_ok and high_ok):
            raise argparse.ArgumentTypeError(f"{text!r} is not {_range_words(minimum, maximum, above, below, unit)}")
        return value

    return parse


def _range_words(minimum: float, maximum: float | None, above: bool, below: bool, unit: str | None) -> str:
    of = f" of {unit}" if unit else ""
    if maximum is None:
        return f"a positive, finite number{of}" if minimum == 0 and above else \
            f"a finite number{of}, {'above' if above else 'at least'} {minimum:g}"
    if not above and not below:
        return f"a number{of} from {minimum:g} to {maximum:g}"
    return (f"a number{of} {'above' if above else 'at least'} {minimum:g} and "
            f"{'below' if below else 'at most'} {maximum:g}")


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from `minimum` to `maximum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bounds = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number {bounds}")
        return value

    return parse


MAX_SEED = 2**64 - 1  # the largest seed torch's generator holds (a negative one would alias a large one)
MAX_WORKERS = 256  # threads (or training's loader processes) a command starts at most
seed_number = whole_number(0, MAX_SEED)
worker_count = whole_number(1, MAX_WORKERS)


def add_report_arguments(group) -> None:
    """The --report and --html flags of the commands that publish results (in9_eval.py, challenge_eval.py, merge)."""
    group.add_argument("--report", type=Path, default=None, metavar="PATH",
                       help="write a Markdown report of the results (default: none)")
    group.add_argument("--html", type=Path, default=None, metavar="PATH",
                       help="write the report as one self-contained HTML page with pictures (default: none)")


def add_log_level_argument(parser) -> None:
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging detail (default: INFO)")


def run_main(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], int | None],
             argv: list[str] | None = None, on_interrupt: str | None = None) -> int:
    """Parse, set up logging once, run: a user error is one `error:` line and exit 2; Ctrl-C (130) and SIGTERM (143)
    stop through the clean-up and say how to go on (`on_interrupt`; default: resume from --output-dir)."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_loading:  # loaded: Ctrl-C is Python's again, caught below
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parser.parse_args(argv)
    from tools.runtime import tune_cpu_allocator  # noqa: PLC0415 (torch: not for --help)
    tune_cpu_allocator()  # a command line's own process: keep freed memory for reuse
    logging.basicConfig(level=getattr(logging, getattr(args, "log_level", "INFO")),
                        format="%(levelname)s: %(message)s", stream=sys.stderr, force=True)
    _cache_written()  # what an earlier command in this process wrote is not this one's
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415
        with sigterm_as_interrupt(), logging_redirect_tqdm():
            return int(main(args) or 0)
    except Exception as exc:
        error = exc if isinstance(exc, UserError) else mismatched_torchvision(exc)
        if error is None:
            raise
        if getattr(error, "stdout", None):  # what the command had computed before the error: printed all the same
            print("\n".join(error.stdout))
        _say_cache_written()  # before the error line, which ends the output
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt as exc:
        if on_interrupt is None:
            on_interrupt = (f"progress so far is saved under {args.output_dir}; rerun with --resume to continue"
                            if getattr(args, "output_dir", None) is not None else "rerun the same command")
        terminated = isinstance(exc, Terminated)
        _say_cache_written()
        print(f"{'terminated' if terminated else 'interrupted'}: {on_interrupt}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    finally:
        _say_cache_written()
        distributed = sys.modules.get("tools.distributed")  # loaded (with torch) only by commands that use it
        if distributed is not None:
            distributed.cleanup()


def _say_cache_written() -> None:
    """Log what the command wrote into the cache, once: at its end, or before its last line (an error)."""
    written = _cache_written()
    if written is not None:
        log.info("%s", written)


def _cache_written() -> str | None:
    """`tools.data.cache_admin.written_line`, where the decoded-data cache was loaded (only then can it be written)."""
    if "tools.data.store" not in sys.modules:
        return None
    from tools.data import cache_admin  # noqa: PLC0415 (numpy: only where the cache was used)
    return cache_admin.written_line()
