"""python -m tools.zoo on generated data with three models (a TorchScript checkpoint of the hand-built colour
model, a plain state dict named by its architecture, a random tiny CLIP) and two that fail: each results
file equals what in9_eval.py and challenge_eval.py compute for the same model; the leaderboard's rows,
order and plot; skipping finished models; resuming a model's runs; one failure not stopping the others."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image

import challenge_eval
import in9_eval
from tests.helpers import TinyCNN, run_in_process, save_torchscript
from tools import challenge, zoo
from tools.data import image_sets, synthetic
from tools.data.hashing import sha256_file
from tools.errors import UserError
from tools.in9 import VARIATIONS, evaluate
from tools.models.device_check import CHECK_IMAGES
from tools.results.leaderboard import (
    CSV_FILE,
    MARKDOWN_FILE,
    MEASURED,
    MODELS_FOLDER,
    PLOT_FILE,
    PLOT_SIZE,
    PUBLISHED,
    build_leaderboard,
    leaderboard_rows,
    nice_ticks,
    published_rows,
    render_markdown,
)

TIMING_KEYS = {"wall_time_s", "composites_per_s"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("zoodata") / "bg_challenge", per_class=2, seed=5).root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoomodels")
    save_torchscript(synthetic.ColorEvidenceModel(9), folder / "color.ts")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.save(torchvision.models.mobilenet_v3_small(num_classes=9).state_dict(), folder / "mobilenet.pt")
    return folder


@pytest.fixture(scope="module")
def specs(checkpoints, tiny_clip):
    """(spec, script arguments for the same model) for the models that work."""
    return {f"file:{checkpoints / 'color.ts'}": ["--checkpoint", str(checkpoints / "color.ts"), "--trust-checkpoint"],
            f"mobilenet_v3_small@file:{checkpoints / 'mobilenet.pt'}":
                ["--arch", "mobilenet_v3_small", "--checkpoint", str(checkpoints / "mobilenet.pt")],
            tiny_clip: ["--arch", tiny_clip]}


@pytest.fixture(scope="module")
def failing(checkpoints):
    """Specs that fail: a missing file, and a plain state dict that does not say its architecture."""
    return [f"file:{checkpoints / 'missing.pt'}", f"file:{checkpoints / 'mobilenet.pt'}"]


def run_zoo_cli(argv, capsys):
    return run_in_process(zoo.main, argv, capsys)


def zoo_args(data, output, models):
    return ["--data-path", str(data), "--models", ",".join(models), "--output-dir", str(output), "--device", "cpu",
            "--no-progress", "--no-cache", "--trust-checkpoint"]


@pytest.fixture(scope="module")
def first_run(data, specs, failing, tmp_path_factory):
    """The zoo on the failing and working models, run once: (output folder, exit code, stdout, stderr)."""
    output = tmp_path_factory.mktemp("zoo")
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = zoo.main(zoo_args(data, output, [failing[0], *specs, failing[1]]))
    finally:
        torch.set_num_threads(threads)
        root.handlers[:] = handlers
        root.setLevel(level)
    return output, code, out.getvalue(), err.getvalue()


def results_file(output: Path, spec: str) -> Path:
    return zoo.results_path(output, zoo.parse_model_spec(spec))


@pytest.mark.slow
def test_failing_models_do_not_stop_the_others(first_run, specs, failing):
    output, code, out, err = first_run
    assert code == zoo.EXIT_SOME_FAILED
    for spec in specs:
        assert results_file(output, spec).is_file()
        assert f"{spec}: done: original " in out
    for spec in failing:
        assert not results_file(output, spec).exists()
        assert f"{spec}: failed" in out
    assert f"3 of 5 models done; failed: {', '.join(failing)}" in out
    errors = [line for line in err.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 2 and "Traceback" not in err
    assert "missing.pt does not exist" in errors[0]
    assert "does not record its architecture" in errors[1] and "NAME@file:PATH" in errors[1]  # resnet50 was tried


@pytest.mark.slow
def test_results_equal_the_scripts(first_run, specs, data, tmp_path, capsys, one_thread):
    output = first_run[0]
    common = ["--data-path", str(data), "--device", "cpu", "--no-progress", "--no-cache"]  # as zoo_args
    for i, (spec, model_args) in enumerate(specs.items()):
        payload = json.loads(results_file(output, spec).read_text())
        in9_file, challenge_file = tmp_path / f"in9-{i}.json", tmp_path / f"challenge-{i}.json"
        code, _, err = run_in_process(in9_eval.main,
                                      [*common, *model_args, "--eval-dataset", "all", "--results-file", str(in9_file),
                                       "--output-dir", str(tmp_path / f"in9-{i}")], capsys)
        assert code == 0, err
        code, _, err = run_in_process(challenge_eval.main,
                                      [*common, *model_args, "--results-file", str(challenge_file),
                                       "--output-dir", str(tmp_path / f"challenge-{i}")], capsys)
        assert code == 0, err
        assert payload["in9"] == json.loads(in9_file.read_text())
        script = json.loads(challenge_file.read_text())
        # one device check a model, on the in9 run's first images (the challenge script's: on backgrounds)
        assert payload["challenge"]["provenance"].pop("device_check") == payload["in9"]["provenance"]["device_check"]
        del script["provenance"]["device_check"]
        assert {k: v for k, v in payload["challenge"].items() if k not in TIMING_KEYS} == \
            {k: v for k, v in script.items() if k not in TIMING_KEYS}
        assert payload["model"] == spec


@pytest.fixture(scope="module")
def release_run(first_run, tmp_path_factory):
    """The first run's results files as if measured on the release (450 images of every class in every
    variation), the leaderboard rebuilt from them: now with the published rows."""
    output = tmp_path_factory.mktemp("release")
    shutil.copytree(first_run[0] / MODELS_FOLDER, output / MODELS_FOLDER)
    for path in (output / MODELS_FOLDER).glob("*.json"):
        payload = json.loads(path.read_text())
        for name in VARIATIONS:
            for entry in payload["in9"][name]["per_class"].values():
                entry["total"] = 450
        path.write_text(json.dumps(payload))
    build_leaderboard(output)
    return output


def test_published_rows_only_beside_runs_on_the_release(first_run, release_run):
    """The zoo's data has 2 images a class: the published rows stay out, and the page says why."""
    for output, published in [(first_run[0], False), (release_run, True)]:
        with open(output / CSV_FILE, newline="") as fh:
            kinds = [r["kind"] for r in csv.DictReader(fh)]
        markdown = (output / MARKDOWN_FILE).read_text()
        assert (PUBLISHED in kinds) == published == ("| ResNet-50 |" in markdown)
        assert ("The published rows are left out" in markdown) != published
    assert "The published rows are left out" not in render_markdown(measured_rows(first_run[0]))


