"""CLIP zero-shot classifiers (the `clip:ARCH/PRETRAINED` source, optional extra open_clip_torch).

A zero-shot head is a fixed linear layer made of text: per class, the normalised mean of its prompts' normalised text
embeddings; logits are `logit_scale * normalise(image_embedding) @ head.T`. The `imagenet` head (default) is a
1000-class model like any other; the `in9` head is a 9-class model, not comparable with them. `clip:ARCH/none` is a
seeded random model (tests use it). The head is built on the runtime's device in true fp32 and cached by content in
`clip-heads/`. See docs/zoo.md, "CLIP zero-shot".
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import pickle
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tools.data.store import CacheEntry, DecodedCache
from tools.errors import UserError, first_line, optional_module
from tools.in9 import IMAGE_SIZE, NUM_IMAGENET_CLASSES, Normalization, full_class_names
from tools.models.architectures import close_matches
from tools.models.boundary import LoadedModel, ModelOrigin, announce_input_size, resize_input, state_sha256, wrap
from tools.models.loading import FULL_UNPICKLING_SWITCH, full_unpickling_forced, read_problem, unpickling_problem
from tools.models.record import ModelRecord
from tools.progress import progress_bar
from tools.runtime import Forward, Runtime, device_model

log = logging.getLogger(__name__)

RANDOM_TAG = "none"
RANDOM_SEED = 0
TEXT_BATCH = 256  # prompts per forward pass of the text encoder
HEAD_CACHE_FOLDER = "clip-heads"  # in the run's cache folder
HEAD_CACHE_VERSION = 1


class Head(str, enum.Enum):
    """What a zero-shot classifier predicts over."""

    IMAGENET = "imagenet"  # open_clip's 1000 ImageNet class names, through the ImageNet->IN-9 map
    IN9 = "in9"  # the nine IN-9 classes by their full names


class Templates(str, enum.Enum):
    """Prompt template sets, as open_clip ships them."""

    OPENAI = "openai"  # CLIP's 80 ImageNet prompts
    SIMPLE = "simple"  # open_clip's 7-prompt subset


OPTIONS = {"head": Head, "templates": Templates}  # `+NAME=VALUE` after the spec
OPTION = re.compile(r"\+(\w+)=([^+/]*)$")
AN_BEFORE_VOWEL = re.compile(r"\b([Aa]) (?=[aeiouAEIOU])")


@dataclass(frozen=True)
class ClipSpec:
    """What follows `clip:`: architecture, weights (a tag or a file; None: seeded random), head, templates."""

    arch: str
    pretrained: str | None
    head: Head = Head.IMAGENET
    templates: Templates = Templates.OPENAI


def parse_spec(spec: str) -> ClipSpec:
    """`ARCH/PRETRAINED[+head=HEAD][+templates=SET]` -> ClipSpec; PRETRAINED `none` or left out: random weights."""
    rest, options = spec, {}
    while match := OPTION.search(rest):
        name, value = match.groups()
        vocabulary = OPTIONS.get(name)
        if vocabulary is None:
            raise UserError(f"unknown option {name!r} in clip:{spec}; valid: {', '.join(OPTIONS)}")
        if name in options:
            raise UserError(f"{name} given twice in clip:{spec}")
        try:
            options[name] = vocabulary(value)
        except ValueError:
            raise UserError(f"unknown {name} {value!r} in clip:{spec}; valid: "
                            f"{', '.join(v.value for v in vocabulary)}") from None
        rest = rest[:match.start()]
    arch, _, pretrained = rest.partition("/")
    if not arch:
        raise UserError(f"clip:{spec} names no architecture; use clip:ARCH/PRETRAINED, e.g. clip:ViT-B-32/openai")
    return ClipSpec(arch, None if pretrained in ("", RANDOM_TAG) else pretrained, **options)


# ----------------------------------------------------------------------------------------------------------
# Prompts and the head

def template_sets() -> dict[Templates, tuple]:
    """The prompt templates (callables of a class name) of each set."""
    from open_clip import zero_shot_metadata  # noqa: PLC0415 (an optional extra)
    return {Templates.OPENAI: tuple(zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES),
            Templates.SIMPLE: tuple(zero_shot_metadata.SIMPLE_IMAGENET_TEMPLATES)}


def with_articles(prompt: str) -> str:
    """'a' made 'an' before a vowel letter: right for every IN-9 name and template word after 'a'."""
    return AN_BEFORE_VOWEL.sub(r"\1n ", prompt)


def prompts(head: Head, templates: Templates) -> list[list[str]]:
    """Each class's prompts in the head's class order (ImageNet names, or IN-9 names with agreeing articles)."""
    chosen = template_sets()[templates]
    if head is Head.IMAGENET:
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: PLC0415 (an optional extra)
        if len(IMAGENET_CLASSNAMES) != NUM_IMAGENET_CLASSES:
            raise RuntimeError(f"open_clip ships {len(IMAGENET_CLASSNAMES)} ImageNet class names, not 1000")
        return [[template(name) for template in chosen] for name in IMAGENET_CLASSNAMES]
    return [[with_articles(template(name)) for template in chosen] for name in full_class_names()]


def zero_shot_head(encode_text: Callable[[torch.Tensor], torch.Tensor], tokenizer, class_prompts: list[list[str]],
                   device: torch.device, progress: bool = False) -> torch.Tensor:
    """(classes, dim) float32 on the CPU, the prompts encoded on `device` TEXT_BATCH at a time."""
    texts = [text for per_class in class_prompts for text in per_class]
    embeddings = []
    with torch.inference_mode(), progress_bar(total=len(texts), unit="prompt", desc="encoding CLIP prompts",
                                              disable=not progress) as bar:
        for start in range(0, len(texts), TEXT_BATCH):
            tokens = tokenizer(texts[start:start + TEXT_BATCH]).to(device)
            embeddings.append(F.normalize(encode_text(tokens).float(), dim=-1).cpu())
            bar.update(tokens.shape[0])
    per_class = torch.cat(embeddings).reshape(len(class_prompts), len(class_prompts[0]), -1)
    return F.normalize(per_class.mean(dim=1), dim=-1)


class ZeroShotClassifier(nn.Module):
    """CLIP's image encoder and a fixed text head: normalised input in, one logit per head row out; other sizes resized,
    a CoCa tower's pooled embedding scored (as open_clip's `encode_image` does)."""

    def __init__(self, visual: nn.Module, head: torch.Tensor, logit_scale: float, image_size: tuple[int, int],
                 interpolation: str = "bicubic"):
        super().__init__()
        self.visual = visual
        self.register_buffer("head", head.detach().clone())
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))
        self.image_size = tuple(image_size)
        self.interpolation = interpolation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.visual(resize_input(x, self.image_size, self.interpolation))
        if isinstance(features, tuple) and features and isinstance(features[0], torch.Tensor):
            features = features[0]  # CoCa: (pooled, tokens)
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"the CLIP image encoder returned {type(features).__name__}, not a tensor")
        return self.logit_scale * F.normalize(features.float(), dim=-1) @ self.head.T


# ----------------------------------------------------------------------------------------------------------
# Loading

def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(f"{tuple(tensor.shape)}".encode() + tensor.contiguous().numpy().tobytes()).hexdigest()


@contextlib.contextmanager
def _quiet(logger_name: str | None = None, level: int = logging.ERROR):
    """Drop a logger's messages below `level` for a while (open_clip logs its steps at INFO on the root logger;
    huggingface_hub logs each retry of a failing download)."""
    if logger_name is None:  # the root logger: its records come from open_clip's module-level logging calls
        previous = logging.root.manager.disable
        logging.disable(level - 1)
        try:
            yield
        finally:
            logging.disable(previous)
        return
    logger = logging.getLogger(logger_name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _create(open_clip, arch: str, pretrained: str | None) -> tuple[nn.Module, str | None]:
    """The open_clip model and the weights file it read (None for a random initialisation)."""
    if pretrained is None:
        with torch.random.fork_rng():
            torch.manual_seed(RANDOM_SEED)
            return open_clip.create_model(arch, pretrained=None), None
    tags = open_clip.list_pretrained_tags_by_model(arch)
    if pretrained in tags:
        config = open_clip.get_pretrained_cfg(arch, pretrained)
        try:  # huggingface_hub logs every retry of an offline download: one error line below says it all
            with _quiet("huggingface_hub"):
                path = open_clip.download_pretrained(config)
        except Exception as exc:  # noqa: BLE001 (urllib, huggingface_hub and OS errors all mean: not fetched)
            reason = first_line(exc)
            raise UserError(f"cannot download the CLIP weights clip:{arch}/{pretrained} ({reason}); offline, fetch "
                            f"them elsewhere into open_clip's cache, or pass a local file as clip:{arch}/PATH") \
                from None
    elif Path(pretrained).is_file():
        path = pretrained
    else:
        raise UserError(f"clip:{arch}/{pretrained}: {pretrained!r} is neither a pretrained tag of {arch} nor a file; "
                        f"tags: {', '.join(tags) or 'none'} (or {RANDOM_TAG} for random weights)")
    if full_unpickling_forced() and "weights_only" not in inspect.signature(open_clip.load_checkpoint).parameters:
        raise UserError(f"{FULL_UNPICKLING_SWITCH} is set, and the installed open_clip reads CLIP weights without "
                        f"saying weights_only, so torch would unpickle clip:{arch}/{pretrained} in full (code in the "
                        f"file would run): unset it for this command, or install open_clip_torch>=2.27")
    try:  # a known tag: open_clip finds the file just downloaded in its cache and sets the tag's mean/std
        return open_clip.create_model(arch, pretrained=pretrained), str(path)
    except Exception as exc:
        if not isinstance(exc, RuntimeError) and pretrained in tags:
            raise
        problem = (f"it needs more than the weights-only unpickling CLIP weights are read with "
                   f"({unpickling_problem(exc)}); save the model's state dict (torch.save(model.state_dict(), PATH))"
                   if isinstance(exc, pickle.UnpicklingError) else read_problem(exc))
        raise UserError(f"cannot load the CLIP weights clip:{arch}/{pretrained}: {problem}") from None


def check_tokenizer_calls(tokenizer, arch: str) -> None:
    """Refuse a tokenizer whose code calls a method its Hugging Face tokenizer lacks: open_clip before 3.3 cuts text
    through transformers' batch_encode_plus, which transformers 5 (the toolkit's floor) removed."""
    inner = getattr(tokenizer, "tokenizer", None)
    calls = getattr(getattr(type(tokenizer).__call__, "__code__", None), "co_names", ())
    if inner is not None and "batch_encode_plus" in calls and not hasattr(inner, "batch_encode_plus"):
        import transformers  # noqa: PLC0415 (the tokenizer's own library, imported by it already)
        raise UserError(f"open_clip {_open_clip_version()} cuts the text of {arch} with a Hugging Face tokenizer "
                        f"through batch_encode_plus, which transformers {transformers.__version__} no longer has; "
                        f"upgrade open_clip to 3.3 or newer (pip install -U open_clip_torch)")


def _open_clip_version() -> str:
    """The installed open_clip_torch's version (its module has no __version__ before 2.25 or so)."""
    return importlib.metadata.version("open_clip_torch")


