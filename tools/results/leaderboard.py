"""The leaderboard: one row per model from the zoo's results files, plus the published rows, as Markdown, CSV and
a PNG plot of BG-gap against challenge accuracy. One table model (`leaderboard_table`) feeds leaderboard.md and the
HTML report; rows are ranked only beside rows made alike (docs/zoo.md, "The leaderboard")."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

from tools.errors import UserError
from tools.in9 import NUM_IN9_CLASSES, RELEASE_IMAGES_PER_CLASS, VARIATIONS, Variation
from tools.provenance import read_json, write_text_atomic
from tools.results.figures import (
    AXIS,
    GRID,
    TEXT,
    Box,
    default_font,
    draw_text,
    free_text_position,
    new_canvas,
    paste_vertical_text,
    save_png,
)
from tools.results.markdown import code, escape, markdown_table
from tools.results.run_settings import differing_settings, parse_settings, run_settings, settings_text

log = logging.getLogger(__name__)

MEASURED, PUBLISHED = "measured", "published"
MODELS_FOLDER = "models"
MARKDOWN_FILE, CSV_FILE, PLOT_FILE = "leaderboard.md", "leaderboard.csv", "leaderboard.png"
PLOT_SIZE = (960, 640)
HASH_CHARS = 12


@dataclass
class Row:
    model: str
    source: str
    weights: str | None
    original: float | None
    mixed_same: float | None
    mixed_rand: float | None
    bg_gap: float | None
    challenge_accuracy: float | None
    provenance_sha256: str | None
    kind: str  # measured or published
    reference: str | None = None  # where a published row is quoted from
    data_sha256: str | None = None  # the data fingerprint a measured row was computed on
    criterion: str | None = "any"  # the challenge's criterion
    classes: int | None = None  # what the model predicts over: 1000 ImageNet classes (mapped) or the 9 of IN-9
    zero_shot: str | None = None  # a CLIP row's head and templates, e.g. "imagenet, openai templates"
    weights_sha256: str | None = None  # short: of the weights file, else the model's identity (a random CLIP)
    note: str | None = None  # how a published row's source ran the model, where it differs from the scripts
    settings: str | None = None  # how a measured row was made (`run_settings`, `settings_text`)


COLUMNS = [f.name for f in fields(Row)]


def provenance_hash(payload: dict) -> str:
    """A short SHA-256 of a results file's provenance (both runs), canonical JSON."""
    prov = {run: payload.get(run, {}).get("provenance") for run in ("in9", "challenge")}
    return hashlib.sha256(json.dumps(prov, sort_keys=True).encode()).hexdigest()[:HASH_CHARS]


def _accuracy(in9: dict, variation: Variation) -> float | None:
    entry = in9.get(variation.value)
    return None if entry is None else entry["accuracy"]


def _zero_shot(provenance: dict) -> str | None:
    head = provenance.get("zero_shot")
    return None if not head else f"{head['head']}, {head['templates']} templates"


def _weights_hash(payload: dict) -> str | None:
    """The weights file's SHA-256, else the model's identity (a random CLIP), short."""
    digest = payload.get("weights_file_sha256") or (payload.get("identity") or {}).get("model")
    return digest[:HASH_CHARS] if digest else None


def measured_row(payload: dict) -> Row:
    in9, challenge = payload.get("in9") or {}, payload.get("challenge") or {}
    provenance = in9.get("provenance") or challenge.get("provenance") or {}
    data = provenance.get("data") or {}
    return Row(payload["model"], payload["source"], payload.get("weights"), _accuracy(in9, Variation.ORIGINAL),
               _accuracy(in9, Variation.MIXED_SAME), _accuracy(in9, Variation.MIXED_RAND), in9.get("bg_gap"),
               challenge.get("challenge_accuracy"), provenance_hash(payload), MEASURED, None, data.get("sha256"),
               challenge.get("criterion"), provenance.get("num_classes"), _zero_shot(provenance),
               _weights_hash(payload), settings=settings_text(run_settings(payload)))


def published_rows() -> list[Row]:
    """The published reference rows shipped with the package."""
    text = resources.files("tools.resources").joinpath("published.json").read_text(encoding="utf-8")
    return [Row(**entry, provenance_sha256=None, kind=PUBLISHED) for entry in json.loads(text)["rows"]]


