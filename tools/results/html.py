"""The HTML report: one self-contained page (thumbnails as data URIs, inline SVG charts, no network, a few lines
of script to sort tables) holding what the Markdown report holds, in pictures beside their numbers.

The sections are in `tools.results.html_sections`; the numbers come from `tools.results.report`'s pieces.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from tools import __version__
from tools.errors import UserError
from tools.in9 import class_names
from tools.provenance import START_EVAL_DIR, TRAINED_EVAL_DIR, TRAINING_LOG, read_json, write_text_atomic
from tools.results import html_sections as sections
from tools.results import report
from tools.results.markdown import inline_html

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
    """The zoo's leaderboard as a sortable table beside its scatter plot: the columns, cells and caveat notes of
    leaderboard.md (`leaderboard.leaderboard_table`), the published rows gated as there."""
    if output_dir is None:
        return ""
    from tools.results import leaderboard  # only a zoo report reads the zoo's results  # noqa: PLC0415

    rows, withheld = leaderboard.leaderboard_rows(output_dir)
    board = leaderboard.leaderboard_table(rows, withheld)
    with tempfile.TemporaryDirectory() as folder:
        plot = Path(folder) / leaderboard.PLOT_FILE
        leaderboard.draw_plot(rows, plot)
        with Image.open(plot) as img:
            uri = sections.data_uri(img.convert("RGB"), "PNG")
    tables = ""
    for index, table in enumerate(board.tables, 1):  # one per group of rows made alike, each sortable alone
        cells = [[sections.cell(c.text, c.value) for c in row] for row in table.rows]
        caption = f"<p>{inline_html(table.caption)}</p>" if table.caption else ""
        tables += caption + sections.table(table.header, cells, "leaderboard" if index == 1 else f"leaderboard-{index}",
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
    """A step's record from a line of train_log.jsonl; None for events and for a line cut short (a run stopped
    while writing it), which the training loop also drops."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    numbers = isinstance(record, dict) and all(isinstance(record.get(k), (int, float)) for k in STEP_KEYS)
    return record if numbers else None


def training_section(output_dir: Path | None, results: tuple[dict, dict | None] | None = None) -> str:
    """A train.py --eval-data run: its loss and accuracy curves and the starting point against the trained model.

    `results`: the run's (trained, starting point or None) evaluations, each {'in9', 'challenge'}, as train.py
    just made them; without them they are read from the run's folder."""
    if output_dir is None:
        return ""
    output_dir = Path(output_dir)
    if results is None:
        evaluated = {name: {"in9": _read_json(output_dir / name / "in9.json"),
                            "challenge": _read_json(output_dir / name / "challenge.json")}
                     for name in (TRAINED_EVAL_DIR, START_EVAL_DIR)}
        if evaluated[TRAINED_EVAL_DIR]["in9"] is None:
            raise UserError(f"{output_dir} holds no {TRAINED_EVAL_DIR}/in9.json; pass the --output-dir of a train.py run "
                            f"with --eval-data")
        results = (evaluated[TRAINED_EVAL_DIR], evaluated[START_EVAL_DIR] if evaluated[START_EVAL_DIR]["in9"] is not None else None)
    trained, start = results
    try:
        lines = (output_dir / TRAINING_LOG).read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    steps = [r for r in map(_step_record, lines) if r is not None]
    parts = []
    if steps:
        parts += [sections.line_chart([(r["step"], r["loss"]) for r in steps], "Training loss per step", "loss"),
                  sections.line_chart([(r["step"], 100 * r["accuracy"]) for r in steps],
                                      "Training accuracy per step (%)", "accuracy (%)")]
        rows = [[sections.cell(r["step"], r["step"]), sections.cell(r["epoch"], r["epoch"]),
                 sections.cell(f"{r['loss']:.4f}", r["loss"]), sections.cell(f"{100 * r['accuracy']:.2f}%", r["accuracy"]),
                 sections.cell(f"{r['lr']:.3g}", r["lr"])] for r in steps]
        parts.append("<details><summary>Every logged step</summary>"
                     + sections.table(["Step", "Epoch", "Loss", "Accuracy", "Learning rate"], rows, "training", True)
                     + "</details>")
    else:
        parts.append(f"<p>No {TRAINING_LOG} under {sections.esc(output_dir)}: no curves.</p>")
    rows, bars = [], []
    for label, before, after in report.before_after(trained, start):
        shown = report.points if label == report.BG_GAP else report.percent
        rows.append([sections.cell(label), sections.cell(shown(before), before), sections.cell(shown(after), after),
                     sections.cell(report.change(before, after))])
        if label != report.BG_GAP:
            bars += [(f"{label} start", before), (f"{label} trained", after)] if start else [(label, after)]
    parts += ["<h3>Starting point against trained model</h3>", sections.bar_chart(bars, "Accuracy before and after"),
              sections.table(["", "Starting point", "Trained", "Change"], rows, "before-after")]
    if start is None:
        parts.append("<p>The starting point (random weights) was not evaluated.</p>")
    return f"<section><h2>Training</h2>{''.join(parts)}</section>"


def render_html(in9: dict | None = None, challenge: dict | None = None, analysis: dict | None = None,
                categories: dict | None = None, warnings: Sequence[str] = (), leaderboard: Path | None = None,
                training: Path | None = None, training_results: tuple[dict, dict | None] | None = None,
                data_path: Path | None = None) -> str:
    """The report as one HTML page; `leaderboard` is a zoo --output-dir to add its leaderboard, `training` a
    train.py --output-dir (of a run with --eval-data) to add its curves and before/after table (from
    `training_results`, see `training_section`, when given); `data_path` the data folder the analysis's pictures
    are read from (only files inside it; None: no pictures)."""
    parts = [f"<p>Written by bg-challenge-toolkit {__version__} from its results files. IN-9 classes: "
             f"{sections.esc(', '.join(class_names()))}.</p>"]
    parts += [f'<p class="warning">Warning: {sections.esc(w)}.</p>' for w in warnings]
    parts.append(training_section(training, training_results))
    parts += [sections.in9_section(in9), sections.challenge_section(challenge), sections.analysis_section(analysis, data_path),
              sections.categories_section(categories), leaderboard_section(leaderboard),
              sections.provenance_section(report.provenance_sources(in9, challenge, analysis, categories))]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Backgrounds Challenge report"
            f"</title><style>{STYLE}</style></head><body><h1>Backgrounds Challenge report</h1>{''.join(parts)}"
            f"<script>{SCRIPT}</script></body></html>\n")


def write_html(path: Path | str, in9: dict | None = None, challenge: dict | None = None, analysis: dict | None = None,
               categories: dict | None = None, warnings: Sequence[str] = (), leaderboard: Path | None = None,
               training: Path | None = None, training_results: tuple[dict, dict | None] | None = None,
               data_path: Path | None = None) -> str:
    """Write the HTML report to `path` (atomically) and return its text (`render_html`)."""
    text = render_html(in9, challenge, analysis, categories, warnings, leaderboard, training, training_results,
                       data_path)
    write_text_atomic(Path(path), text)
    return text
