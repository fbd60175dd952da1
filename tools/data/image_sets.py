"""The image sets a run reads (`ImageSet`), decoded through the decoded-data cache (`tools.data.store`): images
as uint8 tensors, masks ready for compositing, kept on a CUDA device where they fit. See docs/how-it-works.md."""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tools.data import decoders
from tools.data.compositing import MaskArithmetic, original_weights
from tools.data.decoders import Decoder, decode_bytes, pillow_rgb
from tools.data.hashing import open_regular, read_and_fingerprint
from tools.data.store import DecodedCache, Packs, PackWriter
from tools.errors import NUMPY_READ_ERRORS, UserError, option
from tools.in9 import IMAGE_SIZE
from tools.progress import progress_bar
from tools.provenance import provenance, read_npy
from tools.runtime import to_device
from tools.threads import ContextThreadPool, stop_point

log = logging.getLogger(__name__)

DECODE_BATCH = 64  # images decode_images takes from iter_decoded_batches at once (its bar's step); jobs are JOB_IMAGES


def decode_rgb(path: Path, size: int = IMAGE_SIZE, decoder: Decoder = Decoder.PILLOW,
               data: bytes | None = None) -> np.ndarray:
    """The image as HxWx3 uint8 RGB, as the original's loader gives it (Pillow's `convert("RGB")`, no EXIF
    rotation), from `data` (the file's bytes) when already read; checked to be size x size."""
    if data is None:
        try:
            with open_regular(path) as fh:
                data = fh.read()
        except OSError as exc:
            raise UserError(f"cannot read image {path}: {exc}; replace or remove the file") from None
    return decode_bytes(data, path, size, decoder)


