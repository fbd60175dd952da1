"""Which decoder turns an image file's bytes into pixels: Pillow (the reference) or torchvision's `decode_jpeg`,
used only for the JPEGs the run's probe found it decodes bit for bit as Pillow does (`choose_decoder`)."""

from __future__ import annotations

import enum
import io
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from tools.errors import UserError, import_torchvision
from tools.in9 import IMAGE_SIZE

log = logging.getLogger(__name__)


# what decoding imports on first use (torchvision's import is slow, so it is not made at this module's): a caller
# that decodes in a background thread imports these first (tools.threads.alongside)
LAZY_IMPORTS = ("torchvision.io",)


class Decoder(str, enum.Enum):
    """Pillow (the original's loader, the reference) or torchvision's `decode_jpeg` (faster, releases the GIL), used
    only where a probe found it bit-equal; files that are not plain JPEGs go to Pillow either way."""

    PILLOW = "pillow"
    TORCHVISION = "torchvision"


def decode_bytes(data: bytes, name: Path | str, size: int = IMAGE_SIZE,
                 decoder: Decoder = Decoder.PILLOW) -> np.ndarray:
    """`decode_rgb` on bytes already read (`name` is for messages)."""
    rgb = None
    if decoder is Decoder.TORCHVISION and plain_jpeg(data):
        rgb = _torchvision_rgb(data)  # None where torchvision refuses the file: Pillow says why, or reads it
    if rgb is None:
        rgb = pillow_rgb(data, name)
    if rgb.shape[:2] != (size, size):
        raise UserError(f"image {name} is {rgb.shape[1]}x{rgb.shape[0]}, expected {size}x{size}; "
                        f"IN-9 images are {size}x{size} (resize or regenerate it)")
    return rgb


def pillow_rgb(data: bytes, name: Path | str) -> np.ndarray:
    """The reference: Pillow's `convert("RGB")` of the bytes, as HxWx3 uint8."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"cannot read image {name}: {exc}; replace or remove the file") from None


def decode_jpeg_bytes(data: bytes) -> torch.Tensor:
    """torchvision's decoding of JPEG bytes as uint8 (3, H, W) RGB; raises on what it cannot read. Equal to
    Pillow's only where `choose_decoder` found it so: use `decode_bytes` unless you probed."""
    torchvision_io = import_torchvision("torchvision.io")
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _silence_deprecation()
    try:
        return torchvision_io.decode_jpeg(encoded, mode=torchvision_io.ImageReadMode.RGB)
    except DeprecationWarning:  # an error filter's, the filter dropped between the check and the call: again
        _silence_deprecation()
        return torchvision_io.decode_jpeg(encoded, mode=torchvision_io.ImageReadMode.RGB)


def _torchvision_rgb(data: bytes) -> np.ndarray | None:
    try:
        return decode_jpeg_bytes(data).permute(1, 2, 0).numpy()
    except RuntimeError:
        return None


_silenced: list[tuple] = []  # the filter `_silence_deprecation` installed, as `warnings.filters` holds it


def _silence_deprecation() -> None:
    """Ignore torchvision 0.29's DeprecationWarning on every `decode_jpeg` call with one process-wide filter
    (`catch_warnings` is not thread-safe). Installed again where gone: a `catch_warnings` elsewhere (model loading,
    beside the data work) restores its saved filters as it leaves (`decode_jpeg_bytes` then decodes once more)."""
    if _silenced and _silenced[0] in warnings.filters:
        return
    warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                            category=DeprecationWarning, module=r"torchvision\.io")
    _silenced[:] = [warnings.filters[0]]


