"""The benchmark scripts still start (they are run by hand, so nothing else would notice a broken import)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_forked
from tools.data import synthetic
from tools.data.layout import list_variation
from tools.in9 import NUM_IN9_CLASSES
from tools.training.config import Method, TrainConfig, default_train_batch_size
from tools.training.data import list_training_data

pytestmark = pytest.mark.slow  # end to end: the bench scripts run small

BENCH = Path(__file__).resolve().parents[1] / "bench"


SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


@pytest.fixture(scope="module")
def helps() -> dict:
    """Each script's `--help` as `python bench/SCRIPT --help` prints it (tests.helpers.run_forked: one start-up for
    all, each script in a fork that has loaded none of the toolkit)."""
    return dict(zip(SCRIPTS, run_forked([[str(BENCH / script), "--help"] for script in SCRIPTS], Path.cwd())))


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script, helps):
    proc = helps[script]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_gpu_command_runs_small_on_the_cpu(tmp_path, capsys):
    """bench/gpu.py at tiny sizes on the CPU (as CI runs it): every figure asked for, the ratios against the model
    measured in the same run, the environment, and a part that would overrun the budget skipped."""
    out = tmp_path / "gpu.json"
    parts = ["model-fp32-eager", "in9-fp32", "challenge-any", "challenge-full"]
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--small", "--per-class", "1", "--window", "0.2",
                           "--full-foregrounds", "4", "--parts", *parts, "--results-file", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [name for name, entry in report["parts"].items() if entry["status"] == "ok"] == parts, report["parts"]
    assert report["environment"]["torch"] and report["environment"]["device"] == "cpu"
    assert report["parts"]["model-fp32-eager"]["images_per_s"] > 0
    assert report["parts"]["in9-fp32"]["images"] == 8 * 9
    assert report["ratios"]["in9-fp32 cached_ratio"] > 0  # the second run read the decoded variations from memory
    assert report["ratios"]["in9-fp32 disk_cached_ratio"] > 0  # the third, from the decoded-data cache on disk
    full = report["parts"]["challenge-full"]
    assert full["composites"] == full["foregrounds"] * full["backgrounds"] == 4 * 9
    for name in parts[1:]:
        assert report["ratios"][f"{name} ratio"] > 0
        assert f"ratio {name} ratio:" in proc.stdout

    # the skip in this process (it runs no part; the command above was the process)
    assert load_gpu_module().main(["--small", "--per-class", "1", "--budget", "0", "--parts", "train",
                                   "--results-file", str(out)]) == 0
    skipped = json.loads(out.read_text())["parts"]
    assert list(skipped) == ["train"] and skipped["train"]["status"] == "skipped"
    assert "train: skipped" in capsys.readouterr().out


def test_gpu_command_ratios_take_every_part_that_ran():
    """The ratios: each pipeline's against its model, train.py's per method, compiled against eager; none from a
    part that failed or was skipped."""
    gpu = load_gpu_module()
    parts = {"in9-bf16": {"status": "ok", "ratio": 0.5, "cached_ratio": 0.75},
             "challenge-eval": {"status": "ok", "times_ideal": 1.5},
             "challenge-full": {"status": "timed out"},
             "train": {"status": "ok", "ratio": {"erm": {"median": 0.9, "mean": 0.8}}},
             "model-bf16-eager": {"status": "ok", "images_per_s": 100.0},
             "model-bf16-compiled": {"status": "ok", "images_per_s": 150.0}}
    assert gpu.ratios(parts) == {"in9-bf16 ratio": 0.5, "in9-bf16 cached_ratio": 0.75,
                                 "challenge-eval times_ideal": 1.5, "train erm median ratio": 0.9,
                                 "train erm mean ratio": 0.8, "model bf16 compiled / eager": 1.5}


@pytest.mark.parametrize("symlinks", [True, False])
def test_the_training_view_lists_each_generated_image_as_often_as_asked(symlinks, tmp_path, monkeypatch):
    """train.py reads the view like any training folder: every test image `copies` times under its own name, the
    bg-swap masks paired with their images and the background pool, all the generated files' bytes; where symbolic
    links cannot be made (Windows without the right), through hard links."""
    gpu = load_gpu_module()
    if not symlinks:
        def refused(self, target):
            raise OSError("symbolic link privilege not held")
        monkeypatch.setattr(Path, "symlink_to", refused)
    root = synthetic.generate(tmp_path / "in9", per_class=2, seed=0).root
    gpu.training_view(root, 3)
    erm = list_training_data(TrainConfig(root, tmp_path / "out", batch_size=4))
    swap = list_training_data(TrainConfig(root, tmp_path / "out", methods=[Method.BG_SWAP], batch_size=4))
    test = list_variation(root, "original")
    assert len(erm) == len(swap) == len(swap.backgrounds) == 3 * len(test) == 54
    assert erm.images == swap.images and erm.labels == swap.labels == [r.label for r in test for _ in range(3)]
    for image, mask in zip(swap.images, swap.masks):
        assert Path(image).stem == Path(mask).stem
        original = root / "original" / "val" / Path(image).parent.name / (Path(image).stem.rsplit("_", 1)[0] + ".JPEG")
        assert (root / image).read_bytes() == original.read_bytes()


def test_the_gpu_train_part_times_twenty_steps_of_the_default_batch(monkeypatch):
    """On a GPU the train part's run is long enough to measure (bench_train.py needs 3 logged steps; 21 here), at
    train.py's default GPU batch: the view's images over the batch bench_train.py then takes."""
    gpu = load_gpu_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = gpu.settle(gpu.build_parser().parse_args([]))
    args.data = Path("data")
    command = gpu.train_command(args, "out.json")
    assert not args.small and "--batch-size" not in command and command[command.index("--device") + 1] == "cuda"
    images = NUM_IN9_CLASSES * args.per_class * gpu.TRAIN_COPIES
    assert images // default_train_batch_size(torch.device("cuda")) >= 21


def test_each_part_runs_under_its_share_and_the_last_under_what_is_left(monkeypatch):
    """A GPU run's parts each get at most 1.5 times their share of the budget; the last (pytest -m gpu, whose length
    no session has measured) everything that is left."""
    gpu = load_gpu_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = gpu.settle(gpu.build_parser().parse_args(["--parts", "model-fp32-eager", "in9-fp32", "pytest-gpu"]))
    monkeypatch.setattr(gpu, "prepare", lambda args, tmp: None)
    monkeypatch.setattr(gpu, "environment", dict)
    timeouts = {}

    def fake_child(name, args, timeout):
        timeouts[name] = timeout
        return {"status": "ok"}

    monkeypatch.setattr(gpu, "run_child", fake_child)
    gpu.run_all(args)
    assert timeouts["model-fp32-eager"] == 1.5 * gpu.PARTS["model-fp32-eager"][0]
    assert timeouts["in9-fp32"] == 1.5 * gpu.PARTS["in9-fp32"][0]
    assert 479 < timeouts["pytest-gpu"] <= 480


def load_gpu_module():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    return gpu


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # killed, not yet reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_part_that_times_out_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """A part's own processes (challenge_eval.py, bench_train.py, pytest) stop with it at its timeout."""
    gpu = load_gpu_module()
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    monkeypatch.setattr(gpu, "child_command", lambda name, args: [sys.executable, "-c", script])
    # the whole timeout is waited out: 3 s leave ample time for two bare interpreters to start and write the pid
    assert gpu.run_child("train", None, timeout=3) == {"status": "timed out", "timeout_s": 3}
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not gone(pid):
        os.kill(pid, 9)
        pytest.fail("the part's child outlived the part")


