"""What identifying the data by content costs: hashing every file a run reads, against decoding them.

    python bench/bench_hashing.py --per-class 450      # the release's size: 4050 images per variation

Generates IN-9-shaped data (or reads --data-path), then times `tools.data.hashing.fingerprint` over the
challenge's files (foreground images, masks, backgrounds) and over the eight variations an in9 `all` run
reads, against decoding the same images with the toolkit's threaded decoder. The page cache is warm (the
files were just written or read), as it is for the second and later runs on a machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.challenge import list_challenge_files  # noqa: E402
from tools.data import image_sets, layout, synthetic  # noqa: E402
from tools.data.hashing import fingerprint  # noqa: E402
from tools.in9 import VARIATIONS  # noqa: E402


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=450, help="generated images per class (default: 450)")
    parser.add_argument("--data-path", type=Path, default=None, help="measure this data instead of generating it")
    parser.add_argument("--workers", type=int, default=2, help="hashing and decoding threads (default: 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_path
        if root is None:
            _, took = timed(synthetic.generate, Path(tmp) / "bg", per_class=args.per_class, seed=0)
            root = Path(tmp) / "bg"
            print(f"generated {args.per_class} images per class in {took:.1f} s")
        files = list_challenge_files(root, args.workers)
        relpaths = [p for r in files.foregrounds for p in (r.image_relpath, r.mask_relpath)]
        relpaths += [r.relpath for r in files.backgrounds]
        for _ in range(2):  # the second pass is the one reported: both with a warm page cache
            fp, hash_time = timed(fingerprint, root, relpaths, args.workers)
        images = [r.image_relpath for r in files.foregrounds] + [r.relpath for r in files.backgrounds]
        _, decode_time = timed(image_sets.decode_images, image_sets.ImageSet(root), images, args.workers, False)
        print(f"challenge: {fp['files']:,} files, {fp['bytes'] / 1e6:,.0f} MB hashed in {hash_time:.2f} s "
              f"({fp['bytes'] / 1e6 / hash_time:,.0f} MB/s); decoding its {len(images):,} images takes "
              f"{decode_time:.2f} s: hashing is {100 * hash_time / decode_time:.0f}% of that")
        in9 = [r.relpath for name in VARIATIONS for r in layout.list_variation(root, name)]
        for _ in range(2):
            fp, hash_time = timed(fingerprint, root, in9, args.workers)
        _, decode_time = timed(image_sets.decode_images, image_sets.ImageSet(root), in9, args.workers, False)
        print(f"in9 all: {fp['files']:,} files, {fp['bytes'] / 1e6:,.0f} MB hashed in {hash_time:.2f} s "
              f"({fp['bytes'] / 1e6 / hash_time:,.0f} MB/s); decoding them takes {decode_time:.2f} s: hashing is "
              f"{100 * hash_time / decode_time:.0f}% of that")


if __name__ == "__main__":
    main()
