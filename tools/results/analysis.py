"""Which backgrounds fool a model (ASR per background, fool rate per class: docs/results.md, "Background
analysis"), redone from the saved matrix of `challenge_eval.py --full` without the model."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.cli import ArgumentParser, add_log_level_argument, examples, run_main, whole_number
from tools.data.layout import DATA_ENV, DEFAULT_DATA_ROOT, default_data_root
from tools.errors import UserError
from tools.in9 import NUM_IN9_CLASSES, class_names
from tools.provenance import check_outputs, write_csv_atomic, write_json_atomic
from tools.results.figures import (
    MUTED,
    PLACEHOLDER,
    TEXT,
    DataImages,
    centered_text,
    default_font,
    new_canvas,
    save_png,
)
from tools.results.matrix import ChallengeMatrix, load_matrix, require_two_classes

log = logging.getLogger(__name__)

# What the analysis adds to the matrix's folder.
ASR_FILE = "asr.csv"
TOP_FILE = "top_backgrounds.csv"
HISTOGRAM_FILE = "asr_histogram.csv"
SUMMARY_FILE = "analysis.json"
FIGURE_FILE = "top_backgrounds.png"

DEFAULT_TOP_K = 5
HISTOGRAM_BINS = 20  # equal bins over [0, 1]; the last one includes 1
ROUND = 6


# ----------------------------------------------------------------------------------------------------------
# The quantities

def asr_counts(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per background j: (foregrounds of another class predicted as j's class, foregrounds of another class)."""
    other = fg_labels[:, None] != bg_labels[None, :]
    fooled = other & (predictions == bg_labels[None, :])
    return fooled.sum(axis=0), other.sum(axis=0)


def fool_counts(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray,
                num_classes: int = NUM_IN9_CLASSES) -> tuple[np.ndarray, np.ndarray]:
    """Per class c: (foregrounds of another class some background of class c turns into c, all of another class)."""
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
    """Per class, the indices of its k backgrounds with the highest ASR (one denominator per class, so ranked by
    the fooled count); ties go to the lower index."""
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


def fooling_confusion(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray,
                      backgrounds: np.ndarray, num_classes: int = NUM_IN9_CLASSES) -> np.ndarray:
    """(num_classes, num_classes + 1) counts of composites (foreground class, predicted class or outside IN-9) over
    every foreground pasted on each of `backgrounds` of another class."""
    counts = np.zeros((num_classes, num_classes + 1), dtype=np.int64)
    chosen = predictions[:, backgrounds]
    other = fg_labels[:, None] != bg_labels[None, backgrounds]
    rows = np.broadcast_to(fg_labels[:, None], chosen.shape)[other]
    np.add.at(counts, (rows, np.where(chosen[other] < 0, num_classes, chosen[other])), 1)
    return counts


def fooling_examples(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray, fooled: np.ndarray,
                     per_class: int, criterion: str = "any",
                     num_classes: int = NUM_IN9_CLASSES) -> list[tuple[int, int]]:
    """Per foreground class, its first `per_class` vulnerable foregrounds under `criterion`, each with the fooling
    background that fools the most foregrounds (ties: the lower index)."""
    from tools.challenge.config import Criterion  # noqa: PLC0415 (the challenge's own definition of being fooled)
    from tools.challenge.scheduler import fooling  # noqa: PLC0415

    out = []
    wrong = fooling(predictions, fg_labels[:, None], bg_labels[None, :], Criterion(criterion))
    for c in range(num_classes):
        for i in np.flatnonzero((fg_labels == c) & wrong.any(axis=1))[:per_class]:
            candidates = np.flatnonzero(wrong[i])
            out.append((int(i), int(candidates[np.lexsort((candidates, -fooled[candidates]))[0]])))
    return out


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


