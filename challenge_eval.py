"""The Backgrounds Challenge: how many foregrounds some test background makes the model misclassify.

Prints the original challenge_eval.py's summary lines; the verdicts equal an exhaustive search's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools import cli, options
from tools.analysis import summary_lines, write_analysis
from tools.errors import UserError
from tools.report import write_report
from tools.challenge import list_challenge_files, load_challenge_data, run_challenge
from tools.provenance import write_json_atomic


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_common_arguments(parser)
    group = parser.add_argument_group("challenge")
    options.add_search_arguments(group)
    group.add_argument("--full", action="store_true",
                       help="no early exit: evaluate every pair and save the foreground x background prediction "
                            "matrix under --output-dir (default: off)")
    group.add_argument("--analysis", action="store_true",
                       help="with --full: attack success rates, per-class fool rates, top backgrounds and their "
                            "figure under --output-dir (default: off; `python -m tools.analysis DIR` redoes it)")
    group.add_argument("--top-k", type=int, default=5, metavar="K",
                       help="most fooling backgrounds listed and drawn per class (default: 5)")
    group.add_argument("--report", type=Path, default=None, metavar="PATH",
                       help="write a Markdown report of the results (default: none)")
    group.add_argument("--per-foreground-csv", type=Path, default=None, metavar="PATH",
                       help="one row per foreground: stem, class, vulnerable, first fooling background found, the "
                            "prediction it caused (default: none)")
    return parser


def main(args: argparse.Namespace) -> int:
    if args.analysis and not args.full:
        raise UserError("--analysis needs the whole prediction matrix: add --full")
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, not {args.top_k}")
    runtime = options.runtime_from_args(args, compile=args.compile)
    options.preload_model_libraries(args.arch, args.checkpoint)  # imports while the data is checked
    # the data is checked, listed, hashed and decoded (or read from the cache) before any model is built
    config = options.challenge_config_from_args(args, runtime, full=args.full)
    data = load_challenge_data(list_challenge_files(args.data_path, args.workers), args.workers,
                               options.cache_dir_from_args(args), config.progress, config.mask_arithmetic)
    loaded = options.model_from_args(args)
    result = run_challenge(loaded, runtime, data, config, args.output_dir, args.resume)
    if not runtime.group.is_main:  # under torchrun, rank 0 prints and writes what one process would
        return 0
    print("\n".join(result.lines()))
    analysis = None
    if args.full:
        result.write_full_outputs(args.output_dir, args.data_path, loaded.num_classes)
        if args.analysis:
            analysis = write_analysis(args.output_dir, args.data_path, args.top_k)
            print("\n".join(summary_lines(analysis)))
    if args.per_foreground_csv is not None:
        result.write_per_foreground_csv(args.per_foreground_csv)
    if args.results_file is not None:
        write_json_atomic(args.results_file, result.to_json())
    if args.report is not None:
        write_report(args.report, challenge=result.to_json(), analysis=analysis)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_main(build_parser(), main))
