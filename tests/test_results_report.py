"""The Markdown report: every section from results computed on generated data, and absent sections."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tools.challenge import list_challenge_files
from tools.data import image_sets, layout, synthetic
from tools.in9 import IN9_MEAN, IN9_STD, VARIATIONS, class_names
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.boundary import LoadedModel, PixelModel
from tools.models.record import ModelRecord
from tools.provenance import provenance
from tools.results import analysis, report
from tools.results.categories import Category, prediction_categories
from tools.results.report import cli as report_cli
from tools.runtime import Runtime

NAMES = class_names()


class GridColourModel(torch.nn.Module):
    """tools.data.synthetic's colour-evidence classifier on every fourth pixel: the same kind of answers, quicker."""

    def __init__(self):
        super().__init__()
        self.net = synthetic.ColorEvidenceModel(9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, :, ::4, ::4])


@pytest.fixture(scope="module")
def loaded():
    """The hand-built model in the toolkit's pixel wrapper, described as a loaded checkpoint."""
    record = ModelRecord()
    record.setting("arch", "color-evidence")
    return LoadedModel(PixelModel(GridColourModel().eval(), IN9_MEAN, IN9_STD), num_classes=9,
                       arch="color-evidence", weights=None, source="color9.pt", record=record,
                       checkpoint_format="module", normalization="in9")


@pytest.fixture(scope="module")
def in9_results(loaded, dataset):
    """in9_eval's results JSON for all eight variations, and the prediction categories from the same run."""
    run = run_in9(loaded, Runtime(torch.device("cpu")), list_in9_files(dataset.root, VARIATIONS, 1),
                  In9Config(VARIATIONS, batch_size=64, workers=1, progress=False))
    counts = prediction_categories(run.results["original"], run.results["mixed_rand"],
                                   run.results["only_bg_t"])
    return run, run.to_json(), counts


def _first_per_class(records: list, n: int) -> list:
    kept, seen = [], {}
    for record in records:
        seen[record.label] = seen.get(record.label, 0) + 1
        if seen[record.label] <= n:
            kept.append(record)
    return kept


@pytest.fixture(scope="module")
def challenge_results(loaded, dataset, tmp_path_factory):
    """A brute-force full challenge on 9 foregrounds x 18 backgrounds, saved as challenge_eval.py --full saves
    it, analysed; and the challenge results JSON (criterion any) computed from the same matrix."""
    root = dataset.root
    fgs = _first_per_class(layout.list_foregrounds(root), 1)
    bgs = _first_per_class(layout.list_variation(root, "only_bg_t"), 2)
    bg_images = np.stack([image_sets.decode_rgb(root / r.relpath) for r in bgs])
    P = np.zeros((len(fgs), len(bgs)), dtype=np.int8)
    with torch.inference_mode():
        for i, r in enumerate(fgs):
            fg, mask = image_sets.decode_rgb(root / r.image_relpath), np.load(root / r.mask_relpath)
            composites = np.where(mask[None, ..., None], fg[None], bg_images)
            P[i] = loaded.model(torch.from_numpy(composites).permute(0, 3, 1, 2)).argmax(dim=1).numpy()
    out = tmp_path_factory.mktemp("challenge")
    np.save(out / "predictions.npy", P)
    with open(out / "foregrounds.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["index", "stem", "label", "image", "mask"]] +
                                 [[i, r.stem, r.label, r.image_relpath, r.mask_relpath] for i, r in enumerate(fgs)])
    with open(out / "backgrounds.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([["index", "stem", "label", "image"]] +
                                 [[j, r.stem, r.label, r.relpath] for j, r in enumerate(bgs)])
    # the provenance challenge_eval.py records: the same model, the challenge's files of the same data
    info = {**provenance(Runtime(torch.device("cpu")).describe(), loaded.describe(),
                         list_challenge_files(root, workers=1).image_set.fingerprint), "batch_size": 7}
    (out / "challenge_meta.json").write_text(json.dumps({"data_path": str(root), "criterion": "any",
                                                         "num_classes": 9, "provenance": info}))
    summary = analysis.write_analysis(out, top_k=2)
    labels = np.array([r.label for r in fgs])
    vulnerable = (P != labels[:, None]).any(axis=1)
    challenge = {"vulnerable": int(vulnerable.sum()), "total": len(fgs),
                 "vulnerable_percent": round(100 * vulnerable.mean(), 4),
                 "challenge_accuracy": round(100 - 100 * vulnerable.mean(), 4), "criterion": "any",
                 "per_class": {name: {"vulnerable": int(vulnerable[labels == c].sum()),
                                      "total": int((labels == c).sum())} for c, name in enumerate(NAMES)},
                 "composites_evaluated": int(P.size), "wall_time_s": 1.5, "composites_per_s": P.size / 1.5,
                 "provenance": info}
    return out, challenge, summary