_PLAIN = (bool, int, float, str, type(None))


def tokenizer_settings(tokenizer, record: ModelRecord | None = None) -> dict:
    """What the tokenizer makes of a prompt: its class, settings and cleaning; a Hugging Face tokenizer's pipeline by
    SHA-256 (hub files may move), special ids and padding side. Its libraries go into `record`."""
    settings = {"class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"}
    if record is not None and type(tokenizer).__module__ in sys.modules:
        record.libraries_of(sys.modules[type(tokenizer).__module__])
    for name, value in sorted(vars(tokenizer).items()):
        if isinstance(value, _PLAIN) or (isinstance(value, (list, tuple))
                                         and all(isinstance(v, _PLAIN) for v in value)):
            settings[name] = value
        elif callable(value) and hasattr(value, "__qualname__"):  # a cleaning function, as open_clip's code names it
            settings[name] = f"{getattr(value, '__module__', None)}.{value.__qualname__}"
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "save_pretrained"):
        backend = getattr(inner, "backend_tokenizer", None)
        if backend is not None:
            pipeline = backend.to_str().encode()
        else:  # a tokenizer of Python code: its vocabulary files
            with tempfile.TemporaryDirectory() as folder:
                pipeline = b"".join(Path(file).name.encode() + b"\0" + Path(file).read_bytes()
                                    for file in sorted(inner.save_vocabulary(folder)))
        settings["hugging face"] = {
            "class": type(inner).__qualname__, "pipeline sha256": hashlib.sha256(pipeline).hexdigest(),
            "special ids": sorted(inner.all_special_ids), "pad id": inner.pad_token_id,
            "padding side": inner.padding_side, "truncation side": inner.truncation_side}
        if record is not None:
            for library in ("transformers", "tokenizers"):
                record.library(importlib.import_module(library))
    return settings


