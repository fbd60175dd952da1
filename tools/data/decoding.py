"""Decoding what the layout lists: images as uint8 tensors, masks checked and made ready for compositing, and
the decoded-data cache keyed by content (where the toolkit's caches live, and the array cache that CLIP's
text heads share)."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from tools.data.compositing import MaskArithmetic, original_weights
from tools.data.temporary import is_running
from tools.errors import NUMPY_READ_ERRORS, UserError
from tools.in9 import IMAGE_SIZE

log = logging.getLogger(__name__)

DECODE_CHUNK = 64  # images per decoding job
CACHE_VERSION = 4  # of the decoded-data cache's entries


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


def read_mask(path: Path, size: int = IMAGE_SIZE) -> np.ndarray:
    """A foreground mask's raw values as an HxW array, checked for shape and a numeric dtype."""
    try:
        raw = np.load(path, allow_pickle=False)
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


def load_mask(path: Path, arithmetic: MaskArithmetic = MaskArithmetic.BINARY, size: int = IMAGE_SIZE) -> np.ndarray:
    """A foreground mask, ready for compositing.

    binary: an HxW bool array; masks holding anything but booleans or 0/1 are refused, naming the values
    and what the original would have computed. original: the original's uint8 weight numerators
    (`compositing.original_weights`), whatever the values.
    """
    raw = read_mask(path, size)
    if arithmetic is MaskArithmetic.ORIGINAL:
        return original_weights(raw)
    if not is_binary(raw):
        values = np.unique(raw)
        shown = ", ".join(f"{v:g}" for v in values[:6]) + (", ..." if len(values) > 6 else "")
        raise UserError(
            f"mask {path} holds values other than 0 and 1 ({shown}); the original script would blend "
            f"bg * (1 - w) + fg * w with w = (uint8(value) * 255 mod 256) / 255, so 255 gives the foreground a "
            f"weight of 1/255 and 128 about one half; convert the masks to 0/1 "
            f"(np.save(path, np.load(path) > 0)), or pass --mask-arithmetic original to reproduce the "
            f"original's numbers on them")
    return raw.astype(bool, copy=False)


