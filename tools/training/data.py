"""Training batches: which images, in which order, with which background and crop, all from (seed, epoch, index),
so a batch is the same with any number of workers, processes or restarts. The device composites first and
augments the finished image, so label, foreground and mask stay aligned (docs/training.md)."""

from __future__ import annotations

import functools
import logging
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from tools.data import image_sets, layout
from tools.data.compositing import byte_masks, composite
from tools.data.store import DecodedCache, default_cache_dir
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, TRAIN_SPLIT, Variation
from tools.runtime import to_device
from tools.training.config import TrainConfig
from tools.training.draws import EpochDraws, derived_seed, epoch_uniforms
from tools.training.resample import resized_crops

log = logging.getLogger(__name__)


BACKGROUND_POOL = Variation.ONLY_BG_T.value  # the paper's Mixed-Rand backgrounds: tiled, no foreground left


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
    """This rank's share of each global batch from (`epoch`, `start_step`) to the end of epoch `end_epoch - 1`
    (default: `epoch`'s end): rank r of W takes every W-th position from r of the global batch, so W processes
    together see exactly the one-process batch."""

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
        """The seed of the draws made once per global batch (MixUp/CutMix), the same in every process."""
        return derived_seed(self.seed, "step", step)

    def share_seed(self, step: int) -> int:
        """The seed of the draws made over this rank's share (dropout masks), its own in each process."""
        return derived_seed(self.seed, "share", step, self.rank, self.world_size)

    def __iter__(self):
        for epoch in range(self.epoch, self.end_epoch):
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
                derived_seed(self.seed, "order", epoch))).tolist()
            for step in range(self.start_step if epoch == self.epoch else 0,
                              self.steps_per_epoch(self.size, self.batch_size)):
                batch = order[step * self.batch_size:(step + 1) * self.batch_size]
                yield [(epoch, index) for index in batch[self.rank::self.world_size]]


@dataclass
class DecodedStore:
    """The training images (and bg-swap masks and pool) decoded once: uint8 NCHW in NHWC storage, bool NHW masks."""

    images: torch.Tensor
    masks: torch.Tensor | None = None
    backgrounds: torch.Tensor | None = None


def decoded_store(data: TrainingData, fingerprint: dict, workers: int, progress: bool,
                  hashes: dict[str, str] | None = None) -> DecodedStore:
    """The one place training decodes, through tools.data.image_sets's content-keyed cache. `hashes`: the files'
    SHA-256 by relative path where listing computed them."""
    groups = {"images": data.images, **({"backgrounds": data.backgrounds} if data.backgrounds is not None else {})}
    images = image_sets.ImageSet(data.root, fingerprint, hashes, cache=DecodedCache(default_cache_dir()))
    decoded, masks = image_sets.decode_cached(images, groups, data.masks or [], workers=max(1, workers),
                                            progress=progress, channels_last=True)
    return DecodedStore(decoded["images"], masks if data.masks is not None else None, decoded.get("backgrounds"))


