"""Files a training run writes, atomically: the trained checkpoint the evaluation scripts load, and the resume
state (written by a background thread from a CPU copy, so training goes on meanwhile)."""

from __future__ import annotations

import logging
import math
import pickle
import threading
from collections.abc import Sequence
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
    """`payload` with every tensor copied to the CPU and every container rebuilt: training changes the originals."""
    if isinstance(payload, torch.Tensor):
        return payload.detach().to("cpu", copy=True)
    if isinstance(payload, dict):
        return type(payload)((k, cpu_snapshot(v)) for k, v in payload.items())
    if isinstance(payload, (list, tuple)):
        return type(payload)(cpu_snapshot(v) for v in payload)
    return payload


class BackgroundSaver:
    """Writes payloads with save_atomic in one background thread, one write in flight at most; a write's error is
    raised, once, by the next save or `wait`."""

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
        """Wait for the write in flight; after another error (Ctrl-C too) the write's error is only logged."""
        if exc_type is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as error:  # noqa: BLE001
            log.error("writing the resume state failed too: %s", first_line(error))


@dataclass(frozen=True)
class NetworkInput:
    """How a network is rebuilt and fed besides its architecture's name (interpolation None: it takes 224x224)."""

    arch_args: dict = field(default_factory=dict)
    input_size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)
    interpolation: str | None = None

    def in_front(self, network: nn.Module) -> nn.Module:
        """The network behind the resize to its input size, as the evaluation feeds it."""
        return network if self.interpolation is None else InputResize(network, self.input_size, self.interpolation)


def trained_checkpoint(classifier: nn.Module, arch: str, mean, std, method: str, data: dict, train_args: dict,
                       precision: Precision, network: NetworkInput = NetworkInput()) -> dict:
    """The toolkit's checkpoint format: the 9-class network's state dict with what rebuilds, feeds and normalises
    it, and the precision training ran in."""
    return {"format": TRAINED_FORMAT, "arch": arch, "num_classes": NUM_IN9_CLASSES,
            "arch_args": dict(network.arch_args), "input_size": [int(v) for v in network.input_size],
            "interpolation": network.interpolation,
            "mean": [float(v) for v in torch.as_tensor(mean).flatten()],
            "std": [float(v) for v in torch.as_tensor(std).flatten()],
            "model": {k: v.detach().cpu().clone() for k, v in classifier.state_dict().items()},
            "method": method, "data": data, "train_args": train_args, "precision": precision.value}


def load_resume_state(output_dir: Path, run_key: dict, earlier_keys: Sequence[dict] = ()) -> dict | None:
    """The saved state of an interrupted run with the same settings (or `earlier_keys`), or None."""
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
    if state.get("run_key") not in (run_key, *earlier_keys):
        raise UserError(f"{path} was saved by a run with other settings, data or starting model; rerun without "
                        f"--resume, or with another --output-dir")
    return state