def measured_rows(output: Path) -> list:
    return leaderboard_rows(output, include_published=False)[0]


def test_leaderboard_rows_and_order(first_run, release_run, specs):
    output = release_run
    with open(output / CSV_FILE, newline="") as fh:
        rows = list(csv.DictReader(fh))
    measured = [r for r in rows if r["kind"] == MEASURED]
    published = [r for r in rows if r["kind"] == PUBLISHED]
    assert sorted(r["model"] for r in measured) == sorted(specs)
    assert len(published) == len(published_rows()) == 7
    assert {r["model"] for r in published} >= {"ResNet-50", "ResNet-152", "VGG16-BN", "ResNet-50 (IN-9L)",
                                                  "ResNet-50 (Mixed-Rand)", "ViT-L/16", "BiT-M R101x3"}
    resnet50 = next(r for r in published if r["model"] == "ResNet-50")
    assert (resnet50["original"], resnet50["bg_gap"], resnet50["challenge_accuracy"]) == ("95.6", "7.3", "22.3")
    assert not resnet50["provenance_sha256"] and resnet50["reference"]
    for row in measured:
        payload = json.loads(results_file(first_run[0], row["model"]).read_text())
        assert float(row["original"]) == payload["in9"]["original"]["accuracy"]
        assert float(row["mixed_same"]) == payload["in9"]["mixed_same"]["accuracy"]
        assert float(row["mixed_rand"]) == payload["in9"]["mixed_rand"]["accuracy"]
        assert float(row["bg_gap"]) == payload["in9"]["bg_gap"]
        assert float(row["challenge_accuracy"]) == payload["challenge"]["challenge_accuracy"]
        assert len(row["provenance_sha256"]) == 12 and row["data_sha256"]
    # sorted by challenge accuracy, best first; the rows without one last
    values = [float(r["challenge_accuracy"]) if r["challenge_accuracy"] else None for r in rows]
    numbers = [v for v in values if v is not None]
    assert numbers == sorted(numbers, reverse=True)
    assert values[len(numbers):] == [None] * (len(values) - len(numbers)) and len(numbers) < len(values)
    markdown = (output / MARKDOWN_FILE).read_text()
    positions = [markdown.index(f"| {r['model']} |") for r in rows]
    assert positions == sorted(positions)
    assert f"![BG-gap against challenge accuracy]({PLOT_FILE})" in markdown


