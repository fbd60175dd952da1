"""Accuracy of a classifier on the IN-9 variations, and its BG-gap, as the original in9_eval.py prints them."""

from __future__ import annotations

import argparse
import sys

from tools import cli
from tools.evaluate import run_in9
from tools.in9 import VARIATIONS
from tools.provenance import write_json_atomic
from tools.runtime import default_batch_size


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--eval-dataset", default="original", choices=[*VARIATIONS, "all"], metavar="NAME",
                        help=f"variation to evaluate, one of {', '.join(VARIATIONS)}, or all (default: original)")
    cli.add_common_arguments(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    runtime = cli.runtime_from_args(args)
    loaded = cli.model_from_args(args)
    names = VARIATIONS if args.eval_dataset == "all" else (args.eval_dataset,)
    run = run_in9(loaded, runtime, args.data_path, names, args.batch_size or default_batch_size(runtime.device),
                  args.workers, args.output_dir, args.resume, not args.no_progress)
    print("\n".join(run.lines()))
    if args.results_file is not None:
        write_json_atomic(args.results_file, run.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(build_parser(), main))
