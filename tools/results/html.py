"""The HTML report: one self-contained page (data-URI thumbnails, inline SVG, a little script to sort tables) with
the Markdown report's numbers (from `tools.results.report`'s pieces), pictures beside their tables."""

from __future__ import annotations

import html
import json
import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from tools import __version__
from tools.errors import UserError
from tools.in9 import VARIATIONS, class_names
from tools.provenance import START_EVAL_DIR, TRAINED_EVAL_DIR, TRAINING_LOG, read_json, write_text_atomic
from tools.results import report
from tools.results.analysis import asr_counts, fooling_confusion, fooling_examples
from tools.results.categories import CATEGORY_TITLES, Category
from tools.results.figures import DataImages, data_uri, square
from tools.results.markdown import inline_html
from tools.results.matrix import load_matrix

log = logging.getLogger(__name__)

THUMB = 80  # pixels, the side of every thumbnail
EXAMPLES_PER_CLASS = 1  # vulnerable foregrounds shown per class, with the composite that fooled them
BAR_WIDTH = 320


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def cell(text, value=None) -> str:
    """A table cell; a number's exact value goes in data-value."""
    attr = "" if value is None else f' data-value="{esc(value)}"'
    return f"<td{attr}>{esc(text)}</td>"


def table(header: list[str], rows: list[list[str]], name: str, sortable: bool = False) -> str:
    """An HTML table of pre-rendered cells (see `cell`); `name` becomes its data-table attribute."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(f"<tr>{''.join(row)}</tr>" for row in rows)
    cls = ' class="sortable"' if sortable else ""
    return f'<table data-table="{esc(name)}"{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def image(uri: str, alt: str, caption: str = "") -> str:
    text = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure><img src="{uri}" alt="{esc(alt)}" width="{THUMB}" height="{THUMB}">{text}</figure>'


def bar_chart(items: list[tuple[str, float | None]], title: str, unit: str = "%", top: float = 100.0) -> str:
    """A horizontal bar per (label, value) as inline SVG, with the values written beside the bars."""
    row = 22
    height = row * len(items) + 8
    parts = [f'<svg role="img" aria-label="{esc(title)}" width="{BAR_WIDTH + 200}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{esc(title)}</title>']
    for k, (label, value) in enumerate(items):
        y = 4 + k * row
        width = 0 if value is None else max(0.0, value) / top * BAR_WIDTH
        text = "not run" if value is None else f"{value:.2f}{unit}"
        parts.append(f'<text x="0" y="{y + 15}" font-size="13">{esc(label)}</text>'
                     f'<rect x="110" y="{y + 3}" width="{width:.1f}" height="15" fill="#3b6fb6"/>'
                     f'<text x="{116 + width:.1f}" y="{y + 15}" font-size="12">{esc(text)}</text>')
    return "".join(parts) + "</svg>"


def line_chart(points: list[tuple[float, float]], title: str, label: str) -> str:
    """One line through (x, y) points as inline SVG; points that are not finite are left out and counted beneath."""
    width, height, pad = 480, 160, 40
    finite = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    left_out = len(points) - len(finite)
    note = (f'<p class="missing">{esc(title)}: {left_out} values that are not finite (NaN or infinite) are not '
            f'drawn.</p>' if left_out else "")
    if not finite:
        return note
    points = finite
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)
    line = " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}" for x, y in points)
    return (f'<svg role="img" aria-label="{esc(title)}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{esc(title)}</title>'
            f'<rect x="{pad}" y="{pad}" width="{width - 2 * pad}" height="{height - 2 * pad}" fill="none" '
            f'stroke="#999"/>'
            f'<polyline points="{line}" fill="none" stroke="#3b6fb6" stroke-width="2"/>'
            f'<text x="{pad}" y="20" font-size="13">{esc(title)}</text>'
            f'<text x="2" y="{pad + 4}" font-size="11">{y1:.3g}</text>'
            f'<text x="2" y="{height - pad}" font-size="11">{y0:.3g}</text>'
            f'<text x="{pad}" y="{height - pad + 16}" font-size="11">step {x0:g}</text>'
            f'<text x="{width - pad}" y="{height - pad + 16}" font-size="11" text-anchor="end">step {x1:g} '
            f'({esc(label)})</text></svg>' + note)


def _section(title: str, body: str) -> str:
    return f"<section><h2>{esc(title)}</h2>{body}</section>"


def _not_run(title: str) -> str:
    return _section(title, f"<p>{report.NOT_RUN}</p>")


# ----------------------------------------------------------------------------------------------------------

def in9_section(in9: dict | None) -> str:
    title = "IN-9 accuracy"
    if not in9:
        return _not_run(title)
    rows, bars = [], []
    for name in VARIATIONS:
        result = in9.get(name)
        if result is None:
            rows.append([cell(name), cell("not run"), cell("")])
            bars.append((name, None))
        else:
            rows.append([cell(name), cell(report.percent(result["accuracy"]), result["accuracy"]),
                         cell(f"{result['correct']} / {result['total']}", result["correct"])])
            bars.append((name, result["accuracy"]))
    gap = in9.get("bg_gap")
    gap_text = "not run (needs both variations)" if gap is None else f"{gap:.2f} points"
    body = [bar_chart(bars, "Accuracy per variation"),
            table(["Variation", "Accuracy", "Correct / total"], rows, "in9"),
            f'<p><strong>BG-gap</strong> (accuracy on mixed_same − mixed_rand): '
            f'<strong data-value="{esc(gap)}" id="bg-gap">{esc(gap_text)}</strong>.</p>']
    published = report.published_beside(in9)
    if published:
        cells = [[cell(text, value) for text, value in zip(report.published_cells(row),
                                                           [None, row.original, row.mixed_same, row.mixed_rand,
                                                            row.bg_gap, row.challenge_accuracy, None])]
                 for row in published]
        body += [f"<p>{esc(report.PUBLISHED_INTRO)}</p>", table(report.PUBLISHED_HEADER, cells, "published", True)]
    return _section(title, "".join(body))


def challenge_section(challenge: dict | None) -> str:
    title = "Backgrounds Challenge"
    if not challenge:
        return _not_run(title)
    accuracy = challenge["challenge_accuracy"]
    rows, bars = [], []
    for name, entry in challenge.get("per_class", {}).items():
        value = report.class_challenge_accuracy(entry)
        rows.append([cell(name), cell(entry["vulnerable"], entry["vulnerable"]), cell(entry["total"], entry["total"]),
                     cell(report.percent(value), value)])
        bars.append((name, value))
    body = [f'<p><strong>Challenge accuracy: <span id="challenge-accuracy" data-value="{esc(accuracy)}">'
            f'{accuracy:.2f}%</span>.</strong> {esc(report.vulnerable_sentence(challenge, markdown=False))}</p>']
    if rows:
        body += [bar_chart(bars, "Challenge accuracy per class"),
                 table(report.CHALLENGE_HEADER, rows, "challenge", True)]
    cost = report.cost_sentence(challenge)
    if cost:
        body.append(f"<p>Cost: {esc(cost)}</p>")
    return _section(title, "".join(body))


def _composite(images: DataImages, fg_image: str, fg_mask: str, bg_image: str, arithmetic: str) -> Image.Image:
    """The composite the model saw, as a thumbnail, under the run's mask `arithmetic`."""
    import torch  # only a --full report composes images  # noqa: PLC0415

    from tools.data.compositing import MaskArithmetic, blend  # noqa: PLC0415
    from tools.data.image_sets import decode_rgb, load_mask  # noqa: PLC0415

    fg, bg = decode_rgb(images.path(fg_image)), decode_rgb(images.path(bg_image))
    mask = load_mask(images.path(fg_mask), MaskArithmetic(arithmetic))
    if mask.dtype == np.bool_:
        pixels = np.where(mask[..., None], fg, bg)
    else:
        fg_t, bg_t = (torch.tensor(a).permute(2, 0, 1)[None] for a in (fg, bg))
        floats = blend(fg_t, bg_t, torch.from_numpy(mask)[None, None])[0].permute(1, 2, 0)
        pixels = floats.mul(255).round().to(torch.uint8).numpy()
    return square(Image.fromarray(pixels), THUMB)