def test_leaderboard_rows_name_what_they_rank(release_run, specs, checkpoints):
    """Each measured row: its source, weights tag and the short hash of its weights file (or, without one, of the
    weights themselves); each published row what it names: the README's ResNet-50 torchvision's IMAGENET1K_V1,
    Paul & Chen's rows their hand-changed mean/std."""
    output = release_run
    with open(output / CSV_FILE, newline="") as fh:
        rows = {r["model"]: r for r in csv.DictReader(fh)}
    color, mobilenet, clip = specs
    assert (rows[color]["source"], rows[color]["weights"]) == ("file", "color.ts")
    assert rows[color]["weights_sha256"] == sha256_file(checkpoints / "color.ts")[:12]
    assert rows[mobilenet]["weights_sha256"] == sha256_file(checkpoints / "mobilenet.pt")[:12]
    clip_payload = json.loads(results_file(output, clip).read_text())
    assert (rows[clip]["source"], rows[clip]["weights"]) == ("clip", "none")
    assert rows[clip]["weights_sha256"] == clip_payload["identity"]["model"][:12]  # no file: the model's
    resnet50 = rows["ResNet-50"]
    assert (resnet50["source"], resnet50["weights"], resnet50["weights_sha256"]) == \
        ("torchvision", "IMAGENET1K_V1", "19c8e357")  # the hash prefix torch names resnet50-19c8e357.pth by
    for model in ("ViT-L/16", "BiT-M R101x3"):
        assert "mean and std changed to 0.5 by hand" in rows[model]["note"]
    assert not rows["ResNet-152"]["weights_sha256"] and not rows["ResNet-152"]["note"]
    markdown = (output / MARKDOWN_FILE).read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| # |"))
    assert "| Source | Weights | Weights SHA-256 |" in header
    assert f"| {color} | file | color.ts | `{rows[color]['weights_sha256']}` |" in markdown
    assert "| ResNet-50 | torchvision | IMAGENET1K_V1 | `19c8e357` |" in markdown
    vit = next(line for line in markdown.splitlines() if line.startswith("| ") and "| ViT-L/16 |" in line)
    assert "| published ¹ |" in vit and "¹ ViT-L/16, BiT-M R101x3: mean and std changed to 0.5 by hand" in markdown


def test_plot_is_a_png_of_the_stated_size(first_run):
    with Image.open(first_run[0] / PLOT_FILE) as image:
        assert image.format == "PNG" and image.size == PLOT_SIZE
        image.load()


