"""Reading a checkpoint file into a classifier, strictly: no silent partial loads. Formats are told apart by content,
never by name: a `torch.export` program (vetted by `tools.models.export_archive`) or, trusted, a TorchScript one, used
as is and loaded for the run's device; a weights-only pickle holding a state dict in one of several layouts
(peft-wrapped: `tools.models.adapters`; train.py's and timm's training checkpoints: `tools.models.recorded`); trusted, a
whole pickled module. The list: docs/how-it-works.md, "Models and checkpoints".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, first_line, key_list, option
from tools.in9 import IMAGE_SIZE, NUM_IMAGENET_CLASSES, NUM_IN9_CLASSES, SUPPORTED_CLASS_COUNTS, Normalization
from tools.models import adapters, hub
from tools.models.architectures import (
    DEFAULT_ARCH,
    build_architecture,
    classifier_keys,
    recorded_arguments,
    timm_module,
)
from tools.models.loading import check_fits, torch_load
from tools.models.programs import (
    EXPORT_BATCH_HINT,
    check_program_trusted,
    exact_kernel_hint,
    load_program,
    program_kind,
    program_problem,
)
from tools.models.record import ModelRecord
from tools.models.recorded import (
    TRAINED_FORMAT,
    is_timm_training_checkpoint,
    recorded_architecture,
    recorded_network,
    recorded_normaliser,
    timm_architecture_args,
    timm_data_args,
    timm_training_weights,
    trained_checkpoint_header,
)
from tools.models.spec import TIMM_HUB, TIMM_PREFIX, ModelSpec
from tools.runtime.precision import exact_kernels

log = logging.getLogger(__name__)

STATE_DICT_KEYS = ("model", "state_dict", "state_dict_ema", "model_state_dict")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _is_tensor_dict(obj) -> bool:
    return (isinstance(obj, Mapping) and bool(obj)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


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


def _select(obj, key: str | None) -> tuple[object, str]:
    """The part of a loaded checkpoint that holds the model (`key`, else by STATE_DICT_KEYS), and where it is."""
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            found = ", ".join(map(str, obj.keys())) if isinstance(obj, Mapping) else type(obj).__name__
            raise UserError(f"{option('--checkpoint-key')} {key!r} is not in the checkpoint (it has: {found})")
        return obj[key], f"key {key!r}"
    if isinstance(obj, Mapping) and not _is_tensor_dict(obj):
        for candidate in STATE_DICT_KEYS:
            if candidate in obj and isinstance(obj[candidate], (Mapping, nn.Module)):
                return obj[candidate], f"key {candidate!r}"
    return obj, "the top level"


@dataclass
class CheckpointState:
    state_dict: dict
    layout: str
    normalizer: tuple | None  # (mean, std) from the robustness library's normaliser


def extract_state_dict(obj, key: str | None = None, ignore_normalizer: bool = False) -> CheckpointState:
    """The model's state dict, layout and normaliser; ignore_normalizer: statistics are given, so unreadable normaliser
    buffers are dropped."""
    obj, where = _select(obj, key)
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if not _is_tensor_dict(obj):
        found = ", ".join(map(str, obj.keys())) if isinstance(obj, Mapping) else type(obj).__name__
        raise UserError(f"found no state dict in the checkpoint (top-level keys: {found}); pass "
                        f"{option('--checkpoint-key')} with the key that holds the weights")
    log.info("reading the state dict at %s", where)
    state = _strip_prefixes(dict(obj))
    normalizer = None
    layout = f"state dict at {where}"
    if any(k.startswith("normalizer.") for k in state) and any(k.startswith("model.") for k in state):
        buffers = sorted(k for k in state if k.startswith("normalizer."))
        if "normalizer.new_mean" in state and "normalizer.new_std" in state:
            normalizer = (state.pop("normalizer.new_mean").flatten(), state.pop("normalizer.new_std").flatten())
        elif not ignore_normalizer:
            raise UserError(f"robustness-library checkpoint whose normaliser buffers are not normalizer.new_mean/"
                            f"new_std (it has: {key_list(buffers)}); pass {option('--normalize', 'imagenet')}, "
                            f"{option('--normalize', 'in9')} or {option('--normalize', 'none')} to say "
                            f"which statistics the model was trained with")
        for k in buffers:
            state.pop(k, None)
        attacker = [k for k in state if k.startswith("attacker.")]
        for k in attacker:
            del state[k]
        log.info("robustness-library layout: normaliser buffers read, %d duplicate attacker.* keys dropped",
                 len(attacker))
        rest = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        others = [k for k in state if not k.startswith("model.")]
        if others:
            raise UserError(f"unexpected keys in the robustness-library checkpoint: {key_list(others)}")
        state = _strip_prefixes(rest)
        layout = f"robustness library (at {where})"
    return CheckpointState(state, layout, normalizer)


def check_class_count(num_classes: int, in9: bool | None, what: str) -> None:
    if num_classes not in SUPPORTED_CLASS_COUNTS:
        raise UserError(f"{what} has {num_classes} classes; the toolkit evaluates 9-class (IN-9) or 1000-class "
                        f"(ImageNet) models")
    if in9 is True and num_classes != NUM_IN9_CLASSES:
        raise UserError(f"{option('--in9')} says a 9-class model, but {what} has {num_classes} classes; drop "
                        f"{option('--in9')} or pass "
                        f"the 9-class checkpoint")
    if in9 is False and num_classes != NUM_IMAGENET_CLASSES:
        raise UserError(f"{option('--no-in9')} says a 1000-class ImageNet model, but {what} has {num_classes} classes; "
                        f"drop {option('--no-in9')} or pass the ImageNet checkpoint")


def _probe_classes(classifier: nn.Module, path: Path, kind: str, device: torch.device) -> int:
    """The class count, from a batch of 3 on the run's device in the exact mode's kernels."""
    probe = torch.zeros(3, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    try:
        with torch.inference_mode(), exact_kernels():
            out = classifier(probe)
    except Exception as exc:  # noqa: BLE001 (any failure of a foreign program is the user's file)
        hint = exact_kernel_hint(classifier) if kind == "export" and _runs(classifier, probe) else None
        if hint is None:
            hint = f"; {EXPORT_BATCH_HINT} or save it as TorchScript/state dict" if kind == "export" else ""
        raise UserError(f"the model in {path} fails on a 3x3x{IMAGE_SIZE}x{IMAGE_SIZE} input on {device}: "
                        f"{program_problem(exc)}{hint}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise UserError(f"the model in {path} does not return a (batch, classes) tensor of logits")
    return int(out.shape[1])


def _runs(classifier: nn.Module, probe: torch.Tensor) -> bool:
    """Whether the classifier runs on `probe` in the kernels torch picks itself (outside the exact mode's)."""
    try:
        with torch.inference_mode():
            classifier(probe)
    except Exception:  # noqa: BLE001 (a foreign program's failure, whatever it is)
        return False
    return True


def _architecture(arch: str | None, recorded: str | None, path: Path) -> str:
    """--arch, else the recorded architecture, else resnet50; a recorded one that --arch contradicts is an error."""
    if arch is not None and recorded is not None and arch != recorded:
        raise UserError(f"{option('--arch', arch)} contradicts checkpoint {path}, which records architecture "
                        f"{recorded}; name {recorded} (or no architecture) or pass the right checkpoint")
    if arch is None and recorded is not None:
        _check_cached(recorded, path)
        log.info("architecture %s, as the checkpoint records", recorded)
    return arch or recorded or DEFAULT_ARCH


def _check_cached(recorded: str, path: Path) -> None:
    """A recorded `timm:hf-hub:` architecture must be cached: it is downloaded only where the user names it."""
    spec = ModelSpec.parse(recorded)
    if spec.prefix != TIMM_PREFIX or not spec.name.startswith(TIMM_HUB):
        return
    timm_module(spec)  # the line naming its install, before the cache (huggingface_hub comes with timm)
    if hub.cached_file(spec.name[len(TIMM_HUB):], ["config.json"]) is None:
        raise UserError(f"checkpoint {path} records the architecture {recorded}, whose config.json is not in the "
                        f"Hugging Face cache {hub.cache_folder()}; name it with {option('--arch', recorded)} to "
                        f"fetch it from the Hub")


@dataclass
class ReadCheckpoint:
    """A classifier read from a checkpoint file, and what the file said about it."""

    classifier: nn.Module
    num_classes: int
    arch: str | None  # None for a program, which carries its own
    normalizer: tuple | None  # (mean, std) from the file, if it has them
    layout: str
    arch_args: dict = field(default_factory=dict)  # the builder's other arguments, as train.py's checkpoints record
    input: tuple | None = None  # ((height, width), interpolation) the network is fed at, where the file records it
    data_args: dict | None = None  # the data settings of timm's train.py, for a checkpoint of it


def read_checkpoint(path: Path, arch: str | None, in9: bool | None, normalize: Normalization, trust: bool,
                    checkpoint_key: str | None, device: torch.device, record: ModelRecord,
                    lora: adapters.LoraScaling | None = None) -> ReadCheckpoint:
    """The classifier in a checkpoint file: a program loaded for `device` and probed there, or a state dict loaded
    strictly into `arch` (default resnet50) on the CPU; the file recorded by content."""
    if path.is_dir():
        raise UserError(f"checkpoint {path} is a folder without {adapters.ADAPTER_CONFIG}; pass a checkpoint file, "
                        f"or a peft adapter folder on a base model ({option('--arch', 'ARCH@file:ADAPTER_DIR')})")
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; check the path")
    record.read_file(path, "checkpoint")
    kind = program_kind(path)
    if kind is not None:
        check_program_trusted(path, kind, trust)
        classifier = load_program(path, kind, device)
        if arch is not None:
            log.warning("%s is ignored: %s is a %s program, which carries its own architecture",
                        option("--arch", arch), path, kind)
        num_classes = _probe_classes(classifier, path, kind, device)
        check_class_count(num_classes, in9, f"the model in {path}")
        return ReadCheckpoint(classifier, num_classes, None, None,
                              "TorchScript" if kind == "torchscript" else "torch.export")
    obj = torch_load(path, trust)
    module = _pickled_module(obj, checkpoint_key)
    if module is not None:  # only unpickled with --trust-checkpoint
        record.code(module)  # its classes' code is not in the file
        return _read_module(module, path, arch, in9, lora)
    recorded = recorded_architecture(obj)
    named = arch is not None or recorded is not None
    arch = _architecture(arch, recorded, path)
    data_args, weights_chosen = None, f"as {option('--checkpoint-key')} says"
    arch_args, network_input = {}, None
    if is_timm_training_checkpoint(obj):
        data_args, arch_args = timm_data_args(obj), timm_architecture_args(obj)
        if checkpoint_key is None:
            checkpoint_key, weights_chosen = timm_training_weights(obj)
        log.info("timm training checkpoint (%s%s): weights at %r, %s; data settings from its args: %s", arch,
                 f", built with {arch_args}" if arch_args else "", checkpoint_key, weights_chosen,
                 data_args or "none (the tag's)")
    state = extract_state_dict(obj, checkpoint_key, ignore_normalizer=normalize is not Normalization.AUTO)
    if data_args is not None:
        state.layout = f"timm training checkpoint, {checkpoint_key}: {weights_chosen}"
    header = trained_checkpoint_header(obj)
    if header is not None:  # train.py's checkpoint: its architecture (above), builder arguments, input and normaliser
        log.info("trained checkpoint (%s, method %s): architecture and normaliser from the file", arch,
                 header.get("method"))
        state.normalizer = recorded_normaliser(header, path)
        state.layout = f"trained checkpoint {TRAINED_FORMAT}"
        arch_args, network_input = recorded_network(header, path)
    arch_args = recorded_arguments(arch, arch_args, f"checkpoint {path}")  # before any builder runs
    peft_state = adapters.read_peft_state(state.state_dict, path) if adapters.is_peft_state(state.state_dict) else None
    if lora is not None and lora.given() and (peft_state is None or peft_state.kind != "lora"):
        raise lora.misplaced(f"which checkpoint {path} is not")
    base = peft_state.base if peft_state is not None else state.state_dict
    keys = classifier_keys(arch, arch_args)
    present = [k for k in keys if k in base]
    if not present:
        hint = (f"is {option('--arch', arch)} right?" if named else "the checkpoint does not record its "
                f"architecture, so resnet50 was tried; name it with {option('--arch', 'NAME@file:PATH')}")
        raise UserError(f"checkpoint {path} has no classifier keys of {arch} ({key_list(keys)}); {hint}")
    if base[present[0]].ndim == 0:
        raise UserError(f"checkpoint {path} holds a single number at {present[0]}, where {arch} has its classifier's "
                        f"weights; is it a checkpoint of {arch}?")
    num_classes = int(base[present[0]].shape[0])
    check_class_count(num_classes, in9, f"checkpoint {path}")
    try:
        classifier = build_architecture(arch, num_classes, arch_args)
    except TypeError as exc:  # arguments the installed library's builder does not take
        if not arch_args:
            raise
        raise UserError(f"checkpoint {path} records builder arguments {arch_args} that {arch} does not take here "
                        f"({first_line(exc)}); is the library that defines {arch} older than the one it was "
                        f"trained with?") from None
    if peft_state is not None:
        classifier = adapters.merge_peft_state(classifier, state.state_dict, peft_state, lora, path, record)
        return ReadCheckpoint(classifier, num_classes, arch, state.normalizer,
                              f"{state.layout}, peft {peft_state.kind} (merged)", arch_args, network_input, data_args)
    check_fits(state.state_dict, classifier.state_dict(), f"checkpoint {path} does not fit {option('--arch', arch)}")
    classifier.load_state_dict(state.state_dict, strict=True)
    return ReadCheckpoint(classifier, num_classes, arch, state.normalizer, state.layout, arch_args, network_input,
                          data_args)


def _pickled_module(obj, key: str | None) -> nn.Module | None:
    chosen, _ = _select(obj, key) if isinstance(obj, Mapping) or key is not None else (obj, "")
    return chosen if isinstance(chosen, nn.Module) else None


def _read_module(module: nn.Module, path: Path, arch: str | None, in9: bool | None,
                 lora: adapters.LoraScaling | None) -> ReadCheckpoint:
    """A pickled module as is; its class count probed in evaluation mode (batch-norm statistics stay as saved)."""
    if lora is not None and lora.given():
        raise lora.misplaced(f"and {path} holds a whole module")
    if arch is not None:
        log.warning("%s is ignored: %s holds a whole pickled module, which carries its own architecture",
                    option("--arch", arch), path)
    cls = type(module)
    module.eval()
    num_classes = _probe_classes(module, path, "module", torch.device("cpu"))
    check_class_count(num_classes, in9, f"the model in {path}")
    return ReadCheckpoint(module, num_classes, None, None, f"pickled module {cls.__module__}.{cls.__qualname__}")
