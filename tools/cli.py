"""The command-line surface every command shares: the --log-level flag, logging set up once, and turning
user errors into one line. It loads neither torch nor any model code."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from tools.errors import UserError

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class BooleanFlag(argparse.BooleanOptionalAction):
    """`--name/--no-name` with its help as written: Python 3.10's BooleanOptionalAction appends
    "(default: True)" to help strings that already say their default in words (3.11 no longer does)."""

    def __init__(self, *args, help: str | None = None, **kwargs):  # noqa: A002 (argparse's keyword)
        super().__init__(*args, **kwargs)
        self.help = help


def add_log_level_argument(parser) -> None:
    """The --log-level flag every command line of the toolkit takes."""
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging detail (default: INFO)")


def run_main(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], int | None],
             argv: list[str] | None = None, on_interrupt: str | None = None) -> int:
    """Parse, set up logging once, run; a user error is one line on stderr and exit code 2.

    `on_interrupt` says what to do after Ctrl-C (default: resume from --output-dir where there is one).
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, getattr(args, "log_level", "INFO")),
                        format="%(levelname)s: %(message)s", stream=sys.stderr, force=True)
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415
        with logging_redirect_tqdm():
            return int(main(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if on_interrupt is None:
            on_interrupt = (f"progress so far is saved under {args.output_dir}; rerun with --resume to continue"
                            if getattr(args, "output_dir", None) is not None else "rerun the same command")
        print(f"interrupted: {on_interrupt}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        distributed = sys.modules.get("tools.distributed")  # loaded (with torch) only by commands that use it
        if distributed is not None:
            distributed.cleanup()
