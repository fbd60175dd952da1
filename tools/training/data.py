"""Training batches: which images, in which order, with which background and crop, all from (seed, epoch, index).

Workers only decode and draw each sample's random choices from its own seed, so a batch is the same with any
number of workers, processes or restarts. The device then pastes each swapped foreground on its background
(tools.data.compositing, the challenge's function) and applies the crop and flip to the composite: the label,
the foreground and its mask stay aligned because the augmentation sees one finished image.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tools.data import decoding as datasets
from tools.data import layout
from tools.data.compositing import byte_masks, composite
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, TRAIN_SPLIT, Variation
from tools.runtime import to_device
from tools.training.config import TrainConfig
from tools.training.resample import resized_crops

log = logging.getLogger(__name__)


BACKGROUND_POOL = Variation.ONLY_BG_T.value  # the paper's Mixed-Rand backgrounds: tiled, no foreground left
RATIO_RANGE = (3 / 4, 4 / 3)


def derived_seed(*parts: int | str) -> int:
    """A 63-bit seed from a tuple such as (seed, "order", epoch): independent streams, reproducible anywhere."""
    words = [p if isinstance(p, int) else int.from_bytes(p.encode(), "little") for p in parts]
    return int(np.random.SeedSequence(words).generate_state(2, np.uint64)[0] >> np.uint64(1))


@dataclass
class TrainingData:
    """What a run trains on: image (or foreground) paths and labels, masks, and the background pool."""

    root: Path
    images: list[str]
    labels: list[int]
    masks: list[str] | None = None  # bg-swap: one mask per image
    backgrounds: list[str] | None = None  # bg-swap: the only_bg_t pool
    background_labels: list[int] | None = None

    def __len__(self) -> int:
        return len(self.images)

    def relpaths(self) -> list[str]:
        return self.images + (self.masks or []) + (self.backgrounds or [])


def list_training_data(config: TrainConfig) -> TrainingData:
    """The training folder's records for the configured variation and method, checked."""
    root = layout.check_data_root(config.data_path)
    if not config.swap:
        records = layout.list_variation(root, config.train_variation, TRAIN_SPLIT)
        return TrainingData(root, [r.relpath for r in records], [r.label for r in records])
    if config.train_variation != Variation.ORIGINAL.value:
        raise UserError(f"bg-swap pastes the foregrounds of original/ with their masks; --train-variation "
                        f"{config.train_variation} cannot be combined with it (drop one of the two)")
    try:
        foregrounds = layout.list_foregrounds(root, TRAIN_SPLIT)
        pool = layout.list_variation(root, BACKGROUND_POOL, TRAIN_SPLIT)
    except UserError as exc:
        raise UserError(f"bg-swap needs foreground masks and {BACKGROUND_POOL} backgrounds: {exc}") from None
    return TrainingData(root, [f.image_relpath for f in foregrounds], [f.label for f in foregrounds],
                        [f.mask_relpath for f in foregrounds], [r.relpath for r in pool], [r.label for r in pool])


class StepSampler(Sampler):
    """Yields, for each step from `start_step` of `epoch` to the end of epoch `end_epoch - 1` (by default the end
    of `epoch`), this rank's share of the global batch, and seeds the random draws made on it. One sampler over
    the whole run gives each epoch the batches a sampler of that epoch alone gives.

    The global batch of step s is positions s*B .. (s+1)*B-1 of the epoch's seeded permutation; rank r of W
    takes every W-th of them from r, so W processes together see exactly the one-process batch."""

    def __init__(self, size: int, batch_size: int, seed: int, epoch: int, start_step: int = 0, rank: int = 0,
                 world_size: int = 1, end_epoch: int | None = None):
        self.size, self.batch_size, self.seed, self.epoch = size, batch_size, seed, epoch
        self.start_step, self.rank, self.world_size = start_step, rank, world_size
        self.end_epoch = epoch + 1 if end_epoch is None else end_epoch

    @staticmethod
    def steps_per_epoch(size: int, batch_size: int) -> int:
        return size // batch_size

    def __len__(self) -> int:
        epochs = self.end_epoch - self.epoch
        return max(0, self.steps_per_epoch(self.size, self.batch_size) * epochs - self.start_step)

    def batch_seed(self, step: int) -> int:
        """The seed of the draws made once per global batch (MixUp or CutMix, λ, the CutMix box): the same in every
        process, so they are the one-process run's."""
        return derived_seed(self.seed, "step", step)

    def share_seed(self, step: int) -> int:
        """The seed of the draws made over this rank's share of the batch (dropout masks): its own in each process,
        as a one-process run draws them afresh for every image."""
        return derived_seed(self.seed, "share", step, self.rank, self.world_size)

    def __iter__(self):
        for epoch in range(self.epoch, self.end_epoch):
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
                derived_seed(self.seed, "order", epoch))).tolist()
            for step in range(self.start_step if epoch == self.epoch else 0,
                              self.steps_per_epoch(self.size, self.batch_size)):
                batch = order[step * self.batch_size:(step + 1) * self.batch_size]
                yield [(epoch, index) for index in batch[self.rank::self.world_size]]


