"""Where models come from: a registry of sources chosen by a model name's prefix (`tools.models.spec`).

A source is one function `(name, options) -> LoadedModel`, registered with `@register_source("prefix:")`:
`resnet50` (no prefix: a torchvision architecture with its pretrained weights), `timm:NAME`, `toolkit:NAME`,
`file:PATH` (a checkpoint file; `--checkpoint PATH` is the same source), `clip:ARCH/PRETRAINED`
(CLIP zero-shot, by default over the 1000 ImageNet class names) and `hf:ORG/NAME` or `hf:PATH` (a transformers
image classifier). `timm:` and `hf:` read the Hugging Face Hub cache (`tools.models.hub`). With a checkpoint (`--checkpoint` or
`ARCH@file:PATH`), the architecture named (`tools.models.architectures`) is built and the file's weights
loaded into it. Adding a source (CLIP zero-shot, a model hub) is one function and its registration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import logging
import os
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from tools.cli import closest
from tools.models import adapters, checkpoints
from tools.errors import UserError, first_line, import_torchvision
from tools.data.hashing import sha256_file
from tools.in9 import IMAGE_SIZE, NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, Normalization, statistics_for
from tools.models.architectures import (ARCHITECTURES, DEFAULT_ARCH, build_with_weights,
                                       check_torchvision_architecture, close_matches, torchvision_module,
                                       torchvision_weights_arguments)
from tools.models.loading import read_problem
from tools.models.boundary import InputResize, LoadedModel, ModelOrigin, fit_input_size, wrap
from tools.models.spec import CLIP_PREFIX, FILE_PREFIX, HF_PREFIX, TIMM_PREFIX, TOOLKIT_PREFIX, ModelSpec

if TYPE_CHECKING:
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

    @property
    def device(self) -> torch.device:
        """Where load-time work runs and a program is loaded for: the runtime's device, else the CPU."""
        return self.runtime.device if self.runtime is not None else torch.device("cpu")


Source = Callable[[str, ModelOptions], LoadedModel]
SOURCES: dict[str, Source] = {}


def register_source(prefix: str) -> Callable[[Source], Source]:
    """Register `fn(name, options) -> LoadedModel` for model names starting with `prefix` ("" for none)."""
    def register(fn: Source) -> Source:
        SOURCES[prefix] = fn
        return fn
    return register


