"""fp32 on a device against fp64 on the CPU, for every model format: the comparison `tests/test_gpu.py` runs on
CUDA and `tests/test_runtime_precision.py` runs on the CPU (so that the check itself is known to work, and to catch a
reduced-precision path).

A model is built once with seeded random weights; its fp32 logits on the device, through the toolkit's exact
forward pass (`Forward` under an fp32 `Runtime`: flags, attention backend, TorchScript's switches) and, for the
program formats, through the loader (`load_model`: devices pointed, convolutions rewritten), are compared with
the same weights in fp64 on the CPU. fp32 rounding is the CPU's own fp32 deviation from fp64 (at most
`ROUNDING_FACTOR` times it, or `ULPS` units in the last place of the largest logit); TF32 is about 2^13 times
coarser, bf16 2^16."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tools.models.programs import Program
from tools.models.sources import load_model
from tools.runtime import Forward, Runtime, exact_kernels

ROUNDING_FACTOR = 16  # another summation order may round a few times worse than the CPU's own fp32
ULPS = 64
IMAGE = (3, 224, 224)  # the loader probes a program at 224x224; the ViTs here are built for 32x32


class Logits(nn.Module):
    """A transformers model as a classifier: its `logits`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def resnet() -> nn.Module:
    import torchvision  # noqa: PLC0415
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=9).eval()


def timm_vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer  # noqa: PLC0415
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=9).eval()


def hf_vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification  # noqa: PLC0415
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=9, attn_implementation="sdpa")
    return Logits(ViTForImageClassification(config)).eval()


def clip_image_tower(arch: str) -> Callable[[], nn.Module]:
    """The image tower of a registered open_clip architecture (its MultiheadAttention takes the fast path)."""
    def build() -> nn.Module:
        import open_clip  # noqa: PLC0415
        torch.manual_seed(0)
        return open_clip.create_model(arch).visual.eval()
    return build


def save_program(net: nn.Module, kind: str, folder: Path) -> Path:
    """`net` as the program file a user brings: traced (with torch's default cuDNN flags, TF32 on), scripted or
    exported."""
    example = torch.zeros(2, *IMAGE)
    path = folder / f"{kind}.{'pt2' if kind == 'export' else 'ts'}"
    if kind == "export":
        batch = {0: torch.export.Dim("batch", min=1, max=1024)}
        torch.export.save(torch.export.export(net, (example,), dynamic_shapes=(batch,)), str(path))
    else:
        with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
            program = torch.jit.trace(net, example) if kind == "traced" else torch.jit.script(net)
        torch.jit.save(program, str(path))
    return path


def fp32_logits(net: nn.Module, kind: str, runtime: Runtime, folder: Path, x: torch.Tensor) -> torch.Tensor:
    """`net`'s fp32 logits on the runtime's device, as the toolkit computes them for a model of that format."""
    if kind == "eager":
        model = runtime.prepare(copy.deepcopy(net))
    else:
        loaded = load_model(checkpoint=save_program(net, kind, folder), runtime=runtime, trust=kind != "export")
        model = runtime.prepare(next(m for m in loaded.model.modules() if isinstance(m, Program)))
    return Forward(model, runtime, chunk=len(x))(runtime.to_device(x)).cpu()


def fp64_logits(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), exact_kernels():
        return copy.deepcopy(net).double()(x.double())


def deviations(net: nn.Module, kind: str, runtime: Runtime, folder: Path, size: int = IMAGE[-1]
               ) -> tuple[float, float]:
    """(the device's fp32 deviation from fp64, the bound fp32 rounding allows), in absolute logit units, over
    four random images of `size` x `size`."""
    x = torch.rand(4, 3, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1
    reference = fp64_logits(net, x)
    cpu = (fp32_logits(net, "eager", Runtime(torch.device("cpu")), folder, x).double() - reference).abs().max()
    device = (fp32_logits(net, kind, runtime, folder, x).double() - reference).abs().max()
    ulp = torch.finfo(torch.float32).eps * reference.abs().max()
    return float(device), float(max(ROUNDING_FACTOR * cpu, ULPS * ulp))
