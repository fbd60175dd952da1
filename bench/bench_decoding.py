"""JPEG decoding rate per thread count: Pillow (the reference) against torchvision's decode_jpeg, through the
toolkit's loader (tools.data.image_sets.decode_images: jobs of 32 images in threads), on generated IN-9 images
or on --data-path's `original` variation. Also says whether the run's probe would choose decode_jpeg here.

    python bench/bench_decoding.py --threads 1 2 --per-class 40
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's toolkit, one folder up

from tools.data import layout, synthetic
from tools.data.decoders import Decoder, choose_decoder, probe_sample
from tools.data.image_sets import ImageSet, decode_images


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help="an IN-9 folder whose `original` images are decoded (default: generate some)")
    parser.add_argument("--per-class", type=int, default=40, metavar="N",
                        help="generated images per class (default: 40, i.e. 360 images)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N",
                        help="thread counts to time (default: 1 2)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="timed passes; the fastest counts "
                        "(default: 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_path or synthetic.generate(Path(tmp) / "bg", per_class=args.per_class, seed=0).root
        relpaths = [r.relpath for r in layout.list_variation(root, "original")]
        decode_images(ImageSet(root), relpaths, 1, progress=False)  # the files into the page cache
        chosen = choose_decoder([root / rel for rel in probe_sample(relpaths)])
        print(f"{len(relpaths)} images; the probe chooses {chosen.value}")
        rates = {}
        for decoder in Decoder:
            for threads in args.threads:
                best = min(_timed(root, relpaths, threads, decoder) for _ in range(args.repeats))
                rates[decoder, threads] = len(relpaths) / best
                print(f"{decoder.value:<12} {threads} thread(s): {rates[decoder, threads]:8.0f} images/s")
        for threads in args.threads:
            ratio = rates[Decoder.TORCHVISION, threads] / rates[Decoder.PILLOW, threads]
            print(f"decode_jpeg / Pillow at {threads} thread(s): {ratio:.2f}")
    return 0


def _timed(root: Path, relpaths: list[str], threads: int, decoder: Decoder) -> float:
    start = time.perf_counter()
    decode_images(ImageSet(root, decoder=decoder), relpaths, threads, progress=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
