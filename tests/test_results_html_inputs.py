"""The HTML report on inputs beside the common run: images that cannot be read, the original's mask arithmetic,
the bg-class criterion, a data path given relative, strings where numbers belong, files left from an older run,
results files that name images outside the data folder."""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import (
    TINY,
    Page,
    check_error,
    html_runs,
    page_shows_secret,
    run_command,
    run_in_process,
    run_train,
    secret_image,
    shows_secret,
)
from tools.data.compositing import blend, original_weights
from tools.data.image_sets import decode_rgb
from tools.in9 import class_names
from tools.results import analysis as analysis_cli
from tools.results.html import THUMB, write_html
from tools.results.matrix import BACKGROUNDS_FILE, FOREGROUNDS_FILE, META_FILE, PREDICTIONS_FILE, load_matrix
from tools.results.report import cli as report_cli

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


@pytest.mark.slow
def test_unreadable_foregrounds_leave_a_note_not_a_crash(runs, tmp_path):
    _, inputs = runs
    data = Path(inputs["analysis"]["data_path"])
    only_backgrounds = tmp_path / "bg_only"
    shutil.copytree(data / "only_bg_t", only_backgrounds / "only_bg_t")
    text = write_html(tmp_path / "bg_only.html", analysis=inputs["analysis"], data_path=only_backgrounds)
    shown = examples(text)
    assert shown and text.count("composite not shown") == len(shown)
    assert len(Page(text).images) == sum(len(i["top_backgrounds"]) for i in inputs["analysis"]["per_class"].values())
    corrupt = tmp_path / "corrupt"
    shutil.copytree(data, corrupt)
    matrix = load_matrix(inputs["analysis"]["output_dir"])
    first = matrix.fg_stems.index(shown[0][1])
    (corrupt / matrix.fg_images[first]).write_bytes(b"not a JPEG")
    text = write_html(tmp_path / "corrupt.html", analysis=inputs["analysis"], data_path=corrupt)
    assert text.count("composite not shown") == 1 and f"cannot read image {corrupt / matrix.fg_images[first]}" in text
    assert len(examples(text)) == len(shown)