def load_model(arch: str | None = None, weights: str | None = None, checkpoint: Path | str | None = None,
               in9: bool | None = None, normalize: Normalization = Normalization.AUTO, trust: bool = False,
               checkpoint_key: str | None = None, runtime: Runtime | None = None,
               progress: bool = False, lora_alpha: float | None = None, lora_rslora: bool = False,
               lora_options: tuple[str, str] | None = adapters.CLI_LORA_OPTIONS,
               trust_remote_code: bool = False) -> LoadedModel:
    """The model the command line describes, wrapped to take pixels.

    arch: a model name (`tools.models.spec`; default: resnet50); with a checkpoint (`checkpoint`, or the
    name's own `@file:PATH`), the architecture its weights go into (a TorchScript or export program carries
    its own). in9: True (--in9), False (--no-in9), or None to follow the model's class count. runtime: where
    work done at load time runs (CLIP encodes its prompts there); default the CPU. The model itself is
    returned on the CPU, except a TorchScript or export program, which is loaded for the runtime's device
    (the devices its code names pointed there) and probed there. A peft adapter folder (`--checkpoint DIR`,
    `ARCH@file:DIR`, `ARCH@file:BASE@file:DIR`) goes on the model the rest describes and is merged into it
    (into the module its source loaded, inside the toolkit's wrappers). lora_alpha, lora_rslora: the LoRA scaling
    of a peft-wrapped model's state dict; lora_options: how the caller takes them, as messages name them
    (`tools.models.adapters.LoraScaling`).
    trust_remote_code: run the code an `hf:` model or its image processor ships (off: such a model is refused).
    """
    import_torchvision()  # every model library imports it: one that does not match torch is said here, in one line
    lora = adapters.LoraScaling(lora_alpha, lora_rslora, lora_options)
    spec = ModelSpec.parse(arch or DEFAULT_ARCH)
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    adapter = spec.adapter_path
    if checkpoint is not None and spec.file is not None and adapter is None and adapters.is_adapter_folder(checkpoint):
        adapter, checkpoint = checkpoint, None  # --arch ARCH@file:BASE --checkpoint ADAPTER_DIR
    if spec.file is not None:
        if checkpoint is not None:
            raise UserError(f"--arch {spec} and --checkpoint both name a checkpoint file; pass one of them")
        checkpoint = spec.path
    if adapter is None and checkpoint is not None and adapters.is_adapter_folder(checkpoint):
        adapter, checkpoint = checkpoint, None  # the adapter goes on ARCH's pretrained weights
    if adapter is not None and (spec.model is None or not arch):
        raise UserError(f"{adapter} is a peft adapter folder, which goes on a base model: name it with --arch ARCH "
                        f"--checkpoint {adapter} (ARCH@file:{adapter} in the zoo), or ARCH@file:BASE@file:{adapter} "
                        f"for base weights from the checkpoint BASE")
    if lora.given() and (checkpoint is None or adapter is not None):
        raise lora.misplaced("given as a checkpoint (an adapter folder's config holds its scaling)")
    names_architecture = spec.prefix in ARCHITECTURES and spec.model is not None
    options = ModelOptions(weights, checkpoint, in9, normalize, trust, checkpoint_key,
                           spec.model if names_architecture and arch else None, lora, runtime, progress,
                           trust_remote_code)
    # a checkpoint goes into an architecture that is built without weights, or is a whole model (file:); a model
    # whose weights come from its own source (hf:, clip:) refuses it, however it is named
    if checkpoint is not None and (names_architecture or spec.model is None):
        loaded = SOURCES[FILE_PREFIX](str(checkpoint), options)
    else:
        source = SOURCES.get(spec.prefix)
        if source is None:
            raise UserError(f"unknown model source {spec.prefix!r} in {str(spec)!r}{closest(spec.prefix, SOURCES)}; "
                            f"valid: {', '.join(repr(p) for p in SOURCES)}")
        loaded = source(spec.body, options)
    return loaded if adapter is None else _with_adapter(loaded, adapter, trust)


def _with_adapter(base: LoadedModel, folder: Path, trust: bool) -> LoadedModel:
    """The base model with the folder's peft adapter merged into the module its source loaded (the one the
    adapter was saved on, inside the toolkit's wrappers); its identity that of both."""
    owner, attribute = _innermost(base.model, "classifier")

    def place(module: nn.Module) -> nn.Module:
        setattr(owner, attribute, module)
        return base.model.classifier

    merged = adapters.merge_adapter_folder(getattr(owner, attribute), folder, trust, place)
    place(merged.classifier.eval())
    return dataclasses.replace(base, source=f"{base.source} + {folder}",
                               sha256=adapters.combined_sha256(base.sha256, merged.sha256),
                               checkpoint_format=f"{base.checkpoint_format} + peft {merged.kind} adapter (merged)")


def _innermost(owner: nn.Module, attribute: str) -> tuple[nn.Module, str]:
    """Where the module a source loaded sits, as (its owner, the attribute), past the toolkit's wrappers around
    it: the resize to its input size, a transformers model's logits, CLIP's zero-shot head on its image tower."""
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
        raise UserError(f"architecture {arch!r} has no torchvision pretrained weights; pass --checkpoint") from None
    members = [m for m in enum.__members__ if m != "DEFAULT"]
    if name is None:
        name = PUBLISHED_WEIGHTS if PUBLISHED_WEIGHTS in members else "DEFAULT"
        log.info("using %s weights %s (the published numbers used IMAGENET1K_V1)", arch, name)
    short = name.split(".")[-1]
    if short != "DEFAULT" and short not in members:
        raise UserError(f"unknown weights {name!r} for {arch}{close_matches(short, members)}; "
                        f"valid: {', '.join(members + ['DEFAULT'])}")
    return enum[short]