class TrainingSet(Dataset):
    """A batch of (epoch, index) items -> their decoded images gathered at once, with the epoch's draws for them."""

    def __init__(self, data: TrainingData, config: TrainConfig, store: DecodedStore, pin: bool = False):
        self.data, self.config, self.store, self.pin = data, config, store, pin
        self.labels = torch.tensor(data.labels)
        self.background_labels = None if data.backgrounds is None else torch.tensor(data.background_labels)
        self._draws: tuple[int, EpochDraws] | None = None

    def __len__(self) -> int:
        return len(self.data)

    def draws(self, epoch: int) -> EpochDraws:
        if self._draws is None or self._draws[0] != epoch:
            c = self.config
            self._draws = epoch, EpochDraws.from_uniforms(epoch_uniforms(c.seed, epoch, len(self.data)), self.labels,
                                                          self.background_labels, c.crop_scale, c.swap_prob,
                                                          c.swap_same_class_prob)
        return self._draws[1]

    def __getitems__(self, items: list[tuple[int, int]]) -> dict:
        epochs = {epoch for epoch, _ in items}
        if len(epochs) != 1:
            raise ValueError(f"a batch spans epochs {sorted(epochs)}")
        draws = self.draws(epochs.pop())
        index = torch.tensor([i for _, i in items])
        batch = {"image": self._gather(self.store.images, index), "label": self.labels[index]}
        if self.data.masks is not None:  # an image not swapped: a full mask keeps all of it
            swaps = draws.swaps[index]
            batch["swap"] = swaps
            batch["mask"] = self._gather(self.store.masks, index)
            if not bool(swaps.all()):
                batch["mask"] |= ~swaps.view(-1, 1, 1)
            batch["background"] = self._gather(self.store.backgrounds, draws.backgrounds[index])
        if self.config.augment:
            batch["crop"], batch["flip"] = draws.boxes[index], draws.flips[index]
        return batch

    def __getitem__(self, item: tuple[int, int]) -> dict:
        return self.__getitems__([item])

    def _gather(self, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """source[index] in the source's memory layout, written straight to where the batch goes next (pinned
        memory with `pin`, shared memory in a worker), so nothing copies it again."""
        channels_last = source.dim() == 4 and not source.is_contiguous()
        rows = source.permute(0, 2, 3, 1) if channels_last else source  # NHWC storage: contiguous rows
        shape = (len(index), *rows.shape[1:])
        if get_worker_info() is not None:
            out = rows.new(rows._typed_storage()._new_shared(math.prod(shape), device=rows.device)).view(shape)
        else:
            out = torch.empty(shape, dtype=rows.dtype, pin_memory=self.pin)
        torch.index_select(rows, 0, index, out=out)
        return out.permute(0, 3, 1, 2) if channels_last else out


def whole_batch(batch: dict) -> dict:
    """The DataLoader's collate function: the batch comes stacked."""
    return batch


PREFETCH_BATCHES = 4  # per DataLoader worker
SHARED_MEMORY = Path("/dev/shm")  # where Linux's shared memory lives: a worker's batches pass through it


def loader_workers(requested: int, batch_bytes: int) -> int:
    """`requested`, or no workers where /dev/shm cannot hold their batches in flight (they would die of a bus
    error mid-run; a container's default is 64 MB)."""
    if not requested or not SHARED_MEMORY.is_dir():
        return requested
    in_flight = requested * PREFETCH_BATCHES * batch_bytes
    free = shutil.disk_usage(SHARED_MEMORY).free
    if free >= 2 * in_flight:  # room to spare: other processes use it too
        return requested
    log.warning("%s has %d MB free, and %d DataLoader workers keep about %d MB of batches there: gathering the "
                "batches in the training process instead (the same batches; raise the container's --shm-size, or "
                "pass --workers 0 to silence this)", SHARED_MEMORY, free >> 20, requested, in_flight >> 20)
    return 0


def make_loader(data: TrainingData, config: TrainConfig, sampler: StepSampler, pin_memory: bool,
                store: DecodedStore) -> DataLoader:
    """The batches of `sampler` (one for the whole run: workers prefetch across epochs), pinned if `pin_memory`."""
    share = -(-sampler.batch_size // sampler.world_size)  # the images a worker gathers per batch
    row_bytes = sum(rows[0].numel() * rows.element_size() for rows in (store.images, store.masks, store.backgrounds)
                    if rows is not None)
    workers = loader_workers(config.workers, share * row_bytes)
    # Linux: workers forked, sharing the store's memory, as Python's default start method did up to 3.13 (3.14's
    # forkserver would pickle the store to them, moving gigabytes into /dev/shm); elsewhere the platform's own
    context = "fork" if workers and sys.platform.startswith("linux") else None
    return DataLoader(TrainingSet(data, config, store, pin=pin_memory and not workers), batch_sampler=sampler,
                      num_workers=workers, pin_memory=pin_memory, collate_fn=whole_batch,
                      persistent_workers=workers > 0, prefetch_factor=PREFETCH_BATCHES if workers else None,
                      multiprocessing_context=context)


@functools.cache
def _mover(device: torch.device):
    """How a batch's tensors reach `device`: on CUDA through the decoding's side stream; off the CPU contiguous
    (torch 2.6-2.7's MPS bitwise kernels mis-order channels-last operands, pytorch#145203)."""
    if device.type == "cuda":
        return image_sets.DeviceCopies(device)
    if device.type == "cpu":
        return lambda tensor: to_device(tensor, device)
    return lambda tensor: to_device(tensor, device).contiguous()


def device_batch(batch: dict, device: torch.device, augment: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 NCHW images on the device, swapped and augmented there, and their labels."""
    move = _mover(device)
    images = move(batch["image"])
    if "mask" in batch:
        masks = byte_masks(move(batch["mask"]), channels_last=not images.is_contiguous())  # in the images' layout
        images = composite(images, move(batch["background"]), masks)
    if augment:
        if device.type == "cpu":  # torch's vectorised uint8 kernel: faster per image than the matmuls on a CPU
            out = torch.empty_like(images)  # the images' layout: channels-last from the store, the kernel's fastest
            for i, ((top, left, height, width), flip) in enumerate(zip(batch["crop"].tolist(),
                                                                         batch["flip"].tolist())):
                # torchvision's resized_crop(antialias=True): the box's slice, then torch's antialiased resize
                crop = torch.nn.functional.interpolate(images[i:i + 1, :, top:top + height, left:left + width],
                                                       size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                                                       align_corners=False, antialias=True)[0]
                out[i] = crop.flip(-1) if flip else crop  # the flipped ones alone: a batch-wide select costs more
            images = out
        else:  # one batched resample for the batch (within one uint8 level of the loop above)
            out = resized_crops(images, move(batch["crop"]), IMAGE_SIZE)
            # a select, not an index of the flipped images: nonzero() would wait for the device every step
            images = torch.where(move(batch["flip"]).view(-1, 1, 1, 1), out.flip(-1), out)
    return images, move(batch["label"])
