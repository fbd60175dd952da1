"""Hugging Face transformers image classifiers (the `hf:ORG/NAME[@REVISION]` and `hf:PATH` source, extra [hf]).

Loaded in float32 without remote code unless `--trust-remote-code`, weights as safetensors or `weights_only`. What the
image processor does to pixels is measured on probe images (`pixel_map`): a per-channel affine map and a channel order,
taken into the model; anything else is refused. The labels decide the head (`check_labels`): 1000 ImageNet labels
(checked at `IMAGENET_LANDMARKS`) or 9 IN-9 ones, placeholders (LABEL_0 ...) taken in order; any other is refused. See
docs/zoo.md.
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tools.errors import UserError, error_summary, first_line, option, optional_module
from tools.in9 import IMAGE_SIZE, NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization, class_names, class_of_folder
from tools.models import adapters, hub
from tools.models.architectures import recorded_arguments
from tools.models.boundary import LoadedModel, ModelOrigin, fit_input_size, wrap
from tools.models.record import ModelRecord
from tools.models.spec import HF_PREFIX, TIMM_PREFIX
from tools.provenance import read_json

log = logging.getLogger(__name__)

# ImageNet class index -> its first WordNet lemma, where a wrong order or another 1000-class label set shows
IMAGENET_LANDMARKS = {0: "tench", 1: "goldfish", 151: "chihuahua", 281: "tabby", 409: "analog clock",
                      530: "digital clock", 999: "toilet tissue"}
PLACEHOLDER = re.compile(r"LABEL_(\d+)$")  # transformers' label of a config that names none
WEIGHTS_FILES = (("model.safetensors", "model.safetensors.index.json"),  # (one file, a sharded one's index)
                 ("pytorch_model.bin", "pytorch_model.bin.index.json"))
PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes, as image processors store `resample`
PROCESSOR_FILE = "preprocessor_config.json"
REMOTE_CODE_FLAG = "--trust-remote-code"
TIMM_WRAPPER = "timm_wrapper"  # the model_type of transformers' wrapper of a timm model
# The attention implementations a config may ask for: transformers' own, which the exact forward runs on torch's
# math backend (sdpa) or as plain operations (eager). Others are a library's kernels, a torch.compile'd one, or, for
# an `org/repo` name, compiled code that transformers downloads from the Hub and loads (with `kernels` installed).
ATTENTION_IMPLEMENTATIONS = (None, "eager", "sdpa")
ATTENTION_SETTINGS = ("attn_implementation", "_attn_implementation")  # what a config.json may set it as
PROBE_TOLERANCE = 1e-4  # how far a processor's output may be from the affine map measured on the probes


class Logits(nn.Module):
    """A transformers classifier as a plain one: pixels in (channels as its processor orders them), logits out."""

    def __init__(self, model: nn.Module, channel_order: tuple[int, ...] = (0, 1, 2)):
        super().__init__()
        self.model = model
        self.channel_order = tuple(channel_order)

    def forward(self, x):
        if self.channel_order != (0, 1, 2):
            x = x[:, list(self.channel_order)]
        return self.model(pixel_values=x).logits


def _transformers():
    return optional_module("transformers", f"an {HF_PREFIX} model", "transformers", "hf")


def check_remote_code(config: dict, what: str, trust_remote_code: bool) -> None:
    """One line refusing a config's own code unless trusted; another repository's code is refused either way (it would
    not be in the model's record)."""
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    if not trust_remote_code:
        raise UserError(f"{what} needs its own remote code (auto_map names {', '.join(sorted(auto_map))}); "
                        f"it runs only with {option(REMOTE_CODE_FLAG)}, for a model whose code you trust")
    references = [ref for value in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])
                  for ref in (value if isinstance(value, (list, tuple)) else [value]) if ref is not None]
    elsewhere = sorted({ref.split("--")[0] for ref in references if isinstance(ref, str) and "--" in ref})
    if elsewhere:
        raise UserError(f"{what}: its auto_map takes code from other repositories ({', '.join(elsewhere)}), which "
                        f"would not be recorded in the model's identity; copy that code into the model's folder")
    for reference in references:
        module = str(reference).rpartition(".")[0]
        if not isinstance(reference, str) or not module or not hub.inside_folder(module):
            raise UserError(f"{what}: its auto_map names {reference!r}, not a module of the model's folder "
                            f"(module.Class); fix the config")


