"""Image bytes become ToTensor's floats on every device: no image float is divided by a scalar (CUDA turns that
into a multiplication by the reciprocal), and the one conversion equals `to_tensor` for all 256 byte values."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools.data import synthetic
from tools.data.compositing import blend
from tools.models.architectures import SmallCNN
from tools.models.boundary import PixelModel

DIVISIONS = {torch.ops.aten.div, torch.ops.aten.div_, torch.ops.aten.true_divide, torch.ops.aten.true_divide_}
MULTIPLICATIONS = {torch.ops.aten.mul, torch.ops.aten.mul_}
CASTS = {torch.ops.aten._to_copy, torch.ops.aten.to}


def _scalar(value) -> float | None:
    """The value of what CUDA's kernels treat as a CPU scalar (a Python number, or a 0-dim tensor on the CPU)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu":
        return float(value)
    return None


class ScalingWatch(TorchDispatchMode):
    """Records every operation that would scale image data by a CPU scalar, which CUDA computes as a
    multiplication by the scalar's reciprocal: a true division of an integer tensor (image bytes), or of
    floats made from one by a dtype cast (and their views), by a Python number or 0-dim CPU tensor; or such
    floats multiplied by 1/255."""

    def __init__(self):
        super().__init__()
        self.from_bytes: dict[int, weakref.ref] = {}  # by id, alive: the floats made from image bytes
        self.seen: list[str] = []

    def _from_bytes(self, value) -> bool:
        ref = self.from_bytes.get(id(value))
        return ref is not None and ref() is value

    def _image_data(self, value) -> bool:
        return isinstance(value, torch.Tensor) and (
            (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool)
            or self._from_bytes(value))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in DIVISIONS and kwargs.get("rounding_mode") is None and len(args) == 2:
            if self._image_data(args[0]) and _scalar(args[1]) is not None:
                self.seen.append(f"{func}: image data / {_scalar(args[1])!r}")
        if packet in MULTIPLICATIONS and len(args) == 2:
            for data, factor in ((args[0], args[1]), (args[1], args[0])):
                value = _scalar(factor)
                if self._image_data(data) and value and abs(value * 255 - 1) < 1e-6:
                    self.seen.append(f"{func}: image data * 1/255")
        out = func(*args, **kwargs)
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if isinstance(out, torch.Tensor) and source is not None and out.is_floating_point():
            cast = func.overloadpacket in CASTS and not source.is_floating_point()
            derived = self._from_bytes(source) and (func.is_view or func._schema.is_mutable or out is source)
            if (cast and self._image_data(source)) or derived:
                self.from_bytes[id(out)] = weakref.ref(out)
        return out


def test_the_watch_sees_a_division_of_image_bytes_by_a_scalar():
    images = torch.arange(6, dtype=torch.uint8).view(1, 1, 2, 3)
    with ScalingWatch() as watch:
        images.float().div_(255)
        images.float() * (1 / 255)
        torch.div(images, torch.tensor(255.0))
        images.float().div_(torch.full((1,), 255.0))  # not a CPU scalar: CUDA could not mix it in silently
        images.float().mul_(0.5)
    assert len(watch.seen) == 3, watch.seen


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_pixel_model_and_blend_scale_no_image_by_a_scalar(device):
    """On the CPU and on a device that is not the CPU (meta: the operations without their numbers)."""
    torch.manual_seed(0)
    model = PixelModel(SmallCNN(9), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)).eval().to(device)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8).to(device)
    weights = torch.randint(0, 256, (2, 1, 32, 32), dtype=torch.uint8).to(device)
    with ScalingWatch() as watch, torch.inference_mode():
        model(images)
        model(blend(images, images.flip(0), weights))
    assert watch.seen == []


def test_training_with_mixup_scales_no_image_by_a_scalar(tmp_path, one_thread):
    from tools.models.architectures import SMALL_CNN  # noqa: PLC0415
    from tools.training import loop  # noqa: PLC0415
    from tools.training.config import Method, TrainConfig  # noqa: PLC0415

    root = tmp_path / "in9"
    synthetic.generate(root, per_class=1, seed=3, split="train")
    config = TrainConfig(root, tmp_path / "run", methods=[Method.MIXUP], arch=SMALL_CNN, weights="none",
                         batch_size=3, device="cpu", workers=0, progress=False)
    with ScalingWatch() as watch:
        loop.train(config)
    assert watch.seen == []


def test_unit_floats_are_to_tensor_s_for_every_byte_value():
    from torchvision.transforms.functional import to_tensor  # noqa: PLC0415

    from tools.data import pixels  # noqa: PLC0415

    values = np.arange(256, dtype=np.uint8).reshape(16, 16, 1)
    expected = to_tensor(values).view(torch.int32)  # (1, 16, 16): the original's floats, as bits
    images = torch.from_numpy(values).permute(2, 0, 1).unsqueeze(0)  # (1, 1, 16, 16) uint8
    for scaled in (pixels.unit_floats(images), pixels.table_floats(images)):  # the CPU's division, the devices' table
        assert scaled.dtype == torch.float32
        assert torch.equal(scaled[0].view(torch.int32), expected)


def test_unit_floats_keep_the_layout_on_any_device():
    images = torch.randint(0, 256, (2, 3, 4, 5), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    from tools.data import pixels  # noqa: PLC0415

    for scaled in (pixels.unit_floats(images), pixels.table_floats(images)):
        assert scaled.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(scaled, images.float() / 255)
    on_meta = pixels.unit_floats(images.to("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == images.shape and on_meta.dtype == torch.float32
