"""Generated IN-9-shaped data in the release's layout, and hand-built models with known answers: each class has
a foreground and a background colour, so `ColorEvidenceModel` finds originals easy, backgrounds alone predictive,
and small foregrounds on foreign backgrounds fooled, as in the paper."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from tools.data import variations
from tools.in9 import (
    IMAGE_SIZE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    IN9_MEAN,
    IN9_STD,
    MASK_FOLDER,
    NUM_IMAGENET_CLASSES,
    NUM_IN9_CLASSES,
    SPLIT,
    UNMAPPED,
    Variation,
    class_folder_names,
    in_to_in9_table,
)
from tools.provenance import open_own

MANIFEST_NAME = "synthetic.json"

# Bright foreground colours and darker, muted background colours, far apart in RGB.
FG_COLORS = np.array([
    [230, 30, 30], [30, 200, 40], [40, 60, 230], [235, 225, 30], [220, 40, 220],
    [30, 220, 220], [250, 140, 20], [140, 40, 240], [245, 245, 245],
], dtype=np.float32) / 255
BG_COLORS = np.array([
    [90, 60, 40], [40, 90, 60], [50, 50, 100], [110, 110, 50], [100, 50, 90],
    [40, 100, 110], [130, 90, 90], [70, 70, 70], [20, 30, 20],
], dtype=np.float32) / 255


@dataclass
class SyntheticImage:
    stem: str
    label: int
    box: tuple[int, int, int, int]
    mixed_bg: dict = field(default_factory=dict)  # variation -> (stem, class) of the background it used


@dataclass
class SyntheticDataset:
    root: Path
    images: list[SyntheticImage]

    def by_stem(self) -> dict[str, SyntheticImage]:
        return {img.stem: img for img in self.images}


def _random_box(rng: np.random.Generator, size: int, min_side: int, max_side: int) -> tuple[int, int, int, int]:
    margin = size // 8  # keeps the corners background in every variation
    w, h = rng.integers(min_side, max_side + 1, size=2)
    x0 = int(rng.integers(margin, size - margin - w + 1))
    y0 = int(rng.integers(margin, size - margin - h + 1))
    return x0, y0, x0 + int(w), y0 + int(h)


def _ellipse_mask(box, size: int) -> np.ndarray:
    x0, y0, x1, y1 = box
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    return ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1.0


def _texture(rng: np.random.Generator, color: np.ndarray, size: int, amplitude: float) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    fx, fy, phase = rng.uniform(0.02, 0.15), rng.uniform(0.02, 0.15), rng.uniform(0, 2 * np.pi)
    wave = np.sin(fx * xx + fy * yy + phase)[..., None] * amplitude
    noise = rng.normal(0, amplitude / 2, size=(size, size, 3)).astype(np.float32)
    return (np.clip(color + wave + noise, 0, 1) * 255 + 0.5).astype(np.uint8)


def _save_jpeg(array: np.ndarray, path: Path, quality: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_own(path) as fh:  # never through a link already there
        Image.fromarray(array).save(fh, format="JPEG", quality=quality)


def manifest_name(split: str = SPLIT) -> str:
    return MANIFEST_NAME if split == SPLIT else f"synthetic_{split}.json"


def generate(root: Path, per_class: int = 4, seed: int = 0, size: int = IMAGE_SIZE, quality: int = 95,
             min_side: int = 40, max_side: int = 150, classes: int = NUM_IN9_CLASSES,
             split: str = SPLIT) -> SyntheticDataset:
    """Write `per_class` images per class in every variation plus fg_mask, deterministic per seed, and a manifest
    (`manifest_name`: each image's box and each mixed image's background). `split`: val or train."""
    if per_class < 1:
        raise ValueError("per_class must be at least 1")
    root = Path(root)
    rng = np.random.default_rng(seed)
    folders = class_folder_names()[:classes]
    records: list[SyntheticImage] = []
    originals, backgrounds, tiled, masks = [], [], [], []
    for label in range(classes):
        for i in range(per_class):
            stem = f"synth{label}_{i:05d}"
            box = _random_box(rng, size, min_side, max_side)
            mask = _ellipse_mask(box, size)
            bg = _texture(rng, BG_COLORS[label], size, rng.uniform(0.02, 0.2))
            fg = _texture(rng, FG_COLORS[label], size, 0.05)
            records.append(SyntheticImage(stem, label, box))
            originals.append(variations.composite(fg, bg, mask))
            backgrounds.append(bg)
            tiled.append(variations.only_bg_t(bg, box))
            masks.append(mask)

    by_class = [[j for j, r in enumerate(records) if r.label == c] for c in range(classes)]
    for j, rec in enumerate(records):
        folder = folders[rec.label]
        name = f"{rec.stem}.JPEG"

        def out(variation: Variation) -> Path:
            return root / variation.value / split / folder / name  # noqa: B023

        image, mask = originals[j], masks[j]
        _save_jpeg(image, out(Variation.ORIGINAL), quality)
        _save_jpeg(variations.only_fg(image, mask), out(Variation.ONLY_FG), quality)
        _save_jpeg(variations.only_bg_b(backgrounds[j], rec.box), out(Variation.ONLY_BG_B), quality)
        _save_jpeg(tiled[j], out(Variation.ONLY_BG_T), quality)
        _save_jpeg(variations.no_fg(image, mask), out(Variation.NO_FG), quality)
        same = [k for k in by_class[rec.label] if k != j] or by_class[rec.label]
        choices = {
            Variation.MIXED_SAME: same,
            Variation.MIXED_RAND: by_class[int(rng.integers(classes))],
            Variation.MIXED_NEXT: by_class[(rec.label + 1) % classes],
        }
        for variation, pool in choices.items():
            k = int(pool[rng.integers(len(pool))])
            rec.mixed_bg[variation.value] = (records[k].stem, records[k].label)
            _save_jpeg(variations.composite(image, tiled[k], mask), out(variation), quality)
        mask_path = root / MASK_FOLDER / split / folder / f"{rec.stem}.npy"
        mask_path.parent.mkdir(parents=True, exist_ok=True)
        with open_own(mask_path) as fh:
            np.save(fh, mask)

    manifest = {"seed": seed, "per_class": per_class,
                "images": [{"stem": r.stem, "label": r.label, "box": r.box, "mixed_bg": r.mixed_bg} for r in records]}
    with open_own(root / manifest_name(split)) as fh:
        fh.write(json.dumps(manifest, indent=1).encode())
    return SyntheticDataset(root, records)


class ColorEvidenceModel(nn.Module):
    """A hand-built classifier on normalised input: class k's score = fg_weight * (fraction like FG colour k) +
    bg_weight * (fraction like BG colour k). 1000 outputs: k's score at the first ImageNet index mapped to k,
    `unmapped_score` at an unmapped one (-1 when no colour is present), the rest far below. `sampling="stride"`
    (every eighth pixel) and `trunk_width` (a small CNN's compute) are for benchmarks."""

    def __init__(self, num_classes: int = NUM_IN9_CLASSES, fg_weight: float = 4.0, bg_weight: float = 1.0,
                 sigma: float = 0.12, unmapped_score: float = 0.05, trunk_width: int = 0, trunk_scale: float = 1e-3,
                 seed: int = 0, sampling: str = "pool"):
        super().__init__()
        if sampling not in ("pool", "stride"):
            raise ValueError(f"sampling is pool or stride, not {sampling!r}")
        self.sampling = sampling
        self.num_classes = num_classes
        mean, std = (IN9_MEAN, IN9_STD) if num_classes == NUM_IN9_CLASSES else (IMAGENET_MEAN, IMAGENET_STD)
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1))
        palette = torch.from_numpy(np.concatenate([FG_COLORS, BG_COLORS]))  # (18, 3)
        self.register_buffer("palette", palette.view(18, 3, 1, 1))  # a 1x1 convolution computing p . c
        self.register_buffer("palette_sq", (palette ** 2).sum(dim=1).view(1, 18, 1, 1))
        self.register_buffer("weights", torch.tensor([fg_weight] * 9 + [bg_weight] * 9))
        self.inv_two_sigma_sq = 1.0 / (2 * sigma * sigma)
        self.unmapped_score = unmapped_score
        if num_classes == NUM_IMAGENET_CLASSES:
            table = in_to_in9_table()
            targets = [int((table == k).nonzero()[0]) for k in range(NUM_IN9_CLASSES)]
            self.register_buffer("targets", torch.tensor(targets))
            self.unmapped_index = int((table == UNMAPPED).nonzero()[0])
        self.trunk = None
        self.trunk_scale = trunk_scale
        if trunk_width:
            gen = torch.Generator().manual_seed(seed)
            w = trunk_width
            self.trunk = nn.Sequential(
                nn.Conv2d(3, w, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(w, w, 3, stride=1, padding=1), nn.ReLU(),
                nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(2 * w, 2 * w, 3, stride=1, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, NUM_IN9_CLASSES))
            with torch.no_grad():
                for p in self.trunk.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def in9_scores(self, x: torch.Tensor) -> torch.Tensor:
        # colour samples: the mean of each 4x4 cell (56x56), or (much cheaper) every eighth pixel (28x28)
        samples = nn.functional.avg_pool2d(x.float(), 4) if self.sampling == "pool" else x[:, :, ::8, ::8].float()
        pixels = samples * self.std + self.mean
        # |p - c|^2 = |p|^2 - 2 p.c + |c|^2, for the 18 palette colours at once
        dist = (pixels ** 2).sum(dim=1, keepdim=True) - 2 * nn.functional.conv2d(pixels, self.palette) + self.palette_sq
        evidence = torch.exp(-dist * self.inv_two_sigma_sq).mean(dim=(2, 3)) * self.weights
        scores = evidence[:, :9] + evidence[:, 9:]
        if self.trunk is not None:
            scores = scores + self.trunk_scale * self.trunk(x).float()
        return scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.in9_scores(x)
        if self.num_classes == NUM_IN9_CLASSES:
            return scores
        logits = torch.full((x.shape[0], NUM_IMAGENET_CLASSES), -1e4, device=x.device, dtype=scores.dtype)
        logits[:, self.targets] = scores
        logits[:, self.unmapped_index] = self.unmapped_score
        return logits
