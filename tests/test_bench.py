"""The benchmark scripts still start (they are run by hand, so nothing else would notice a broken import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")))
def test_bench_script_starts(script):
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_gpu_command_runs_small_on_the_cpu(tmp_path):
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
    full = report["parts"]["challenge-full"]
    assert full["composites"] == full["foregrounds"] * full["backgrounds"] == 4 * 9
    for name in parts[1:]:
        assert report["ratios"][f"{name} ratio"] > 0
        assert f"ratio {name} ratio:" in proc.stdout

    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--small", "--per-class", "1", "--budget", "0",
                           "--parts", "train", "--results-file", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = json.loads(out.read_text())["parts"]
    assert list(skipped) == ["train"] and skipped["train"]["status"] == "skipped"
    assert "train: skipped" in proc.stdout
