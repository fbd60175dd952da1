"""The release's folder layout, walked in one place: `<data>/<variation>/<split>/<class>/<file>` and
`<data>/fg_mask/<split>/<class>/<stem>.npy`. Listings are sorted (ImageFolder order: the class index is the
folder's position); links are followed, a FIFO, device or socket is never opened (`list_folder`)."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from tools.errors import UserError, option
from tools.in9 import MASK_FOLDER, NUM_IN9_CLASSES, SPLIT, VARIATIONS, Variation, class_folder_names, class_of_folder

log = logging.getLogger(__name__)

# Image extensions read, compared case-blind: torchvision.datasets.folder.IMG_EXTENSIONS as of torchvision 0.20+.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MASK_EXTENSION = ".npy"
DATA_ENV = "BG_CHALLENGE_DATA"
DEFAULT_DATA_ROOT = Path("data") / "bg_challenge"
LAYOUT_NAMES: tuple[str, ...] = (*VARIATIONS, MASK_FOLDER)  # every top-level folder of a data root
MIXED = (Variation.MIXED_SAME.value, Variation.MIXED_RAND.value, Variation.MIXED_NEXT.value)
SUMMARY_NAME = "build_summary.json"  # what `tools.data build` writes beside the folders it built
PROVENANCE_FOLDER = "provenance"  # where `tools.data provenance` writes in the data folder unless told otherwise


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


def default_data_root() -> Path:
    """$BG_CHALLENGE_DATA, else data/bg_challenge (where the README's `fetch` puts it)."""
    return Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_ROOT)


def check_data_root(root: Path | None, flag: str = "--data-path") -> Path:
    """The data folder (`default_data_root()` when None), checked to exist; `flag` names it in the message."""
    if root is None:
        root = default_data_root()
        if not root.is_dir():
            raise UserError(
                f"no data folder given and none at {root} ({option(flag)}, else ${DATA_ENV}, else "
                f"{DEFAULT_DATA_ROOT}); pass {option(flag)}, set {DATA_ENV}, or download the release with "
                f"`python -m tools.data fetch --data-path {DEFAULT_DATA_ROOT}`")
    root = Path(root)
    if not root.is_dir():
        raise UserError(
            f"data path {root} does not exist or is not a folder; pass {option(flag)} the folder that holds "
            f"original/, mixed_rand/, ... (e.g. {DEFAULT_DATA_ROOT}; `python -m tools.data fetch` downloads it)"
        )
    return root


def data_file(root: Path, relpath: str) -> Path:
    """The regular file `relpath` names under `root`, links resolved: what a results file may make a report read.
    UserError for a path absolute, climbing out, resolving outside `root`, missing, unreadable or not a regular file."""
    where = Path(root) / str(relpath)
    named = PurePosixPath(str(relpath))
    if not str(relpath) or named.is_absolute() or ".." in named.parts:
        raise UserError(f"{str(relpath)!r} is not a path inside the data folder {root}")
    try:
        inside = Path(root).resolve(strict=True)
        real = (inside / named).resolve(strict=True)
        mode = real.stat().st_mode
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a loop of links (RuntimeError before Python 3.13)
        raise UserError(f"cannot read {where} ({getattr(exc, 'strerror', None) or exc})") from None
    if not real.is_relative_to(inside):
        raise UserError(f"{where} resolves to {real}, outside the data folder {inside}")
    if not stat.S_ISREG(mode):
        raise UserError(f"{where} is not a regular file")
    return real


def outside(real_root: str, path: Path | str, folders: dict[str, str] | None = None) -> str | None:
    """Where `path` really is when outside the data folder whose realpath is `real_root`; None inside. `folders`
    memoises real folder paths, so a file that is no link costs one lstat, not a walk (a fifth of its hashing)."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    real_parent = None if folders is None else folders.get(parent)
    if real_parent is None:
        real_parent = os.path.realpath(parent)
        if folders is not None:
            folders[parent] = real_parent
    real = os.path.realpath(path) if os.path.islink(path) else os.path.join(real_parent, os.path.basename(path))
    return None if real.startswith(real_root.rstrip(os.sep) + os.sep) else real


def outside_note(root: Path, targets: list[str]) -> str | None:
    """What to say of the files read from outside the data folder `root` (their real paths), None for none."""
    if not targets:
        return None
    folders = sorted({os.path.dirname(t) for t in targets})
    more = f" and {len(folders) - 3} more folder(s)" if len(folders) > 3 else ""
    return (f"{len(targets)} file(s) lie outside the data folder {root}, reached through links (in "
            f"{', '.join(folders[:3])}{more}): they are read as the data")


def variation_dir(root: Path, name: str, split: str = SPLIT) -> Path:
    return Path(root) / name / split


def class_folders(folder: Path, what: str, split: str = SPLIT) -> list[str]:
    """The sorted class folder names under `folder`, checked to be nine (and, if named after the IN-9 classes, in
    their order: `class_order_problem`)."""
    if not folder.is_dir():
        raise UserError(
            f"{what} is missing: no folder {folder}; the layout is <data>/{what}/{split}/<class>/ "
            f"(check {option('--data-path')}, or regenerate the data)"
        )
    names = list_folder(folder).dirs
    if len(names) != NUM_IN9_CLASSES:
        raise UserError(
            f"{folder} has {len(names)} class folders, expected {NUM_IN9_CLASSES} "
            f"(found: {', '.join(names) or 'none'}); every variation needs the nine IN-9 class folders"
        )
    problem = class_order_problem(names)
    if problem is not None:
        raise UserError(f"{folder}: {problem}")
    return names


def class_order_problem(names: list[str], examples: int = 3) -> str | None:
    """What is wrong when class folders named after the IN-9 classes (dog, 03_reptile, n02084071) sort into other
    classes' positions; None when the order is right or any name is the user's own."""
    labels = [class_of_folder(name) for name in names]
    if not labels or None in labels:
        return None
    wrong = [f"{name} would be class {position}, IN-9's {label}"
             for position, (name, label) in enumerate(zip(names, labels)) if label != position]
    if not wrong:
        return None
    folders = class_folder_names()
    shown = "; ".join(wrong[:examples]) + ("; ..." if len(wrong) > examples else "")
    return (f"class folders named after IN-9 classes sort into other indices than theirs ({shown}); rename them "
            f"{folders[0]} ... {folders[-1]}")


class Listing(NamedTuple):
    """A folder's entries by kind, each sorted by name, hidden ones left out (`list_folder`)."""

    dirs: list[str]  # folders, or links to one
    files: list[str]  # regular files, or links to one
    special: list[str]  # anything else: a FIFO, a device, a socket (or a link to one), which is never read


