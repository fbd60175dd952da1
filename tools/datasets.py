"""Reading the release's folder layout: listing, checking, decoding images and masks, fingerprints."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, MASK_FOLDER, NUM_IN9_CLASSES, SPLIT, Variation

log = logging.getLogger(__name__)

# The extensions torchvision's ImageFolder (and so the original scripts) accept, compared case-blind.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MASK_EXTENSION = ".npy"


@dataclass(frozen=True)
class ImageRecord:
    """One image of a variation: its path relative to the data root and its class index."""

    relpath: str
    label: int

    @property
    def stem(self) -> str:
        return Path(self.relpath).stem


@dataclass(frozen=True)
class ForegroundRecord:
    """One challenge foreground: the original image, its mask, and its class index."""

    stem: str
    label: int
    image_relpath: str
    mask_relpath: str


def check_data_root(root: Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise UserError(
            f"data path {root} does not exist or is not a folder; pass --data-path the folder that holds "
            f"original/, mixed_rand/, ... (e.g. data/bg_challenge; `python -m tools.data fetch` downloads it)"
        )
    return root


def variation_dir(root: Path, name: str, split: str = SPLIT) -> Path:
    return Path(root) / name / split


def class_folders(folder: Path, what: str, split: str = SPLIT) -> list[str]:
    """The sorted class folder names under `folder`, checked to be nine; the index is the position."""
    if not folder.is_dir():
        raise UserError(
            f"{what} is missing: no folder {folder}; the layout is <data>/{what}/{split}/<class>/ "
            f"(check --data-path, or regenerate the data)"
        )
    names = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))
    if len(names) != NUM_IN9_CLASSES:
        raise UserError(
            f"{folder} has {len(names)} class folders, expected {NUM_IN9_CLASSES} "
            f"(found: {', '.join(names) or 'none'}); every variation needs the nine IN-9 class folders"
        )
    return names


def _sorted_files(folder: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_file() and not entry.name.startswith("."))


def list_variation(root: Path, name: str, split: str = SPLIT) -> list[ImageRecord]:
    """Every image of a variation in ImageFolder order (sorted classes, sorted files), checked non-empty."""
    root = check_data_root(root)
    folder = variation_dir(root, name, split)
    records: list[ImageRecord] = []
    for label, cls in enumerate(class_folders(folder, name, split)):
        files = _sorted_files(folder / cls)
        images = [f for f in files if f.lower().endswith(IMAGE_EXTENSIONS)]
        skipped = len(files) - len(images)
        if skipped:
            log.warning("%s: skipped %d file(s) that are not images by their extension, as the original does",
                        folder / cls, skipped)
        if not images:
            raise UserError(f"class folder {folder / cls} holds no images; every class needs at least one image")
        records.extend(ImageRecord(f"{name}/{split}/{cls}/{f}", label) for f in images)
    return records


def list_foregrounds(root: Path, split: str = SPLIT) -> list[ForegroundRecord]:
    """Every mask in fg_mask/<split>/<class>/<stem>.npy paired with original/<split>/<class>/<stem>.<ext>."""
    root = check_data_root(root)
    mask_dir = variation_dir(root, MASK_FOLDER, split)
    image_dir = variation_dir(root, Variation.ORIGINAL.value, split)
    mask_classes = class_folders(mask_dir, MASK_FOLDER, split)
    image_classes = class_folders(image_dir, Variation.ORIGINAL.value, split)
    if mask_classes != image_classes:
        raise UserError(f"the class folders of {mask_dir} ({', '.join(mask_classes)}) differ from those of "
                        f"{image_dir} ({', '.join(image_classes)}); both need the same nine names")
    records: list[ForegroundRecord] = []
    for label, cls in enumerate(mask_classes):
        masks = {Path(f).stem: f for f in _sorted_files(mask_dir / cls) if f.endswith(MASK_EXTENSION)}
        images = {Path(f).stem: f for f in _sorted_files(image_dir / cls) if f.lower().endswith(IMAGE_EXTENSIONS)}
        lonely_masks = sorted(set(masks) - set(images))
        if lonely_masks:
            raise UserError(f"mask {mask_dir / cls / masks[lonely_masks[0]]} has no image {image_dir / cls}/"
                            f"{lonely_masks[0]}.JPEG ({len(lonely_masks)} such mask(s)); restore the image or "
                            f"remove the mask")
        lonely_images = sorted(set(images) - set(masks))
        if lonely_images:
            raise UserError(f"image {image_dir / cls / images[lonely_images[0]]} has no mask {mask_dir / cls}/"
                            f"{lonely_images[0]}.npy ({len(lonely_images)} such image(s)); every original image "
                            f"needs its foreground mask")
        if not masks:
            raise UserError(f"class folder {mask_dir / cls} holds no masks; every class needs foregrounds")
        for stem in sorted(masks):
            records.append(ForegroundRecord(stem, label, f"{Variation.ORIGINAL.value}/{split}/{cls}/{images[stem]}",
                                            f"{MASK_FOLDER}/{split}/{cls}/{masks[stem]}"))
    return records


def fingerprint(root: Path, relpaths: Sequence[str]) -> dict:
    """File count and a SHA-256 over the sorted relative paths and sizes: what a run read, cheaply."""
    digest = hashlib.sha256()
    for rel in sorted(relpaths):
        digest.update(f"{rel}\t{os.path.getsize(Path(root) / rel)}\n".encode())
    return {"files": len(relpaths), "sha256": digest.hexdigest()}


def decode_rgb(path: Path, size: int = IMAGE_SIZE) -> np.ndarray:
    """The image as HxWx3 uint8 RGB, decoded by Pillow as the original's loader does; checked to be size x size."""
    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"cannot read image {path}: {exc}; replace or remove the file") from None
    if rgb.size != (size, size):
        raise UserError(f"image {path} is {rgb.size[0]}x{rgb.size[1]}, expected {size}x{size}; "
                        f"IN-9 images are {size}x{size} (resize or regenerate it)")
    return np.asarray(rgb)


