"""`python -m tools.merge DIR...`: the shards of one run (`--shard I/N`, see tools.shards) merged into the
outputs one process would have written: the summary lines, the results JSON, and for the challenge the
per-foreground CSV and the --full matrix (with --analysis, its analysis); for in9 the prediction categories."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tools.challenge.config import Criterion
from tools.challenge.data import ChallengeFiles
from tools.challenge.result import ChallengeResult
from tools.challenge.scheduler import state_problem
from tools.challenge.state import SearchState
from tools.cli import ArgumentParser, add_log_level_argument, add_report_arguments, examples, run_main, whole_number
from tools.data import layout
from tools.data.image_sets import ImageSet
from tools.data.layout import DATA_ENV, DEFAULT_DATA_ROOT
from tools.errors import UserError
from tools.in9.evaluate import In9Run, VariationResult
from tools.models import device_check
from tools.provenance import check_outputs
from tools.results.analysis import DEFAULT_TOP_K
from tools.results.publish import publish_challenge, publish_in9
from tools.shards import NOT_MINE, find_shards, read_challenge_arrays

KINDS = ("challenge", "in9")
RERUN_HINT = "fix the cause and rerun the merge"
RERUN_SHARDS = "rerun the shards (--shard I/N) with the run's settings"


def merge_challenge(shards: list[tuple[Path, dict]], data_path: Path) -> tuple[ChallengeResult, int]:
    """The whole run's result from its shards, with the class count the outputs need; the outputs' pictures are
    read from `data_path`, never where a shard file says."""
    (first_path, first), shared = shards[0], ("foregrounds", "backgrounds", "num_classes")
    for path, meta in shards[1:]:
        if any(meta[name] != first[name] for name in shared) or any(
                meta["results"][name] != first["results"][name] for name in ("criterion", "full")):
            raise UserError(f"{path} and {first_path} list other files or settings, yet claim one run; rerun the "
                            f"shards of one run")
    foregrounds = [layout.ForegroundRecord(stem, label, image, mask)
                   for stem, label, image, mask in first["foregrounds"]]
    backgrounds = [layout.ImageRecord(relpath, label) for relpath, label in first["backgrounds"]]
    results = first["results"]
    try:
        criterion = Criterion(results["criterion"])
    except ValueError:
        raise UserError(f"{first_path} names no criterion of the challenge ({results['criterion']!r}); "
                        f"{RERUN_SHARDS}") from None
    files = ChallengeFiles(foregrounds, backgrounds, ImageSet(Path(data_path), results["provenance"].get("data")))
    arrays = [read_challenge_arrays(path, meta) for path, meta in shards]
    if any(not np.array_equal(z["bg_pred"], arrays[0]["bg_pred"]) for z in arrays):
        raise UserError(f"the shards' predictions on the backgrounds alone differ: they are not of one model and data; "
                        f"{RERUN_SHARDS}")
    state = SearchState.finished(len(foregrounds), arrays[0]["bg_pred"], bool(results["full"]))
    for z in arrays:
        rows = z["indices"]
        state.verdict[rows], state.fool_bg[rows], state.fool_pred[rows] = z["verdict"], z["fool_bg"], z["fool_pred"]
        state.min_margin[rows] = z["min_margin"]
        if state.matrix is not None:
            state.matrix[rows] = z["matrix"]
    problem = state_problem(state, files.fg_labels, files.bg_labels, criterion, tested=False)
    if problem is not None:
        raise UserError(f"the shards' verdicts are not what their searches give: {problem}; {RERUN_SHARDS}")
    metas = [meta["results"] for _, meta in shards]
    state.evaluated = sum(m["composites_evaluated"] for m in metas)
    state.elapsed = max(m["wall_time_s"] for m in metas)
    unsure = None if results["unsure_verdicts"] is None else sum(m["unsure_verdicts"] for m in metas)
    provenance = device_check.combined([meta["provenance"] for meta in metas])
    result = ChallengeResult(files, state, criterion, provenance,
                             sum(m["rechecked_fp32"] for m in metas), sum(m["recheck_changed"] for m in metas),
                             unsure, first["key"])
    return result, int(first["num_classes"])


def merge_in9(shards: list[tuple[Path, dict]]) -> In9Run:
    """The whole run's predictions from its shards: every image predicted by exactly one of them."""
    (first_path, first) = shards[0]
    listing = {name: (v["relpaths"], v["labels"]) for name, v in first["variations"].items()}
    for path, meta in shards[1:]:
        if {name: (v["relpaths"], v["labels"]) for name, v in meta["variations"].items()} != listing:
            raise UserError(f"{path} and {first_path} list other images, yet claim one run; {RERUN_SHARDS}")
    results = {}
    for name, variation in first["variations"].items():
        predictions = np.full(len(variation["predictions"]), NOT_MINE, np.int64)
        covered = np.zeros(len(predictions), np.int64)
        for _, meta in shards:
            share = np.asarray(meta["variations"][name]["predictions"], np.int64)
            mine = share != NOT_MINE
            predictions[mine], covered = share[mine], covered + mine
        if (covered != 1).any():
            raise UserError(f"the in9 shards do not predict every image of {name} exactly once; rerun them")
        counts = [sum(meta["variations"][name].get(field, 0) for _, meta in shards)
                  for field in ("rechecked_fp32", "recheck_changed")]
        results[name] = VariationResult(name, variation["relpaths"], np.asarray(variation["labels"], np.int64),
                                        predictions, *counts)
    return In9Run(results, device_check.combined([meta["provenance"] for _, meta in shards]), first["key"])


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=examples(
        "python -m tools.merge shard0 shard1 shard2 shard3",
        "python -m tools.merge --kind challenge runs/"))
    parser.add_argument("folders", nargs="+", type=Path, metavar="DIR",
                        help="the --output-dir of every shard (one folder may hold them all)")
    parser.add_argument("--kind", choices=KINDS, default=None,
                        help="which run to merge when the folders hold shards of both (default: the one found)")
    parser.add_argument("--output-dir", type=Path, default=None, metavar="DIR",
                        help="where the --full matrix and analysis go (default: the first DIR)")
    parser.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                        help="write the merged results and their provenance as JSON (default: none)")
    add_report_arguments(parser)
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help=f"challenge with --analysis: the data folder the figure's and the HTML report's pictures "
                             f"are read from; only files inside it are shown (default: ${DATA_ENV} if set, else "
                             f"{DEFAULT_DATA_ROOT})")
    parser.add_argument("--per-foreground-csv", type=Path, default=None, metavar="PATH",
                        help="challenge: one row per foreground, as challenge_eval.py writes it (default: none)")
    parser.add_argument("--analysis", action="store_true",
                        help="challenge with --full: the adversarial-background analysis (default: off)")
    parser.add_argument("--top-k", type=whole_number(1), default=DEFAULT_TOP_K, metavar="K",
                        help=f"challenge: backgrounds listed and drawn per class by --analysis (default: "
                             f"{DEFAULT_TOP_K})")
    parser.add_argument("--categories", action="store_true",
                        help="in9: the prediction categories, from original, mixed_rand and only_bg_t (default: off)")
    add_log_level_argument(parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    check_outputs(files={"--results-file": args.results_file, "--report": args.report, "--html": args.html,
                         "--per-foreground-csv": args.per_foreground_csv},
                  folders={"--output-dir": args.output_dir})
    found = find_shards(args.folders)
    kind = args.kind or (next(iter(found)) if len(found) == 1 else None)
    if kind is None:
        raise UserError(f"the folders hold shards of both runs ({', '.join(sorted(found))}); pass --kind")
    if kind not in found:
        raise UserError(f"no {kind} shards in {', '.join(map(str, args.folders))}")
    if kind == "challenge":
        data_path = args.data_path or layout.default_data_root()
        result, num_classes = merge_challenge(found[kind], data_path)
        if args.analysis and result.state.matrix is None:
            raise UserError("--analysis needs the whole prediction matrix: the shards ran without --full")
        lines = publish_challenge(result, args.output_dir or args.folders[0], data_path, num_classes, args.analysis,
                                  args.top_k, args.per_foreground_csv, args.results_file, args.report, RERUN_HINT,
                                  html=args.html)
    else:
        lines = publish_in9(merge_in9(found[kind]), args.categories, args.results_file, args.report, RERUN_HINT,
                            html=args.html)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _main, argv, on_interrupt="rerun the same command")


if __name__ == "__main__":
    sys.exit(main())
