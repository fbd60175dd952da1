"""The reference facts' folder, and a brute-force reference for IN-9 accuracy written for clarity, not speed.

The reference facts (the ImageNet->IN-9 map and the class names the shipped copies must equal, and the
README with the published figures) live outside the repository, in `../shared/reference` beside its root
(where CI puts them) or in $IN9_REFERENCE_DIR; `reference_dir` finds them.

The brute-force reference shares no code with the toolkit's evaluation path: it walks the folders itself,
decodes each image with Pillow, converts and normalises it with torchvision's transforms, runs the plain
classifier on one image at a time and maps 1000-class predictions through the JSON file read with `json`.
The statistics are the figures of the reference facts' README, written out here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import Normalize
from torchvision.transforms.functional import to_tensor

REPOSITORY = Path(__file__).resolve().parents[1]
IN_TO_IN9_JSON = REPOSITORY / "tools" / "resources" / "in_to_in9.json"
REFERENCE_DIR_VARIABLE = "IN9_REFERENCE_DIR"

IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
IN9_STATS = ((0.4717, 0.4499, 0.3837), (0.2600, 0.2516, 0.2575))


@dataclass
class ReferenceResult:
    paths: list[Path]
    labels: list[int]
    predictions: list[int]  # IN-9 class index, or -1 for an ImageNet class outside IN-9

    @property
    def correct(self) -> int:
        return sum(1 for p, y in zip(self.predictions, self.labels) if p == y)

    @property
    def total(self) -> int:
        return len(self.labels)

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / self.total


def reference_dir(repository: Path = REPOSITORY) -> Path:
    """The folder of reference facts: $IN9_REFERENCE_DIR, else `../shared/reference` beside `repository`.

    Where it is missing the calling test is skipped, but fails under CI ($CI set, as CI services set it): there
    a skip would hide that the shipped copies were never compared."""
    configured = os.environ.get(REFERENCE_DIR_VARIABLE)
    folder = Path(configured) if configured else repository.parent / "shared" / "reference"
    if not folder.is_dir():
        message = (f"no reference facts at {folder}: put them in ../shared/reference beside the repository, or set "
                   f"{REFERENCE_DIR_VARIABLE}")
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
            pytest.fail(message)
        pytest.skip(message)
    return folder


def in_to_in9() -> dict[int, int]:
    with open(IN_TO_IN9_JSON, encoding="utf-8") as fh:
        return {int(k): int(v) for k, v in json.load(fh).items()}


def default_statistics(num_classes: int):
    return IN9_STATS if num_classes == 9 else IMAGENET_STATS


def evaluate(classifier: torch.nn.Module, root: Path, variation: str, num_classes: int,
             statistics=None) -> ReferenceResult:
    """Accuracy of `classifier` (taking normalised input) on root/<variation>/val/<class>/<image>.

    statistics: (mean, std), default by the class-count rule; pass "none" for no normalisation.
    """
    if statistics is None:
        statistics = default_statistics(num_classes)
    normalize = (lambda t: t) if statistics == "none" else Normalize(*statistics)
    mapping = in_to_in9() if num_classes == 1000 else None
    folder = Path(root) / variation / "val"
    class_dirs = sorted(p for p in folder.iterdir() if p.is_dir())
    result = ReferenceResult([], [], [])
    classifier.eval()
    for label, class_dir in enumerate(class_dirs):
        for path in sorted(p for p in class_dir.iterdir() if p.is_file()):
            with Image.open(path) as img:
                pixels = img.convert("RGB")
            x = normalize(to_tensor(pixels)).unsqueeze(0)
            with torch.no_grad():
                logits = classifier(x)
            top = int(logits[0].argmax())
            prediction = mapping[top] if mapping is not None else top
            result.paths.append(path)
            result.labels.append(label)
            result.predictions.append(prediction)
    return result
