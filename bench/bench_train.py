"""How close train.py's whole loop comes to the model's own training speed, for erm and bg-swap.

Measures (a) images/s of the bare training step (forward, loss, backward, optimiser step) of the wrapped
model on a uint8 batch already on the device, at the batch size, device and precision given, after a
warm-up; and (b) images/s of whole train.py runs (tools.training.loop.train: the DataLoader gathering
batches from the decoded store, the background swap and the crops on the device, the step, logging, resume
saves), read from the run's train_log.jsonl between its first and last step so that start-up is excluded. The
target is (b)/(a) >= 0.85: the data pipeline, the swap included, must not starve the model. It also times the data
pipeline per image alone (the DataLoader, and the DataLoader with the device's swap and crops); with PYTHONPATH
pointed at an older checkout it times that checkout's code the same way (bench/RESULTS.md, issue 27).

    python bench/bench_train.py --device cpu --arch resnet18 --per-class 20 --batch-size 16 --workers 1
    python bench/bench_train.py --device cuda --arch resnet50 --per-class 600 --workers 8 --channels-last
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    import tools  # noqa: F401
except ImportError:  # run as `python bench/bench_train.py` from a checkout: the toolkit is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_in9 import machine, synchronize
from tools.data import synthetic
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, Normalization, statistics_for
from tools.models.architectures import build_architecture
from tools.models.boundary import PixelModel
from tools.runtime import Precision, Runtime, resolve_device
from tools.threads import default_workers
from tools.training.config import Method, TrainConfig

try:
    from tools.training.config import default_train_batch_size
except ImportError:  # a checkout from before the GPU's default batch (PYTHONPATH pointed at an older one)
    def default_train_batch_size(device: torch.device) -> int:
        return 32
from tools.data.hashing import fingerprint as content_fingerprint

try:
    from tools.provenance import TRAINING_LOG
except ImportError:  # a checkout from before it was shared (PYTHONPATH pointed at an older one)
    TRAINING_LOG = "train_log.jsonl"
from tools.training import data as training_data
from tools.training.loop import train, training_step

log = logging.getLogger("bench_train")
# the paper's Mixed-Rand recipe: a ResNet-50 trained on IN-9L-sized data (about 45,000 images) for 30 epochs
RECIPE_IMAGES, RECIPE_EPOCHS = 45_000, 30

LEAST_LOGGED_STEPS = 3  # (b)'s figure is taken from the steps after the first logged one: two durations at least


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help="an IN-9-style training folder to read instead of generating one (default: generate)")
    parser.add_argument("--per-class", type=int, default=20, metavar="N",
                        help="generated training images per class (default: 20)")
    parser.add_argument("--arch", default="resnet18", metavar="NAME",
                        help="architecture, random weights, 9 classes (default: resnet18)")
    parser.add_argument("--device", default=None, metavar="DEV", help="cuda, cuda:N, mps or cpu (default: the best)")
    parser.add_argument("--precision", type=Precision, choices=[Precision.FP32, Precision.BF16], default=None,
                        metavar="{fp32,bf16}", help="(default: bf16 on CUDA, else fp32)")
    parser.add_argument("--channels-last", action="store_true", help="channels-last memory format (default: off)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="training batch size (default: train.py's on the device: 256 on a GPU, 32 elsewhere)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                        help=f"DataLoader workers (default: {default_workers()})")
    parser.add_argument("--epochs", type=int, default=1, metavar="N", help="epochs of each timed run (default: 1)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps before (a) (default: 2)")
    parser.add_argument("--iters", type=int, default=8, metavar="N", help="timed steps for (a) (default: 8)")
    parser.add_argument("--methods", nargs="+", type=Method, choices=[Method.ERM, Method.BG_SWAP],
                        default=[Method.ERM, Method.BG_SWAP], metavar="{erm,bg-swap}",
                        help="methods timed in (b) (default: erm bg-swap)")
    parser.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                        help="also write the figures as JSON (default: none)")
    return parser


def step_throughput(args: argparse.Namespace, runtime: Runtime) -> tuple[float, float]:
    """(a): images/s of forward + loss + backward + AdamW step on a batch already on the device: from the
    median step time (robust to a shared machine's bursts) and from the mean."""
    mean, std = statistics_for(Normalization.IN9, NUM_IN9_CLASSES)
    model = runtime.prepare(PixelModel(build_architecture(args.arch, NUM_IN9_CLASSES), mean, std)).train()
    if hasattr(runtime, "compiled"):  # an older checkout (PYTHONPATH) has no --compile
        model = runtime.compiled(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    gen = torch.Generator().manual_seed(0)
    images = runtime.to_device(torch.randint(0, 256, (args.batch_size, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8,
                                             generator=gen))
    labels = torch.randint(0, NUM_IN9_CLASSES, (args.batch_size,), generator=gen).to(runtime.device)

    def step() -> None:
        training_step(model, images, labels, loss_fn, optimizer, runtime)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        synchronize(runtime.device)
        start = time.perf_counter()
        step()
        synchronize(runtime.device)
        times.append(time.perf_counter() - start)
    return args.batch_size / statistics.median(times), args.batch_size * len(times) / sum(times)


def loop_throughput(args: argparse.Namespace, data: Path, method: Method, out: Path) -> tuple[float, float]:
    """(b): images/s of a whole training run after its first logged step: from the median time between steps, and
    from the mean: the steps after the first over the time from the first to the last epoch's end. A step's time is
    when the host queued it, so on a GPU, where the host may run ahead of the device, the median may read fast;
    the epoch's end is when its steps were done on the device (the log's numbers were read) and its state saved,
    so the mean counts that wait and the save, and is low by at most one step (the first step's own work)."""
    config = TrainConfig(data_path=data, output_dir=out, methods=[method], arch=args.arch, weights="none",
                         epochs=args.epochs, batch_size=args.batch_size, device=args.device,
                         precision=args.precision, channels_last=args.channels_last, workers=args.workers,
                         progress=False, save_every=10**9)
    train(config)
    lines = [json.loads(line) for line in (out / TRAINING_LOG).read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    if len(steps) < LEAST_LOGGED_STEPS:
        raise SystemExit(f"only {len(steps)} steps: raise --per-class or --epochs for a measurable run")
    durations = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])]
    # an older checkout's epoch ends have no time (PYTHONPATH): its last step's queuing ends the mean instead
    end = max([line["time_s"] for line in lines if line.get("event") == "epoch_end" and "time_s" in line],
              default=steps[-1]["time_s"])
    return args.batch_size / statistics.median(durations), args.batch_size * len(durations) / (end - steps[0]["time_s"])


def loader_cost(args: argparse.Namespace, data: Path, method: Method) -> tuple[float, float]:
    """Milliseconds per image of (1) train.py's DataLoader alone (what its workers do: gather the batch from the
    decoded store with its random choices) and (2) the whole data pipeline, the DataLoader and then
    `device_batch` (swap, crops and flips on the device) and the images put in the model's layout, in this
    process (workers=0), over the second epoch's batches; start-up (hashing, decoding into the store)
    excluded. (2) is measured directly, not as a
    difference of two throughputs, so it holds on a machine whose speed drifts. Pointed at a checkout from before
    the decoded store (PYTHONPATH), it times that checkout's pipeline the same way: Pillow decoding each image and
    mask, and the per-sample draws, in __getitem__."""
    config = TrainConfig(data_path=data, output_dir=data.parent / "unused", methods=[method], arch=args.arch,
                         weights="none", batch_size=args.batch_size, workers=0, progress=False)
    records = training_data.list_training_data(config)
    store = ()
    if hasattr(training_data, "decoded_store"):
        store = (training_data.decoded_store(records, content_fingerprint(records.root, records.relpaths(), 1), 0,
                                             False),)
    sampler = training_data.StepSampler(len(records), args.batch_size, config.seed, 1)
    device = resolve_device(args.device)
    runtime = Runtime(device, Precision.FP32, args.channels_last)  # the model's input layout, as the loop makes it
    loading = finishing = 0.0
    images = 0
    start = time.perf_counter()
    for batch in training_data.make_loader(records, config, sampler, False, *store):
        loaded = time.perf_counter()
        runtime.to_device(training_data.device_batch(batch, device, config.augment)[0])
        synchronize(device)
        finished = time.perf_counter()
        loading, finishing = loading + loaded - start, finishing + finished - loaded
        images += len(batch["label"])
        start = time.perf_counter()
    return loading * 1000 / images, (loading + finishing) * 1000 / images


def measure(args: argparse.Namespace) -> dict:
    """The figures as a JSON-ready dict (what the GPU suite calls): (a), (b), their ratios, the data pipeline's
    cost per image, 1/(b) - 1/(a), in milliseconds (from the median steps), and measured directly, and the
    minutes the Mixed-Rand recipe's steps would take at (b)'s rate from the mean (its epoch ends included; not the
    start-up: hashing and decoding the data once, the model, each epoch's first step)."""
    device = resolve_device(args.device)
    if args.batch_size is None:
        args.batch_size = default_train_batch_size(device)
    # train.py's own default where it has one (bf16 only on GPUs that compute it natively), so (a) and (b) match
    default = TrainConfig(data_path=Path("."), output_dir=Path("."))
    precision = args.precision or (default.precision_on(device) if hasattr(default, "precision_on") else
                                   Precision.BF16 if device.type == "cuda" else Precision.FP32)
    runtime = Runtime(device, precision, args.channels_last)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data = args.data_path
        if data is None:
            data = Path(tmp) / "in9"
            synthetic.generate(data, per_class=args.per_class, seed=0, split="train")
        before = step_throughput(args, runtime)
        loops = {m.value: loop_throughput(args, data, m, Path(tmp) / m.value) for m in args.methods}
        loader = {m.value: loader_cost(args, data, m) for m in args.methods}
        after = step_throughput(args, runtime)
    step_rate = [(b + a) / 2 for b, a in zip(before, after)]  # (median-based, mean-based)
    results = {"machine": machine(), "arch": args.arch, "device": str(device), "precision": precision.value,
               "batch_size": args.batch_size, "workers": args.workers,
               "step_images_per_s": {"median_before": round(before[0], 2), "median_after": round(after[0], 2),
                                     "median": round(step_rate[0], 2), "mean": round(step_rate[1], 2)},
               "loop_images_per_s": {k: {"median": round(v[0], 2), "mean": round(v[1], 2)} for k, v in loops.items()},
               "ratio": {k: {"median": round(v[0] / step_rate[0], 3), "mean": round(v[1] / step_rate[1], 3)}
                         for k, v in loops.items()},
               "pipeline_ms_per_image": {k: round(1000 / v[0] - 1000 / step_rate[0], 3) for k, v in loops.items()},
               "loader_ms_per_image": {k: round(v[0], 3) for k, v in loader.items()},
               "pipeline_direct_ms_per_image": {k: round(v[1], 3) for k, v in loader.items()},
               "recipe_minutes": {k: round(RECIPE_IMAGES * RECIPE_EPOCHS / v[1] / 60, 1) for k, v in loops.items()}}
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    results = measure(args)
    step_rate = (results["step_images_per_s"]["median"], results["step_images_per_s"]["mean"])
    loops = {k: (v["median"], v["mean"]) for k, v in results["loop_images_per_s"].items()}
    print(f"(a) training step alone: {step_rate[0]:.1f} img/s from the median step (before "
          f"{results['step_images_per_s']['median_before']:.1f}, after "
          f"{results['step_images_per_s']['median_after']:.1f}); {step_rate[1]:.1f} from the mean")
    for name, (median, mean) in loops.items():
        print(f"(b) train.py {name}: {median:.1f} img/s from the median step, ratio {median / step_rate[0]:.2f} "
              f"(target >= 0.85); from the mean {mean:.1f}, ratio {mean / step_rate[1]:.2f}; data pipeline "
              f"{results['pipeline_ms_per_image'][name]:.2f} ms per image, of which the DataLoader "
              f"{results['loader_ms_per_image'][name]:.2f}; measured directly (DataLoader + device_batch) "
              f"{results['pipeline_direct_ms_per_image'][name]:.2f}; the Mixed-Rand recipe ({RECIPE_IMAGES:,} "
              f"images, {RECIPE_EPOCHS} epochs) at this rate: {results['recipe_minutes'][name]:.1f} min")
    if args.results_file is not None:
        args.results_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