@pytest.mark.slow
def test_every_section_renders_from_generated_results(in9_results, challenge_results, tmp_path):
    run, in9, categories = in9_results
    out, challenge, summary = challenge_results
    path = tmp_path / "paper" / "report.md"
    text = report.write_report(path, in9=in9, challenge=challenge, analysis=summary, categories=categories)
    assert path.read_text(encoding="utf-8") == text
    for heading in ("# Backgrounds Challenge report", "## IN-9 accuracy", "## Backgrounds Challenge",
                    "## Adversarial backgrounds", "## Prediction categories", "## Provenance"):
        assert f"\n{heading}\n" in "\n" + text
    assert "Not run." not in text and "not run" not in text
    for name, result in run.results.items():
        assert f"| `{name}` | {result.accuracy:.2f}% | {result.correct} / {result.total} |" in text
    assert f"**{run.bg_gap:.2f} points**" in text
    assert f"**Challenge accuracy: {challenge['challenge_accuracy']:.2f}%.** {challenge['vulnerable']} of 9" in text
    assert "`any` criterion" in text and "Cost: 162 composites evaluated in 1.5 s (108 composites/s)." in text
    for name, info in summary["per_class"].items():
        start = f"| {name} | {100 * info['fool_rate']:.1f}% |"
        row = next(line for line in text.splitlines() if line.startswith(start))
        assert all(f"`{e['stem']}` {100 * e['asr']:.1f}%" in row for e in info["top_backgrounds"])
    link = re.search(r"!\[Top-2 backgrounds per class\]\(([^)]+)\)", text).group(1)
    assert not Path(link).is_absolute() and (path.parent / link).resolve() == (out / "top_backgrounds.png").resolve()
    overall = categories["overall"]
    cells = " | ".join(f"{overall['percent'][c.value]:.1f}% ({overall['counts'][c.value]})" for c in Category)
    assert f"| **all** | {overall['images']} | {cells} |" in text
    provenance = in9["provenance"]
    assert provenance["toolkit_version"] in text and provenance["data"]["sha256"] in text
    assert f"`{provenance['identity']}`" in text  # the model's identity
    header = next(line for line in text.splitlines() if line.startswith("|  | IN-9 evaluation"))
    assert header == "|  | IN-9 evaluation | challenge, analysis |"  # identical provenance shares a column


def test_absent_sections_say_not_run(challenge_results, tmp_path):
    _, challenge, _ = challenge_results
    text = report.write_report(tmp_path / "r.md", challenge=challenge)
    for heading in ("IN-9 accuracy", "Adversarial backgrounds", "Prediction categories"):
        assert f"## {heading}\n\nNot run.\n" in text
    assert text.count("Not run.") == 3
    assert "Challenge accuracy" in text and "![" not in text
    empty = report.write_report(tmp_path / "empty.md")
    assert empty.count("Not run.") == 4 and "No provenance recorded." in empty