def test_the_summary_line_is_timed_when_printed(tmp_path):
    """challenge_eval.py's end-to-end time stops at its summary line, not at its exit, even with block-buffered
    stdout and a stderr larger than a pipe holds."""
    gpu = load_gpu_module()
    script = ("import sys, time; sys.stderr.write('w' * 300_000 + chr(10)); print('Summary: done'); time.sleep(3); "
              "print('after')")
    seconds = gpu.seconds_to_line([sys.executable, "-c", script], str(tmp_path), "Summary:")
    assert seconds is not None and seconds < 2.5
    with pytest.raises(RuntimeError, match="boom"):
        gpu.seconds_to_line([sys.executable, "-c", "import sys; sys.exit('boom')"], str(tmp_path), "Summary:")


def test_the_compiled_model_parts_time_a_compiled_model(monkeypatch):
    """model-*-compiled (and challenge-eval-compile's reference speed) time the model through torch.compile, as
    --compile runs it: else `model bf16 compiled / eager` compares the eager model with itself."""
    import torch  # noqa: PLC0415
    gpu = load_gpu_module()
    args = gpu.settle(gpu.build_parser().parse_args(["--small", "--batch-size", "2", "--window", "0.01"]))
    runs = []

    def fake_compile(model, **options):  # the eager model, its calls counted
        def compiled(x):
            runs.append(x.shape[0])
            return model(x)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    gpu.model_speed(args, "fp32", compiled=False)
    assert runs == []
    gpu.model_speed(args, "fp32", compiled=True)
    assert len(runs) >= 3 and set(runs) == {2}  # the first batch, the warm one and the timed ones


