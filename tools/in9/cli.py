"""Accuracy of a classifier on the IN-9 variations, and its BG-gap, as the original in9_eval.py prints them."""

from __future__ import annotations

import argparse

from tools import cli, options
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config
from tools.results.categories import CATEGORY_VARIATIONS
from tools.results.publish import publish_in9
from tools.runtime import RECHECK_MARGIN
from tools.shards import write_in9_shard, written_line


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__, epilog=cli.examples(
        "python in9_eval.py --eval-dataset all --results-file in9.json",
        "python in9_eval.py --eval-dataset mixed_rand --arch timm:convnext_tiny --device cuda"))
    parser.add_argument("--eval-dataset", default="original", choices=[*VARIATIONS, "all"], metavar="NAME",
                        help=f"variation to evaluate, one of {', '.join(VARIATIONS)}, or all (default: original)")
    parser.add_argument("--categories", action="store_true",
                        help="also count the paper's prediction categories (BG Irrelevant, BG Required, ...) from "
                             "original, mixed_rand and only_bg_t, evaluating those three as needed (default: off)")
    cli.add_report_arguments(parser)
    parser.add_argument("--recheck-margin", type=cli.number(0), default=RECHECK_MARGIN, metavar="M",
                        help=f"in bf16/fp16/tf32, re-run every image whose top-two logit margin is below M in true "
                             f"fp32, as the challenge does, so near ties get fp32's prediction (default: "
                             f"{RECHECK_MARGIN} in reduced precision; 0 turns it off)")
    options.add_common_arguments(parser)
    options.add_cache_arguments(parser.add_argument_group("cache"))
    return parser


def _main(args: argparse.Namespace) -> int:
    from tools.prepared_run import Request, prepare  # noqa: PLC0415 (with the challenge's engine: not for -h)

    checked, runtime = options.start(args)
    names = list(VARIATIONS if args.eval_dataset == "all" else (args.eval_dataset,))
    if args.categories:
        names += [v for v in CATEGORY_VARIATIONS.values() if v not in names]
    cache = options.cache_from_args(args)
    request = Request(checked.data_path, In9Config(tuple(names), args.batch_size, args.workers, checked.progress,
                                                   args.recheck_margin),
                      workers=args.workers, cache=cache, progress=checked.progress,
                      allow_inexact_device=args.allow_inexact_device)
    prepared = prepare(request, runtime, lambda: options.model_from_args(args, runtime, checked.progress))
    run = prepared.in9(args.output_dir, args.resume, args.shard)
    if args.shard is not None:
        path = write_in9_shard(args.output_dir, args.shard, run)
        print(written_line(args.shard, path, args.output_dir))
    elif runtime.group.is_main:  # under torchrun, rank 0 prints and writes what one process would
        print("\n".join(publish_in9(run, args.categories, args.results_file, args.report, html=args.html)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(build_parser(), _main, argv)
