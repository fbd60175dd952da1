"""IN-9 facts: class names, variations, normalisation statistics and the ImageNet->IN-9 map. The package also holds
the evaluation of the variations (tools.in9.evaluate, not imported here) and its command (tools.in9.cli)."""

from __future__ import annotations

import enum
import functools
import json
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made, so the registry itself loads without it
    import torch

NUM_IN9_CLASSES = 9
RELEASE_IMAGES_PER_CLASS = 450  # in each variation of the IN-9 test release
NUM_IMAGENET_CLASSES = 1000
SUPPORTED_CLASS_COUNTS = (NUM_IN9_CLASSES, NUM_IMAGENET_CLASSES)
IMAGE_SIZE = 224
UNMAPPED = -1  # an ImageNet class that belongs to no IN-9 class; always counted wrong


class Variation(str, enum.Enum):
    """The eight test variations of the release, in the paper's order."""

    ORIGINAL = "original"
    ONLY_FG = "only_fg"
    ONLY_BG_B = "only_bg_b"
    ONLY_BG_T = "only_bg_t"
    NO_FG = "no_fg"
    MIXED_SAME = "mixed_same"
    MIXED_RAND = "mixed_rand"
    MIXED_NEXT = "mixed_next"


VARIATIONS: tuple[str, ...] = tuple(v.value for v in Variation)
MASK_FOLDER = "fg_mask"
SPLIT = "val"  # the test release's split folder
TRAIN_SPLIT = "train"  # training data's (train.py, `tools.data build --split train`)


class Normalization(str, enum.Enum):
    """Which statistics the model wrapper normalises with (`auto` follows the class-count rule)."""

    AUTO = "auto"
    IMAGENET = "imagenet"
    IN9 = "in9"
    NONE = "none"


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IN9_MEAN = (0.4717, 0.4499, 0.3837)
IN9_STD = (0.2600, 0.2516, 0.2575)

STATISTICS = {
    Normalization.IMAGENET: (IMAGENET_MEAN, IMAGENET_STD),
    Normalization.IN9: (IN9_MEAN, IN9_STD),
}


def statistics_for(normalization: Normalization, num_classes: int):
    """(mean, std) for a normalisation choice, or None for no normalisation."""
    if normalization is Normalization.AUTO:
        normalization = Normalization.IN9 if num_classes == NUM_IN9_CLASSES else Normalization.IMAGENET
    if normalization is Normalization.NONE:
        return None
    return STATISTICS[normalization]


def _resource_text(name: str) -> str:
    return resources.files("tools.resources").joinpath(name).read_text(encoding="utf-8")


@functools.cache
def _class_table() -> tuple[tuple[str, str], ...]:
    """(lower-case name, WordNet id of its ancestor synset) of each class, in index order."""
    lines = [line.split() for line in _resource_text("in9_classes.txt").splitlines() if line.strip()]
    return tuple((parts[0].lower(), parts[1]) for parts in lines)


def class_names() -> tuple[str, ...]:
    """The nine class names in index order, lower case (dog, bird, ..., fish)."""
    return tuple(name for name, _ in _class_table())


def class_wordnet_ids() -> tuple[str, ...]:
    """The WordNet id of each class's ancestor synset, in index order (n02084071 for dog, ...)."""
    return tuple(wnid for _, wnid in _class_table())


# What the WordNet synsets of in9_classes.txt are called, where the short class name leaves part out; a text
# prompt names a class by its full name ("a photo of a musical instrument").
FULL_NAMES = {"vehicle": "wheeled vehicle", "instrument": "musical instrument"}


def full_class_names() -> tuple[str, ...]:
    """The nine classes by their synsets' full names, in index order (dog, ..., wheeled vehicle, ...)."""
    return tuple(FULL_NAMES.get(name, name) for name in class_names())


def class_folder_names() -> list[str]:
    """Class folder names in index order, 00_dog ... 08_fish: their sorted order is the class index."""
    return [f"{i:02d}_{name}" for i, name in enumerate(class_names())]


@functools.cache
def _folder_name_index() -> dict[str, int]:
    index: dict[str, int] = {}
    for forms in (class_names(), class_folder_names(), class_wordnet_ids()):
        index.update((form.lower(), label) for label, form in enumerate(forms))
    return index


def class_of_folder(name: str) -> int | None:
    """The class a folder name stands for: its plain name (any case), its release folder name (00_dog) or its
    ancestor synset's WordNet id (n02084071); None otherwise."""
    return _folder_name_index().get(name.strip().lower())


@functools.cache
def in_to_in9_list() -> tuple[int, ...]:
    """The IN-9 class of each ImageNet class index (-1 for none), as a tuple."""
    raw = json.loads(_resource_text("in_to_in9.json"))
    table = [UNMAPPED] * NUM_IMAGENET_CLASSES
    for key, value in raw.items():
        table[int(key)] = int(value)
    return tuple(table)


def in_to_in9_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """A 1000-long int64 lookup tensor: ImageNet class index -> IN-9 class index or -1."""
    import torch  # noqa: PLC0415
    return torch.tensor(in_to_in9_list(), dtype=torch.int64, device=device)


class PredictionMap:
    """Batches of logits to IN-9 predictions on the logits' device: 9 logits, the argmax; 1000, the argmax mapped
    ImageNet->IN-9 (-1, no IN-9 class, never equals a label)."""

    def __init__(self, num_classes: int):
        if num_classes not in SUPPORTED_CLASS_COUNTS:
            raise ValueError(f"num_classes must be 9 or 1000, not {num_classes}")
        self.num_classes = num_classes
        self._tables: dict[torch.device, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        top = logits.argmax(dim=1)
        if self.num_classes == NUM_IN9_CLASSES:
            return top
        table = self._tables.get(top.device)
        if table is None:
            table = self._tables[top.device] = in_to_in9_table(top.device)
        return table[top]