def analysis_section(analysis: dict | None, data_path: Path | None = None) -> str:
    """The analysis with its pictures, read only from inside `data_path` (never a folder the results name)."""
    title = "Adversarial backgrounds"
    if not analysis:
        return _not_run(title)
    names = class_names()
    readable = data_path is not None and Path(data_path).is_dir()
    images = DataImages(Path(data_path) if readable else None)
    body = [f"<p>{esc(report.ASR_DEFINITION)} Over {esc(analysis['foregrounds'])} foregrounds × "
            f"{esc(analysis['backgrounds'])} backgrounds.</p>"]
    if not readable:
        body.append(f'<p class="missing">No data folder at {esc(data_path or "(none given)")} (--data-path), so the '
                    f"images are not shown; the numbers are.</p>")
    rows, grid = [], []
    for name, info in analysis["per_class"].items():
        tops = info["top_backgrounds"]
        rows.append([cell(name), cell(report.fraction_percent(info["fool_rate"]), info["fool_rate"]),
                     cell(info["backgrounds"], info["backgrounds"]),
                     cell(report.fraction_percent(info["mean_asr"]), info["mean_asr"]),
                     cell(report.fraction_percent(info["max_asr"]), info["max_asr"]),
                     cell(", ".join(f"{e['stem']} {report.fraction_percent(e['asr'])}" for e in tops) or "–")])
        pictures = []
        for e in tops:
            thumb = images.thumbnail(e["image"], THUMB) if readable else None
            caption = f"ASR {report.fraction_percent(e['asr'])}"
            pictures.append(image(data_uri(thumb), f"{name} background {e['stem']}, {caption}", caption)
                            if thumb is not None else f"<figure><figcaption>{esc(e['stem'])}: {esc(caption)}"
                                                      f"</figcaption></figure>")
        grid.append(f'<div class="row"><div class="label">{esc(name)}</div>{"".join(pictures)}</div>')
    body += [f"<h3>Top-{esc(analysis['top_k'])} backgrounds per class (ASR)</h3>",
             f'<div class="grid">{"".join(grid)}</div>',
             table(["Class", "Fool rate", "Backgrounds", "Mean ASR", "Max ASR", "Top backgrounds (ASR)"], rows,
                   "analysis", True)]
    body.append(_matrix_parts(analysis, names, images if readable else None))
    images.warn()
    return _section(title, "".join(body))


