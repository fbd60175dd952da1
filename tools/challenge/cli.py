"""The Backgrounds Challenge: how many foregrounds some test background makes the model misclassify.
Prints the original challenge_eval.py's summary lines; the verdicts equal an exhaustive search's."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools import cli, options
from tools.challenge import flags
from tools.errors import UserError
from tools.prepared_run import Request, prepare
from tools.results.analysis import DEFAULT_TOP_K
from tools.results.publish import publish_challenge
from tools.shards import write_challenge_shard, written_line


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__, epilog=cli.examples(
        "python challenge_eval.py --results-file challenge.json",
        "python challenge_eval.py --checkpoint model.pt --full --analysis --report challenge.md"))
    options.add_common_arguments(parser)
    cli.reword(parser, "batch_size", options.BATCH_HELP["challenge"])
    group = parser.add_argument_group("challenge")
    flags.add_search_arguments(group)
    group.add_argument("--full", action="store_true",
                       help="no early exit: evaluate every pair and save the foreground x background prediction "
                            "matrix under --output-dir (default: off)")
    group.add_argument("--analysis", action="store_true",
                       help="with --full: attack success rates, per-class fool rates, top backgrounds and their "
                            "figure under --output-dir (default: off; `python -m tools.results.analysis DIR` redoes "
                            "it)")
    group.add_argument("--top-k", type=cli.whole_number(1), default=DEFAULT_TOP_K, metavar="K",
                       help=f"most fooling backgrounds listed and drawn per class (default: {DEFAULT_TOP_K})")
    cli.add_report_arguments(group)
    group.add_argument("--per-foreground-csv", type=Path, default=None, metavar="PATH",
                       help="one row per foreground: stem, class, vulnerable, first fooling background found, the "
                            "prediction it caused (default: none)")
    return parser


def _main(args: argparse.Namespace) -> int:
    if args.analysis and not args.full:
        raise UserError("--analysis needs the whole prediction matrix: add --full")
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1, not {args.top_k}")
    checked, runtime = options.start(args, compile=args.compile)
    request = Request(checked.data_path, challenge=flags.challenge_config_from_args(args, checked.progress, args.full),
                      workers=args.workers, cache=flags.cache_from_args(args), progress=checked.progress,
                      allow_inexact_device=args.allow_inexact_device)
    prepared = prepare(request, runtime, lambda: options.model_from_args(args, runtime, checked.progress))
    result = prepared.challenge(args.output_dir, args.resume, args.shard)
    num_classes = prepared.model.num_classes
    if args.shard is not None:
        path = write_challenge_shard(args.output_dir, args.shard, result, prepared.data.challenge(),
                                     checked.data_path, num_classes)
        print(written_line(args.shard, path, args.output_dir))
    elif runtime.group.is_main:  # under torchrun, rank 0 prints and writes what one process would
        print("\n".join(publish_challenge(result, args.output_dir, checked.data_path, num_classes, args.analysis,
                                          args.top_k, args.per_foreground_csv, args.results_file, args.report,
                                          html=args.html)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(build_parser(), _main, argv)
