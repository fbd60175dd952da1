"""CLIP zero-shot classifiers for IN-9 (the `clip:ARCH/PRETRAINED` model source, optional extra open_clip_torch).

The nine IN-9 class names go through a set of prompt templates; per class, the text embeddings of its
prompts are normalised, averaged and normalised again into one row of a 9-class linear head, computed
once at load time. Logits are `logit_scale * normalise(image_embedding) @ head.T`, so the model is an
ordinary 9-class classifier for the rest of the toolkit, with CLIP's own mean/std inside the
`PixelModel` wrapper.

The spec after `clip:` is `ARCH/PRETRAINED`: an open_clip architecture (`open_clip.list_models()`) and a
pretrained tag (`open_clip.list_pretrained_tags_by_model(ARCH)`) or a local weights file. `ARCH`,
`ARCH/` or `ARCH/none` ask for a randomly initialised model (seeded, so the same every time), which
needs no download: tests use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, Normalization, class_names
from tools.hashing import sha256_file
from tools.models import LoadedModel, close_matches, wrap

log = logging.getLogger(__name__)

RANDOM_TAG = "none"
RANDOM_SEED = 0
INSTALL_HINT = "run `pip install open_clip_torch` (or install this project with the [clip] extra)"
TEXT_BATCH = 256


def _open_clip():
    try:
        import open_clip  # noqa: PLC0415 (an optional extra)
    except ImportError:
        raise UserError(f"clip: models need open_clip_torch, which is not installed; {INSTALL_HINT}") from None
    return open_clip


def template_sets() -> dict[str, tuple]:
    """Prompt template sets by name, as open_clip ships them: `openai` (CLIP's 80 ImageNet prompts, the
    default) and `simple` (its 7-prompt subset)."""
    from open_clip import zero_shot_metadata  # noqa: PLC0415 (an optional extra)
    return {"openai": tuple(zero_shot_metadata.OPENAI_IMAGENET_TEMPLATES),
            "simple": tuple(zero_shot_metadata.SIMPLE_IMAGENET_TEMPLATES)}


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`ARCH/PRETRAINED` -> (arch, pretrained tag or file), with None for a random initialisation."""
    arch, _, pretrained = spec.partition("/")
    if not arch:
        raise UserError(f"clip:{spec} names no architecture; use clip:ARCH/PRETRAINED, e.g. clip:ViT-B-32/openai")
    return arch, (None if pretrained in ("", RANDOM_TAG) else pretrained)


def prompts_for(name: str, templates) -> list[str]:
    return [template(name) for template in templates]


def zero_shot_head(clip_model: nn.Module, tokenizer, names, templates) -> torch.Tensor:
    """(classes, dim): per class the normalised mean of its prompts' normalised text embeddings."""
    prompts = [p for name in names for p in prompts_for(name, templates)]
    embeddings = []
    with torch.inference_mode():
        for start in range(0, len(prompts), TEXT_BATCH):
            tokens = tokenizer(prompts[start:start + TEXT_BATCH])
            embeddings.append(F.normalize(clip_model.encode_text(tokens).float(), dim=-1))
    per_class = torch.cat(embeddings).reshape(len(names), len(templates), -1)
    return F.normalize(per_class.mean(dim=1), dim=-1)


class ZeroShotClassifier(nn.Module):
    """CLIP's image encoder and a fixed text-derived head: normalised input in, 9 logits out.

    Inputs of another size than the encoder's are resized to it first (bicubic, antialiased). Resizing
    is linear with weights summing to one, so it commutes with the per-channel normalisation before it."""

    def __init__(self, visual: nn.Module, head: torch.Tensor, logit_scale: float, image_size: tuple[int, int]):
        super().__init__()
        self.visual = visual
        self.register_buffer("head", head.detach().clone())
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))
        self.image_size = tuple(image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.image_size:
            x = F.interpolate(x, size=self.image_size, mode="bicubic", align_corners=False, antialias=True)
        features = self.visual(x)
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"the CLIP image encoder returned {type(features).__name__}, not a tensor")
        return self.logit_scale * F.normalize(features.float(), dim=-1) @ self.head.T


def _image_size(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(int(v) for v in value)


def _state_digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def _quiet(logger_name: str | None = None, level: int = logging.ERROR):
    """Messages below `level` from a logger are dropped for a while (open_clip logs its steps on the root
    logger at INFO; huggingface_hub logs each retry of a failing download)."""
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
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"cannot download the CLIP weights clip:{arch}/{pretrained} ({reason}); offline, fetch "
                            f"them elsewhere into open_clip's cache, or pass a local file as clip:{arch}/PATH") from None
    elif Path(pretrained).is_file():
        path = pretrained
    else:
        raise UserError(f"clip:{arch}/{pretrained}: {pretrained!r} is neither a pretrained tag of {arch} nor a file; "
                        f"tags: {', '.join(tags) or 'none'} (or {RANDOM_TAG} for random weights)")
    try:  # a known tag: open_clip finds the file just downloaded in its cache and sets the tag's mean/std
        return open_clip.create_model(arch, pretrained=pretrained), str(path)
    except RuntimeError as exc:
        raise UserError(f"cannot load the CLIP weights clip:{arch}/{pretrained}: {str(exc).splitlines()[0]}") from None


def load_clip(spec: str, templates: str = "openai") -> LoadedModel:
    """A 9-class zero-shot IN-9 classifier from an open_clip model; `spec` is what follows `clip:`."""
    open_clip = _open_clip()
    arch, pretrained = parse_spec(spec)
    if arch not in open_clip.list_models():
        raise UserError(f"unknown open_clip architecture {arch!r}"
                        f"{close_matches(arch, open_clip.list_models()) or '; see open_clip.list_models()'}")
    sets = template_sets()
    if templates not in sets:
        raise UserError(f"unknown prompt template set {templates!r}; valid: {', '.join(sets)}")
    with _quiet(level=logging.WARNING):
        clip_model, weights_file = _create(open_clip, arch, pretrained)
        tokenizer = open_clip.get_tokenizer(arch)
    clip_model.eval()
    names = class_names()
    log.info("building the zero-shot head of clip:%s from %d prompts (%s templates)", spec,
             len(names) * len(sets[templates]), templates)
    head = zero_shot_head(clip_model, tokenizer, names, sets[templates])
    preprocess = open_clip.get_model_preprocess_cfg(clip_model)
    image_size = _image_size(preprocess.get("size", IMAGE_SIZE))
    if image_size != (IMAGE_SIZE, IMAGE_SIZE):
        log.info("clip:%s takes %dx%d images: the 224x224 inputs are resized inside the model", spec, *image_size)
    classifier = ZeroShotClassifier(clip_model.visual, head, clip_model.logit_scale.exp().item(), image_size)
    if weights_file is None:  # no file to hash: the digest of the weights themselves identifies the run
        fmt, digest, weights = f"open_clip random init (seed {RANDOM_SEED}), {templates} prompts", \
            _state_digest(classifier), RANDOM_TAG
    else:
        fmt, digest, weights = f"open_clip zero-shot, {templates} prompts", sha256_file(weights_file), pretrained
    return wrap(classifier, NUM_IN9_CLASSES, Normalization.AUTO, (preprocess["mean"], preprocess["std"]), "CLIP",
                f"clip:{arch}", weights, weights_file, digest, fmt)
