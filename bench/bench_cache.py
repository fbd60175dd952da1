"""What checking the decoded-data cache's packs costs a warm in9 `all` run.

A pack proves itself before its rows are used (tools.data.cache_checks): the rows a run takes are hashed and
compared with the SHA-256 stored beside them, once per process, and a few of them are decoded again from their
files on every use. This script fills a cache with a first (cold) run, then times warm runs as a second
in9_eval.py makes them (listing and hashing the files, every image read from the cache), alternately with the
checks, each run as a new process would (nothing checked yet), and without them (the digests and the spot check
skipped, as before they existed; the owner and name checks, a few stats and one digest of the list of file
hashes, run in both). The target: the checked run takes at most 1.05 times the unchecked one.

    python bench/bench_cache.py --device cpu --per-class 20 --model color --repeats 5
    python bench/bench_cache.py --device cuda --data-path data/bg_challenge --arch resnet50 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import tools  # noqa: F401
except ImportError:  # run as `python bench/bench_cache.py` from a checkout: the toolkit is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_in9, beside it

from bench_in9 import build_model, machine, synchronize
from tools.data import store, synthetic
from tools.data.cache_checks import RowChecks
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.runtime import Precision, Runtime, resolve_device, seed_everything
from tools.threads import default_workers

log = logging.getLogger("bench_cache")
TARGET = 1.05  # checked / unchecked warm run, at most


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help="an IN-9 folder (the release's bg_challenge/) to read instead of generating one "
                             "(default: generate synthetic data in a temporary folder)")
    parser.add_argument("--per-class", type=int, default=20, metavar="N",
                        help="generated images per class and variation (default: 20, i.e. 1440 images)")
    parser.add_argument("--model", choices=["arch", "color"], default="color",
                        help="arch: a torchvision architecture with random weights (see --arch); color: the "
                             "synthetic colour model with a small convolutional trunk (default: color)")
    parser.add_argument("--arch", default="resnet18", metavar="NAME",
                        help="torchvision classification builder name, 1000 classes (default: resnet18)")
    parser.add_argument("--trunk-width", type=int, default=32, metavar="N",
                        help="channels of the colour model's trunk (default: 32)")
    parser.add_argument("--device", default=None, metavar="DEV",
                        help="cuda, cuda:N, mps or cpu (default: the best available)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="images per forward pass (default: the device's, as in9_eval.py)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                        help=f"image-decoding and checking threads (default: {default_workers()})")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="timed warm runs of each kind, alternating (default: 3)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    parser.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                        help="also write the figures as JSON (default: none)")
    return parser


class Unchecked(RowChecks):
    """Every row taken as it is: the digests are not read against the rows."""

    def failing(self, identity, rows, digests, wanted, workers=None) -> list[int]:
        return []


@contextlib.contextmanager
def checks(on: bool, spent: list[float]):
    """Inside: the packs' digests and spot check as the toolkit makes them (`on`, each run as a new process, the
    seconds spent in them added to `spent[0]`), or neither."""
    store.forget_checks()
    row_checks, spot_check = store._row_checks, store.spot_check

    def timed(function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    if on:
        row_checks.failing, store.spot_check = timed(row_checks.failing), timed(spot_check)
    else:
        store._row_checks, store.spot_check = Unchecked(), lambda rows, used, reference: None
    try:
        yield
    finally:
        store._row_checks, store.spot_check = row_checks, spot_check
        row_checks.__dict__.pop("failing", None)


def warm_run(loaded, runtime: Runtime, root: Path, config: In9Config, cache: store.DecodedCache) -> tuple[float, int]:
    """Seconds of a warm run as a second in9_eval.py makes it (listed and hashed again), and the rows it hashed."""
    hashed = store._row_checks.hashed
    start = time.perf_counter()
    run_in9(loaded, runtime, list_in9_files(root, VARIATIONS, config.workers, cache), config)
    synchronize(runtime.device)
    return time.perf_counter() - start, store._row_checks.hashed - hashed


def main(args: argparse.Namespace) -> int:
    for flag in ("per_class", "workers", "repeats"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be at least 1")
    seed_everything(args.seed)
    runtime = Runtime(resolve_device(args.device), Precision.FP32)
    loaded = build_model(args)
    info = machine()
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp:
        root = args.data_path or synthetic.generate(Path(tmp) / "bg_challenge", per_class=args.per_class,
                                                    seed=args.seed).root
        config = In9Config(VARIATIONS, args.batch_size, args.workers, progress=False)
        cache = store.DecodedCache(Path(tmp) / "cache")
        start = time.perf_counter()
        run_in9(loaded, runtime, list_in9_files(root, VARIATIONS, args.workers, cache), config)  # fills the cache
        cold = time.perf_counter() - start
        seconds: dict[str, list[float]] = {"checked": [], "unchecked": []}
        hashed: dict[str, list[int]] = {"checked": [], "unchecked": []}
        in_checks: list[float] = []  # of each checked run, the seconds spent in the checks themselves
        for _ in range(args.repeats):
            for kind in ("unchecked", "checked"):
                spent = [0.0]
                with checks(kind == "checked", spent):
                    took, rows = warm_run(loaded, runtime, root, config, cache)
                seconds[kind].append(took)
                hashed[kind].append(rows)
                in_checks += spent if kind == "checked" else []
        files = list_in9_files(root, VARIATIONS, args.workers)
        images = sum(len(listed) for listed in files.listings.values())
        distinct = len(set(files.image_set.hashes.values()))
    median = {kind: statistics.median(values) for kind, values in seconds.items()}
    ratio = median["checked"] / median["unchecked"]
    print(f"machine: {info['cpu']}, {info['cores']} cores, GPU: {info['gpu'] or 'none'}, torch {info['torch']}")
    print(f"model: {loaded.arch}; device {runtime.device}, fp32, batch {runtime.batch_size(args.batch_size)}, "
          f"workers {args.workers}; {images} images in 8 variations "
          f"({'generated, ' + str(args.per_class) + ' per class' if args.data_path is None else root})")
    print(f"cold run (decoding, filling the cache): {cold:.2f} s")
    for kind in ("unchecked", "checked"):
        runs = ", ".join(f"{s:.3f}" for s in seconds[kind])
        print(f"warm run, {kind + ':':10} median {median[kind]:.3f} s of {runs} ({max(hashed[kind])} rows hashed, of "
              f"{distinct} distinct images)")
    print(f"checked / unchecked: {ratio:.3f}  (target <= {TARGET}); the checks themselves: median "
          f"{statistics.median(in_checks):.3f} s, {statistics.median(in_checks) / median['unchecked']:.1%} of the "
          f"unchecked run (steadier than the ratio on a busy machine)")
    if args.results_file is not None:
        args.results_file.parent.mkdir(parents=True, exist_ok=True)
        args.results_file.write_text(json.dumps({
            "machine": info, "model": loaded.arch, "device": str(runtime.device), "workers": args.workers,
            "images": images, "distinct_images": distinct, "cold_s": round(cold, 3), "seconds": seconds,
            "rows_hashed": hashed, "checks_s": in_checks, "median_s": median, "ratio": round(ratio, 4),
            "target": TARGET}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s", stream=sys.stderr)
    sys.exit(main(build_parser().parse_args()))
