"""Building classifiers and reading checkpoints; the wrapper that takes pixels and normalises inside.

Checkpoint formats, told apart by the file's contents, never by its name:
- a TorchScript archive (`torch.jit.save`) or a `torch.export` program (`torch.export.save`, .pt2):
  used as the classifier as it is;
- the toolkit's own trained checkpoint (`train.py`), recognised by its `format` key: the architecture and
  the normaliser come from the file;
- a pickle read by `torch.load(weights_only=True)`: a state dict, directly or under `model`,
  `state_dict` or `state_dict_ema` (that priority, or `--checkpoint-key`), with `module.` /
  `_orig_mod.` wrapper prefixes, or the robustness library's layout (`normalizer.new_mean/new_std`,
  `model.<arch keys>`, a duplicate `attacker.*` copy that is dropped).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import pickle
import re
import urllib.error
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError
from tools.in9 import (IMAGE_SIZE, NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, SUPPORTED_CLASS_COUNTS, Normalization,
                       statistics_for)

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm:"
STATE_DICT_KEYS = ("model", "state_dict", "state_dict_ema")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
PUBLISHED_WEIGHTS = "IMAGENET1K_V1"  # the weights the paper's numbers used, where an architecture has them
DEFAULT_ARCH = "resnet50"  # the paper's model, where neither --arch nor the checkpoint names one
TRAINED_FORMAT = "bg-challenge-toolkit/1"  # the `format` value of the checkpoints train.py writes
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
        # The same operations as ToTensor then Normalize, in the same order (so the same floats), in place
        # on a fresh copy to spare memory traffic.
        x = x.float().div_(255) if x.dtype == torch.uint8 else x.clone()
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

    def describe(self) -> dict:
        return {"arch": self.arch, "weights": self.weights, "checkpoint": self.source, "sha256": self.sha256,
                "checkpoint_format": self.checkpoint_format, "num_classes": self.num_classes,
                "normalization": self.normalization}


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Architectures and pretrained weights

def _torchvision():
    import torchvision  # noqa: PLC0415 (imported lazily: only model building needs it)
    return torchvision


def torchvision_architectures() -> list[str]:
    tv = _torchvision()
    return sorted(tv.models.list_models(module=tv.models))


def _close(name: str, options) -> str:
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
            raise UserError(f"unknown timm architecture {name!r}{_close(name, timm.list_models())}")
        return timm.create_model(name, pretrained=False, num_classes=num_classes)
    _check_torchvision_architecture(arch)
    return _torchvision().models.get_model(arch, weights=None, num_classes=num_classes)


def _check_torchvision_architecture(arch: str) -> None:
    names = torchvision_architectures()
    if arch not in names:
        raise UserError(f"unknown architecture {arch!r}{_close(arch, names)}; --arch takes a torchvision "
                        f"classification model name, or timm:NAME with timm installed")


def classifier_keys(arch: str) -> list[str]:
    """State-dict keys whose shapes depend on the class count (the classifier), found by building both."""
    with torch.device("meta"):
        nine = build_architecture(arch, NUM_IN9_CLASSES).state_dict()
        full = build_architecture(arch, NUM_IMAGENET_CLASSES).state_dict()
    return [k for k in nine if nine[k].shape != full[k].shape]


def resolve_weights(arch: str, name: str | None):
    """The torchvision weights enum member for `--weights` (default: the published IMAGENET1K_V1)."""
    if arch == SMALL_CNN:
        raise UserError(f"{SMALL_CNN} has no pretrained weights; pass --checkpoint (or train it from scratch)")
    if arch.startswith(TIMM_PREFIX):
        raise UserError("pretrained timm weights are not downloaded by this toolkit; pass --checkpoint with the "
                        "weights file of the timm model")
    _check_torchvision_architecture(arch)
    tv = _torchvision()
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
        raise UserError(f"unknown weights {name!r} for {arch}{_close(short, members)}; "
                        f"valid: {', '.join(members + ['DEFAULT'])}")
    return enum[short]


def _download_weights(weights) -> tuple[dict, str]:
    url = weights.url
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
    try:
        state = weights.get_state_dict(progress=True, check_hash=True)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
        raise UserError(f"cannot download {url} ({getattr(exc, 'reason', exc)}); offline, fetch that file "
                        f"elsewhere and put it at {path} (set TORCH_HOME to move {path.parent.parent.parent})") from None
    return state, str(path)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints

def trained_checkpoint_header(obj) -> dict | None:
    """The toolkit's trained-checkpoint fields (arch, mean, std, ...) when `obj` is one, else None."""
    if not isinstance(obj, Mapping) or obj.get("format") != TRAINED_FORMAT:
        return None
    return {k: v for k, v in obj.items() if k != "model"}