INTERPOLATIONS = ("bicubic", "bilinear")  # open_clip's resize interpolations that torch's resize has


def preprocess_settings(open_clip, clip_model: nn.Module, what: str) -> dict:
    """open_clip's pixel pipeline for the model (input size, mean, std, interpolation, resize mode; every mode is one
    resize of the square inputs)."""
    config = open_clip.get_model_preprocess_cfg(clip_model)
    size = config.get("size", IMAGE_SIZE)
    settings = {"size": [size, size] if isinstance(size, int) else [int(v) for v in size],
                "mean": [float(v) for v in config["mean"]], "std": [float(v) for v in config["std"]],
                "interpolation": config.get("interpolation", "bicubic"),
                "resize_mode": config.get("resize_mode", "shortest")}
    if settings["interpolation"] not in INTERPOLATIONS:
        raise UserError(f"{what}: open_clip's preprocess interpolation {settings['interpolation']!r} is not one of "
                        f"{', '.join(INTERPOLATIONS)}")
    if settings["size"][0] != settings["size"][1] and settings["resize_mode"] != "squash":
        raise UserError(f"{what}: a {settings['resize_mode']} resize to the non-square size {settings['size']} is not "
                        f"supported")
    return settings


def _text_head(open_clip, parsed: ClipSpec, clip_model: nn.Module, tokenizer, class_prompts: list[list[str]],
               weights_sha256: str, runtime: Runtime | None, progress: bool,
               tokenizer_record: dict, cache: DecodedCache | None) -> torch.Tensor:
    """The zero-shot head from `cache` (`clip-heads/`; None: not used) when built from the same content, else encoded on
    the runtime's device in true fp32 (TF32 and autocast off) and cached."""
    texts = [text for per_class in class_prompts for text in per_class]
    device = runtime.device if runtime is not None else torch.device("cpu")
    # the device model too: a head encoded on one GPU model differs from another's, and the CPU's, in the last bits
    meta = {"format": HEAD_CACHE_VERSION, "open_clip": _open_clip_version(), "weights_sha256": weights_sha256,
            "device": device_model(device),
            "config": open_clip.get_model_config(parsed.arch),
            "pretrained_cfg": open_clip.get_pretrained_cfg(parsed.arch, parsed.pretrained or ""),  # {} for a file
            "tokenizer": tokenizer_record,
            "head": parsed.head.value, "templates": parsed.templates.value, "classes": len(class_prompts),
            "prompts_sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest()}
    meta = json.loads(json.dumps(meta))  # as it reads back from the cache
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]
    entry = CacheEntry(cache.folder / HEAD_CACHE_FOLDER if cache is not None else None, key, meta,
                       what="CLIP text head", shared=cache is not None and cache.shared)
    cached = entry.load(["head"])
    if cached is not None:
        return torch.from_numpy(cached["head"])
    log.info("encoding the %d prompts of clip:%s's %s head on %s", len(texts), parsed.arch, parsed.head.value, device)
    try:
        clip_model.to(device)
        # true fp32 in the same batches whatever the precision (the cache key holds no precision), halving the
        # prompts per batch on out-of-memory; without a runtime, on the CPU as it is
        encode_text = clip_model.encode_text if runtime is None else Forward(
            clip_model.encode_text, runtime, TEXT_BATCH, exact=True, what="prompts per batch", pad=False)
        head = zero_shot_head(encode_text, tokenizer, class_prompts, device, progress)
    finally:
        clip_model.to("cpu")
    entry.save({"head": head.numpy()})
    return head