_mask_value_warning_given = False


def load_mask(path: Path, size: int = IMAGE_SIZE) -> np.ndarray:
    """A foreground mask as an HxW bool array: foreground where the value cast to uint8 is non-zero."""
    global _mask_value_warning_given
    try:
        raw = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read mask {path}: {exc}; masks are .npy arrays of shape ({size}, {size})") from None
    if raw.ndim == 3 and 1 in (raw.shape[0], raw.shape[-1]):
        raw = raw.reshape(raw.shape[1:] if raw.shape[0] == 1 else raw.shape[:-1])
    if raw.shape != (size, size):
        raise UserError(f"mask {path} has shape {raw.shape}, expected ({size}, {size}) like its image; "
                        f"regenerate the mask at the image's size")
    if not (raw.dtype == np.bool_ or np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise UserError(f"mask {path} has dtype {raw.dtype}; masks hold booleans or 0/1 numbers")
    if raw.dtype != np.bool_ and not _mask_value_warning_given:
        values = np.unique(raw)
        if not np.isin(values, (0, 1)).all():
            _mask_value_warning_given = True
            log.warning("mask %s holds values other than 0 and 1 (%s); a pixel counts as foreground where its "
                        "value cast to uint8 is non-zero, as in the original", path, values[:6])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the uint8 cast of out-of-range floats is the rule
        return raw.astype(np.uint8) != 0


def _decode_batch(root: Path, relpaths: Sequence[str]) -> torch.Tensor:
    out = np.empty((len(relpaths), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for i, rel in enumerate(relpaths):
        out[i] = decode_rgb(Path(root) / rel)
    # NHWC storage seen as NCHW: exactly torch's channels_last layout, no copy.
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def iter_decoded_batches(root: Path, relpaths: Sequence[str], batch_size: int, workers: int,
                         pin_memory: bool = False) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start index, uint8 Nx3xHxW batch) in order, decoding ahead in `workers` threads.

    Pillow releases the GIL while it decodes, so threads decode in parallel without pickling batches
    between processes; errors (unreadable files, wrong sizes) surface as they are, naming the file.
    """
    starts = range(0, len(relpaths), batch_size)
    workers = max(1, workers)

    def job(start: int) -> torch.Tensor:
        batch = _decode_batch(root, relpaths[start:start + batch_size])
        return batch.pin_memory() if pin_memory else batch

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode") as pool:
        pending: collections.deque = collections.deque()
        it = iter(starts)
        try:
            for start in it:
                pending.append((start, pool.submit(job, start)))
                if len(pending) >= 2 * workers:
                    break
            while pending:
                start, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(job, nxt)))
                yield start, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
