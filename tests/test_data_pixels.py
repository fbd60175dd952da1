"""Image bytes become ToTensor's floats on every device: no image float is divided by a scalar (CUDA turns that
into a multiplication by the reciprocal), and the one conversion equals `to_tensor` for all 256 byte values."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools.data import synthetic
from tools.data.compositing import blend, byte_masks
from tools.in9 import IMAGENET_MEAN, IMAGENET_STD, IN9_MEAN, IN9_STD
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


# ----------------------------------------------------------------------------------------------------------
# The model's input: one gather in the table of the CPU's normalised floats

STATISTICS = [IN9_MEAN + IN9_STD, IMAGENET_MEAN + IMAGENET_STD,
              (0.5, 0.5, 0.5, 0.5, 0.5, 0.5), (0.0, 0.0, 0.0, 1.0, 1.0, 1.0),
              (0.123456789, 0.987654321, -0.3, 1 / 3, 1.7, 1e-3),  # odd ones: a tiny std, a negative mean
              (1.0, 255.0, 0.1, 0.07, 3.0, 0.3)]


def every_byte_in_every_channel() -> np.ndarray:
    """(16, 16, 3) uint8: each channel holds the 256 byte values, in a different order per channel."""
    values = np.arange(256, dtype=np.uint8)
    return np.stack([values, values[::-1], np.roll(values, 77)], axis=-1).reshape(16, 16, 3)


@pytest.mark.parametrize("stats", STATISTICS + [None])
def test_bytes_become_to_tensor_then_normalize_for_every_value_and_channel(stats):
    """The original's ToTensor then Normalize on the CPU, bit for bit, for the 256 values of each channel, in
    every memory layout a batch arrives in."""
    from torchvision.transforms import Normalize  # noqa: PLC0415
    from torchvision.transforms.functional import to_tensor  # noqa: PLC0415

    image = every_byte_in_every_channel()
    expected = to_tensor(image)
    mean, std = (stats[:3], stats[3:]) if stats else (None, None)
    if stats:
        expected = Normalize(mean, std)(expected)
    model = PixelModel(torch.nn.Identity(), mean, std).eval()
    batch = torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0).expand(2, -1, -1, -1)
    for layout in (batch.contiguous(), batch.contiguous(memory_format=torch.channels_last), batch,
                   batch.contiguous()[:, :, ::2, 1::3]):  # a strided slice
        out = model(layout)
        assert out.dtype == torch.float32
        want = expected[:, ::2, 1::3] if layout.shape[-1] != 16 else expected
        assert torch.equal(out[1].view(torch.int32), want.view(torch.int32)), (stats, layout.stride())
    for memory_format in (torch.contiguous_format, torch.channels_last):  # the runtime's layouts are kept
        assert model(batch.contiguous(memory_format=memory_format)).is_contiguous(memory_format=memory_format)


class BatchOps(TorchDispatchMode):
    """The operations that read or write a tensor of the batch's size, by name."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, out) if isinstance(a, torch.Tensor)]
        if any(t.numel() >= self.numel for t in tensors) and not func.is_view:
            self.seen.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_input_conversion_is_one_gather_without_arithmetic_on_the_images(device):
    """Bytes to normalised floats: the index (channel * 256 + byte) and one gather; no subtraction, division or
    multiplication of image data on any device, which would be the device's own arithmetic."""
    model = PixelModel(torch.nn.Identity(), IN9_MEAN, IN9_STD).eval().to(device)
    images = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8).to(device)
    with BatchOps(images.numel()) as ops, torch.inference_mode():
        model(images)
    assert [op for op in ops.seen if op != "_to_copy"] == ["add_", "index_select"]  # the index's cast aside


def test_loaded_statistics_rebuild_the_table():
    """The table is derived from the statistics, not saved: loading other statistics gives their floats."""
    images = torch.from_numpy(every_byte_in_every_channel()).permute(2, 0, 1).unsqueeze(0)
    source = PixelModel(torch.nn.Identity(), IMAGENET_MEAN, IMAGENET_STD)
    model = PixelModel(torch.nn.Identity(), IN9_MEAN, IN9_STD)
    assert "table" not in model.state_dict()
    model.load_state_dict(source.state_dict())
    assert torch.equal(model(images), source(images))


def test_float_inputs_are_normalised_as_normalize_does():
    """Floats that are not bytes scaled (the original mask arithmetic's blend) keep Normalize's arithmetic."""
    from torchvision.transforms import Normalize  # noqa: PLC0415

    floats = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = PixelModel(torch.nn.Identity(), IN9_MEAN, IN9_STD).eval()
    assert torch.equal(model(floats), torch.stack([Normalize(IN9_MEAN, IN9_STD)(f) for f in floats]))


# ----------------------------------------------------------------------------------------------------------
# Composites: one-channel masks, bytes selected, then the model's gather

def test_challenge_masks_are_one_channel(dataset):
    from tools.challenge import list_challenge_files, load_challenge_data  # noqa: PLC0415

    data = load_challenge_data(list_challenge_files(dataset.root, 1), workers=1, progress=False)
    assert data.masks.shape == (len(data.foregrounds), 1, *data.fg_images.shape[-2:])
    assert data.masks.dtype == torch.uint8 and set(data.masks.unique().tolist()) <= {0, 255}


def test_the_predictor_s_composites_give_the_brute_force_logits():
    """Hand-built masks (all foreground, all background, one pixel, a half) and random ones: the predictor's
    composites through the model give the logits of the original's float arithmetic (ToTensor, `bg * (1 - m) +
    fg * m`, Normalize) bit for bit, in the same batch."""
    from torchvision.transforms import Normalize  # noqa: PLC0415

    from tools.challenge.data import ChallengeData  # noqa: PLC0415
    from tools.challenge.predictor import CompositePredictor  # noqa: PLC0415
    from tools.data.image_sets import ImageSet  # noqa: PLC0415
    from tools.models.boundary import LoadedModel  # noqa: PLC0415
    from tools.runtime import Runtime  # noqa: PLC0415

    gen = torch.Generator().manual_seed(2)
    size = 32
    fg = torch.randint(0, 256, (6, 3, size, size), dtype=torch.uint8, generator=gen)
    bg = torch.randint(0, 256, (5, 3, size, size), dtype=torch.uint8, generator=gen)
    masks = torch.rand(6, size, size, generator=gen) > 0.5
    masks[0], masks[1], masks[2], masks[3] = True, False, False, False
    masks[2, 7, 9] = True
    masks[3, :, : size // 2] = True
    data = ChallengeData([], [], ImageSet("."), fg, byte_masks(masks), bg)
    torch.manual_seed(0)
    classifier = SmallCNN(9).eval()
    loaded = LoadedModel(PixelModel(classifier, IN9_MEAN, IN9_STD), 9, None, None, None, None, "test", "test")
    predictor = CompositePredictor(loaded, Runtime(torch.device("cpu")), data, batch_size=64)
    fg_idx, bg_idx = (t.flatten() for t in torch.meshgrid(torch.arange(6), torch.arange(5), indexing="ij"))
    with torch.inference_mode():
        logits = predictor.forward.model(predictor.composite(fg_idx, bg_idx))
        weights = masks.float().unsqueeze(1)
        floats = bg.float()[bg_idx] / 255 * (1 - weights[fg_idx]) + fg.float()[fg_idx] / 255 * weights[fg_idx]
        expected = classifier(torch.stack([Normalize(IN9_MEAN, IN9_STD)(f) for f in floats]))
    assert torch.equal(logits, expected)
