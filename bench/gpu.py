"""Every GPU figure in one command, within a time budget: the model's own speed and each pipeline's against it.

On generated data (by default 1,350 foregrounds x 1,350 backgrounds on a GPU) and a torchvision architecture
with random weights (ResNet-50), it measures in one run:
  model-{fp32,bf16}-{eager,compiled}  the wrapped model alone on uint8 batches already on the device (and how long
                                      torch.compile took)
  in9-{fp32,bf16}                     in9_eval's `all` run (tools.in9.evaluate.run_in9): a first run (listing and
                                      decoding), and one reading the decoded variations from memory (the zoo's)
  challenge-any, challenge-full       the challenge's search (tools.challenge.run_challenge), composites/s
  challenge-eval[-compile]            `python challenge_eval.py` from process start to its summary line, against
                                      (composites + background predictions) / the model's speed
  train                               bench/bench_train.py (train.py's loop in steady state against its step)
  pytest-gpu                          `pytest -m gpu`
and prints each pipeline's ratio to the model measured in the same run, and writes one JSON with the device,
driver and versions. Each part runs in its own process under its share of the budget (default 8 minutes in
all); a part that would overrun what is left is skipped and says so.

Without CUDA (or with --small) it runs the same parts at small sizes on the CPU (a tiny CNN, a few images per
class, no compilation), as CI does:

    python bench/gpu.py --results-file gpu.json                 # on a GPU machine: every figure, <= 8 min
    python bench/gpu.py --small --parts model-fp32-eager in9-fp32 challenge-any
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# part: (share of the budget, the least time it needs to be worth starting, in seconds on a GPU)
PARTS = {
    "model-fp32-eager": (15, 8), "model-bf16-eager": (15, 8),
    "model-fp32-compiled": (45, 20), "model-bf16-compiled": (45, 20),  # a cold ResNet-50 compile: 20-45 s
    "in9-fp32": (35, 15), "in9-bf16": (25, 12),
    "challenge-any": (35, 15), "challenge-full": (90, 30),
    "challenge-eval": (45, 20), "challenge-eval-compile": (60, 30),
    "train": (40, 25), "pytest-gpu": (30, 15),
}  # the shares add up to the default budget, 480 s; a part may run to 1.5 times its share while time is left,
# the last one to whatever is left
# on a GPU the training view lists each generated image 4 times: 1,350 x 4 = 5,400 images, 21 steps of train.py's
# default batch (256) in one epoch, decoded in seconds, without generating (or writing) more images
TRAIN_COPIES = 4
SMALL_PARTS = [p for p in PARTS if "compile" not in p]  # compiling on a CPU takes minutes; its figures mean little


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true",
                        help="small sizes on the CPU: a tiny CNN, few images (default: on when CUDA is missing)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=None, metavar="PART",
                        help=f"which parts to run, in this order (default: all; with --small those without "
                             f"compilation): {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=480.0, metavar="S",
                        help="seconds for the whole run, data generation included (default: 480)")
    parser.add_argument("--per-class", type=int, default=None, metavar="N",
                        help="generated images per class (default: 150, i.e. 1,350 x 1,350; --small: 2)")
    parser.add_argument("--arch", default=None, metavar="NAME",
                        help="architecture with random weights (default: resnet50; --small: the toolkit's small CNN)")
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="images per forward pass (default: 512 on a GPU, 16 --small)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="decoding threads (default: the toolkit's default)")
    parser.add_argument("--full-foregrounds", type=int, default=600, metavar="N",
                        help="foregrounds (evenly spaced) that challenge-full pairs with every background: the "
                             "whole 1,350 x 1,350 matrix takes minutes (default: 600)")
    parser.add_argument("--window", type=float, default=None, metavar="S",
                        help="seconds per model-speed measurement (default: 5; --small: 0.5)")
    parser.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                        help="write every figure as one JSON (default: bench_gpu.json in the working folder)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: run one part, print its JSON
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on the mode (a GPU or --small)."""
    import torch  # noqa: PLC0415

    from tools.models.architectures import SMALL_CNN  # noqa: PLC0415
    from tools.threads import default_workers  # noqa: PLC0415
    args.small = args.small or not torch.cuda.is_available()
    args.device = "cpu" if args.small else "cuda"
    args.per_class = args.per_class or (2 if args.small else 150)
    args.arch = args.arch or (SMALL_CNN if args.small else "resnet50")
    args.batch_size = args.batch_size or (16 if args.small else 512)
    args.workers = args.workers or default_workers()
    args.window = args.window or (0.5 if args.small else 5.0)
    return args