def _top_indices(analysis: dict, matrix) -> np.ndarray:
    """The top backgrounds' columns in the matrix, checked to be the backgrounds the analysis names."""
    indices = []
    for info in analysis["per_class"].values():
        for e in info["top_backgrounds"]:
            index = e.get("index")
            if not (isinstance(index, int) and 0 <= index < len(matrix.bg_stems)
                    and matrix.bg_stems[index] == e.get("stem")):
                raise UserError(f"the analysis in {analysis['output_dir']} names background {e.get('stem')!r} at index "
                                f"{index!r}, which is not that column of the saved matrix there (of "
                                f"{len(matrix.bg_stems)} backgrounds); rerun `python -m tools.results.analysis "
                                f"{analysis['output_dir']}`")
            indices.append(index)
    return np.array(indices, dtype=np.int64)


def _matrix_parts(analysis: dict, names: list[str], images: DataImages | None) -> str:
    """The fooling examples and the confusion under the fooling backgrounds, from the saved matrix."""
    try:
        matrix = load_matrix(analysis["output_dir"])
    except (KeyError, UserError) as exc:
        return f'<p class="missing">The saved prediction matrix is not readable ({esc(exc)}): no examples.</p>'
    p, fg, bg = matrix.predictions, matrix.fg_labels, matrix.bg_labels
    examples = []
    arithmetic = matrix.meta.get("provenance", {}).get("mask_arithmetic", "binary")
    criterion = matrix.meta.get("criterion") or "any"
    for i, j in fooling_examples(p, fg, bg, asr_counts(p, fg, bg)[0], EXAMPLES_PER_CLASS, criterion):
        predicted = names[p[i, j]] if p[i, j] >= 0 else "outside IN-9"
        caption = f"{names[fg[i]]} → {predicted}"
        alt = f"{names[fg[i]]} foreground {matrix.fg_stems[i]} on {names[bg[j]]} background {matrix.bg_stems[j]}, " \
              f"predicted {predicted}"
        why = None if images is not None and matrix.fg_images else ""
        if why is None:
            try:
                examples.append(image(data_uri(_composite(images, matrix.fg_images[i], matrix.fg_masks[i],
                                                          matrix.bg_images[j], arithmetic)), alt, caption))
                continue
            except UserError as exc:  # this composite's files are missing or unreadable: its text stands alone
                why = f'<span class="missing">composite not shown: {esc(exc)}</span>'
        examples.append(f"<figure><figcaption>{esc(alt)}</figcaption>{why}</figure>")
    backgrounds = _top_indices(analysis, matrix)
    confusion = fooling_confusion(p, fg, bg, backgrounds)
    columns = [*names, "outside IN-9"]
    rows = [[cell(names[r]), *(cell(int(n), int(n)) for n in confusion[r])] for r in range(len(names))]
    return (f"<h3>Vulnerable foregrounds and the composite that fooled them</h3>"
            f'<div class="grid examples">{"".join(examples) or "<p>No foreground was fooled.</p>"}</div>'
            f"<h3>Foreground class (rows) against predicted class (columns) on the top fooling backgrounds of the "
            f"other classes</h3>" + table(["Foreground \\ predicted", *columns], rows, "confusion"))


