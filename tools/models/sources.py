"""Where models come from: a registry of sources chosen by a model name's prefix (`tools.models.spec`).

A source is one function `(name, options, record) -> LoadedModel`, registered with `@register_source("prefix:")`; it
records every file it reads and setting it resolves in `record` and hands it to `wrap`. `load_model` records what it was
given first, so the identity holds every input of the loader but those `NOT_IN_IDENTITY` lists, each with its reason.
The sources: docs/how-it-works.md, "Models and checkpoints", and docs/zoo.md; adding one: docs/extending.md.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib
import logging
import os
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tools.cli import closest
from tools.errors import UserError, first_line, import_torchvision, option
from tools.in9 import NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization
from tools.models import adapters, checkpoints
from tools.models.architectures import (
    ARCHITECTURES,
    DEFAULT_ARCH,
    architecture_family,
    build_with_weights,
    check_torchvision_architecture,
    close_matches,
    torchvision_module,
    torchvision_weights_arguments,
)
from tools.models.boundary import InputResize, LoadedModel, ModelOrigin, fit_input_size, wrap
from tools.models.loading import read_problem
from tools.models.record import ModelRecord
from tools.models.spec import CLIP_PREFIX, FILE_PREFIX, HF_PREFIX, TIMM_PREFIX, TOOLKIT_PREFIX, ModelSpec

if TYPE_CHECKING:
    from tools.data.store import DecodedCache
    from tools.runtime import Runtime

log = logging.getLogger(__name__)

PUBLISHED_WEIGHTS = "IMAGENET1K_V1"  # the weights the paper's numbers used, where an architecture has them


@dataclass(frozen=True)
class ModelOptions:
    """What the command line says about the model besides its name."""

    weights: str | None = None
    checkpoint: Path | None = None
    in9: bool | None = None
    normalize: Normalization = Normalization.AUTO
    trust: bool = False
    checkpoint_key: str | None = None
    arch: str | None = None  # the architecture a checkpoint's weights go into
    lora: adapters.LoraScaling = adapters.LoraScaling()  # the LoRA scaling of a peft-wrapped model's state dict
    runtime: Runtime | None = None  # where a source computes what it builds at load time (CLIP's text head)
    progress: bool = False  # a progress bar for such work
    trust_remote_code: bool = False  # run the code a hub model ships (--trust-remote-code)
    cache: DecodedCache | None = None  # where what is computed at load time is kept by content (CLIP's text heads)

    @property
    def device(self) -> torch.device:
        """Where load-time work runs and a program is loaded for: the runtime's device, else the CPU."""
        return self.runtime.device if self.runtime is not None else torch.device("cpu")


# What reaches the loader (load_model's parameters, the fields of ModelOptions) but not the model's identity, and
# why it cannot change the logits; every other input is in the model's record (tests/test_models_record.py).
NOT_IN_IDENTITY = {
    "in9": "a check of the model's class count: it refuses a model, never changes one",
    "trust": "lets a checkpoint unpickle fully: a file that loads either way loads the same objects, and what it "
             "loads is recorded (the file, a pickled module's code)",
    "trust_remote_code": "lets the code an hf: model ships run, or refuses the model: that code is recorded by content",
    "runtime": "where load-time work runs; what that work computes is recorded (CLIP's text head), and the device "
               "is the run's own, in its provenance",
    "progress": "shows a progress bar for load-time work and nothing else",
    "lora_options": "how the caller's messages name the LoRA scaling's flags or keywords",
    "lora": "the LoRA scaling, made of lora_alpha and lora_rslora, which are recorded, and lora_options",
    "cache": "where load-time work is kept for later loads, keyed by all its inputs (CLIP's text heads); what that "
             "work gives is recorded",
}

Source = Callable[[str, ModelOptions, ModelRecord], LoadedModel]
SOURCES: dict[str, Source] = {}


def register_source(prefix: str) -> Callable[[Source], Source]:
    """Register `fn(name, options, record) -> LoadedModel` for model names starting with `prefix` ("" for none)."""
    def register(fn: Source) -> Source:
        SOURCES[prefix] = fn
        return fn
    return register


