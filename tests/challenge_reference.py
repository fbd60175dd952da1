"""A brute-force challenge written for clarity: every (foreground, background) pair, the formula as written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import functional as TF

IN_TO_IN9 = Path(__file__).resolve().parents[1] / "tools" / "resources" / "in_to_in9.json"


def _folders(path: Path) -> list[str]:
    return sorted(d for d in os.listdir(path) if (path / d).is_dir())


def _load(path: Path) -> torch.Tensor:
    return TF.to_tensor(Image.open(path).convert("RGB"))


def original_weight(raw: np.ndarray) -> torch.Tensor:
    """The original script's mask pipeline, step by step: tile to 3 channels, uint8, times 255 (in uint8),
    a PIL image, ToTensor."""
    tiled = np.tile(raw[:, :, np.newaxis], [1, 1, 3]).astype("uint8")
    return TF.to_tensor(Image.fromarray(tiled * 255))


def binary_weight(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw.astype(np.uint8)).float().unsqueeze(0)


def reference_matrix(root: Path, classifier: torch.nn.Module, mean, std, weight=binary_weight):
    """Predictions of every composite: (matrix (F, B), foreground labels, background labels).

    `weight` turns a mask's raw array into the compositing weight (binary_weight, or original_weight)."""
    root = Path(root)
    table = {int(k): v for k, v in json.loads(IN_TO_IN9.read_text()).items()}
    foregrounds, fg_labels = [], []
    mask_root, image_root = root / "fg_mask" / "val", root / "original" / "val"
    for label, cls in enumerate(_folders(mask_root)):
        for name in sorted(os.listdir(mask_root / cls)):
            stem = name[:-len(".npy")]
            mask = weight(np.load(mask_root / cls / name))
            foregrounds.append((_load(image_root / cls / f"{stem}.JPEG"), mask))
            fg_labels.append(label)
    backgrounds, bg_labels = [], []
    bg_root = root / "only_bg_t" / "val"
    for label, cls in enumerate(_folders(bg_root)):
        for name in sorted(os.listdir(bg_root / cls)):
            backgrounds.append(_load(bg_root / cls / name))
            bg_labels.append(label)
    mean = torch.tensor(mean).view(3, 1, 1)
    std = torch.tensor(std).view(3, 1, 1)
    matrix = np.zeros((len(foregrounds), len(backgrounds)), dtype=np.int64)
    with torch.no_grad():
        for i, (fg, mask) in enumerate(foregrounds):
            for j, bg in enumerate(backgrounds):
                composite = bg * (1 - mask) + fg * mask
                logits = classifier(((composite - mean) / std).unsqueeze(0))[0]
                top = int(logits.argmax())
                matrix[i, j] = top if logits.numel() == 9 else table[top]
    return matrix, np.array(fg_labels), np.array(bg_labels)


def reference_verdicts(matrix: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray, criterion: str) -> np.ndarray:
    vulnerable = np.zeros(len(fg_labels), dtype=bool)
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            if criterion == "any" and matrix[i, j] != fg_labels[i]:
                vulnerable[i] = True
            if criterion == "bg-class" and bg_labels[j] != fg_labels[i] and matrix[i, j] == bg_labels[j]:
                vulnerable[i] = True
    return vulnerable