@pytest.mark.slow
def test_second_run_does_no_work(first_run, data, specs, capsys, monkeypatch):
    output = first_run[0]
    mtimes = {spec: results_file(output, spec).stat().st_mtime_ns for spec in specs}
    calls = []
    monkeypatch.setattr(zoo, "evaluate_model", lambda *a, **k: calls.append(a) or {})
    code, out, err = run_zoo_cli(zoo_args(data, output, list(specs)), capsys)
    assert code == 0, err
    assert calls == []
    assert all(f"{spec}: skipped: original " in out for spec in specs)
    assert {spec: results_file(output, spec).stat().st_mtime_ns for spec in specs} == mtimes


@pytest.mark.slow
def test_a_models_runs_resume_from_their_state(first_run, data, specs, tmp_path, capsys, monkeypatch):
    """With the results file gone but the run state kept, the model is rebuilt from its state: no forward passes."""
    output = tmp_path / "copy"
    shutil.copytree(first_run[0], output)
    spec = next(iter(specs))
    path = results_file(output, spec)
    before = json.loads(path.read_text())
    path.unlink()

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass despite the saved state")

    monkeypatch.setattr(evaluate, "Forward", no_forward)
    monkeypatch.setattr(challenge.CompositePredictor, "predict_pairs", no_forward)
    monkeypatch.setattr(challenge.CompositePredictor, "predict_backgrounds", no_forward)
    code, out, err = run_zoo_cli(zoo_args(data, output, [spec]), capsys)
    assert code == 0, err
    after = json.loads(path.read_text())
    assert after["in9"] == before["in9"]
    assert after["challenge"]["vulnerable"] == before["challenge"]["vulnerable"]
    assert after["challenge"]["composites_evaluated"] == before["challenge"]["composites_evaluated"]


@pytest.mark.slow
def test_other_settings_are_refused_per_model(first_run, data, specs, capsys):
    code, out, err = run_zoo_cli([*zoo_args(data, first_run[0], list(specs)), "--criterion", "bg-class",
                                  "--no-leaderboard"], capsys)
    assert code == zoo.EXIT_SOME_FAILED
    assert err.count("was made with other settings") == len(specs)


@pytest.mark.slow
def test_another_batch_size_is_refused_per_model(first_run, data, specs, capsys):
    """Another batch shape may change the last bits: a result made at the CPU's default size is not "done" at 8."""
    code, out, err = run_zoo_cli([*zoo_args(data, first_run[0], list(specs)), "--batch-size", "8",
                                  "--no-leaderboard"], capsys)
    assert code == zoo.EXIT_SOME_FAILED
    assert err.count("was made with other settings") == len(specs)


def test_leaderboard_only_rebuilds_the_files(first_run, tmp_path, capsys):
    output = tmp_path / "copy"
    shutil.copytree(first_run[0], output, ignore=shutil.ignore_patterns("leaderboard.*", "runs"))
    code, out, err = run_zoo_cli(["--leaderboard-only", str(output)], capsys)
    assert code == 0, err
    assert (output / CSV_FILE).read_text() == (first_run[0] / CSV_FILE).read_text()
    assert (output / MARKDOWN_FILE).read_text() == (first_run[0] / MARKDOWN_FILE).read_text()
    code, out, err = run_zoo_cli(["--leaderboard-only", str(tmp_path / "nothing")], capsys)
    assert code == 2 and err.startswith("error: ") and "no zoo results" in err


@pytest.mark.parametrize("text, source, arch, path", [
    ("resnet50", "torchvision", "resnet50", None),
    ("timm:convnext_tiny", "timm", "timm:convnext_tiny", None),
    ("clip:ViT-B-32/openai", "clip", "clip:ViT-B-32/openai", None),
    ("file:my.pt", "file", None, Path("my.pt")),
    ("resnet18@file:dir/sd.pt", "file", "resnet18", Path("dir/sd.pt")),
    ("timm:vit_tiny_patch16_224@file:a@b.pt", "file", "timm:vit_tiny_patch16_224", Path("a@b.pt")),
])
def test_model_specs(text, source, arch, path):
    spec = zoo.parse_model_spec(text)
    assert (spec.source, spec.arch, spec.path) == (source, arch, path)


