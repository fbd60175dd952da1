"""`python challenge_eval.py [flags]`: the original challenge_eval.py's interface. The command is
tools/challenge/cli.py, also installed as `bgc-challenge`; its flags are in docs/cli.md."""

import sys

from tools.challenge.cli import build_parser, main

__all__ = ["build_parser", "main"]  # build_parser: the flags, for docs and tests

if __name__ == "__main__":
    sys.exit(main())
