"""Files a training run writes: the trained checkpoint the evaluation scripts load, and the resume state.

Both are written to a temporary file and renamed into place, so a kill at any moment leaves either the
previous file or the new one, never half of one.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, first_line
from tools.in9 import NUM_IN9_CLASSES
from tools.models.checkpoints import TRAINED_FORMAT
from tools.provenance import atomic_write
from tools.runtime import Precision

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
STATE_NAME = "resume_state.pt"


def save_atomic(payload, path: Path) -> None:
    with atomic_write(path, "wb") as fh:
        torch.save(payload, fh)


def trained_checkpoint(classifier: nn.Module, arch: str, mean, std, method: str, data: dict, train_args: dict,
                       precision: Precision) -> dict:
    """The toolkit's checkpoint format: a 9-class state dict with what is needed to rebuild and normalise it, and
    the precision training ran in (train_args holds --precision as given, None for the device's default)."""
    return {"format": TRAINED_FORMAT, "arch": arch, "num_classes": NUM_IN9_CLASSES,
            "mean": [float(v) for v in torch.as_tensor(mean).flatten()],
            "std": [float(v) for v in torch.as_tensor(std).flatten()],
            "model": {k: v.detach().cpu().clone() for k, v in classifier.state_dict().items()},
            "method": method, "data": data, "train_args": train_args, "precision": precision.value}


def load_resume_state(output_dir: Path, run_key: dict, earlier_key: dict | None = None) -> dict | None:
    """The saved state of an interrupted run with the same settings, or None when there is none. `earlier_key`:
    the same settings as an earlier version keyed them, accepted too."""
    path = Path(output_dir) / STATE_NAME
    if not path.is_file():
        log.warning("--resume: no saved state in %s, starting afresh", output_dir)
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds more than tensors and plain data (saved by an older version?), so it is not "
                        f"read; rerun without --resume, or with another --output-dir") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:  # empty, truncated, unreadable
        raise UserError(f"cannot read {path} ({first_line(exc)}); rerun without "
                        f"--resume, or with another --output-dir") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a resume state of train.py; rerun without --resume, or with another "
                        f"--output-dir")
    if state.get("run_key") not in (run_key, earlier_key or run_key):
        raise UserError(f"{path} was saved by a run with other settings or data; rerun without --resume, or with "
                        f"another --output-dir")
    return state
