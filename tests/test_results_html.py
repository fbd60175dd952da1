"""The HTML report: its numbers equal the results files, its pictures decode and stay small, and in a real headless
browser (Debian's chromium) it loads without console errors, every image decodes and it is not blank."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import TINY, Page, check_error, html_runs, run_train
from tools.data.image_sets import decode_rgb
from tools.in9 import VARIATIONS, class_names
from tools.results import report
from tools.results.categories import Category
from tools.results.html import THUMB, in9_section, line_chart, write_html
from tools.results.matrix import load_matrix
from tools.results.report import cli as report_cli

NAMES = class_names()
# Debian names it chromium, Ubuntu also chromium-browser
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
REQUIRE_BROWSER = os.environ.get("CI_REQUIRE_BROWSER") == "1"
MAX_THUMBNAIL_BYTES = 8_000  # an 80-px JPEG at quality 80 is a few kB


@pytest.fixture(scope="module")
def runs(dataset, color_ts, tmp_path_factory):
    """in9_eval and challenge_eval --full --analysis on the generated data with their HTML reports
    (tests.helpers.html_runs)."""
    return html_runs(dataset, color_ts, tmp_path_factory.mktemp("html"))


def _number(value: str | None) -> float:
    assert value is not None
    return float(value)


def check_numbers(page: Page, inputs: dict) -> None:
    """Every number of the page's tables equals the results files (and a brute-force count of the matrix)."""
    in9, challenge, analysis, categories = (inputs[k] for k in ("in9", "challenge", "analysis", "categories"))
    rows = page.rows("in9")
    for name in VARIATIONS:
        assert _number(rows[name][0][1]) == in9[name]["accuracy"]
        assert rows[name][0][0] == f"{in9[name]['accuracy']:.2f}%"
        assert rows[name][1][0] == f"{in9[name]['correct']} / {in9[name]['total']}"
    assert _number(page.values["bg-gap"]) == in9["bg_gap"]
    assert _number(page.values["challenge-accuracy"]) == challenge["challenge_accuracy"]
    rows = page.rows("challenge")
    for name, entry in challenge["per_class"].items():
        assert [_number(v) for _, v in rows[name][:2]] == [entry["vulnerable"], entry["total"]]
        assert _number(rows[name][2][1]) == pytest.approx(100 * (entry["total"] - entry["vulnerable"]) / entry["total"])
    rows = page.rows("analysis")
    for name, info in analysis["per_class"].items():
        assert [_number(v) for _, v in rows[name][:4]] == [info["fool_rate"], info["backgrounds"], info["mean_asr"],
                                                            info["max_asr"]]
    rows = page.rows("categories")
    for name, entry in [("all", categories["overall"]), *categories["per_class"].items()]:
        assert [_number(v) for _, v in rows[name][1:]] == [entry["counts"][c.value] for c in Category]
    # the confusion under the fooling backgrounds, counted pair by pair from the saved matrix
    matrix = load_matrix(analysis["output_dir"])
    tops = [e["index"] for info in analysis["per_class"].values() for e in info["top_backgrounds"]]
    expected = np.zeros((9, 10), dtype=int)
    for i, label in enumerate(matrix.fg_labels):
        for j in tops:
            if matrix.bg_labels[j] != label:
                predicted = matrix.predictions[i, j]
                expected[label, 9 if predicted < 0 else predicted] += 1
    rows = page.rows("confusion")
    assert [[int(_number(v)) for _, v in rows[name]] for name in NAMES] == expected.tolist()


def check_images(page: Page) -> None:
    """Every image is embedded (a data URI), decodes, and is small."""
    assert page.images
    for img in page.images:
        assert img["src"].startswith("data:image/") and img.get("alt")
        raw = base64.b64decode(img["src"].split(",", 1)[1])
        with Image.open(io.BytesIO(raw)) as decoded:
            decoded.load()
            if img.get("width"):
                assert decoded.size == (THUMB, THUMB)
                assert len(raw) < MAX_THUMBNAIL_BYTES


