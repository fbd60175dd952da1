"""The Backgrounds Challenge: how many foregrounds some test background makes the model misclassify.

Prints the original challenge_eval.py's summary lines; the verdicts equal an exhaustive search's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tools import cli, options
from tools.analysis import summary_lines, write_analysis
from tools.errors import UserError
from tools.report import write_report
from tools.challenge import ChallengeConfig, Criterion, list_challenge_files, load_challenge_data, run_challenge
from tools.compositing import MaskArithmetic
from tools.provenance import write_json_atomic


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bg-challenge-toolkit"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_common_arguments(parser)
    group = parser.add_argument_group("challenge")
    group.add_argument("--criterion", type=Criterion, choices=list(Criterion), default=Criterion.ANY,
                       metavar="{" + ",".join(c.value for c in Criterion) + "}",
                       help="any: some background changes the prediction (the leaderboard's); bg-class: some "
                            "background of another class makes the model predict that class (default: any)")
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
    group.add_argument("--compile", action="store_true", help="torch.compile the model (default: off)")
    group.add_argument("--recheck-margin", type=float, default=None, metavar="M",
                       help="in bf16/fp16/tf32, re-run every composite whose top-two logit margin is below M in true "
                            "fp32 (autocast and TF32 off for that pass), so near ties get fp32's verdict (default: "
                            "1.0 in reduced precision; 0 turns it off)")
    group.add_argument("--mask-arithmetic", type=MaskArithmetic, choices=list(MaskArithmetic),
                       default=MaskArithmetic.BINARY,
                       metavar="{" + ",".join(m.value for m in MaskArithmetic) + "}",
                       help="binary: masks must hold 0/1 (or booleans) and are composited exactly on bytes; masks "
                            "with other values are refused. original: the original script's arithmetic for any "
                            "values, weight = (uint8(mask) * 255 mod 256) / 255 blended in float, to reproduce "
                            "its numbers on such masks (default: binary)")
    group.add_argument("--cache-dir", type=Path, default=default_cache_dir(), metavar="DIR",
                       help=f"decoded-data cache, keyed by the data fingerprint (default: {default_cache_dir()})")
    group.add_argument("--no-cache", action="store_true", help="neither read nor write the decoded-data cache")
    group.add_argument("--save-every", type=float, default=5.0, metavar="SECONDS",
                       help="seconds between saves of the search state (default: 5)")
    return parser


def main(args: argparse.Namespace) -> int:
    if args.analysis and not args.full:
        raise UserError("--analysis needs the whole prediction matrix: add --full")
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, not {args.top_k}")
    runtime = options.runtime_from_args(args, compile=args.compile)
    # the data is checked, listed, hashed and decoded (or read from the cache) before any model is built
    data = load_challenge_data(list_challenge_files(args.data_path, args.workers), args.workers,
                               None if args.no_cache else args.cache_dir, not args.no_progress,
                               args.mask_arithmetic)
    loaded = options.model_from_args(args)
    recheck = args.recheck_margin if args.recheck_margin is not None else (0.0 if runtime.exact else 1.0)
    config = ChallengeConfig(criterion=args.criterion, full=args.full,
                             batch_size=args.batch_size,
                             save_every=args.save_every, recheck_margin=recheck, progress=not args.no_progress)
    result = run_challenge(loaded, runtime, data, config, args.output_dir, args.resume)
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
