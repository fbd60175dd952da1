"""in9_eval end to end: the printed accuracies and the results file against a brute-force reference and
against a hand-built model whose answers follow from the data; determinism, batching and --resume."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

import in9_eval
from tests import reference
from tests.helpers import save_torchscript
from tools import __version__
from tools.data import synthetic
from tools.data.decoders import Decoder
from tools.in9 import VARIATIONS, class_folder_names, class_names, evaluate
from tools.in9.evaluate import In9Config, evaluate_variations, list_in9_files, run_in9
from tools.models.sources import load_model
from tools.runtime import Runtime

REPO = Path(__file__).resolve().parents[1]
ACCURACY_LINE = re.compile(r"^Accuracy on (\w+) is (\d+\.\d\d)%$", re.MULTILINE)
GAP_LINE = re.compile(r"^BG-gap \(mixed_same - mixed_rand\): (-?\d+\.\d\d) points$", re.MULTILINE)
STATE_FILE = "in9_state.json"


def tiny_cnn(num_classes: int, seed: int) -> nn.Module:
    """A random-weight CNN: no meaning, but predictions that differ from image to image."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(3, 16, 8, stride=8), nn.Tanh(), nn.Conv2d(16, 32, 3, stride=2), nn.Tanh(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes, bias=False)).eval()


class CornerLookupModel(nn.Module):
    """Predicts the class of the `original` image whose top-left 8x8 corner is nearest to the input's.

    The corner is background in every variation (boxes keep a 28-pixel margin) and a mixed image's
    corner is its background source's corner; JPEG codes that 8x8 block from those pixels alone, so
    the decoded corners are bit-identical. Hence: the own class on original, only_bg_b, only_bg_t,
    no_fg and mixed_same; on mixed_rand and mixed_next the class of the background's source image.
    Takes [0,1] pixels (run with --normalize none).
    """

    SIDE = 8

    def __init__(self, root: Path):
        super().__init__()
        corners, labels = [], []
        folder = Path(root) / "original" / "val"
        for label, class_dir in enumerate(sorted(p for p in folder.iterdir() if p.is_dir())):
            for path in sorted(class_dir.iterdir()):
                with Image.open(path) as img:
                    pixels = np.asarray(img.convert("RGB"))[:self.SIDE, :self.SIDE]
                corners.append(torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div(255).flatten())
                labels.append(label)
        self.register_buffer("corners", torch.stack(corners))  # (M, 3*SIDE*SIDE)
        other_class = torch.ones(len(labels), 9)
        other_class[torch.arange(len(labels)), torch.tensor(labels)] = 0
        self.register_buffer("penalty", other_class * 1e6)  # (M, 9): far away unless the stored corner's class

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        corner = x[:, :, :self.SIDE, :self.SIDE].flatten(1)
        distance = ((corner[:, None, :] - self.corners[None]) ** 2).sum(dim=2)  # (N, M)
        return -(distance[:, :, None] + self.penalty[None]).min(dim=1).values


@dataclass
class Model:
    module: nn.Module
    path: Path
    num_classes: int


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Model]:
    folder = tmp_path_factory.mktemp("eval_models")
    modules = {
        "color9": synthetic.ColorEvidenceModel(9).eval(),
        # a high score for an unmapped ImageNet class: where little colour evidence is seen, -1 wins
        "color1000": synthetic.ColorEvidenceModel(1000, unmapped_score=0.5).eval(),
        "cnn9": tiny_cnn(9, seed=0),
        "cnn1000": tiny_cnn(1000, seed=1),
    }
    out = {}
    for name, module in modules.items():
        path = folder / f"{name}.ts"
        save_torchscript(module, path)
        out[name] = Model(module, path, 1000 if name.endswith("1000") else 9)
    return out


@pytest.fixture(scope="module")
def references(models, dataset):
    """Brute-force results per model and variation, computed on first use."""
    cache: dict[str, dict[str, reference.ReferenceResult]] = {}

    def get(name: str) -> dict[str, reference.ReferenceResult]:
        if name not in cache:
            model = models[name]
            cache[name] = {v: reference.evaluate(model.module, dataset.root, v, model.num_classes)
                           for v in VARIATIONS}
        return cache[name]

    return get


pytestmark = pytest.mark.usefixtures("one_thread")