def test_partial_in9_marks_missing_variations(in9_results, tmp_path):
    run, in9, _ = in9_results
    only_original = {"original": in9["original"], "bg_gap": None, "provenance": in9["provenance"]}
    text = report.write_report(tmp_path / "r.md", in9=only_original)
    assert "| `mixed_rand` | not run |  |" in text and "not run (needs both variations)" in text
    assert f"| `original` | {run.results['original'].accuracy:.2f}% |" in text


def test_sparkline():
    assert report.sparkline([0, 1, 2, 8]) == "·▁▂█"
    assert report.sparkline([0, 0]) == "··"


# ----------------------------------------------------------------------------------------------------------
# Command line

def test_command_line_merges_json_files(in9_results, challenge_results, tmp_path, capsys):
    _, in9, categories = in9_results
    out, challenge, summary = challenge_results
    (tmp_path / "in9.json").write_text(json.dumps(in9))
    (tmp_path / "challenge.json").write_text(json.dumps(challenge))
    (tmp_path / "categories.json").write_text(json.dumps(categories))
    target = tmp_path / "report.md"
    assert report_cli.main(["--in9", str(tmp_path / "in9.json"), "--challenge", str(tmp_path / "challenge.json"),
                        "--analysis-dir", str(out), "--categories", str(tmp_path / "categories.json"),
                        "--output", str(target)]) == 0
    assert str(target) in capsys.readouterr().out
    expected = report.render_report(in9, challenge, summary, categories, report_dir=tmp_path)
    assert target.read_text(encoding="utf-8") == expected
    # categories carried inside the IN-9 results file are used when --categories is not given
    (tmp_path / "in9_with_categories.json").write_text(json.dumps({**in9, "categories": categories}))
    assert report_cli.main(["--in9", str(tmp_path / "in9_with_categories.json"), "--output", str(target)]) == 0
    assert "| **all** |" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("args, message", [
    ([], "nothing to report: pass at least one of --in9"),
    (["--in9", "{tmp}/absent.json"],
     "IN-9 file {tmp}/absent.json does not exist; pass the --results-file of in9_eval.py"),
    (["--in9", "{tmp}/challenge.json"],
     "{tmp}/challenge.json holds challenge results (challenge_eval.py --results-file), not IN-9 results; pass it "
     "as --challenge"),
    (["--challenge", "{tmp}/broken.json"], "cannot read challenge file {tmp}/broken.json"),
    (["--analysis-dir", "{tmp}"], "run `python -m tools.results.analysis {tmp}` first"),
])
def test_command_line_errors_are_one_line(args, message, tmp_path, capsys):
    (tmp_path / "challenge.json").write_text(json.dumps({"challenge_accuracy": 50.0}))
    (tmp_path / "broken.json").write_text("{not json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args] + ["--output", str(tmp_path / "r.md")]
    assert report_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message.replace("{tmp}", str(tmp_path)) in err
    assert not (tmp_path / "r.md").exists()


# ----------------------------------------------------------------------------------------------------------
# Inputs that do not belong together, or are not what their flag says, or are incomplete

def _write(folder: Path, **payloads) -> dict[str, Path]:
    paths = {}
    for name, payload in payloads.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(payload))
    return paths


def _report_error(argv: list, capsys) -> str:
    assert report_cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("flag, given, says", [
    ("--in9", "challenge", "holds challenge results (challenge_eval.py --results-file), not IN-9 results; pass "
                           "it as --challenge"),
    ("--challenge", "in9", "holds IN-9 results (in9_eval.py --results-file), not challenge results; pass it as "
                           "--in9"),
    ("--in9", "zoo", "holds a zoo model's results (python -m tools.zoo), not IN-9 results; pass its in9 and "
                     "challenge entries as separate files"),
    ("--categories", "in9", "holds IN-9 results (in9_eval.py --results-file), not prediction categories; pass it "
                            "as --in9"),
])
def test_inputs_of_the_wrong_kind_are_refused(flag, given, says, in9_results, challenge_results, tmp_path, capsys):
    _, in9, _ = in9_results
    _, challenge, _ = challenge_results
    files = _write(tmp_path, in9=in9, challenge=challenge,
                   zoo={"model": "m", "source": "file", "in9": in9, "challenge": challenge})
    err = _report_error([flag, files[given], "--output", tmp_path / "r.md"], capsys)
    assert f"{files[given]} {says}" in err
    assert not (tmp_path / "r.md").exists()