def read_mask(path: Path, size: int = IMAGE_SIZE, data: bytes | None = None) -> np.ndarray:
    """A foreground mask's raw HxW values (from `data` when already read), checked for shape and a numeric dtype."""
    try:
        raw = read_npy(path if data is None else data)
    except NUMPY_READ_ERRORS as exc:
        raise UserError(f"cannot read mask {path}: {exc}; masks are .npy arrays of shape ({size}, {size})") from None
    if raw.ndim == 3 and 1 in (raw.shape[0], raw.shape[-1]):
        raw = raw.reshape(raw.shape[1:] if raw.shape[0] == 1 else raw.shape[:-1])
    if raw.shape != (size, size):
        raise UserError(f"mask {path} has shape {raw.shape}, expected ({size}, {size}) like its image; "
                        f"regenerate the mask at the image's size")
    if not (raw.dtype == np.bool_ or np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise UserError(f"mask {path} has dtype {raw.dtype}; masks hold booleans or 0/1 numbers")
    return raw


def is_binary(raw: np.ndarray) -> bool:
    return raw.dtype == np.bool_ or bool(((raw == 0) | (raw == 1)).all())


def load_mask(path: Path, arithmetic: MaskArithmetic = MaskArithmetic.BINARY, size: int = IMAGE_SIZE,
              data: bytes | None = None) -> np.ndarray:
    """A foreground mask for compositing. binary: HxW bool, refusing values other than booleans or 0/1 (naming them
    and what the original would compute). original: the original's uint8 weight numerators, whatever the values."""
    raw = read_mask(path, size, data)
    if arithmetic is MaskArithmetic.ORIGINAL:
        return original_weights(raw)
    if not is_binary(raw):
        values = np.unique(raw)
        shown = ", ".join(f"{v:g}" for v in values[:6]) + (", ..." if len(values) > 6 else "")
        raise UserError(
            f"mask {path} holds values other than 0 and 1 ({shown}); the original script would blend "
            f"bg * (1 - w) + fg * w with w = (uint8(value) * 255 mod 256) / 255, so 255 gives the foreground a "
            f"weight of 1/255 and 128 about one half; convert the masks to 0/1 "
            f"(np.save(path, np.load(path) > 0)), or pass {option('--mask-arithmetic', 'original')} to reproduce the "
            f"original's numbers on them")
    return raw.astype(bool, copy=False)


@dataclass(eq=False)
class ImageSet:
    """Files listed under `root`: each one's SHA-256 by relative path (`hashes`) and their `fingerprint`, the bytes
    read while hashing (`contents`, until decoded), the decoder chosen and the `cache` (None: not used); `held` (a
    dict, the zoo's) keeps what was decoded in memory."""

    root: Path
    fingerprint: dict | None = None
    hashes: dict[str, str] | None = None
    contents: dict[str, bytes] = field(default_factory=dict, repr=False)
    decoder: Decoder = Decoder.PILLOW
    cache: DecodedCache | None = None
    held: dict | None = field(default=None, repr=False)

    def __post_init__(self):
        self.root = Path(self.root)

    def hashed_bytes(self, rel: str) -> tuple[bytes | None, bool]:
        """A file's bytes (None where unreadable: its decoder names the error) and whether they are those hashed
        when listed (False for a set listed without hashes): a file rewritten since (read again once a run freed
        the bytes) is decoded as it is now, with a warning, but its rows are not cached."""
        if rel in self.contents:
            return self.contents[rel], True
        try:
            with open_regular(self.root / rel) as fh:  # a FIFO refused, not waited on
                data = fh.read()
        except OSError:
            return None, False
        if self.hashes is None:
            return data, False
        if hashlib.sha256(data).hexdigest() != self.hashes[rel]:
            log.warning("%s changed since it was listed; not caching what it decodes to", rel)
            return data, False
        return data, True

    def provenance(self, runtime_info: dict, model_info: dict) -> dict:
        """A run's provenance on these files (`tools.provenance.provenance`): their fingerprint, decoder and cache."""
        return provenance(runtime_info, model_info, self.fingerprint, self.decoder.value,
                          self.cache.describe() if self.cache is not None else None)


def read_image_set(root: Path, relpaths: Sequence[str], images: Sequence[str], workers: int,
                   cache: DecodedCache | None = None, hold: bool = False) -> ImageSet:
    """The files of `relpaths` read and hashed in `workers` threads (bytes kept until decoded), the decoder chosen on
    a few of `images`; `hold`: keep what is decoded in memory."""
    fingerprint, contents, hashes = read_and_fingerprint(root, relpaths, workers, keep=relpaths)
    decoder = decoders.choose_decoder([contents[rel] for rel in decoders.probe_sample(images)])
    return ImageSet(root, fingerprint, hashes, contents, decoder, cache, {} if hold else None)


JOB_IMAGES = 32  # images per decoding job: small enough that every thread has work while a batch fills


def _decode_into(out: torch.Tensor, images: ImageSet, relpaths: Sequence[str], cached: Sequence,
                 writer: PackWriter | None = None) -> None:
    """Fill `out` (NHWC) with the images of `relpaths`: from `cached` (per image: a cache pack's (rows, row), or
    (None, i): decode it, and write it as row i of `writer`)."""
    array = out.numpy()  # NHWC
    for i, (rel, (rows, row)) in enumerate(zip(relpaths, cached)):
        stop_point()
        if rows is not None:
            array[i] = rows[row]
            continue
        data, same = images.hashed_bytes(rel)
        array[i] = decode_rgb(images.root / rel, decoder=images.decoder, data=data)
        if same and writer is not None:
            writer.put(row, array[i])


class DeviceCopies:
    """Batches copied to a CUDA device on a side stream, overlapping the model's work on the previous batch; the
    consumer's stream waits for each copy. Nothing off CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        consumer = torch.cuda.current_stream(self.device)
        # Allocated on the side stream, the copy's target is recycled only by the side stream's allocations, and
        # (record_stream) only once the consumer's work on it is done; the pinned source block, only once the
        # copy is done (the host allocator records an event on the side stream).
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device)  # pinned already: no wait; NHWC: channels_last on the device
        consumer.wait_stream(self.stream)
        moved.record_stream(consumer)
        return moved


def iter_decoded_batches(images: ImageSet, relpaths: Sequence[str], batch_size: int, workers: int,
                         pin_memory: bool = False, starts: Sequence[int] | None = None,
                         device: torch.device | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start index, uint8 Nx3xHxW batch) of `relpaths` in order (all, or the batches at `starts`), decoded
    ahead by `workers` threads into pinned buffers (PyTorch's host allocator recycles a pinned block only once its
    copies are done) or read from the cache, new rows cached in one pack after the last batch; errors name the file."""
    starts = list(range(0, len(relpaths), batch_size) if starts is None else starts)
    workers = max(1, workers)
    copies = DeviceCopies(device) if device is not None and device.type == "cuda" else None
    ahead = max(2, -(-2 * workers * JOB_IMAGES // batch_size))  # batches decoding at once
    cached, writer = _cache_plan(images, relpaths, batch_size, starts)
    count = sum(min(batch_size, len(relpaths) - start) for start in starts)
    if copies is not None and writer is not None and not writer.hashes and \
            fits_on_device(count * IMAGE_SIZE * IMAGE_SIZE * 3, device):
        yield from _resident_batches(relpaths, batch_size, starts, cached, device)
        return

    def submit(pool, start: int):
        count = min(batch_size, len(relpaths) - start)
        out = torch.empty((count, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, pin_memory=pin_memory)
        jobs = [pool.submit(_decode_into, out[i:i + JOB_IMAGES], images,
                            relpaths[start + i:start + min(i + JOB_IMAGES, count)],
                            cached[start + i:start + min(i + JOB_IMAGES, count)], writer)
                for i in range(0, count, JOB_IMAGES)]
        return start, out, jobs

    with ContextThreadPool(max_workers=workers, thread_name_prefix="decode") as pool:
        pending: collections.deque = collections.deque()
        it = iter(starts)
        try:
            for start in it:
                pending.append(submit(pool, start))
                if len(pending) >= ahead:
                    break
            while pending:
                start, out, jobs = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(submit(pool, nxt))
                for job in jobs:
                    job.result()
                # NHWC storage seen as NCHW: exactly torch's channels_last layout, no copy.
                batch = out.permute(0, 3, 1, 2)
                yield start, (copies(batch) if copies is not None else batch)
            if writer is not None:
                writer.commit()
        finally:
            for _, _, jobs in pending:
                for job in jobs:
                    job.cancel()
            if writer is not None:
                writer.abort()


RESIDENT_FRACTION = 0.25  # of the device's free memory: at most this much decoded data is kept on it


def fits_on_device(nbytes: int, device: torch.device | None, free: int | None = None) -> bool:
    """Whether `nbytes` of decoded data are kept on `device` rather than streamed: on CUDA, when they take at most
    `RESIDENT_FRACTION` of its free memory (`free`, default `torch.cuda.mem_get_info`); never elsewhere."""
    if device is None or device.type != "cuda":
        return False
    if free is None:
        free = torch.cuda.mem_get_info(device)[0]
    return nbytes <= RESIDENT_FRACTION * free


def _resident_batches(relpaths: Sequence[str], batch_size: int, starts: Sequence[int], cached: Sequence,
                      device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """The batches at `starts`, every image of them in the cache: copied to `device` once, then sliced there."""
    spans = [(start, min(batch_size, len(relpaths) - start)) for start in starts]
    resident = torch.empty((sum(n for _, n in spans), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8, device=device)
    host = torch.empty((batch_size, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=torch.uint8)
    at = 0
    for start, n in spans:
        array = host[:n].numpy()
        for i, (rows, row) in enumerate(cached[start:start + n]):
            array[i] = rows[row]
        resident[at:at + n].copy_(host[:n])  # from ordinary memory: waits, so `host` may be refilled
        at += n
    log.info("%d decoded image(s) kept on %s for this run", at, device)
    at = 0
    for start, n in spans:
        yield start, resident[at:at + n].permute(0, 3, 1, 2)  # NHWC seen as NCHW, as the streamed batches
        at += n


def image_packs(cache: DecodedCache | None) -> Packs:
    """The decoded-data cache's image rows (HxWx3 uint8, Pillow's pixels), shared by every command."""
    return Packs(cache, "image", (IMAGE_SIZE, IMAGE_SIZE, 3))


def _cache_plan(images: ImageSet, relpaths: Sequence[str], batch_size: int,
                starts: Sequence[int]) -> tuple[list, PackWriter | None]:
    """Per image of `relpaths`: (rows, row) of a cache pack that holds it, or (None, i) where it is decoded as
    row i of the writer returned (None without a cache)."""
    hashes, cache = images.hashes, images.cache
    if hashes is None or cache is None:
        return [(None, 0)] * len(relpaths), None
    mine = [p for start in starts for p in range(start, min(start + batch_size, len(relpaths)))]

    def decoded_again(i: int) -> np.ndarray | None:  # the spot check's reference: Pillow's pixels of the file now
        data, same = images.hashed_bytes(relpaths[mine[i]])
        return pillow_rgb(data, images.root / relpaths[mine[i]]) if same else None

    found = image_packs(cache).lookup([hashes[relpaths[p]] for p in mine], decoded_again)
    cached: list = [(None, 0)] * len(relpaths)
    missing = []
    for p, hit in zip(mine, found):
        cached[p] = hit if hit is not None else (None, len(missing))
        if hit is None:
            missing.append(p)
    if mine:
        log.info("%d of %d image(s) read from the decoded-data cache", len(mine) - len(missing), len(mine))

    def is_pillows(i: int, row: np.ndarray) -> bool:
        data, _ = images.hashed_bytes(relpaths[missing[i]])
        return data is not None and np.array_equal(row, pillow_rgb(data, images.root / relpaths[missing[i]]))

    return cached, image_packs(cache).writer([hashes[relpaths[p]] for p in missing],
                                             is_pillows if images.decoder is Decoder.TORCHVISION else None)


def decode_images(images: ImageSet, relpaths: Sequence[str], workers: int, progress: bool = True,
                  desc: str = "decoding", channels_last: bool = False) -> torch.Tensor:
    """The `images` of `relpaths` as one uint8 (N, 3, H, W) tensor, through the cache, with a progress bar;
    `channels_last`: NHWC storage (the decoders' layout, no transposing copy)."""
    shape = (len(relpaths), IMAGE_SIZE, IMAGE_SIZE, 3) if channels_last else (len(relpaths), 3, IMAGE_SIZE, IMAGE_SIZE)
    out = torch.empty(shape, dtype=torch.uint8)
    out = out.permute(0, 3, 1, 2) if channels_last else out
    with progress_bar(total=len(relpaths), unit="img", desc=desc, disable=not progress, dynamic_ncols=True) as bar:
        for start, batch in iter_decoded_batches(images, relpaths, DECODE_BATCH, workers):
            out[start:start + batch.shape[0]] = batch
            bar.update(batch.shape[0])
    return out


def load_masks(root: Path, masks: Sequence[tuple[str, bytes | None]],
               arithmetic: MaskArithmetic = MaskArithmetic.BINARY) -> np.ndarray:
    """The `masks` ((relative path, bytes or None) each) stacked: (N, H, W) bool, or the original's uint8 weights."""
    dtype = np.uint8 if arithmetic is MaskArithmetic.ORIGINAL else bool
    stacked = np.empty((len(masks), IMAGE_SIZE, IMAGE_SIZE), dtype=dtype)
    for i, (rel, data) in enumerate(masks):
        stop_point()
        stacked[i] = load_mask(Path(root) / rel, arithmetic, data=data)
    return stacked


def decode_cached(images: ImageSet, groups: dict[str, Sequence[str]], masks: Sequence[str],
                  arithmetic: MaskArithmetic = MaskArithmetic.BINARY, workers: int = 4, progress: bool = True,
                  channels_last: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Named groups of `images` as uint8 (N, 3, H, W) tensors and the `masks`, through the set's cache (masks per
    arithmetic); without the files' hashes (tests, bench) they are hashed first when there is a cache."""
    key = ("decoded", images.decoder, arithmetic, channels_last, tuple(masks),
           *((name, tuple(relpaths)) for name, relpaths in groups.items()))  # all that the decoding depends on
    if images.held is not None and key in images.held:
        return images.held[key]
    if images.cache is not None and images.hashes is None:
        images.hashes = read_and_fingerprint(images.root, [*masks, *(p for paths in groups.values() for p in paths)],
                                             workers)[2]
    mask_array = _masks_cached(images, masks, arithmetic)  # a refused mask stops it first
    decoded = {name: decode_images(images, relpaths, workers, progress, f"decoding {name}", channels_last)
               for name, relpaths in groups.items()}
    if images.held is not None:
        images.held[key] = decoded, mask_array
    return decoded, mask_array


def _masks_cached(images: ImageSet, relpaths: Sequence[str], arithmetic: MaskArithmetic) -> torch.Tensor:
    """`load_masks` through the cache, per arithmetic; binary masks are cached as packed bits."""
    packed = arithmetic is MaskArithmetic.BINARY
    pixels = IMAGE_SIZE * IMAGE_SIZE
    packs = Packs(images.cache, f"mask-{arithmetic.value}", (pixels // 8,) if packed else (IMAGE_SIZE, IMAGE_SIZE))
    hashes, hashed = images.hashes, images.hashes is not None and images.cache is not None

    def as_rows(masks: np.ndarray) -> np.ndarray:
        return np.packbits(masks.reshape(len(masks), pixels), axis=1) if packed else masks

    def loaded_again(i: int) -> np.ndarray | None:  # the spot check's reference: the mask file read now
        data, same = images.hashed_bytes(relpaths[i])
        return as_rows(load_masks(images.root, [(relpaths[i], data)], arithmetic))[0] if same else None

    found = packs.lookup([hashes[rel] for rel in relpaths], loaded_again) if hashes is not None \
        else [None] * len(relpaths)
    missing = [i for i, hit in enumerate(found) if hit is None]
    names = [relpaths[i] for i in missing]
    read = {rel: images.hashed_bytes(rel) for rel in names}
    fresh = as_rows(load_masks(images.root, [(rel, read[rel][0]) for rel in names], arithmetic))
    rows = np.empty((len(relpaths), *packs.row_shape), np.uint8)
    for i, hit in enumerate(found):
        if hit is not None:
            rows[i] = hit[0][hit[1]]
    rows[missing] = fresh
    same = [k for k, rel in enumerate(names) if hashed and read[rel][1]]
    if same:
        writer = packs.writer([hashes[names[k]] for k in same])
        for j, k in enumerate(same):
            writer.put(j, fresh[k])
        writer.commit()
    if packed:
        return torch.from_numpy(np.unpackbits(rows, axis=1, count=pixels).astype(bool).reshape(-1, IMAGE_SIZE,
                                                                                                 IMAGE_SIZE))
    return torch.from_numpy(rows)