def start_script(args) -> subprocess.Popen:
    """python in9_eval.py ARGS from the repository root, as a user runs it (with one intra-op thread)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "in9_eval.py"), *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_cli(args) -> tuple[int, str, str]:
    """in9_eval's main through cli.run_main in this process: (exit code, stdout, stderr).

    Saves and restores the logging setup that run_main replaces; usable from module-scoped fixtures,
    where capsys is not.
    """
    root = logging.getLogger()
    saved = sys.stdout, sys.stderr, root.handlers[:], root.level
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        code = in9_eval.main([str(a) for a in args])
        return code, sys.stdout.getvalue(), sys.stderr.getvalue()
    finally:
        sys.stdout, sys.stderr = saved[0], saved[1]
        root.handlers[:] = saved[2]
        root.setLevel(saved[3])


def eval_args(dataset, model: Model, out_dir: Path, *extra) -> list:
    in9 = ["--in9"] if model.num_classes == 9 else []
    return ["--data-path", dataset.root, "--eval-dataset", "all", "--checkpoint", model.path, "--trust-checkpoint",
            *in9,
            "--device", "cpu", "--output-dir", out_dir, "--results-file", out_dir / "results.json",
            "--no-progress", *extra]


@dataclass
class ScriptRun:
    stdout: str
    results: dict
    state: dict
    args: list


SUBPROCESS_RUNS = ("color9", "color1000")  # the script as a user runs it; the others in this process


@pytest.fixture(scope="module")
def script_runs(models, dataset, tmp_path_factory):
    """in9_eval run once per model: the colour models as subprocesses started at once, in the background
    while tests compute their references; the others in this process on first use."""
    cache: dict[str, ScriptRun] = {}
    runs = {}
    for name in models:
        out_dir = tmp_path_factory.mktemp(f"run_{name}")
        runs[name] = out_dir, eval_args(dataset, models[name], out_dir, "--batch-size", "32")
    jobs = {name: start_script(runs[name][1]) for name in SUBPROCESS_RUNS}

    def get(name: str) -> ScriptRun:
        if name not in cache:
            out_dir, args = runs[name]
            if name in jobs:
                stdout, stderr = jobs[name].communicate(timeout=600)
                assert jobs[name].returncode == 0, stderr
                assert "Traceback" not in stderr
            else:
                code, stdout, stderr = run_cli(args)
                assert code == 0, stderr
            cache[name] = ScriptRun(stdout, json.loads((out_dir / "results.json").read_text()),
                                    json.loads((out_dir / STATE_FILE).read_text()), args)
        return cache[name]

    yield get
    for job in jobs.values():
        if job.poll() is None:
            job.kill()
            job.communicate()


def printed_accuracies(stdout: str) -> dict[str, str]:
    found = dict(ACCURACY_LINE.findall(stdout))
    assert list(found) == list(VARIATIONS), stdout
    return found


# ----------------------------------------------------------------------------------------------------------
# Against the brute-force reference

@pytest.mark.parametrize("name", ["color9", "color1000", "cnn9", "cnn1000"])
@pytest.mark.slow
def test_printed_accuracies_and_bg_gap_match_reference(name, script_runs, references):
    ref, run = references(name), script_runs(name)
    printed = printed_accuracies(run.stdout)
    for variation in VARIATIONS:
        assert printed[variation] == f"{ref[variation].accuracy:.2f}", variation
        assert run.results[variation]["correct"] == ref[variation].correct, variation
        assert run.results[variation]["total"] == ref[variation].total == 9 * 4, variation
        # per image, in the reference's sorted order: the saved predictions are the reference's
        assert run.state["done"][variation] == ref[variation].predictions, variation
    gap = 100.0 * ref["mixed_same"].correct / ref["mixed_same"].total \
        - 100.0 * ref["mixed_rand"].correct / ref["mixed_rand"].total
    assert GAP_LINE.findall(run.stdout) == [f"{gap:.2f}"]
    assert run.results["bg_gap"] == round(gap, 4)


@pytest.mark.parametrize("name", ["cnn9", "cnn1000"])
def test_random_cnn_is_not_trivial(name, references):
    """The random CNN's predictions vary, so agreeing with the reference means something."""
    predictions = [p for result in references(name).values() for p in result.predictions]
    assert len(set(predictions)) >= 4
    assert 0 < sum(r.correct for r in references(name).values()) < 8 * 36