def categories_section(categories: dict | None) -> str:
    title = "Prediction categories"
    if not categories:
        return _not_run(title)
    v = categories["variations"]
    rows = []
    for name, entry in [("all", categories["overall"]), *categories["per_class"].items()]:
        rows.append([cell(name), cell(entry["images"], entry["images"]),
                     *(cell(f"{report.percent(entry['percent'][c.value], 1)} ({entry['counts'][c.value]})",
                            entry["counts"][c.value]) for c in Category)])
    bars = [(CATEGORY_TITLES[c], categories["overall"]["percent"][c.value]) for c in Category]
    body = (f"<p>Each image by how its prediction depends on the background (the paper's Table 3): full image "
            f"{esc(v['full'])}, foreground on a random background {esc(v['foreground'])}, background alone "
            f"{esc(v['background'])}. The results hold counts, not images.</p>"
            + bar_chart(bars, "Share of all images per category")
            + table(["Class", "Images", *(CATEGORY_TITLES[c] for c in Category)], rows, "categories", True))
    return _section(title, body)


def provenance_section(sources: list[tuple[str, dict]]) -> str:
    found = report.provenance_table(sources, markdown=False)
    if found is None:
        return _section("Provenance", "<p>No provenance recorded.</p>")
    header, rows = found
    return _section("Provenance", table(header, [[cell(c) for c in row] for row in rows], "provenance"))


