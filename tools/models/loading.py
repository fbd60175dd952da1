"""Unpickling a checkpoint safely (`weights_only` unless trusted; an unsafe or unreadable file is one error line) and
loading a state dict strictly (every bad key named), for `checkpoints` and `adapters`.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from tools.errors import UserError, first_line, key_list, option

log = logging.getLogger(__name__)


def _blocked_globals(path: Path, exc: Exception) -> list[str]:
    """The globals a weights-only load refused, the file's own then torch's, each sorted (torch's order varies)."""
    allowed = {f"{cls.__module__}.{cls.__qualname__}" for cls in SAFE_CLASSES}
    try:
        found = list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 (legacy, non-zip files: torch's message names the first one)
        found = re.findall(r"Unsupported global: GLOBAL (\S+)", str(exc))
    return sorted((name for name in found if name not in allowed), key=lambda name: (name.startswith("torch."), name))


def unpickling_problem(exc: Exception) -> str:
    """The useful line of an unpickling error (torch wraps weights-only failures in paragraphs of advice)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# Classes the weights-only unpickler may build besides tensors and plain data, for this reading alone: an
# argparse.Namespace (timm's train.py saves its command line as one, `args`) is a bag of attributes, no code.
SAFE_CLASSES = (argparse.Namespace,)


# torch's switch that makes torch.load unpickle in full wherever its caller does not say weights_only, as torch reads it
FULL_UNPICKLING_SWITCH = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def full_unpickling_forced() -> bool:
    """Whether `FULL_UNPICKLING_SWITCH` makes a load without weights_only run a pickle's code."""
    return os.environ.get(FULL_UNPICKLING_SWITCH, "0").lower() in ("1", "y", "yes", "true")


def torch_load(path: Path, trust: bool):
    """The unpickled file: weights-only (SAFE_CLASSES allowed) unless trusted; else one error line."""
    if trust:
        log.warning("loading %s with full unpickling (%s): only do this for files you trust", path,
                    option("--trust-checkpoint"))
    try:
        if trust:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(list(SAFE_CLASSES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        blocked = [] if trust else _blocked_globals(path, exc)
        if blocked:
            raise UserError(f"checkpoint {path} needs arbitrary unpickling (blocked globals: {key_list(blocked)}); "
                            f"if you trust the file, rerun with {option('--trust-checkpoint')}") from None
        raise UserError(f"cannot read checkpoint {path}: it does not unpickle ({unpickling_problem(exc)}); "
                        f"is it a PyTorch file?") from None
    except (ImportError, AttributeError) as exc:
        if trust:  # a class the file needs is missing
            raise UserError(f"cannot unpickle checkpoint {path}: {first_line(exc)}; install the code that defines its "
                            f"classes, or save a state dict instead") from None
        raise UserError(f"cannot read checkpoint {path}: {read_problem(exc)}; is it a PyTorch file?") from None
    except Exception as exc:  # noqa: BLE001 (a damaged or foreign file fails anywhere in torch's readers)
        raise UserError(f"cannot read checkpoint {path}: {read_problem(exc)}; is it a PyTorch file?") from None


def read_problem(exc: Exception) -> str:
    """Why torch.load could not read a file, in one line (for an unpickler's error on bytes that are no pickle: that it
    does not unpickle)."""
    if isinstance(exc, EOFError):  # an empty or cut file: torch's message, if any, says only "Ran out of input"
        return f"it ends too early ({type(exc).__name__}{': ' + first_line(exc) if str(exc).strip() else ''})"
    if isinstance(exc, (RuntimeError, OSError, ValueError)) and type(exc).__module__ == "builtins":
        return first_line(exc)
    return f"it does not unpickle ({type(exc).__name__}: {first_line(exc)})"


def check_fits(state: Mapping, expected: Mapping, what: str) -> None:
    """Strict loading, checked first so that every problem is named (load_state_dict stops at a shape)."""
    problems = []
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [f"{k} {tuple(state[k].shape)} (the architecture has {tuple(v.shape)})"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing:
        problems.append(f"missing keys: {key_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {key_list(unexpected)}")
    if mismatched:
        problems.append(f"shapes that differ: {key_list(mismatched, limit=3)}")
    if problems:
        raise UserError(f"{what}: {'; '.join(problems)}")