@pytest.mark.parametrize("name", ["color1000", "cnn1000"])
def test_unmapped_predictions_count_wrong(name, script_runs, references):
    run, ref = script_runs(name), references(name)
    unmapped_total = 0
    for variation in VARIATIONS:
        predictions, labels = ref[variation].predictions, ref[variation].labels
        result = run.results[variation]
        for k, per_class in enumerate(result["per_class"].values()):
            assert per_class["unmapped"] == sum(1 for p, y in zip(predictions, labels) if y == k and p == -1)
        unmapped = predictions.count(-1)
        unmapped_total += unmapped
        # a -1 is wrong whatever the label, and in no row of the confusion matrix
        assert result["correct"] == sum(1 for p, y in zip(predictions, labels) if p == y and p != -1)
        assert sum(map(sum, result["confusion"])) == result["total"] - unmapped
    assert unmapped_total > 0
    assert any(p != -1 for result in ref.values() for p in result.predictions)


# ----------------------------------------------------------------------------------------------------------
# The results file

def test_results_json_fields(script_runs, models, dataset):
    run = script_runs("color9")
    results = run.results
    assert set(results) == {*VARIATIONS, "bg_gap", "provenance", "rechecked_fp32", "recheck_changed"}
    assert results["rechecked_fp32"] == results["recheck_changed"] == 0  # fp32: nothing to re-check
    for variation in VARIATIONS:
        result = results[variation]
        assert set(result) == {"accuracy", "correct", "total", "per_class", "confusion", "rechecked_fp32",
                               "recheck_changed"}
        assert result["accuracy"] == round(100.0 * result["correct"] / result["total"], 4)
        assert list(result["per_class"]) == list(class_names())
        confusion = np.array(result["confusion"])
        assert confusion.shape == (9, 9) and confusion.dtype.kind == "i"
        for k, per_class in enumerate(result["per_class"].values()):
            assert set(per_class) == {"correct", "total", "accuracy", "unmapped"}
            assert per_class["total"] == 4 == confusion[k].sum() + per_class["unmapped"]
            assert per_class["correct"] == confusion[k, k]
            assert per_class["accuracy"] == round(100.0 * per_class["correct"] / 4, 4)
        assert confusion.trace() == result["correct"]
    same, rand = results["mixed_same"], results["mixed_rand"]
    gap = 100.0 * same["correct"] / same["total"] - 100.0 * rand["correct"] / rand["total"]
    assert results["bg_gap"] == round(gap, 4)

    provenance = results["provenance"]
    assert provenance["toolkit_version"] == __version__
    assert provenance["torch"] == torch.__version__
    assert provenance["torchvision"] == torchvision.__version__
    assert provenance["python"] == platform.python_version()
    assert provenance["device"] == "cpu"
    assert provenance["precision"] == "fp32"
    assert provenance["checkpoint"] == str(models["color9"].path)
    assert provenance["model_record"]["files"]["checkpoint"]["sha256"] == \
        hashlib.sha256(models["color9"].path.read_bytes()).hexdigest()
    assert provenance["num_classes"] == 9
    assert provenance["checkpoint_format"] == "TorchScript"
    assert provenance["normalization"].startswith("in9")
    # the data fingerprint: every image read, by content: a SHA-256 over sorted (relative path, file SHA-256)
    root = dataset.root
    relpaths = sorted(str(p.relative_to(root)) for v in VARIATIONS for p in (root / v).rglob("*.JPEG"))
    lines = "".join(f"{rel}\t{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n" for rel in relpaths)
    data = provenance["data"]
    assert data["files"] == 8 * 36 and data["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert data["bytes"] == sum(os.path.getsize(root / rel) for rel in relpaths) and "content" in data["method"]


def test_two_runs_give_identical_results(script_runs, tmp_path):
    first = script_runs("color9")
    args = list(first.args)
    out_dir = tmp_path / "again"
    args[args.index("--output-dir") + 1] = out_dir
    args[args.index("--results-file") + 1] = out_dir / "results.json"
    code, out, err = run_cli(args)
    assert code == 0, err
    assert json.loads((out_dir / "results.json").read_text()) == first.results
    assert out == first.stdout


# ----------------------------------------------------------------------------------------------------------
# Batching

@pytest.mark.parametrize("batch_size,workers,channels_last", [(5, 1, False), (7, 2, True), (64, 2, False),
                                                              (1000, 1, False)])
@pytest.mark.slow
def test_batch_sizes_give_the_same_predictions(batch_size, workers, channels_last, models, dataset, references):
    """Batches that straddle variations, end part-full, or hold everything: the same predictions."""
    loaded = load_model(trust=True, checkpoint=models["cnn9"].path)
    runtime = Runtime(torch.device("cpu"), channels_last=channels_last)
    results, _ = evaluate_variations(loaded, runtime, list_in9_files(dataset.root, VARIATIONS, workers), batch_size,
                                     workers, progress=False)
    for variation in VARIATIONS:
        assert results[variation].predictions.tolist() == references("cnn9")[variation].predictions, variation


@pytest.mark.parametrize("decoder", list(Decoder))
@pytest.mark.slow
def test_either_decoder_gives_the_references_results(decoder, models, dataset, references):
    """In fp32, torchvision's decoder and Pillow's give the brute-force (Pillow) reference's predictions, and the
    run names its decoder in the provenance."""
    files = list_in9_files(dataset.root, VARIATIONS, 2)
    files.image_set.decoder = decoder
    loaded = load_model(trust=True, checkpoint=models["cnn1000"].path)
    run = run_in9(loaded, Runtime(torch.device("cpu")), files, In9Config(batch_size=11, workers=2, progress=False))
    for variation in VARIATIONS:
        assert run.results[variation].predictions.tolist() == references("cnn1000")[variation].predictions
    assert run.provenance["decoder"]["used"] == decoder.value


@pytest.mark.slow
def test_torch_export_program_gives_the_same_predictions(models, dataset, references, tmp_path):
    """A .pt2 with a dynamic batch dimension runs full and partial batches like the module it came from."""
    path = tmp_path / "cnn9.pt2"
    program = torch.export.export(models["cnn9"].module, (torch.zeros(2, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, path)
    loaded = load_model(trust=True, checkpoint=path)
    results, _ = evaluate_variations(loaded, Runtime(torch.device("cpu")), list_in9_files(dataset.root, VARIATIONS, 2),
                                     7, 2, progress=False)
    for variation in VARIATIONS:
        assert results[variation].predictions.tolist() == references("cnn9")[variation].predictions, variation


# ----------------------------------------------------------------------------------------------------------
# --resume

@pytest.mark.slow
def test_resume_uses_saved_variations(script_runs, tmp_path):
    first = script_runs("color9")
    out_dir = tmp_path / "resume"
    out_dir.mkdir()
    args = list(first.args)
    args[args.index("--output-dir") + 1] = out_dir
    args[args.index("--results-file") + 1] = out_dir / "results.json"
    # A state that says original and only_fg are done, with made-up predictions for original (all dog):
    # a resumed run must take them as they are and evaluate only the rest.
    fake = [0] * 36
    state = {"key": first.state["key"], "done": {"original": fake, "only_fg": first.state["done"]["only_fg"]}}
    (out_dir / STATE_FILE).write_text(json.dumps(state))

    code, out, err = run_cli([*args, "--resume"])
    assert code == 0, err
    printed, expected = printed_accuracies(out), printed_accuracies(first.stdout)
    assert printed["original"] == f"{100 * 4 / 36:.2f}" != expected["original"]
    assert {v: a for v, a in printed.items() if v != "original"} == \
        {v: a for v, a in expected.items() if v != "original"}
    saved = json.loads((out_dir / STATE_FILE).read_text())
    assert list(saved["done"]) == list(VARIATIONS)
    assert saved["done"]["original"] == fake
    assert {v: p for v, p in saved["done"].items() if v != "original"} == \
        {v: p for v, p in first.state["done"].items() if v != "original"}

    # without --resume the state is not read: everything is evaluated afresh
    code, out, err = run_cli(args)
    assert code == 0, err
    assert printed_accuracies(out) == expected


def test_resume_refuses_a_state_from_another_model(script_runs, models, dataset, tmp_path):
    out_dir = tmp_path / "other"
    out_dir.mkdir()
    (out_dir / STATE_FILE).write_text(json.dumps(script_runs("color9").state))
    args = eval_args(dataset, models["cnn9"], out_dir, "--resume", "--log-level", "WARNING")
    code, out, err = run_cli(args)
    assert code == 2
    assert err.splitlines() == [f"error: {out_dir / STATE_FILE} was written for another model, data or setting (it "
                                f"differs in batch_size, model_identity); rerun without --resume or use another "
                                f"--output-dir"]
    assert out == ""


def test_resume_refuses_a_state_saved_at_another_batch_size(script_runs, tmp_path):
    """Predictions made at another batch shape may differ in the last bits: that state is another setting's."""
    first = script_runs("color9")
    out_dir = tmp_path / "other-size"
    out_dir.mkdir()
    (out_dir / STATE_FILE).write_text(json.dumps(first.state))
    args = [str(a) for a in first.args]
    args[args.index("--output-dir") + 1] = str(out_dir)
    args[args.index("--results-file") + 1] = str(out_dir / "results.json")
    args[args.index("--batch-size") + 1] = "16"
    code, out, err = run_cli([*args, "--resume", "--log-level", "WARNING"])
    assert code == 2
    assert err.splitlines() == [f"error: {out_dir / STATE_FILE} was written for another model, data or setting (it "
                                f"differs in batch_size); rerun without --resume or use another --output-dir"]


# ----------------------------------------------------------------------------------------------------------
# A hand-built model whose answers are known in advance

def test_corner_model_answers_follow_from_the_manifest(dataset, tmp_path):
    path = tmp_path / "corner.ts"
    save_torchscript(CornerLookupModel(dataset.root), path)
    out_dir = tmp_path / "out"
    args = ["--data-path", dataset.root, "--eval-dataset", "all", "--checkpoint", path, "--trust-checkpoint", "--in9",
            "--normalize", "none", "--device", "cpu", "--output-dir", out_dir, "--results-file",
            out_dir / "results.json", "--batch-size", "16", "--no-progress"]
    code, out, err = run_cli(args)
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    correct = {v: results[v]["correct"] for v in VARIATIONS}

    manifest = json.loads((dataset.root / synthetic.MANIFEST_NAME).read_text())
    images = manifest["images"]
    assert len(images) == 36

    def background_is_own_class(variation: str) -> int:
        return sum(1 for img in images if img["mixed_bg"][variation][1] == img["label"])

    for variation in ("original", "only_bg_b", "only_bg_t", "no_fg", "mixed_same"):
        assert correct[variation] == 36, variation
    assert correct["mixed_rand"] == background_is_own_class("mixed_rand")
    assert 0 < correct["mixed_rand"] < 36  # the manifest has both kinds, so this says something
    assert correct["mixed_next"] == background_is_own_class("mixed_next") == 0
    # per image: a mixed image is predicted as the class of its background's source
    folders = class_folder_names()
    state = json.loads((out_dir / STATE_FILE).read_text())["done"]
    order = sorted(images, key=lambda img: (folders[img["label"]], img["stem"]))
    for variation in ("mixed_rand", "mixed_next", "mixed_same"):
        assert state[variation] == [img["mixed_bg"][variation][1] for img in order], variation


@pytest.mark.parametrize("batch_size", [1, 4, 5, 16, 64])
def test_kept_variations_are_batched_without_a_copy_of_them_all(batch_size, monkeypatch):
    """The variations kept in memory (views of one decoded tensor) come in the batches of their concatenation,
    but only a batch that straddles two of them is copied: never a tensor of them all (4.9 GB on the release)."""
    whole = torch.randint(0, 256, (30, 3, 4, 4), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    groups = [whole[0:7], whole[7:12], whole[12:12], whole[12:13], whole[13:30]]
    made = []
    real_cat = torch.cat

    def recording_cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        made.append(out.shape[0])
        return out

    monkeypatch.setattr(torch, "cat", recording_cat)
    batches = list(evaluate._batches_in_memory(groups, batch_size))
    assert [start for start, _ in batches] == list(range(0, 30, batch_size))
    for start, batch in batches:
        assert torch.equal(batch, whole[start:start + batch_size])
        assert batch.is_contiguous(memory_format=torch.channels_last)
    assert all(rows <= batch_size for rows in made), made
    inside = [b for s, b in batches if any(lo <= s and s + b.shape[0] <= hi for lo, hi in [(0, 7), (7, 12), (13, 30)])]
    assert all(b.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for b in inside)


def test_a_run_evaluates_the_variations_its_config_names_of_those_listed(dataset, color_ts, one_thread):
    """Listed once for every variation, a run of In9Config(("mixed_rand", "original")) evaluates those two, in that
    order, with the predictions a listing of them alone gives; a variation that was not listed is refused."""
    loaded = load_model(checkpoint=color_ts[9], trust=True)
    cpu = Runtime(torch.device("cpu"))
    names = ("mixed_rand", "original")
    config = In9Config(names, 16, workers=1, progress=False)
    run = run_in9(loaded, cpu, list_in9_files(dataset.root, VARIATIONS, 1), config)
    alone = run_in9(loaded, cpu, list_in9_files(dataset.root, names, 1), config)
    assert list(run.results) == list(names)
    assert {n: r.predictions.tolist() for n, r in run.results.items()} == \
        {n: r.predictions.tolist() for n, r in alone.results.items()}
    with pytest.raises(ValueError, match="only_fg"):
        run_in9(loaded, cpu, list_in9_files(dataset.root, names, 1), In9Config(("only_fg",), 16, 1, False))