def environment() -> dict:
    import PIL  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torchvision  # noqa: PLC0415
    info = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "pillow": PIL.__version__, "cuda_runtime": torch.version.cuda, "cpu_cores": os.cpu_count(),
            "device": "cpu", "driver": None}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return info


# ----------------------------------------------------------------------------------------------------------
# The parts (each run in its own process; each returns a flat dict of figures)

def _loaded(args):
    from bench_in9 import build_model  # noqa: PLC0415
    return build_model(argparse.Namespace(model="arch", arch=args.arch, seed=0))


def _runtime(args, precision: str, compiled: bool = False):
    import torch  # noqa: PLC0415

    from tools.runtime import Precision, Runtime  # noqa: PLC0415
    return Runtime(torch.device(args.device), Precision(precision), channels_last=not args.small, compile=compiled)


def model_speed(args, precision: str, compiled: bool) -> dict:
    """Images/s of the wrapped model alone, and (compiled) how long the first batch took."""
    import torch  # noqa: PLC0415

    from bench_in9 import synchronize  # noqa: PLC0415
    from tools.runtime import Forward  # noqa: PLC0415
    runtime = _runtime(args, precision, compiled)
    forward = Forward(runtime.compiled(runtime.prepare(_loaded(args).model)), runtime, args.batch_size)
    batch = runtime.to_device(torch.randint(0, 256, (args.batch_size, 3, 224, 224), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(0)))
    start = time.perf_counter()
    forward(batch)
    synchronize(runtime.device)
    first = time.perf_counter() - start
    forward(batch)
    synchronize(runtime.device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.window:
        forward(batch)
        count += args.batch_size
    synchronize(runtime.device)
    return {"images_per_s": count / (time.perf_counter() - start), "first_batch_s": first}


def in9_speed(args, precision: str) -> dict:
    """A first `all` run (listing, hashing, decoding, filling an empty decoded-data cache), then the same files'
    run with the set holding what it decoded, as the zoo's next model reads them: the decoded variations from memory;
    then a run as a second in9_eval.py would make it (listing and hashing again), its images read from the disk cache
    (`disk_cached_ratio`; on CUDA, kept on the device where they fit)."""
    from bench_in9 import synchronize  # noqa: PLC0415
    from tools.data.store import DecodedCache  # noqa: PLC0415
    from tools.in9 import VARIATIONS  # noqa: PLC0415
    from tools.in9.evaluate import In9Config, run_in9  # noqa: PLC0415
    from tools.prepared_run import Request, list_data  # noqa: PLC0415
    loaded, runtime = _loaded(args), _runtime(args, precision)
    model = model_speed(args, precision, False)["images_per_s"]
    seconds = []
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as cache:
        config = In9Config(VARIATIONS, args.batch_size, args.workers, progress=False)
        request = Request(args.data, config, workers=args.workers, cache=DecodedCache(Path(cache)))
        start = time.perf_counter()
        files = list_data(request, hold=True).in9
        for _ in range(2):
            run = run_in9(loaded, runtime, files, config)
            synchronize(runtime.device)
            seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
        run = run_in9(loaded, runtime, list_data(request).in9, config)
        synchronize(runtime.device)
        seconds.append(time.perf_counter() - start)
    images = sum(result.total for result in run.results.values())
    first, cached, disk = images / seconds[0], images / seconds[1], images / seconds[2]
    return {"model_images_per_s": model, "images": images, "first_run_s": seconds[0], "cached_s": seconds[1],
            "images_per_s": first, "ratio": first / model, "cached_images_per_s": cached,
            "cached_ratio": cached / model, "disk_cached_s": seconds[2], "disk_cached_images_per_s": disk,
            "disk_cached_ratio": disk / model,
            "rechecked_fp32": sum(result.rechecked for result in run.results.values())}


def challenge_speed(args, full: bool) -> dict:
    import numpy as np  # noqa: PLC0415

    from tools.challenge import ChallengeConfig, Criterion, run_challenge  # noqa: PLC0415
    from tools.prepared_run import Request, list_data  # noqa: PLC0415
    precision = "fp32" if args.small else "bf16"
    loaded, runtime = _loaded(args), _runtime(args, precision)
    model = model_speed(args, precision, False)["images_per_s"]
    with tempfile.TemporaryDirectory() as out:
        config = ChallengeConfig(batch_size=args.batch_size, progress=False, criterion=Criterion.ANY, full=full)
        start = time.perf_counter()  # the data decoded and the backgrounds predicted too
        data = list_data(Request(args.data, challenge=config, workers=args.workers, progress=False)).challenge()
        if full and args.full_foregrounds < len(data.foregrounds):
            data = data.foreground_subset(np.linspace(0, len(data.foregrounds) - 1, args.full_foregrounds).astype(int))
        result = run_challenge(loaded, runtime, data, config, output_dir=Path(out), workers=args.workers)
    state = result.state
    rate = state.evaluated / state.elapsed
    return {"precision": precision, "model_images_per_s": model, "composites": int(state.evaluated),
            "search_s": state.elapsed, "whole_s": time.perf_counter() - start, "composites_per_s": rate,
            "ratio": rate / model, "vulnerable": result.vulnerable, "foregrounds": result.total,
            "backgrounds": len(data.backgrounds)}


def challenge_eval_speed(args, compiled: bool) -> dict:
    """challenge_eval.py as a user runs it: process start to the summary line."""
    precision = "fp32" if args.small else "bf16"
    model = model_speed(args, precision, compiled)["images_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(REPO / "challenge_eval.py"), "--data-path", str(args.data), "--arch", args.arch,
                   "--checkpoint", str(args.checkpoint), "--device", args.device, "--precision", precision,
                   "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--no-cache",
                   "--no-progress", "--output-dir", f"{tmp}/out", "--results-file", f"{tmp}/r.json"]
        command += ["--compile"] if compiled else []
        command += [] if args.small else ["--channels-last"]
        summary_at = seconds_to_line(command, tmp, "Summary:")
        result = json.loads(Path(f"{tmp}/r.json").read_text())
    ideal = (result["composites_evaluated"] + result["background_predictions"]) / model
    return {"precision": precision, "model_images_per_s": model, "end_to_end_s": summary_at,
            "composites": result["composites_evaluated"], "ideal_s": ideal, "times_ideal": summary_at / ideal}


def seconds_to_line(command: list[str], cwd: str, prefix: str) -> float | None:
    """Run a Python `command` to its end; the seconds from its start to its first line starting with `prefix`.
    Both streams share one pipe (a full stderr pipe nobody reads would stall the process), and the child runs
    unbuffered, so the line arrives when printed, not at exit."""
    began, seen_at = time.perf_counter(), None
    output = collections.deque(maxlen=40)  # its last lines, for a failure's message
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        output.append(line)
        if line.startswith(prefix) and seen_at is None:
            seen_at = time.perf_counter() - began
    if proc.wait() != 0:
        raise RuntimeError("".join(output)[-2000:])
    return seen_at


def train_command(args, results: str) -> list[str]:
    """bench_train.py on the training view (`training_view`), erm and bg-swap; on a GPU at train.py's default batch
    size (256), bf16, channels-last: one epoch of 21 steps, measured between its first and last step."""
    command = [sys.executable, str(REPO / "bench" / "bench_train.py"), "--data-path", str(args.data),
               "--arch", args.arch, "--device", args.device, "--workers", str(min(args.workers, 8)),
               "--methods", "erm", "bg-swap", "--results-file", results]
    return command + (["--batch-size", "4", "--warmup", "1", "--iters", "3"] if args.small else
                      ["--channels-last", "--iters", "20"])


def train_speed(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # the decoded store's cache in the temporary folder: the view's copies (about 1.6 GB) are not kept
        proc = subprocess.run(train_command(args, f"{tmp}/train.json"), capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "XDG_CACHE_HOME": tmp})
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        return json.loads(Path(f"{tmp}/train.json").read_text())


def pytest_gpu(args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=REPO)
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-300:]]
    return {"exit_code": proc.returncode, "summary": tail[0]}