def _archive_kind(path: Path) -> str:
    if not zipfile.is_zipfile(path):
        return "pickle"
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    if any(n.endswith("/archive_format") for n in names):
        return "export"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    return "pickle"


def _blocked_globals(path: Path, exc: Exception) -> list[str]:
    """The globals a weights-only load refused: listed from a zip checkpoint, else read off the error."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 (legacy, non-zip files: torch's message names the first one)
        return re.findall(r"Unsupported global: GLOBAL (\S+)", str(exc))


def _unpickling_problem(exc: Exception) -> str:
    """The useful line of an unpickling error (torch wraps weights-only failures in paragraphs of advice)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _torch_load(path: Path, trust: bool):
    if trust:
        log.warning("loading %s with full unpickling (--trust-checkpoint): only do this for files you trust", path)
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        blocked = [] if trust else _blocked_globals(path, exc)
        if blocked:
            raise UserError(f"checkpoint {path} needs arbitrary unpickling (blocked globals: {', '.join(blocked)}); "
                            f"if you trust the file, rerun with --trust-checkpoint") from None
        raise UserError(f"cannot read checkpoint {path}: it does not unpickle ({_unpickling_problem(exc)}); "
                        f"is it a PyTorch file?") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"cannot read checkpoint {path}: {str(exc).splitlines()[0]}; is it a PyTorch file?") from None
    except (ImportError, AttributeError) as exc:  # only with --trust-checkpoint: a class the file needs is missing
        raise UserError(f"cannot unpickle checkpoint {path}: {exc}; install the code that defines its classes, "
                        f"or save a state dict instead") from None


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _strip_prefixes(state: dict) -> dict:
    """Remove wrapper prefixes that every key carries (DataParallel/DDP, torch.compile), repeatedly."""
    changed = True
    while changed and state:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
                log.info("stripped the wrapper prefix %r from every key", prefix)
                changed = True
    return state


@dataclass
class CheckpointState:
    state_dict: dict
    layout: str
    normalizer: tuple | None  # (mean, std) from the robustness library's normaliser


def extract_state_dict(obj, key: str | None = None) -> CheckpointState:
    """The model's state dict from a loaded checkpoint object, and its layout and normaliser if any."""
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    where = "the top level"
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            found = ", ".join(map(str, obj.keys())) if isinstance(obj, Mapping) else type(obj).__name__
            raise UserError(f"--checkpoint-key {key!r} is not in the checkpoint (it has: {found})")
        obj, where = obj[key], f"key {key!r}"
    elif not _is_tensor_dict(obj) and isinstance(obj, Mapping):
        for candidate in STATE_DICT_KEYS:
            if candidate in obj and isinstance(obj[candidate], (Mapping, nn.Module)):
                obj, where = obj[candidate], f"key {candidate!r}"
                break
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if not _is_tensor_dict(obj):
        found = ", ".join(map(str, obj.keys())) if isinstance(obj, Mapping) else type(obj).__name__
        raise UserError(f"found no state dict in the checkpoint (top-level keys: {found}); pass "
                        f"--checkpoint-key with the key that holds the weights")
    log.info("reading the state dict at %s", where)
    state = _strip_prefixes(dict(obj))
    normalizer = None
    layout = f"state dict at {where}"
    if any(k.startswith("normalizer.") for k in state) and any(k.startswith("model.") for k in state):
        normalizer = (state.pop("normalizer.new_mean").flatten(), state.pop("normalizer.new_std").flatten())
        attacker = [k for k in state if k.startswith("attacker.")]
        for k in attacker:
            del state[k]
        log.info("robustness-library layout: normaliser buffers read, %d duplicate attacker.* keys dropped",
                 len(attacker))
        rest = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        others = [k for k in state if not k.startswith("model.")]
        if others:
            raise UserError(f"unexpected keys in the robustness-library checkpoint: {', '.join(others[:8])}")
        state = _strip_prefixes(rest)
        layout = f"robustness library (at {where})"
    return CheckpointState(state, layout, normalizer)


