"""The HTML report on inputs beside the common run: images that cannot be read, the original's mask arithmetic,
the bg-class criterion, a data path given relative, strings where numbers belong, files left from an older run."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import TINY, Page, check_error, html_runs, run_command, run_in_process, run_train
from tools.data.compositing import blend, original_weights
from tools.data.decoding import decode_rgb
from tools.in9 import class_names
from tools.results import analysis as analysis_cli
from tools.results import html_sections, report, report_cli
from tools.results.html import write_html
from tools.results.matrix import META_FILE, PREDICTIONS_FILE, load_matrix

EXAMPLE = re.compile(r"(?:alt|<figcaption)[=>]\"?([a-z]+) foreground (\S+) on ([a-z]+) background (\S+), predicted "
                     r"([a-z]+|outside IN-9)")

NAMES = class_names()


@pytest.fixture(scope="module")
def runs(dataset, color_ts, tmp_path_factory):
    """in9_eval and challenge_eval --full --analysis with their HTML reports (tests.helpers.html_runs)."""
    return html_runs(dataset, color_ts, tmp_path_factory.mktemp("html"))


def copy_matrix(inputs: dict, tmp_path: Path, **meta) -> dict:
    """The run's analysis over a copy of its matrix folder whose challenge_meta.json takes `meta`'s entries."""
    folder = tmp_path / "matrix"
    shutil.copytree(inputs["analysis"]["output_dir"], folder)
    saved = json.loads((folder / META_FILE).read_text())
    provenance = dict(saved.get("provenance", {}), **meta.pop("provenance", {}))
    (folder / META_FILE).write_text(json.dumps(dict(saved, **meta, provenance=provenance)))
    return dict(inputs["analysis"], output_dir=str(folder))


def examples(text: str) -> list[tuple[str, str, str, str, str]]:
    """The page's fooling examples: (foreground class, its stem, background class, its stem, predicted)."""
    return EXAMPLE.findall(text)


def test_unreadable_foregrounds_leave_a_note_not_a_crash(runs, tmp_path):
    _, inputs = runs
    data = Path(inputs["analysis"]["data_path"])
    only_backgrounds = tmp_path / "bg_only"
    shutil.copytree(data / "only_bg_t", only_backgrounds / "only_bg_t")
    text = write_html(tmp_path / "bg_only.html", analysis=dict(inputs["analysis"], data_path=str(only_backgrounds)))
    shown = examples(text)
    assert shown and text.count("composite not shown") == len(shown)
    assert len(Page(text).images) == sum(len(i["top_backgrounds"]) for i in inputs["analysis"]["per_class"].values())
    corrupt = tmp_path / "corrupt"
    shutil.copytree(data, corrupt)
    matrix = load_matrix(inputs["analysis"]["output_dir"])
    first = matrix.fg_stems.index(shown[0][1])
    (corrupt / matrix.fg_images[first]).write_bytes(b"not a JPEG")
    text = write_html(tmp_path / "corrupt.html", analysis=dict(inputs["analysis"], data_path=str(corrupt)))
    assert text.count("composite not shown") == 1 and f"cannot read image {corrupt / matrix.fg_images[first]}" in text
    assert len(examples(text)) == len(shown)


def test_the_composite_is_the_one_the_original_arithmetic_made(runs, tmp_path):
    _, inputs = runs
    data = tmp_path / "data"
    shutil.copytree(inputs["analysis"]["data_path"], data)
    for mask in data.rglob("*.npy"):  # 0/255 masks: the original gives the foreground a weight of 1/255
        np.save(mask, (np.load(mask) > 0).astype(np.uint8) * 255)
    analysis = copy_matrix(inputs, tmp_path, provenance={"mask_arithmetic": "original"})
    page = Page(write_html(tmp_path / "original.html", analysis=dict(analysis, data_path=str(data))))
    composites = [img for img in page.images if " predicted " in img["alt"]]
    assert composites
    matrix = load_matrix(analysis["output_dir"])
    for img in composites:
        _, _, fg_stem, _, _, _, bg_stem, *_ = img["alt"].replace(",", "").split()
        i, j = matrix.fg_stems.index(fg_stem), matrix.bg_stems.index(bg_stem)
        fg, bg = (torch.tensor(decode_rgb(data / p)).permute(2, 0, 1)[None] for p in
                  (matrix.fg_images[i], matrix.bg_images[j]))
        weights = torch.from_numpy(original_weights(np.load(data / matrix.fg_masks[i])))[None, None]
        seen = blend(fg, bg, weights)[0].permute(1, 2, 0).mul(255).round().to(torch.uint8).numpy()
        cut_out = np.where(np.load(data / matrix.fg_masks[i])[..., None] > 0, decode_rgb(data / matrix.fg_images[i]),
                           decode_rgb(data / matrix.bg_images[j]))
        with Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1]))) as shown:
            got = np.asarray(shown.convert("RGB")).astype(int)
        thumb = [np.asarray(Image.fromarray(a).resize((html_sections.THUMB,) * 2, Image.Resampling.LANCZOS)).astype(int)
                 for a in (seen, cut_out)]
        assert np.abs(got - thumb[0]).mean() < 8 < np.abs(got - thumb[1]).mean()