def run_part(name: str, args) -> dict:
    if name.startswith("model-"):
        _, precision, mode = name.split("-")
        return model_speed(args, precision, mode == "compiled")
    if name.startswith("in9-"):
        return in9_speed(args, name.split("-")[1])
    if name.startswith("challenge-eval"):
        return challenge_eval_speed(args, name.endswith("compile"))
    if name.startswith("challenge-"):
        return challenge_speed(args, name == "challenge-full")
    return train_speed(args) if name == "train" else pytest_gpu(args)


# ----------------------------------------------------------------------------------------------------------
# The whole run

def prepare(args, tmp: Path) -> None:
    """Generate the data in the training layout too (train.py reads the train split), and save the checkpoint."""
    import torch  # noqa: PLC0415

    from tools.data import synthetic  # noqa: PLC0415
    from tools.models.architectures import build_architecture  # noqa: PLC0415
    args.data = synthetic.generate(tmp / "bg_challenge", per_class=args.per_class, seed=0).root
    training_view(args.data, 1 if args.small else TRAIN_COPIES)
    args.checkpoint = tmp / "model.pt"
    torch.manual_seed(0)
    torch.save(build_architecture(args.arch, 9).state_dict(), args.checkpoint)


def training_view(root: Path, copies: int) -> None:
    """A train split of the generated data without generating more: in original/, only_bg_t/ and fg_mask/ (what
    train.py reads for erm and bg-swap), links to the test split's files (`_link`), each listed `copies` times
    (<stem>_<copy>, so that masks and images still pair up by name)."""
    from tools.data.layout import MASK_FOLDER, list_folder  # noqa: PLC0415
    from tools.in9 import SPLIT, TRAIN_SPLIT, Variation  # noqa: PLC0415
    for folder in (Variation.ORIGINAL.value, Variation.ONLY_BG_T.value, MASK_FOLDER):
        source = root / folder / SPLIT
        for cls in list_folder(source)[0]:
            target = root / folder / TRAIN_SPLIT / cls
            target.mkdir(parents=True)
            for name in list_folder(source / cls)[1]:
                stem, suffix = os.path.splitext(name)
                for copy in range(copies):
                    _link(source / cls / name, target / f"{stem}_{copy}{suffix}")


