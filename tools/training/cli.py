"""Fine-tune a classifier on an IN-9-style training folder (erm, bg-swap, mixup, cutmix, SWA, LoRA/OFT), save a
checkpoint that in9_eval.py and challenge_eval.py load, and optionally evaluate it against its starting point.

Several GPUs or machines: torchrun --nproc-per-node N train.py ...
"""

from __future__ import annotations

import argparse
import sys

from tools import cli, distributed
from tools.errors import UserError
from tools.provenance import check_outputs
from tools.training.config import build_parser as build_training_parser
from tools.training.config import config_from_args


def build_parser() -> argparse.ArgumentParser:
    return build_training_parser(__doc__)


def _main(args: argparse.Namespace) -> int:
    # the training loop and the evaluation (with the challenge engine and the report) load only for a run, not
    # for parsing the flags or -h
    from tools.training.evaluation import check_eval_data, evaluate_and_report  # noqa: PLC0415
    from tools.training.loop import train  # noqa: PLC0415

    config = config_from_args(args)  # every flag checked
    check_outputs(folders={"--output-dir": config.output_dir})
    check_eval_data(config)  # and the test data; the training data is checked by `train` before the model is built
    try:
        result = train(config)
    finally:
        distributed.cleanup()  # the processes part here: rank 0 evaluates alone, as one process, with no group
    if distributed.from_environment().is_main:
        if config.eval_data is not None:
            try:
                print(f"report: {evaluate_and_report(config, result)}")
            except UserError as exc:  # what the quick check cannot see (an unreadable image): the model is kept
                raise UserError(f"{exc} (the trained model is saved: {result.checkpoint}; evaluate it with "
                                f"`python in9_eval.py --checkpoint {result.checkpoint}` once that is fixed)") from None
        print(f"checkpoint: {result.checkpoint}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(build_parser(), _main, argv)


if __name__ == "__main__":
    sys.exit(main())