def load_model(arch: str | None = None, weights: str | None = None, checkpoint: Path | str | None = None,
               in9: bool | None = None, normalize: Normalization = Normalization.AUTO, trust: bool = False,
               checkpoint_key: str | None = None, runtime: Runtime | None = None,
               progress: bool = False, lora_alpha: float | None = None, lora_rslora: bool = False,
               lora_options: tuple[str, str] | None = adapters.CLI_LORA_OPTIONS,
               trust_remote_code: bool = False, cache: DecodedCache | None = None) -> LoadedModel:
    """The model the command line describes, wrapped to take pixels, with the record of every input
    (`LoadedModel.record`; its digest is `LoadedModel.identity`).

    arch: a model name (`tools.models.spec`; default resnet50); with a checkpoint (`checkpoint` or the name's
    `@file:PATH`), the architecture its weights go into. in9: True, False, or None to follow the class count. runtime:
    where load-time work runs (default the CPU). The model is returned on the CPU, except a TorchScript or export
    program, loaded for and probed on the runtime's device. A peft adapter folder is merged into the module its source
    loaded. lora_alpha, lora_rslora: a peft-wrapped state dict's LoRA scaling; lora_options: how messages name them.
    trust_remote_code: run the code an `hf:` model ships (off: refused). cache: where load-time work is kept by content
    (CLIP's text heads; None: neither read nor written)."""
    import_torchvision()  # every model library imports it: one that does not match torch is said here, in one line
    lora = adapters.LoraScaling(lora_alpha, lora_rslora, lora_options)
    spec = ModelSpec.parse(arch or DEFAULT_ARCH)
    record = ModelRecord()
    # what the loader is given, as given (the name less the files it names, which are recorded by content where
    # they are read, as `checkpoint` is)
    record.setting("arch", _recorded_name(spec) if arch else None)
    for name, value in (("weights", weights), ("checkpoint_key", checkpoint_key), ("normalize", normalize),
                        ("lora_alpha", lora_alpha), ("lora_rslora", lora_rslora)):
        record.setting(name, value)
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    adapter = spec.adapter_path
    if checkpoint is not None and spec.file is not None and adapter is None and adapters.is_adapter_folder(checkpoint):
        adapter, checkpoint = checkpoint, None  # --arch ARCH@file:BASE --checkpoint ADAPTER_DIR
    if spec.file is not None:
        if checkpoint is not None:
            raise UserError(f"{option('--arch', spec)} and {option('--checkpoint')} both name a checkpoint file; pass "
                            f"one of them")
        checkpoint = spec.path
    if adapter is None and checkpoint is not None and adapters.is_adapter_folder(checkpoint):
        adapter, checkpoint = checkpoint, None  # the adapter goes on ARCH's pretrained weights
    if adapter is not None and (spec.model is None or not arch):
        raise UserError(f"{adapter} is a peft adapter folder, which goes on a base model: name it with "
                        f"{option('--arch', f'ARCH@file:{adapter}')}, or ARCH@file:BASE@file:{adapter} "
                        f"for base weights from the checkpoint BASE")
    if lora.given() and (checkpoint is None or adapter is not None):
        raise lora.misplaced("given as a checkpoint (an adapter folder's config holds its scaling)")
    names_architecture = spec.prefix in ARCHITECTURES and spec.model is not None
    options = ModelOptions(weights, checkpoint, in9, normalize, trust, checkpoint_key,
                           spec.model if names_architecture and arch else None, lora, runtime, progress,
                           trust_remote_code, cache)
    # a checkpoint goes into an architecture that is built without weights, or is a whole model (file:); a model
    # whose weights come from its own source (hf:, clip:) refuses it, however it is named
    if checkpoint is not None and (names_architecture or spec.model is None):
        loaded = SOURCES[FILE_PREFIX](str(checkpoint), options, record)
    else:
        source = SOURCES.get(spec.prefix)
        if source is None:
            raise UserError(f"unknown model source {spec.prefix!r} in {str(spec)!r}{closest(spec.prefix, SOURCES)}; "
                            f"valid: {', '.join(repr(p) for p in SOURCES)}")
        loaded = source(spec.body, options, record)
    if adapter is not None:
        loaded = _with_adapter(loaded, adapter, trust)
    if loaded.record is not record:
        raise RuntimeError(f"the source of {spec} did not record its model in the record it was given")
    record.close()
    return loaded


