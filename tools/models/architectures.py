"""Untrained architectures by name: families chosen by the name's prefix (`tools.models.spec`), registered with
`@register_architectures(prefix)`: torchvision's (no prefix), `timm:NAME[.TAG]` and `toolkit:NAME`. A checkpoint's
weights go into one of them.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tools.errors import UserError, first_line, import_torchvision, key_list, option, optional_module
from tools.in9 import NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES
from tools.models import hub
from tools.models.spec import TIMM_HUB, TIMM_PREFIX, TOOLKIT_PREFIX, ModelSpec

DEFAULT_ARCH = "resnet50"  # the paper's model, where neither --arch nor the checkpoint names one
SMALL_CNN = f"{TOOLKIT_PREFIX}small_cnn"  # a tiny BatchNorm-free CNN for tests, demos and smoke runs


@dataclass(frozen=True)
class Family:
    """Architectures of one prefix: how to build one, and the libraries that building imports."""

    build: Callable[..., nn.Module]  # (spec, num_classes, **builder arguments)
    libraries: tuple[str, ...]


ARCHITECTURES: dict[str, Family] = {}


def register_architectures(prefix: str, libraries: tuple[str, ...] = ()):
    """Register `build(spec, num_classes, **arguments) -> nn.Module` for architecture names starting with `prefix`."""
    def register(build: Callable[..., nn.Module]):
        ARCHITECTURES[prefix] = Family(build, libraries)
        return build
    return register


def architecture_names() -> str:
    """How architectures are named, for messages: "NAME (torchvision), timm:NAME, toolkit:NAME"."""
    return ", ".join(f"{p}NAME" if p else "NAME (torchvision)" for p in sorted(ARCHITECTURES))


def architecture_family(spec: ModelSpec) -> Family:
    """The family a spec's architecture belongs to; a name that is not an architecture is an error."""
    family = ARCHITECTURES.get(spec.prefix)
    if family is None or spec.file is not None or spec.model is None:
        raise UserError(f"{spec} is not an architecture; {option('--arch')} takes {architecture_names()}")
    return family


def build_architecture(arch: str, num_classes: int, arch_args: dict | None = None) -> nn.Module:
    """An untrained classifier; `arch_args`: builder arguments pretrained weights fix (a ViT's image_size)."""
    spec = ModelSpec.parse(arch)
    return architecture_family(spec).build(spec, num_classes, **(arch_args or {}))


def classifier_keys(arch: str, arch_args: dict | None = None) -> list[str]:
    """State-dict keys whose shapes depend on the class count, found by building twice (on the meta device, or the CPU
    for an architecture that reads tensor values while built)."""
    try:
        with torch.device("meta"):
            nine = build_architecture(arch, NUM_IN9_CLASSES, arch_args).state_dict()
            full = build_architecture(arch, NUM_IMAGENET_CLASSES, arch_args).state_dict()
    except (NotImplementedError, RuntimeError):  # "Cannot copy out of meta tensor; no data!"
        nine = build_architecture(arch, NUM_IN9_CLASSES, arch_args).state_dict()
        full = build_architecture(arch, NUM_IMAGENET_CLASSES, arch_args).state_dict()
    return [k for k in nine if nine[k].shape != full[k].shape]


def close_matches(name: str, options) -> str:
    matches = difflib.get_close_matches(name, list(options), n=5, cutoff=0.5)
    return f" (close matches: {', '.join(matches)})" if matches else ""


# ----------------------------------------------------------------------------------------------------------
# The families

def torchvision_module():
    return import_torchvision()  # imported lazily: only model building needs it


def torchvision_architectures() -> list[str]:
    tv = torchvision_module()
    return sorted(tv.models.list_models(module=tv.models))


def check_torchvision_architecture(arch: str) -> None:
    names = torchvision_architectures()
    if arch not in names:
        raise UserError(f"unknown architecture {arch!r}{close_matches(arch, names)}; {option('--arch')} takes a "
                        f"torchvision classification model name, or timm:NAME with timm installed")