def _key_list(keys, limit: int = 8) -> str:
    keys = list(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_fits(state: Mapping, expected: Mapping, what: str) -> None:
    """Strict loading, checked first so that every problem is named (load_state_dict stops at a shape)."""
    problems = []
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {tuple(state[k].shape)} (the architecture has {tuple(v.shape)})"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing:
        problems.append(f"missing keys: {_key_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_key_list(unexpected)}")
    if mismatched:
        problems.append(f"shapes that differ: {_key_list(mismatched, limit=3)}")
    if problems:
        raise UserError(f"{what}: {'; '.join(problems)}")


def _check_class_count(num_classes: int, in9: bool | None, what: str) -> None:
    if num_classes not in SUPPORTED_CLASS_COUNTS:
        raise UserError(f"{what} has {num_classes} classes; the toolkit evaluates 9-class (IN-9) or 1000-class "
                        f"(ImageNet) models")
    if in9 is True and num_classes != NUM_IN9_CLASSES:
        raise UserError(f"--in9 says a 9-class model, but {what} has {num_classes} classes; drop --in9 or pass "
                        f"the 9-class checkpoint")


def _probe_classes(classifier: nn.Module, path: Path, kind: str) -> int:
    """The class count, from a forward pass on a batch of 3 (which also finds programs fixed to one batch size)."""
    try:
        with torch.inference_mode():
            out = classifier(torch.zeros(3, 3, IMAGE_SIZE, IMAGE_SIZE))
    except Exception as exc:  # noqa: BLE001 (any failure of a foreign program is the user's file)
        hint = ("; export it with a dynamic batch dimension (dynamic_shapes with torch.export.Dim) or save it as "
                "TorchScript/state dict") if kind == "export" else ""
        raise UserError(f"the model in {path} fails on a 3x3x{IMAGE_SIZE}x{IMAGE_SIZE} input: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}{hint}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise UserError(f"the model in {path} does not return a (batch, classes) tensor of logits")
    return int(out.shape[1])


class ExportedModule(nn.Module):
    """A torch.export program as a module. Its mode was fixed when it was exported and the program refuses
    train()/eval(), so those set this wrapper's flag and do not reach into it."""

    def __init__(self, program: nn.Module):
        super().__init__()
        self.program = program

    def train(self, mode: bool = True) -> "ExportedModule":
        self.training = mode
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(x)


def _load_program(path: Path, kind: str) -> nn.Module:
    try:
        if kind == "torchscript":
            with warnings.catch_warnings():  # TorchScript is deprecated upstream, yet users' files are TorchScript
                warnings.simplefilter("ignore", FutureWarning)
                return torch.jit.load(str(path), map_location="cpu")
        return ExportedModule(torch.export.load(str(path)).module())
    except Exception as exc:  # noqa: BLE001 (a broken archive is the user's file)
        raise UserError(f"cannot load the {kind} program {path}: {str(exc).splitlines()[0]}") from None


def load_model(arch: str | None = None, weights: str | None = None, checkpoint: Path | str | None = None,
               in9: bool | None = None, normalize: Normalization = Normalization.AUTO, trust: bool = False,
               checkpoint_key: str | None = None) -> LoadedModel:
    """Build the classifier the command line describes, wrapped to take pixels. Strict: no silent partial loads.

    arch: None means the checkpoint's own (a trained checkpoint names it), else resnet50.
    in9: True (--in9), or None to follow the checkpoint's class count.
    """
    normalizer = None
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_file():
            raise UserError(f"checkpoint {path} does not exist; check --checkpoint")
        if weights is not None:
            raise UserError("--weights and --checkpoint both give the model's weights; pass one of them")
        kind = _archive_kind(path)
        if kind in ("torchscript", "export"):
            classifier = _load_program(path, kind)
            num_classes = _probe_classes(classifier, path, kind)
            _check_class_count(num_classes, in9, f"the model in {path}")
            layout, arch_name = ("TorchScript" if kind == "torchscript" else "torch.export"), None
        else:
            obj = _torch_load(path, trust)
            header = trained_checkpoint_header(obj)
            if header is not None:
                if arch is not None and arch != header["arch"]:
                    raise UserError(f"--arch {arch} contradicts checkpoint {path}, which holds a trained "
                                    f"{header['arch']}; drop --arch")
                arch = header["arch"]
                log.info("trained checkpoint (%s, method %s): architecture and normaliser from the file",
                         arch, header.get("method"))
            arch = arch or DEFAULT_ARCH
            state = extract_state_dict(obj, checkpoint_key)
            layout, normalizer, arch_name = state.layout, state.normalizer, arch
            if header is not None:
                normalizer = (torch.tensor(header["mean"]), torch.tensor(header["std"]))
                layout = f"trained checkpoint {TRAINED_FORMAT}"
            keys = classifier_keys(arch)
            present = [k for k in keys if k in state.state_dict]
            if not present:
                raise UserError(f"checkpoint {path} has no classifier keys of {arch} ({_key_list(keys)}); "
                                f"is --arch right?")
            num_classes = int(state.state_dict[present[0]].shape[0])
            _check_class_count(num_classes, in9, f"checkpoint {path}")
            classifier = build_architecture(arch, num_classes)
            _check_fits(state.state_dict, classifier.state_dict(), f"checkpoint {path} does not fit --arch {arch}")
            classifier.load_state_dict(state.state_dict, strict=True)
        source, digest, weights_name = str(path), sha256_file(path), None
    else:
        if in9:
            raise UserError("--in9 needs --checkpoint: there are no pretrained 9-class weights to download")
        arch = arch or DEFAULT_ARCH
        member = resolve_weights(arch, weights)
        classifier = build_architecture(arch, NUM_IMAGENET_CLASSES)
        state, source = _download_weights(member)
        classifier.load_state_dict(state, strict=True)
        num_classes, layout, arch_name = NUM_IMAGENET_CLASSES, "torchvision weights", arch
        digest, weights_name = sha256_file(source), f"{type(member).__name__}.{member.name}"
    if in9 is None and num_classes == NUM_IN9_CLASSES:
        log.info("the checkpoint has 9 classes: evaluating as an IN-9 model (as with --in9)")

    if normalize is Normalization.AUTO and normalizer is not None:
        mean, std = normalizer
        norm_text = f"checkpoint normaliser (mean {[round(float(v), 4) for v in mean]}, std " \
                    f"{[round(float(v), 4) for v in std]})"
    else:
        stats = statistics_for(normalize, num_classes)
        mean, std = stats if stats is not None else (None, None)
        if normalize is Normalization.AUTO:
            norm_text = "in9 (9-class rule)" if num_classes == NUM_IN9_CLASSES else "imagenet (1000-class rule)"
        else:
            norm_text = f"{normalize.value} (--normalize)"
    classifier.eval()
    return LoadedModel(PixelModel(classifier, mean, std).eval(), num_classes, arch_name, weights_name, source,
                       digest, layout, norm_text)