def _recorded_name(spec: ModelSpec) -> str | None:
    """The model's name as its identity holds it: an `hf:` model's is its files (recorded by content)."""
    return f"{HF_PREFIX}(its files)" if spec.prefix == HF_PREFIX else spec.model


def _with_adapter(base: LoadedModel, folder: Path, trust: bool) -> LoadedModel:
    """The base model with the folder's peft adapter merged into the module its source loaded, recorded."""
    owner, attribute = _innermost(base.model, "classifier")

    def place(module: nn.Module) -> nn.Module:
        setattr(owner, attribute, module)
        return base.model.classifier

    merged = adapters.merge_adapter_folder(getattr(owner, attribute), folder, trust, base.record, place)
    place(merged.classifier.eval())
    return dataclasses.replace(base, source=f"{base.source} + {folder}",
                               checkpoint_format=f"{base.checkpoint_format} + peft {merged.kind} adapter (merged)")


def _innermost(owner: nn.Module, attribute: str) -> tuple[nn.Module, str]:
    """(owner, attribute) of the module a source loaded, past the toolkit's wrappers."""
    from tools.models.clip import ZeroShotClassifier  # noqa: PLC0415 (the sources' modules import this one)
    from tools.models.hf import Logits  # noqa: PLC0415
    wrapped = {InputResize: "classifier", Logits: "model", ZeroShotClassifier: "visual"}
    while type(getattr(owner, attribute)) in wrapped:
        owner, attribute = getattr(owner, attribute), wrapped[type(getattr(owner, attribute))]
    return owner, attribute


# ----------------------------------------------------------------------------------------------------------
# The sources

def resolve_weights(arch: str, name: str | None):
    """The torchvision weights enum member for `--weights` (default: the published IMAGENET1K_V1)."""
    check_torchvision_architecture(arch)
    tv = torchvision_module()
    try:
        enum = tv.models.get_model_weights(arch)
    except (ValueError, KeyError):
        raise UserError(f"architecture {arch!r} has no torchvision pretrained weights; pass "
                        f"{option('--checkpoint', 'PATH')}") from None
    members = [m for m in enum.__members__ if m != "DEFAULT"]
    if name is None:
        name = PUBLISHED_WEIGHTS if PUBLISHED_WEIGHTS in members else "DEFAULT"
        log.info("using %s weights %s (the published numbers used IMAGENET1K_V1)", arch, name)
    short = name.split(".")[-1]
    if short != "DEFAULT" and short not in members:
        raise UserError(f"unknown weights {name!r} for {arch}{close_matches(short, members)}; "
                        f"valid: {', '.join(members + ['DEFAULT'])}")
    if enum[short].meta.get("categories") is None:  # torchvision's mark of weights that cannot classify
        classifying = [m for m in members if enum[m].meta.get("categories") is not None]
        raise UserError(f"{arch}'s {short} weights have no classifier (torchvision ships only their features: the "
                        f"classifier's weights are not values, so every prediction would be the same); pass "
                        f"{' or '.join(option('--weights', m) for m in classifying)}")
    return enum[short]