def _vulnerable(inputs: dict) -> list[tuple[int, bool]]:
    """(class, whether some background makes the prediction wrong) per foreground, from the saved matrix."""
    matrix = load_matrix(inputs["analysis"]["output_dir"])
    return [(int(label), bool((row != label).any())) for label, row in zip(matrix.fg_labels, matrix.predictions)]


def check_composites(composites: list[dict], inputs: dict) -> None:
    """Each composite is its foreground pasted on a background that makes the prediction wrong, named right."""
    matrix = load_matrix(inputs["analysis"]["output_dir"])
    root = Path(inputs["analysis"]["data_path"])
    for img in composites:
        words = img["alt"].split()  # "<class> foreground <stem> on <class> background <stem>, predicted <class>"
        i, j = matrix.fg_stems.index(words[2]), matrix.bg_stems.index(words[6].rstrip(","))
        assert matrix.predictions[i, j] != matrix.fg_labels[i] and words[-1] == NAMES[matrix.predictions[i, j]]
        mask = np.load(root / matrix.fg_masks[i]) > 0
        truth = np.where(mask[..., None], decode_rgb(root / matrix.fg_images[i]),
                         decode_rgb(root / matrix.bg_images[j]))
        expected = np.asarray(Image.fromarray(truth).resize((THUMB,) * 2, Image.Resampling.LANCZOS))
        with Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1]))) as shown:
            got = np.asarray(shown.convert("RGB"))
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 8  # JPEG at quality 80


@pytest.mark.slow
def test_the_page_holds_the_results_numbers_and_small_embedded_images(runs):
    out, inputs = runs
    text = (out / "report.html").read_text()
    page = Page(text)
    check_numbers(page, inputs)
    check_images(page)
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    thumbnails = [img for img in page.images if img.get("width")]
    composites = [img for img in thumbnails if " predicted " in img["alt"]]
    tops = sum(len(info["top_backgrounds"]) for info in inputs["analysis"]["per_class"].values())
    assert len(thumbnails) == tops + len(composites)
    fooled_classes = {NAMES[label] for label, vulnerable in _vulnerable(inputs) if vulnerable}
    assert {img["alt"].split(" foreground")[0] for img in composites} == fooled_classes
    check_composites(composites, inputs)
    assert len(text.encode()) < 2_000 + 10_000 * len(thumbnails) + 100_000  # the tables, and a few kB per image


def test_the_scripts_pages_hold_their_own_results(runs):
    out, inputs = runs
    in9_page = Page((out / "in9.html").read_text())
    assert _number(in9_page.values["bg-gap"]) == inputs["in9"]["bg_gap"] and "categories" in in9_page.tables
    challenge_page = Page((out / "challenge.html").read_text())
    assert _number(challenge_page.values["challenge-accuracy"]) == inputs["challenge"]["challenge_accuracy"]
    assert "confusion" in challenge_page.tables and "in9" not in challenge_page.tables
    assert "challenge" not in in9_page.tables


def test_a_gone_data_folder_is_said_not_failed(runs, tmp_path):
    out, inputs = runs
    text = write_html(tmp_path / "report.html", analysis=inputs["analysis"], data_path=tmp_path / "moved")
    assert f"No data folder at {tmp_path / 'moved'}" in text
    page = Page(text)
    assert not page.images and len(page.rows("confusion")) == len(NAMES)


def test_published_rows_beside_a_run_on_the_release(runs):
    _, inputs = runs
    in9 = json.loads(json.dumps(inputs["in9"]))
    page = Page(in9_section(in9))
    assert "published" not in page.tables  # 4 images per class: not the release
    on_release(in9)
    rows = Page(in9_section(in9)).rows("published")
    assert "ResNet-50" in rows and _number(rows["ResNet-50"][3][1]) == 7.3  # the paper's BG-gap
    assert "| ResNet-50 | 95.60 | 86.20 | 78.90 | 7.30 | 22.30 |" in "\n".join(report.in9_section(in9))
    in9["mixed_rand"]["per_class"]["dog"]["total"] += 1  # 4,050 images, but not 450 of every class
    in9["mixed_rand"]["per_class"]["bird"]["total"] -= 1
    assert in9["mixed_rand"]["total"] == 4050 and "published" not in Page(in9_section(in9)).tables