STYLE = """
body{font-family:sans-serif;margin:24px;color:#141414;max-width:1100px}
table{border-collapse:collapse;margin:8px 0 16px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
td[data-value]{text-align:right}td{overflow-wrap:anywhere}td:first-child{overflow-wrap:normal}
th:first-child,td:first-child{text-align:left}table.sortable th{cursor:pointer;background:#f2f2f2}
figure{display:inline-block;margin:4px;text-align:center;font-size:12px;vertical-align:top}
.row{display:flex;align-items:center}.label{width:110px;font-weight:bold}.missing{color:#a33}
.warning{font-weight:bold;color:#a33}
"""
# Sorting by a header click: the clicked header's own column (cellIndex, per table); cells with a number (their
# data-value) first, by number, then the others ("–", names) by text; a second click reverses the order, numbers
# still first. And a record of images that did not decode.
SCRIPT = """
function sortKey(tr, col) {
  var c = tr.cells[col], v = c ? parseFloat(c.dataset.value) : NaN;
  return {number: isFinite(v) ? v : null, text: c ? c.textContent.trim() : ''};
}
document.querySelectorAll('table.sortable th').forEach(function (th) {
  th.addEventListener('click', function () {
    var col = th.cellIndex, body = th.closest('table').tBodies[0], up = th.dataset.order !== 'up';
    var sign = up ? 1 : -1;
    Array.from(body.rows).sort(function (a, b) {
      var x = sortKey(a, col), y = sortKey(b, col);
      if ((x.number === null) !== (y.number === null)) { return x.number === null ? 1 : -1; }
      if (x.number !== null) { return (x.number - y.number) * sign; }
      return x.text.localeCompare(y.text) * sign;
    }).forEach(function (tr) { body.appendChild(tr); });
    th.dataset.order = up ? 'up' : 'down';
  });
});
window.addEventListener('load', function () {
  document.body.dataset.brokenImages = Array.from(document.images).filter(function (img) {
    return !img.complete || img.naturalWidth === 0; }).length;
});
"""


WARNING = ' class="warning"'


def leaderboard_section(output_dir: Path | None) -> str:
    """The zoo's leaderboard as leaderboard.md has it (`leaderboard.leaderboard_table`), beside its scatter plot."""
    if output_dir is None:
        return ""
    from tools.results import leaderboard  # only a zoo report reads the zoo's results  # noqa: PLC0415

    rows, withheld = leaderboard.leaderboard_rows(output_dir)
    board = leaderboard.leaderboard_table(rows, withheld)
    with tempfile.TemporaryDirectory() as folder:
        plot = Path(folder) / leaderboard.PLOT_FILE
        leaderboard.draw_plot(rows, plot)
        with Image.open(plot) as img:
            uri = data_uri(img.convert("RGB"), "PNG")
    tables = ""
    for index, group in enumerate(board.tables, 1):  # one per group of rows made alike, each sortable alone
        cells = [[cell(c.text, c.value) for c in row] for row in group.rows]
        caption = f"<p>{inline_html(group.caption)}</p>" if group.caption else ""
        tables += caption + table(group.header, cells, "leaderboard" if index == 1 else f"leaderboard-{index}",
                                           True)
    notes = "".join(f"<p{WARNING if note.warning else ''}>{inline_html(note.text)}</p>" for note in board.notes)
    body = (f"<p>{inline_html(board.intro)}</p>"
            f'<img src="{uri}" alt="BG-gap against challenge accuracy, one point per model with both (the tables '
            f'below hold the numbers)">' + tables + notes)
    return f"<section><h2>Leaderboard</h2>{body}</section>"


def _read_json(path: Path) -> dict | None:
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}; rerun train.py with --eval-data") from None


STEP_KEYS = ("step", "epoch", "loss", "accuracy", "lr")  # what a step's line of train_log.jsonl holds