def list_folder(folder: Path) -> Listing:
    """A folder's entries by kind, hidden ones left out: the one listing of the layout (scripts, verify, training,
    build inputs). A folder that cannot be listed, an entry that cannot be looked at and a non-UTF-8 name are one
    UserError each, naming it."""
    try:
        with os.scandir(folder) as it:
            names = sorted(entry.name for entry in it if not entry.name.startswith("."))
    except OSError as exc:
        raise UserError(f"cannot list {folder} ({exc.strerror or exc}); make it readable, or pass another "
                        f"folder") from None
    listing = Listing([], [], [])
    for name in names:
        path = Path(folder) / name
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{folder} holds a name that is not UTF-8 ({os.fsencode(name)!r}); rename it "
                            f"(e.g. with `convmv`), or move it out of the data folder") from None
        try:
            mode = os.stat(path).st_mode  # through links; opens nothing (a FIFO would block an open)
        except OSError as exc:
            raise UserError(f"cannot read {path} ({exc.strerror or exc}: a link loop, a link to nothing, or no "
                            f"permission?); fix or remove it") from None
        kind = listing.dirs if stat.S_ISDIR(mode) else listing.files if stat.S_ISREG(mode) else listing.special
        kind.append(name)
    return listing


def not_read_note(listing: Listing, kept: list[str], folder_name: str) -> str | None:
    """What of a class folder's `listing` the scripts do not read (non-image files, non-regular entries), said once;
    None when all are read."""
    others = len(listing.files) - len(kept)
    what = [f"{others} file(s) that are not {'masks' if folder_name == MASK_FOLDER else 'images'} by their "
            f"extension, as the original does"] if others else []
    if listing.special:
        what.append(f"{len(listing.special)} entr(y/ies) that are no regular file (a FIFO, a device or a socket, or "
                    f"a link to one), never opened: {listing.special[0]}")
    return "skipped " + "; and ".join(what) if what else None


def is_listed(folder_name: str, file_name: str) -> bool:
    """Whether the scripts read the file: .npy in fg_mask, an image extension (any case) elsewhere."""
    if folder_name == MASK_FOLDER:
        return file_name.endswith(MASK_EXTENSION)
    return file_name.lower().endswith(IMAGE_EXTENSIONS)


def list_variation(root: Path, name: str, split: str = SPLIT) -> list[ImageRecord]:
    """Every image of a variation in ImageFolder order (sorted classes, sorted files), checked non-empty."""
    root = check_data_root(root)
    folder = variation_dir(root, name, split)
    records: list[ImageRecord] = []
    for label, cls in enumerate(class_folders(folder, name, split)):
        listing = list_folder(folder / cls)
        images = [f for f in listing.files if is_listed(name, f)]
        note = not_read_note(listing, images, name)
        if note:
            log.warning("%s: %s", folder / cls, note)
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
        listings = {name: list_folder(folder / cls) for name, folder in ((MASK_FOLDER, mask_dir),
                                                                         (Variation.ORIGINAL.value, image_dir))}
        for name, listing in listings.items():
            if listing.special:
                log.warning("%s: %s", variation_dir(root, name, split) / cls,
                            not_read_note(listing, listing.files, name))
        masks = {Path(f).stem: f for f in listings[MASK_FOLDER].files if is_listed(MASK_FOLDER, f)}
        images = {Path(f).stem: f for f in listings[Variation.ORIGINAL.value].files
                  if is_listed(Variation.ORIGINAL.value, f)}
        lonely_masks = sorted(set(masks) - set(images))
        if lonely_masks:
            extension = Path(next(iter(images.values()))).suffix if images else ".<image extension>"
            raise UserError(f"mask {mask_dir / cls / masks[lonely_masks[0]]} has no image {image_dir / cls}/"
                            f"{lonely_masks[0]}{extension} ({len(lonely_masks)} such mask(s)); restore the image or "
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