def _tensors_problem(saved, wanted: dict, what: str) -> str | None:
    """Why `saved` is not a state dict like `wanted` (names, shapes, dtypes); None when it is."""
    if not isinstance(saved, dict) or saved.keys() != wanted.keys():
        names = sorted(set(saved) ^ set(wanted)) if isinstance(saved, dict) else []
        return f"its {what} has other weights than this run's" + (f" ({', '.join(names[:3])})" if names else "")
    for name, tensor in wanted.items():
        value = saved[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            return f"its {what}'s {name} is {got}, not {tuple(tensor.shape)} {tensor.dtype}"
    return None


# The optimiser's settings the schedules set as training goes (LambdaLR's rate, SWALR's): numbers, any value; every
# other setting of a group (betas, decay, momentum, ...) is the run's own
RATES = frozenset({"lr", "swa_lr"})
# What a schedule's state holds that changes as it steps: of the kind the schedule's own is; its other keys (base
# rates, annealing) are the run's settings. torch's load_state_dict sets every key as an attribute.
SCHEDULE_STEPPING = frozenset({"last_epoch", "_step_count", "_last_lr", "_is_initial", "_get_lr_called_within_step"})
SCHEDULE_EARLIER = frozenset({"verbose"})  # what the schedules of earlier torch releases also saved


def _optimizer_problem(saved, optimizer: torch.optim.Optimizer) -> str | None:
    """Why `saved` is not a state of `optimizer` over this run's parameters and settings, its buffers floats of
    their parameter's shape (or single numbers); None when it is."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = optimizer.state_dict()["param_groups"]
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)
            and [g.get("params") if isinstance(g, dict) else None for g in saved["param_groups"]]
            == [group["params"] for group in groups]):
        return "its optimiser state is not over this run's parameters"
    for saved_group, group in zip(saved["param_groups"], groups):
        for key, value in saved_group.items():
            if key in RATES and not _same_kind(value, 0.0):
                return f"its optimiser's {key} is {value!r}, not a rate"
            if key not in RATES and key != "params" and key in group and not _same_value(value, group[key]):
                return f"its optimiser's {key} is {value!r}, this run's {group[key]!r}"
    for index, buffers in saved["state"].items():
        if not (type(index) is int and 0 <= index < len(params) and isinstance(buffers, dict)):
            return f"its optimiser state names parameter {index!r}, of {len(params)}"
        for name, value in buffers.items():
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                return f"its optimiser's {name} of parameter {index} is {type(value).__name__}, not a tensor of floats"
            if value.ndim and value.shape != params[index].shape:
                return (f"its optimiser's {name} of parameter {index} is {tuple(value.shape)}, not "
                        f"{tuple(params[index].shape)}")
    return None


def _same_kind(value, made) -> bool:
    """Whether `value` is of `made`'s kind: a flag, a whole number, a finite number, a list of such of its length."""
    if isinstance(made, bool) or made is None:
        return type(value) is type(made)
    if isinstance(made, int):
        return type(value) is int
    if isinstance(made, float):
        return type(value) in (int, float) and math.isfinite(value)
    if isinstance(made, list):
        return isinstance(value, list) and len(value) == len(made) and all(map(_same_kind, value, made))
    return value == made


def _same_value(value, made) -> bool:
    """Whether `value` is `made`, a setting of plain data (numbers, text, flags, lists, tuples, dicts of them), of the
    same types throughout (a tensor is never one)."""
    if type(value) is not type(made):
        return False
    if isinstance(made, (list, tuple)):
        return len(value) == len(made) and all(map(_same_value, value, made))
    if isinstance(made, dict):
        return value.keys() == made.keys() and all(_same_value(value[key], made[key]) for key in made)
    return bool(value == made)


def _schedule_problem(saved, made: dict, what: str) -> str | None:
    """Why `saved` is not a state of the schedule made as `made` (an unknown key, another setting, a stepping value
    of another kind); None when it is."""
    if not isinstance(saved, dict):
        return f"its {what} is not a schedule's state"
    for key, value in saved.items():
        if key not in made and key not in SCHEDULE_EARLIER:
            return f"its {what} holds {key!r}, which this run's schedule does not"
        if key in SCHEDULE_STEPPING and key in made and not _same_kind(value, made[key]):
            return f"its {what}'s {key} is {value!r}"
        if key not in SCHEDULE_STEPPING and key in made and not _same_value(value, made[key]):
            return f"its {what}'s {key} is {value!r}, this run's {made[key]!r}"
    return None


def restore_resume_state(state: dict, output_dir: Path, net: nn.Module, optimizer: torch.optim.Optimizer, schedule,
                         swa, total_steps: int) -> int:
    """Load a resume state into the run's model, optimiser, schedule and SWA average (None without --swa) and return
    its step. Everything is checked first, the settings torch's load_state_dict would take as they are too; a state
    that does not fit is one UserError, the run's files untouched."""
    path = Path(output_dir) / STATE_NAME

    def refuse(why: str):
        raise UserError(f"{path} does not fit this run: {why}; rerun without --resume, or with another --output-dir")

    missing = [key for key in ("step", "model", "optimizer", "schedule", "swa") if key not in state]
    if missing:
        refuse(f"it lacks {', '.join(missing)}")
    step = state["step"]
    if type(step) is not int or not 0 <= step <= total_steps:
        refuse(f"its step {step!r} is not one of the run's 0..{total_steps}")
    schedule_step = state["schedule"].get("last_epoch") if isinstance(state["schedule"], dict) else None
    if type(schedule_step) is not int or not (schedule_step == step or swa is not None and 0 <= schedule_step <= step):
        refuse(f"its schedule is at step {schedule_step!r}, its training at {step}")
    if (state["swa"] is None) != (swa is None):
        refuse("it is of a run with other --swa")
    problem = (_tensors_problem(state["model"], net.state_dict(), "model")
               or _optimizer_problem(state["optimizer"], optimizer)
               or _schedule_problem(state["schedule"], schedule.state_dict(), "schedule"))
    if problem is None and swa is not None:
        saved_swa = state["swa"] if isinstance(state["swa"], dict) else {}
        problem = _tensors_problem(saved_swa.get("averaged"), swa.averaged.state_dict(), "SWA average")
        if problem is None and saved_swa.get("scheduler") is not None:
            problem = _schedule_problem(saved_swa["scheduler"], swa.scheduler_made(optimizer), "SWA schedule")
    if problem:
        refuse(problem)
    try:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        if swa is not None:
            swa.load_state_dict(state["swa"], optimizer)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:  # what the checks above do not foresee
        refuse(first_line(exc))
    return step