def read_results(output_dir: Path) -> list[dict]:
    """Every per-model results file under output_dir/models, sorted by file name."""
    folder = Path(output_dir) / MODELS_FOLDER
    if not folder.is_dir():
        raise UserError(f"{output_dir} holds no zoo results (no {MODELS_FOLDER}/ folder); pass the --output-dir of "
                        f"a `python -m tools.zoo` run")
    payloads = []
    for path in sorted(folder.glob("*.json")):
        try:
            payload = read_json(path)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read the results file {path}: {exc}; delete it and rerun its model") from None
        if not isinstance(payload, dict) or "model" not in payload:
            raise UserError(f"{path} is not a zoo results file (no 'model' key); move it out of {folder}")
        payloads.append(payload)
    return payloads


def used_release(in9: dict) -> bool:
    """Whether an IN-9 run evaluated the whole test release (only such a run compares with the published rows)."""
    ran = [in9[name] for name in VARIATIONS if in9.get(name)]
    return bool(ran) and all(
        isinstance(result.get("per_class"), dict) and len(result["per_class"]) == NUM_IN9_CLASSES
        and all(isinstance(entry, dict) and entry.get("total") == RELEASE_IMAGES_PER_CLASS
                for entry in result["per_class"].values())
        for result in ran)


def leaderboard_rows(output_dir: Path | str, include_published: bool = True) -> tuple[list[Row], bool]:
    """The sorted rows of a zoo output folder, and whether the published rows were withheld (`used_release`)."""
    payloads = read_results(Path(output_dir))
    rows = [measured_row(payload) for payload in payloads]
    withheld = include_published and not all(used_release(p.get("in9") or {}) for p in payloads)
    if include_published and not withheld:
        rows += published_rows()
    return sort_rows(rows), withheld


def sort_rows(rows: list[Row]) -> list[Row]:
    """Best challenge accuracy first; rows without one last, then by original accuracy; ties by name."""
    def key(row: Row):
        return (row.challenge_accuracy is None, -(row.challenge_accuracy or 0.0),
                row.original is None, -(row.original or 0.0), row.model)
    return sorted(rows, key=key)


# ----------------------------------------------------------------------------------------------------------
# Tables

@dataclass(frozen=True)
class Cell:
    text: str
    value: float | None = None  # a number's exact value (the HTML sorts by it)
    code: bool = False  # a hash: set as code


@dataclass(frozen=True)
class Note:
    text: str  # Markdown: names from the results files through `escape` and `code` (the HTML renders its code spans)
    warning: bool = False  # a comparability caveat: set in bold


@dataclass(frozen=True)
class Table:
    """One ranking of rows made alike: what its caption says they were made with, its columns and rows of cells."""
    caption: str  # `code` spans allowed
    header: list[str]
    align: str  # l or r per column
    rows: list[list[Cell]]


@dataclass(frozen=True)
class Leaderboard:
    """The leaderboard as both renderings show it: intro, one table per settings group, notes."""
    intro: str
    tables: list[Table]
    notes: list[Note]


def _number(value) -> Cell:
    return Cell("–" if value is None else f"{value:.2f}", value)


def _hash(digest: str | None) -> Cell:
    return Cell(digest[:HASH_CHARS], code=True) if digest else Cell("–")


def _classes(row: Row) -> Cell:
    if row.classes is None:
        return Cell("–")
    return Cell(f"{row.classes} (CLIP {row.zero_shot})" if row.zero_shot else str(row.classes), row.classes)


def classes_notes(rows: list[Row]) -> list[Note]:
    """What the Classes column means, for the class counts and CLIP heads the rows have."""
    notes = []
    if len({row.classes for row in rows if row.classes is not None}) > 1:
        notes.append(Note("Classes: what a model predicts over. A 1000-class model's prediction goes through the "
                          "ImageNet→IN-9 map, and one of the 630 ImageNet classes outside the nine groups is wrong; a "
                          "9-class model (trained on IN-9, or CLIP's `in9` head) can never be wrong that way, so the "
                          "9-class rows are not comparable with the 1000-class rows.", True))
    if any(row.zero_shot for row in rows):
        notes.append(Note("CLIP rows are zero-shot: each class's prompts (its name in every template) are encoded by "
                          "CLIP's text tower and averaged into one row of a fixed head. The `imagenet` head "
                          "scores over open_clip's 1000 ImageNet class names (CLIP's standard ImageNet classifier) "
                          "through the same map as every 1000-class model; the `in9` head over nine prompts, one set "
                          "per IN-9 class by its full name. Templates: `openai` (CLIP's 80) or `simple` "
                          "(open_clip's 7)."))
    return notes


SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


