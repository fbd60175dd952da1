"""The start-up check of a run's arithmetic: the model's fp32 logits on the run's device, on the run's first
few images, against a float64 reference computed on the CPU.

What it catches is what nobody foresaw: a convolution that runs in TF32 whatever the flags, a model whose code
casts to bf16 and back, a kernel of lower precision on some device. The reference is a float64 copy of the model
run under `Float64Everywhere`, which turns every floating dtype a model asks for (a cast, a factory, autocast's
casts) into float64, so a hidden cast in the model's own code is absent from the reference and shows as a
deviation, on the CPU as on any device.

The tolerance (`TOLERANCE`, relative to each image's largest reference logit): fp32's unit roundoff is 6e-8, and
an honest fp32 forward pass deviates from float64 by 2e-7 to 1.3e-6 of the largest logit (six torchvision
architectures with random weights, on the CPU). TF32 (a 10-bit mantissa) and bf16 (7 bits) deviate by 1e-3 to
1.4e-2. 1e-4 sits two orders of magnitude above fp32's deviation and one below TF32's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tools import distributed
from tools.data.decoding import decode_images
from tools.errors import UserError, first_line, option
from tools.models.boundary import LoadedModel
from tools.models.checkpoints import Program
from tools.runtime import Runtime

log = logging.getLogger(__name__)

TOLERANCE = 1e-4
# the run's first images. float64 on the CPU is slow: seconds for a ResNet-50, over a minute for a ConvNeXt-T on
# two cores (measured: 110 s for 4 images), so two
CHECK_IMAGES = 2
ALLOW_FLAG = "--allow-inexact-device"


class Float64Everywhere(TorchDispatchMode):
    """Every floating dtype an operation is asked for becomes float64, every device the CPU, and a floating result
    in another dtype (a factory's default float32) is widened: a model's computation as the mathematics it
    means, whatever casts its code makes. It sees TorchScript and torch.export programs' operations too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_widen_argument, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func.is_view or func._schema.is_mutable:  # the result is (a view of) an input, already widened
            return out
        return tree_map(_widen_result, out)


def _widen_argument(value):
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _widen_result(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(torch.float64)
    return value


@dataclass(frozen=True)
class DeviceCheck:
    """What the start-up check found, as the provenance records it."""

    device: str
    images: int
    deviation: float | None  # the largest |logit - reference| over an image's largest |reference logit|
    unavailable: str | None = None  # why no reference could be built
    allowed: bool = False  # the run went on past a failed check (--allow-inexact-device)
    tolerance: float = TOLERANCE

    @property
    def passed(self) -> bool | None:
        return None if self.deviation is None else self.deviation <= self.tolerance

    def describe(self) -> dict:
        info = {"device": self.device, "reference": "float64 on the CPU", "images": self.images,
                "max_relative_deviation": None if self.deviation is None else float(f"{self.deviation:.3g}"),
                "tolerance": self.tolerance, "passed": self.passed}
        if self.unavailable is not None:
            info["reference"], info["unavailable"] = None, self.unavailable
        if self.allowed:
            info["allowed_inexact"] = True
        return info


def relative_deviation(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest |logits - reference| of an image over its largest |reference logit|, the worst image's; equal
    values (infinities, zeros) deviate by 0, a NaN on one side only by infinity."""
    logits, reference = logits.double().flatten(1), reference.double().flatten(1)
    both_nan = logits.isnan() & reference.isnan()
    diff = torch.where((logits == reference) | both_nan, 0.0, (logits - reference).abs()).nan_to_num(nan=torch.inf)
    scale = reference.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1)
    worst = diff.amax(dim=1)
    ratio = torch.where(worst == 0, 0.0, worst / scale)  # a zero scale with a deviation: infinite
    return float(ratio.max()) if ratio.numel() else 0.0


def float64_logits(loaded: LoadedModel, images: torch.Tensor) -> torch.Tensor:
    """The model's logits on `images`, computed in float64 on the CPU by a copy of it (the model is not changed)."""
    with torch.no_grad():  # copied without autograd history (a TorchScript module's copies would carry some)
        reference = copy.deepcopy(loaded.model)
        for module in reference.modules():
            if isinstance(module, Program):  # the devices its code names become the CPU under Float64Everywhere
                module.names_devices = False
        reference = reference.cpu().double().eval()
    with torch.inference_mode(), Float64Everywhere():
        return reference(images.cpu())


def check_device(loaded: LoadedModel, runtime: Runtime, images: torch.Tensor, allow_inexact: bool = False
                 ) -> DeviceCheck:
    """Compare the model's eager fp32 logits on the runtime's device (fp32 math whatever the run's precision,
    since fp32 is what is exact and what the reduced precisions are re-checked in) with the float64 reference,
    on `images` (uint8, the run's first few). Beyond `TOLERANCE`: refused in one line, unless `allow_inexact`,
    when the run goes on with a warning and the check says so. A model that cannot be copied or run in float64
    is not refused: the check records why it has no reference."""
    device = str(runtime.device)
    if not len(images):
        return DeviceCheck(device, 0, None, unavailable="no images to check on")
    try:  # first, while the model may still be on the CPU
        reference = float64_logits(loaded, images)
    except Exception as exc:  # noqa: BLE001 (any model: the check is skipped, and says why)
        log.warning("device check skipped: no float64 reference of the model on the CPU (%s)", first_line(exc))
        return DeviceCheck(device, len(images), None, unavailable=first_line(exc))
    model = loaded.model.to(runtime.device).eval()  # as `Runtime.prepare` moves it, eager
    if runtime.channels_last:
        model = model.to(memory_format=torch.channels_last)
    with torch.inference_mode(), runtime.fp32_math():
        logits = model(runtime.to_device(images)).float().cpu()
    check = DeviceCheck(device, len(images), relative_deviation(logits, reference), allowed=allow_inexact)
    if check.passed:
        log.info("device check: fp32 logits on %s within %.1e of float64 on the CPU (tolerance %g, %d images)",
                 device, check.deviation, TOLERANCE, len(images))
        return DeviceCheck(device, len(images), check.deviation)
    message = (f"the model's fp32 logits on {device} differ from float64 on the CPU by {check.deviation:.1e} of the "
               f"largest logit on the run's first {len(images)} images, beyond fp32 rounding (tolerance "
               f"{TOLERANCE:g}): the model or the device computes in lower precision (a cast to bf16 or fp16, TF32)")
    if not allow_inexact:
        raise UserError(f"{message}; pass {option(ALLOW_FLAG)} to run anyway (recorded in the results' provenance)")
    log.warning("%s; running anyway (%s, recorded in the provenance)", message, option(ALLOW_FLAG))
    return check


def first_images(root: Path, relpaths: Sequence[str], workers: int) -> torch.Tensor:
    """The first CHECK_IMAGES of a run's images, decoded (uint8), for `check_run`."""
    return decode_images(root, list(relpaths)[:CHECK_IMAGES], workers, progress=False)


def check_run(loaded: LoadedModel, runtime: Runtime, images: torch.Tensor, allow_inexact: bool = False) -> dict:
    """`check_device` on a run's first images (uint8; the first CHECK_IMAGES are used), in every process, which
    leave together if one refuses; its record for the run's provenance (`device_check`)."""
    with distributed.agree(runtime.group, runtime.device):
        return check_device(loaded, runtime, images[:CHECK_IMAGES], allow_inexact).describe()