@pytest.mark.slow
def test_the_composite_is_the_one_the_original_arithmetic_made(runs, tmp_path):
    _, inputs = runs
    data = tmp_path / "data"
    shutil.copytree(inputs["analysis"]["data_path"], data)
    for mask in data.rglob("*.npy"):  # 0/255 masks: the original gives the foreground a weight of 1/255
        np.save(mask, (np.load(mask) > 0).astype(np.uint8) * 255)
    analysis = copy_matrix(inputs, tmp_path, provenance={"mask_arithmetic": "original"})
    page = Page(write_html(tmp_path / "original.html", analysis=analysis, data_path=data))
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
        thumb = [np.asarray(Image.fromarray(a).resize((THUMB,) * 2, Image.Resampling.LANCZOS)).astype(int)
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
    text = write_html(tmp_path / "bg_class.html", analysis=analysis, data_path=tmp_path / "gone")
    shown = examples(text)
    assert {NAMES.index(f) for f, *_ in shown} == {int(fg[i]) for i in np.flatnonzero(vulnerable)}
    for fg_name, fg_stem, bg_name, bg_stem, predicted in shown:
        i, j = matrix.fg_stems.index(fg_stem), matrix.bg_stems.index(bg_stem)
        assert vulnerable[i] and predicted == bg_name == NAMES[bg[j]] == NAMES[p[i, j]] != fg_name


@pytest.mark.slow
def test_a_relative_data_path_is_recorded_absolute_and_the_report_reads_the_one_it_is_given(runs, tmp_path,
                                                                                           monkeypatch):
    _, inputs = runs
    data = Path(inputs["analysis"]["data_path"])
    folder = tmp_path / "matrix"
    shutil.copytree(inputs["analysis"]["output_dir"], folder)
    monkeypatch.chdir(data.parent)
    run_command(analysis_cli.main, [str(folder), "--data-path", data.name, "--log-level", "WARNING"])
    summary = json.loads((folder / "analysis.json").read_text())
    assert Path(summary["data_path"]) == data.resolve()
    run_command(report_cli.main, ["--analysis-dir", str(folder), "--html", str(tmp_path / "given.html"),
                                  "--data-path", data.name])
    assert "No data folder" not in (tmp_path / "given.html").read_text()
    monkeypatch.chdir(tmp_path)  # the recorded folder is not where the pictures come from: --data-path is
    monkeypatch.delenv("BG_CHALLENGE_DATA", raising=False)
    run_command(report_cli.main, ["--analysis-dir", str(folder), "--html", str(tmp_path / "default.html")])
    text = (tmp_path / "default.html").read_text()
    assert "No data folder at data/bg_challenge" in text and not Page(text).images


def test_strings_in_the_results_are_escaped(runs, tmp_path):
    _, inputs = runs
    hostile = "<script>alert(1)</script>"
    analysis = dict(inputs["analysis"], foregrounds=hostile, backgrounds=hostile, top_k=hostile)
    challenge = dict(inputs["challenge"], criterion=hostile)
    text = write_html(tmp_path / "page.html", analysis=analysis, challenge=challenge, data_path=tmp_path / hostile)
    assert "<script>alert" not in text and text.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 5


@pytest.mark.slow
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
    for name, change in [("beyond", lambda e: e.update(index=10**6)),
                         ("other", lambda e: e.update(index=e["index"] + 1)),
                         ("no_index", lambda e: e.pop("index")), ("no_image", lambda e: e.pop("image"))]:
        folder = tmp_path / name
        shutil.copytree(inputs["analysis"]["output_dir"], folder)
        summary = json.loads((folder / "analysis.json").read_text())
        change(summary["per_class"][NAMES[1]]["top_backgrounds"][0])
        (folder / "analysis.json").write_text(json.dumps(summary))
        code, out, err = run_in_process(report_cli.main,
                                        ["--analysis-dir", str(folder), "--html", str(folder / "p.html")], capsys)
        assert "analysis" in check_error(code, out, err), name


def names_outside(data: Path, secret: Path) -> list[str]:
    """What an edited results file may name, relative to the data root, for a file outside the data folder: its
    absolute path, a path that climbs out, and a link inside the data folder that points at it."""
    link = data / "only_bg_t" / "val" / sorted(os.listdir(data / "only_bg_t" / "val"))[0] / "zz_link.JPEG"
    link.symlink_to(secret)
    return [str(secret), os.path.relpath(secret, data), link.relative_to(data).as_posix()]


def rewrite_csv(path: Path, column: str, values: list[str]) -> None:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(dict(row, **{column: values[i % len(values)]}) for i, row in enumerate(rows))


def figure_shows_secret(path: Path, k: int) -> bool:
    with Image.open(path) as img:
        figure = img.convert("RGB")
    boxes = [analysis_cli.FigureLayout(rows=len(NAMES), cols=k).image_box(r, c) for r in range(len(NAMES))
             for c in range(k)]
    return any(shows_secret(figure.crop(box)) for box in boxes)


@pytest.mark.slow
def test_reports_and_figures_read_no_file_outside_the_data_folder_whatever_the_results_name(runs, tmp_path, capsys):
    """analysis.json, the matrix's CSVs and challenge_meta.json edited to name a file outside the data folder (and the
    data path recorded as /): the report and the analysis's figure read only the --data-path folder's own files."""
    _, inputs = runs
    data = tmp_path / "data"
    shutil.copytree(inputs["analysis"]["data_path"], data)
    secret = secret_image(tmp_path / "private")
    outside = names_outside(data, secret)
    folder = tmp_path / "matrix"
    shutil.copytree(inputs["analysis"]["output_dir"], folder)
    rewrite_csv(folder / BACKGROUNDS_FILE, "image", outside)
    rewrite_csv(folder / FOREGROUNDS_FILE, "image", outside)
    meta = json.loads((folder / META_FILE).read_text())
    (folder / META_FILE).write_text(json.dumps(dict(meta, data_path="/")))
    code, _, err = run_in_process(analysis_cli.main, [str(folder), "--data-path", str(data), "--top-k", "3"], capsys)
    assert code == 0, err
    assert not figure_shows_secret(folder / "top_backgrounds.png", 3)
    assert "27 of 27 background image(s) for the figure are not shown" in err and "inside the data folder" in err
    summary = json.loads((folder / "analysis.json").read_text())
    tops = [e for info in summary["per_class"].values() for e in info["top_backgrounds"]]
    for k, entry in enumerate(tops):
        entry["image"] = outside[k % len(outside)]
    (folder / "analysis.json").write_text(json.dumps(dict(summary, data_path="/")))
    page = tmp_path / "page.html"
    code, _, err = run_in_process(report_cli.main, ["--analysis-dir", str(folder), "--html", str(page),
                                                    "--data-path", str(data)], capsys)
    assert code == 0, err
    text = page.read_text()
    assert not page_shows_secret(text) and "not shown" in err
    assert text.count("composite not shown") == len(examples(text)) > 0
    # the check can fail: the same picture inside the data folder is shown, in the report and in the figure
    shutil.copy(secret, data / "only_bg_t" / "val" / "inside.png")
    tops[0]["image"] = "only_bg_t/val/inside.png"
    (folder / "analysis.json").write_text(json.dumps(summary))
    assert page_shows_secret(write_html(tmp_path / "inside.html", analysis=summary, data_path=data))
    rewrite_csv(folder / BACKGROUNDS_FILE, "image", ["only_bg_t/val/inside.png"])
    run_command(analysis_cli.main, [str(folder), "--data-path", str(data), "--top-k", "3", "--log-level", "ERROR"])
    assert figure_shows_secret(folder / "top_backgrounds.png", 3)