@register_architectures("", libraries=("torchvision",))
def torchvision_architecture(spec: ModelSpec, num_classes: int, **arguments) -> nn.Module:
    """torchvision classification models, by builder name (resnet50, vit_b_16, ...)."""
    check_torchvision_architecture(spec.name)
    return torchvision_module().models.get_model(spec.name, weights=None, num_classes=num_classes, **arguments)


# What torchvision's builders take from pretrained weights besides the class count, by the module that defines the
# weights (torchvision 0.13 to 0.29, read from its source; tests/test_torchvision_weights.py holds every
# classification weights to its builder): the input size that ViT and MaxViT fix when they are built, and GoogLeNet's
# and Inception-v3's input transform (their weights take inputs normalised to 0.5, which `transform_input` makes of
# ImageNet-normalised ones) and auxiliary heads: loaded with the weights, then dropped (`aux_logits` False), as
# GoogLeNet's builder does by default and Inception's when asked. In training mode a network with auxiliary heads
# returns their outputs beside its logits, which no loss here takes (and DDP would find their weights unused); in
# evaluation they compute nothing.
#
# The builder arguments `torchvision_weights_arguments` gives, the only ones a checkpoint may record for a torchvision
# (or the toolkit's) architecture (`recorded_arguments`).
RECORDED_ARGUMENTS = frozenset({"image_size", "input_size", "transform_input", "aux_logits", "init_weights"})
_WEIGHTS_ARGUMENTS = {
    "vision_transformer": lambda meta: {"image_size": int(meta["min_size"][0])},
    "maxvit": lambda meta: {"input_size": [int(v) for v in meta["min_size"]]},
    "googlenet": lambda meta: {"transform_input": True, "aux_logits": False, "init_weights": False},
    "inception": lambda meta: {"transform_input": True, "aux_logits": False, "init_weights": False},
}
# The auxiliary heads a builder keeps with weights unless asked not to (which it refuses with weights given, in
# torchvision 0.29): dropped here as the builder drops them when asked (`aux_logits` False, the heads None)
_KEPT_HEADS = {"inception": ("AuxLogits",)}


def build_with_weights(arch: str, weights, state: dict) -> nn.Module:
    """torchvision's own builder of `arch` given `weights` (so it takes their settings), with their state dict `state`
    instead of torchvision's download; a state dict that does not fit is one error line."""
    check_torchvision_architecture(arch)
    weights.get_state_dict = lambda *args, **kwargs: state  # this member's alone, for this call alone
    try:
        network = torchvision_module().models.get_model(arch, weights=weights)
    except NotImplementedError:  # a RuntimeError too, but a bug, not a file that does not fit
        raise
    except RuntimeError as exc:  # load_state_dict: missing, unexpected or misshapen keys, a kind per line
        raise UserError(f"the weights file of {weights} does not fit {arch} as torchvision builds it for them "
                        f"({_load_problems(exc)})") from None
    finally:
        del weights.get_state_dict
    for head in _KEPT_HEADS.get(_weights_module(weights), ()):
        network.aux_logits = False
        setattr(network, head, None)
    return network


QUOTED = re.compile(r'"([^"]+)"')  # a key as load_state_dict's message quotes it


def _load_problems(exc: RuntimeError) -> str:
    """load_state_dict's complaint in one line: each kind of problem with its first keys (`key_list`)."""
    problems = []
    for line in str(exc).splitlines()[1:]:
        kind, _, keys = line.strip().partition(":")
        if keys:
            names = re.findall(QUOTED, keys) or [keys.strip()]
            problems.append(f"{kind}: {key_list(names, limit=3)}")
    return "; ".join(problems) or first_line(exc)


def torchvision_weights_arguments(weights) -> dict:
    """The builder arguments besides the class count an architecture needs to hold `weights`."""
    arguments = _WEIGHTS_ARGUMENTS.get(_weights_module(weights))
    return arguments(weights.meta) if arguments is not None else {}


def _weights_module(weights) -> str:
    return type(weights).__module__.rsplit(".", 1)[-1]


def timm_module(spec: ModelSpec):
    """timm, or one line saying how to install it."""
    return optional_module("timm", option("--arch", spec), "timm", "timm")


