"""torchrun: two processes on the gloo backend write exactly what one process writes, for both scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import save_torchscript
from tests.test_challenge import TinyCNN
from tools import synthetic

REPO = Path(__file__).resolve().parents[1]
TIMING = ("wall_time_s", "composites_per_s", "composites_evaluated")  # cost, not results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    data = synthetic.generate(root / "bg", per_class=3, seed=5).root
    models = {}
    for name, module in (("cnn", TinyCNN(9, seed=3)), ("color", synthetic.ColorEvidenceModel(9))):
        models[name] = root / f"{name}.ts"
        save_torchscript(module, models[name])
    return data, models


def run(script: str, out: Path, processes: int, *args) -> str:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    command = [*(launcher if processes > 1 else [sys.executable]), str(REPO / script), "--device", "cpu",
               "--no-progress", "--log-level", "WARNING", "--output-dir", str(out), "--results-file",
               str(out / "results.json"), *map(str, args)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def results(out: Path) -> dict:
    payload = json.loads((out / "results.json").read_text())
    return {k: v for k, v in payload.items() if k not in TIMING}


@pytest.mark.parametrize("model,full", [("color", False), ("cnn", True)])  # robust and vulnerable; every pair
def test_challenge_two_processes_equal_one(model, full, setup, tmp_path):
    data, models = setup
    args = ["--data-path", data, "--checkpoint", models[model], "--no-cache", "--batch-size", 5]
    if full:
        args += ["--full", "--analysis"]
    outputs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        stdout = run("challenge_eval.py", out, n, *args, "--per-foreground-csv", out / "fg.csv")
        outputs[n] = (stdout, results(out), (out / "fg.csv").read_text())
    assert outputs[1] == outputs[2]
    assert outputs[1][0].startswith("Summary: ")
    if full:
        one, two = tmp_path / "n1", tmp_path / "n2"
        assert np.array_equal(np.load(one / "predictions.npy"), np.load(two / "predictions.npy"))
        for name in ("foregrounds.csv", "backgrounds.csv", "asr.csv", "top_backgrounds.csv"):
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
        summaries = [json.loads((out / "analysis.json").read_text()) for out in (one, two)]
        assert [{k: v for k, v in a.items() if k != "output_dir"} for a in summaries][0] == \
               {k: v for k, v in summaries[1].items() if k != "output_dir"}


def test_in9_two_processes_equal_one(setup, tmp_path):
    data, models = setup
    args = ["--data-path", data, "--checkpoint", models["cnn"], "--eval-dataset", "all", "--categories",
            "--batch-size", 5]
    one = run("in9_eval.py", tmp_path / "n1", 1, *args)
    two = run("in9_eval.py", tmp_path / "n2", 2, *args)
    assert one == two and one.startswith("Accuracy on original is ")
    assert results(tmp_path / "n1") == results(tmp_path / "n2")


def test_zoo_two_processes_equal_one(setup, tmp_path):
    data, models = setup
    outputs = []
    for n in (1, 2):
        out = tmp_path / f"zoo{n}"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        command = [*(launcher if n > 1 else [sys.executable]), "-m", "tools.zoo", "--models",
                   f"file:{models['color']}", "--data-path", str(data), "--device", "cpu", "--no-progress",
                   "--no-cache", "--batch-size", "5", "--output-dir", str(out), "--log-level", "WARNING"]
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        (path,) = (out / "models").glob("*.json")
        payload = json.loads(path.read_text())
        payload["challenge"] = {k: v for k, v in payload["challenge"].items() if k not in TIMING}
        outputs.append(payload)
    assert outputs[0] == outputs[1]
