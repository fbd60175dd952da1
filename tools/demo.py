"""An offline demonstration: generate IN-9-shaped data and a hand-built model, then run both scripts on them.

    python -m tools.demo [--out demo] [--per-class 10]

Needs no download: the data come from tools.data.synthetic and the model is its ColorEvidenceModel saved as
a torch.export program (demo/color9.pt2), so the printed numbers are those of a toy model, not of any published result.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from tools.cli import ArgumentParser, examples, whole_number
from tools.data import cache_admin, synthetic
from tools.data.store import default_cache_dir
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE
from tools.provenance import atomic_write

ROOT = Path(__file__).resolve().parents[1]
MAX_BATCH = 2**31 - 1  # the exported program's largest batch: more than any batch that fits in memory
MAX_PER_CLASS = 1000  # generated images per class at most (the release has 450)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, epilog=examples(
        "python -m tools.demo", "python -m tools.demo --out /tmp/demo --per-class 2"))
    parser.add_argument("--out", type=Path, default=Path("demo"), metavar="DIR",
                        help="where the data, model and results go (default: demo)")
    parser.add_argument("--per-class", type=whole_number(1, MAX_PER_CLASS), default=10, metavar="N",
                        help=f"images per class, at most {MAX_PER_CLASS} (default: 10)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    data = args.out / "bg_challenge"
    model = args.out / "color9.pt2"
    print(f"generating {9 * args.per_class} images per variation under {data} ...", flush=True)
    try:
        synthetic.generate(data, per_class=args.per_class, seed=0)
    except OSError as exc:  # a folder not writable, a link where a file goes (never written through)
        print(f"error: cannot write the demo's data under {data} ({exc.strerror or exc}); pass another --out",
              file=sys.stderr)
        return 2
    # a torch.export program, which is data (TorchScript, deprecated, is code: loaded only with --trust-checkpoint):
    # any batch size up to MAX_BATCH. The bound is for torch 2.6 (the floor): with an unbounded Dim its export of
    # the model's `evidence[:, :9]` guards batch != sys.maxsize and refuses the range it was given.
    batch = torch.export.Dim("batch", max=MAX_BATCH)
    program = torch.export.export(synthetic.ColorEvidenceModel(9).eval(), (torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE),),
                                  dynamic_shapes=({0: batch},))
    with atomic_write(model, "wb") as fh:
        torch.export.save(program, fh)
    common = ["--data-path", str(data), "--checkpoint", str(model), "--in9", "--device", "cpu",
              "--output-dir", str(args.out / "results"), "--log-level", "WARNING"]
    commands = [
        [sys.executable, str(ROOT / "in9_eval.py"), "--eval-dataset", "all", "--categories",
         "--results-file", str(args.out / "in9.json"), *common],
        [sys.executable, str(ROOT / "challenge_eval.py"), "--full", "--analysis", "--no-cache",
         "--results-file", str(args.out / "challenge.json"), *common],
        [sys.executable, "-m", "tools.results.report", "--in9", str(args.out / "in9.json"), "--challenge",
         str(args.out / "challenge.json"), "--analysis-dir", str(args.out / "results"), "--output",
         str(args.out / "report.md"), "--html", str(args.out / "report.html"), "--data-path", str(data)],
    ]
    cache, before = default_cache_dir(), _cache_size(default_cache_dir())
    for command in commands:
        print("\n$ " + " ".join(Path(c).name if c == sys.executable else c for c in command), flush=True)
        code = subprocess.call(command)
        if code:
            return code
    added = _cache_size(cache) - before
    if added > 0:  # the scripts say it at --log-level INFO; the demo runs them at WARNING
        print(f"\ndecoded images cached in {cache} ({cache_admin.format_size(added)}): `python -m tools.data cache "
              f"--clear` removes them, and the scripts' --no-cache writes none")
    print(f"\nresults: {args.out}/in9.json, {args.out}/challenge.json, {args.out}/report.md, "
          f"{args.out}/report.html, {args.out}/results/top_backgrounds.png")
    return 0


def _cache_size(folder: Path) -> int:
    """The bytes the decoded-data cache in `folder` takes (0 where it is not one)."""
    try:
        return cache_admin.survey(folder).size
    except UserError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
