"""How close in9_eval's whole `all` run comes to the model's own forward speed.

Measures (a) the classifier's forward throughput on random uint8 images through the toolkit's PixelModel
wrapper, at the batch size, device and precision given, after a warm-up; and (b) the images per second
of a whole `--eval-dataset all` run through tools.in9.evaluate.run_in9 (listing, decoding, transfer, forward,
mapping; the model load excluded), on generated data or on --data-path. The ratio (b)/(a) says how much
of the model's speed the pipeline keeps: the target is at least 0.7 on a CPU and 0.8 on a GPU.

    python bench/bench_in9.py --device cpu --per-class 20 --arch resnet18
    python bench/bench_in9.py --model color --trunk-width 32 --per-class 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import tools  # noqa: F401
except ImportError:  # run as `python bench/bench_in9.py` from a checkout: the toolkit is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.data import synthetic
from tools.in9 import NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, VARIATIONS, Normalization, statistics_for
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.architectures import build_architecture
from tools.models.boundary import LoadedModel, PixelModel
from tools.runtime import BATCH_SIZE_DEFAULTS, Forward, Precision, Runtime, resolve_device, seed_everything
from tools.threads import default_workers

log = logging.getLogger("bench_in9")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help="an IN-9 folder (the release's bg_challenge/) to read instead of generating one "
                             "(default: generate synthetic data in a temporary folder)")
    parser.add_argument("--per-class", type=int, default=20, metavar="N",
                        help="generated images per class and variation (default: 20, i.e. 1440 images)")
    parser.add_argument("--model", choices=["arch", "color"], default="arch",
                        help="arch: a torchvision architecture with random weights (see --arch); color: the "
                             "synthetic colour model with a small convolutional trunk (default: arch)")
    parser.add_argument("--arch", default="resnet18", metavar="NAME",
                        help="torchvision classification builder name, 1000 classes (default: resnet18)")
    parser.add_argument("--trunk-width", type=int, default=32, metavar="N",
                        help="channels of the colour model's trunk (default: 32)")
    parser.add_argument("--device", default=None, metavar="DEV",
                        help="cuda, cuda:N, mps or cpu (default: the best available)")
    parser.add_argument("--precision", type=Precision, choices=list(Precision), default=Precision.FP32,
                        metavar="{" + ",".join(p.value for p in Precision) + "}",
                        help="fp32 is exact; tf32, bf16 and fp16 are faster (default: fp32)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help=f"images per forward pass (default: {BATCH_SIZE_DEFAULTS}, where smaller batches stay in "
                             f"cache)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                        help=f"image-decoding threads (default: {default_workers()})")
    parser.add_argument("--channels-last", action="store_true", help="channels-last memory format (default: off)")
    parser.add_argument("--cudnn-deterministic", action=argparse.BooleanOptionalAction, default=None,
                        help="override cuDNN's deterministic-algorithms flag, to measure what it costs "
                             "(default: as the precision sets it, on in fp32 only)")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="untimed forward batches before timing (a) (default: 3)")
    parser.add_argument("--iters", type=int, default=10, metavar="N",
                        help="timed forward batches for (a) (default: 10)")
    parser.add_argument("--repeats", type=int, default=2, metavar="N",
                        help="timed `all` runs for (b); the fastest counts, the first also warms the file cache "
                             "(default: 2)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    parser.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                        help="also write the figures as JSON (default: none)")
    return parser


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torchvision  # noqa: PLC0415 (only for its version)
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "torchvision": torchvision.__version__, "python": platform.python_version()}


def build_model(args: argparse.Namespace) -> LoadedModel:
    """A classifier with random weights (the speed does not depend on them), wrapped as in9_eval wraps it."""
    if args.model == "color":
        classifier = synthetic.ColorEvidenceModel(NUM_IN9_CLASSES, trunk_width=args.trunk_width, seed=args.seed)
        num_classes, name = NUM_IN9_CLASSES, f"color (trunk width {args.trunk_width})"
        weights = "hand-built colour scores, random trunk"
    else:
        classifier = build_architecture(args.arch, NUM_IMAGENET_CLASSES)
        num_classes, name, weights = NUM_IMAGENET_CLASSES, args.arch, "random weights"
    mean, std = statistics_for(Normalization.AUTO, num_classes)
    return LoadedModel(PixelModel(classifier.eval(), mean, std).eval(), num_classes, name, None, None, None,
                       weights, Normalization.AUTO.value)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_throughput(loaded: LoadedModel, runtime: Runtime, batch_size: int, warmup: int, iters: int) -> float:
    """(a): images/s of the wrapped model alone on a uint8 batch already on the device."""
    model = runtime.compiled(runtime.prepare(loaded.model))
    forward = Forward(model, runtime, batch_size)
    gen = torch.Generator().manual_seed(0)
    batch = runtime.to_device(torch.randint(0, 256, (batch_size, 3, 224, 224), dtype=torch.uint8, generator=gen))
    for _ in range(warmup):
        forward(batch)
    synchronize(runtime.device)
    start = time.perf_counter()
    for _ in range(iters):
        forward(batch)
    synchronize(runtime.device)
    return iters * batch_size / (time.perf_counter() - start)


def pipeline_throughput(loaded: LoadedModel, runtime: Runtime, root: Path, batch_size: int, workers: int,
                        repeats: int) -> tuple[float, int, list[float]]:
    """(b): images/s of a whole `all` run (the fastest of `repeats`), its image count and every run's seconds."""
    seconds, images = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        run = run_in9(loaded, runtime, list_in9_files(root, VARIATIONS, workers),
                      In9Config(VARIATIONS, batch_size, workers, progress=False))
        synchronize(runtime.device)
        seconds.append(time.perf_counter() - start)
        images = sum(result.total for result in run.results.values())
    return images / min(seconds), images, seconds


