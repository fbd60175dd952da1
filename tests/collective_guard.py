"""A test-only guard on torch.distributed: the toolkit issues every collective through tools.distributed, and
every collective's tensors lie where the group's backend takes them (NCCL: the GPU; gloo: the CPU).

`install()` wraps torch.distributed's collectives in this process. Run a command under it with
`python -m tests.collective_guard SCRIPT ARGS...` or `... -m MODULE ARGS...`, also as torchrun's program:
`python -m torch.distributed.run --nproc-per-node 2 -m tests.collective_guard train.py ...`.

On the CPU every tensor is where gloo takes it, so the device check alone cannot catch a tensor that would stay
on the CPU under NCCL. The guard therefore also checks who calls: only tools/distributed.py applies the NCCL
rule (`reduction_device` of the run's device), so a collective called straight from any other toolkit code
(tools/ or a root script) fails. torch's own calls (its DataLoader, DDP) and the tests' are not the toolkit's.
A broken rule raises `CollectiveRuleBroken`, a BaseException that no `except Exception` swallows.
"""

from __future__ import annotations

import functools
import inspect
import runpy
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import tools
import tools.distributed

PROJECT = Path(tools.__file__).resolve().parents[1]
CHOKEPOINT = Path(tools.distributed.__file__).resolve()
TENSOR_DEVICE = {"nccl": "cuda", "gloo": "cpu"}  # the device type each backend's collectives take
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
               "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "send_object_list", "recv_object_list")


class CollectiveRuleBroken(BaseException):
    """A collective issued around tools.distributed, or with a tensor where its backend would refuse it."""


def is_toolkit_code(path: Path) -> bool:
    """The toolkit's own code: the tools package and the root scripts (not the tests, not other packages)."""
    return path.is_relative_to(PROJECT / "tools") or path.parent == PROJECT


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def problems(name: str, caller: Path, tensors, backend: str) -> list[str]:
    """What is wrong with a call of collective `name` from file `caller` on these tensors under `backend`."""
    found = []
    if is_toolkit_code(caller) and caller != CHOKEPOINT:
        found.append(f"{caller.relative_to(PROJECT)} calls torch.distributed.{name} itself; the toolkit's "
                     f"collectives go through tools.distributed, which puts their tensors where the backend needs them")
    # "nccl", "gloo", or per device type as in "cpu:gloo,cuda:nccl"
    allowed = ({part.split(":")[0] for part in backend.split(",")} if ":" in backend
               else {TENSOR_DEVICE[backend]} if backend in TENSOR_DEVICE else None)
    for tensor in tensors if allowed is not None else ():
        if tensor.device.type not in allowed:
            found.append(f"torch.distributed.{name} got a tensor on {tensor.device} under {backend}, which takes "
                         f"{' or '.join(sorted(map(str, allowed)))} tensors")
    return found


def _guarded(name: str, collective):
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        caller = Path(sys._getframe(1).f_code.co_filename).resolve()
        bound = signature.bind_partial(*args, **kwargs)
        backend = str(dist.get_backend(bound.arguments.get("group")))
        found = problems(name, caller, list(_tensors(list(bound.arguments.values()))), backend)
        if found:
            raise CollectiveRuleBroken("; ".join(found))
        return collective(*args, **kwargs)

    wrapper.__guarded__ = True
    return wrapper


def install(patch=setattr) -> None:
    """Wrap every collective of torch.distributed (and of c10d, where torch's own helpers look them up);
    `patch`: how to set the attributes (pytest's `monkeypatch.setattr` to undo it after a test)."""
    for name in COLLECTIVES:
        collective = getattr(c10d, name, None) or getattr(dist, name, None)
        if collective is None or getattr(collective, "__guarded__", False):
            continue
        wrapper = _guarded(name, collective)
        for namespace in (dist, c10d):
            if hasattr(namespace, name):
                patch(namespace, name, wrapper)


TEARDOWN_ABORT = "terminate called without an active exception"


def launch(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, **kwargs)` for a torchrun command, run once more
    when a process aborted in gloo's teardown (std::terminate as the process exits, after its work; seen about
    once in 30 runs on a loaded 2-core machine, with and without the guard). Any other failure stands."""
    for attempt in (1, 2):
        proc = subprocess.run(command, capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr or attempt == 2:
            return proc
        print(f"torchrun: a process aborted in gloo's teardown; running once more: {' '.join(command)}",
              file=sys.stderr)
    raise AssertionError("unreachable")


def main(argv: list[str]) -> None:
    """`SCRIPT ARGS...` or `-m MODULE ARGS...`, run as `python` runs them, with the guard installed."""
    install()
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
