"""Where the release's mixed images come from, read off their pixels (outside its mask a mixed image is a JPEG
copy of one `only_bg_t` image): each one's background, by a coarse thumbnail search then the exact error of the
best few, and every mask's box (half-open, as in tools.data.variations). See docs/data.md, provenance."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from tools.data.image_sets import ImageSet, decode_images, iter_decoded_batches, read_mask
from tools.data.layout import MIXED, check_data_root, class_folders, list_variation, variation_dir
from tools.data.variations import Box
from tools.errors import UserError
from tools.in9 import MASK_FOLDER, Variation
from tools.progress import progress_bar
from tools.provenance import OutputFiles, write_csv_atomic, write_json_atomic
from tools.threads import map_in_threads

log = logging.getLogger(__name__)

MATCHES_FILE = "provenance.csv"
BOXES_FILE = "boxes.csv"
SUMMARY_FILE = "provenance_summary.json"
MATCH_COLUMNS = ("variation", "image", "class", "background", "background_class", "error", "runner_up",
                 "runner_up_error", "ratio", "doubtful")
BOX_COLUMNS = ("mask", "class", "stem", "x0", "y0", "x1", "y1", "foreground_pixels")
THUMBNAIL_CELL = 8  # pixels per side of a thumbnail cell: 224x224 images become 28x28 thumbnails
MASK_MARGIN = 3  # pixels around the foreground left out of every comparison: JPEG mixes the two there
CANDIDATES = 5  # coarse candidates checked at full resolution
COARSE_TIE = 2.0  # coarse distances (0-255 units) this close to the nearest's are within JPEG noise of it
WIDE_CANDIDATES = 64  # candidates checked at full resolution where the CANDIDATES nearest tie
MIN_CLEAN_CELLS = 8  # with fewer thumbnail cells outside the mask, the coarse search compares sampled pixels
PIXEL_SAMPLE = 2048  # the most outside pixels that pixel search compares per image
DOUBT_RATIO = 0.5  # a match is doubtful when its error is more than this share of the runner-up's
BATCH = 64  # mixed images matched at once


@dataclass(frozen=True)
class Match:
    """One mixed image and the background it matches (None where its mask leaves no pixel to compare)."""

    variation: str
    image: str  # relative to the data folder, as every path here
    background: str | None
    error: float | None  # mean absolute difference over the compared pixels and channels, in 0-255 units
    runner_up: str | None
    runner_up_error: float | None

    @property
    def ratio(self) -> float | None:
        """The match's error over the runner-up's: near 0 a clear match, near 1 two equally good ones."""
        if self.error is None or self.runner_up_error is None:
            return None
        return self.error / self.runner_up_error if self.runner_up_error > 0 else 1.0

    @property
    def doubtful(self) -> bool:
        return self.ratio is not None and self.ratio > DOUBT_RATIO


@dataclass(frozen=True)
class MaskBox:
    """A foreground mask's extent: the box of every variation's image of that stem (None for an empty mask)."""

    mask: str
    box: Box | None
    foreground_pixels: int


@dataclass
class ProvenanceResult:
    root: Path
    backgrounds: int
    matches: list[Match]
    boxes: list[MaskBox]
    summary: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        """What the command prints: the summary in a few lines."""
        return summary_lines(self.summary)


def class_of(relpath: str) -> str:
    """The class folder of a layout path `<variation>/<split>/<class>/<file>`."""
    return PurePosixPath(relpath).parts[2]


def mask_key(relpath: str) -> tuple[str, str]:
    """(class folder, stem): what ties an image of any variation to its mask."""
    return class_of(relpath), PurePosixPath(relpath).stem


def mask_box(mask: np.ndarray) -> Box | None:
    """The smallest half-open box holding every set pixel of a 2-D mask; None when none is set."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def compared_pixels(foreground: np.ndarray) -> np.ndarray:
    """(H, W) bool: the pixels farther than MASK_MARGIN from every foreground pixel, or, for a mask that leaves
    none, every pixel outside it."""
    rows = foreground.copy()
    for shift in range(1, MASK_MARGIN + 1):
        rows[shift:] |= foreground[:-shift]
        rows[:-shift] |= foreground[shift:]
    widened = rows.copy()
    for shift in range(1, MASK_MARGIN + 1):
        widened[:, shift:] |= rows[:, :-shift]
        widened[:, :-shift] |= rows[:, shift:]
    return ~widened if not widened.all() else ~foreground