def test_bad_model_lists(tmp_path, data, capsys):
    with pytest.raises(UserError, match="ARCH@ must be followed by file:PATH"):
        zoo.parse_model_spec("resnet18@sd.pt")
    with pytest.raises(UserError, match="listed twice: resnet50"):
        zoo.parse_model_specs(["resnet50", "vgg16", "resnet50"])
    listing = tmp_path / "models.txt"
    listing.write_text("# a zoo\nresnet50  # the paper's\n\n   \nfile:my.pt\n")
    assert zoo.read_models_file(listing) == ["resnet50", "file:my.pt"]
    code, out, err = run_zoo_cli(["--data-path", str(data), "--output-dir", str(tmp_path / "z")], capsys)
    assert code == 2 and err.strip() == "error: no models: pass --models or --models-file"


def test_slugs_are_distinct_file_names():
    a, b = zoo.parse_model_spec("file:a/b.pt"), zoo.parse_model_spec("file:a_b.pt")
    assert a.slug != b.slug and "/" not in a.slug


def test_nice_ticks_cover_the_range():
    assert nice_ticks(0, 22.3) == [0, 5, 10, 15, 20, 25]
    ticks = nice_ticks(-7.4, 48.1)
    assert ticks[0] <= -7.4 and ticks[-1] >= 48.1


# ----------------------------------------------------------------------------------------------------------
# A result's identity: the data's content, the model's weights and the settings, never their paths

def small_zoo(data, output, spec, capsys, *extra):
    """One model through the zoo on a small data folder, without the leaderboard: (exit code, stdout, stderr)."""
    return run_zoo_cli([*zoo_args(data, output, [spec]), "--no-leaderboard", "--batch-size", "8", *extra], capsys)


@pytest.fixture
def small(tmp_path, checkpoints):
    """A data folder of nine images and a copy of the colour model's TorchScript file, both private to the test."""
    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=1).root
    model = tmp_path / "model.ts"
    shutil.copyfile(checkpoints / "color.ts", model)
    return data, model


@pytest.mark.slow
def test_data_rewritten_in_place_is_recomputed(small, tmp_path, capsys, one_thread):
    data, model = small
    spec, output = f"file:{model}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    old = json.loads(results_file(output, spec).read_text())
    synthetic.generate(data, per_class=1, seed=2)  # the same file names, other pixels
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0, err
    assert f"{spec}: done: " in out
    new = json.loads(results_file(output, spec).read_text())
    fingerprint = evaluate.list_in9_files(data, list(VARIATIONS)).image_set.fingerprint
    assert new["in9"]["provenance"]["data"] == fingerprint != old["in9"]["provenance"]["data"]
    assert new["identity"]["data_sha256"]["in9"] == fingerprint["sha256"]


@pytest.mark.slow
def test_checkpoint_overwritten_in_place_is_recomputed(small, tmp_path, capsys, one_thread):
    data, model = small
    spec, output = f"file:{model}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    old = json.loads(results_file(output, spec).read_text())
    save_torchscript(synthetic.ColorEvidenceModel(9, fg_weight=0.5, bg_weight=4.0), model)  # same path, other weights
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0, err
    assert f"{spec}: done: " in out
    new = json.loads(results_file(output, spec).read_text())
    checkpoint = new["in9"]["provenance"]["model_record"]["files"]["checkpoint"]
    assert checkpoint["sha256"] == sha256_file(model) != old["in9"]["provenance"]["model_record"]["files"][
        "checkpoint"]["sha256"]
    assert new["identity"]["model"] == new["in9"]["provenance"]["identity"] != old["identity"]["model"]


@pytest.mark.slow
def test_same_content_under_another_path_is_reused(small, tmp_path, capsys, monkeypatch, one_thread):
    data, model = small
    spec, output = f"file:{model}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    moved = tmp_path / "elsewhere" / "bg"
    shutil.copytree(data, moved)
    calls = []
    monkeypatch.setattr(zoo, "evaluate_model", lambda *a, **k: calls.append(a) or {})
    code, out, err = small_zoo(moved, output, spec, capsys)
    assert code == 0, err
    assert calls == [] and f"{spec}: skipped: " in out


