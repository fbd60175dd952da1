"""An epoch's random choices for every image at once (background swaps, crop boxes, flips), from one table of
uniforms per (seed, epoch) whose row i depends on (seed, epoch, i) only; see docs/training.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES

# which way of drawing made a run's crops, flips and swaps, in its resume key: 2 is this module's table per epoch
# (1, unnamed in older keys, was a generator per sample), so a state saved with other draws is not continued
DRAWS_VERSION = 2
CROP_TRIES = 10  # torchvision's get_params
RATIO_RANGE = (3 / 4, 4 / 3)
# a row's columns: swap or not, own class or not, random class, pool member; each try's area and aspect; top, left; flip
SLOTS = SimpleNamespace(swap=0, scale=slice(4, 4 + CROP_TRIES), ratio=slice(4 + CROP_TRIES, 4 + 2 * CROP_TRIES),
                        top=4 + 2 * CROP_TRIES, left=5 + 2 * CROP_TRIES, flip=6 + 2 * CROP_TRIES)
WIDTH = SLOTS.flip + 1


def derived_seed(*parts: int | str) -> int:
    """A 63-bit seed from a tuple such as (seed, "order", epoch): independent streams, reproducible anywhere."""
    words = [p if isinstance(p, int) else int.from_bytes(p.encode(), "little") for p in parts]
    return int(np.random.SeedSequence(words).generate_state(2, np.uint64)[0] >> np.uint64(1))


def epoch_uniforms(seed: int, epoch: int, size: int) -> torch.Tensor:
    """(size, WIDTH) float64 uniforms in [0, 1): row i holds image i's numbers for this epoch."""
    gen = torch.Generator().manual_seed(derived_seed(seed, "draws", epoch))
    return torch.rand(size, WIDTH, dtype=torch.float64, generator=gen)


def crop_boxes(u: torch.Tensor, scale_min: float, size: int = IMAGE_SIZE) -> torch.Tensor:
    """(N, 4) int64 (top, left, height, width): get_params' first fitting try per row, else the whole image."""
    low, high = math.log(RATIO_RANGE[0]), math.log(RATIO_RANGE[1])
    target_area = size * size * (scale_min + (1.0 - scale_min) * u[:, SLOTS.scale])
    aspect = torch.exp(low + (high - low) * u[:, SLOTS.ratio])
    widths = torch.sqrt(target_area * aspect).round().long()
    heights = torch.sqrt(target_area / aspect).round().long()
    fits = (widths > 0) & (widths <= size) & (heights > 0) & (heights <= size)
    first = fits.int().argmax(1, keepdim=True)  # the first try that fits
    height, width = heights.gather(1, first)[:, 0], widths.gather(1, first)[:, 0]
    top = (u[:, SLOTS.top] * (size - height + 1)).long()
    left = (u[:, SLOTS.left] * (size - width + 1)).long()
    boxes = torch.stack([top, left, height, width], 1)
    whole = torch.tensor([0, 0, size, size])
    return torch.where(fits.any(1, keepdim=True), boxes, whole)


def background_picks(u: torch.Tensor, labels: torch.Tensor, background_labels: torch.Tensor, swap_prob: float,
                     same_class_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(swapped, background index) per row: a swap with probability swap_prob; its background's class the image's
    own with probability same_class_prob, else uniform over the classes; then uniform over that class's pool."""
    swaps = u[:, SLOTS.swap] < swap_prob
    random_class = (u[:, SLOTS.swap + 2] * NUM_IN9_CLASSES).long()
    classes = torch.where(u[:, SLOTS.swap + 1] < same_class_prob, labels, random_class)
    order = torch.argsort(background_labels, stable=True)  # the pool grouped by class, in listing order
    counts = torch.bincount(background_labels, minlength=NUM_IN9_CLASSES)
    starts = counts.cumsum(0) - counts
    member = (u[:, SLOTS.swap + 3] * counts[classes]).long()
    return swaps, order[starts[classes] + member]


@dataclass
class EpochDraws:
    """Every image's choices for one epoch, indexed by image index."""

    boxes: torch.Tensor  # (N, 4) int64
    flips: torch.Tensor  # (N,) bool
    swaps: torch.Tensor | None = None  # (N,) bool, bg-swap only
    backgrounds: torch.Tensor | None = None  # (N,) int64 into the background pool

    @classmethod
    def from_uniforms(cls, u: torch.Tensor, labels: torch.Tensor, background_labels: torch.Tensor | None,
                      scale_min: float, swap_prob: float, same_class_prob: float) -> EpochDraws:
        swaps = backgrounds = None
        if background_labels is not None:
            swaps, backgrounds = background_picks(u, labels, background_labels, swap_prob, same_class_prob)
        return cls(crop_boxes(u, scale_min), u[:, SLOTS.flip] < 0.5, swaps, backgrounds)
