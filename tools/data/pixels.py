"""Image bytes to floats: torchvision's ToTensor (and Normalize) floats bit for bit on every device. The model's
input is one gather in a (3, 256) table the CPU computed; `unit_floats` divides only on the CPU, since off it a
division by 255 may be a multiplication by the reciprocal (CUDA, torch.compile): another float for 126 of the 256
byte values. See docs/how-it-works.md, "Exactness and behaviour on each device"."""

from __future__ import annotations

import torch

BYTE_VALUES = 256
CHANNELS = 3
# A one-element tensor, not a scalar: should the CPU's division ever meet a GPU tensor, it fails loudly
# instead of taking the reciprocal path.
_CPU_DIVISOR = torch.full((1,), BYTE_VALUES - 1, dtype=torch.float32)
_TABLES: dict[torch.device, torch.Tensor] = {}


def unit_floats(images: torch.Tensor) -> torch.Tensor:
    """Integer images (uint8, any shape and layout) as new float32 on [0, 1], ToTensor's values, on their device."""
    if images.device.type == "cpu":
        return images.float().div_(_CPU_DIVISOR)
    return table_floats(images)


def table_floats(images: torch.Tensor) -> torch.Tensor:
    """The same floats as a lookup in the CPU's 256 quotients, on the images' device."""
    return _table(images.device)[images.long()]


def _table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
            quotients = torch.arange(BYTE_VALUES, dtype=torch.float32).div_(_CPU_DIVISOR)  # computed on the CPU
            table = _TABLES[device] = quotients.to(device)
    return table


def normalisation_table(mean=None, std=None) -> torch.Tensor:
    """(3, 256) float32: row c, column v is ToTensor then Normalize of byte v in channel c as the original computes
    them on the CPU (fp32 statistics); without statistics, ToTensor's floats in every row."""
    with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
        table = torch.arange(BYTE_VALUES, dtype=torch.float32).expand(CHANNELS, -1).div(_CPU_DIVISOR)
        if mean is not None:
            column = (CHANNELS, 1)
            table.sub_(torch.as_tensor(mean, dtype=torch.float32).cpu().reshape(column))
            table.div_(torch.as_tensor(std, dtype=torch.float32).cpu().reshape(column))
    return table


def normalised_floats(images: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) images, in any layout, as `table`'s floats (on the images' device): one gather in the
    images' memory layout, its int32 index alive only during it."""
    offsets = torch.arange(0, CHANNELS * BYTE_VALUES, BYTE_VALUES, dtype=torch.int32, device=images.device)
    # channel * 256 + byte, in the images' layout (cast then added: the CPU's mixed-dtype add is several times slower)
    index = images.int().add_(offsets.view(1, CHANNELS, 1, 1))
    order = sorted(range(index.dim()), key=lambda d: -index.stride(d))  # outermost dimension in memory first
    physical = index.permute(order)
    if not physical.is_contiguous():
        physical = physical.contiguous()
    gathered = table.reshape(-1).index_select(0, physical.reshape(-1)).view(physical.shape)
    return gathered.permute(sorted(range(len(order)), key=order.__getitem__))