def load_clip(spec: str, record: ModelRecord, runtime: Runtime | None = None, progress: bool = False,
              cache: DecodedCache | None = None) -> LoadedModel:
    """A zero-shot classifier on the CPU from `spec` (what follows `clip:`), its head from `cache`."""
    open_clip = optional_module("open_clip", "a clip: model", "open_clip_torch", "clip")
    parsed = parse_spec(spec)
    if parsed.arch not in open_clip.list_models():
        raise UserError(f"unknown open_clip architecture {parsed.arch!r}"
                        f"{close_matches(parsed.arch, open_clip.list_models()) or '; see open_clip.list_models()'}")
    record.library(open_clip)
    record.setting("open_clip model config", open_clip.get_model_config(parsed.arch))
    with _quiet(level=logging.WARNING):
        clip_model, weights_file = _create(open_clip, parsed.arch, parsed.pretrained)
        tokenizer = open_clip.get_tokenizer(parsed.arch)
    check_tokenizer_calls(tokenizer, parsed.arch)
    clip_model.eval()
    if weights_file is None:  # drawn with the seed by the installed torch
        record.setting("open_clip random weights seed", RANDOM_SEED)
        weights_sha256 = record.compute("open_clip random weights sha256", state_sha256(clip_model))
    else:
        weights_sha256 = record.read_file(weights_file, "weights")
        record.setting("open_clip pretrained config", open_clip.get_pretrained_cfg(parsed.arch, parsed.pretrained))
    preprocess = record.setting("preprocess", preprocess_settings(open_clip, clip_model, f"clip:{spec}"))
    image_size = tuple(preprocess["size"])
    if image_size != (IMAGE_SIZE, IMAGE_SIZE):
        announce_input_size(image_size, f"clip:{spec}", preprocess["interpolation"], runtime=runtime)
    class_prompts = prompts(parsed.head, parsed.templates)
    tokenizer_record = record.setting("tokenizer", tokenizer_settings(tokenizer, record))
    head = _text_head(open_clip, parsed, clip_model, tokenizer, class_prompts, weights_sha256, runtime, progress,
                      tokenizer_record, cache)
    classifier = ZeroShotClassifier(clip_model.visual, head, clip_model.logit_scale.exp().item(), image_size,
                                    preprocess["interpolation"])
    head_sha256 = _tensor_digest(head)
    classes, templates = len(class_prompts), len(class_prompts[0])
    record.setting("zero-shot prompts", {"head": parsed.head.value, "templates": parsed.templates.value,
                                         "sha256": hashlib.sha256("\n".join(
                                             text for per_class in class_prompts for text in per_class).encode())
                                         .hexdigest()})
    record.compute("zero-shot head sha256", head_sha256)  # encoded on the run's device
    names = "ImageNet class names" if parsed.head is Head.IMAGENET else "IN-9 classes"
    initialisation = f"random init (seed {RANDOM_SEED}) " if weights_file is None else ""
    origin = ModelOrigin(f"clip:{parsed.arch}", parsed.pretrained or RANDOM_TAG, weights_file,
                         f"open_clip {initialisation}zero-shot, {classes} {names} x {templates} "
                         f"{parsed.templates.value} templates")
    loaded = wrap(classifier, num_classes=classes, origin=origin, normalize=Normalization.AUTO, record=record,
                  stats=(preprocess["mean"], preprocess["std"]), stats_origin="CLIP")
    loaded.details["zero_shot"] = {
        "head": parsed.head.value, "classes": classes, "templates": parsed.templates.value,
        "templates_count": templates, "prompts": classes * templates,
        "class_names": ("open_clip IMAGENET_CLASSNAMES" if parsed.head is Head.IMAGENET
                        else ", ".join(full_class_names())),
        "weights_sha256": weights_sha256, "head_sha256": head_sha256, "open_clip": _open_clip_version(),
        "preprocess": preprocess}
    return loaded