@pytest.mark.slow
def test_a_done_model_whose_files_are_unchanged_is_skipped_without_building_it(small, tmp_path, capsys, monkeypatch,
                                                                             one_thread):
    """The results file's record names every input of the model's loader: when each of its files hashes as
    recorded (and each library has its version), the model is skipped unbuilt; when one does not, it runs again."""
    data, model = small
    spec, output = f"file:{model}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    built = []
    monkeypatch.setattr(zoo, "load_model", lambda *a, **k: built.append(a) or pytest.fail("the model was built"))
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0 and f"{spec}: skipped: " in out and built == [], err
    payload = json.loads(results_file(output, spec).read_text())
    assert zoo.recorded_model_unchanged(payload) is True
    from tools.models import record as records  # noqa: PLC0415
    with monkeypatch.context() as patch:  # another toolkit (a library the record names) may load it otherwise
        patch.setattr(records, "__version__", "99.0")
        assert zoo.recorded_model_unchanged(payload) is False
    record = payload["in9"]["provenance"]["model_record"]
    assert record["files"]["checkpoint"]["path"] == str(model)
    save_torchscript(synthetic.ColorEvidenceModel(9, fg_weight=0.5, bg_weight=4.0), model)  # same path, other weights
    assert zoo.recorded_model_unchanged(payload) is False
    payload["in9"]["provenance"]["model_record"]["settings"]["arch"] = "resnet18"  # not the identity's record
    assert zoo.recorded_model_unchanged(payload) is None


@pytest.mark.slow
def test_a_results_file_of_another_model_is_not_taken_for_this_one(small, tmp_path, capsys, one_thread):
    """A results file is this model's when it says so: one of another model at this model's place (copied, or
    from someone else's output folder) whose record's files are unchanged is no reason to skip this model, whose
    numbers it would claim."""
    data, model = small
    other = tmp_path / "other.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, fg_weight=0.5, bg_weight=4.0), other)
    spec, other_spec, output = f"file:{model}", f"file:{other}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    shutil.copyfile(results_file(output, spec), results_file(output, other_spec))
    code, out, err = small_zoo(data, output, other_spec, capsys)
    assert code == 0 and f"{other_spec}: done: " in out, err
    assert json.loads(results_file(output, other_spec).read_text())["model"] == other_spec


@pytest.mark.slow
def test_run_state_of_other_settings_is_set_aside_once(small, tmp_path, capsys, one_thread):
    """A model interrupted under one criterion and rerun under another: its state is moved aside with one line."""
    data, model = small
    spec, output = f"file:{model}", tmp_path / "zoo"
    assert small_zoo(data, output, spec, capsys)[0] == 0
    results_file(output, spec).unlink()  # as if stopped after its runs saved their state
    code, out, err = small_zoo(data, output, spec, capsys, "--criterion", "bg-class")
    assert code == 0, err
    slug = zoo.parse_model_spec(spec).slug
    aside = [line for line in err.splitlines() if "set aside" in line]
    assert len(aside) == 1 and aside[0].startswith("WARNING: ") and slug in aside[0], err
    assert (output / zoo.RUNS_FOLDER / f"{slug}.stale-1" / challenge.STATE_NAME).is_file()
    assert json.loads(results_file(output, spec).read_text())["challenge"]["criterion"] == "bg-class"
    code, out, err = small_zoo(data, output, spec, capsys, "--criterion", "bg-class")
    assert code == 0 and f"{spec}: skipped: " in out and "set aside" not in err