def clean_cells(compared: np.ndarray) -> np.ndarray:
    """(28 * 28,) bool: the thumbnail cells whose every pixel is compared."""
    cells = compared.shape[0] // THUMBNAIL_CELL
    return compared.reshape(cells, THUMBNAIL_CELL, cells, THUMBNAIL_CELL).all(axis=(1, 3)).ravel()


def thumbnails(images: np.ndarray) -> np.ndarray:
    """(N, 3 * 28 * 28) float32 of (N, 3, H, W) uint8 images: each cell's mean colour, channel by channel."""
    n, channels, size, _ = images.shape
    cells, cell = size // THUMBNAIL_CELL, THUMBNAIL_CELL
    rows = images.reshape(n, channels, cells, cell, size).sum(3, dtype=np.uint16)  # whole rows first: contiguous
    sums = rows.reshape(n, channels, cells, cells, cell).sum(-1, dtype=np.uint16)
    return sums.reshape(n, -1).astype(np.float32) / (cell * cell)


@dataclass(frozen=True)
class ReadMask:
    """A mask as the search uses it: its box, the pixels compared, and the thumbnail cells wholly among them."""

    box: MaskBox
    compared: np.ndarray
    clean: np.ndarray


def read_provenance_mask(root: Path, relpath: str) -> ReadMask:
    foreground = read_mask(root / relpath) != 0
    compared = compared_pixels(foreground)
    return ReadMask(MaskBox(relpath, mask_box(foreground), int(foreground.sum())), compared, clean_cells(compared))


