"""Which backgrounds fool a model, redone from the challenge's saved prediction matrix without the model.

Run as `python -m tools.results.analysis OUTPUT_DIR` on the --output-dir of `challenge_eval.py --full`.

Definitions (all over the saved matrix `predictions[i, j]`, the IN-9 prediction for foreground i pasted
on background j; -1 is an ImageNet class outside IN-9):

- ASR (attack success rate) of background j of class c: among foregrounds of classes other than c, the
  fraction whose composite with j is predicted c.
- Fool rate of class c: among foregrounds of classes other than c, the fraction for which at least one
  background of class c makes the prediction c.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError

from tools.cli import add_log_level_argument, run_main
from tools.errors import NUMPY_READ_ERRORS, UserError
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED, class_names
from tools.provenance import atomic_write, check_outputs, write_json_atomic

log = logging.getLogger(__name__)

# What `challenge_eval.py --full` leaves in its --output-dir.
PREDICTIONS_FILE = "predictions.npy"
FOREGROUNDS_FILE = "foregrounds.csv"
BACKGROUNDS_FILE = "backgrounds.csv"
META_FILE = "challenge_meta.json"
FOREGROUND_COLUMNS = ["index", "stem", "label", "image", "mask"]
BACKGROUND_COLUMNS = ["index", "stem", "label", "image"]

# What the analysis adds to it.
ASR_FILE = "asr.csv"
TOP_FILE = "top_backgrounds.csv"
HISTOGRAM_FILE = "asr_histogram.csv"
SUMMARY_FILE = "analysis.json"
FIGURE_FILE = "top_backgrounds.png"

DEFAULT_TOP_K = 5
HISTOGRAM_BINS = 20  # equal bins over [0, 1]; the last one includes 1
ROUND = 6


# ----------------------------------------------------------------------------------------------------------
# Reading the saved matrix

@dataclass
class ChallengeMatrix:
    """The saved prediction matrix with the foregrounds and backgrounds its rows and columns stand for."""

    predictions: np.ndarray  # int64 (n_fg, n_bg), IN-9 index or -1
    fg_labels: np.ndarray  # int64 (n_fg,)
    fg_stems: list[str]
    bg_labels: np.ndarray  # int64 (n_bg,)
    bg_stems: list[str]
    bg_images: list[str]  # relative to the data root
    meta: dict


def _read_index_csv(path: Path, columns: list[str]) -> list[dict]:
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            rows = list(reader)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if header != columns:
        raise UserError(f"{path} has columns {','.join(header) or '(none)'}, expected {','.join(columns)}; "
                        f"it was not written by challenge_eval.py --full (rerun it)")
    for position, row in enumerate(rows):
        try:
            index, label = int(row["index"]), int(row["label"])
        except (TypeError, ValueError):
            raise UserError(f"{path} row {position + 2}: index and label must be integers "
                            f"(got {row['index']!r}, {row['label']!r})") from None
        if index != position:
            raise UserError(f"{path} row {position + 2} has index {index}, expected {position}; "
                            f"rows must be in index order 0, 1, 2, ...")
        if not 0 <= label < NUM_IN9_CLASSES:
            raise UserError(f"{path} row {position + 2} has label {label}; labels are IN-9 classes 0..8")
    return rows


def load_matrix(output_dir: Path | str) -> ChallengeMatrix:
    """Read predictions.npy, foregrounds.csv, backgrounds.csv and challenge_meta.json, checked to agree."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise UserError(f"{output_dir} is not a folder; pass the --output-dir of `challenge_eval.py --full`")
    missing = [name for name in (PREDICTIONS_FILE, FOREGROUNDS_FILE, BACKGROUNDS_FILE, META_FILE)
               if not (output_dir / name).is_file()]
    if missing:
        raise UserError(f"{output_dir} lacks {', '.join(missing)}; the analysis reads the saved matrix of "
                        f"`challenge_eval.py --full --output-dir {output_dir}` (run that first)")
    try:
        raw = np.load(output_dir / PREDICTIONS_FILE, allow_pickle=False)
    except NUMPY_READ_ERRORS as exc:
        raise UserError(f"cannot read {output_dir / PREDICTIONS_FILE}: {exc}; rerun challenge_eval.py --full") from None
    try:
        meta = json.loads((output_dir / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {output_dir / META_FILE}: {exc}; rerun challenge_eval.py --full") from None
    if not isinstance(meta, dict):
        raise UserError(f"{output_dir / META_FILE} holds no JSON object; rerun challenge_eval.py --full")
    foregrounds = _read_index_csv(output_dir / FOREGROUNDS_FILE, FOREGROUND_COLUMNS)
    backgrounds = _read_index_csv(output_dir / BACKGROUNDS_FILE, BACKGROUND_COLUMNS)
    if raw.ndim != 2 or not np.issubdtype(raw.dtype, np.integer):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} is a {raw.dtype} array of shape {raw.shape}; expected a "
                        f"2-D integer array (foregrounds x backgrounds)")
    if raw.shape != (len(foregrounds), len(backgrounds)):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} has shape {raw.shape} but {FOREGROUNDS_FILE} lists "
                        f"{len(foregrounds)} foregrounds and {BACKGROUNDS_FILE} {len(backgrounds)} backgrounds; "
                        f"the files come from different runs (rerun challenge_eval.py --full)")
    predictions = raw.astype(np.int64)
    if predictions.size and (predictions.min() < UNMAPPED or predictions.max() >= NUM_IN9_CLASSES):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} holds values from {predictions.min()} to "
                        f"{predictions.max()}; predictions are IN-9 classes 0..8 or -1")
    fg_labels = np.array([int(r["label"]) for r in foregrounds], dtype=np.int64)
    if len(np.unique(fg_labels)) < 2:
        raise UserError(f"{output_dir / FOREGROUNDS_FILE} has foregrounds of fewer than two classes; ASR and fool "
                        f"rates compare a class's backgrounds with the other classes' foregrounds")
    return ChallengeMatrix(
        predictions=predictions, fg_labels=fg_labels, fg_stems=[r["stem"] for r in foregrounds],
        bg_labels=np.array([int(r["label"]) for r in backgrounds], dtype=np.int64),
        bg_stems=[r["stem"] for r in backgrounds], bg_images=[r["image"] for r in backgrounds], meta=meta)