# JPEG start-of-frame markers of Huffman-coded baseline and progressive frames: what both decoders read the same
# way. Extended (which Pillow never writes, so the probe cannot try it), lossless, hierarchical and
# arithmetic-coded frames go to Pillow.
_PLAIN_FRAMES = {0xC0, 0xC2}
_OTHER_FRAMES = {0xC1, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# The components' sampling factors (H << 4 | V) the probe tries: grey; 4:4:4, 4:2:2 and 4:2:0 with the chroma
# at 1x1. 8-bit samples only.
_PLAIN_SAMPLINGS = {(0x11,), (0x11, 0x11, 0x11), (0x21, 0x11, 0x11), (0x22, 0x11, 0x11)}


def _plain_frame(data: bytes, pos: int) -> bool:
    """Whether the frame header at `pos` (its marker) has 8-bit samples and one of `_PLAIN_SAMPLINGS`."""
    if pos + 10 > len(data) or data[pos + 4] != 8:
        return False
    components = data[pos + 9]
    samplings = tuple(data[pos + 11 + 3 * i] for i in range(components) if pos + 11 + 3 * i < len(data))
    return len(samplings) == components and samplings in _PLAIN_SAMPLINGS


def plain_jpeg(data: bytes) -> bool:
    """Whether the bytes are a JPEG `decode_jpeg` may decode in Pillow's place: Huffman-coded baseline or
    progressive, 8-bit, grey or 3 components sampled 4:4:4, 4:2:2 or 4:2:0 (the probe's kinds)."""
    if data[:2] != b"\xff\xd8":
        return False
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if 0xD0 <= marker <= 0xD9 or marker == 0x01:  # markers without a length
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in _PLAIN_FRAMES:
            return _plain_frame(data, pos)
        if marker in _OTHER_FRAMES or marker == 0xDA:  # another frame, or scan data before any frame
            return False
        pos += 2 + length
    return False


def _probe_samples() -> list[bytes]:
    """Generated JPEGs of every kind `plain_jpeg` accepts: 4:2:0, 4:2:2, 4:4:4 and grey, each baseline and
    progressive; optimised, with restart markers, RGB (Adobe transform 0)."""
    yy, xx = np.mgrid[0:64, 0:64]
    rng = np.random.default_rng(0)
    pixels = np.stack([xx * 4, yy * 4, (xx + yy) * 2], -1) + rng.integers(0, 24, (64, 64, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    kinds = [(image, {"subsampling": s}) for s in (2, 1, 0)] + [(image.convert("L"), {})]
    samples = []
    for img, options in kinds + [(img, {**options, "progressive": True}) for img, options in kinds] + [
            (image, {"optimize": True}), (image, {"restart_marker_blocks": 2}), (image, {"keep_rgb": True})]:
        buffer = io.BytesIO()
        img.save(buffer, "JPEG", quality=87, **options)
        samples.append(buffer.getvalue())
    return samples


def choose_decoder(sample_files: Sequence[Path | bytes], requested: Decoder | None = None) -> Decoder:
    """torchvision where it decodes a few of the run's own files (`sample_files`: paths or bytes) and a generated
    JPEG of every kind bit for bit as Pillow (builds differ: torchvision issue 8027), else Pillow. `requested`
    forces one (torchvision still only where the probe passes)."""
    if requested is Decoder.PILLOW:
        return Decoder.PILLOW
    torchvision_io = import_torchvision("torchvision.io")  # after the scripts' background import of it
    if not hasattr(torchvision_io, "decode_jpeg"):  # deprecated in torchvision 0.29: may go
        return Decoder.PILLOW
    try:
        samples = _probe_samples() + [p if isinstance(p, bytes) else Path(p).read_bytes() for p in sample_files]
    except OSError:
        return Decoder.PILLOW  # an unreadable file: the run's own reading says which, in one line
    _silence_deprecation()
    for data in samples:
        if not plain_jpeg(data):
            continue
        try:
            ours = _torchvision_rgb(data)
        except Exception as exc:  # noqa: BLE001 (a build without its image extension: AttributeError, ...)
            log.info("torchvision's decode_jpeg fails here (%s: %s); decoding with Pillow", type(exc).__name__, exc)
            return Decoder.PILLOW
        try:
            reference = pillow_rgb(data, "probe")
        except UserError:
            return Decoder.PILLOW
        if ours is None or ours.shape != reference.shape or not np.array_equal(ours, reference):
            log.info("torchvision's decode_jpeg differs from Pillow here; decoding with Pillow")
            return Decoder.PILLOW
    return Decoder.TORCHVISION


def probe_sample(relpaths: Sequence[str], count: int = 8) -> list[str]:
    """A few of `relpaths`, spread evenly, for `choose_decoder`."""
    step = max(1, len(relpaths) // count)
    return list(relpaths[::step][:count])