def _decode_batch(root: Path, relpaths: Sequence[str]) -> torch.Tensor:
    out = np.empty((len(relpaths), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for i, rel in enumerate(relpaths):
        out[i] = decode_rgb(Path(root) / rel)
    # NHWC storage seen as NCHW: exactly torch's channels_last layout, no copy.
    return torch.from_numpy(out).permute(0, 3, 1, 2)


def iter_decoded_batches(root: Path, relpaths: Sequence[str], batch_size: int, workers: int,
                         pin_memory: bool = False, starts: Sequence[int] | None = None
                         ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start index, uint8 Nx3xHxW batch) in order, decoding ahead in `workers` threads (every batch, or
    those beginning at `starts`).

    Pillow releases the GIL while it decodes, so threads decode in parallel without pickling batches
    between processes; errors (unreadable files, wrong sizes) surface as they are, naming the file.
    """
    starts = range(0, len(relpaths), batch_size) if starts is None else starts
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


def decode_images(root: Path, relpaths: Sequence[str], workers: int, progress: bool = True,
                  desc: str = "decoding") -> torch.Tensor:
    """Every image as one uint8 (N, 3, H, W) tensor, decoded in `workers` threads, with a progress bar."""
    out = torch.empty((len(relpaths), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
    with tqdm(total=len(relpaths), unit="img", desc=desc, disable=not progress, dynamic_ncols=True) as bar:
        for start, batch in iter_decoded_batches(root, relpaths, DECODE_CHUNK, workers):
            out[start:start + batch.shape[0]] = batch
            bar.update(batch.shape[0])
    return out


def load_masks(root: Path, relpaths: Sequence[str], arithmetic: MaskArithmetic = MaskArithmetic.BINARY) -> np.ndarray:
    """Every mask of `relpaths` stacked: (N, H, W) bool (binary) or the original's uint8 weights (original)."""
    dtype = np.uint8 if arithmetic is MaskArithmetic.ORIGINAL else bool
    masks = np.empty((len(relpaths), IMAGE_SIZE, IMAGE_SIZE), dtype=dtype)
    for i, rel in enumerate(relpaths):
        masks[i] = load_mask(Path(root) / rel, arithmetic)
    return masks


def default_cache_dir() -> Path:
    """Where the toolkit's caches live unless told otherwise: $XDG_CACHE_HOME/bg-challenge-toolkit, else
    ~/.cache/bg-challenge-toolkit."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bg-challenge-toolkit"


def _temporary_prefix(pid: int | None = None) -> str:
    """`.tmp-HOST@` starts the names of the cache entries being written on this machine, `.tmp-HOST@PID@` those
    of process PID (no host name holds an @)."""
    host = f".tmp-{socket.gethostname()}@"
    return host if pid is None else f"{host}{pid}@"


def remove_stale_temporaries(cache_dir: Path) -> None:
    """Remove the half-written entries of processes of this machine that are no longer running (killed while
    saving); entries of running processes, and of other machines sharing the folder, are left alone."""
    mine = _temporary_prefix()
    try:
        candidates = [p for p in Path(cache_dir).iterdir() if p.name.startswith(mine) and p.is_dir()]
    except OSError:
        return
    for folder in candidates:
        pid = folder.name[len(mine):].split("@", 1)[0]
        if pid.isdigit() and not is_running(int(pid)):
            log.info("removing %s, left by process %s that was stopped while writing the cache", folder, pid)
            shutil.rmtree(folder, ignore_errors=True)


class DecodedCache:
    """Arrays on disk (decoded data, CLIP's text heads), in a folder named by a key derived from their inputs'
    content; `meta` (JSON) says what they were made from and must match on reading.

    `load` gives None on a miss, and on a broken or foreign entry (with a warning); `save` writes through a
    temporary folder (named by host and process) and a rename, so an error, Ctrl-C or SIGTERM leaves no half
    entry, and `load` removes what a killed process left.
    """

    def __init__(self, cache_dir: Path | None, key: str, meta: dict, what: str = "decoded data"):
        self.folder = Path(cache_dir) / key if cache_dir is not None else None
        self.meta = meta
        self.what = what

    def load(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        if self.folder is None:
            return None
        remove_stale_temporaries(self.folder.parent)
        if not (self.folder / "meta.json").is_file():
            return None
        try:
            if json.loads((self.folder / "meta.json").read_text()) != self.meta:
                return None
            arrays = {name: np.load(self.folder / f"{name}.npy", allow_pickle=False) for name in names}
        except (*NUMPY_READ_ERRORS, KeyError) as exc:
            log.warning("ignoring an unreadable cache at %s (%s)", self.folder, exc)
            return None
        log.info("%s read from the cache %s", self.what, self.folder)
        return arrays

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        if self.folder is None:
            return
        tmp = None
        try:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.folder.parent, prefix=_temporary_prefix(os.getpid())))
            for name, array in arrays.items():
                np.save(tmp / f"{name}.npy", array)
            (tmp / "meta.json").write_text(json.dumps(self.meta))
            if self.folder.exists():
                shutil.rmtree(self.folder)
            os.replace(tmp, self.folder)
            tmp = None
            log.info("%s cached at %s", self.what, self.folder)
        except OSError as exc:
            log.warning("could not write the %s cache at %s (%s); continuing without it", self.what, self.folder, exc)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def decode_cached(root: Path, images: dict[str, Sequence[str]], masks: Sequence[str], fingerprint: dict,
                  cache_dir: Path | None, arithmetic: MaskArithmetic = MaskArithmetic.BINARY, workers: int = 4,
                  progress: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Named groups of images as uint8 (N, 3, H, W) tensors and the masks (`load_masks`), decoded once and
    reused from `cache_dir` when the content fingerprint and the mask arithmetic match (the challenge's data, and
    train.py's store: tools.training.data.decoded_store). Binary masks are cached as packed bits."""
    cache = DecodedCache(cache_dir, f"{fingerprint['sha256'][:24]}-{arithmetic.value}-v{CACHE_VERSION}",
                         {"fingerprint": fingerprint, "mask_arithmetic": arithmetic.value, "groups": list(images)})
    packed = arithmetic is MaskArithmetic.BINARY
    cached = cache.load([*images, "masks"])
    if cached is not None:
        mask_array = cached["masks"]
        if packed:
            pixels = IMAGE_SIZE * IMAGE_SIZE
            mask_array = np.unpackbits(mask_array, axis=1, count=pixels).astype(bool).reshape(-1, IMAGE_SIZE,
                                                                                               IMAGE_SIZE)
        return {name: torch.from_numpy(cached[name]) for name in images}, torch.from_numpy(mask_array)
    mask_array = load_masks(root, masks, arithmetic)  # first: a refused mask stops the run before any decoding
    decoded = {name: decode_images(root, relpaths, workers, progress, f"decoding {name}")
               for name, relpaths in images.items()}
    stored = np.packbits(mask_array.reshape(len(mask_array), IMAGE_SIZE * IMAGE_SIZE), axis=1) if packed else mask_array
    cache.save({**{name: tensor.numpy() for name, tensor in decoded.items()}, "masks": stored})
    return decoded, torch.from_numpy(mask_array)