def note_marks(rows: list[Row]) -> dict[str, str]:
    """A superscript mark for each distinct note, in the order the rows first give it."""
    notes = list(dict.fromkeys(row.note for row in rows if row.note))
    return {note: SUPERSCRIPTS[i] if i < len(SUPERSCRIPTS) else f"^{i + 1}" for i, note in enumerate(notes)}


HEADER = ["#", "Model", "Source", "Weights", "Weights SHA-256", "Classes", "Criterion", "Original", "Mixed-Same",
          "Mixed-Rand", "BG-gap", "Challenge", "Kind", "Data", "Provenance"]
ALIGN = "rlllllllrrrrlll"
INTRO = ("Accuracies in percent on the IN-9 variations and the challenge (under the Criterion column's criterion); "
         "BG-gap = mixed_same − mixed_rand in points. Sorted by challenge accuracy; rows without a challenge number "
         "come last. published rows are quoted from their sources, measured rows were computed by this toolkit "
         "(Data: the short SHA-256 fingerprint of the data; Provenance: a hash of the results file's provenance).")


def settings_groups(rows: list[Row]) -> list[list[Row]]:
    """One group per distinct `settings` of the measured rows, in first-seen order, each with the published rows."""
    settings = list(dict.fromkeys(row.settings for row in rows if row.kind == MEASURED))
    if len(settings) <= 1:
        return [rows]
    return [[row for row in rows if row.kind != MEASURED or row.settings == group] for group in settings]


def _caption(settings: str | None, several: bool) -> str:
    text = ", ".join(f"{label} {code(value)}" for label, value in parse_settings(settings).items())
    text = text or "settings not recorded"
    return f"Rows measured with {text}:" if several else f"Every measured row was made with {text}."


def leaderboard_table(rows: list[Row], published_withheld: bool = False) -> Leaderboard:
    """The leaderboard's tables, cells and caveats, built once for leaderboard.md and the HTML report."""
    marks, tables = note_marks(rows), []
    groups = settings_groups(rows)
    for group in groups:
        cells = []
        for rank, row in enumerate(group, 1):
            provenance = _hash(row.provenance_sha256) if row.provenance_sha256 else Cell(row.reference or "–")
            cells.append([Cell(str(rank), rank), Cell(row.model), Cell(row.source or "–"), Cell(row.weights or "–"),
                          _hash(row.weights_sha256), _classes(row), Cell(row.criterion or "–"), _number(row.original),
                          _number(row.mixed_same), _number(row.mixed_rand), _number(row.bg_gap),
                          _number(row.challenge_accuracy),
                          Cell(f"{row.kind} {marks[row.note]}" if row.note else row.kind), _hash(row.data_sha256),
                          provenance])
        measured = next((row.settings for row in group if row.kind == MEASURED), None)
        caption = _caption(measured, len(groups) > 1) if any(row.kind == MEASURED for row in group) else ""
        tables.append(Table(caption, HEADER, ALIGN, cells))
    notes = [Note(f"{mark} {', '.join(escape(row.model) for row in rows if row.note == note)}: {escape(note)}.")
             for note, mark in marks.items()]
    if len(groups) > 1:
        differ = differing_settings([row.settings for row in rows if row.kind == MEASURED])
        listed = " and ".join([", ".join(differ[:-1]), differ[-1]] if len(differ) > 1 else differ)
        notes.append(Note(f"The measured rows were not all made alike (they differ in {listed}): each table ranks "
                          f"the rows made alike, and rows of different tables are not comparable.", True))
    notes += classes_notes(rows)
    fingerprints = sorted({row.data_sha256 for row in rows if row.kind == MEASURED and row.data_sha256})
    if fingerprints:
        notes.append(Note("Measured on data with SHA-256 fingerprint " + ", ".join(code(f) for f in fingerprints)
                          + "."))
        if len(fingerprints) > 1:
            notes.append(Note("The measured rows come from different data: they are not comparable.", True))
    others = sorted({row.criterion for row in rows if row.criterion not in (None, "any")})
    if others:
        notes.append(Note(f"Some measured rows use the challenge criterion {', '.join(map(code, others))}, not "
                          f"`any`: their challenge accuracy is not comparable (the Criterion column).", True))
    if published_withheld:
        notes.append(Note(f"The published rows are left out: they compare only with runs on the release's test set "
                          f"({RELEASE_IMAGES_PER_CLASS} images of every class in every variation), and some measured "
                          f"rows are not."))
    return Leaderboard(INTRO, tables, notes)