class BackgroundIndex:
    """Every background at full resolution and as thumbnails; `match` finds a batch's best two."""

    def __init__(self, images: np.ndarray):
        self.images = images  # (N, 3, H, W) uint8
        self.thumbs = np.concatenate([thumbnails(images[i:i + 512]) for i in range(0, len(images), 512)])
        self.cell_squares = (self.thumbs ** 2).reshape(len(images), 3, -1).sum(1)  # (N, 28 * 28): over the channels

    def cell_distances(self, images: np.ndarray, masks: list[ReadMask]) -> np.ndarray:
        """(B, N): the root mean squared difference of the thumbnails over the cells wholly compared."""
        cell_weights = np.stack([m.clean for m in masks]).astype(np.float32)
        weighted = np.tile(cell_weights, 3) * thumbnails(images)  # the same cells in each channel's block
        # sum over the clean cells of |m - t|^2 = |m|^2 - 2 m.t + |t|^2, against every background t at once
        squared = ((weighted ** 2).sum(1, keepdims=True) - 2 * weighted @ self.thumbs.T
                   + cell_weights @ self.cell_squares.T)
        return np.sqrt(np.maximum(squared, 0) / np.maximum(3 * cell_weights.sum(1, keepdims=True), 1))

    def sampled_distances(self, image: np.ndarray, compared: np.ndarray) -> np.ndarray:
        """(N,): the mean absolute difference of one (3, H, W) image over up to PIXEL_SAMPLE of its compared pixels
        (every n-th), summed as integers so equal pixels give equal distances."""
        pixels = np.flatnonzero(compared)
        pixels = pixels[::-(-len(pixels) // PIXEL_SAMPLE)]
        flat = self.images.reshape(*self.images.shape[:2], -1)
        sample = image.reshape(3, -1)[:, pixels].astype(np.int16)
        return np.abs(flat[:, :, pixels] - sample).sum((1, 2), dtype=np.int64) / (3 * len(pixels))

    def coarse_distances(self, images: np.ndarray, masks: list[ReadMask]) -> np.ndarray:
        """(B, N): the thumbnails' distance over the clean cells, or the sampled pixels' (`sampled_distances`) where
        there are fewer than MIN_CLEAN_CELLS or the nearest CANDIDATES tie (`tied`: letterbox bars, flat backdrops)."""
        distances = self.cell_distances(images, masks)
        resample = (np.array([m.clean.sum() for m in masks]) < MIN_CLEAN_CELLS) | tied(distances)
        for b in np.flatnonzero(resample):
            if masks[b].compared.any():
                distances[b] = self.sampled_distances(images[b], masks[b].compared)
        return distances

    def exact_errors(self, images: np.ndarray, compared: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """(B, k): full-resolution mean absolute difference of each image against each candidate over its compared
        pixels ((B, H, W) bool)."""
        chosen, image = self.images[candidates], images[:, None]
        diff = np.maximum(chosen, image)
        diff -= np.minimum(chosen, image)  # |a - b| in uint8, without widening
        diff *= compared[:, None, None].view(np.uint8)
        counts = compared.reshape(len(images), -1).sum(1)
        return diff.reshape(*candidates.shape, -1).sum(-1, dtype=np.uint32) / (3 * np.maximum(counts, 1)[:, None])

    def match(self, images: np.ndarray, masks: list[ReadMask]) -> list[tuple[int, float, int, float] | None]:
        """Per image of the (B, 3, H, W) uint8 batch: (best background index, its error, runner-up index, its error),
        the runner-up -1 (error nan) with a single background; None with no pixel to compare. Checks the CANDIDATES
        coarsely nearest, or WIDE_CANDIDATES where those tie; ties go to the background listed first."""
        distances = self.coarse_distances(images, masks)
        compared = np.stack([m.compared for m in masks])
        narrow = nearest(distances, CANDIDATES)
        narrow_errors = self.exact_errors(images, compared, narrow)
        wide = tied(distances) & compared.any(axis=(1, 2))
        out: list[tuple[int, float, int, float] | None] = []
        for b in range(len(images)):
            if not compared[b].any():
                out.append(None)
                continue
            candidates, errors = narrow[b], narrow_errors[b]
            if wide[b]:
                candidates = nearest(distances[b:b + 1], WIDE_CANDIDATES)
                errors = self.exact_errors(images[b:b + 1], compared[b:b + 1], candidates)[0]
                candidates = candidates[0]
            order = errors.argsort(kind="stable")  # candidates are in listed order: ties go to the first listed
            first, second = order[0], (order[1] if len(order) > 1 else None)
            out.append((int(candidates[first]), float(errors[first]),
                        -1 if second is None else int(candidates[second]),
                        float("nan") if second is None else float(errors[second])))
        return out


def nearest(distances: np.ndarray, k: int) -> np.ndarray:
    """(B, k): per row of (B, N) distances, the indices of the k smallest, the first listed among equals."""
    return np.sort(np.argsort(distances, axis=1, kind="stable")[:, :k], axis=1)


def tied(distances: np.ndarray) -> np.ndarray:
    """(B,) bool: rows whose CANDIDATES-th smallest distance is within COARSE_TIE of their smallest (the true
    background, within JPEG noise, need not be among the nearest CANDIDATES)."""
    if distances.shape[1] <= CANDIDATES:
        return np.zeros(len(distances), bool)
    smallest = np.partition(distances, [0, CANDIDATES - 1], axis=1)
    return smallest[:, CANDIDATES - 1] - smallest[:, 0] <= COARSE_TIE


def check_same_class_folders(root: Path, names: list[str]) -> None:
    """UserError unless every folder of `names` has the first's class folders (masks and classes are found by
    the class folder's name)."""
    reference = class_folders(variation_dir(root, names[0]), names[0])
    for name in names[1:]:
        classes = class_folders(variation_dir(root, name), name)
        if classes != reference:
            only_here = [cls for cls in classes if cls not in reference] or classes
            only_there = [cls for cls in reference if cls not in classes] or reference
            raise UserError(f"the class folders of {variation_dir(root, name)} ({', '.join(only_here)}) differ from "
                            f"those of {variation_dir(root, names[0])} ({', '.join(only_there)}); provenance needs the "
                            f"same nine class folder names in {', '.join(names)}")


def find_provenance(root: Path, workers: int = 4, progress: bool = True) -> ProvenanceResult:
    """Match every mixed image of the data folder `root` with its `only_bg_t` background and box every mask."""
    root = check_data_root(root)
    check_same_class_folders(root, [MASK_FOLDER, *MIXED, Variation.ONLY_BG_T.value])
    backgrounds = [r.relpath for r in list_variation(root, Variation.ONLY_BG_T.value)]
    mask_paths = [r.relpath for r in list_variation(root, MASK_FOLDER)]
    mixed = [r.relpath for name in MIXED for r in list_variation(root, name)]
    mask_index = {mask_key(relpath): i for i, relpath in enumerate(mask_paths)}
    lonely = [relpath for relpath in mixed if mask_key(relpath) not in mask_index]
    if lonely:
        cls, stem = mask_key(lonely[0])
        raise UserError(f"{lonely[0]} has no mask {MASK_FOLDER}/{PurePosixPath(lonely[0]).parts[1]}/{cls}/"
                        f"{stem}.npy ({len(lonely)} such image(s)); a mixed image keeps the name of the foreground "
                        f"it shows, and its mask is needed to compare what lies outside it")
    log.info("matching %d mixed images against %d only_bg_t backgrounds", len(mixed), len(backgrounds))
    masks = list(map_in_threads(lambda relpath: read_provenance_mask(root, relpath), mask_paths, workers, progress,
                                "reading masks"))
    index = BackgroundIndex(decode_images(ImageSet(root), backgrounds, workers, progress, "decoding only_bg_t").numpy())
    matches: list[Match] = []
    with progress_bar(total=len(mixed), unit="img", desc="matching mixed images", disable=not progress,
                      dynamic_ncols=True) as bar:
        for start, batch in iter_decoded_batches(ImageSet(root), mixed, BATCH, workers):
            names = mixed[start:start + len(batch)]
            found = index.match(batch.numpy(), [masks[mask_index[mask_key(relpath)]] for relpath in names])
            for relpath, match in zip(names, found):
                variation = PurePosixPath(relpath).parts[0]
                if match is None:
                    matches.append(Match(variation, relpath, None, None, None, None))
                    continue
                best, error, second, second_error = match
                matches.append(Match(variation, relpath, backgrounds[best], error,
                                     backgrounds[second] if second >= 0 else None,
                                     None if second < 0 else second_error))
            bar.update(len(batch))
    result = ProvenanceResult(root, len(backgrounds), matches, [m.box for m in masks])
    result.summary = summarize(result, sorted({class_of(relpath) for relpath in backgrounds}))
    return result


def _share(count: int, total: int) -> float:
    return round(count / total, 4) if total else 0.0


def _uses(counter: collections.Counter) -> dict:
    """How many backgrounds were used once, twice, ...: {"1": n1, "2": n2, ...}."""
    return {str(uses): n for uses, n in sorted(collections.Counter(counter.values()).items())}


def summarize(result: ProvenanceResult, classes: list[str]) -> dict:
    """The summary JSON: per variation, how often the background is of the image's own class, the next class, its
    own image, each class, and reuse; across the three, backgrounds shared by two mixed images of one foreground."""
    position = {cls: i for i, cls in enumerate(classes)}
    matched = [m for m in result.matches if m.background is not None]
    variations = {}
    for name in MIXED:
        own = [m for m in result.matches if m.variation == name]
        found = [m for m in own if m.background is not None]
        used = collections.Counter(m.background for m in found)
        same = sum(class_of(m.background) == class_of(m.image) for m in found)
        following = sum(position[class_of(m.background)] == (position[class_of(m.image)] + 1) % len(classes)
                        for m in found)
        own_image = sum(mask_key(m.background) == mask_key(m.image) for m in found)
        by_class = collections.Counter(class_of(m.background) for m in found)
        errors = [m.error for m in found]
        runner_ups = [m.runner_up_error for m in found if m.runner_up_error is not None]
        variations[name] = {
            "images": len(own), "matched": len(found), "doubtful": sum(m.doubtful for m in found),
            "own_class": same, "own_class_share": _share(same, len(found)),
            "next_class": following, "next_class_share": _share(following, len(found)),
            "own_image": own_image,
            "background_classes": {cls: by_class.get(cls, 0) for cls in classes},
            "distinct_backgrounds": len(used), "reused_backgrounds": sum(n > 1 for n in used.values()),
            "most_uses": max(used.values(), default=0), "uses": _uses(used),
            "error_median": round(float(np.median(errors)), 3) if errors else None,
            "error_max": round(max(errors), 3) if errors else None,
            "runner_up_error_median": round(float(np.median(runner_ups)), 3) if runner_ups else None,
            "runner_up_error_min": round(min(runner_ups), 3) if runner_ups else None,
        }
    chosen = {(m.variation, mask_key(m.image)): m.background for m in matched}
    shared = {}
    for i, first in enumerate(MIXED):
        for second in MIXED[i + 1:]:
            shared[f"{first}/{second}"] = sum(background == chosen.get((second, key))
                                              for (variation, key), background in chosen.items()
                                              if variation == first)
    used = collections.Counter(m.background for m in matched)
    return {
        "data_path": str(result.root), "backgrounds": result.backgrounds, "mixed_images": len(result.matches),
        "doubtful": sum(m.doubtful for m in matched), "unmatched": len(result.matches) - len(matched),
        "variations": variations, "same_background": shared,
        "reuse": {"distinct_backgrounds": len(used), "unused_backgrounds": result.backgrounds - len(used),
                  "reused_backgrounds": sum(n > 1 for n in used.values()), "uses": _uses(used)},
        "boxes": {"masks": len(result.boxes), "empty_masks": sum(b.box is None for b in result.boxes)},
        "settings": {"thumbnail_cell": THUMBNAIL_CELL, "mask_margin": MASK_MARGIN, "candidates": CANDIDATES,
                     "coarse_tie": COARSE_TIE, "wide_candidates": WIDE_CANDIDATES, "min_clean_cells": MIN_CLEAN_CELLS,
                     "pixel_sample": PIXEL_SAMPLE, "doubt_ratio": DOUBT_RATIO},
    }


def summary_lines(summary: dict) -> list[str]:
    lines = [f"{summary['mixed_images']:,} mixed images matched against {summary['backgrounds']:,} only_bg_t "
             f"backgrounds in {summary['data_path']}: {summary['doubtful']:,} doubtful, "
             f"{summary['unmatched']:,} with no background pixel to compare"]
    for name, row in summary["variations"].items():
        n = max(row["matched"], 1)
        classes = " ".join(f"{cls} {count}" for cls, count in row["background_classes"].items())
        lines.append(f"{name}: {row['images']:,} images; background of its own class {row['own_class']:,} "
                     f"({100 * row['own_class'] / n:.1f}%), of the next class {row['next_class']:,} "
                     f"({100 * row['next_class'] / n:.1f}%), its own image's {row['own_image']:,}; "
                     f"{row['distinct_backgrounds']:,} distinct backgrounds, {row['reused_backgrounds']:,} used "
                     f"more than once (at most {row['most_uses']} times); by background class: {classes}")
    shared = ", ".join(f"{pair} {count:,}" for pair, count in summary["same_background"].items())
    reuse = summary["reuse"]
    lines.append(f"foregrounds whose two mixed images share a background: {shared}")
    lines.append(f"over all three: {reuse['distinct_backgrounds']:,} distinct backgrounds used, "
                 f"{reuse['reused_backgrounds']:,} more than once, {reuse['unused_backgrounds']:,} never")
    lines.append(f"boxes of {summary['boxes']['masks']:,} masks ({summary['boxes']['empty_masks']:,} empty)")
    return lines


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def write_provenance(result: ProvenanceResult, output: Path) -> list[Path]:
    """Write provenance.csv, boxes.csv and provenance_summary.json into `output`, each atomically."""
    output = Path(output)
    with OutputFiles("fix the cause and rerun the command", result.lines()) as outputs:
        outputs.write(write_csv_atomic, output / MATCHES_FILE, MATCH_COLUMNS, (
            [m.variation, m.image, class_of(m.image), m.background or "",
             class_of(m.background) if m.background else "", _number(m.error, 3), m.runner_up or "",
             _number(m.runner_up_error, 3), _number(m.ratio, 4), int(m.doubtful)] for m in result.matches))
        outputs.write(write_csv_atomic, output / BOXES_FILE, BOX_COLUMNS, (
            [b.mask, class_of(b.mask), PurePosixPath(b.mask).stem, *(b.box if b.box is not None else ("",) * 4),
             b.foreground_pixels] for b in result.boxes))
        outputs.write(write_json_atomic, output / SUMMARY_FILE, result.summary)
    return outputs.written