def on_release(in9: dict) -> dict:
    """`in9` (changed in place) as if every variation ran on the release: 450 images of every class."""
    for name in VARIATIONS:
        in9[name]["total"] = 450 * len(NAMES)
        for entry in in9[name]["per_class"].values():
            entry["total"] = 450
    return in9


def test_the_markdown_wording_is_unchanged(runs):
    _, inputs = runs
    text = report.render_report(challenge=dict(inputs["challenge"], criterion="custom"), analysis=inputs["analysis"])
    assert ("The **ASR** (attack success rate) of a background of class *c* is the share of the other classes' "
            "foregrounds that the model predicts as *c* when pasted on it. The **fool rate** of *c* is the share of "
            "the other classes' foregrounds that at least one background of *c* turns into *c*. Over ") in text
    assert "under the `custom` criterion: as the challenge run defined it." in text


def test_the_report_command_writes_the_page_and_the_leaderboard(runs, tmp_path, capsys, monkeypatch):
    out, inputs = runs
    zoo = tmp_path / "zoo"
    (zoo / "models").mkdir(parents=True)
    in9 = on_release(json.loads(json.dumps(inputs["in9"])))  # the published rows only beside the release's
    (zoo / "models" / "toy.json").write_text(json.dumps({"model": "toy", "source": "torchscript",
                                                          "in9": in9, "challenge": inputs["challenge"]}))
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "page.html"
    assert report_cli.main(["--challenge", str(out / "challenge.json"), "--html", str(target),
                                "--leaderboard", str(zoo)]) == 0
    assert f"Wrote {target}" in capsys.readouterr().out and not (tmp_path / "report.md").exists()
    page = Page(target.read_text())
    header = [text for text, _ in page.tables["leaderboard"][0]]
    rows = {row[1][0]: dict(zip(header, row)) for row in page.tables["leaderboard"][1:]}
    toy = [_number(rows["toy"][name][1]) for name in ("Original", "Mixed-Same", "Mixed-Rand", "BG-gap", "Challenge")]
    assert toy == [inputs["in9"]["original"]["accuracy"], inputs["in9"]["mixed_same"]["accuracy"],
                   inputs["in9"]["mixed_rand"]["accuracy"], inputs["in9"]["bg_gap"],
                   inputs["challenge"]["challenge_accuracy"]]
    assert rows["ResNet-50"]["Kind"][0] == "published" and "sortable" in target.read_text()
    check_images(page)


def test_a_leaderboard_without_html_is_one_line(tmp_path, capsys):
    code = report_cli.main(["--leaderboard", str(tmp_path), "--output", str(tmp_path / "r.md")])
    out, err = capsys.readouterr()
    assert "--leaderboard adds to the HTML report: add --html PATH" in check_error(code, out, err)


@pytest.mark.parametrize("flag", ["--training", "--leaderboard"])
def test_a_folder_that_is_not_the_run_named_writes_nothing(flag, runs, tmp_path, capsys):
    """--training or --leaderboard naming a folder without the run's results is one error line before anything is
    written: the Markdown report was written first, then the command failed on the HTML page's folder."""
    markdown, page = tmp_path / "r.md", tmp_path / "r.html"
    code = report_cli.main(["--in9", str(runs[0] / "in9.json"), "--output", str(markdown), "--html", str(page),
                            flag, str(tmp_path / "empty")])
    out, err = capsys.readouterr()
    assert "pass the --output-dir of" in check_error(code, out, err)
    assert not markdown.exists() and not page.exists()


