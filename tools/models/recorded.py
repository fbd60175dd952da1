"""What a checkpoint file records about its model besides the weights: train.py's header and timm's train.py's model,
data settings and ranked weights, each checked as read (a malformed record is one error line).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from tools.errors import UserError
from tools.models.spec import TIMM_PREFIX

TRAINED_FORMAT = "bg-challenge-toolkit/1"  # the `format` value of the checkpoints train.py writes


def trained_checkpoint_header(obj) -> dict | None:
    """The toolkit's trained-checkpoint fields (arch, mean, std, method, ...) when `obj` is one, else None."""
    if not isinstance(obj, Mapping) or obj.get("format") != TRAINED_FORMAT:
        return None
    return {k: v for k, v in obj.items() if k != "model"}


TIMM_TRAINING_KEYS = {"arch", "state_dict", "version", "args"}  # what timm's train.py (its CheckpointSaver) writes
# The settings of timm's train.py that `timm.data.resolve_data_config` reads: the pixel pipeline the model trained on
TIMM_DATA_ARGS = ("in_chans", "chans", "input_size", "img_size", "interpolation", "mean", "std", "crop_pct",
                  "crop_mode")


def is_timm_training_checkpoint(obj) -> bool:
    """A checkpoint of timm's own train.py (`model_best.pth.tar`, `last.pth.tar`), told by its keys."""
    return isinstance(obj, Mapping) and TIMM_TRAINING_KEYS <= obj.keys() and obj.get("format") != TRAINED_FORMAT


def _timm_args(obj) -> dict:
    """timm's train.py `args` (an argparse.Namespace; a mapping in some forks) as a dict."""
    args = obj.get("args")
    if isinstance(args, Mapping):
        return dict(args)
    return dict(vars(args)) if hasattr(args, "__dict__") else {}


def timm_training_weights(obj) -> tuple[str, str]:
    """(the key of the weights timm's train.py ranked the checkpoint by, which those are): the EMA's where it validated
    one, else `state_dict`."""
    has_ema = isinstance(obj.get("state_dict_ema"), Mapping) and bool(obj["state_dict_ema"])
    args = _timm_args(obj)
    if not has_ema:
        return "state_dict", "the model's weights (it kept no EMA)"
    if args.get("model_ema_force_cpu"):
        return "state_dict", ("the model's weights: its EMA stayed on the CPU unvalidated (timm's "
                              "`--model-ema-force-cpu`)")
    if not args.get("val_split", "validation"):  # timm's default split when its args predate the setting
        return "state_dict", ("the model's weights: no validation split (timm's `--val-split ''`), so no EMA was "
                              "validated")
    return "state_dict_ema", "the EMA's weights, by whose validation timm's train.py ranked it"


# The settings timm's train.py builds its model with besides the name and the class count (`create_model`'s
# arguments, a None left out as timm leaves it out) that make the evaluated network: its global pool, BatchNorm's
# epsilon and `--model-kwargs`. The rest act in training alone (drop rates, BatchNorm's momentum) or are refused by
# the weights' shapes (in_chans).
TIMM_ARCH_ARGS = {"gp": "global_pool", "bn_eps": "bn_eps"}


def timm_architecture_args(obj) -> dict:
    """The builder arguments a timm training checkpoint records (TIMM_ARCH_ARGS and `model_kwargs`) that are set."""
    args = _timm_args(obj)
    built = {argument: args.get(setting) for setting, argument in TIMM_ARCH_ARGS.items()}
    model_kwargs = args.get("model_kwargs")
    if isinstance(model_kwargs, Mapping):
        built.update(model_kwargs)
    return {key: value for key, value in built.items() if value is not None}


def timm_data_args(obj) -> dict:
    """The data settings a timm training checkpoint records (TIMM_DATA_ARGS that are set)."""
    args = _timm_args(obj)
    return {key: args[key] for key in TIMM_DATA_ARGS if args.get(key) not in (None, "")}


def recorded_architecture(obj) -> str | None:
    """The architecture recorded under "arch", if any; timm's train.py's bare name is `timm:NAME`."""
    arch = obj.get("arch") if isinstance(obj, Mapping) else None
    if not isinstance(arch, str) or not arch:
        return None
    return f"{TIMM_PREFIX}{arch}" if is_timm_training_checkpoint(obj) and not arch.startswith(TIMM_PREFIX) else arch


def recorded_normaliser(header: dict, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) a trained checkpoint records: three numbers each, the deviations positive."""
    stats = []
    for name in ("mean", "std"):
        values = header.get(name)
        if (not isinstance(values, (list, tuple)) or len(values) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values)
                or (name == "std" and min(values) <= 0)):
            raise UserError(f"checkpoint {path} records a normaliser {name} of {values!r}, not three numbers (the "
                            f"deviations positive); is it a checkpoint train.py wrote?")
        stats.append(torch.tensor([float(v) for v in values]))
    return stats[0], stats[1]


def recorded_network(header: dict, path: Path) -> tuple[object, tuple | None]:
    """(builder arguments, ((height, width), interpolation)) a trained checkpoint records, unchecked; older ones record
    neither."""
    arch_args, size = header.get("arch_args") or {}, header.get("input_size")
    mode = header.get("interpolation") or "bicubic"
    if size is None:
        return arch_args, None
    if (not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
            or mode not in ("bilinear", "bicubic")):
        raise UserError(f"checkpoint {path} records an input of {size!r} pixels resized {mode!r}; a trained checkpoint "
                        f"records [height, width] and bilinear or bicubic: is it a checkpoint train.py wrote?")
    return arch_args, (tuple(size), mode)
