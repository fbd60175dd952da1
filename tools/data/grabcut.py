"""Foreground masks by OpenCV's GrabCut initialised with the bounding box (OpenCV is an optional extra)."""

from __future__ import annotations

import numpy as np

from tools.data.variations import Box
from tools.errors import optional_module

DEFAULT_ITERATIONS = 5


def require_opencv():
    """The cv2 module, or a UserError saying how to install it or what to pass instead."""
    return optional_module("cv2", "making foreground masks with GrabCut", "opencv-python-headless", "opencv",
                           called="OpenCV", also="; or pass --masks DIR with your own masks")


def grabcut_mask(image: np.ndarray, box: Box, iterations: int = DEFAULT_ITERATIONS, seed: int = 0) -> np.ndarray:
    """The HxW bool foreground (sure or probable) GrabCut finds in an HxWx3 uint8 RGB image, starting from the box
    as probable foreground; OpenCV's generator is seeded first, so it is deterministic. ValueError where GrabCut
    cannot run (an empty box, no background outside it)."""
    cv2 = require_opencv()
    x0, y0, x1, y1 = box
    height, width = image.shape[:2]
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"empty box {box}")
    if (x0, y0, x1, y1) == (0, 0, width, height):
        raise ValueError(f"box {box} covers the whole image: GrabCut needs background outside it")
    mask = np.zeros((height, width), np.uint8)
    background_model = np.zeros((1, 65), np.float64)
    foreground_model = np.zeros((1, 65), np.float64)
    bgr = np.ascontiguousarray(image[..., ::-1])
    cv2.setRNGSeed(seed)
    try:
        cv2.grabCut(bgr, mask, (int(x0), int(y0), int(x1 - x0), int(y1 - y0)), background_model, foreground_model,
                    iterations, cv2.GC_INIT_WITH_RECT)
    except cv2.error as exc:
        raise ValueError(f"GrabCut failed: {str(exc).strip().splitlines()[-1]}") from None
    return (mask == cv2.GC_FGD) | (mask == cv2.GC_PR_FGD)
