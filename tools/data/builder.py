"""Building the eight variations and fg_mask from labelled images with one bounding box each, as in the paper's
Appendix A (resize 256, centre crop 224, four filters, GrabCut or your own masks); inputs are found by
`tools.data.build_inputs`. See docs/data.md, build."""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from tools.data import boxes as boxes_mod
from tools.data import grabcut, variations
from tools.data.build_inputs import SourceImage, index_user_masks, list_sources
from tools.data.layout import LAYOUT_NAMES, MASK_EXTENSION, MIXED, SUMMARY_NAME
from tools.data.temporary import temporary_folder
from tools.errors import NUMPY_READ_ERRORS, UserError
from tools.in9 import IMAGE_SIZE, MASK_FOLDER, NUM_IN9_CLASSES, SPLIT, Variation
from tools.provenance import read_npy, write_json_atomic
from tools.threads import default_workers, map_in_threads

log = logging.getLogger(__name__)

MAX_BOX_FRACTION = 0.9  # of the crop's area
MIN_BOX_INSIDE = 0.5  # of the resized box's area inside the crop
MIN_FOREGROUND_FRACTION = 0.1  # of the box's area
DEFAULT_JPEG_QUALITY = 95
BUILDING_INFIX = ".building-"  # the output is built in <parent>/.<out name>.building-<host>-<pid>-<random>


class ImageFormat(str, enum.Enum):
    JPEG = "jpeg"
    PNG = "png"


EXTENSIONS = {ImageFormat.JPEG: ".JPEG", ImageFormat.PNG: ".png"}


class DropReason(str, enum.Enum):
    """Why an image was left out, in the order the filters run."""

    NO_BOX = "no_box"
    SEVERAL_BOXES = "several_boxes"
    UNREADABLE = "unreadable"
    EMPTY_BOX = "empty_box"
    BOX_TOO_LARGE = "box_too_large"
    BOX_OUTSIDE_CROP = "box_outside_crop"
    NO_MASK = "no_mask"
    GRABCUT_FAILED = "grabcut_failed"
    SMALL_FOREGROUND = "small_foreground"


@dataclass
class BuiltImage:
    """A kept image: its box in the crop, its packed mask, and the images whose backgrounds it was mixed with."""

    source: SourceImage
    box: variations.Box
    foreground_fraction: float
    packed_mask: np.ndarray
    source_size: tuple[int, int]  # (width, height) of the original image
    backgrounds: dict[str, int] = field(default_factory=dict)  # mixed variation -> index into BuildResult.kept

    def mask(self) -> np.ndarray:
        return np.unpackbits(self.packed_mask, count=IMAGE_SIZE * IMAGE_SIZE).reshape(IMAGE_SIZE, IMAGE_SIZE) != 0


@dataclass
class BuildResult:
    out: Path
    config: dict
    classes: list[str]
    total: int
    kept: list[BuiltImage]
    dropped: dict[DropReason, list[str]]
    boxes_rescaled: int = 0
    same_class_fallbacks: list[str] = field(default_factory=list)
    unboxed: list[SourceImage] = field(default_factory=list)  # --keep-unboxed: in original/ only

    def summary(self) -> dict:
        return {
            "config": self.config,
            "input_images": self.total,
            "kept": len(self.kept),
            "dropped": {reason.value: len(self.dropped.get(reason, [])) for reason in DropReason},
            "kept_per_class": {cls: sum(1 for k in self.kept if k.source.folder == cls) for cls in self.classes},
            "boxes_rescaled": self.boxes_rescaled,
            "unboxed_in_original": [source.key for source in self.unboxed],
            "mixed_same_fallbacks": self.same_class_fallbacks,
            "dropped_images": {reason.value: self.dropped[reason] for reason in DropReason if reason in self.dropped},
            "images": [{"image": k.source.key, "label": k.source.label, "box": list(k.box),
                        "foreground_fraction": round(k.foreground_fraction, 4),
                        **{v: self.kept[i].source.key for v, i in k.backgrounds.items()}} for k in self.kept],
        }

    def lines(self) -> list[str]:
        dropped = sum(len(v) for v in self.dropped.values())
        lines = [f"built {self.out} from {self.total} images: kept {len(self.kept)}, dropped {dropped}"]
        lines.extend(f"  dropped, {reason.value}: {len(self.dropped[reason])}" for reason in DropReason
                     if self.dropped.get(reason))
        per_class = self.summary()["kept_per_class"]
        lines.append("  kept per class: " + ", ".join(f"{cls} {n}" for cls, n in per_class.items()))
        if self.unboxed:
            lines.append(f"  without a box, in original/ only (--keep-unboxed): {len(self.unboxed)}")
        if self.boxes_rescaled:
            lines.append(f"  boxes rescaled from the size their XML declares: {self.boxes_rescaled}")
        if self.same_class_fallbacks:
            lines.append(f"  mixed_same used the image's own background (no other image of its class): "
                         f"{len(self.same_class_fallbacks)}")
        lines.append(f"summary: {self.out / SUMMARY_NAME}")
        return lines