def override_cudnn_deterministic(runtime: Runtime, value: bool) -> None:
    """cuDNN's determinism as `value` for the whole run, forward passes included: the exact mode's math
    (`Runtime.fp32_math`) sets it on around every fp32 forward pass, so it is set again inside that block."""
    torch.backends.cudnn.deterministic = value
    exact_math = runtime.fp32_math

    @contextlib.contextmanager
    def fp32_math():
        with exact_math():
            torch.backends.cudnn.deterministic = value  # put back as it was when the block ends
            yield

    runtime.fp32_math = fp32_math


def main(args: argparse.Namespace) -> int:
    for flag in ("per_class", "workers", "iters", "repeats"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be at least 1")
    seed_everything(args.seed)
    runtime = Runtime(resolve_device(args.device), args.precision, args.channels_last)
    if args.cudnn_deterministic is not None:
        override_cudnn_deterministic(runtime, args.cudnn_deterministic)
    batch_size = runtime.batch_size(args.batch_size)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable, torch uses "
          f"{info['torch_threads']} threads), GPU: {info['gpu'] or 'none'}, torch {info['torch']}, "
          f"torchvision {info['torchvision']}")
    loaded = build_model(args)
    print(f"model: {loaded.arch}, {loaded.num_classes} classes, {loaded.checkpoint_format}; device {runtime.device}, "
          f"precision {runtime.precision.value}, batch {batch_size}, workers {args.workers}, "
          f"channels_last {'on' if args.channels_last else 'off'}, "
          f"cudnn.deterministic {'on' if torch.backends.cudnn.deterministic else 'off'}")

    with tempfile.TemporaryDirectory(prefix="bench_in9_") as tmp:
        root = args.data_path
        if root is None:
            start = time.perf_counter()
            root = synthetic.generate(Path(tmp) / "bg_challenge", per_class=args.per_class, seed=args.seed).root
            log.info("generated %d images per class in %.1f s", args.per_class, time.perf_counter() - start)
        model_rate = forward_throughput(loaded, runtime, batch_size, args.warmup, args.iters)
        run_rate, images, seconds = pipeline_throughput(loaded, runtime, root, batch_size, args.workers, args.repeats)

    ratio = run_rate / model_rate
    target = 0.8 if runtime.device.type == "cuda" else 0.7
    print(f"data: {'generated, ' + str(args.per_class) + ' per class' if args.data_path is None else root}, "
          f"{images} images in 8 variations")
    print(f"(a) model forward: {model_rate:10.1f} img/s  ({args.iters} batches of {batch_size} after "
          f"{args.warmup} warm-up, random uint8 input through PixelModel)")
    print(f"(b) in9_eval all:  {run_rate:10.1f} img/s  (fastest of {len(seconds)} run(s): "
          f"{', '.join(f'{s:.2f}' for s in seconds)} s; model load excluded)")
    print(f"ratio (b)/(a): {ratio:.2f}  (target >= {target} on this {runtime.device.type})")
    if args.results_file is not None:
        args.results_file.parent.mkdir(parents=True, exist_ok=True)
        args.results_file.write_text(json.dumps({
            "machine": info, "model": loaded.arch, "num_classes": loaded.num_classes, **runtime.describe(),
            "batch_size": batch_size, "workers": args.workers, "images": images,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "model_images_per_s": round(model_rate, 2), "pipeline_images_per_s": round(run_rate, 2),
            "pipeline_seconds": [round(s, 3) for s in seconds], "ratio": round(ratio, 4),
            "median_pipeline_seconds": round(statistics.median(seconds), 3)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    sys.exit(main(build_parser().parse_args()))
