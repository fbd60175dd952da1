"""The process group, torchvision style: rank and world size from torchrun's environment (without it, one
process). Every collective of the toolkit goes through this module, which puts its tensors where the backend
needs them (`reduction_device`), so no caller can leave one on the wrong device."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from tools.errors import UserError

log = logging.getLogger(__name__)

NCCL, GLOO = "nccl", "gloo"
# How long a process waits in a collective for the others before the run is aborted (torch's NCCL default, 10
# minutes, ends a run whose processes wait for one another longer: a slow rank 0 writing, a large model's batch)
DEFAULT_TIMEOUT_MINUTES = 120.0
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands: its rank among `world_size` processes and its rank on this machine."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, requested: torch.device) -> torch.device:
        """The device this process uses: on CUDA the GPU of its local rank, else the requested one."""
        if requested.type == "cuda" and self.distributed:
            return torch.device("cuda", self.local_rank)
        return requested

    def barrier(self) -> None:
        """Wait for every process; under NCCL on this process's GPU (named, not guessed)."""
        if self.distributed:
            dist.barrier(device_ids=[self.local_rank] if dist.get_backend() == NCCL else None)


def from_environment() -> ProcessGroup:
    """RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_PORT) as torchrun sets them, checked; one process without them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return ProcessGroup()
    world_size = _environment_number("WORLD_SIZE", 1)
    rank = _environment_number("RANK", 0, world_size - 1)
    if world_size > 1 and "MASTER_PORT" in os.environ:
        _environment_number("MASTER_PORT", 1, 65535)
    return ProcessGroup(rank, world_size, _local_rank())


def _local_rank() -> int:
    local_size = _environment_number("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else None
    return _environment_number("LOCAL_RANK", 0, None if local_size is None else local_size - 1, default=0)


def _environment_number(name: str, minimum: int, maximum: int | None = None, default: int | None = None) -> int:
    """A whole number torchrun's environment holds, from `minimum` to `maximum`; one error line otherwise."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
        raise UserError(f"the environment variable {name} is {text!r}, not a whole number {bounds}; torchrun sets "
                        f"it for each process: launch with torchrun, or unset RANK and WORLD_SIZE for one process")
    return value


def joined_group() -> ProcessGroup:
    """Where this process stands in a process group its caller has joined; one process when none is."""
    if not _joined():
        return ProcessGroup()
    return ProcessGroup(dist.get_rank(), dist.get_world_size(), _local_rank())


def setup(device: torch.device, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> ProcessGroup:
    """Join torchrun's process group if there is one (NCCL for CUDA, gloo otherwise); returns where we stand."""
    group = from_environment()
    if not group.distributed or dist.is_initialized():
        return group
    backend = NCCL if device.type == "cuda" else GLOO
    if device.type == "cuda":
        torch.cuda.set_device(group.local_rank)
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    log.info("process %d of %d joined the %s process group", group.rank, group.world_size, backend)
    return group


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


# Before torch 2.8 (pytorch#154976) the gloo group's destructor joins its worker threads holding the GIL, while a
# worker dropping a finished collective's tensors may need the GIL: a rare deadlock at exit (seen at torch 2.6).
GLOO_DESTRUCTOR_HOLDS_GIL_BEFORE = (2, 8)
GLOO_DRAIN_SECONDS = 0.05  # the workers' time, the GIL released, to drop the collectives they have finished


def cleanup() -> None:
    if not _joined():
        return
    if GLOO in str(dist.get_backend()) and torch.__version__ < GLOO_DESTRUCTOR_HOLDS_GIL_BEFORE:  # "cpu:gloo,..." too
        time.sleep(GLOO_DRAIN_SECONDS)  # not a guarantee, but the window shrinks from microseconds to this
    dist.destroy_process_group()


def reduction_device(device: torch.device) -> torch.device:
    """Where a collective's tensors live for a run on `device`: that GPU under NCCL, the CPU under gloo."""
    return device if _joined() and dist.get_backend() == NCCL else torch.device("cpu")


def all_reduce(array: np.ndarray, op: str, device: torch.device) -> np.ndarray:
    """An element-wise reduction ("sum", "mean", "min" or "max") of a numpy array over the process group."""
    if not _joined():
        return array
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(reduction_device(device))
    dist.all_reduce(tensor, op=REDUCE_OPS[op])
    reduced = tensor.cpu().numpy()
    return reduced / dist.get_world_size() if op == "mean" else reduced


def broadcast(array: np.ndarray, group: ProcessGroup, device: torch.device) -> np.ndarray:
    """Rank 0's copy of an array (int or float), in every process."""
    if not group.distributed:
        return array
    mine = array if group.is_main else np.zeros_like(array)
    return all_reduce(mine, "sum", device).astype(array.dtype)


def all_gather_floats(value: float, device: torch.device) -> list[float]:
    """One number from every process, in rank order."""
    if not _joined():
        return [value]
    place = reduction_device(device)
    out = [torch.zeros(1, dtype=torch.float64, device=place) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64, device=place))
    return [float(t.item()) for t in out]


class PeerFailure(UserError):
    """Raised in every process but the failed ones when some processes failed in an `agree` block."""


_AGREED = "_failure_agreed_across_processes"  # set on an error once every process knows of it


@contextlib.contextmanager
def agree(group: ProcessGroup, device: torch.device) -> Iterator[None]:
    """Leave a block in every process of `group` together: at its end the processes vote in one all-reduce, and
    when some failed, those raise their own error and the others `PeerFailure`, so none waits in a collective a
    failed one will not join. Work that may fail in some processes only runs inside one; nested blocks vote once;
    a `group` of one process votes with nobody, even inside a joined group."""
    if not (group.distributed and _joined()):
        yield
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = np.zeros(world, np.int64)
    try:
        yield
    except Exception as exc:
        if not getattr(exc, _AGREED, False):
            mine[rank] = 1
            all_reduce(mine, "sum", device)
            setattr(exc, _AGREED, True)
        raise
    failed = np.flatnonzero(all_reduce(mine, "sum", device))
    if len(failed):
        which = f"process{'es' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of {world}"
        error = PeerFailure(f"{which} failed (its own error line says why); every process stops this work with it")
        setattr(error, _AGREED, True)
        raise error
