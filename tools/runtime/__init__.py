"""Device, precision and batch sizing, resolved once into one `Runtime`."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
import platform
import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tools.distributed import ProcessGroup
from tools.errors import UserError, first_line, option
from tools.in9 import IMAGE_SIZE
from tools.runtime.precision import (
    AUTOCAST_DTYPES,
    Precision,
    exact_kernels,
    math_flags_kept,
    math_in_effect,
    set_math_flags,
)

log = logging.getLogger(__name__)


# in reduced precision, predictions whose top-two logit margin is below it are re-run in fp32 (the challenge's and
# in9's --recheck-margin); 0 turns the re-check off
RECHECK_MARGIN = 1.0


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.6.0+cu124" -> (2, 6), "2.8.0.dev20250601" -> (2, 8)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


# The first torch release whose MPS backend has each anti-aliased resize (`interpolate(..., antialias=True)`):
# bilinear from 2.7 (pytorch#145526), bicubic from 2.8 (pytorch#149378). CPU and CUDA have both on every
# supported release. Without them the resize raises NotImplementedError in the middle of a run.
MPS_ANTIALIAS_SINCE = {"bilinear": (2, 7), "bicubic": (2, 8)}
MPS_FALLBACK_VARIABLE = "PYTORCH_ENABLE_MPS_FALLBACK"  # set to 1: torch runs the ops MPS lacks on the CPU


def check_antialias(device: torch.device, mode: str, used_by: str, version: str | None = None,
                    cpu_fallback: bool | None = None) -> None:
    """Refuse at start-up a device whose torch lacks the anti-aliased `mode` resize `used_by` needs (with MPS's
    CPU fallback on, only warn)."""
    version = torch.__version__ if version is None else version
    since = MPS_ANTIALIAS_SINCE[mode] if device.type == "mps" else None
    if since is None or torch_release(version) >= since:
        return
    if cpu_fallback is None:
        cpu_fallback = os.environ.get(MPS_FALLBACK_VARIABLE) == "1"
    needed = ".".join(map(str, since))
    if cpu_fallback:
        log.warning("%s resizes with anti-aliased %s, which MPS has from torch %s (this is %s): it runs on the "
                    "CPU (%s=1)", used_by, mode, needed, version, MPS_FALLBACK_VARIABLE)
        return
    raise UserError(f"{option('--device', 'mps')} needs torch>={needed} for the anti-aliased {mode} resizing of "
                    f"{used_by} (this is torch {version}); upgrade torch, set {MPS_FALLBACK_VARIABLE}=1 to run it on "
                    f"the CPU, or use {option('--device', 'cpu')}")


def autocast_refusal(device_type: str, dtype: torch.dtype) -> str | None:
    """None when `torch.autocast(device_type, dtype)` really turns autocast on here; else torch's reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type=device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype
        except RuntimeError as exc:
            return first_line(exc)
    if enabled:
        return None
    return first_line(caught[0].message) if caught else "autocast stayed off"


