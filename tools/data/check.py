"""Checking a data folder: every problem both scripts would meet (`verify_layout`), and the fast form the
scripts run before they start (`quick_check`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from tools.data.layout import (
    MIXED,
    SUMMARY_NAME,
    check_data_root,
    class_order_problem,
    is_listed,
    list_folder,
    outside,
    outside_note,
)
from tools.errors import NUMPY_READ_ERRORS, UserError
from tools.in9 import IMAGE_SIZE, MASK_FOLDER, NUM_IN9_CLASSES, SPLIT, VARIATIONS, Variation
from tools.provenance import read_json, read_npy
from tools.threads import default_workers, map_in_threads

log = logging.getLogger(__name__)


MAX_EXAMPLES = 3
MASK_SHAPES = ((IMAGE_SIZE, IMAGE_SIZE), (IMAGE_SIZE, IMAGE_SIZE, 1), (1, IMAGE_SIZE, IMAGE_SIZE))


class _Problems:
    """Problems grouped by where and what, so thousands of like ones read as one line with examples."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], list[str]] = {}

    def add(self, where: str, what: str, example: str | None = None) -> None:
        examples = self._groups.setdefault((where, what), [])
        if example is not None:
            examples.append(example)

    def lines(self) -> list[str]:
        lines = []
        for (where, what), examples in self._groups.items():
            if not examples:
                lines.append(f"{where}: {what}")
                continue
            shown = ", ".join(examples[:MAX_EXAMPLES])
            more = len(examples) - MAX_EXAMPLES
            lines.append(f"{where}: {len(examples)} {what}: {shown}" + (f", ... ({more} more)" if more > 0 else ""))
        return lines


@dataclass
class VerifyReport:
    """What `verify_layout` found: counts[folder][class] (variations and fg_mask) and the problems."""

    root: Path
    classes: list[str]
    counts: dict[str, dict[str, int]]
    problems: list[str]
    notes: list[str]
    images_checked: int
    decoded: bool
    masks_checked: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def first_problem(self) -> str:
        """The first problem, and how many more there are."""
        more = f" (and {len(self.problems) - 1} more problem(s))" if len(self.problems) > 1 else ""
        return f"{self.problems[0]}{more}"

    def table(self) -> list[str]:
        classes = self.classes or sorted({c for per in self.counts.values() for c in per})
        first = max([len("variation"), *(len(name) for name in self.counts)])
        widths = [max(len(c), 5) for c in classes]
        lines = [" ".join(["variation".ljust(first), *(c.rjust(w) for c, w in zip(classes, widths)), "total".rjust(6)])]
        for name, per in self.counts.items():
            cells = [str(per[c]) if c in per else "-" for c in classes]
            lines.append(" ".join([name.ljust(first), *(v.rjust(w) for v, w in zip(cells, widths)),
                                   str(sum(per.values())).rjust(6)]))
        return lines

    def lines(self) -> list[str]:
        how = "decoded" if self.decoded else "header-checked (pass --full to decode every image)"
        lines = [f"{self.root}: {self.images_checked} images {how}, {self.masks_checked} masks loaded", *self.table()]
        lines.extend(f"note: {note}" for note in self.notes)
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines.extend(f"  {p}" for p in self.problems)
        else:
            lines.append("no problems found")
        return lines


def _check_image(path: Path, decode: bool) -> tuple[str, str] | None:
    """(what, example) when the image is unreadable or not IMAGE_SIZE square, else None."""
    try:
        with Image.open(path) as img:
            size = img.size
            if decode:
                img.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        return "unreadable image(s)", f"{path.name} ({exc})"
    if size != (IMAGE_SIZE, IMAGE_SIZE):
        return f"image(s) not {IMAGE_SIZE}x{IMAGE_SIZE}", f"{path.name} ({size[0]}x{size[1]})"
    return None


def _check_mask(path: Path, load: bool) -> tuple[str, str] | None:
    """(what, example) when the mask is unreadable, of the wrong shape or type, or not 0/1, else None."""
    try:
        array = read_npy(path, mmap=not load)
    except NUMPY_READ_ERRORS as exc:
        return "unreadable mask(s)", f"{path.name} ({exc})"
    if array.shape not in MASK_SHAPES:
        return f"mask(s) not of shape ({IMAGE_SIZE}, {IMAGE_SIZE})", f"{path.name} {array.shape}"
    if not (array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer)
            or np.issubdtype(array.dtype, np.floating)):
        return "mask(s) of a non-numeric dtype", f"{path.name} ({array.dtype})"
    if load and array.dtype != np.bool_:
        values = np.unique(array)
        if not np.isin(values, (0, 1)).all():
            return "mask(s) with values other than 0 and 1", f"{path.name} ({', '.join(map(str, values[:4]))})"
    return None


