"""`python train.py [flags]` (or `torchrun --nproc-per-node N train.py [flags]`): fine-tuning. The command is
tools/training/cli.py, also installed as `bgc-train`; its flags are in docs/cli.md."""

import sys

from tools.training.cli import build_parser, main

__all__ = ["build_parser", "main"]  # build_parser: the flags, for docs and tests

if __name__ == "__main__":
    sys.exit(main())
