"""`python in9_eval.py [flags]`: the original in9_eval.py's interface. The command is tools/in9/cli.py, also
installed as `bgc-in9`; its flags are in docs/cli.md."""

import sys

from tools.in9.cli import build_parser, main

__all__ = ["build_parser", "main"]  # build_parser: the flags, for docs and tests

if __name__ == "__main__":
    sys.exit(main())