@pytest.mark.slow
def test_a_training_run_leaves_its_curves_and_before_after_table(tiny, tmp_path, capsys, one_thread):
    out = tmp_path / "run"
    code, _, err = run_train(["--data-path", tiny, "--weights", "none", "--epochs", 2, "--batch-size", 6,
                              "--eval-data", tiny, "--output-dir", out, *TINY], capsys)
    assert code == 0, err
    text = (out / "report.html").read_text()
    page = Page(text)
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r]
    assert [(_number(r[0][1]), _number(r[2][1])) for r in page.tables["training"][1:]] == \
        [(r["step"], r["loss"]) for r in logged]
    assert text.count("<polyline") == 2
    trained = json.loads((out / "eval_trained" / "in9.json").read_text())
    rows = page.rows("before-after")
    assert [_number(rows[name][1][1]) for name in VARIATIONS] == [trained[name]["accuracy"] for name in VARIATIONS]
    assert _number(rows["BG-gap"][1][1]) == trained["bg_gap"] and rows["BG-gap"][0][1] is None  # random start
    assert "The starting point (random weights) was not evaluated." in text
    # the report command renders the same section from the run's folder
    code = report_cli.main(["--training", str(out), "--html", str(tmp_path / "again.html")])
    assert (code == 0
            and Page((tmp_path / "again.html").read_text()).tables["before-after"] == page.tables["before-after"])


# ----------------------------------------------------------------------------------------------------------
# In a real browser

def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=timeout)


def console_errors(stderr: str) -> list[str]:
    """The page's console messages: the page writes none, so each is an error (chromium logs console.error, SVG
    attribute errors and uncaught exceptions alike as INFO:CONSOLE lines)."""
    return [line for line in stderr.splitlines() if "console" in line.lower()]


def every_sortable_table(runs, tmp_path) -> Path:
    """A page holding every sortable table: the run's results as if on the release (the published rows, with
    "–" cells), a zoo's leaderboard (on the release too, so with the published rows) and a training run's logged steps
    (in no column's order)."""
    out, inputs = runs
    in9 = on_release(json.loads(json.dumps(inputs["in9"])))
    zoo, training = tmp_path / "zoo", tmp_path / "training"
    (zoo / "models").mkdir(parents=True)
    (zoo / "models" / "toy.json").write_text(json.dumps({"model": "toy", "source": "torchscript",
                                                          "in9": in9, "challenge": inputs["challenge"]}))
    (training / "eval_trained").mkdir(parents=True)
    (training / "eval_trained" / "in9.json").write_text(json.dumps(inputs["in9"]))
    steps = [(1, 0, 0.9, 0.5, 1e-3), (2, 1, 1.2, 0.25, 3e-3), (3, 0, 0.5, 0.75, 2e-3), (4, 1, 0.7, 0.0, 5e-4)]
    (training / "train_log.jsonl").write_text("".join(
        json.dumps({"step": s, "epoch": e, "loss": loss, "accuracy": acc, "lr": lr}) + "\n"
        for s, e, loss, acc, lr in steps))
    page = tmp_path / "every.html"
    write_html(page, **dict(inputs, in9=in9), leaderboard=zoo, training=training)
    return page


def ordered(cells: list[tuple[str, str | None]]) -> bool:
    """A column sorted as a click sorts it: the cells with a number first, ascending; then the others by their
    text (checked where the texts are plain words, whose order every collation agrees on)."""
    numbers = [float(value) for _, value in cells if value not in (None, "None")]
    texts = [text for text, value in cells if value in (None, "None")]
    first_text = next((k for k, (_, value) in enumerate(cells) if value in (None, "None")), len(cells))
    plain = all(t.replace(" ", "").isalpha() for t in texts)
    return (numbers == sorted(numbers) and first_text == len(numbers)
            and (not plain or texts == sorted(texts, key=str.casefold)))