def _step_record(line: str) -> dict | None:
    """A step's record from a line of train_log.jsonl; None for events and for a line cut short."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    numbers = isinstance(record, dict) and all(isinstance(record.get(k), (int, float)) for k in STEP_KEYS)
    return record if numbers else None


def training_section(output_dir: Path | None, results: tuple[dict, dict | None] | None = None) -> str:
    """A train.py --eval-data run: its curves and the starting point against the trained model. `results`: the
    evaluations train.py just made, else read from the run's folder."""
    if output_dir is None:
        return ""
    output_dir = Path(output_dir)
    if results is None:
        evaluated = {name: {"in9": _read_json(output_dir / name / "in9.json"),
                            "challenge": _read_json(output_dir / name / "challenge.json")}
                     for name in (TRAINED_EVAL_DIR, START_EVAL_DIR)}
        if evaluated[TRAINED_EVAL_DIR]["in9"] is None:
            raise UserError(f"{output_dir} holds no {TRAINED_EVAL_DIR}/in9.json; pass the --output-dir of a train.py "
                            f"run with --eval-data")
        start = evaluated[START_EVAL_DIR]
        results = (evaluated[TRAINED_EVAL_DIR], start if start["in9"] is not None else None)
    trained, start = results
    try:
        lines = (output_dir / TRAINING_LOG).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    steps = [r for r in map(_step_record, lines) if r is not None]
    parts = []
    if steps:
        parts += [line_chart([(r["step"], r["loss"]) for r in steps], "Training loss per step", "loss"),
                  line_chart([(r["step"], 100 * r["accuracy"]) for r in steps],
                                      "Training accuracy per step (%)", "accuracy (%)")]
        rows = [[cell(r["step"], r["step"]), cell(r["epoch"], r["epoch"]),
                 cell(f"{r['loss']:.4f}", r["loss"]), cell(f"{100 * r['accuracy']:.2f}%", r["accuracy"]),
                 cell(f"{r['lr']:.3g}", r["lr"])] for r in steps]
        parts.append("<details><summary>Every logged step</summary>"
                     + table(["Step", "Epoch", "Loss", "Accuracy", "Learning rate"], rows, "training", True)
                     + "</details>")
    else:
        parts.append(f"<p>No {TRAINING_LOG} under {esc(output_dir)}: no curves.</p>")
    rows, bars = [], []
    for label, before, after in report.before_after(trained, start):
        shown = report.points if label == report.BG_GAP else report.percent
        rows.append([cell(label), cell(shown(before), before), cell(shown(after), after),
                     cell(report.change(before, after))])
        if label != report.BG_GAP:
            bars += [(f"{label} start", before), (f"{label} trained", after)] if start else [(label, after)]
    parts += ["<h3>Starting point against trained model</h3>", bar_chart(bars, "Accuracy before and after"),
              table(["", "Starting point", "Trained", "Change"], rows, "before-after")]
    if start is None:
        parts.append("<p>The starting point (random weights) was not evaluated.</p>")
    return f"<section><h2>Training</h2>{''.join(parts)}</section>"


def render_html(in9: dict | None = None, challenge: dict | None = None, analysis: dict | None = None,
                categories: dict | None = None, warnings: Sequence[str] = (), leaderboard: Path | None = None,
                training: Path | None = None, training_results: tuple[dict, dict | None] | None = None,
                data_path: Path | None = None) -> str:
    """The report as one HTML page; `leaderboard`: a zoo --output-dir, `training`: a train.py --output-dir,
    `data_path`: the data folder the analysis's pictures are read from (None: no pictures)."""
    parts = [f"<p>Written by bg-challenge-toolkit {__version__} from its results files. IN-9 classes: "
             f"{esc(', '.join(class_names()))}.</p>"]
    parts += [f'<p class="warning">Warning: {esc(w)}.</p>' for w in warnings]
    parts.append(training_section(training, training_results))
    parts += [in9_section(in9), challenge_section(challenge), analysis_section(analysis, data_path),
              categories_section(categories), leaderboard_section(leaderboard),
              provenance_section(report.provenance_sources(in9, challenge, analysis, categories))]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Backgrounds Challenge report"
            f"</title><style>{STYLE}</style></head><body><h1>Backgrounds Challenge report</h1>{''.join(parts)}"
            f"<script>{SCRIPT}</script></body></html>\n")


def write_html(path: Path | str, in9: dict | None = None, challenge: dict | None = None, analysis: dict | None = None,
               categories: dict | None = None, warnings: Sequence[str] = (), leaderboard: Path | None = None,
               training: Path | None = None, training_results: tuple[dict, dict | None] | None = None,
               data_path: Path | None = None) -> str:
    text = render_html(in9, challenge, analysis, categories, warnings, leaderboard, training, training_results,
                       data_path)
    write_text_atomic(Path(path), text)
    return text
