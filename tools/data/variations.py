"""The paper's image variations as pure functions on HxWx3 uint8 arrays, boxes and boolean masks. Boxes are
(x0, y0, x1, y1) in pixels, half-open: columns x0..x1-1 and rows y0..y1-1."""

from __future__ import annotations

import numpy as np

Box = tuple[int, int, int, int]


def composite(foreground: np.ndarray, background: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Foreground pixels where the mask is set, background pixels elsewhere."""
    return np.where(mask[..., None], foreground, background)


def only_fg(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Everything but the foreground black."""
    return np.where(mask[..., None], image, 0).astype(np.uint8)


def no_fg(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The foreground black."""
    return np.where(mask[..., None], 0, image).astype(np.uint8)


def only_bg_b(image: np.ndarray, box: Box) -> np.ndarray:
    """The bounding box black."""
    x0, y0, x1, y1 = box
    out = image.copy()
    out[y0:y1, x0:x1] = 0
    return out


def largest_strip(shape: tuple[int, int], box: Box) -> tuple[str, int, int]:
    """(axis, start, stop) of the largest full-width ("rows") or full-height ("cols") strip outside the box; ties go
    to the first of top, bottom, left, right."""
    height, width = shape
    x0, y0, x1, y1 = box
    candidates = [
        (y0 * width, "rows", 0, y0),
        ((height - y1) * width, "rows", y1, height),
        (x0 * height, "cols", 0, x0),
        ((width - x1) * height, "cols", x1, width),
    ]
    area, axis, start, stop = max(candidates, key=lambda c: c[0])  # max keeps the first of equal areas
    if area == 0:
        raise ValueError(f"box {box} covers the whole image: no background strip to tile from")
    return axis, start, stop


def only_bg_t(image: np.ndarray, box: Box) -> np.ndarray:
    """The box filled with tiles of the largest background strip outside it."""
    x0, y0, x1, y1 = box
    axis, start, stop = largest_strip(image.shape[:2], box)
    out = image.copy()
    if axis == "rows":
        rows = start + (np.arange(y0, y1) - y0) % (stop - start)
        out[y0:y1, x0:x1] = image[rows][:, x0:x1]
    else:
        cols = start + (np.arange(x0, x1) - x0) % (stop - start)
        out[y0:y1, x0:x1] = image[y0:y1][:, cols]
    return out