def click_each_column(tables: dict[str, list], widest: int) -> str:
    """A script that, for each column in turn, puts every table's rows back in the order the page loaded them,
    clicks that column's header in each table that has it, and then keeps a copy of each clicked table under
    data-table "NAME@COLUMN": one page load shows what a click on each column does to a freshly loaded page
    (a browser start per column cost seconds each)."""
    names = json.dumps(sorted(tables))
    steps = [f"clickAll({column}, {json.dumps([n for n, rows in tables.items() if len(rows[0]) > column])});"
             for column in range(1, widest)]
    return ("(function () {\n"
            f"var loaded = {{}};\n{names}.forEach(function (name) {{ loaded[name] = "
            "Array.from(document.querySelector('table[data-table=' + name + ']').tBodies[0].rows); });\n"
            "function clickAll(column, names) {\n"
            "  names.forEach(function (name) { var body = document.querySelector('table[data-table=' + name + ']')"
            ".tBodies[0]; loaded[name].forEach(function (tr) { body.appendChild(tr); }); });\n"
            "  names.forEach(function (name) { document.querySelector('table[data-table=' + name + '] "
            "th:nth-child(' + (column + 1) + ')').click(); });\n"
            "  names.forEach(function (name) { var copy = document.querySelector('table[data-table=' + name + ']')"
            ".cloneNode(true); copy.setAttribute('data-table', name + '@' + column); "
            "document.body.appendChild(copy); });\n"
            "}\n" + "\n".join(steps) + "\n})();")


@pytest.mark.skipif(BROWSER is None and not REQUIRE_BROWSER, reason="chromium is not installed")
@pytest.mark.slow
def test_a_click_sorts_its_own_column_in_every_sortable_table(runs, tmp_path):
    page = every_sortable_table(runs, tmp_path)
    tables = {name: rows for name, rows in Page(page.read_text()).tables.items()
              if f'data-table="{name}" class="sortable"' in page.read_text()}
    assert set(tables) == {"training", "published", "challenge", "analysis", "categories", "leaderboard"}
    widest = max(len(rows[0]) for rows in tables.values())
    clicked = tmp_path / "clicked.html"
    script = click_each_column(tables, widest)
    clicked.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>"))
    dumped = chromium("--dump-dom", clicked.resolve().as_uri())
    assert console_errors(dumped.stderr) == []
    after = Page(dumped.stdout).tables
    unsorted = set()
    for column in range(1, widest):  # the first columns are names; a click sorts column `column` of each table
        for name, rows in tables.items():
            if len(rows[0]) > column:
                cells = [row[column] for row in after[f"{name}@{column}"][1:]]
                assert len(cells) == len(rows) - 1, (name, column)
                assert ordered(cells), (name, column, cells)
                unsorted |= {(name, column)} if not ordered([row[column] for row in rows[1:]]) else set()
    assert {name for name, _ in unsorted} == set(tables)  # every table had a column a click had to reorder


@pytest.mark.skipif(BROWSER is None and not REQUIRE_BROWSER,
                    reason="chromium is not installed (apt-get install chromium); CI installs it and sets "
                           "CI_REQUIRE_BROWSER=1")
@pytest.mark.slow
def test_the_page_in_a_headless_browser(runs, tmp_path):
    assert BROWSER is not None, "CI_REQUIRE_BROWSER=1 but neither chromium nor chromium-browser is on PATH"
    out, inputs = runs
    url = (out / "report.html").resolve().as_uri()
    dumped = chromium("--dump-dom", url)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert console_errors(dumped.stderr) == []
    page = Page(dumped.stdout)
    assert page.body.get("data-broken-images") == "0"  # the page's own count of images that did not decode
    check_numbers(page, inputs)
    shot = tmp_path / "shot.png"
    shown = chromium(f"--screenshot={shot}", "--window-size=1000,1400", url)
    assert shown.returncode == 0, shown.stderr[-2000:]
    with Image.open(shot) as img:
        pixels = np.asarray(img.convert("L"), dtype=np.float64)
    assert pixels.std() > 20 and (pixels < 128).mean() > 0.01  # text and pictures, not a blank page
    # a click on a header sorts its table by the column's numbers, and a second click reverses it (the table as
    # the first click left it is kept as a copy, "challenge@1", for the one page load)
    sorted_page = tmp_path / "sorted.html"
    table = "document.querySelector('table[data-table=challenge]')"
    click = f"{table}.querySelector('th:nth-child(4)').click();"
    keep = f"var copy = {table}.cloneNode(true); copy.setAttribute('data-table', 'challenge@1'); " \
           "document.body.appendChild(copy);"
    sorted_page.write_text((out / "report.html").read_text().replace(
        "</body>", f"<script>{click}{keep}{click}</script></body>"))
    dumped = chromium("--dump-dom", sorted_page.resolve().as_uri())
    assert console_errors(dumped.stderr) == []
    tables = Page(dumped.stdout).tables
    order = [_number(row[3][1]) for row in tables["challenge@1"][1:]]
    assert order == sorted(order) and len(set(order)) > 1
    assert [_number(row[3][1]) for row in tables["challenge"][1:]] == sorted(order, reverse=True)
    # the same checks see a broken page: a script error, a console error, an SVG that does not parse, and an
    # image that does not decode
    broken = tmp_path / "broken.html"
    for fault in ["<script>undefinedCall();</script>", "<script>console.error('broken');</script>",
                  '<svg xmlns="http://www.w3.org/2000/svg"><polyline points="1,1 2,nan 3,3"/></svg>']:
        broken.write_text((out / "report.html").read_text().replace(
            "</body>", f'<img src="data:image/png;base64,AAAA" alt="x">{fault}</body>'))
        dumped = chromium("--dump-dom", broken.resolve().as_uri())
        assert console_errors(dumped.stderr), fault
        assert Page(dumped.stdout).body.get("data-broken-images") == "1"