def _link(source: Path, link: Path) -> None:
    """`link` to `source`'s bytes: a symbolic link (relative), else a hard link (Windows without the right to make
    symbolic links), else a copy."""
    try:
        link.symlink_to(os.path.relpath(source, link.parent))
    except OSError:
        try:
            os.link(source, link)
        except OSError:
            shutil.copyfile(source, link)


def child_command(name: str, args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--part", name, "--data", str(args.data),
            "--checkpoint", str(args.checkpoint), "--arch", args.arch, "--batch-size", str(args.batch_size),
            "--workers", str(args.workers), "--window", str(args.window), "--per-class", str(args.per_class),
            "--full-foregrounds", str(args.full_foregrounds)]\
        + (["--small"] if args.small else [])


def run_all(args) -> dict:
    began = time.perf_counter()
    parts = args.parts or (SMALL_PARTS if args.small else list(PARTS))
    report: dict = {"environment": environment(), "small": args.small, "arch": args.arch,
                    "per_class": args.per_class, "batch_size": args.batch_size, "workers": args.workers,
                    "budget_s": args.budget, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        prepare(args, Path(tmp))
        report["data_generation_s"] = time.perf_counter() - began
        for name in parts:
            left = args.budget - (time.perf_counter() - began)
            share, least = PARTS[name]
            least = least / 10 if args.small else least
            if left < least:
                report["parts"][name] = {"status": "skipped", "why": f"{left:.0f} s of the budget left, needs {least}"}
                print(f"{name}: skipped ({left:.0f} s left)", flush=True)
                continue
            start = time.perf_counter()
            if args.small:  # small and quick: in this process, without the cost of another start
                try:
                    entry = {"status": "ok", **run_part(name, args)}
                except Exception as exc:  # noqa: BLE001 (a failed part is reported; the others still run)
                    entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[-1500:]}
            else:
                last = name == parts[-1]  # the last part may take whatever is left (pytest -m gpu's length is unknown)
                entry = run_child(name, args, left if last else min(left, 1.5 * share * args.budget / 480))
            entry["wall_s"] = time.perf_counter() - start
            report["parts"][name] = entry
            print(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in entry.items() if not isinstance(v, (dict, list))), flush=True)
    report["ratios"] = ratios(report["parts"])
    report["total_s"] = time.perf_counter() - began
    for key, value in report["ratios"].items():
        print(f"ratio {key}: {value:.3f}")
    from bench_train import RECIPE_EPOCHS, RECIPE_IMAGES  # noqa: PLC0415
    train = report["parts"].get("train", {})
    for method, minutes in train.get("recipe_minutes", {}).items() if not args.small else ():
        print(f"train {method}: the Mixed-Rand recipe's steps ({RECIPE_IMAGES:,} images, {RECIPE_EPOCHS} epochs) "
              f"projected at {minutes:.1f} min ({train['arch']}, {train['precision']}, batch {train['batch_size']}, "
              f"{train['device']})")
    return report