def check_timm_wrapper(config: dict, what: str) -> None:
    """One line refusing a timm_wrapper config that would make timm read a folder or the Hub, or load weights, before
    transformers runs `timm.create_model`."""
    if config.get("model_type") != TIMM_WRAPPER:
        return
    architecture = config.get("architecture")
    if not isinstance(architecture, str) or not architecture or ":" in architecture:
        raise UserError(f"{what}: its config.json's architecture is {architecture!r}, not a timm model name (timm "
                        f"would read it from a folder or the Hub); fix the file or re-save the model")
    recorded_arguments(f"{TIMM_PREFIX}{architecture}", config.get("model_args") or {}, f"{what}'s config.json")


def check_attention(config: dict, what: str) -> None:
    """One line refusing a (sub-)config asking for attention other than `ATTENTION_IMPLEMENTATIONS`."""
    pending = [config]
    while pending:  # a config nests as deep as the JSON parser goes: no recursion here
        settings = pending.pop()
        for key, value in settings.items():
            asked = list(value.values()) if key in ATTENTION_SETTINGS and isinstance(value, dict) else [value]
            other = [v for v in asked if v not in ATTENTION_IMPLEMENTATIONS] if key in ATTENTION_SETTINGS else []
            if other:
                raise UserError(f"{what}: its config.json asks for attention {other[0]!r:.80} ({key}); the toolkit "
                                f"runs transformers' own eager or sdpa attention, exact and repeatable (an ORG/NAME "
                                f"there is compiled code from the Hub): remove {key} from the file")
            if isinstance(value, dict):
                pending.append(value)


def _config(transformers, name: str, revision: str | None, what: str, trust_remote_code: bool) -> dict:
    """The model's config.json as a dict, read without running any of its code."""
    try:
        config, _ = transformers.PretrainedConfig.get_config_dict(name, revision=revision)
    except RecursionError:
        raise UserError(f"{what}: its config.json is JSON nested deeper than it can be read; fix the file or re-save "
                        f"the model with save_pretrained") from None
    except OSError as exc:
        if Path(name).expanduser().exists():
            raise UserError(f"{what}: {first_line(exc)}") from None
        raise UserError(hub.not_cached_line(what, hub.snapshot_command(name), first_line(exc))) from None
    if not isinstance(config, dict):
        raise UserError(f"{what}: its config.json holds a {type(config).__name__}, not an object of settings: "
                        f"re-save the model with save_pretrained")
    check_remote_code(config, what, trust_remote_code)
    check_timm_wrapper(config, what)
    check_attention(config, what)
    return config


def _id2label(config: dict, what: str) -> dict[int, str]:
    """The config's labels by class index (transformers' placeholders when it names none), or one line."""
    num_labels = config.get("num_labels", 2)
    if not config.get("id2label") and not (isinstance(num_labels, int) and not isinstance(num_labels, bool)
                                           and num_labels > 0):
        raise UserError(f"{what}: its config.json's num_labels is {num_labels!r}, not a whole number of classes; "
                        f"fix the file or re-save the model with save_pretrained")
    id2label = config.get("id2label") or {i: f"LABEL_{i}" for i in range(num_labels)}
    try:
        return {int(k): v for k, v in id2label.items()}
    except (AttributeError, TypeError, ValueError):
        raise UserError(f"{what}: its config.json's id2label must map class numbers to names ({{\"0\": \"tench\", "
                        f"...}}); fix the file or re-save the model with save_pretrained") from None


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


def _processor_shape(processor, what: str) -> tuple[int, int]:
    crop = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    size = dict(crop or getattr(processor, "size", None) or {})
    if "height" in size:
        return _input_shape([size["height"], size.get("width")], f"{what}'s {PROCESSOR_FILE} size")
    return _input_shape(size.get("shortest_edge", IMAGE_SIZE), f"{what}'s {PROCESSOR_FILE} shortest_edge")


def _input_shape(size, what: str) -> tuple[int, int]:
    """(height, width) from a config's size: a number of pixels, or [height, width]; else one line."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0
    if whole(size):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(whole(v) for v in size):
        return int(size[0]), int(size[1])
    raise UserError(f"{what} is {size!r}, not an image size (a number of pixels, or [height, width]); fix the file "
                    f"or re-save the model with save_pretrained")


def _resample_mode(resample, what: str) -> str:
    """The interpolation of a processor's PIL `resample` (2 bilinear, else bicubic); else one line."""
    code = getattr(resample, "value", resample)
    if code is None:
        return "bicubic"
    if not isinstance(code, int) or isinstance(code, bool):
        raise UserError(f"{what}'s {PROCESSOR_FILE} has resample {code!r}, not PIL's code of a resampling filter "
                        f"(2 for bilinear, 3 for bicubic); fix the file or re-save the processor with save_pretrained")
    return PIL_RESAMPLE.get(code, "bicubic")


