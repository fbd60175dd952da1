"""Benchmark of the challenge engine: throughput against the model's own, work against the minimum, and
end-to-end time against a per-foreground loop that streams backgrounds from disk as the original does.

    python bench/bench_challenge.py --device cpu --per-class 30
    python bench/bench_challenge.py --device cuda --arch resnet50 --per-class 450 --precision bf16 --skip-baseline

--end-to-end times `python challenge_eval.py` itself, from process start to its summary line, against
(composites evaluated + background predictions) / (the model's own forward throughput at its best batch
size, each batch size measured in a fresh process, with and without the toolkit's CPU allocator tuning):

    python bench/bench_challenge.py --end-to-end --model timm:efficientnet_lite0 --per-class 10

Prints its figures; record them in bench/RESULTS.md with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import functional as TF

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import challenge  # noqa: E402
from tools.challenge import ChallengeConfig, Criterion, run_challenge  # noqa: E402
from tools.data import synthetic  # noqa: E402
from tools.in9 import Normalization, PredictionMap, statistics_for  # noqa: E402
from tools.models.architectures import build_architecture  # noqa: E402
from tools.models.boundary import LoadedModel, PixelModel  # noqa: E402
from tools.runtime import Forward, Precision, Runtime  # noqa: E402


def machine(device: torch.device) -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    if device.type == "cuda":
        text = f"{torch.cuda.get_device_name(device)}; " + text
    return text


def make_model(args) -> tuple[torch.nn.Module, int]:
    if args.model in ("color", "color-stride"):
        sampling = "stride" if args.model == "color-stride" else "pool"
        return synthetic.ColorEvidenceModel(9, trunk_width=args.trunk_width, trunk_scale=1e-3, sampling=sampling), 9
    import torchvision  # noqa: PLC0415
    torch.manual_seed(0)
    return torchvision.models.get_model(args.model, weights=None, num_classes=9), 9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_throughput(model: torch.nn.Module, runtime: Runtime, batch: int, seconds: float, repeats: int = 3) -> float:
    """Images/s of the wrapped model alone on random uint8 input at the engine's batch size (mean of windows).

    Shared virtual machines drift by tens of percent within minutes, so the benchmark measures this before
    and after the engine's run and compares the engine with the mean of the two."""
    return sum(_forward_window(model, runtime, batch, seconds / repeats) for _ in range(repeats)) / repeats


def _forward_window(model: torch.nn.Module, runtime: Runtime, batch: int, seconds: float) -> float:
    prepared = runtime.compiled(runtime.prepare(model))
    forward = Forward(prepared, runtime, batch)
    x = runtime.to_device(torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8))
    for _ in range(3):
        forward(x)
    sync(runtime.device)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        out = forward(x).argmax(1)
        n += batch
    out.cpu()
    sync(runtime.device)
    return n / (time.perf_counter() - start)


class _Backgrounds(Dataset):
    """only_bg_t as the original reads it: ImageFolder order, PIL, ToTensor, decoded per request."""

    def __init__(self, root: Path):
        folder = root / "only_bg_t" / "val"
        self.items = [(folder / c / f, i) for i, c in enumerate(sorted(os.listdir(folder)))
                      for f in sorted(os.listdir(folder / c))]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return TF.to_tensor(Image.open(path).convert("RGB")), label


def baseline(root: Path, data: challenge.ChallengeData, model: torch.nn.Module, num_classes: int,
             runtime: Runtime, workers: int) -> tuple[np.ndarray, float, int]:
    """Per foreground, stream every background from disk in batches of 32 until one fools it."""
    start = time.perf_counter()
    mean, std = statistics_for(Normalization.AUTO, num_classes)
    mean, std = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    prepared = runtime.compiled(runtime.prepare(model))
    to_in9 = PredictionMap(num_classes)
    loader = DataLoader(_Backgrounds(root), batch_size=32, shuffle=False, num_workers=workers)
    vulnerable = np.zeros(len(data.foregrounds), dtype=bool)
    evaluated = 0
    for i, rec in enumerate(data.foregrounds):
        fg = TF.to_tensor(Image.open(root / rec.image_relpath).convert("RGB")).unsqueeze(0)
        mask = torch.from_numpy(np.load(root / rec.mask_relpath).astype(np.uint8)).float()[None, None]
        for bgs, _ in loader:
            composite = bgs * (1 - mask) + fg * mask
            with torch.inference_mode(), runtime.autocast():
                preds = to_in9(prepared(((composite - mean) / std).to(runtime.device))).cpu()
            evaluated += len(bgs)
            if (preds != rec.label).any():
                vulnerable[i] = True
                break
    return vulnerable, time.perf_counter() - start, evaluated


