"""What the challenge reads: foregrounds (image and mask) and backgrounds, listed, hashed and decoded once
through the decoded-data cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tools.data import layout
from tools.data.compositing import MaskArithmetic, byte_masks
from tools.data.image_sets import ImageSet, decode_cached, read_image_set
from tools.data.store import DecodedCache
from tools.in9 import Variation


@dataclass
class Pairs:
    """The two sides of the challenge's pairs: foregrounds (image and mask) and backgrounds, with labels."""

    foregrounds: list[layout.ForegroundRecord]
    backgrounds: list[layout.ImageRecord]

    @property
    def fg_labels(self) -> np.ndarray:
        return np.array([r.label for r in self.foregrounds], dtype=np.int64)

    @property
    def bg_labels(self) -> np.ndarray:
        return np.array([r.label for r in self.backgrounds], dtype=np.int64)


@dataclass
class ChallengeFiles(Pairs):
    """What the challenge reads, listed, and its image set (content, decoder, cache)."""

    image_set: ImageSet


@dataclass
class ChallengeData(ChallengeFiles):
    """What the challenge reads, decoded."""

    fg_images: torch.Tensor  # uint8 (F, 3, H, W)
    # one channel, uint8 (F, 1, H, W): binary: 255 on the foreground, 0 elsewhere (for bitwise compositing);
    # original: the original's weight numerators (w = value / 255)
    masks: torch.Tensor
    bg_images: torch.Tensor  # uint8 (B, 3, H, W)
    arithmetic: MaskArithmetic = MaskArithmetic.BINARY

    def foreground_subset(self, indices: np.ndarray) -> ChallengeData:
        """The same data with only these foregrounds (a --shard's share), backgrounds unchanged."""
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return replace(self, foregrounds=[self.foregrounds[i] for i in indices],
                       fg_images=self.fg_images.index_select(0, idx), masks=self.masks.index_select(0, idx))

    def to(self, device: torch.device) -> ChallengeData:
        return replace(self, fg_images=self.fg_images.to(device), masks=self.masks.to(device),
                       bg_images=self.bg_images.to(device))


def list_challenge_files(root: Path, workers: int = 4, cache: DecodedCache | None = None,
                         hold: bool = False) -> ChallengeFiles:
    """List the foregrounds and backgrounds (folders checked first: `tools.prepared_run.check_folders`) and hash
    their content (`cache`, `hold`: as `image_sets.read_image_set`)."""
    foregrounds = layout.list_foregrounds(Path(root))
    backgrounds = layout.list_variation(Path(root), Variation.ONLY_BG_T.value)
    relpaths = [p for r in foregrounds for p in (r.image_relpath, r.mask_relpath)] + [r.relpath for r in backgrounds]
    images = [r.image_relpath for r in foregrounds] + [r.relpath for r in backgrounds]
    return ChallengeFiles(foregrounds, backgrounds, read_image_set(root, relpaths, images, workers, cache, hold))


def load_challenge_data(files: ChallengeFiles, workers: int, progress: bool = True,
                        arithmetic: MaskArithmetic = MaskArithmetic.BINARY) -> ChallengeData:
    """Decode foregrounds, masks and backgrounds once, through the decoded-data cache (masks per arithmetic)."""
    images, masks = decode_cached(files.image_set, {"foregrounds": [r.image_relpath for r in files.foregrounds],
                                                    "backgrounds": [r.relpath for r in files.backgrounds]},
                                  [r.mask_relpath for r in files.foregrounds], arithmetic, workers, progress)
    files.image_set.contents.clear()  # decoded: the bytes are not needed again
    masks = byte_masks(masks) if arithmetic is MaskArithmetic.BINARY else masks.unsqueeze(1).contiguous()
    return ChallengeData(files.foregrounds, files.backgrounds, files.image_set, images["foregrounds"], masks,
                         images["backgrounds"], arithmetic)