def run_child(name: str, args, timeout: float) -> dict:
    """One part in its own process (a fresh compiler and CUDA context), stopped at `timeout` seconds: with the
    processes it started (challenge_eval.py, bench_train.py, pytest), its whole process group."""
    proc = subprocess.Popen(child_command(name, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "timed out", "timeout_s": timeout}
    if proc.returncode != 0:
        return {"status": "failed", "error": err.strip()[-1500:]}
    return {"status": "ok", **json.loads(out.strip().splitlines()[-1])}


def ratios(parts: dict) -> dict:
    """Each pipeline against the model measured in the same run (its own part)."""
    out = {}
    for name, entry in parts.items():
        if entry.get("status") != "ok":
            continue
        for key in ("ratio", "cached_ratio", "disk_cached_ratio", "times_ideal"):
            if isinstance(entry.get(key), float):
                out[f"{name} {key}"] = entry[key]
        if name == "train":
            for method, value in entry.get("ratio", {}).items():
                out[f"train {method} median ratio"] = value["median"]
                out[f"train {method} mean ratio"] = value["mean"]
    compiled, eager = parts.get("model-bf16-compiled", {}), parts.get("model-bf16-eager", {})
    if compiled.get("status") == eager.get("status") == "ok":
        out["model bf16 compiled / eager"] = compiled["images_per_s"] / eager["images_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = settle(build_parser().parse_args(argv))
    if args.part is not None:
        print(json.dumps(run_part(args.part, args)))
        return 0
    report = run_all(args)
    path = args.results_file or Path("bench_gpu.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