def render_markdown(rows: list[Row], published_withheld: bool = False) -> str:
    board = leaderboard_table(rows, published_withheld)
    out = ["# Backgrounds Challenge leaderboard", "", board.intro]
    for table in board.tables:
        cells = [[code(c.text) if c.code else escape(c.text) for c in row] for row in table.rows]
        out += ["", table.caption, ""] if table.caption else [""]
        out += markdown_table(table.header, cells, table.align)
    for note in board.notes:
        out += ["", f"**{note.text}**" if note.warning else note.text]
    out += ["", f"![BG-gap against challenge accuracy]({PLOT_FILE})", ""]
    return "\n".join(out)


def render_csv(rows: list[Row]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------------------------
# The plot

COLORS = {MEASURED: (31, 100, 180), PUBLISHED: (220, 110, 20)}
MARGIN = (80, 50, 40, 70)  # left, top, right, bottom


def nice_ticks(low: float, high: float, count: int = 8) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 times a power of ten) covering [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    ticks = [round(math.floor(low / step) * step, 10)]
    while ticks[-1] < high:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _marker(draw, x: float, y: float, kind: str) -> None:
    """A disc for a measured row, a square for a published one."""
    shape = draw.rectangle if kind == PUBLISHED else draw.ellipse
    shape([x - 5, y - 5, x + 5, y + 5], fill=COLORS[kind])


def draw_plot(rows: list[Row], path: Path | str) -> list[Row]:
    """BG-gap (x) against challenge accuracy (y), one labelled point per row that has both; returns those rows."""
    points = [r for r in rows if r.bg_gap is not None and r.challenge_accuracy is not None]
    width, height = PLOT_SIZE
    left, top, right, bottom = MARGIN
    canvas, draw = new_canvas(PLOT_SIZE)
    font, small = default_font(14), default_font(12)
    xs = [r.bg_gap for r in points] or [0.0, 10.0]
    ys = [r.challenge_accuracy for r in points] or [0.0, 100.0]
    x_ticks = nice_ticks(min(0.0, min(xs)), max(xs))
    y_ticks = nice_ticks(0.0, max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def to_pixel(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))

    for x in x_ticks:
        px, _ = to_pixel(x, y0)
        draw.line([(px, top), (px, height - bottom)], fill=GRID)
        draw_text(draw, (px, height - bottom + 6), f"{x:g}", small, "mt")
    for y in y_ticks:
        _, py = to_pixel(x0, y)
        draw.line([(left, py), (width - right, py)], fill=GRID)
        draw_text(draw, (left - 6, py), f"{y:g}", small, "rm")
    draw.rectangle([left, top, width - right, height - bottom], outline=AXIS)
    draw_text(draw, ((left + width - right) / 2, height - 22), "BG-gap (mixed_same - mixed_rand, points)", font, "mm")
    draw_text(draw, (width / 2, 20), "Backgrounds Challenge: BG-gap against challenge accuracy", font, "mm")
    paste_vertical_text(canvas, (8, top), (height - top - bottom, 20), "challenge accuracy (%)", font)
    taken: list[Box] = []
    for row in points:
        px, py = to_pixel(row.bg_gap, row.challenge_accuracy)
        _marker(draw, px, py, row.kind)
        anchor = "rm" if px > width - right - 200 else "lm"
        position = free_text_position(draw, (px - 9 if anchor == "rm" else px + 9, py), row.model[:40], small,
                                      anchor, taken)
        draw.text(position, row.model[:40], font=small, fill=TEXT)
    legend_x = left + 12
    for i, kind in enumerate((MEASURED, PUBLISHED)):
        ly = top + 14 + 18 * i
        _marker(draw, legend_x + 5, ly, kind)
        draw_text(draw, (legend_x + 16, ly), kind, small, "lm")
    save_png(canvas, path)
    return points


# ----------------------------------------------------------------------------------------------------------

def build_leaderboard(output_dir: Path | str, include_published: bool = True) -> list[Row]:
    """Rebuild leaderboard.md, leaderboard.csv and leaderboard.png in output_dir from its results files."""
    output_dir = Path(output_dir)
    rows, withheld = leaderboard_rows(output_dir, include_published)
    write_text_atomic(output_dir / MARKDOWN_FILE, render_markdown(rows, withheld))
    write_text_atomic(output_dir / CSV_FILE, render_csv(rows))
    draw_plot(rows, output_dir / PLOT_FILE)
    log.info("leaderboard of %d rows written to %s", len(rows), output_dir / MARKDOWN_FILE)
    return rows
