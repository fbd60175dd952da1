"""The process group, torchvision style: rank and world size from torchrun's environment, one helper for all.

Without torchrun's variables everything is the single-process code path (rank 0 of 1, no process group).
With them, `setup` joins the group (NCCL on CUDA, gloo on the CPU) and picks the device for LOCAL_RANK.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


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
        if self.distributed:
            dist.barrier()


def from_environment() -> ProcessGroup:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them; a single process without them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return ProcessGroup()
    return ProcessGroup(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def setup(device: torch.device) -> ProcessGroup:
    """Join torchrun's process group if there is one (NCCL for CUDA, gloo otherwise); returns where we stand."""
    group = from_environment()
    if not group.distributed or dist.is_initialized():
        return group
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(group.local_rank)
    dist.init_process_group(backend=backend)
    log.info("process %d of %d joined the %s process group", group.rank, group.world_size, backend)
    return group


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
