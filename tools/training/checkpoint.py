"""Files a training run writes: the trained checkpoint the evaluation scripts load, and the resume state.

Both are written to a temporary file and renamed into place, so a kill at any moment leaves either the
previous file or the new one, never half of one. The periodic resume state is written by one background thread
(BackgroundSaver) from a CPU copy taken at the save, so training goes on while the file is written and synced.
"""

from __future__ import annotations

import logging
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, first_line
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES
from tools.models.boundary import InputResize
from tools.models.checkpoints import TRAINED_FORMAT
from tools.models.loading import read_problem
from tools.provenance import atomic_write
from tools.runtime import Precision

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
STATE_NAME = "resume_state.pt"


def save_atomic(payload, path: Path) -> None:
    with atomic_write(path, "wb") as fh:
        torch.save(payload, fh)


def cpu_snapshot(payload):
    """`payload` with every tensor copied to the CPU (a copy even of a CPU tensor) and every container rebuilt:
    what a background write may read while training goes on changing the model and optimiser in place."""
    if isinstance(payload, torch.Tensor):
        return payload.detach().to("cpu", copy=True)
    if isinstance(payload, dict):
        return type(payload)((k, cpu_snapshot(v)) for k, v in payload.items())
    if isinstance(payload, (list, tuple)):
        return type(payload)(cpu_snapshot(v) for v in payload)
    return payload


class BackgroundSaver:
    """Writes payloads with save_atomic in one background thread, at most one write in flight: a save first
    waits for the write before it. An error of a write is raised, once, by the next save or by `wait`."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, payload, path: Path) -> None:
        self.wait()
        snapshot = cpu_snapshot(payload)  # taken now: the caller changes the tensors once this returns
        self._thread = threading.Thread(target=self._write, args=(snapshot, path), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _write(self, payload, path: Path) -> None:
        try:
            save_atomic(payload, path)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
            self._error = exc

    def wait(self) -> None:
        """Wait for the write in flight; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def __enter__(self) -> BackgroundSaver:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Wait for the write in flight, so the last state is complete on disk. After another error (Ctrl-C
        included) an error of the write is logged rather than raised, so the first error is the one reported."""
        if exc_type is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001
            log.error("writing the resume state failed too: %s", first_line(error))


@dataclass(frozen=True)
class NetworkInput:
    """How a network is rebuilt and fed besides its architecture's name: the builder's other arguments
    (`build_architecture`), its input size, and the interpolation that resizes the 224x224 images to it (None: 224)."""

    arch_args: dict = field(default_factory=dict)
    input_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)
    interpolation: str | None = None

    def in_front(self, network: nn.Module) -> nn.Module:
        """The network behind the resize to its input size, as the evaluation feeds it (`fit_input_size`)."""
        return network if self.interpolation is None else InputResize(network, self.input_size, self.interpolation)


def trained_checkpoint(classifier: nn.Module, arch: str, mean, std, method: str, data: dict, train_args: dict,
                       precision: Precision, network: NetworkInput = NetworkInput()) -> dict:
    """The toolkit's checkpoint format: a 9-class state dict of the network itself with what is needed to rebuild,
    feed and normalise it, and the precision training ran in (train_args holds --precision as given, None for the
    device's default)."""
    return {"format": TRAINED_FORMAT, "arch": arch, "num_classes": NUM_IN9_CLASSES,
            "arch_args": dict(network.arch_args), "input_size": [int(v) for v in network.input_size],
            "interpolation": network.interpolation,
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
    except Exception as exc:  # noqa: BLE001 (empty, truncated, damaged: it fails anywhere in torch's readers)
        raise UserError(f"cannot read {path} ({read_problem(exc)}); rerun without "
                        f"--resume, or with another --output-dir") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a resume state of train.py; rerun without --resume, or with another "
                        f"--output-dir")
    if state.get("run_key") not in (run_key, earlier_key or run_key):
        raise UserError(f"{path} was saved by a run with other settings or data; rerun without --resume, or with "
                        f"another --output-dir")
    return state