def test_a_line_chart_leaves_out_values_that_are_not_finite():
    chart = line_chart([(1, 0.9), (2, float("nan")), (3, float("inf")), (4, 0.5)], "Loss", "loss")
    points = chart.split('<polyline points="')[1].split('"')[0].split()
    assert len(points) == 2 and all(np.isfinite(float(v)) for p in points for v in p.split(","))
    assert "2 values that are not finite (NaN or infinite) are not drawn" in chart
    assert "<polyline" not in line_chart([(1, float("nan"))], "Loss", "loss")


def zoo_payload(model: str, classes: int, criterion: str, data: str, per_class: int) -> dict:
    """A zoo results file by hand: `per_class` images of every class in every variation, on data `data`."""
    provenance = {"num_classes": classes, "data": {"sha256": data * 64}}
    in9 = {name: {"accuracy": 90.0 - 5 * k, "total": per_class * len(NAMES),
                  "per_class": {c: {"total": per_class} for c in NAMES}}
           for k, name in enumerate(VARIATIONS)}
    in9.update(bg_gap=10.0, provenance=provenance)
    return {"model": model, "source": "file", "weights": f"{model}.pt", "in9": in9,
            "challenge": {"challenge_accuracy": 30.0 if classes == 9 else 10.0, "criterion": criterion,
                          "provenance": provenance}}


def leaderboard_paragraphs(markdown: str) -> list[str]:
    """The Markdown leaderboard's paragraphs around its table (its title and plot left out), markup removed."""
    lines = [line for line in markdown.split("\n\n")
             if line.strip() and not line.startswith(("#", "|", "!["))]
    return [line.replace("**", "").replace("`", "").strip() for line in lines]


def html_leaderboard_paragraphs(text: str) -> list[str]:
    section = re.search(r"<section><h2>Leaderboard</h2>(.*?)</section>", text, re.S).group(1)
    return [html.unescape(re.sub(r"<[^>]+>", "", p)).strip() for p in re.findall(r"<p[^>]*>(.*?)</p>", section, re.S)]


def leaderboard_tables(text: str) -> list[list[list[str]]]:
    """The HTML leaderboard's tables in order (leaderboard, leaderboard-2, ...), as cell texts."""
    tables = Page(text).tables
    names = ["leaderboard"] + [f"leaderboard-{i}" for i in range(2, len(tables) + 2) if f"leaderboard-{i}" in tables]
    return [[[t for t, _ in row] for row in tables[name]] for name in names]


