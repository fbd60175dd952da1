"""What the challenge reads: foregrounds (image and mask) and backgrounds, listed, hashed by content, and
decoded once (through the decoded-data cache) into uint8 tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tools.data import decoders, image_sets, layout
from tools.data.check import quick_check
from tools.data.compositing import MaskArithmetic, byte_masks
from tools.data.hashing import read_and_fingerprint
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
    """What the challenge reads, listed, and its content fingerprint."""

    root: Path
    fingerprint: dict
    decoder: decoders.Decoder = decoders.Decoder.PILLOW  # chosen on a few of these files (`choose_decoder`)
    # the files' bytes, read once when hashed, until decoded (`load_challenge_data` empties it)
    contents: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    hashes: dict[str, str] | None = field(default=None, repr=False, compare=False)  # each file's SHA-256


@dataclass
class ChallengeData(Pairs):
    """What the challenge reads, decoded."""

    fg_images: torch.Tensor  # uint8 (F, 3, H, W)
    # one channel, uint8 (F, 1, H, W): binary: 255 on the foreground, 0 elsewhere (for bitwise compositing);
    # original: the original's weight numerators (w = value / 255)
    masks: torch.Tensor
    bg_images: torch.Tensor  # uint8 (B, 3, H, W)
    fingerprint: dict
    arithmetic: MaskArithmetic = MaskArithmetic.BINARY
    decoder: decoders.Decoder = decoders.Decoder.PILLOW
    cache: dict | None = None  # the decoded-data cache read and written (`DecodedCache.describe`), for the provenance

    def foreground_subset(self, indices: np.ndarray) -> ChallengeData:
        """The same data with only these foregrounds (a --shard's share), backgrounds unchanged."""
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return ChallengeData([self.foregrounds[i] for i in indices], self.backgrounds,
                             self.fg_images.index_select(0, idx), self.masks.index_select(0, idx), self.bg_images,
                             self.fingerprint, self.arithmetic, self.decoder, self.cache)

    def to(self, device: torch.device) -> ChallengeData:
        return ChallengeData(self.foregrounds, self.backgrounds, self.fg_images.to(device), self.masks.to(device),
                             self.bg_images.to(device), self.fingerprint, self.arithmetic, self.decoder, self.cache)


def check_challenge_files(root: Path) -> None:
    """The fast checks of the challenge's folders (`quick_check`): directory listings and a header per class."""
    quick_check(root, [Variation.ONLY_BG_T.value], need_masks=True)


def list_challenge_files(root: Path, workers: int = 4) -> ChallengeFiles:
    """Check and list the foregrounds and backgrounds, and hash their content."""
    check_challenge_files(root)
    root = Path(root)
    foregrounds = layout.list_foregrounds(root)
    backgrounds = layout.list_variation(root, Variation.ONLY_BG_T.value)
    relpaths = [p for r in foregrounds for p in (r.image_relpath, r.mask_relpath)] + [r.relpath for r in backgrounds]
    images = [r.image_relpath for r in foregrounds] + [r.relpath for r in backgrounds]
    content_fingerprint, contents, hashes = read_and_fingerprint(root, relpaths, workers, keep=relpaths)
    decoder = decoders.choose_decoder([contents[rel] for rel in decoders.probe_sample(images)])
    return ChallengeFiles(foregrounds, backgrounds, root, content_fingerprint, decoder, contents, hashes)


def load_challenge_data(files: ChallengeFiles | Path, workers: int, cache: DecodedCache | None = None,
                        progress: bool = True, arithmetic: MaskArithmetic = MaskArithmetic.BINARY) -> ChallengeData:
    """Decode foregrounds, masks and backgrounds once; each read from the decoded-data `cache` where it holds that
    file's content (for a mask, with this arithmetic), whichever command decoded it."""
    if not isinstance(files, ChallengeFiles):
        files = list_challenge_files(files, workers)
    images, masks = image_sets.decode_cached(
        files.root, {"foregrounds": [r.image_relpath for r in files.foregrounds],
                     "backgrounds": [r.relpath for r in files.backgrounds]},
        [r.mask_relpath for r in files.foregrounds], files.fingerprint, cache, arithmetic, workers, progress,
        files.decoder, files.contents, files.hashes)
    files.contents.clear()  # decoded: the bytes are not needed again
    fg, bg = images["foregrounds"], images["backgrounds"]
    masks = byte_masks(masks) if arithmetic is MaskArithmetic.BINARY else masks.unsqueeze(1).contiguous()
    return ChallengeData(files.foregrounds, files.backgrounds, fg, masks, bg, files.fingerprint, arithmetic,
                         files.decoder, cache.describe() if cache is not None else None)