def _download_weights(weights) -> tuple[dict, str, str]:
    """The weights' state dict, the file it was read from (in torch's hub cache) and that file's SHA-256.

    A missing file is downloaded here, checked against the hash prefix in its name as torch checks it, so that
    torch's own download line is never printed (it went to stderr on older torch, and goes to stdout on newer,
    where it would mix with the results). A file already in the cache (perhaps put there by hand, offline) is
    held to the same hash: another file under that name would silently change every number."""
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
    digest = sha256_file(path)
    if prefix is not None and not digest.startswith(prefix):
        raise UserError(f"{path} is not the file {url} names: its SHA-256 starts {digest[:len(prefix)]}, not "
                        f"{prefix}; delete it and rerun (or put the right file there)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (a damaged file fails anywhere in torch's readers)
        raise UserError(f"cannot read {path} ({read_problem(exc)}); delete it and rerun") from None
    return state, str(path), digest


@register_source("")
def torchvision_pretrained(name: str, options: ModelOptions) -> LoadedModel:
    """A torchvision architecture with its pretrained ImageNet weights (default: the published IMAGENET1K_V1)."""
    if options.in9:
        raise UserError("--in9 needs --checkpoint: there are no pretrained 9-class weights to download")
    member = resolve_weights(name, options.weights)
    state, source, digest = _download_weights(member)
    classifier = build_with_weights(name, member, state)
    size, mode, mean, std = weights_pipeline(member)
    weights_name = f"{type(member).__name__}.{member.name}"
    classifier = fit_input_size(classifier, size, f"{name} with {weights_name}", mode, options.runtime)
    model = wrap(classifier, num_classes=NUM_IMAGENET_CLASSES, normalize=options.normalize, stats=(mean, std),
                 stats_origin="the weights' transforms",
                 origin=ModelOrigin(name, weights_name, source, _pipeline_identity(digest, size, mode, mean, std),
                                    "torchvision weights"))
    arch_args = torchvision_weights_arguments(member)
    if arch_args:
        model.details["arch_args"] = arch_args
    return model


def weights_pipeline(weights) -> tuple[tuple[int, int], str, list[float], list[float]]:
    """(input size, interpolation, mean, std) of torchvision weights, from their transforms (ImageClassification):
    the size they crop to, to which the 224x224 images are resized (as a timm model's are to its input size)."""
    transforms = weights.transforms()
    crop = [int(v) for v in transforms.crop_size]
    size = (crop[0], crop[-1])
    return size, transforms.interpolation.value, list(transforms.mean), list(transforms.std)


def _pipeline_identity(digest: str, size: tuple[int, int], mode: str, mean, std) -> str:
    """Torchvision weights' identity: their file's SHA-256, with their pixel pipeline where it is not the one the
    toolkit gave every torchvision model before it read the weights' transforms (224x224, ImageNet's statistics),
    so that results made at 224 are never taken for results at the weights' size."""
    imagenet_mean, imagenet_std = statistics_for(Normalization.IMAGENET, NUM_IMAGENET_CLASSES)
    if (tuple(size) == (IMAGE_SIZE, IMAGE_SIZE) and list(map(float, mean)) == list(map(float, imagenet_mean))
            and list(map(float, std)) == list(map(float, imagenet_std))):
        return digest
    pixels = json.dumps({"input_size": list(size), "interpolation": mode, "mean": list(mean), "std": list(std)},
                        sort_keys=True)
    return hashlib.sha256(f"weights {digest}\npixels {pixels}\n".encode()).hexdigest()


@register_source(TIMM_PREFIX)
def timm_pretrained(name: str, options: ModelOptions) -> LoadedModel:
    """timm models with timm's pretrained weights (timm:NAME[.TAG], timm:hf-hub:ORG/NAME; tools.models.timm_weights;
    --weights none: random weights)."""
    from tools.models.timm_weights import load_timm  # noqa: PLC0415 (timm, an optional extra, is imported there)
    return load_timm(name, options.weights, options.in9, options.normalize, options.runtime)


@register_source(FILE_PREFIX)
def checkpoint_file(path: str, options: ModelOptions) -> LoadedModel:
    """A checkpoint file: a TorchScript or export program as it is, or a state dict loaded into --arch."""
    if options.weights is not None:
        raise UserError("--weights and --checkpoint both give the model's weights; pass one of them")
    loaded = checkpoints.read_checkpoint(Path(path), options.arch, options.in9, options.normalize, options.trust,
                                         options.checkpoint_key, options.device, options.lora)
    if options.in9 is None and loaded.num_classes == NUM_IN9_CLASSES:
        log.info("the checkpoint has 9 classes: evaluating as an IN-9 model (as with --in9)")
    classifier, stats, stats_origin = loaded.classifier, loaded.normalizer, "checkpoint normaliser"
    identity = sha256_file(path)
    if loaded.input is not None:  # a trained checkpoint records the input its network was trained at
        size, mode = loaded.input
        classifier = fit_input_size(classifier, size, str(loaded.arch), mode, options.runtime)
    else:
        classifier, tagged = fit_named_input(classifier, loaded.arch, options.runtime, loaded.data_args, path)
        if tagged is not None:  # timm:NAME.TAG: the tag's data config (under a timm training checkpoint's settings)
            from tools.models.timm_weights import pipeline_identity  # noqa: PLC0415 (timm, an optional extra)
            data_cfg, timm_version = tagged
            if stats is None:
                stats = data_cfg["mean"], data_cfg["std"]
                stats_origin = (f"timm pretrained config of {loaded.arch}" if not loaded.data_args else
                                f"timm training checkpoint's data settings over {loaded.arch}'s config")
            identity = pipeline_identity(identity, data_cfg, timm_version)
    model = wrap(classifier, num_classes=loaded.num_classes, normalize=options.normalize,
                 stats=stats, stats_origin=stats_origin,
                 origin=ModelOrigin(loaded.arch, None, str(path), identity, loaded.layout))
    if loaded.arch_args:
        model.details["arch_args"] = loaded.arch_args
    return model


def fit_named_input(classifier: nn.Module, arch: str | None, runtime: Runtime | None = None,
                    data_args: dict | None = None, path: Path | str | None = None
                    ) -> tuple[nn.Module, tuple[dict, str] | None]:
    """The classifier behind a resize to the input size its architecture's name gives it: a timm tag's data config
    (`timm:NAME.TAG`, or the default tag of `timm:NAME`) under `data_args` (the settings a timm training checkpoint,
    `path`, records), and (that data config, timm's version); other names give 224x224, the classifier as it is and
    None."""
    if arch is None or not arch.startswith(TIMM_PREFIX):
        return classifier, None
    from tools.models.timm_weights import fit_data_config, tag_data_config  # noqa: PLC0415 (timm, an optional extra)
    tagged = tag_data_config(arch, data_args, f"checkpoint {path}" if path is not None else "")
    if tagged is None:
        return classifier, None
    return fit_data_config(classifier, tagged[0], arch, runtime), tagged


@register_source(TOOLKIT_PREFIX)
def toolkit_untrained(name: str, options: ModelOptions) -> LoadedModel:
    """This toolkit's own architectures, which have no pretrained weights: a checkpoint gives them."""
    raise UserError(f"{TOOLKIT_PREFIX}{name} has no pretrained weights; pass --checkpoint (or train it from scratch)")


@register_source(CLIP_PREFIX)
def clip_zero_shot(spec: str, options: ModelOptions) -> LoadedModel:
    """CLIP zero-shot over the 1000 ImageNet class names, or nine IN-9 prompts (tools.models.clip; needs
    open_clip_torch)."""
    if options.checkpoint is not None or options.weights is not None or options.normalize is not Normalization.AUTO:
        raise UserError(f"--arch {CLIP_PREFIX}{spec} takes its weights and normalisation from open_clip: drop "
                        f"--checkpoint, --weights and --normalize")
    from tools.models.clip import load_clip  # noqa: PLC0415 (the optional extra is imported only here)
    loaded = load_clip(spec, options.runtime, options.progress)
    checkpoints.check_class_count(loaded.num_classes, options.in9, f"{CLIP_PREFIX}{spec}")
    return loaded


@register_source(HF_PREFIX)
def transformers_classifier(name: str, options: ModelOptions) -> LoadedModel:
    """Hugging Face transformers image classifiers, hf:ORG/NAME or hf:PATH (a save_pretrained folder), with 1000
    ImageNet or 9 IN-9 labels (tools.models.hf; needs transformers)."""
    if options.checkpoint is not None or options.weights is not None:
        raise UserError(f"--arch {HF_PREFIX}{name} takes its weights from its folder or hub repository: drop "
                        f"--checkpoint and --weights")
    from tools.models.hf import load_transformers  # noqa: PLC0415 (the optional extra is imported there)
    loaded = load_transformers(name, options.normalize, options.runtime, options.trust_remote_code)
    checkpoints.check_class_count(loaded.num_classes, options.in9, f"{HF_PREFIX}{name}")
    return loaded