def resolve_device(name: str | None) -> torch.device:
    """The device asked for, checked to exist; by default the best one here, with a notice for the CPU."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        log.info("no GPU found: running on the CPU (pass %s to choose)", option("--device"))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r}; use cuda, cuda:N, mps or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name} is not available: this machine has no CUDA GPU (use "
                            f"{option('--device', 'cpu')})")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device {name} is not available: this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UserError(f"device {name} is not available: no Apple MPS device here (use "
                            f"{option('--device', 'cpu')})")
    elif device.type != "cpu":
        raise UserError(f"unsupported device {name!r}; use cuda, cuda:N, mps or cpu")
    return device


def device_model(device: torch.device) -> str:
    """What decides a computation's last bits on `device` besides its inputs and shapes (GPU model and capability,
    or the CPU's instruction set, with torch's and CUDA's versions)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    if device.type == "cpu":
        return f"cpu ({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}"
    return f"{device.type}, torch {torch.__version__}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`, without waiting only from fresh pinned memory to CUDA; every other copy blocks (MPS:
    pytorch/pytorch#139550). Why: docs/how-it-works.md, "Copies to the device wait unless waiting is provably
    unneeded"."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """The tensors copied to host memory, and the event to wait for before reading them (None: ready now); from
    CUDA the copies do not wait, and the event is on the tensors' own device's stream."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return [t.cpu() for t in tensors], None  # no single CUDA stream to wait on: copy blocking
    device = devices.pop()
    stream = torch.cuda.current_stream(device)
    with torch.cuda.device(device):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record(stream)
    return host, event


@dataclass
class Runtime:
    """Where and how the model runs: device, precision, memory format, compilation, and the torchrun group."""

    device: torch.device
    precision: Precision = Precision.FP32
    channels_last: bool = False
    compile: bool = False
    group: ProcessGroup = field(default_factory=ProcessGroup)  # torchrun's processes sharing the work

    def __post_init__(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        refusal = None if dtype is None else autocast_refusal(self.device.type, dtype)
        if refusal is not None:  # the precision that runs, and so the one recorded, is fp32
            log.warning("%s autocast does not run on %s here (%s): running in fp32", self.precision.value,
                        self.device.type, refusal)
            self.precision = Precision.FP32
        set_math_flags(self.precision)
        if self.precision is Precision.FP16 and self.device.type == "cpu":
            log.warning("fp16 on the CPU is slow and no more exact than bf16; consider %s",
                        option("--precision", "bf16"))

    @property
    def exact(self) -> bool:
        """fp32, eager: Inductor's kernels (torch.compile) divide approximately, so fp32 compiled is re-checked."""
        return self.precision is Precision.FP32 and not self.compile

    def recheck_margin(self, margin: float) -> float:
        """The near-tie re-check margin that applies here: `margin` in a speed mode, 0 when exact."""
        return 0.0 if self.exact else margin

    def arithmetic(self) -> dict:
        """What decides the model's logits here besides the model, its inputs and the batch shape; saved states,
        shards and the zoo's results are keyed by it."""
        return {"device": device_model(self.device), "precision": self.precision.value, "compile": self.compile,
                "channels_last": self.channels_last,
                "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None}

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def math(self):
        """The math around each forward pass: the precision's autocast, or when exact `fp32_math` (so a flag
        changed since the runtime was made cannot reach the run)."""
        return self.fp32_math() if self.exact else self.autocast()

    @contextlib.contextmanager
    def fp32_math(self):
        """The exact mode's math inside the block whatever the precision (autocast off, fp32's flags, the exact
        kernels); the runtime's flags are restored afterwards. The fp32 re-check runs under it."""
        with math_flags_kept():
            set_math_flags(Precision.FP32)
            # autocast switched off only where it is on: torch warns on entering a context for a device type whose
            # autocast it does not support, even one that turns it off
            off = torch.autocast(device_type=self.device.type, enabled=False) \
                if torch.is_autocast_enabled(self.device.type) else contextlib.nullcontext()
            with off, exact_kernels():
                yield

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The eager model on the device, in eval mode and the memory format (the fp32 re-check runs it)."""
        model = model.to(self.device).eval()
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def compiled(self, model: Callable) -> Callable:
        """`model` compiled with --compile (else as it is), for the one batch shape `Forward` runs."""
        return torch.compile(model, dynamic=False) if self.compile else model

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        return to_device(batch, self.device).contiguous(memory_format=self.memory_format)

    def release(self) -> None:
        """Forget the last model before the next: torch.compile's caches (else past torch's recompile limit a later
        model runs uncompiled), then its memory."""
        if self.compile:
            torch.compiler.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def batch_size(self, requested: int | None) -> int:
        """The batch size asked for (refused if its images alone exceed the device's memory), else the default."""
        if requested is None:
            return default_batch_size(self.device)
        memory = device_memory(self.device)
        if memory is not None and requested * IMAGE_BYTES > memory:
            raise UserError(f"a batch of {requested} images takes {requested * IMAGE_BYTES / 2**30:,.0f} GiB in "
                            f"float32 for its images alone, more than the {memory / 2**30:,.0f} GiB of {self.device}; "
                            f"pass a smaller {option('--batch-size')}")
        return requested

    def pin(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> dict:
        name = str(self.device)
        if self.device.type == "cuda":
            name += f" ({torch.cuda.get_device_name(self.device)})"
        with self.math():
            math = math_in_effect()
        # `exact` is a claim only the start-up check makes (tools.models.device_check.record_check): false until it does
        return {"device": name, "precision": self.precision.value, "channels_last": self.channels_last,
                "compile": self.compile, "exact_mode": self.exact, "exact": False, "math": math,
                "arithmetic": self.arithmetic()}  # what the saved states are keyed by; the leaderboard groups by it


IMAGE_BYTES = 3 * IMAGE_SIZE * IMAGE_SIZE * 4  # one image as the models take it: 3x224x224 float32


def device_memory(device: torch.device) -> int | None:
    """A CUDA GPU's memory, else the machine's (MPS's is unified); None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


GPU_BATCH_SIZE = 256
CPU_BATCH_SIZE = 16  # smaller batches stay in the CPU's cache
BATCH_SIZE_DEFAULTS = f"{GPU_BATCH_SIZE} on a GPU, {CPU_BATCH_SIZE} on the CPU"  # for help texts


def default_batch_size(device: torch.device) -> int:
    return GPU_BATCH_SIZE if device.type == "cuda" else CPU_BATCH_SIZE


@functools.cache
def tune_cpu_allocator() -> None:
    """Keep freed memory in the process on Linux/glibc (command lines only: glibc cannot give a library caller's
    process its dynamic thresholds back). See docs/how-it-works.md, "Batch size, threads and the CPU allocator"."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        log.debug("CPU allocator tuned for reuse: %s", bool(ok))
    except (OSError, AttributeError) as exc:
        log.debug("CPU allocator left as it is (%s)", exc)


def _is_oom(exc: BaseException) -> bool:
    """A GPU's out-of-memory, or the CPU allocator's refusal."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class Forward:
    """Runs a model over a batch in chunks of `chunk` rows, halving the chunk on out-of-memory (one notice naming
    it `what`). One batch shape: a short chunk is padded with copies of its last row (docs/how-it-works.md, "One
    batch shape"); compiled, through one static buffer made outside inference mode. `exact`: true fp32, a chunk of
    its own; `pad=False`: chunks as they are (a one-off pass such as CLIP's text head)."""

    def __init__(self, model: Callable, runtime: Runtime, chunk: int, exact: bool = False, what: str = "batch size",
                 pad: bool = True):
        self.model, self.runtime, self.chunk, self.what = model, runtime, max(1, chunk), what
        self.first_chunk = self.chunk
        self.math = runtime.fp32_math if exact else runtime.math
        self.pad = pad
        self.static = runtime.compile and pad  # a compiled model's one input buffer
        self._buffer: torch.Tensor | None = None

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        outputs, start, chunk_before = [], 0, self.chunk
        while start < batch.shape[0]:
            piece = batch[start:start + self.chunk]
            rows = piece.shape[0]
            try:
                piece = self._staged(piece) if self.static else piece
                with torch.inference_mode(), self.math():
                    outputs.append(self._run(piece, rows))
            except Exception as exc:
                if not _is_oom(exc) or self.chunk == 1:
                    raise
                self.chunk //= 2
                self._buffer = None
                if self.runtime.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            start += rows
        if self.chunk != chunk_before:
            shape = (f"; results from here on may differ in the last bits from a run at {self.first_chunk}"
                     if self.pad else "")
            log.warning("out of memory: %s lowered from %d to %d%s", self.what, chunk_before, self.chunk, shape)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    @property
    def lowered_from(self) -> int | None:
        """The chunk asked for, where out-of-memory has lowered it (None: it runs at that size)."""
        return self.first_chunk if self.chunk != self.first_chunk else None

    def provenance(self) -> dict:
        """The batch size as it runs now, and the one it was lowered from, if it was."""
        lowered = {} if self.lowered_from is None else {"batch_size_lowered_from": self.lowered_from}
        return {"batch_size": self.chunk, **lowered}

    def _staged(self, piece: torch.Tensor) -> torch.Tensor:
        """`piece` padded into the static buffer (made, and filled, outside inference mode)."""
        shape = (self.chunk, *piece.shape[1:])
        buffer = self._buffer
        if buffer is None or buffer.shape != shape or buffer.dtype != piece.dtype or buffer.device != piece.device:
            buffer = torch.empty(shape, dtype=piece.dtype, device=piece.device)
            if buffer.dim() == 4:
                buffer = buffer.contiguous(memory_format=self.runtime.memory_format)
            self._buffer = buffer
        rows = piece.shape[0]
        with torch.no_grad():
            buffer[:rows].copy_(piece)
            buffer[rows:].copy_(piece[-1:].expand(self.chunk - rows, *piece.shape[1:]))
        return buffer

    def _run(self, piece: torch.Tensor, rows: int) -> torch.Tensor:
        if not self.pad or piece.shape[0] == self.chunk:
            return self.model(piece)[:rows]
        padded = torch.cat([piece, piece[-1:].expand(self.chunk - rows, *piece.shape[1:])])
        if padded.dim() == 4:  # an image batch, in the runtime's memory format
            padded = padded.contiguous(memory_format=self.runtime.memory_format)
        return self.model(padded)[:rows]
