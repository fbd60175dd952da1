"""One batched, antialiased crop-and-resize for a whole batch, a box per image: torch's antialiased bilinear
resize is separable, so the crops are `rows @ image @ columns^T` with one (B, out, in) weight matrix per axis."""

from __future__ import annotations

import torch

# devices without float64 arithmetic (MPS: pytorch#122602), whose weights are computed in float32 (the crops stay
# within one uint8 level of torchvision's, tested)
NO_FLOAT64 = frozenset({"mps"})


def weights_dtype(device: torch.device) -> torch.dtype:
    """The precision the weights are computed in on `device`: float64, or float32 where the device has none."""
    return torch.float32 if device.type in NO_FLOAT64 else torch.float64


def antialias_weights(starts: torch.Tensor, lengths: torch.Tensor, in_size: int, out_size: int) -> torch.Tensor:
    """(B, out_size, in_size) float32: row i of image b holds the input pixels' weights for output pixel i, as
    torch's antialiased bilinear resize (align_corners=False) of the crop start..start+length-1 computes them."""
    device = starts.device
    dtype = weights_dtype(device)
    lengths = lengths.to(dtype).view(-1, 1, 1)
    scale = lengths / out_size
    support = scale.clamp(min=1.0)
    center = scale * (torch.arange(out_size, device=device, dtype=dtype).view(1, -1, 1) + 0.5)
    j = torch.arange(in_size, device=device, dtype=dtype).view(1, 1, -1) - starts.view(-1, 1, 1)
    low = (center - support + 0.5).trunc().clamp(min=0)
    high = torch.minimum((center + support + 0.5).trunc(), lengths)
    weights = (1 - ((j - center + 0.5) / support).abs()).clamp(min=0)
    weights = weights * ((j >= low) & (j < high))
    return (weights / weights.sum(-1, keepdim=True)).to(torch.float32)


def resized_crops(images: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (B, C, size, size): image b's box (top, left, height, width) resized with antialiasing, within one
    uint8 level of torchvision's per-image `resized_crop(..., antialias=True)` (float weights here; torch's CPU
    uint8 kernel uses fixed-point ones)."""
    boxes = boxes.to(images.device)
    rows = antialias_weights(boxes[:, 0], boxes[:, 2], images.shape[-2], size)
    columns = antialias_weights(boxes[:, 1], boxes[:, 3], images.shape[-1], size)
    pixels = images.to(torch.float32, memory_format=torch.contiguous_format)  # any layout in, the same products
    out = rows.unsqueeze(1) @ pixels @ columns.unsqueeze(1).transpose(-1, -2)
    return out.round_().clamp_(0, 255).to(torch.uint8)