def timm_loading_parameters(timm) -> frozenset[str]:
    """timm.create_model's own parameters (where weights come from, compilation), not the network's."""
    parameters = inspect.signature(timm.create_model).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD) - {"model_name"}


def _plain(value) -> bool:
    """A value a file may give a builder argument: a number, a string, a flag, None, or a list of those."""
    scalar = (bool, int, float, str, type(None))
    return type(value) in scalar or type(value) in (list, tuple) and all(type(v) in scalar for v in value)


def recorded_arguments(arch: str, arguments, what: str) -> dict:
    """The builder arguments a file (`what`) records for `arch`, of plain values: for timm any but
    `timm_loading_parameters` (checkpoint_path reads any file), else `RECORDED_ARGUMENTS`; else one error line."""
    if not isinstance(arguments, Mapping) or not all(isinstance(k, str) for k in arguments):
        raise UserError(f"{what} records builder arguments that are not a mapping of names (a "
                        f"{type(arguments).__name__}); is it a file its library wrote?")
    spec = ModelSpec.parse(arch)
    refused = (set(arguments) & timm_loading_parameters(timm_module(spec)) if spec.prefix == TIMM_PREFIX
               else set(arguments) - RECORDED_ARGUMENTS)
    refused |= {name for name, value in arguments.items() if not _plain(value)}
    if refused:
        raise UserError(f"{what} records builder arguments for {arch} that could make its builder read a file or "
                        f"download, or that are not plain values ({key_list(sorted(refused))}); a file's builder "
                        f"arguments may only shape the network: is it a file its library wrote?")
    return dict(arguments)


def check_timm_name(timm, spec: ModelSpec) -> None:
    """An unknown timm architecture or tag is one line with the close matches; `hf-hub:` names are the hub's."""
    if spec.name.startswith(TIMM_HUB):
        return
    if spec.name not in timm.list_models():
        raise UserError(f"unknown timm architecture {spec.name!r}{close_matches(spec.name, timm.list_models())}")
    if spec.tag is not None:
        tags = [name.split(".", 1)[1] for name in timm.list_pretrained(f"{spec.name}.*")]
        if spec.tag not in tags:
            raise UserError(f"unknown timm tag {spec.tag!r} of {spec.name} (valid: {', '.join(tags) or 'none'})")


@register_architectures(TIMM_PREFIX, libraries=("timm",))
def timm_architecture(spec: ModelSpec, num_classes: int, **arguments) -> nn.Module:
    """timm models, timm:NAME or timm:NAME.TAG (a pretrained tag, which may set the input size), timm installed."""
    timm = timm_module(spec)
    check_timm_name(timm, spec)
    try:
        return timm.create_model(spec.body, pretrained=False, num_classes=num_classes, **arguments)
    except (FileNotFoundError, ConnectionError, TimeoutError) as exc:  # a hub name's config.json, not to be had
        if not spec.name.startswith(TIMM_HUB):
            raise
        repo = spec.name[len(TIMM_HUB):]
        raise UserError(hub.not_cached_line(f"the architecture {spec}", hub.snapshot_command(repo),
                                            first_line(exc))) from None


class SmallCNN(nn.Module):
    """Three strided convolutions, a 1x1 one, global average pooling and a linear head (`fc`). No BatchNorm, so one
    process and several data-parallel ones train it to the same weights. About 10 MFLOPs per 224x224 image."""

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


TOOLKIT_ARCHITECTURES = {SMALL_CNN[len(TOOLKIT_PREFIX):]: SmallCNN}


@register_architectures(TOOLKIT_PREFIX)
def toolkit_architecture(spec: ModelSpec, num_classes: int, **arguments) -> nn.Module:
    """This toolkit's own: toolkit:small_cnn, a tiny CNN for tests, demos and smoke runs."""
    builder = TOOLKIT_ARCHITECTURES.get(spec.name)
    if builder is None:
        raise UserError(f"unknown toolkit architecture {spec.name!r}"
                        f"{close_matches(spec.name, TOOLKIT_ARCHITECTURES)}; valid: {', '.join(TOOLKIT_ARCHITECTURES)}")
    return builder(num_classes, **arguments)