@pytest.mark.slow
def test_a_clip_model_from_a_weights_file_is_reused_until_the_file_changes(small, tmp_path, capsys, tiny_clip,
                                                                          one_thread):
    """A CLIP row's weights hash also covers its text head, so the file is compared with the file's own hash."""
    import open_clip  # noqa: PLC0415 (tiny_clip skips without it)

    data, _ = small
    arch = tiny_clip.split("/")[0][len("clip:"):]
    weights = tmp_path / "tiny.pt"
    torch.manual_seed(0)
    torch.save(open_clip.create_model(arch, pretrained=None).state_dict(), weights)
    spec, output = f"clip:{arch}/{weights}+templates=simple", tmp_path / "zoo"
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0 and f"{spec}: done: " in out, err
    recorded = json.loads(results_file(output, spec).read_text())
    assert recorded["weights_file_sha256"] == sha256_file(weights) != recorded["identity"]["model"]
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0 and f"{spec}: skipped: " in out, err
    torch.manual_seed(1)
    torch.save(open_clip.create_model(arch, pretrained=None).state_dict(), weights)
    code, out, err = small_zoo(data, output, spec, capsys)
    assert code == 0 and f"{spec}: done: " in out, err


@pytest.mark.slow
def test_the_zoo_decodes_each_image_once_for_all_its_models(data, checkpoints, tmp_path, monkeypatch, capsys):
    """in9's images and the challenge's are decoded for the first model and read from memory for the others (by
    content), with the same numbers; a second zoo run decodes afresh."""
    decoded = []
    real = image_sets.decode_rgb
    monkeypatch.setattr(image_sets, "decode_rgb", lambda path, *a, **k: decoded.append(path) or real(path, *a, **k))
    copies = []
    for n in range(3):
        shutil.copyfile(checkpoints / "color.ts", tmp_path / f"color{n}.ts")
        copies.append(f"file:{tmp_path / f'color{n}.ts'}")
    code, out, err = run_zoo_cli(zoo_args(data, tmp_path / "zoo", copies), capsys)
    assert code == 0, err
    in9_images = sum(1 for v in VARIATIONS for _ in (data / v).rglob("*.JPEG"))
    challenge_images = 2 * sum(1 for _ in (data / "only_bg_t").rglob("*.JPEG"))  # foregrounds and backgrounds
    assert len(decoded) == in9_images + challenge_images + CHECK_IMAGES  # the device check's, once for all models
    assert len(set(decoded)) == in9_images  # the challenge's foregrounds and backgrounds are original's and only_bg_t's
    runs = [json.loads(results_file(tmp_path / "zoo", spec).read_text()) for spec in copies]
    timing = ("provenance", "wall_time_s", "composites_per_s")
    for run in runs[1:]:
        for part in ("in9", "challenge"):
            assert {k: v for k, v in run[part].items() if k not in timing} == \
                {k: v for k, v in runs[0][part].items() if k not in timing}


class _HiddenBF16(torch.nn.Module):
    """Computes in bf16 inside and returns fp32 logits: the start-up device check catches it, on the CPU too."""

    def __init__(self):
        super().__init__()
        self.inner = TinyCNN(9, seed=1).bfloat16()

    def forward(self, x):
        return self.inner(x.bfloat16()).float()


@pytest.mark.slow
def test_the_device_check_fails_an_inexact_model_alone(small, tmp_path, capsys, one_thread):
    """The scripts' start-up check runs for each model: refused, that model's row fails with the one-line reason
    and the others go on; passed, it is in both results' provenance."""
    data, model = small
    inexact = tmp_path / "inexact.ts"
    save_torchscript(_HiddenBF16().eval(), inexact)
    good, bad, output = f"file:{model}", f"file:{inexact}", tmp_path / "zoo"
    code, out, err = run_zoo_cli([*zoo_args(data, output, [bad, good]), "--no-leaderboard", "--batch-size", "8"],
                                 capsys)
    assert code == zoo.EXIT_SOME_FAILED
    assert f"{bad}: failed" in out and f"{good}: done: " in out
    assert [line for line in err.splitlines() if bad in line and "differ from float64" in line], err
    payload = json.loads(results_file(output, good).read_text())
    assert payload["in9"]["provenance"]["device_check"]["passed"] is True
    assert payload["challenge"]["provenance"]["device_check"] == payload["in9"]["provenance"]["device_check"]