def _run_checks(check, paths: list[Path], workers: int, progress: bool, desc: str) -> list[tuple[Path, tuple]]:
    results = map_in_threads(check, paths, workers, progress, desc)
    return [(path, result) for path, result in zip(paths, results) if result is not None]


def _compare_with_original(listings: dict[str, dict[str, list[str]]], original: dict[str, list[str]],
                           problems: _Problems, notes: list[str], split: str) -> None:
    """A problem per class whose image count differs from original's; differently named images in the variations
    made from one image are a note (nothing the scripts rely on)."""
    for name, per in listings.items():
        if name in (Variation.ORIGINAL.value, MASK_FOLDER):
            continue
        renamed = 0
        for cls, files in per.items():
            if cls not in original:
                continue
            if len(files) != len(original[cls]):
                problems.add(f"{name}/{split}/{cls}", f"{len(files)} images where original has {len(original[cls])}")
            if name not in MIXED:
                renamed += len({Path(f).stem for f in files} - {Path(f).stem for f in original[cls]})
        if renamed:
            notes.append(f"{name}/{split}: {renamed} image stem(s) that original does not have")


def _scan(root: Path, names: Sequence[str], need_masks: bool, images: str, load_masks: bool, compare_counts: bool,
          workers: int, progress: bool, split: str = SPLIT, original_only: Collection[str] = ()) -> VerifyReport:
    """The one walk behind verify_layout and quick_check. images: 'sample' (first per class), 'header', 'full'.
    original_only: 'class/stem' of original images with no mask or other variation by design."""
    root = check_data_root(root)
    problems, notes = _Problems(), []
    names = list(dict.fromkeys([*names, *((Variation.ORIGINAL.value, MASK_FOLDER) if need_masks else ())]))
    listings: dict[str, dict[str, list[str]]] = {}  # folder -> class -> kept files
    for name in names:
        folder = root / name / split
        where = f"{name}/{split}"
        if not folder.is_dir():
            problems.add(where, "missing: no such folder")
            continue
        classes, stray, _ = list_folder(folder)
        if stray:
            notes.append(f"{where}: {len(stray)} file(s) outside the class folders, ignored ({stray[0]}, ...)")
        listings[name] = {}
        for cls in classes:
            listing = list_folder(folder / cls)
            kept = [f for f in listing.files if is_listed(name, f)]
            if len(kept) < len(listing.files):
                other = [f for f in listing.files if not is_listed(name, f)]
                notes.append(f"{where}/{cls}: {len(other)} file(s) of another type, ignored ({other[0]}, ...)")
            if listing.special:
                notes.append(f"{where}/{cls}: {len(listing.special)} entr(y/ies) that are no regular file (a FIFO, "
                             f"a device or a socket, or a link to one), never opened ({listing.special[0]}, ...)")
            if not kept:
                problems.add(f"{where}/{cls}", f"no {'masks' if name == MASK_FOLDER else 'images'}")
            listings[name][cls] = kept

    reference_name = next((n for n in (Variation.ORIGINAL.value, *listings) if n in listings), None)
    reference = list(listings[reference_name]) if reference_name else []
    order_problem = class_order_problem(reference, MAX_EXAMPLES)
    if order_problem is not None:
        problems.add(f"{reference_name}/{split}", order_problem)
    for name, per in listings.items():
        count = "" if len(per) == NUM_IN9_CLASSES else f"{len(per)} class folders, expected {NUM_IN9_CLASSES}"
        if list(per) != reference:
            missing = [c for c in reference if c not in per]
            extra = [c for c in per if c not in reference]
            problems.add(f"{name}/{split}", f"class folders differ from those of {reference_name}/{split}: missing "
                                            f"{', '.join(missing) or 'none'}; extra {', '.join(extra) or 'none'}"
                                            + (f" ({count})" if count else ""))
        elif count:
            problems.add(f"{name}/{split}", f"{count} ({', '.join(per) or 'none'})")

    original = {cls: [f for f in files if f"{cls}/{Path(f).stem}" not in original_only]
                for cls, files in listings.get(Variation.ORIGINAL.value, {}).items()}
    alone = sum(len(files) for files in listings.get(Variation.ORIGINAL.value, {}).values()) - \
        sum(len(files) for files in original.values())
    if alone:
        notes.append(f"{Variation.ORIGINAL.value}/{split}: {alone} image(s) without a box, in original/ alone "
                     f"(build --keep-unboxed)")
    original_stems = {cls: {Path(f).stem for f in files} for cls, files in original.items()}
    for cls, files in listings.get(MASK_FOLDER, {}).items():
        if cls not in original_stems:
            continue
        stems = {Path(f).stem for f in files}
        for stem in sorted(stems - original_stems[cls]):
            problems.add(f"{MASK_FOLDER}/{split}/{cls}", "mask(s) without an original image", stem)
        for stem in sorted(original_stems[cls] - stems):
            problems.add(f"{MASK_FOLDER}/{split}/{cls}", "original image(s) without a mask", stem)
    if compare_counts:
        _compare_with_original(listings, original, problems, notes, split)

    image_paths, mask_paths = [], []
    if images != "sample":  # verify: where every file really is (the quick check lists, and the run says it)
        real_root, folders = os.path.realpath(root), {}
        note = outside_note(root, [real for name, per in listings.items() for cls, files in per.items() for f in files
                                   for real in [outside(real_root, root / name / split / cls / f, folders)] if real])
        if note:
            notes.append(note)
    for name, per in listings.items():
        for cls, files in per.items():
            chosen = files[:1] if images == "sample" or (name == MASK_FOLDER and not load_masks) else files
            (mask_paths if name == MASK_FOLDER else image_paths).extend(root / name / split / cls / f for f in chosen)
    decode = images == "full"
    found = _run_checks(lambda p: _check_image(p, decode), image_paths, workers, progress, "images")
    found += _run_checks(lambda p: _check_mask(p, load_masks), mask_paths, workers, progress, "masks")
    for path, (what, example) in found:
        problems.add(path.parent.relative_to(root).as_posix(), what, example)

    counts = {name: {cls: len(files) for cls, files in per.items()} for name, per in listings.items()}
    return VerifyReport(root, reference, counts, problems.lines(), notes, len(image_paths), decode,
                        len(mask_paths) if load_masks else 0)


