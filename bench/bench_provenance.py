"""What `python -m tools.data provenance` costs on data of the release's size, and whether it finds every pair.

    python bench/bench_provenance.py                      # 450 per class: 4,050 backgrounds, 3 x 4,050 mixed
    python bench/bench_provenance.py --data DIR           # generate into DIR once, reuse it on later runs

Generates only what the command reads, in the release's layout: `only_bg_t/` (random smooth colour fields
with fine noise), `fg_mask/` (random ellipses) and the three mixed variations (a random foreground field
composited over the `only_bg_t` image of another image of the same class, of a random class, of the next
class), every image a 224x224 JPEG; the true pairs go to `bench_truth.json`. Then times the command as a
user runs it (a fresh process, so its imports count) and counts the pairs it recovered.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.data.layout import MIXED  # noqa: E402
from tools.in9 import IMAGE_SIZE, MASK_FOLDER, NUM_IN9_CLASSES, class_folder_names  # noqa: E402

TRUTH = "bench_truth.json"


def smooth_fields(rng: np.random.Generator, count: int, size: int = IMAGE_SIZE) -> np.ndarray:
    """(count, size, size, 3) uint8: random 7x7 colour grids enlarged bilinearly, plus fine noise."""
    coarse = rng.integers(0, 256, (count, 7, 7, 3), dtype=np.uint8)
    out = np.empty((count, size, size, 3), np.uint8)
    for i in range(count):
        field = np.asarray(Image.fromarray(coarse[i]).resize((size, size), Image.BILINEAR), np.int16)
        out[i] = np.clip(field + rng.integers(-12, 13, (size, size, 3)), 0, 255)
    return out


def ellipse(rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    rx, ry = rng.uniform(25, 95, 2)
    cx, cy = rng.uniform(rx, size - rx), rng.uniform(ry, size - ry)
    return ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1


def generate(root: Path, per_class: int, quality: int, seed: int, workers: int) -> dict:
    """Write the data and return the truth: {variation/class/stem: background stem}."""
    rng = np.random.default_rng(seed)
    folders = class_folder_names()
    stems = [(label, f"bench{label}_{i:05d}") for label in range(NUM_IN9_CLASSES) for i in range(per_class)]
    backgrounds = smooth_fields(rng, len(stems))
    by_class = [[k for k, (label, _) in enumerate(stems) if label == c] for c in range(NUM_IN9_CLASSES)]
    truth: dict[str, str] = {}

    def save(job) -> None:
        array, path = job
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(path, format="JPEG", quality=quality)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for label in range(NUM_IN9_CLASSES):  # written class by class: a class's images are all held at once
            jobs = []
            for j in by_class[label]:
                stem, folder = stems[j][1], folders[label]
                jobs.append((backgrounds[j], root / "only_bg_t" / "val" / folder / f"{stem}.JPEG"))
                mask = ellipse(rng)
                (root / MASK_FOLDER / "val" / folder).mkdir(parents=True, exist_ok=True)
                np.save(root / MASK_FOLDER / "val" / folder / f"{stem}.npy", mask)
                foreground = smooth_fields(rng, 1)[0]
                pools = {"mixed_same": [k for k in by_class[label] if k != j] or [j],
                         "mixed_rand": by_class[int(rng.integers(NUM_IN9_CLASSES))],
                         "mixed_next": by_class[(label + 1) % NUM_IN9_CLASSES]}
                for variation in MIXED:
                    k = int(rng.choice(pools[variation]))
                    truth[f"{variation}/{folder}/{stem}"] = stems[k][1]
                    jobs.append((np.where(mask[..., None], foreground, backgrounds[k]),
                                 root / variation / "val" / folder / f"{stem}.JPEG"))
            list(pool.map(save, jobs))
    return truth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=450, metavar="N",
                        help="images per class in each variation (default: 450, the release's)")
    parser.add_argument("--data", type=Path, default=None, metavar="DIR",
                        help="generate into DIR, or reuse what an earlier run with the same settings generated "
                             "there (default: a temporary folder, removed at the end)")
    parser.add_argument("--jpeg-quality", type=int, default=90, metavar="Q", help="JPEG quality (default: 90)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="generator seed (default: 0)")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="threads writing the data and the command's --workers (default: 2)")
    args = parser.parse_args()
    settings = {"per_class": args.per_class, "jpeg_quality": args.jpeg_quality, "seed": args.seed}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or Path(tmp) / "bg"
        stored = json.loads((root / TRUTH).read_text()) if (root / TRUTH).is_file() else {}
        if stored.get("settings") == settings:
            truth = stored["truth"]
            print(f"reusing the data generated in {root}")
        else:
            start = time.perf_counter()
            truth = generate(root, args.per_class, args.jpeg_quality, args.seed, args.workers)
            (root / TRUTH).write_text(json.dumps({"settings": settings, "truth": truth}))
            print(f"generated {len(truth) // 3:,} backgrounds and {len(truth):,} mixed images in "
                  f"{time.perf_counter() - start:.0f} s")
        output = Path(tmp) / "provenance"
        command = [sys.executable, "-m", "tools.data", "provenance", "--data-path", str(root), "--output",
                   str(output), "--workers", str(args.workers), "--no-progress"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        took = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"the command failed ({done.returncode}): {done.stderr.strip()}")
        with open(output / "provenance.csv", newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
        right = sum(truth[f"{r['variation']}/{r['class']}/{Path(r['image']).stem}"] == Path(r["background"]).stem
                    for r in rows if r["background"])
        print(done.stdout.rstrip())
        print(f"provenance: {len(rows):,} mixed images against {len(truth) // 3:,} backgrounds in {took:.1f} s "
              f"(a fresh process, imports included); {right:,} of {len(truth):,} pairs recovered, "
              f"{sum(r['doubtful'] == '1' for r in rows):,} flagged doubtful")


if __name__ == "__main__":
    main()
