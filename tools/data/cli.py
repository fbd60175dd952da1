"""The command line of `python -m tools.data {fetch,verify,build,provenance,cache}`."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from tools.cli import (
    ArgumentParser,
    add_log_level_argument,
    examples,
    positive_number,
    run_main,
    seed_number,
    whole_number,
    worker_count,
)
from tools.data import cache_admin, grabcut
from tools.data.builder import DEFAULT_JPEG_QUALITY, ImageFormat, build
from tools.data.check import verify_layout
from tools.data.download import DEFAULT_TIMEOUT_S, RELEASE_URL, fetch
from tools.data.layout import DATA_ENV, DEFAULT_DATA_ROOT, PROVENANCE_FOLDER, check_data_root, default_data_root
from tools.data.store import default_cache_dir
from tools.errors import UserError
from tools.in9 import SPLIT, TRAIN_SPLIT
from tools.provenance import check_outputs
from tools.threads import default_workers

log = logging.getLogger(__name__)

MAX_GRABCUT_ITERATIONS = 100  # GrabCut's iterations at most (its default: 5; each costs seconds per image)
RERUN_ADVICE = ("rerun the same command (fetch resumes its partial download, or extracts the downloaded archive; "
                "build starts again)")


def _sha256_arg(value: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a SHA-256 (64 hexadecimal digits)")
    return value.lower()


# -h's text, its own: the package docstring says what the package owns
DESCRIPTION = ("Getting, checking and building IN-9 test data: "
               "`python -m tools.data {fetch,verify,build,provenance,cache}`." """

fetch   downloads the release archive (resuming a partial download), checks its SHA-256 and extracts it
        safely into --data-path, so that <data-path>/original/val/... exist.
verify  checks the folder layout both scripts read and prints a variation x class table of counts and
        every problem found; `quick_check` is the fast form the scripts run before they start.
build   makes the eight variations and fg_mask from labelled images with one bounding box each,
        following the paper's Appendix A (resize 256, centre crop 224, four filters, GrabCut masks).