def verify_layout(root: Path, full: bool = False, workers: int | None = None, progress: bool = False,
                  split: str = SPLIT) -> VerifyReport:
    """Check everything both scripts need and collect every problem: eight variations and fg_mask with the same nine
    non-empty class folders and original's counts, images readable and IMAGE_SIZE square (header only unless `full`),
    masks 0/1 (224, 224) .npy paired with original both ways. `build --keep-unboxed` images are a note."""
    return _scan(root, VARIATIONS, need_masks=True, images="full" if full else "header", load_masks=True,
                 compare_counts=True, workers=workers or default_workers(), progress=progress, split=split,
                 original_only=built_original_only(check_data_root(root), split))


def built_original_only(root: Path, split: str) -> set[str]:
    """'class/stem' of the images `build --keep-unboxed` put in original/ alone, as the build's summary of this
    split lists them (none without one; a special file there is never opened)."""
    try:
        summary = read_json(root / SUMMARY_NAME)
        if summary["config"]["split"] != split:
            return set()
        return {str(key) for key in summary["unboxed_in_original"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def quick_scan(root: Path, variations: Sequence[str], need_masks: bool = False, split: str = SPLIT) -> VerifyReport:
    """The fast check the scripts run before they start, its problems returned (see `quick_check`)."""
    return _scan(root, variations, need_masks, images="sample", load_masks=False, compare_counts=False, workers=1,
                 progress=False, split=split)


def quick_check(root: Path, variations: Sequence[str], need_masks: bool = False, split: str = SPLIT) -> dict[str, int]:
    """The fast check the scripts run before they start: listings (nine non-empty class folders, named alike) and
    each class's first image header (IMAGE_SIZE square), with need_masks one mask per original image. Returns the
    file count per folder checked; UserError with the first problem."""
    report = quick_scan(root, variations, need_masks, split)
    if report.problems:
        raise UserError(f"data in {report.root}: {report.first_problem()}; run `python -m tools.data verify "
                        f"--data-path {report.root}` for the full list")
    return {name: sum(per.values()) for name, per in report.counts.items()}