def test_bench_in9_runs_its_forward_passes_with_the_cudnn_determinism_asked_for(monkeypatch, tmp_path, capsys):
    """`bench_in9.py --no-cudnn-deterministic` times fp32 with cuDNN's determinism off (RESULTS.md compares it with
    the default run for the cost of determinism): every forward pass, the model's alone and in9's, sees it off,
    although the exact mode's math sets it on around each one."""
    import torch  # noqa: PLC0415
    load_gpu_module()  # puts bench/ on the path
    import bench_in9  # noqa: PLC0415
    from tools.models.boundary import LoadedModel, PixelModel  # noqa: PLC0415
    seen = []

    class Records(torch.nn.Module):  # nine logits, and the flag each forward pass ran under
        def forward(self, x):
            seen.append(torch.backends.cudnn.deterministic)
            return x.float().mean(dim=(2, 3)).repeat(1, 3)

    monkeypatch.setattr(bench_in9, "build_model", lambda args: LoadedModel(PixelModel(Records()).eval(), 9, "records",
                                                                          None, None, None, "test", "none"))
    before = torch.backends.cudnn.deterministic
    for flag, expected in (("--no-cudnn-deterministic", False), ("--cudnn-deterministic", True)):
        seen.clear()
        args = bench_in9.build_parser().parse_args(["--device", "cpu", "--per-class", "1", "--warmup", "1",
                                                    "--iters", "1", "--repeats", "1", "--workers", "1", flag])
        assert bench_in9.main(args) == 0
        assert seen and set(seen) == {expected}, flag
    torch.backends.cudnn.deterministic = before


def test_bench_cache_times_warm_runs_with_and_without_the_pack_checks(tmp_path, capsys):
    """bench_cache.py at a tiny size: warm in9 `all` runs read every image from the cache; the checked ones hash
    every row they use (each as a new process), the unchecked ones none; and the toolkit's checks are back after."""
    load_gpu_module()  # puts bench/ on the path
    import bench_cache  # noqa: PLC0415
    from tools.data import store  # noqa: PLC0415
    checks = (store._row_checks, store.spot_check)
    out = tmp_path / "cache.json"
    args = bench_cache.build_parser().parse_args(["--device", "cpu", "--per-class", "1", "--repeats", "2",
                                                  "--workers", "1", "--trunk-width", "4", "--results-file", str(out)])
    assert bench_cache.main(args) == 0
    report = json.loads(out.read_text())
    distinct = report["distinct_images"]  # files of the same content are one row
    assert report["images"] == 72 and report["rows_hashed"] == {"checked": [distinct] * 2, "unchecked": [0, 0]}
    assert report["ratio"] > 0 and len(report["checks_s"]) == 2 and all(s > 0 for s in report["checks_s"])
    assert "checked / unchecked: " in capsys.readouterr().out
    assert (store._row_checks, store.spot_check) == checks
