"""What `tools.data build` reads besides the boxes: the images of --images, in nine class folders matched to the IN-9
classes by name or in an ImageNet-style folder grouped through the map, and the index of the user's --masks."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tools.data.layout import IMAGE_EXTENSIONS, list_folder
from tools.errors import UserError, key_list
from tools.in9 import (
    NUM_IMAGENET_CLASSES,
    UNMAPPED,
    class_folder_names,
    class_names,
    class_of_folder,
    class_wordnet_ids,
    in_to_in9_list,
)

log = logging.getLogger(__name__)

WNID = re.compile(r"n\d{8}")
USER_MASK_EXTENSIONS = (".npy", ".png")


@dataclass(frozen=True)
class SourceImage:
    """An image of --images: its file, its IN-9 label, and the class folder (00_dog ...) it is built into."""

    path: Path
    label: int
    folder: str

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def key(self) -> str:
        return f"{self.folder}/{self.stem}"


def imagenet_groups(folders: list[str]) -> dict[str, int] | None:
    """For an ImageNet-style folder (1000 WordNet-id folders, the index their sorted position), the IN-9 label of
    each folder of an IN-9 class; None when the folders are not WordNet ids."""
    if not folders or not all(WNID.fullmatch(name) for name in folders):
        return None
    if len(folders) != NUM_IMAGENET_CLASSES:
        raise UserError(f"--images holds {len(folders)} WordNet-id folders; an ImageNet-style folder needs all "
                        f"{NUM_IMAGENET_CLASSES} of ImageNet's (the class index is the position among them in sorted "
                        f"order), or pass nine IN-9 class folders instead")
    table = in_to_in9_list()
    return {name: table[index] for index, name in enumerate(sorted(folders)) if table[index] != UNMAPPED}


def _expected_folders() -> str:
    names, folders, wnids = class_names(), class_folder_names(), class_wordnet_ids()
    return (f"{', '.join(names)} (in any case, or numbered {folders[0]} ... {folders[-1]}, or their WordNet ids "
            f"{wnids[0]} ... {wnids[-1]})")


def class_folder_labels(images: Path, folders: list[str]) -> dict[str, int]:
    """The IN-9 label of each of nine class folders, by name (`tools.in9.class_of_folder`), never by sorted order;
    a folder naming no class, a class named twice or missing is refused."""
    matches = {folder: class_of_folder(folder) for folder in folders}
    unknown = [folder for folder, label in matches.items() if label is None]
    if unknown:
        raise UserError(f"--images {images}: the folder(s) {key_list(unknown)} name no IN-9 class; name the nine "
                        f"class folders {_expected_folders()}, or pass an ImageNet-style folder with all "
                        f"{NUM_IMAGENET_CLASSES} of its WordNet-id folders")
    labels = {folder: label for folder, label in matches.items() if label is not None}
    by_label: dict[int, list[str]] = defaultdict(list)
    for folder, label in labels.items():
        by_label[label].append(folder)
    twice = next(((label, alike) for label, alike in by_label.items() if len(alike) > 1), None)
    if twice is not None:
        raise UserError(f"--images {images}: the folders {' and '.join(twice[1])} both hold class "
                        f"{class_names()[twice[0]]}; merge them into one (the class folders are "
                        f"{_expected_folders()})")
    missing = [name for label, name in enumerate(class_names()) if label not in by_label]
    if missing:
        raise UserError(f"--images {images} has no folder for {', '.join(missing)}; every IN-9 class needs a folder: "
                        f"{_expected_folders()}")
    return labels


def list_sources(images: Path) -> tuple[list[str], list[SourceImage]]:
    """The class folders written (00_dog ... 08_fish) and the images of --images: nine folders matched by name, or
    an ImageNet-style folder whose 370 IN-9 classes are grouped into the nine."""
    images = Path(images)
    if not images.is_dir():
        raise UserError(f"--images {images} is not a folder; pass the folder holding one sub-folder per IN-9 class")
    folders = list_folder(images).dirs
    classes = class_folder_names()
    named = all(class_of_folder(folder) is not None for folder in folders)
    groups = None if named else imagenet_groups(folders)
    if groups is not None:
        log.info("ImageNet-style --images: %d of its classes grouped into the nine IN-9 classes", len(groups))
    else:
        groups = class_folder_labels(images, folders)
    members = [(label, classes[label], folder) for folder, label in groups.items()]
    sources, seen = [], {}
    for label, cls, folder in sorted(members):
        listing = list_folder(images / folder)
        if listing.special:
            log.warning("%s: skipped %d entr(y/ies) that are no regular file (a FIFO, a device or a socket, or a "
                        "link to one), never opened: %s", images / folder, len(listing.special), listing.special[0])
        for name in listing.files:
            if not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            source = SourceImage(images / folder / name, label, cls)
            if source.stem in seen:
                raise UserError(f"two images share the stem {source.stem}: {seen[source.stem]} and {source.path}; "
                                f"boxes and masks are matched by stem, so rename one")
            seen[source.stem] = source.path
            sources.append(source)
    if not sources:
        raise UserError(f"--images {images} holds no images in its class folders")
    return classes, sources


def index_user_masks(folder: Path) -> dict[str, Path]:
    """The user's masks by image stem: every .npy and .png file under `folder`, at any depth."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--masks {folder} is not a folder; pass the folder of <stem>.npy or <stem>.png masks")
    index: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix.lower() in USER_MASK_EXTENSIONS:
            if path.stem in index:
                raise UserError(f"two masks for {path.stem}: {index[path.stem]} and {path}; keep one")
            index[path.stem] = path
    return index