# ----------------------------------------------------------------------------------------------------------
# The quantities

def asr_counts(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per background j: (foregrounds of another class predicted as j's class, foregrounds of another class).

    The ASR of j is the first divided by the second.
    """
    other = fg_labels[:, None] != bg_labels[None, :]
    fooled = other & (predictions == bg_labels[None, :])
    return fooled.sum(axis=0), other.sum(axis=0)


def fool_counts(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray,
                num_classes: int = NUM_IN9_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """Per class c: (foregrounds of another class that some background of class c turns into c,
    foregrounds of another class). The fool rate of c is the first divided by the second."""
    turned = predictions == bg_labels[None, :]  # the composite is predicted as the background's class
    fooled = np.zeros(num_classes, dtype=np.int64)
    others = np.zeros(num_classes, dtype=np.int64)
    for c in range(num_classes):
        other = fg_labels != c
        others[c] = other.sum()
        fooled[c] = (turned[:, bg_labels == c].any(axis=1) & other).sum()
    return fooled, others


def top_backgrounds(fooled: np.ndarray, bg_labels: np.ndarray, k: int,
                    num_classes: int = NUM_IN9_CLASSES) -> list[np.ndarray]:
    """Per class, the indices of its k backgrounds with the highest ASR; ties go to the lower index.

    Every background of a class has the same ASR denominator, so ranking by the fooled count is ranking by ASR.
    """
    out = []
    for c in range(num_classes):
        members = np.flatnonzero(bg_labels == c)
        order = np.lexsort((members, -fooled[members]))  # last key first: fooled descending, then index
        out.append(members[order][:k])
    return out


def asr_bins(fooled: np.ndarray, eligible: np.ndarray, bins: int = HISTOGRAM_BINS) -> np.ndarray:
    """The histogram bin of each ASR, computed exactly from the counts: bin b holds b/bins <= ASR < (b+1)/bins,
    and the last bin also holds ASR = 1."""
    return np.minimum(fooled * bins // np.maximum(eligible, 1), bins - 1)


def asr_histograms(fooled: np.ndarray, eligible: np.ndarray, bg_labels: np.ndarray, bins: int = HISTOGRAM_BINS,
                   num_classes: int = NUM_IN9_CLASSES) -> np.ndarray:
    """(num_classes, bins) counts of backgrounds per ASR bin, per background class."""
    counts = np.zeros((num_classes, bins), dtype=np.int64)
    np.add.at(counts, (bg_labels, asr_bins(fooled, eligible, bins)), 1)
    return counts


def fooled_into_background_class(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray) -> np.ndarray:
    """Per foreground: whether some background of another class makes the prediction that background's class."""
    turned = (predictions == bg_labels[None, :]) & (fg_labels[:, None] != bg_labels[None, :])
    return turned.any(axis=1)


def _rate(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, ROUND) if denominator else None


def analyze(matrix: ChallengeMatrix, top_k: int = DEFAULT_TOP_K) -> tuple[dict, np.ndarray, np.ndarray]:
    """The summary dict (JSON-able), and the per-background fooled and eligible counts behind it."""
    if top_k < 1:
        raise UserError(f"--top-k must be at least 1, not {top_k}")
    names = class_names()
    p, fg, bg = matrix.predictions, matrix.fg_labels, matrix.bg_labels
    fooled, eligible = asr_counts(p, fg, bg)
    asr = fooled / np.maximum(eligible, 1)
    class_fooled, class_others = fool_counts(p, fg, bg)
    tops = top_backgrounds(fooled, bg, top_k)
    histograms = asr_histograms(fooled, eligible, bg)
    any_class = fooled_into_background_class(p, fg, bg)
    per_class = {}
    for c, name in enumerate(names):
        members = bg == c
        rates = asr[members]
        has_backgrounds = bool(members.any())
        per_class[name] = {
            "backgrounds": int(members.sum()),
            "other_foregrounds": int(class_others[c]),
            "fooled_foregrounds": int(class_fooled[c]),
            "fool_rate": _rate(int(class_fooled[c]), int(class_others[c])) if has_backgrounds else None,
            "mean_asr": round(float(rates.mean()), ROUND) if has_backgrounds else None,
            "median_asr": round(float(np.median(rates)), ROUND) if has_backgrounds else None,
            "max_asr": round(float(rates.max()), ROUND) if has_backgrounds else None,
            "asr_histogram": histograms[c].tolist(),
            "top_backgrounds": [
                {"rank": rank + 1, "index": int(j), "stem": matrix.bg_stems[j], "image": matrix.bg_images[j],
                 "asr": round(float(asr[j]), ROUND), "fooled": int(fooled[j]), "eligible": int(eligible[j])}
                for rank, j in enumerate(tops[c])],
        }
    summary = {
        "top_k": top_k,
        "criterion": matrix.meta.get("criterion"),
        "num_classes": matrix.meta.get("num_classes"),
        "foregrounds": int(p.shape[0]),
        "backgrounds": int(p.shape[1]),
        "fooled_into_bg_class": int(any_class.sum()),
        "fooled_into_bg_class_rate": _rate(int(any_class.sum()), int(p.shape[0])),
        "mean_asr": round(float(asr.mean()), ROUND) if len(asr) else None,
        "histogram_edges": [round(b / HISTOGRAM_BINS, ROUND) for b in range(HISTOGRAM_BINS + 1)],
        "per_class": per_class,
        "files": {"asr": ASR_FILE, "top_backgrounds": TOP_FILE, "histograms": HISTOGRAM_FILE, "figure": FIGURE_FILE},
        "provenance": matrix.meta.get("provenance", {}),
    }
    return summary, fooled, eligible


# ----------------------------------------------------------------------------------------------------------
# The figure: one row per class, its top-k backgrounds with their ASR above each

@dataclass(frozen=True)
class FigureLayout:
    """Pixel geometry of the top-backgrounds figure; boxes are (x0, y0, x1, y1), half-open."""

    rows: int
    cols: int
    thumb: int = 112
    gap: int = 10
    caption: int = 20  # height of the "ASR 37.5%" line above each image
    label: int = 130  # width of the class-name column
    title: int = 52
    margin: int = 12
    min_width: int = 580  # room for the title lines when k is small

    @property
    def size(self) -> tuple[int, int]:
        width = 2 * self.margin + self.label + self.cols * self.thumb + (self.cols - 1) * self.gap
        width = max(width, self.min_width)
        height = self.title + self.rows * (self.caption + self.thumb) + (self.rows - 1) * self.gap + self.margin
        return width, height

    def panel_box(self, row: int, col: int) -> tuple[int, int, int, int]:
        """The caption and the image of one panel."""
        x0 = self.margin + self.label + col * (self.thumb + self.gap)
        y0 = self.title + row * (self.caption + self.thumb + self.gap)
        return x0, y0, x0 + self.thumb, y0 + self.caption + self.thumb

    def image_box(self, row: int, col: int) -> tuple[int, int, int, int]:
        x0, y0, x1, y1 = self.panel_box(row, col)
        return x0, y0 + self.caption, x1, y1


CANVAS = (255, 255, 255)
PLACEHOLDER = (200, 200, 200)
TEXT = (20, 20, 20)
MUTED = (100, 100, 100)


def default_font(size: int):
    """Pillow's default font at `size` points (the bitmap font on old Pillow)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1 has one fixed-size bitmap font
        return ImageFont.load_default()


def _thumbnail(path: Path | None, size: int) -> Image.Image | None:
    if path is None:
        return None
    try:
        with Image.open(path) as img:
            return ImageOps.fit(img.convert("RGB"), (size, size), Image.Resampling.LANCZOS)
    except (OSError, UnidentifiedImageError, ValueError):
        return None


def _centered(draw: ImageDraw.ImageDraw, box, text: str, font, fill) -> None:
    x0, y0, x1, y1 = box
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((x0 + x1 - (right - left)) / 2 - left, (y0 + y1 - (bottom - top)) / 2 - top), text, font=font,
              fill=fill)


def draw_top_backgrounds(summary: dict, data_path: Path | None, path: Path | str) -> FigureLayout:
    """Draw the figure to `path` (PNG); a missing image becomes a grey placeholder and one warning."""
    names = class_names()
    k = summary["top_k"]
    layout = FigureLayout(rows=len(names), cols=k)
    canvas = Image.new("RGB", layout.size, CANVAS)
    draw = ImageDraw.Draw(canvas)
    title_font, name_font, small_font = default_font(17), default_font(16), default_font(13)
    draw.text((layout.margin, layout.margin - 2), f"Top-{k} backgrounds per class by attack success rate (ASR)",
              font=title_font, fill=TEXT)
    draw.text((layout.margin, layout.margin + 19), "ASR: share of other classes' foregrounds predicted as the row's "
              "class on that background", font=small_font, fill=MUTED)
    missing: list[str] = []
    shown = 0
    for row, name in enumerate(names):
        info = summary["per_class"][name]
        _, y0, _, y1 = layout.image_box(row, 0)
        label_box = (layout.margin, y0, layout.margin + layout.label - layout.gap, y1)
        mid = (y0 + y1) // 2
        _centered(draw, (label_box[0], mid - 22, label_box[2], mid - 2), name, name_font, TEXT)
        rate = info["fool_rate"]
        _centered(draw, (label_box[0], mid + 2, label_box[2], mid + 20),
                  "no backgrounds" if rate is None else f"fool rate {100 * rate:.1f}%", small_font, MUTED)
        for col, entry in enumerate(info["top_backgrounds"]):
            shown += 1
            px0, py0, px1, _ = layout.panel_box(row, col)
            _centered(draw, (px0, py0, px1, py0 + layout.caption), f"ASR {100 * entry['asr']:.1f}%", small_font, TEXT)
            image_box = layout.image_box(row, col)
            thumb = _thumbnail(None if data_path is None else Path(data_path) / entry["image"], layout.thumb)
            if thumb is None:
                missing.append(entry["image"])
                draw.rectangle((image_box[0], image_box[1], image_box[2] - 1, image_box[3] - 1), fill=PLACEHOLDER)
                _centered(draw, image_box, "image missing", small_font, MUTED)
            else:
                canvas.paste(thumb, image_box[:2])
    if missing:
        why = "no data path is known (pass --data-path DIR)" if data_path is None else f"not readable under {data_path}"
        log.warning("%d of %d background image(s) for the figure are missing: %s (e.g. %s); drew grey placeholders",
                    len(missing), shown, why, missing[0])
    with atomic_write(path, "wb") as fh:
        canvas.save(fh, format="PNG")
    return layout


# ----------------------------------------------------------------------------------------------------------
# Writing everything

def _write_csv(path: Path, header: Sequence[str], rows) -> None:
    with atomic_write(path, newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)


def write_analysis(output_dir: Path | str, data_path: Path | str | None = None, top_k: int = DEFAULT_TOP_K) -> dict:
    """Analyse the saved matrix in `output_dir` and write asr.csv, top_backgrounds.csv, asr_histogram.csv,
    analysis.json and top_backgrounds.png there; returns the summary (the content of analysis.json).

    `data_path` locates the background images for the figure (default: the data path the run recorded).
    """
    output_dir = Path(output_dir)
    matrix = load_matrix(output_dir)
    summary, fooled, eligible = analyze(matrix, top_k)
    if data_path is None and matrix.meta.get("data_path"):
        data_path = Path(matrix.meta["data_path"])
    summary["data_path"] = None if data_path is None else str(data_path)
    names = class_names()
    asr = fooled / np.maximum(eligible, 1)
    _write_csv(output_dir / ASR_FILE, ["index", "stem", "class", "asr", "fooled", "eligible"],
               ([j, stem, names[matrix.bg_labels[j]], round(float(asr[j]), ROUND), int(fooled[j]), int(eligible[j])]
                for j, stem in enumerate(matrix.bg_stems)))
    _write_csv(output_dir / TOP_FILE, ["class", "rank", "index", "stem", "asr", "fooled", "eligible", "image"],
               ([name, e["rank"], e["index"], e["stem"], e["asr"], e["fooled"], e["eligible"], e["image"]]
                for name in names for e in summary["per_class"][name]["top_backgrounds"]))
    edges = summary["histogram_edges"]
    _write_csv(output_dir / HISTOGRAM_FILE, ["class", *(f"{lo:g}-{hi:g}" for lo, hi in zip(edges, edges[1:]))],
               ([name, *summary["per_class"][name]["asr_histogram"]] for name in names))
    draw_top_backgrounds(summary, data_path, output_dir / FIGURE_FILE)
    summary["output_dir"] = str(output_dir.resolve())
    write_json_atomic(output_dir / SUMMARY_FILE, summary)
    return summary


def summary_lines(summary: dict) -> list[str]:
    """A short table for the terminal: per class the fool rate and the most fooling background."""
    out = [f"{'class':<11} {'fool rate':>9} {'mean ASR':>9}  top background (ASR)"]
    for name, info in summary["per_class"].items():
        if info["fool_rate"] is None:
            out.append(f"{name:<11} {'-':>9} {'-':>9}  no backgrounds")
            continue
        best = info["top_backgrounds"][0]
        out.append(f"{name:<11} {100 * info['fool_rate']:>8.1f}% {100 * info['mean_asr']:>8.1f}%  "
                   f"{best['stem']} ({100 * best['asr']:.1f}%)")
    rate = summary["fooled_into_bg_class_rate"]
    out.append(f"Foregrounds some other class's background turns into that class: {summary['fooled_into_bg_class']}/"
               f"{summary['foregrounds']} ({100 * rate:.2f}%)")
    return out


# ----------------------------------------------------------------------------------------------------------
# Command line

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.results.analysis",
        description="Redo the adversarial-background analysis (ASR per background, fool rate per class, top "
                    "backgrounds, ASR histograms, figure) from the matrix `challenge_eval.py --full` saved, "
                    "without the model.")
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR",
                        help="the --output-dir of challenge_eval.py --full (holds predictions.npy); the analysis "
                             "files are written there too")
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help="data root holding only_bg_t/, for the figure's images (default: the path the "
                             "challenge run recorded)")
    parser.add_argument("--top-k", type=_positive, default=DEFAULT_TOP_K, metavar="K",
                        help=f"backgrounds per class in the top lists and the figure (default: {DEFAULT_TOP_K})")
    add_log_level_argument(parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    check_outputs(folders={"OUTPUT_DIR": args.output_dir})
    summary = write_analysis(args.output_dir, args.data_path, args.top_k)
    print("\n".join(summary_lines(summary)))
    print(f"Wrote {', '.join(summary['files'].values())} and {SUMMARY_FILE} to {args.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _main, argv, on_interrupt="rerun the same command")


if __name__ == "__main__":
    sys.exit(main())