def crop_box(rng: torch.Generator, scale_min: float, size: int = IMAGE_SIZE) -> tuple[int, int, int, int]:
    """A random resized crop's (top, left, height, width), drawn as torchvision's RandomResizedCrop.get_params
    draws it from the global generator seeded by one draw of `rng`, but from a generator of its own: the same
    boxes, without forking and reseeding the global state for every sample."""
    gen = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=rng)))
    area = size * size
    log_ratio = torch.log(torch.tensor(RATIO_RANGE))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale_min, 1.0, generator=gen).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=gen)).item()
        width = int(round(math.sqrt(target_area * aspect_ratio)))
        height = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < width <= size and 0 < height <= size:
            top = int(torch.randint(0, size - height + 1, size=(1,), generator=gen))
            left = int(torch.randint(0, size - width + 1, size=(1,), generator=gen))
            return top, left, height, width
    return 0, 0, size, size  # torchvision's fallback for a square image: the whole image


@dataclass
class DecodedStore:
    """The training images (and the bg-swap masks and background pool) decoded once, uint8 NCHW and bool NHW,
    in memory: workers index it instead of decoding each sample every epoch."""

    images: torch.Tensor
    masks: torch.Tensor | None = None
    backgrounds: torch.Tensor | None = None


def decoded_store(data: TrainingData, fingerprint: dict, workers: int, progress: bool) -> DecodedStore:
    """The one place training decodes: tools.data.decoding's content-keyed cache (key: the files' bytes and the
    decoder's version), made on the first run and read back by every later run on the same files."""
    groups = {"images": data.images, **({"backgrounds": data.backgrounds} if data.backgrounds is not None else {})}
    decoded, masks = datasets.decode_cached(data.root, groups, data.masks or [], fingerprint,
                                            datasets.default_cache_dir(), workers=max(1, workers), progress=progress)
    return DecodedStore(decoded["images"], masks if data.masks is not None else None, decoded.get("backgrounds"))


class TrainingSet(Dataset):
    """Item (epoch, index) -> decoded image (and mask and background for a swap) plus its random choices."""

    def __init__(self, data: TrainingData, config: TrainConfig, store: DecodedStore):
        self.data, self.config, self.store = data, config, store
        if data.backgrounds is not None:
            labels = np.asarray(data.background_labels)
            self.pool_by_class = [np.flatnonzero(labels == k) for k in range(NUM_IN9_CLASSES)]

    def __len__(self) -> int:
        return len(self.data)

    def _background(self, rng: np.random.Generator, label: int) -> int:
        same = rng.random() < self.config.swap_same_class_prob
        klass = label if same else int(rng.integers(NUM_IN9_CLASSES))
        pool = self.pool_by_class[klass]
        return int(pool[rng.integers(len(pool))])

    def __getitem__(self, item: tuple[int, int]) -> dict:
        epoch, index = item
        label = self.data.labels[index]
        sample = {"image": self.store.images[index], "label": label}
        rng = np.random.default_rng(derived_seed(self.config.seed, "sample", epoch, index))
        if self.data.masks is not None:
            swap = bool(rng.random() < self.config.swap_prob)
            background = self._background(rng, label) if swap else index
            sample["swap"] = swap
            sample["mask"] = self.store.masks[index] if swap else torch.ones(IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
            sample["background"] = self.store.backgrounds[background] if swap else sample["image"]
        if self.config.augment:
            gen = torch.Generator().manual_seed(derived_seed(self.config.seed, "crop", epoch, index))
            sample["crop"] = torch.tensor(crop_box(gen, self.config.crop_scale))
            sample["flip"] = bool(torch.rand((), generator=gen) < 0.5)
        return sample


def make_loader(data: TrainingData, config: TrainConfig, sampler: StepSampler, pin_memory: bool,
                store: DecodedStore) -> DataLoader:
    """The batches of `sampler` (one for the whole run: its workers live as long as the loader, and prefetch across
    epochs), in pinned memory when `pin_memory` (a CUDA device: tools.runtime.to_device copies them without waiting)."""
    workers = config.workers
    return DataLoader(TrainingSet(data, config, store), batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                      persistent_workers=workers > 0, prefetch_factor=4 if workers else None)


def device_batch(batch: dict, device: torch.device, augment: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NCHW images on the device, swapped and augmented there, and their labels."""
    images = to_device(batch["image"], device)
    if "mask" in batch:
        masks = to_device(batch["mask"], device)
        images = composite(images, to_device(batch["background"], device), byte_masks(masks))
    if augment:
        if device.type == "cpu":  # torch's vectorised uint8 kernel: faster per image than the matmuls on a CPU
            from torchvision.transforms.v2 import functional as F  # noqa: PLC0415
            out = torch.empty_like(images)
            for i, (top, left, height, width) in enumerate(batch["crop"].tolist()):
                out[i] = F.resized_crop(images[i], top, left, height, width, [IMAGE_SIZE, IMAGE_SIZE],
                                        antialias=True)
        else:  # one batched resample for the batch (within one uint8 level of the loop above)
            out = resized_crops(images, to_device(batch["crop"], device), IMAGE_SIZE)
        # a select, not an index of the flipped images: nonzero() would wait for the device every step
        images = torch.where(to_device(batch["flip"], device).view(-1, 1, 1, 1), out.flip(-1), out)
    return images, to_device(batch["label"], device)
