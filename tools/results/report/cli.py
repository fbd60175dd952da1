"""The report command (`python -m tools.results.report`, bgc-report): results files in, a Markdown report and,
with --html, the HTML page out. A module of its own so that the report's text (`tools.results.report`) and the
HTML page (`tools.results.html`), which reads that text, do not import each other."""

from __future__ import annotations

import argparse
from pathlib import Path

from tools.cli import ArgumentParser, add_log_level_argument, examples, run_main
from tools.data.layout import DATA_ENV, DEFAULT_DATA_ROOT, default_data_root
from tools.errors import UserError
from tools.provenance import check_outputs, write_text_atomic
from tools.results.analysis import FIGURE_FILE, SUMMARY_FILE
from tools.results.html import render_html
from tools.results.reading import check_inputs_belong_together, load_inputs
from tools.results.report import DEFAULT_OUTPUT, write_report


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(epilog=examples("python -m tools.results.report --in9 in9.json --challenge challenge.json "
                                            "--output report.md"),
                            description="Merge results files into one Markdown report.")
    parser.add_argument("--in9", type=Path, default=None, metavar="PATH",
                        help="results JSON of in9_eval.py --results-file (default: none)")
    parser.add_argument("--challenge", type=Path, default=None, metavar="PATH",
                        help="results JSON of challenge_eval.py --results-file (default: none)")
    parser.add_argument("--analysis-dir", type=Path, default=None, metavar="DIR",
                        help=f"folder holding {SUMMARY_FILE} and {FIGURE_FILE} from tools.results.analysis "
                             f"(default: none)")
    parser.add_argument("--categories", type=Path, default=None, metavar="PATH",
                        help="prediction-categories JSON (default: the 'categories' entry of --in9, if any)")
    parser.add_argument("--output", type=Path, default=None, metavar="PATH",
                        help=f"the Markdown file to write (default: {DEFAULT_OUTPUT}, or none when only --html is "
                             f"given)")
    parser.add_argument("--html", type=Path, default=None, metavar="PATH",
                        help="also write the report as one self-contained HTML page with pictures (default: none)")
    parser.add_argument("--leaderboard", type=Path, default=None, metavar="DIR",
                        help="with --html: add the leaderboard of this `python -m tools.zoo` --output-dir "
                             "(default: none)")
    parser.add_argument("--training", type=Path, default=None, metavar="DIR",
                        help="with --html: add the curves and before/after table of this `train.py --eval-data` "
                             "--output-dir (default: none)")
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help=f"with --html and --analysis-dir: the data folder the analysis's pictures are read from; "
                             f"only files inside it are shown (default: ${DATA_ENV} if set, else {DEFAULT_DATA_ROOT})")
    parser.add_argument("--allow-mixed", action="store_true",
                        help="report results of different models or data together, with a warning at the top "
                             "(default: refuse them)")
    add_log_level_argument(parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    markdown = args.output or (None if args.html else DEFAULT_OUTPUT)
    html_only = [flag for flag, value in (("--leaderboard", args.leaderboard), ("--training", args.training)) if value]
    if html_only and args.html is None:
        raise UserError(f"{html_only[0]} adds to the HTML report: add --html PATH")
    check_outputs(files={"--output": markdown, "--html": args.html})
    inputs = load_inputs(args.in9, args.challenge, args.analysis_dir, args.categories,
                         allow_none=bool(html_only))
    warnings = check_inputs_belong_together(inputs, args.allow_mixed)
    # the page is made first: it reads --leaderboard's and --training's folders, whose errors leave nothing written
    page = None if args.html is None else render_html(
        **inputs, warnings=warnings, leaderboard=args.leaderboard, training=args.training,
        data_path=args.data_path or default_data_root())
    if markdown is not None:
        write_report(markdown, **inputs, warnings=warnings)
        print(f"Wrote {markdown}")
    if page is not None:
        write_text_atomic(args.html, page)
        print(f"Wrote {args.html}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _main, argv, on_interrupt="rerun the same command")