def _download_weights(weights, record: ModelRecord) -> tuple[dict, str]:
    """The weights' state dict and the file it was read from (torch's hub cache), recorded as the weights.

    Downloaded here, not by torch, so torch's download line never mixes with the results (stdout on newer torch); a file
    already cached (perhaps put there by hand) is held to the hash in its name too: another file under that name would
    silently change every number."""
    url = weights.url
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    named_hash = torch.hub.HASH_REGEX.search(path.name)  # torch's rule: "-<hex>." starts the file's SHA-256
    prefix = named_hash.group(1) if named_hash else None
    if not path.exists():
        log.info("downloading %s to %s", url, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(url, str(path), hash_prefix=prefix, progress=True)
        except (urllib.error.URLError, http.client.HTTPException, OSError, RuntimeError) as exc:
            # RuntimeError: torch's hash check (a proxy's error page served as the file); torch removes the file
            raise UserError(f"cannot download {url} ({first_line(getattr(exc, 'reason', exc))}); offline, fetch "
                            f"that file elsewhere and put it at {path} (set TORCH_HOME to move "
                            f"{path.parent.parent.parent})") from None
    if not path.is_file():
        raise UserError(f"{path} is not a file; remove it and rerun to download {url}")
    digest = record.read_file(path, "weights")
    if prefix is not None and not digest.startswith(prefix):
        raise UserError(f"{path} is not the file {url} names: its SHA-256 starts {digest[:len(prefix)]}, not "
                        f"{prefix}; delete it and rerun (or put the right file there)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (a damaged file fails anywhere in torch's readers)
        raise UserError(f"cannot read {path} ({read_problem(exc)}); delete it and rerun") from None
    return state, str(path)


@register_source("")
def torchvision_pretrained(name: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """A torchvision architecture with its pretrained ImageNet weights (default: the published IMAGENET1K_V1)."""
    if options.in9:
        raise UserError(f"{option('--in9')} needs {option('--checkpoint', 'PATH')}: there are no pretrained 9-class "
                        f"weights to download")
    member = resolve_weights(name, options.weights)
    weights_name = record.setting("torchvision weights", f"{type(member).__name__}.{member.name}")
    record.library(torchvision_module())
    state, source = _download_weights(member, record)
    classifier = build_with_weights(name, member, state)
    size, mode, mean, std = weights_pipeline(member)
    # what the weights' transforms give the model: its input size, interpolation and statistics
    record.setting("torchvision pipeline", {"input_size": list(size), "interpolation": mode, "mean": list(mean),
                                            "std": list(std)})
    classifier = fit_input_size(classifier, size, f"{name} with {weights_name}", mode, options.runtime)
    model = wrap(classifier, num_classes=NUM_IMAGENET_CLASSES, normalize=options.normalize, stats=(mean, std),
                 stats_origin="the weights' transforms", record=record,
                 origin=ModelOrigin(name, weights_name, source, "torchvision weights"))
    arch_args = torchvision_weights_arguments(member)
    if arch_args:
        model.details["arch_args"] = arch_args
    return model


def weights_pipeline(weights) -> tuple[tuple[int, int], str, list[float], list[float]]:
    """(input size, interpolation, mean, std) of torchvision weights, from their transforms."""
    transforms = weights.transforms()
    crop = [int(v) for v in transforms.crop_size]
    size = (crop[0], crop[-1])
    return size, transforms.interpolation.value, list(transforms.mean), list(transforms.std)


@register_source(TIMM_PREFIX)
def timm_pretrained(name: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """timm models with timm's pretrained weights (timm:NAME[.TAG], timm:hf-hub:ORG/NAME; tools.models.timm_weights;
    --weights none: random weights)."""
    from tools.models.timm_weights import load_timm  # noqa: PLC0415 (timm, an optional extra, is imported there)
    return load_timm(name, options.weights, options.in9, options.normalize, record, options.runtime)


@register_source(FILE_PREFIX)
def checkpoint_file(path: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """A checkpoint file: a TorchScript or export program as it is, or a state dict loaded into --arch."""
    if options.weights is not None:
        raise UserError(f"{option('--weights')} and {option('--checkpoint')} both give the model's weights; pass one "
                        f"of them")
    loaded = checkpoints.read_checkpoint(Path(path), options.arch, options.in9, options.normalize, options.trust,
                                         options.checkpoint_key, options.device, record, options.lora)
    if options.in9 is None and loaded.num_classes == NUM_IN9_CLASSES:
        log.info("the checkpoint has 9 classes: evaluating as an IN-9 model (as with %s)", option("--in9"))
    record.setting("checkpoint layout", loaded.layout)  # where in the file the weights were, read how
    record.setting("architecture", loaded.arch)  # as named, recorded in the file, or the default
    if loaded.arch is not None:
        for library in architecture_family(ModelSpec.parse(loaded.arch)).libraries:
            record.library(importlib.import_module(library))
    classifier, stats, stats_origin = loaded.classifier, loaded.normalizer, "checkpoint normaliser"
    if loaded.input is not None:  # a trained checkpoint records the input its network was trained at
        size, mode = loaded.input
        classifier = fit_input_size(classifier, size, str(loaded.arch), mode, options.runtime)
    else:
        classifier, data_cfg = fit_named_input(classifier, loaded.arch, options.runtime, loaded.data_args, path,
                                               record)
        if data_cfg is not None and stats is None:  # timm:NAME.TAG: the tag's data config (under a timm training
            stats = data_cfg["mean"], data_cfg["std"]  # checkpoint's settings)
            stats_origin = (f"timm pretrained config of {loaded.arch}" if not loaded.data_args else
                            f"timm training checkpoint's data settings over {loaded.arch}'s config")
    model = wrap(classifier, num_classes=loaded.num_classes, normalize=options.normalize,
                 stats=stats, stats_origin=stats_origin, record=record,
                 origin=ModelOrigin(loaded.arch, None, str(path), loaded.layout))
    if loaded.arch_args:
        model.details["arch_args"] = loaded.arch_args
    return model


def fit_named_input(classifier: nn.Module, arch: str | None, runtime: Runtime | None = None,
                    data_args: dict | None = None, path: Path | str | None = None,
                    record: ModelRecord | None = None) -> tuple[nn.Module, dict | None]:
    """The classifier behind a resize to a timm tag's data config (under `data_args`) and that config; other names: the
    classifier as is and None."""
    if arch is None or not arch.startswith(TIMM_PREFIX):
        return classifier, None
    from tools.models.timm_weights import fit_data_config, tag_data_config  # noqa: PLC0415 (timm, an optional extra)
    data_cfg = tag_data_config(arch, record, data_args, f"checkpoint {path}" if path is not None else "")
    if data_cfg is None:
        return classifier, None
    return fit_data_config(classifier, data_cfg, arch, runtime), data_cfg


@register_source(TOOLKIT_PREFIX)
def toolkit_untrained(name: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """This toolkit's own architectures, which have no pretrained weights: a checkpoint gives them."""
    raise UserError(f"{TOOLKIT_PREFIX}{name} has no pretrained weights; pass {option('--checkpoint', 'PATH')}, or "
                    f"train it from random weights with `train.py --weights none`")


def _given(options: ModelOptions, normalize: bool = False) -> str:
    """The options given for a model whose source brings its own weights, as the caller names them; "" if none."""
    given = [option("--checkpoint", options.checkpoint) if options.checkpoint is not None else None,
             option("--weights", options.weights) if options.weights is not None else None,
             option("--normalize", options.normalize.value)
             if normalize and options.normalize is not Normalization.AUTO else None]
    given = [text for text in given if text is not None]
    return " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)


@register_source(CLIP_PREFIX)
def clip_zero_shot(spec: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """CLIP zero-shot over the 1000 ImageNet class names, or nine IN-9 prompts (tools.models.clip; needs
    open_clip_torch)."""
    given = _given(options, normalize=True)
    if given:
        raise UserError(f"{option('--arch', CLIP_PREFIX + spec)} takes its weights and normalisation from open_clip: "
                        f"drop {given}")
    from tools.models.clip import load_clip  # noqa: PLC0415 (the optional extra is imported only here)
    loaded = load_clip(spec, record, options.runtime, options.progress, options.cache)
    checkpoints.check_class_count(loaded.num_classes, options.in9, f"{CLIP_PREFIX}{spec}")
    return loaded


@register_source(HF_PREFIX)
def transformers_classifier(name: str, options: ModelOptions, record: ModelRecord) -> LoadedModel:
    """Hugging Face transformers image classifiers, hf:ORG/NAME or hf:PATH (a save_pretrained folder), with 1000
    ImageNet or 9 IN-9 labels (tools.models.hf; needs transformers)."""
    given = _given(options)
    if given:
        raise UserError(f"{option('--arch', HF_PREFIX + name)} takes its weights from its folder or hub repository: "
                        f"drop {given}")
    from tools.models.hf import load_transformers  # noqa: PLC0415 (the optional extra is imported there)
    loaded = load_transformers(name, options.normalize, record, options.runtime, options.trust_remote_code)
    checkpoints.check_class_count(loaded.num_classes, options.in9, f"{HF_PREFIX}{name}")
    return loaded