def draw_top_backgrounds(summary: dict, data_path: Path | None, path: Path | str) -> FigureLayout:
    """Draw the figure to `path` (PNG), its images read only from inside `data_path`; one missing or refused is a
    grey placeholder and one warning."""
    names = class_names()
    # as many columns as the longest list holds: --top-k beyond a class's backgrounds draws no empty columns
    k = max(1, min(summary["top_k"], max(len(info["top_backgrounds"]) for info in summary["per_class"].values())))
    layout = FigureLayout(rows=len(names), cols=k)
    canvas, draw = new_canvas(layout.size)
    title_font, name_font, small_font = default_font(17), default_font(16), default_font(13)
    draw.text((layout.margin, layout.margin - 2), f"Top-{k} backgrounds per class by attack success rate (ASR)",
              font=title_font, fill=TEXT)
    draw.text((layout.margin, layout.margin + 19), "ASR: share of other classes' foregrounds predicted as the row's "
              "class on that background", font=small_font, fill=MUTED)
    missing: list[str] = []
    shown = 0
    images = DataImages(data_path)
    for row, name in enumerate(names):
        info = summary["per_class"][name]
        _, y0, _, y1 = layout.image_box(row, 0)
        label_box = (layout.margin, y0, layout.margin + layout.label - layout.gap, y1)
        mid = (y0 + y1) // 2
        centered_text(draw, (label_box[0], mid - 22, label_box[2], mid - 2), name, name_font)
        rate = info["fool_rate"]
        centered_text(draw, (label_box[0], mid + 2, label_box[2], mid + 20),
                      "no backgrounds" if rate is None else f"fool rate {100 * rate:.1f}%", small_font, MUTED)
        for col, entry in enumerate(info["top_backgrounds"]):
            shown += 1
            px0, py0, px1, _ = layout.panel_box(row, col)
            centered_text(draw, (px0, py0, px1, py0 + layout.caption), f"ASR {100 * entry['asr']:.1f}%", small_font)
            image_box = layout.image_box(row, col)
            thumb = images.thumbnail(entry["image"], layout.thumb)
            if thumb is None:
                missing.append(entry["image"])
                draw.rectangle((image_box[0], image_box[1], image_box[2] - 1, image_box[3] - 1), fill=PLACEHOLDER)
                centered_text(draw, image_box, "image missing", small_font, MUTED)
            else:
                canvas.paste(thumb, image_box[:2])
    if missing:
        why = images.refused[0] if images.refused else f"{missing[0]} is no image Pillow reads"
        log.warning("%d of %d background image(s) for the figure are not shown (%s); drew grey placeholders",
                    len(missing), shown, why)
    save_png(canvas, path)
    return layout


# ----------------------------------------------------------------------------------------------------------
# Writing everything

def write_analysis(output_dir: Path | str, data_path: Path | str | None = None, top_k: int = DEFAULT_TOP_K,
                   matrix: ChallengeMatrix | None = None) -> dict:
    """Analyse `matrix` (None: the one saved in `output_dir`), write the analysis files there, return the summary;
    the figure's images come from `data_path` only, never from the folder the (editable) saved files name."""
    output_dir = Path(output_dir)
    matrix = load_matrix(output_dir) if matrix is None else require_two_classes(matrix, output_dir)
    summary, fooled, eligible = analyze(matrix, top_k)
    summary["data_path"] = None if data_path is None else str(Path(data_path).resolve())
    names = class_names()
    asr = fooled / np.maximum(eligible, 1)
    write_csv_atomic(output_dir / ASR_FILE, ["index", "stem", "class", "asr", "fooled", "eligible"],
                     ([j, stem, names[matrix.bg_labels[j]], round(float(asr[j]), ROUND), int(fooled[j]),
                       int(eligible[j])] for j, stem in enumerate(matrix.bg_stems)))
    write_csv_atomic(output_dir / TOP_FILE, ["class", "rank", "index", "stem", "asr", "fooled", "eligible", "image"],
                     ([name, e["rank"], e["index"], e["stem"], e["asr"], e["fooled"], e["eligible"], e["image"]]
                      for name in names for e in summary["per_class"][name]["top_backgrounds"]))
    edges = summary["histogram_edges"]
    write_csv_atomic(output_dir / HISTOGRAM_FILE,
                     ["class", *(f"{lo:g}-{hi:g}" for lo, hi in zip(edges, edges[1:]))],
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

def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        epilog=examples("python -m tools.results.analysis bg_results --top-k 5"),
        description="Redo the adversarial-background analysis (ASR per background, fool rate per class, top "
                    "backgrounds, ASR histograms, figure) from the matrix `challenge_eval.py --full` saved, "
                    "without the model.")
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR",
                        help="the --output-dir of challenge_eval.py --full (holds predictions.npy); the analysis "
                             "files are written there too")
    parser.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                        help=f"data root holding only_bg_t/, for the figure's images: only files inside it are drawn "
                             f"(default: ${DATA_ENV} if set, else {DEFAULT_DATA_ROOT})")
    parser.add_argument("--top-k", type=whole_number(1), default=DEFAULT_TOP_K, metavar="K",
                        help=f"backgrounds per class in the top lists and the figure (default: {DEFAULT_TOP_K})")
    add_log_level_argument(parser)
    return parser


def _main(args: argparse.Namespace) -> int:
    check_outputs(folders={"OUTPUT_DIR": args.output_dir})
    summary = write_analysis(args.output_dir, args.data_path or default_data_root(), args.top_k)
    print("\n".join(summary_lines(summary)))
    print(f"Wrote {', '.join(summary['files'].values())} and {SUMMARY_FILE} to {args.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _main, argv, on_interrupt="rerun the same command")


if __name__ == "__main__":
    sys.exit(main())
