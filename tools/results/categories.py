"""The paper's prediction categories (Table 3, Figure 7): how each image's prediction depends on its
background, from three evaluated variations (original, mixed_rand, only_bg_t)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from tools.errors import UserError
from tools.in9 import UNMAPPED, Variation, class_names


class Category(str, enum.Enum):
    """How an image's prediction depends on its background, from the full image, its foreground on a random
    background (mixed_rand) and its background alone (only_bg_t)."""

    BG_IRRELEVANT = "bg_irrelevant"  # full and foreground both right, or both wrong
    BG_REQUIRED = "bg_required"  # full right, foreground wrong, background right
    BG_FG_REQUIRED = "bg_fg_required"  # full right, foreground wrong, background wrong
    BG_FOOLS = "bg_fools"  # full wrong, foreground right, background wrong with the full image's prediction
    OTHER = "other"  # full wrong, foreground right, otherwise


CATEGORY_TITLES = {
    Category.BG_IRRELEVANT: "BG Irrelevant",
    Category.BG_REQUIRED: "BG Required",
    Category.BG_FG_REQUIRED: "BG+FG Required",
    Category.BG_FOOLS: "BG Fools",
    Category.OTHER: "Other",
}
CATEGORY_VARIATIONS = {"full": Variation.ORIGINAL.value, "foreground": Variation.MIXED_RAND.value,
                       "background": Variation.ONLY_BG_T.value}


class PredictionsLike(Protocol):
    """What prediction_categories needs of a variation's result (tools.in9.evaluate.VariationResult has it)."""

    name: str
    relpaths: list[str]
    labels: np.ndarray
    predictions: np.ndarray


def categorize(full_right: np.ndarray, fg_right: np.ndarray, bg_right: np.ndarray,
               bg_same_as_full: np.ndarray) -> np.ndarray:
    """The Category position (0..4, in Category's order) of each image, from per-image booleans."""
    order = list(Category)
    out = np.full(full_right.shape, order.index(Category.OTHER), dtype=np.int64)
    out[full_right == fg_right] = order.index(Category.BG_IRRELEVANT)
    required = full_right & ~fg_right
    out[required & bg_right] = order.index(Category.BG_REQUIRED)
    out[required & ~bg_right] = order.index(Category.BG_FG_REQUIRED)
    out[~full_right & fg_right & ~bg_right & bg_same_as_full] = order.index(Category.BG_FOOLS)
    return out


def _by_stem(result: PredictionsLike) -> dict[str, int]:
    positions: dict[str, int] = {}
    for position, rel in enumerate(result.relpaths):
        stem = Path(rel).stem
        if stem in positions:
            raise UserError(f"{result.name} holds two images with the stem {stem!r} ({result.relpaths[positions[stem]]}"
                            f" and {rel}); prediction categories match images across variations by file stem")
        positions[stem] = position
    return positions


def _few(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _counts_entry(codes: np.ndarray) -> dict:
    total = int(len(codes))
    counts = np.bincount(codes, minlength=len(Category))
    return {"images": total,
            "counts": {cat.value: int(n) for cat, n in zip(Category, counts)},
            "percent": {cat.value: round(100.0 * int(n) / total, 4) if total else None
                        for cat, n in zip(Category, counts)}}


def prediction_categories(full: PredictionsLike, foreground: PredictionsLike, background: PredictionsLike) -> dict:
    """Count each image's prediction category, overall and per class, images matched by file stem. -1 is always
    wrong, and a background's -1 never counts as the full image's prediction (it stands for 630 classes)."""
    maps = [_by_stem(r) for r in (full, foreground, background)]
    stems = sorted(maps[0])
    for other, result in zip(maps[1:], (foreground, background)):
        absent = sorted(set(maps[0]) - set(other))
        extra = sorted(set(other) - set(maps[0]))
        if absent or extra:
            parts = []
            if absent:
                parts.append(f"{len(absent)} stem(s) of {full.name} missing from {result.name} ({_few(absent)})")
            if extra:
                parts.append(f"{len(extra)} stem(s) of {result.name} not in {full.name} ({_few(extra)})")
            raise UserError("; ".join(parts) + "; the three variations must hold the same images "
                            "(evaluate complete variations of one release)")
    rows = [np.array([m[s] for s in stems], dtype=np.int64) for m in maps]
    labels = [np.asarray(r.labels)[i] for r, i in zip((full, foreground, background), rows)]
    for result, lab in zip((foreground, background), labels[1:]):
        differ = np.flatnonzero(lab != labels[0])
        if len(differ):
            raise UserError(f"{len(differ)} image(s) have another class in {result.name} than in {full.name} "
                            f"({_few([stems[i] for i in differ])}); the variations must use the same class folders")
    label = labels[0]
    p_full, p_fg, p_bg = (np.asarray(r.predictions)[i] for r, i in zip((full, foreground, background), rows))
    codes = categorize(p_full == label, p_fg == label, p_bg == label, (p_bg == p_full) & (p_bg != UNMAPPED))
    return {
        "variations": {"full": full.name, "foreground": foreground.name, "background": background.name},
        "categories": {cat.value: CATEGORY_TITLES[cat] for cat in Category},
        "overall": _counts_entry(codes),
        "per_class": {name: _counts_entry(codes[label == c]) for c, name in enumerate(class_names())},
    }


def format_categories(result: dict) -> str:
    """The categories as a text table: one row for all images and one per class, percentages (counts)."""
    titles = [CATEGORY_TITLES[cat] for cat in Category]
    widths = [max(len(t), 13) for t in titles]
    lines = [f"{'class':<11} {'images':>6}  " + "  ".join(f"{t:>{w}}" for t, w in zip(titles, widths))]
    entries = [("all", result["overall"]), *result["per_class"].items()]
    for name, entry in entries:
        cells = []
        for cat, w in zip(Category, widths):
            pct = entry["percent"][cat.value]
            cells.append(f"{'-' if pct is None else f'{pct:.1f}%'} ({entry['counts'][cat.value]})".rjust(w))
        lines.append(f"{name:<11} {entry['images']:>6}  " + "  ".join(cells))
    v = result["variations"]
    lines.append(f"(full: {v['full']}, foreground: {v['foreground']}, background: {v['background']})")
    return "\n".join(lines)
