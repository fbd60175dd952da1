"""Image bytes to floats: the one conversion, giving torchvision's ToTensor floats bit for bit on every device.

The original converts on the CPU (ToTensor: a true division by 255). Off the CPU a division by 255 is not
always one: CUDA's kernel divides by a CPU scalar (a Python number, or a 0-dim CPU tensor) as a
multiplication by its reciprocal, and torch.compile does so for any constant divisor off the CPU, which gives
another float for 126 of the 256 byte values, so a near tie could flip on the GPU only. Off the CPU the floats
are therefore looked up in a table of the CPU's 256 quotients; on the CPU the true division is exact already,
and a few times faster than a lookup.
"""

from __future__ import annotations

import torch

BYTE_VALUES = 256
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
    """The same floats as a lookup in the CPU's 256 quotients, moved to the images' device (the path off the CPU)."""
    return _table(images.device)[images.long()]


def _table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
            quotients = torch.arange(BYTE_VALUES, dtype=torch.float32).div_(_CPU_DIVISOR)  # computed on the CPU
            table = _TABLES[device] = quotients.to(device)
    return table