FORWARD_PROBE = """
import sys, time, torch
from tools.models.sources import load_model
from tools.runtime import Forward, Runtime, tune_cpu_allocator
arch, checkpoint, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
tuned, seconds = sys.argv[4] == "1", float(sys.argv[5])
if tuned:
    tune_cpu_allocator()
model = load_model(arch, checkpoint=checkpoint).model.eval()
x = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8)
with torch.inference_mode():
    for _ in range(2):
        model(x)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model(x).argmax(1)
        n += batch
print(n / (time.perf_counter() - start))
"""


def fresh_process_throughput(arch: str, checkpoint: Path, batch: int, tuned: bool, seconds: float) -> float:
    """Images/s of the model alone (PixelModel, uint8 input) in a new CPU process, after two warm-up passes."""
    out = subprocess.run([sys.executable, "-c", FORWARD_PROBE, arch, str(checkpoint), str(batch), str(int(tuned)),
                          str(seconds)], capture_output=True, text=True, check=True, cwd=REPO)
    return float(out.stdout.strip().splitlines()[-1])


def end_to_end(args) -> None:
    """challenge_eval.py as a user runs it on the CPU, process start to summary line, against the model's speed."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = args.data_path or synthetic.generate(tmp / "bg", per_class=args.per_class, seed=0).root
        checkpoint = tmp / "model.pt"
        torch.manual_seed(0)
        torch.save(build_architecture(args.model, 9).state_dict(), checkpoint)
        print(f"machine: {machine(torch.device('cpu'))}")
        command = [sys.executable, str(REPO / "challenge_eval.py"), "--data-path", str(root), "--arch", args.model,
                   "--checkpoint", str(checkpoint), "--device", "cpu", "--no-cache", "--no-progress",
                   "--output-dir", str(tmp / "out"), "--results-file", str(tmp / "r.json")]
        if args.batch_size:
            command += ["--batch-size", str(args.batch_size)]
        began = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
        summary_at = None
        for line in proc.stdout:
            if line.startswith("Summary:") and summary_at is None:
                summary_at = time.perf_counter() - began
                print(line.rstrip())
        if proc.wait() != 0:
            raise SystemExit(proc.stderr.read())
        result = json.loads((tmp / "r.json").read_text())
        composites, backgrounds = result["composites_evaluated"], result["background_predictions"]
        robust = result["total"] - result["vulnerable"]
        minimum = robust * backgrounds + result["vulnerable"]
        print(f"model {args.model}, 9 classes; {result['total']} foregrounds x {backgrounds} backgrounds; batch "
              f"{result['provenance']['batch_size']} (chosen by the run)")
        print(f"end to end: {summary_at:.2f} s to the summary line; search {result['wall_time_s']:.2f} s")
        print(f"(3) composites evaluated {composites:,} / necessary minimum {minimum:,} = {composites / minimum:.3f}")
        for tuned in (False, True):
            rates = {b: fresh_process_throughput(args.model, checkpoint, b, tuned, args.window)
                     for b in (4, 8, 16, 32)}
            best = max(rates, key=rates.get)
            ideal = (composites + backgrounds) / rates[best]
            print(f"model alone, {'with' if tuned else 'without'} the allocator tuning: "
                  + ", ".join(f"batch {b}: {r:.1f}" for b, r in rates.items())
                  + f" images/s; best {best}; ideal {ideal:.2f} s; end to end / ideal = {summary_at / ideal:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", type=Precision, default=Precision.FP32)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--model", default="color",
                        help="color (hand-built, with --trunk-width), color-stride (the same reading every eighth "
                             "pixel: nearly free) or a torchvision name")
    parser.add_argument("--trunk-width", type=int, default=0, help="conv trunk width of the colour model")
    parser.add_argument("--per-class", type=int, default=30, help="images per class of the generated data")
    parser.add_argument("--data-path", type=Path, default=None, help="use this data instead of generating it")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--full", action="store_true", help="also time --full (every pair)")
    parser.add_argument("--end-to-end", action="store_true",
                        help="time challenge_eval.py from process start to summary line on the CPU; --model is then "
                             "an architecture name (torchvision, or timm:NAME) built with random weights")
    parser.add_argument("--window", type=float, default=4.0, help="seconds per forward-throughput measurement")
    args = parser.parse_args()
    if args.end_to_end:
        end_to_end(args)
        return

    device = torch.device(args.device)
    runtime = Runtime(device, args.precision, args.channels_last)
    batch = runtime.batch_size(args.batch_size)
    module, num_classes = make_model(args)
    mean, std = statistics_for(Normalization.AUTO, num_classes)
    loaded = LoadedModel(PixelModel(module, mean, std).eval(), num_classes, args.model, None, None, None, "bench",
                         "auto")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.data_path or synthetic.generate(Path(tmp) / "bg", per_class=args.per_class, seed=0).root
        print(f"machine: {machine(device)}")
        print(f"model: {args.model}{f' (trunk {args.trunk_width})' if args.model.startswith('color') else ''}, "
              f"device {device}, precision {args.precision.value}, batch {batch}")
        window = 6.0 if device.type == "cpu" else 10.0
        fwd_before = forward_throughput(loaded.model, runtime, batch, seconds=window)

        t0 = time.perf_counter()
        config = ChallengeConfig(batch_size=batch, progress=False, criterion=Criterion.ANY)
        result = run_challenge(loaded, runtime, challenge.list_challenge_files(root, args.workers), config,
                               output_dir=Path(tmp) / "out", workers=args.workers)
        engine_time = time.perf_counter() - t0
        s = result.state
        fwd_after = forward_throughput(loaded.model, runtime, batch, seconds=window)
        fwd = (fwd_before + fwd_after) / 2
        print(f"(1) model forward throughput: {fwd:,.0f} images/s (before the run {fwd_before:,.0f}, after "
              f"{fwd_after:,.0f})")
        rate = s.evaluated / s.elapsed
        n_bg = len(result.data.backgrounds)
        robust = int((s.verdict == challenge.ROBUST).sum())
        minimum = robust * n_bg + result.vulnerable
        print(f"data: {result.total} foregrounds x {n_bg} backgrounds; {result.vulnerable} vulnerable, {robust} robust")
        print(f"(2) engine: {rate:,.0f} composites/s in the search; ratio to (1): {rate / fwd:.3f}")
        print(f"(3) composites evaluated {s.evaluated:,} / necessary minimum {minimum:,} = {s.evaluated / minimum:.3f}")
        print(f"    end to end (decode, predict backgrounds, search): {engine_time:.2f} s")
        if args.full:
            full = run_challenge(loaded, runtime, challenge.list_challenge_files(root, args.workers),
                                 ChallengeConfig(batch_size=batch, progress=False, full=True),
                                 output_dir=Path(tmp) / "full", workers=args.workers)
            full_rate = full.state.evaluated / full.state.elapsed
            print(f"    --full: {full_rate:,.0f} composites/s, ratio to (1): {full_rate / fwd:.3f}; verdicts equal: "
                  f"{np.array_equal(full.state.verdict, s.verdict)}")
        if not args.skip_baseline:
            vulnerable, base_time, base_evaluated = baseline(Path(root), result.data, module, num_classes, runtime,
                                                             args.workers)
            same = np.array_equal(vulnerable, s.verdict == challenge.VULNERABLE)
            print(f"(4) per-foreground loop from disk: {base_time:.2f} s ({base_evaluated:,} composites); engine "
                  f"{engine_time:.2f} s; speed-up {base_time / engine_time:.1f}x; verdicts equal: {same}")
        if device.type == "cuda" and s.elapsed > 0:
            full_pairs = 4050 * 4050
            print(f"projection for the full release (4050 x 4050, same vulnerable share): search "
                  f"{(robust / result.total * full_pairs + result.vulnerable / result.total * 4050) / rate / 60:.1f} "
                  f"min, --full {full_pairs / rate / 60:.1f} min at this rate")


if __name__ == "__main__":
    main()
