"""torchrun: two processes on the gloo backend write exactly what one process writes, for both scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_in_process, save_torchscript
from tests.test_challenge import TinyCNN
from tools import synthetic, zoo

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


def test_zoo_failure_in_one_process_fails_the_model_in_every_process(setup, tmp_path, capsys):
    """A model failing on one rank only, in each phase in turn (tests/zoo_failures.py): no process is left waiting
    in a collective, each is reported failed, a model done before is skipped by both, and the model after them
    gets the numbers of the one done before (the same weights, run by one process)."""
    data, models = setup
    words = ["fail-load", "fail-in9", "done-before", "fail-decode", "fail-search", "fail-save", "fail-write", "works"]
    specs = {}
    for word in words:
        shutil.copyfile(models["color"], tmp_path / f"color-{word}.ts")
        specs[word] = f"file:{tmp_path / f'color-{word}.ts'}"
    common = ["--data-path", str(data), "--device", "cpu", "--no-progress", "--no-cache", "--batch-size", "5",
              "--log-level", "WARNING", "--no-leaderboard", "--output-dir", str(tmp_path / "zoo")]
    code, _, err = run_in_process(zoo.main, [*common, "--models", specs["done-before"]], capsys)
    assert code == 0, err
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*launcher, "-m", "tests.zoo_failures", "--models", ",".join(specs.values()), *common],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0, proc.stderr[-3000:]
    failing = [word for word in words if word.startswith("fail-")]
    lines = proc.stdout.splitlines()
    assert [line.split(": ")[1] for line in lines[:len(words)]] == \
        ["failed" if word in failing else "skipped" if word == "done-before" else "done" for word in words], \
        proc.stdout + proc.stderr[-3000:]
    assert lines[len(words)] == f"2 of 8 models done; failed: {', '.join(specs[word] for word in failing)}"
    for word in failing:  # the other process says which one failed
        assert f"ERROR: {specs[word]}: process {0 if word in ('fail-save', 'fail-write') else 1} of 2 failed" \
            in proc.stderr, proc.stderr[-3000:]
    written = {json.loads(path.read_text())["model"]: json.loads(path.read_text())
               for path in (tmp_path / "zoo" / "models").glob("*.json")}
    assert sorted(written) == sorted([specs["done-before"], specs["works"]])
    one, two = written[specs["done-before"]], written[specs["works"]]
    for run in ("in9", "challenge"):
        assert copy_independent(two[run]) == copy_independent(one[run])


def copy_independent(run: dict) -> dict:
    """A run's results less what differs between two copies of one checkpoint: the timing and the file's path."""
    kept = {k: v for k, v in run.items() if k not in TIMING}
    kept["provenance"] = {k: v for k, v in run["provenance"].items() if k != "checkpoint"}
    return kept
