"""The model boundary: `PixelModel` (pixels in, normalised inside, logits out), `LoadedModel` (a ready model, what it is
and its record), `wrap`, and the resize inside the model for inputs other than 224x224 (`fit_input_size`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tools.data.pixels import normalisation_table, normalised_floats
from tools.errors import option
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, Normalization, statistics_for
from tools.models import torchscript
from tools.models.record import ModelRecord, described_value
from tools.runtime import Runtime, check_antialias

log = logging.getLogger(__name__)


def state_sha256(module: nn.Module) -> str:
    """The SHA-256 of a module's state dict (tensors by dtype, shape and bytes): an in-memory model's weights' identity;
    the same bytes as another dtype or shape are other weights."""
    digest = hashlib.sha256()
    for key, value in module.state_dict().items():
        digest.update(json.dumps([key, described_value(value)], sort_keys=True).encode() + b"\n")
    return digest.hexdigest()


class PixelModel(nn.Module):
    """Pixels in, logits out: uint8 (or [0,1] float) NCHW images, scaled as ToTensor does, normalised, classified.

    Bytes go through one gather in the table of the CPU's normalised floats (`normalisation_table`), the same on every
    device; floats (the original mask arithmetic's blend) are normalised as Normalize does."""

    def __init__(self, classifier: nn.Module, mean=None, std=None):
        super().__init__()
        self.classifier = classifier
        self.normalize = mean is not None
        if self.normalize:
            self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32).reshape(1, 3, 1, 1).clone())
            self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(1, 3, 1, 1).clone())
        # derived from the statistics, so not saved with them: rebuilt when they are loaded
        self.register_buffer("table", normalisation_table(mean, std), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            return self.classifier(normalised_floats(x, self.table))
        # Normalize's arithmetic, in place on a fresh copy to spare memory traffic
        x = x.clone()
        if self.normalize:
            x.sub_(self.mean).div_(self.std)
        return self.classifier(x)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.normalize:
            self.table.copy_(normalisation_table(self.mean.float(), self.std.float()))


@dataclass
class LoadedModel:
    """A ready classifier: where it came from, its class count, its normalisation, and its record."""

    model: PixelModel
    num_classes: int
    arch: str | None
    weights: str | None
    source: str | None  # checkpoint or weights file
    record: ModelRecord | None  # None only for a LoadedModel built by hand (a test's, a benchmark's)
    checkpoint_format: str
    normalization: str
    details: dict = field(default_factory=dict)  # what else its source records, e.g. CLIP's zero-shot head

    @property
    def identity(self) -> str | None:
        """The model's identity: the digest of its record (resume states, the zoo's "already done")."""
        return None if self.record is None else self.record.digest

    def describe(self) -> dict:
        return {"arch": self.arch, "weights": self.weights, "checkpoint": self.source, "identity": self.identity,
                "checkpoint_format": self.checkpoint_format, "num_classes": self.num_classes,
                "normalization": self.normalization,
                "model_record": None if self.record is None else self.record.describe(), **self.details}


@dataclass(frozen=True)
class ModelOrigin:
    """Where a classifier came from, as its `LoadedModel` names it (what it is made of is its `ModelRecord`)."""

    arch: str | None  # None for a program, which carries its own
    weights: str | None = None  # the named weights (torchvision's, CLIP's pretrained tag)
    source: str | None = None  # the checkpoint or weights file
    checkpoint_format: str = ""


def wrap(classifier: nn.Module, *, num_classes: int, origin: ModelOrigin, normalize: Normalization,
         record: ModelRecord, stats: tuple | None = None, stats_origin: str = "") -> LoadedModel:
    """A classifier as a `LoadedModel`, normalising inside with `stats` unless --normalize says otherwise, else the
    class-count rule; its TorchScript convolutions rewritten to read the run's flags."""
    classifier = torchscript.rewritten(classifier)
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
            norm_text = f"{normalize.value} ({option('--normalize', normalize.value)})"
    record.setting("num_classes", num_classes)
    record.setting("normalization", None if mean is None else {"mean": [float(v) for v in mean],
                                                               "std": [float(v) for v in std]})
    classifier.eval()
    return LoadedModel(PixelModel(classifier, mean, std).eval(), num_classes, origin.arch, origin.weights,
                       origin.source, record, origin.checkpoint_format, norm_text)


# ----------------------------------------------------------------------------------------------------------
# Inputs of another size

def resize_input(x: torch.Tensor, size: tuple[int, int], mode: str = "bicubic") -> torch.Tensor:
    """A normalised batch resized (antialiased) to the input size: linear, so it commutes with the normalisation."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode=mode, align_corners=False, antialias=True)


def announce_input_size(size: tuple[int, int], used_by: str, mode: str = "bicubic",
                        runtime: Runtime | None = None) -> None:
    """Say once that the 224x224 inputs are resized inside `used_by`; refuse a device without antialiased resize."""
    if runtime is not None:
        check_antialias(runtime.device, mode, f"{used_by}, which resizes its inputs to {size[0]}x{size[1]}")
    log.info("%s takes %dx%d images: the %dx%d inputs are resized inside the model (%s, antialiased)", used_by,
             *size, IMAGE_SIZE, IMAGE_SIZE, mode)


class InputResize(nn.Module):
    """A classifier whose input size is not 224x224, behind `resize_input`."""

    def __init__(self, classifier: nn.Module, size: tuple[int, int], mode: str = "bicubic"):
        super().__init__()
        self.classifier = classifier
        self.size = tuple(size)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(resize_input(x, self.size, self.mode))


def fit_input_size(classifier: nn.Module, size: tuple[int, int], used_by: str, mode: str = "bicubic",
                   runtime: Runtime | None = None) -> nn.Module:
    """The classifier as it is for 224x224 inputs; else behind `InputResize`, said once (`announce_input_size`)."""
    size = tuple(int(v) for v in size)
    if size == (IMAGE_SIZE, IMAGE_SIZE):
        return classifier
    announce_input_size(size, used_by, mode, runtime)
    return InputResize(classifier, size, mode)


def network_input(classifier: nn.Module) -> tuple[nn.Module, tuple[int, int], str | None]:
    """(the network behind `fit_input_size`'s resize, its input size, the interpolation; 224x224 and None without one):
    training changes the network, behind the same resize."""
    if isinstance(classifier, InputResize):
        return classifier.classifier, classifier.size, classifier.mode
    return classifier, (IMAGE_SIZE, IMAGE_SIZE), None