def _without(payload: dict, *path: str) -> dict:
    """A deep copy of the payload with the key at `path` removed."""
    copy = json.loads(json.dumps(payload))
    entry = copy
    for key in path[:-1]:
        entry = entry[key]
    del entry[path[-1]]
    return copy


@pytest.mark.parametrize("flag, path", [
    ("--in9", ("original", "correct")), ("--in9", ("bg_gap",)), ("--in9", ("provenance",)),
    ("--challenge", ("vulnerable",)), ("--challenge", ("per_class", "dog", "total")),
    ("--categories", ("overall", "percent")),
])
def test_incomplete_results_are_one_line(flag, path, in9_results, challenge_results, tmp_path, capsys):
    _, in9, categories = in9_results
    _, challenge, _ = challenge_results
    payload = {"--in9": in9, "--challenge": challenge, "--categories": categories}[flag]
    files = _write(tmp_path, partial=_without(payload, *path))
    err = _report_error([flag, files["partial"], "--output", tmp_path / "r.md"], capsys)
    assert f"{files['partial']} is incomplete: it has no {'.'.join(path)}" in err


def test_incomplete_analysis_is_one_line(challenge_results, tmp_path, capsys):
    out, _, summary = challenge_results
    (tmp_path / analysis.SUMMARY_FILE).write_text(json.dumps(_without(summary, "per_class", "dog", "fool_rate")))
    err = _report_error(["--analysis-dir", tmp_path, "--output", tmp_path / "r.md"], capsys)
    assert "is incomplete: it has no per_class.dog.fool_rate" in err


def test_results_of_other_data_or_another_model_are_refused(in9_results, challenge_results, tmp_path, capsys):
    """The fingerprints of the data both runs read (original/ and only_bg_t/) and the model must agree; with
    --allow-mixed the report is written, with a warning at its top."""
    _, in9, _ = in9_results
    out, challenge, _ = challenge_results
    other = synthetic.generate(tmp_path / "other", per_class=2, seed=7).root
    other_data = {**challenge, "provenance": {**challenge["provenance"],
                                              "data": list_challenge_files(other, workers=1).image_set.fingerprint}}
    other_model = {**challenge, "provenance": {**challenge["provenance"], "identity": "cd" * 32}}
    files = _write(tmp_path, in9=in9, same=challenge, other_data=other_data, other_model=other_model)
    target = tmp_path / "r.md"
    assert report_cli.main(["--in9", str(files["in9"]), "--challenge", str(files["same"]), "--analysis-dir", str(out),
                        "--output", str(target)]) == 0
    assert "Warning" not in target.read_text(encoding="utf-8")
    capsys.readouterr()
    err = _report_error(["--in9", files["in9"], "--challenge", files["other_data"], "--output", target], capsys)
    assert "the IN-9 results and the challenge results come from different data" in err
    assert "original" in err and "only_bg_t" in err and "--allow-mixed" in err
    err = _report_error(["--challenge", files["other_model"], "--analysis-dir", out, "--output", target], capsys)
    assert "the challenge results and the analysis come from different models" in err and "identity" in err
    assert report_cli.main(["--in9", str(files["in9"]), "--challenge", str(files["other_data"]), "--allow-mixed",
                        "--output", str(target)]) == 0
    text = target.read_text(encoding="utf-8")
    assert "**Warning: the IN-9 results and the challenge results come from different data" in text