def test_the_examples_follow_the_runs_criterion(runs, tmp_path):
    _, inputs = runs
    analysis = copy_matrix(inputs, tmp_path, criterion="bg-class")
    matrix = load_matrix(analysis["output_dir"])
    p, fg, bg = matrix.predictions.copy(), matrix.fg_labels, matrix.bg_labels
    for c in range(len(NAMES)):  # each class's first foreground: wrong everywhere, never the background's class
        first, other = np.flatnonzero(fg == c)[0], (c + 1) % len(NAMES)
        p[first] = np.where(bg == other, c, other)
    np.save(Path(analysis["output_dir"]) / PREDICTIONS_FILE, p)
    vulnerable = ((p == bg[None, :]) & (bg[None, :] != fg[:, None])).any(axis=1)
    text = write_html(tmp_path / "bg_class.html", analysis=dict(analysis, data_path=str(tmp_path / "gone")))
    shown = examples(text)
    assert {NAMES.index(f) for f, *_ in shown} == {int(fg[i]) for i in np.flatnonzero(vulnerable)}
    for fg_name, fg_stem, bg_name, bg_stem, predicted in shown:
        i, j = matrix.fg_stems.index(fg_stem), matrix.bg_stems.index(bg_stem)
        assert vulnerable[i] and predicted == bg_name == NAMES[bg[j]] == NAMES[p[i, j]] != fg_name


def test_a_relative_data_path_is_found_from_another_folder(runs, tmp_path, monkeypatch):
    _, inputs = runs
    data = Path(inputs["analysis"]["data_path"])
    folder = tmp_path / "matrix"
    shutil.copytree(inputs["analysis"]["output_dir"], folder)
    monkeypatch.chdir(data.parent)
    run_command(analysis_cli.main, [str(folder), "--data-path", data.name, "--log-level", "WARNING"])
    summary = json.loads((folder / "analysis.json").read_text())
    assert Path(summary["data_path"]) == data.resolve()
    monkeypatch.chdir(tmp_path)
    text = write_html(tmp_path / "page.html", analysis=summary)
    assert "is gone" not in text and Page(text).images


def test_strings_in_the_results_are_escaped(runs, tmp_path):
    _, inputs = runs
    hostile = "<script>alert(1)</script>"
    analysis = dict(inputs["analysis"], foregrounds=hostile, backgrounds=hostile, top_k=hostile,
                    data_path=str(tmp_path / hostile))
    challenge = dict(inputs["challenge"], criterion=hostile)
    text = write_html(tmp_path / "page.html", analysis=analysis, challenge=challenge)
    assert "<script>alert" not in text and text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 5


def test_a_training_rerun_shows_its_own_results_not_older_files(runs, tiny, tmp_path, capsys, one_thread):
    out_dir, _ = runs
    out = tmp_path / "run"
    for stale in ("eval_start/in9.json", "eval_trained/challenge.json"):  # left by an earlier run into the folder
        (out / stale).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out_dir / Path(stale).name, out / stale)
    code, _, err = run_train(["--data-path", tiny, "--weights", "none", "--epochs", 1, "--batch-size", 6,
                              "--eval-data", tiny, "--output-dir", out, *TINY], capsys)
    assert code == 0, err
    for page in (out / "report.html", tmp_path / "again.html"):
        if page != out / "report.html":
            run_command(report_cli.main, ["--training", str(out), "--html", str(page)])
        rows = Page(page.read_text()).rows("before-after")
        assert [cells[0][1] for cells in rows.values()] == [None] * len(rows), page  # random weights: no "before"
        assert "Challenge accuracy" not in rows, page  # this run did not run the challenge


def test_a_truncated_training_log_loses_only_its_partial_line(runs, tmp_path):
    out_dir, _ = runs
    run = tmp_path / "run"
    (run / "eval_trained").mkdir(parents=True)
    shutil.copy(out_dir / "in9.json", run / "eval_trained" / "in9.json")
    steps = [{"step": s, "epoch": 0, "loss": 1.0 / s, "accuracy": 0.5, "lr": 1e-3} for s in (1, 2, 3)]
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps) + '{"step": 4, "epo')
    run_command(report_cli.main, ["--training", str(run), "--html", str(tmp_path / "page.html")])
    rows = Page((tmp_path / "page.html").read_text()).tables["training"][1:]
    assert [float(row[0][1]) for row in rows] == [1, 2, 3]


def test_an_analysis_that_does_not_fit_its_matrix_is_one_error_line(runs, tmp_path, capsys):
    _, inputs = runs
    for name, change in [("beyond", lambda e: e.update(index=10**6)), ("other", lambda e: e.update(index=e["index"] + 1)),
                         ("no_index", lambda e: e.pop("index")), ("no_image", lambda e: e.pop("image"))]:
        folder = tmp_path / name
        shutil.copytree(inputs["analysis"]["output_dir"], folder)
        summary = json.loads((folder / "analysis.json").read_text())
        change(summary["per_class"][NAMES[1]]["top_backgrounds"][0])
        (folder / "analysis.json").write_text(json.dumps(summary))
        code, out, err = run_in_process(report_cli.main, ["--analysis-dir", str(folder), "--html", str(folder / "p.html")],
                                        capsys)
        assert "analysis" in check_error(code, out, err), name