def pixel_map(processor, shape: tuple[int, int], what: str):
    """(mean, std, channel order) such that the processor's output channel k, with resizing and cropping off, is
    (x[order[k]] - mean[order[k]]) / std[order[k]] for x in [0, 1]; measured on probe images, checked on a random one;
    any other processing is refused in one line."""
    height, width = shape
    probes = [np.zeros((height, width, 3), np.uint8)]
    for channel in range(3):
        probes.append(probes[0].copy())
        probes[-1][..., channel] = 255
    probes.append(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
    try:
        out = processor(images=probes, return_tensors="pt", do_resize=False, do_center_crop=False)["pixel_values"]
    except Exception as exc:  # noqa: BLE001 (a processor's own errors: it cannot be measured)
        raise UserError(f"{what}: cannot run its image processor {type(processor).__name__} on probe images "
                        f"({error_summary(exc, lines=1)})") from None
    out = out.to(torch.float64)
    if tuple(out.shape) != (len(probes), 3, height, width):
        raise UserError(f"{what}: its image processor {type(processor).__name__} turns {height}x{width} RGB images "
                        f"into {tuple(out.shape[1:])} with resizing and cropping off; the toolkit cannot take that in")
    offset = out[0].mean(dim=(1, 2))
    gains = torch.stack([out[1 + c].mean(dim=(1, 2)) - offset for c in range(3)], dim=1)  # [output k, input c]
    order = tuple(int(c) for c in gains.abs().argmax(dim=1))
    scale = torch.stack([gains[k, order[k]] for k in range(3)])
    x = torch.as_tensor(probes[-1], dtype=torch.float64).permute(2, 0, 1) / 255
    predicted = x[list(order)] * scale.reshape(3, 1, 1) + offset.reshape(3, 1, 1)  # x in [0, 1]
    if sorted(order) != [0, 1, 2] or (scale <= 0).any() or (predicted - out[-1]).abs().max() > PROBE_TOLERANCE * \
            max(1.0, float(out[-1].abs().max())):
        raise UserError(f"{what}: its image processor {type(processor).__name__} does more to the pixels than a "
                        f"per-channel scale, shift and channel order; the toolkit cannot take that into the model")
    mean, std = [0.0] * 3, [1.0] * 3
    for k, c in enumerate(order):
        std[c] = float(1 / scale[k])
        mean[c] = float(-offset[k] / scale[k])
    return tuple(mean), tuple(std), order


def _processor_file(transformers, source: str, revision: str | None) -> Path | None:
    """The model's image processor config, where transformers finds it; None without one."""
    found = transformers.utils.cached_file(source, PROCESSOR_FILE, revision=revision,
                                           _raise_exceptions_for_missing_entries=False)
    return None if found is None else Path(found)


def _processor_settings(transformers, source: str, revision: str | None, config: dict, found: Path | None,
                        what: str, trust_remote_code: bool):
    """(mean, std) or None, channel order, input size and resize mode from the processor config `found`; without one,
    the class-count rule (warned) and the config's image size."""
    if found is None:
        shape = _input_shape(config.get("image_size", IMAGE_SIZE), f"{what}'s config.json image_size")
        log.warning("%s has no %s: normalised with the class-count rule's mean/std, %dx%d inputs", what,
                    PROCESSOR_FILE, *shape)
        return None, (0, 1, 2), shape, "bicubic"
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(source, revision=revision,
                                                                    trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 (transformers' errors for an unknown or broken processor)
        raise UserError(f"{what}: cannot load its image processor from {PROCESSOR_FILE} "
                        f"({error_summary(exc, lines=1)})") from None
    shape = _processor_shape(processor, what)
    mean, std, order = pixel_map(processor, shape, what)
    return (mean, std), order, shape, _resample_mode(getattr(processor, "resample", None), what)


def _json(path: Path) -> dict:
    try:
        return read_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {first_line(exc)}") from None


def _weights_files(folder: Path) -> list[Path]:
    """The files transformers loads the weights from, in its order (one file, else its index's shards), each inside the
    model's folder (through links too: `hub.files_root`)."""
    root = hub.files_root(folder)
    for single, index in WEIGHTS_FILES:
        if (folder / single).is_file():
            if not (folder / single).resolve().is_relative_to(root):
                raise UserError(f"{folder / single} links to {(folder / single).resolve()}, a file outside the "
                                f"model's folder; the weights of a model are a file of its folder: copy it there")
            return [folder / single]
        if (folder / index).is_file():
            weight_map = _json(folder / index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
                raise UserError(f"{folder / index} has no weight_map of file names: re-save the model with "
                                f"save_pretrained")
            for name in sorted(set(weight_map.values())):
                if not hub.inside_folder(name) or not (folder / name).resolve().is_relative_to(root):
                    raise UserError(f"{folder / index} names {name!r}, a file outside the model's folder; the "
                                    f"shards of a model are files of its folder: fix the index or re-save the "
                                    f"model with save_pretrained")
            return sorted({folder / name for name in weight_map.values()})
    return []


def _record_inputs(record: ModelRecord, files: list[Path], folder: Path, processor_file: Path | None,
                   code: list[Path], adapter: list[Path], pixels: dict) -> None:
    """Record the weights, config, processor and pixel map, shipped code, an adapter and the libraries."""
    record.library(_transformers())
    if len(files) == 1:
        record.read_file(files[0], "weights")
    elif files:
        index = [folder / index for _, index in WEIGHTS_FILES if (folder / index).is_file()][:1]
        record.read_files(files + index, "weights", folder)
    record.read_file(folder / "config.json", "config.json")
    if processor_file is not None:
        record.read_file(processor_file, PROCESSOR_FILE)
    if code:
        record.read_files(code, "remote code", folder)
    if adapter:
        record.library(adapters.peft_module(f"the adapter in {folder}"))
        record.read_files(adapter, "folder's adapter", folder)
    record.setting("pixels", pixels)


def _adapter_files(model: nn.Module, folder: Path) -> list[Path]:
    """The config and weights of the peft adapter transformers put on the model from `folder`."""
    if not getattr(model, "_hf_peft_config_loaded", False):
        return []
    weights = [folder / name for name in adapters.ADAPTER_WEIGHTS if (folder / name).is_file()][:1]
    return [folder / adapters.ADAPTER_CONFIG, *weights]


def remote_code_files(folder: Path, *configs: dict) -> list[Path]:
    """The Python files of the model's folder, which transformers copies and imports a shipped auto_map's code from."""
    if not any(config.get("auto_map") for config in configs):
        return []
    return sorted(path for path in folder.rglob("*.py") if path.is_file())


def load_transformers(name: str, normalize: Normalization, record: ModelRecord, runtime=None,
                      trust_remote_code: bool = False) -> LoadedModel:
    """`hf:` + `name`: a save_pretrained folder, else a cached hub repository, recorded in `record`."""
    transformers = _transformers()
    what = f"{HF_PREFIX}{name}"
    local = Path(name).expanduser()
    source, revision = (str(local), None) if local.is_dir() else hub.split_revision(name)
    config = _config(transformers, source, revision, what, trust_remote_code)
    kind = check_labels(_id2label(config, what), what)
    folder = local if local.is_dir() else hub.cached_file(name, ["config.json"]).parent
    files = _weights_files(folder)  # checked before transformers reads them
    if (folder / adapters.ADAPTER_CONFIG).exists():  # transformers would put the adapter on the model
        adapters.check_adapter_files(folder)
    processor_file = _processor_file(transformers, source, revision)
    processor_config = _json(processor_file) if processor_file is not None else {}
    check_remote_code(processor_config, f"{what}'s image processor", trust_remote_code)
    try:
        model = transformers.AutoModelForImageClassification.from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code, weights_only=True, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 (transformers validates a config and reads weights with errors of many types)
        # SafetensorError: a file whose header misdescribes it (offsets or shapes the bytes do not hold)
        safetensors = optional_module("safetensors", "an hf: model", "safetensors", "hf")
        if isinstance(exc, (pickle.UnpicklingError, safetensors.SafetensorError)):
            raise UserError(f"cannot load {what} safely (safetensors or weights_only unpickling): "
                            f"{error_summary(exc, lines=1)}") from None
        if isinstance(exc, (ImportError, AttributeError)) and config.get("auto_map"):  # trusted code not there
            raise UserError(f"cannot load {what}: its code ({', '.join(sorted(config['auto_map']))}) does not "
                            f"load: {first_line(exc)}") from None
        raise UserError(f"cannot load {what}: {error_summary(exc)}; fix its config.json or re-save the model with "
                        f"save_pretrained") from None
    model.eval()
    stats, order, size, mode = _processor_settings(transformers, source, revision, config, processor_file, what,
                                                   trust_remote_code)
    _record_inputs(record, files, folder, processor_file, remote_code_files(folder, config, processor_config),
                   _adapter_files(model, folder), {"stats": stats, "order": order, "size": size, "resample": mode})
    revision = None if local.is_dir() else hub.snapshot_revision(folder / "config.json")
    origin = ModelOrigin(what, revision, str(files[0] if len(files) == 1 else folder),
                         f"transformers {type(model).__name__} ({kind} labels)")
    classifier = fit_input_size(Logits(model, order), size, what, mode, runtime)
    order_text = "" if order == (0, 1, 2) else f", channels reordered {order}"
    return wrap(classifier, num_classes=model.config.num_labels, normalize=normalize, origin=origin, record=record,
                stats=stats, stats_origin=f"image processor{order_text}")