def variation_arrays(crop: np.ndarray, box: variations.Box, mask: np.ndarray,
                     backgrounds: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The variations of one crop, before encoding; `backgrounds`: per mixed variation, the only_bg_t array its
    foreground is laid over."""
    out = {
        Variation.ORIGINAL.value: crop,
        Variation.ONLY_FG.value: variations.only_fg(crop, mask),
        Variation.ONLY_BG_B.value: variations.only_bg_b(crop, box),
        Variation.ONLY_BG_T.value: variations.only_bg_t(crop, box),
        Variation.NO_FG.value: variations.no_fg(crop, mask),
    }
    for name, background in (backgrounds or {}).items():
        out[name] = variations.composite(crop, background, mask)
    return out


def load_user_mask(path: Path, geometry: boxes_mod.CropGeometry) -> np.ndarray:
    """A user's mask (.npy or .png; non-zero is foreground) in the crop's pixels: one of the original's size is
    resized (nearest) and cropped; an IMAGE_SIZE square one of another size is taken as already cropped."""
    try:
        if path.suffix.lower() == ".png":
            with Image.open(path) as img:
                raw = np.asarray(img.convert("L"))
        else:
            raw = read_npy(path)
    except (*NUMPY_READ_ERRORS, UnidentifiedImageError) as exc:
        raise UserError(f"cannot read mask {path}: {exc}; masks are .npy arrays or .png images") from None
    if raw.ndim == 3 and raw.shape[-1] == 1:
        raw = raw[..., 0]
    if not (raw.dtype == np.bool_ or np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise UserError(f"mask {path} has dtype {raw.dtype}; masks hold booleans or numbers (non-zero is foreground)")
    mask = raw != 0
    if mask.shape == (geometry.height, geometry.width):
        return geometry.mask(mask)
    if mask.shape == (geometry.size, geometry.size):
        return mask
    raise UserError(f"mask {path} has shape {raw.shape}; it must match its image ({geometry.height}, {geometry.width}) "
                    f"or be already cropped ({geometry.size}, {geometry.size})")


def _open_rgb(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        log.warning("cannot read %s (%s); left out", path, exc)
        return None


@dataclass
class _Prepared:
    geometry: boxes_mod.CropGeometry
    crop: np.ndarray
    box: variations.Box


def _prepare(source: SourceImage, entry: boxes_mod.BoxEntry | None) -> _Prepared | DropReason:
    """Decode, resize and crop one image and apply the box filters (the mask comes later)."""
    if entry is None or not entry.boxes:
        return DropReason.NO_BOX
    if len(entry.boxes) > 1:
        return DropReason.SEVERAL_BOXES
    img = _open_rgb(source.path)
    if img is None:
        return DropReason.UNREADABLE
    geometry = boxes_mod.CropGeometry.for_image(*img.size)
    (box,) = entry.boxes_for(*img.size)
    if entry.declared_size is not None and entry.declared_size != img.size:
        log.debug("%s: box rescaled from the declared size %s to %s", source.path, entry.declared_size, img.size)
    if boxes_mod.box_area(box) <= 0:
        return DropReason.EMPTY_BOX
    moved = geometry.box(box)
    inside = boxes_mod.clip_box(moved, geometry.size)
    if boxes_mod.box_area(inside) > MAX_BOX_FRACTION * geometry.size ** 2:
        return DropReason.BOX_TOO_LARGE
    if boxes_mod.box_area(inside) < MIN_BOX_INSIDE * boxes_mod.box_area(moved):
        return DropReason.BOX_OUTSIDE_CROP
    return _Prepared(geometry, geometry.image(img), boxes_mod.pixel_box(inside, geometry.size))


def crop_image(path: Path) -> np.ndarray:
    """An image file resized and centre-cropped exactly as `build` does it (no filters)."""
    img = _open_rgb(path)
    if img is None:
        raise UserError(f"cannot read image {path}; replace or remove it")
    return boxes_mod.CropGeometry.for_image(*img.size).image(img)


def _filter_and_mask(source: SourceImage, entry: boxes_mod.BoxEntry | None, user_masks: dict[str, Path] | None,
                     iterations: int, seed: int) -> BuiltImage | DropReason:
    """One image through the filters: the box filters, then the mask (the user's or GrabCut's) and its size."""
    prepared = _prepare(source, entry)
    if isinstance(prepared, DropReason):
        return prepared
    if user_masks is not None:
        if source.stem not in user_masks:
            return DropReason.NO_MASK
        mask = load_user_mask(user_masks[source.stem], prepared.geometry)
    else:
        try:
            mask = grabcut.grabcut_mask(prepared.crop, prepared.box, iterations, seed)
        except ValueError as exc:
            log.warning("GrabCut failed on %s (%s); left out", source.path, exc)
            return DropReason.GRABCUT_FAILED
    x0, y0, x1, y1 = prepared.box
    fraction = float(mask.sum()) / ((x1 - x0) * (y1 - y0))
    if fraction < MIN_FOREGROUND_FRACTION:
        return DropReason.SMALL_FOREGROUND
    size = (prepared.geometry.width, prepared.geometry.height)
    return BuiltImage(source, prepared.box, fraction, np.packbits(mask), size)


def build(images: Path, boxes: Path, out: Path, masks: Path | None = None, seed: int = 0,
          jpeg_quality: int = DEFAULT_JPEG_QUALITY, image_format: ImageFormat = ImageFormat.JPEG,
          grabcut_iterations: int = grabcut.DEFAULT_ITERATIONS, workers: int | None = None,
          progress: bool = True, split: str = SPLIT, keep_unboxed: bool = False) -> BuildResult:
    """Make the eight variations and fg_mask in the release's layout under `out` (empty or new). Nothing is written
    until every image passed the filters and every class kept one; written into a temporary folder renamed to `out`
    once complete. `workers`: threads (default up to 8). `split`: val (as the test release) or train;
    `keep_unboxed` (train only): images without a box go to `original` alone (IN-9L-style)."""
    out = Path(out)
    if keep_unboxed and split == SPLIT:
        raise UserError(f"--keep-unboxed makes an IN-9L-style training set, whose original/ holds more images than "
                        f"the other variations: use it with --split train, not {SPLIT}")
    workers = workers or default_workers()
    image_format = ImageFormat(image_format)
    if not 1 <= jpeg_quality <= 100:
        raise UserError(f"--jpeg-quality must be between 1 and 100, not {jpeg_quality}")
    if grabcut_iterations < 1:
        raise UserError(f"--grabcut-iterations must be at least 1, not {grabcut_iterations}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; build never overwrites: pass a new folder")
    classes, sources = list_sources(images)
    entries = boxes_mod.read_boxes(boxes)
    user_masks = index_user_masks(masks) if masks is not None else None
    if user_masks is None:
        grabcut.require_opencv()
    unknown = len(set(entries) - {s.stem for s in sources})
    if unknown:
        log.info("%d box entries name no image under %s; ignored", unknown, images)

    def filter_and_mask(source: SourceImage) -> BuiltImage | DropReason:
        return _filter_and_mask(source, entries.get(source.stem), user_masks, grabcut_iterations, seed)

    kept: list[BuiltImage] = []
    dropped: dict[DropReason, list[str]] = defaultdict(list)
    unboxed: list[SourceImage] = []
    for source, outcome in zip(sources, map_in_threads(filter_and_mask, sources, workers, progress, "filter, mask")):
        if keep_unboxed and outcome is DropReason.NO_BOX:
            unboxed.append(source)
        elif isinstance(outcome, DropReason):
            dropped[outcome].append(source.key)
        else:
            kept.append(outcome)

    empty = [cls for label, cls in enumerate(classes) if not any(k.source.label == label for k in kept)]
    if empty:
        raise UserError(f"no image of class(es) {', '.join(empty)} passed the filters, and every class folder needs "
                        f"at least one image; add images or boxes for them (nothing was written to {out})")

    config = {"images": str(images), "boxes": str(boxes), "masks": None if masks is None else str(masks),
              "mask_source": "grabcut" if user_masks is None else "masks", "seed": seed,
              "image_format": image_format.value, "jpeg_quality": jpeg_quality,
              "grabcut_iterations": grabcut_iterations if user_masks is None else None,
              "resize": boxes_mod.RESIZE_SIZE, "crop": IMAGE_SIZE, "max_box_fraction": MAX_BOX_FRACTION,
              "min_box_inside": MIN_BOX_INSIDE, "min_foreground_fraction": MIN_FOREGROUND_FRACTION}
    rescaled = sum(1 for k in kept if entries[k.source.stem].declared_size not in (None, k.source_size))
    config.update(split=split, keep_unboxed=keep_unboxed)
    result = BuildResult(out, config, classes, len(sources), kept, dict(dropped), rescaled, unboxed=unboxed)
    _choose_backgrounds(result, seed)
    target = Path(os.path.abspath(out))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the folder {target.parent} for --out: {exc.strerror or exc}") from None
    with temporary_folder(target.parent, f".{target.name}{BUILDING_INFIX}") as folder:
        _write(result, folder, image_format, jpeg_quality, workers, progress, split)
        write_json_atomic(folder / SUMMARY_NAME, result.summary())
        try:
            os.replace(folder, target)  # the whole build appears at once: an interrupted one leaves nothing
        except OSError as exc:
            raise UserError(f"cannot move the finished build into --out {out} ({exc.strerror or exc}): something "
                            f"was put there while it ran; nothing was written, rerun with a new folder") from None
    return result


def _choose_backgrounds(result: BuildResult, seed: int) -> None:
    """Seeded choices: another image of the same class, of a random class, and of the next class."""
    rng = np.random.default_rng(seed)
    by_class = [[i for i, k in enumerate(result.kept) if k.source.label == c] for c in range(NUM_IN9_CLASSES)]

    def pick(pool: list[int]) -> int:
        return pool[int(rng.integers(len(pool)))]

    for i, image in enumerate(result.kept):
        label = image.source.label
        same = [j for j in by_class[label] if j != i]
        if not same:
            result.same_class_fallbacks.append(image.source.key)
            same = [i]
        random_class = int(rng.integers(NUM_IN9_CLASSES))
        anywhere = [j for j in by_class[random_class] if j != i] or by_class[random_class]
        image.backgrounds = {
            Variation.MIXED_SAME.value: pick(same),
            Variation.MIXED_RAND.value: pick(anywhere),
            Variation.MIXED_NEXT.value: pick(by_class[(label + 1) % NUM_IN9_CLASSES]),
        }
    if result.same_class_fallbacks:
        log.warning("%d image(s) are the only ones kept in their class; their mixed_same uses their own background",
                    len(result.same_class_fallbacks))


def _run_all(fn, items: list, workers: int, progress: bool, desc: str) -> None:
    """fn over items in threads; on an error or an interrupt, the threads have stopped when this returns."""
    with contextlib.closing(map_in_threads(fn, items, workers, progress, desc)) as results:
        for _ in results:
            pass


def _write(result: BuildResult, folder: Path, image_format: ImageFormat, quality: int, workers: int,
           progress: bool, split: str = SPLIT) -> None:
    extension = EXTENSIONS[image_format]
    for name in LAYOUT_NAMES:
        for cls in result.classes:
            (folder / name / split / cls).mkdir(parents=True, exist_ok=True)

    def save(array: np.ndarray, target: Path) -> None:
        if image_format is ImageFormat.JPEG:
            Image.fromarray(array).save(target, format="JPEG", quality=quality)
        else:
            Image.fromarray(array).save(target, format="PNG", compress_level=1)  # lossless at any level

    def write_one(image: BuiltImage) -> None:
        # the crops are made again from the files rather than kept: memory stays flat for any number of images
        crop, mask = crop_image(image.source.path), image.mask()
        backgrounds = {}
        for variation in MIXED:
            other = result.kept[image.backgrounds[variation]]
            backgrounds[variation] = variations.only_bg_t(crop_image(other.source.path), other.box)
        for name, array in variation_arrays(crop, image.box, mask, backgrounds).items():
            save(array, folder / name / split / image.source.folder / f"{image.source.stem}{extension}")
        np.save(folder / MASK_FOLDER / split / image.source.folder / f"{image.source.stem}{MASK_EXTENSION}", mask)

    def write_unboxed(source: SourceImage) -> None:
        save(crop_image(source.path),
             folder / Variation.ORIGINAL.value / split / source.folder / f"{source.stem}{extension}")

    _run_all(write_one, result.kept, workers, progress, "write")
    _run_all(write_unboxed, result.unboxed, workers, progress, "write unboxed")