def markdown_cells(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|") and "---" not in line]
    return [[re.sub(r"\\(.)", r"\1", c.strip().replace("`", "")) for c in line.strip("|").split(" | ")]
            for line in lines]


def test_rows_made_with_other_settings_are_ranked_apart(tmp_path):
    """Three models of one zoo folder, two measured in fp32 with binary masks and one in bf16 with the original mask
    arithmetic: two tables, each ranking only the rows made alike under a caption that says how they were made,
    and a warning naming the settings that differ; the Markdown and the HTML alike."""
    from tools.results.leaderboard import MARKDOWN_FILE, build_leaderboard  # noqa: PLC0415

    (tmp_path / "models").mkdir()
    for model, precision, arithmetic, accuracy in [("a", "fp32", "binary", 30.0), ("b", "bf16", "original", 40.0),
                                                   ("c", "fp32", "binary", 20.0)]:
        payload = zoo_payload(model, 1000, "any", "a", 4)
        made = {"device": "cpu", "precision": precision, "batch_size": 16}
        payload["in9"]["provenance"] = {**payload["in9"]["provenance"], **made}
        payload["challenge"]["provenance"] = {**payload["in9"]["provenance"], "mask_arithmetic": arithmetic}
        payload["challenge"]["challenge_accuracy"] = accuracy
        (tmp_path / "models" / f"{model}.json").write_text(json.dumps(payload))
    build_leaderboard(tmp_path)
    markdown = (tmp_path / MARKDOWN_FILE).read_text()
    text = write_html(tmp_path / "page.html", leaderboard=tmp_path)
    html_tables = leaderboard_tables(text)
    assert len(html_tables) == 2 and [row for table in html_tables for row in table] == markdown_cells(markdown)
    assert [[row[:2] for row in table[1:]] for table in html_tables] == [[["1", "b"]], [["1", "a"], ["2", "c"]]]
    notes = leaderboard_paragraphs(markdown)
    assert html_leaderboard_paragraphs(text) == notes
    captions = [n for n in notes if n.startswith("Rows measured with")]
    assert captions == ["Rows measured with device cpu, precision bf16, batch size 16, criterion any, mask arithmetic "
                        "original:", "Rows measured with device cpu, precision fp32, batch size 16, criterion any, "
                        "mask arithmetic binary:"]
    assert any("(they differ in precision and mask arithmetic)" in n and "not comparable" in n for n in notes)
    assert "**The measured rows were not all made alike" in markdown  # a warning, in bold
    single = tmp_path / "one"
    (single / "models").mkdir(parents=True)
    (single / "models" / "a.json").write_text((tmp_path / "models" / "a.json").read_text())
    build_leaderboard(single)
    assert "Every measured row was made with device `cpu`, precision `fp32`" in (single / MARKDOWN_FILE).read_text()


@pytest.mark.parametrize("per_class", [4, 450])
def test_the_html_leaderboard_has_the_markdown_columns_and_caveats(tmp_path, per_class):
    """A 9-class model under bg-class beside a 1000-class model under any, on other data: both renderings have
    the same columns, rows and not-comparable notes; the published rows only beside runs on the release."""
    from tools.results.leaderboard import MARKDOWN_FILE, build_leaderboard  # noqa: PLC0415

    (tmp_path / "models").mkdir()
    for model, classes, criterion, data in [("nine", 9, "bg-class", "a"), ("thousand", 1000, "any", "b")]:
        (tmp_path / "models" / f"{model}.json").write_text(json.dumps(
            zoo_payload(model, classes, criterion, data, per_class)))
    build_leaderboard(tmp_path)
    markdown = (tmp_path / MARKDOWN_FILE).read_text()
    text = write_html(tmp_path / "page.html", leaderboard=tmp_path)
    tables = leaderboard_tables(text)
    assert [row for table in tables for row in table] == markdown_cells(markdown)
    assert {"Classes", "Criterion", "Data"} <= set(tables[0][0])
    notes = leaderboard_paragraphs(markdown)
    assert html_leaderboard_paragraphs(text) == notes
    caveats = [n for n in notes if "not comparable" in n]
    assert len(caveats) == 4 and any("9-class" in n for n in caveats) and any("bg-class" in n for n in caveats)
    assert any("(they differ in criterion)" in n for n in caveats)  # ranked apart: one table per criterion
    published = "ResNet-50 | torchvision" in markdown
    assert published == (per_class == 450) == ("IMAGENET1K_V1" in text)


def test_rows_made_on_other_cpus_or_thread_counts_are_ranked_apart(tmp_path):
    """Two results files made alike on the CPU but with another instruction set (torch picks other kernels) or intra-op
    thread count (the sums are split otherwise): the run's arithmetic, which its provenance records (the same that
    keys its saved states), ranks them apart. Before, the provenance said "cpu" alone and one table ranked them."""
    import torch  # noqa: PLC0415

    from tools.results.leaderboard import build_leaderboard  # noqa: PLC0415
    from tools.runtime import Runtime, device_model  # noqa: PLC0415

    recorded = Runtime(torch.device("cpu")).describe()["arithmetic"]
    assert recorded["device"] == device_model(torch.device("cpu"))
    assert recorded["cpu_threads"] == torch.get_num_threads()
    (tmp_path / "models").mkdir()
    for model, capability, threads, accuracy in [("a", "AVX2", 1, 30.0), ("b", "AVX512", 1, 40.0),
                                                 ("c", "AVX2", 2, 20.0)]:
        payload = zoo_payload(model, 1000, "any", "a", 4)
        made = {"device": "cpu", "precision": "fp32", "batch_size": 16,
                "arithmetic": {**recorded, "device": f"cpu ({capability}), torch 2.14.1", "cpu_threads": threads}}
        payload["in9"]["provenance"] = {**payload["in9"]["provenance"], **made}
        payload["challenge"]["provenance"] = {**payload["in9"]["provenance"], "mask_arithmetic": "binary"}
        payload["challenge"]["challenge_accuracy"] = accuracy
        (tmp_path / "models" / f"{model}.json").write_text(json.dumps(payload))
    build_leaderboard(tmp_path)
    tables = leaderboard_tables(write_html(tmp_path / "page.html", leaderboard=tmp_path))
    assert sorted([row[1] for row in table[1:]] for table in tables) == [["a"], ["b"], ["c"]]


def test_rows_made_by_other_versions_are_ranked_apart(tmp_path):
    """Two results files of one zoo folder made alike but by other versions of the toolkit or of torch (an older
    results file kept, a SLURM array task in another environment: another torch picks other kernels, another toolkit
    may compute otherwise): ranked apart, each table's caption naming its versions. Before, one table ranked them."""
    from tools.results.leaderboard import MARKDOWN_FILE, build_leaderboard  # noqa: PLC0415

    (tmp_path / "models").mkdir()
    for model, toolkit, torch_version, accuracy in [("a", "0.1.0", "2.14.1", 30.0), ("b", "0.2.0", "2.14.1", 40.0),
                                                    ("c", "0.1.0", "2.9.0+cu128", 20.0)]:
        payload = zoo_payload(model, 1000, "any", "a", 4)
        made = {"device": "cpu", "precision": "fp32", "batch_size": 16, "toolkit_version": toolkit,
                "torch": torch_version}
        payload["in9"]["provenance"] = {**payload["in9"]["provenance"], **made}
        payload["challenge"]["provenance"] = {**payload["in9"]["provenance"], "mask_arithmetic": "binary"}
        payload["challenge"]["challenge_accuracy"] = accuracy
        (tmp_path / "models" / f"{model}.json").write_text(json.dumps(payload))
    build_leaderboard(tmp_path)
    markdown = (tmp_path / MARKDOWN_FILE).read_text()
    tables = leaderboard_tables(write_html(tmp_path / "page.html", leaderboard=tmp_path))
    assert sorted([row[1] for row in table[1:]] for table in tables) == [["a"], ["b"], ["c"]]
    notes = leaderboard_paragraphs(markdown)
    assert any("(they differ in toolkit and torch)" in n for n in notes)
    assert any(n.startswith("Rows measured with") and "toolkit 0.2.0" in n and "torch 2.14.1" in n for n in notes)
