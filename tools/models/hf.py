"""Hugging Face transformers image classifiers (the `hf:ORG/NAME` and `hf:PATH` source, optional extra [hf]).

`AutoModelForImageClassification` loads the model without remote code (`trust_remote_code` off: a model that
ships its own code is refused) and its weights as safetensors or with `weights_only` unpickling; its image
processor gives the mean/std and the input size (inputs of another size are resized inside the model). The
labels decide what the model is, in their `id2label` order:

- 1000 labels: an ImageNet head, through the ImageNet->IN-9 map. Accepted when the labels name ImageNet's
  classes at the checked indices (`IMAGENET_LANDMARKS`, the first WordNet lemma as transformers' ImageNet
  configs write it, "tench, Tinca tinca"), or are transformers' placeholders (LABEL_0 ...), which name nothing
  and are taken in ImageNet's order, as the log says.
- 9 labels: an IN-9 model, when label i names IN-9 class i (dog, 00_dog, Dog or its WordNet id) or the labels
  are placeholders.
- anything else is refused.
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path

from torch import nn

from tools.errors import UserError, first_line
from tools.in9 import IMAGE_SIZE, NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization, class_names, class_of_folder
from tools.models import hub
from tools.models.boundary import LoadedModel, ModelOrigin, fit_input_size, wrap
from tools.models.spec import HF_PREFIX

log = logging.getLogger(__name__)

INSTALL_HINT = "run `pip install 'bg-challenge-toolkit[hf]'` (transformers and safetensors)"
# ImageNet class index -> its first WordNet lemma, where a wrong order or another 1000-class label set shows
IMAGENET_LANDMARKS = {0: "tench", 1: "goldfish", 151: "chihuahua", 281: "tabby", 409: "analog clock",
                      530: "digital clock", 999: "toilet tissue"}
PLACEHOLDER = re.compile(r"LABEL_(\d+)$")  # transformers' label of a config that names none
WEIGHTS_FILES = ("*.safetensors", "pytorch_model*.bin")
PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes, as image processors store `resample`


class Logits(nn.Module):
    """A transformers classifier as a plain one: pixel values in, `outputs.logits` out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def _transformers():
    try:
        import transformers  # noqa: PLC0415 (an optional extra)
    except ImportError:
        raise UserError(f"{HF_PREFIX} models need transformers, which is not installed; {INSTALL_HINT}") from None
    return transformers


def _fetch_command(repo: str) -> str:
    return f"python -c \"from huggingface_hub import snapshot_download; snapshot_download('{repo}')\""


def _config(transformers, name: str, what: str) -> dict:
    """The model's config.json as a dict, read without running any of its code."""
    try:
        config, _ = transformers.PretrainedConfig.get_config_dict(name)
    except OSError as exc:
        if Path(name).expanduser().exists():
            raise UserError(f"{what}: {first_line(exc)}") from None
        raise UserError(hub.not_cached_line(what, _fetch_command(name), first_line(exc))) from None
    if config.get("auto_map"):
        raise UserError(f"{what} needs its own remote code (its config's auto_map names "
                        f"{', '.join(sorted(config['auto_map']))}); this toolkit runs no remote code "
                        f"(trust_remote_code stays off): export the model yourself (torch.export or TorchScript) "
                        f"and pass the file with --checkpoint")
    return config


def check_labels(id2label: dict, what: str) -> str:
    """What the labels say the head is ("ImageNet" or "IN-9"), or one line refusing it."""
    labels = [str(id2label[i]) if i in id2label else str(id2label.get(str(i), "")) for i in range(len(id2label))]
    placeholders = all((m := PLACEHOLDER.match(label)) and int(m.group(1)) == i for i, label in enumerate(labels))
    if len(labels) == NUM_IMAGENET_CLASSES:
        if placeholders:
            log.info("%s: its 1000 labels are placeholders (LABEL_0 ...): taken in ImageNet's class order", what)
            return "ImageNet"
        wrong = [i for i, lemma in IMAGENET_LANDMARKS.items() if labels[i].split(",")[0].strip().lower() != lemma]
        if wrong:
            i = wrong[0]
            raise UserError(f"{what} has 1000 labels that are not ImageNet's in ImageNet's order (label {i} is "
                            f"{labels[i]!r}, ImageNet's class {i} is {IMAGENET_LANDMARKS[i]!r})")
        return "ImageNet"
    if len(labels) == NUM_IN9_CLASSES:
        if placeholders:
            log.info("%s: its 9 labels are placeholders (LABEL_0 ...): taken in IN-9's class order", what)
            return "IN-9"
        wrong = [i for i, label in enumerate(labels) if class_of_folder(label) != i]
        if wrong:
            raise UserError(f"{what} has 9 labels that are not IN-9's in IN-9's order ({', '.join(labels)}; "
                            f"IN-9's: {', '.join(class_names())})")
        return "IN-9"
    raise UserError(f"{what} has {len(labels)} labels; the toolkit evaluates 1000-label ImageNet heads and "
                    f"9-label IN-9 heads")


def _processor_settings(transformers, name: str, config: dict, what: str):
    """(mean, std) or None, the input size and the resize mode, from the model's image processor."""
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        size = config.get("image_size", IMAGE_SIZE)
        log.info("%s has no image processor (%s): the class-count rule's mean/std, %s inputs", what, first_line(exc),
                 size)
        return None, (size, size) if isinstance(size, int) else tuple(size), "bicubic"
    stats = (processor.image_mean, processor.image_std) if getattr(processor, "do_normalize", True) else None
    crop = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    size = dict(crop or getattr(processor, "size", None) or {})
    if "height" in size:
        shape = (size["height"], size["width"])
    else:
        edge = size.get("shortest_edge", IMAGE_SIZE)
        shape = (edge, edge)
    resample = getattr(processor, "resample", None)
    mode = PIL_RESAMPLE.get(int(getattr(resample, "value", resample)) if resample is not None else 3, "bicubic")
    return stats, shape, mode


def _weights_files(folder: Path) -> list[Path]:
    for pattern in WEIGHTS_FILES:
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def load_transformers(name: str, normalize: Normalization, runtime=None) -> LoadedModel:
    """`hf:` + `name`: a local save_pretrained folder, else a hub repository (its cache, HF_HUB_OFFLINE honoured)."""
    transformers = _transformers()
    what = f"{HF_PREFIX}{name}"
    local = Path(name).expanduser()
    source = str(local) if local.is_dir() else name
    config = _config(transformers, source, what)
    kind = check_labels({int(k): v for k, v in (config.get("id2label") or {}).items()}
                        or {i: f"LABEL_{i}" for i in range(config.get("num_labels", 2))}, what)
    try:
        model = transformers.AutoModelForImageClassification.from_pretrained(source, trust_remote_code=False,
                                                                             weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as exc:
        raise UserError(f"cannot load {what} safely (safetensors or weights_only unpickling): "
                        f"{first_line(exc)}") from None
    model.eval()
    folder = local if local.is_dir() else hub.cached_file(name, ["config.json"]).parent
    files = _weights_files(folder)
    stats, size, mode = _processor_settings(transformers, source, config, what)
    revision = None if local.is_dir() else hub.snapshot_revision(folder / "config.json")
    origin = ModelOrigin(what, revision, str(files[0] if len(files) == 1 else folder),
                         hub.files_digest(files) if files else None,
                         f"transformers {type(model).__name__} ({kind} labels)")
    classifier = fit_input_size(Logits(model), size, what, mode, runtime)
    return wrap(classifier, num_classes=model.config.num_labels, normalize=normalize, origin=origin, stats=stats,
                stats_origin="image processor")
