"""The model boundary: `PixelModel` (pixels in, normalised inside, logits out), `LoadedModel` (a ready model
and what it is), building an untrained architecture by name, and wrapping a classifier with its statistics."""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tools.errors import UserError
from tools.in9 import NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization, statistics_for
from tools.data.pixels import unit_floats

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm:"
DEFAULT_ARCH = "resnet50"  # the paper's model, where neither --arch nor the checkpoint names one
SMALL_CNN = "toolkit:small_cnn"  # a tiny BatchNorm-free CNN for tests, demos and smoke runs


class PixelModel(nn.Module):
    """Pixels in, logits out: uint8 (or [0,1] float) NCHW images, scaled as ToTensor does, normalised, classified."""

    def __init__(self, classifier: nn.Module, mean=None, std=None):
        super().__init__()
        self.classifier = classifier
        self.normalize = mean is not None
        if self.normalize:
            self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(1, 3, 1, 1).clone())
            self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(1, 3, 1, 1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same floats as ToTensor then Normalize, in the same order, on every device (`unit_floats`), in
        # place on a fresh copy to spare memory traffic.
        x = unit_floats(x) if x.dtype == torch.uint8 else x.clone()
        if self.normalize:
            x.sub_(self.mean).div_(self.std)
        return self.classifier(x)


@dataclass
class LoadedModel:
    """A ready classifier and what it is: where it came from, its class count and its normalisation."""

    model: PixelModel
    num_classes: int
    arch: str | None
    weights: str | None
    source: str | None  # checkpoint or weights file
    sha256: str | None
    checkpoint_format: str
    normalization: str
    details: dict = field(default_factory=dict)  # what else its source records, e.g. CLIP's zero-shot head

    def describe(self) -> dict:
        return {"arch": self.arch, "weights": self.weights, "checkpoint": self.source, "sha256": self.sha256,
                "checkpoint_format": self.checkpoint_format, "num_classes": self.num_classes,
                "normalization": self.normalization, **self.details}


def torchvision_module():
    import torchvision  # noqa: PLC0415 (imported lazily: only model building needs it)
    return torchvision


def torchvision_architectures() -> list[str]:
    tv = torchvision_module()
    return sorted(tv.models.list_models(module=tv.models))


def close_matches(name: str, options) -> str:
    matches = difflib.get_close_matches(name, list(options), n=5, cutoff=0.5)
    return f" (close matches: {', '.join(matches)})" if matches else ""


class SmallCNN(nn.Module):
    """Three strided convolutions, a 1x1 one, global average pooling and a linear head (`fc`). No BatchNorm,
    so one process and several data-parallel ones train it to the same weights. About 10 MFLOPs per 224x224 image."""

    def __init__(self, num_classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 5, stride=4, padding=2), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_architecture(arch: str, num_classes: int) -> nn.Module:
    """An untrained classifier of the architecture with `num_classes` outputs."""
    if arch == SMALL_CNN:
        return SmallCNN(num_classes)
    if arch.startswith(TIMM_PREFIX):
        try:
            import timm  # noqa: PLC0415 (an optional extra)
        except ImportError:
            raise UserError(f"--arch {arch} needs timm, which is not installed; run `pip install timm` "
                            f"(or install this project with the [timm] extra)") from None
        name = arch[len(TIMM_PREFIX):]
        if name not in timm.list_models():
            raise UserError(f"unknown timm architecture {name!r}{close_matches(name, timm.list_models())}")
        return timm.create_model(name, pretrained=False, num_classes=num_classes)
    check_torchvision_architecture(arch)
    return torchvision_module().models.get_model(arch, weights=None, num_classes=num_classes)


def check_torchvision_architecture(arch: str) -> None:
    names = torchvision_architectures()
    if arch not in names:
        raise UserError(f"unknown architecture {arch!r}{close_matches(arch, names)}; --arch takes a torchvision "
                        f"classification model name, or timm:NAME with timm installed")


def classifier_keys(arch: str) -> list[str]:
    """State-dict keys whose shapes depend on the class count (the classifier), found by building both."""
    with torch.device("meta"):
        nine = build_architecture(arch, NUM_IN9_CLASSES).state_dict()
        full = build_architecture(arch, NUM_IMAGENET_CLASSES).state_dict()
    return [k for k in nine if nine[k].shape != full[k].shape]


def wrap(classifier: nn.Module, num_classes: int, normalize: Normalization, stats: tuple | None, stats_origin: str,
         arch: str | None, weights: str | None, source: str | None, digest: str | None,
         layout: str) -> LoadedModel:
    """A classifier as a `LoadedModel`, normalising inside with: the source's own statistics (`stats`, e.g.
    a checkpoint's normaliser or CLIP's) unless --normalize says otherwise, else the class-count rule."""
    if normalize is Normalization.AUTO and stats is not None:
        mean, std = stats
        norm_text = f"{stats_origin} (mean {[round(float(v), 4) for v in mean]}, std " \
                    f"{[round(float(v), 4) for v in std]})"
    else:
        rule = statistics_for(normalize, num_classes)
        mean, std = rule if rule is not None else (None, None)
        if normalize is Normalization.AUTO:
            norm_text = "in9 (9-class rule)" if num_classes == NUM_IN9_CLASSES else "imagenet (1000-class rule)"
        else:
            norm_text = f"{normalize.value} (--normalize)"
    classifier.eval()
    return LoadedModel(PixelModel(classifier, mean, std).eval(), num_classes, arch, weights, source, digest, layout,
                       norm_text)