provenance  finds the only_bg_t image each mixed image was made from, and every mask's box, from the pixels.
cache   shows what the decoded-data cache holds, and clears it, bounds its size or removes what this
        version cannot read.""")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    add_log_level_argument(common)
    parser = ArgumentParser(description=DESCRIPTION, epilog=examples(
        "python -m tools.data fetch", "python -m tools.data verify --data-path data/bg_challenge"))
    commands = parser.add_subparsers(dest="command", required=True, metavar="{fetch,verify,build,provenance,cache}")

    fetch_p = commands.add_parser("fetch", parents=[common], help="download, check and extract the IN-9 test release",
                                  description="Download the release archive (resuming a partial download), check "
                                              "its SHA-256 and extract it safely into --data-path.",
                                  epilog=examples("python -m tools.data fetch", "python -m tools.data fetch "
                                                  "--archive backgrounds_challenge_data.tar.gz"))
    fetch_p.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                         help=f"folder to hold original/, ..., fg_mask/, created if missing (default: ${DATA_ENV} if "
                              f"set, else {DEFAULT_DATA_ROOT}, where the evaluation scripts look)")
    fetch_p.add_argument("--url", default=RELEASE_URL, metavar="URL",
                         help=f"archive to download (default: {RELEASE_URL})")
    fetch_p.add_argument("--sha256", type=_sha256_arg, default=None, metavar="HEX",
                         help="expected SHA-256 of the archive (default: the release's, unless --url names another "
                              "source, when the check is skipped with a warning)")
    fetch_p.add_argument("--archive", type=Path, default=None, metavar="FILE",
                         help="extract this already downloaded archive instead of downloading (default: download)")
    fetch_p.add_argument("--keep-archive", action="store_true",
                         help="keep the downloaded archive in --data-path after extracting it (default: delete it)")
    fetch_p.add_argument("--timeout", type=positive_number("seconds"), default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                         help=f"network timeout, a positive number of seconds (default: {DEFAULT_TIMEOUT_S:g})")
    fetch_p.set_defaults(handler=_run_fetch)

    verify_p = commands.add_parser("verify", parents=[common], help="check a data folder and count its images",
                                   description="Check the layout both scripts read; print a variation x class table "
                                               "and every problem; exit 2 if there is any.",
                                   epilog=examples("python -m tools.data verify",
                                                   "python -m tools.data verify --data-path data/bg_challenge --full"))
    verify_p.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                          help=f"folder holding original/, ..., fg_mask/ (default: ${DATA_ENV} if set, else "
                               f"{DEFAULT_DATA_ROOT})")
    verify_p.add_argument("--full", action="store_true",
                          help="decode every image (default: read image headers only, which finds wrong sizes and "
                               "non-images but not truncated files)")
    verify_p.add_argument("--split", choices=(SPLIT, TRAIN_SPLIT), default=SPLIT,
                          help=f"the split folder checked, <variation>/<split>/<class>/: {SPLIT} as the test release, "
                               f"{TRAIN_SPLIT} for what `build --split {TRAIN_SPLIT}` writes (default: {SPLIT})")
    verify_p.add_argument("--workers", type=worker_count, default=default_workers(), metavar="N",
                          help=f"threads reading files (default: {default_workers()})")
    verify_p.set_defaults(handler=_run_verify)

    build_p = commands.add_parser("build", parents=[common], help="make the variations from images with boxes",
                                  description="Make the eight variations and fg_mask from labelled images with one "
                                              "bounding box each, as in the paper's Appendix A.",
                                  epilog=examples("python -m tools.data build --images my_images --boxes boxes.csv "
                                                  "--out data/my_in9",
                                                  "python -m tools.data build --images train_images --boxes boxes/ "
                                                  "--out data/my_in9_train --split train"))
    build_p.add_argument("--images", type=Path, required=True, metavar="DIR",
                         help="folder with one sub-folder per IN-9 class, matched to the classes by name (dog or "
                              "Dog, 00_dog, or the class's WordNet id n02084071; written as 00_dog ... 08_fish), or "
                              "an ImageNet-style folder with its 1000 WordNet-id sub-folders, whose 370 IN-9 classes "
                              "are grouped into the nine by the ImageNet->IN-9 map")
    build_p.add_argument("--boxes", type=Path, required=True, metavar="PATH",
                         help="folder of Pascal VOC .xml files (1-based inclusive coordinates) or a CSV file "
                              "image,xmin,ymin,xmax,ymax (0-based pixels, xmax/ymax exclusive)")
    build_p.add_argument("--out", type=Path, required=True, metavar="DIR",
                         help="new or empty output folder; the build is written beside it in a hidden folder and "
                              "renamed to it when complete, so an interrupted build leaves nothing")
    build_p.add_argument("--masks", type=Path, default=None, metavar="DIR",
                         help="your own foreground masks <stem>.npy or <stem>.png, at the original image's size or "
                              "224x224 (default: GrabCut from the box, which needs OpenCV)")
    build_p.add_argument("--seed", type=seed_number, default=0, metavar="N",
                         help="seed for the mixed backgrounds and GrabCut (default: 0)")
    build_p.add_argument("--jpeg-quality", type=whole_number(1, 100), default=DEFAULT_JPEG_QUALITY, metavar="Q",
                         help=f"JPEG quality 1-100 (default: {DEFAULT_JPEG_QUALITY})")
    build_p.add_argument("--image-format", type=ImageFormat, choices=list(ImageFormat), default=ImageFormat.JPEG,
                         metavar="{" + ",".join(f.value for f in ImageFormat) + "}",
                         help="jpeg writes <stem>.JPEG as the release; png is lossless (default: jpeg)")
    build_p.add_argument("--grabcut-iterations", type=whole_number(1, MAX_GRABCUT_ITERATIONS),
                         default=grabcut.DEFAULT_ITERATIONS, metavar="N",
                         help=f"GrabCut iterations (default: {grabcut.DEFAULT_ITERATIONS})")
    build_p.add_argument("--split", choices=(SPLIT, TRAIN_SPLIT), default=SPLIT,
                         help=f"the split folder written, <variation>/<split>/<class>/: {SPLIT} as the test release, "
                              f"{TRAIN_SPLIT} for train.py (default: {SPLIT})")
    build_p.add_argument("--keep-unboxed", action="store_true",
                         help=f"with --split {TRAIN_SPLIT}: images without a bounding box go to original/ alone "
                              f"(IN-9L-style, usable by erm/mixup/cutmix, not by bg-swap) instead of being dropped "
                              f"(default: off)")
    build_p.add_argument("--workers", type=worker_count, default=default_workers(), metavar="N",
                         help=f"threads decoding, segmenting and writing images (default: {default_workers()})")
    build_p.set_defaults(handler=_run_build)

    provenance_p = commands.add_parser(
        "provenance", parents=[common], help="find each mixed image's background and each mask's box",
        description="Match every mixed_same/mixed_rand/mixed_next image with the only_bg_t image it was made from "
                    "(by its pixels outside the foreground mask) and box every mask; write provenance.csv, "
                    "boxes.csv and provenance_summary.json.",
        epilog=examples("python -m tools.data provenance --data-path data/bg_challenge --output provenance"))
    provenance_p.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                              help=f"folder holding only_bg_t/, the mixed variations and fg_mask/ (default: "
                                   f"${DATA_ENV} if set, else {DEFAULT_DATA_ROOT})")
    provenance_p.add_argument("--output", type=Path, default=None, metavar="DIR",
                              help=f"folder the three files are written to, created if missing (default: "
                                   f"{PROVENANCE_FOLDER}/ in the data folder)")
    provenance_p.add_argument("--workers", type=worker_count, default=default_workers(), metavar="N",
                              help=f"threads decoding images (default: {default_workers()})")
    provenance_p.set_defaults(handler=_run_provenance)

    cache_p = commands.add_parser(
        "cache", help="see what the decoded-data cache holds; clear it or bound its size",
        description="Print what the decoded-data cache holds per kind (packs or entries, rows, size, last use), "
                    "marking apart the packs of another format version or decoder build (another install sharing "
                    "the cache may read them) and what no version reads; with an option, remove some of it first. "
                    "A writer at work keeps its folder, and a reader of a removed pack decodes its rows again. Only "
                    "what the cache wrote is removed (its own names, holding only its own files); a folder that "
                    "holds anything else is refused whole. Exit code 1 where some could not be removed.",
        epilog=examples("python -m tools.data cache", "python -m tools.data cache --max-size 20G"))
    cache_p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), metavar="DIR",
                         help=f"the decoded-data cache's folder, as the other commands' --cache-dir (default: "
                              f"{default_cache_dir()})")
    removal = cache_p.add_mutually_exclusive_group()
    removal.add_argument("--clear", action="store_true",
                         help="remove every pack and entry, keeping the folder (default: remove nothing)")
    removal.add_argument("--max-size", type=_size_arg, default=None, metavar="SIZE",
                         help="remove what no version reads, then the least recently used packs and entries "
                              "(used: read or written, to the day; another build's or version's too), until the "
                              "cache takes at most SIZE (stopping as soon as it does), "
                              "e.g. 20G, 500M (K, M, G, T: powers of 1024) (default: no bound)")
    removal.add_argument("--unreadable", action="store_true",
                         help="remove only what no version reads: damaged packs and entries, and the entries of "
                              "versions before packs; packs of another format version or decoder build stay "
                              "(default: keep them)")
    add_log_level_argument(cache_p)
    cache_p.set_defaults(handler=_run_cache)
    return parser


def _size_arg(value: str) -> int:
    try:
        return cache_admin.parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_fetch(args: argparse.Namespace) -> int:
    if args.url != RELEASE_URL and args.sha256 is None and args.archive is None:
        log.warning("--url without --sha256: the download's SHA-256 will be reported but not checked")
    result = fetch(args.data_path or default_data_root(), args.url, args.sha256, args.keep_archive, args.archive,
                   not args.no_progress, args.timeout)
    print("\n".join(result.lines()))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    report = verify_layout(check_data_root(args.data_path), args.full, args.workers, not args.no_progress,
                           args.split)
    print("\n".join(report.lines()))
    if report.problems:
        raise UserError(f"{len(report.problems)} problem(s) in {report.root}, listed above; fix them or rerun "
                        f"`python -m tools.data fetch` / `build`")
    return 0


def _run_build(args: argparse.Namespace) -> int:
    check_outputs(folders={"--out": args.out})
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    result = build(args.images, args.boxes, args.out, args.masks, args.seed, args.jpeg_quality, args.image_format,
                   args.grabcut_iterations, args.workers, not args.no_progress, args.split, args.keep_unboxed)
    print("\n".join(result.lines()))
    return 0


def _run_provenance(args: argparse.Namespace) -> int:
    root = check_data_root(args.data_path)
    output = args.output or root / PROVENANCE_FOLDER
    check_outputs(folders={"--output": output})
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    from tools.data import mixed_origins  # noqa: PLC0415 (torch, for this command alone)
    result = mixed_origins.find_provenance(root, args.workers, not args.no_progress)
    written = mixed_origins.write_provenance(result, output)
    print("\n".join([*result.lines(), f"wrote {', '.join(map(str, written))}"]))
    return 0


def _run_cache(args: argparse.Namespace) -> int:
    if args.clear:
        result = cache_admin.clear(args.cache_dir)
    elif args.max_size is not None:
        result = cache_admin.trim(args.cache_dir, args.max_size)
    elif args.unreadable:
        result = cache_admin.remove_unreadable(args.cache_dir)
    else:
        result = cache_admin.survey(args.cache_dir)
    print("\n".join(result.lines()))
    return 1 if getattr(result, "failed", None) else 0  # some could not be removed: said above


def main(argv: Iterable[str] | None = None) -> int:
    """Run one command (exit codes as `tools.cli.run_main`), removing what it left half-made."""
    return run_main(build_parser(), lambda args: args.handler(args), None if argv is None else list(argv),
                    on_interrupt=RERUN_ADVICE)


if __name__ == "__main__":
    sys.exit(main())
