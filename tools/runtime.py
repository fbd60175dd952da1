"""Device, precision and batch sizing, resolved once into one `Runtime`."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import logging
import platform
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tools.distributed import ProcessGroup
from tools.errors import UserError

log = logging.getLogger(__name__)


class Precision(str, enum.Enum):
    """fp32 is exact; the others are opt-in speed that may change a near-tie prediction."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"


AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(name: str | None) -> torch.device:
    """The device asked for, checked to exist; by default the best one here, with a notice for the CPU."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        log.info("no GPU found: running on the CPU (pass --device to choose)")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {name!r}; use cuda, cuda:N, mps or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {name} is not available: this machine has no CUDA GPU (use --device cpu)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device {name} is not available: this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not _mps_available():
            raise UserError(f"device {name} is not available: no Apple MPS device here (use --device cpu)")
    elif device.type != "cpu":
        raise UserError(f"unsupported device {name!r}; use cuda, cuda:N, mps or cpu")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


MathFlags = tuple[bool, bool, bool, bool]  # TF32 in matmul, TF32 in cuDNN, cuDNN autotuning, deterministic cuDNN


def _read_math_flags() -> MathFlags:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic)


def _write_math_flags(flags: MathFlags) -> None:
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.deterministic) = flags


def set_math_flags(precision: Precision) -> MathFlags:
    """Set the process-wide math flags for `precision` (all four every time, so no earlier runtime's setting
    survives); they exist on every build and act on CUDA only. Returns the flags as they were.

    TF32 only when asked for. In fp32, no cuDNN autotuning (it may pick other convolution algorithms from one
    run to the next) and only deterministic cuDNN algorithms, so the same device and library versions give
    the same fp32 logits bit for bit; the speed modes autotune and allow any algorithm."""
    saved = _read_math_flags()
    tf32, exact = precision is Precision.TF32, precision is Precision.FP32
    _write_math_flags((tf32, tf32, not exact, exact))
    return saved


@dataclass
class Runtime:
    """Where and how the model runs: device, precision (an autocast context), memory format, and the process
    group it shares the work with (a single process unless under torchrun)."""

    device: torch.device
    precision: Precision = Precision.FP32
    channels_last: bool = False
    compile: bool = False
    group: ProcessGroup = field(default_factory=ProcessGroup)  # torchrun's processes sharing the work

    def __post_init__(self):
        set_math_flags(self.precision)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        if self.precision is Precision.FP16 and self.device.type == "cpu":
            log.warning("fp16 on the CPU is slow and no more exact than bf16; consider --precision bf16")

    @property
    def exact(self) -> bool:
        return self.precision is Precision.FP32

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def fp32_math(self):
        """The exact mode's math inside the block whatever the precision: autocast off and fp32's flags (no
        TF32, no autotuning, deterministic cuDNN); the runtime's flags are restored afterwards. The
        reduced-precision re-check runs under it."""
        saved = set_math_flags(Precision.FP32)
        try:
            with torch.autocast(device_type=self.device.type, enabled=False):
                yield
        finally:
            _write_math_flags(saved)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device).eval()
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.compile:
            model = torch.compile(model)
        return model

    def to_device(self, batch: torch.Tensor) -> torch.Tensor:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        batch = batch.to(self.device, non_blocking=True)
        return batch.contiguous(memory_format=memory_format)

    def pin(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> dict:
        name = str(self.device)
        if self.device.type == "cuda":
            name += f" ({torch.cuda.get_device_name(self.device)})"
        return {"device": name, "precision": self.precision.value, "channels_last": self.channels_last,
                "compile": self.compile}


CPU_BATCH_CANDIDATES = (8, 16, 32)  # timed at start-up where a batch size is chosen by measurement


def default_batch_size(device: torch.device) -> int:
    return 256 if device.type == "cuda" else 16


@functools.lru_cache(maxsize=None)
def tune_cpu_allocator() -> None:
    """Keep freed memory in the process on Linux/glibc, once per process.

    By default glibc returns every large block (activations, batches) to the system when it is freed and
    asks for it again on the next forward pass, so a CPU run spends much of its time in page faults
    (measured: half of EfficientNet-Lite0's time on a 2-core VM). Raising the mmap and trim thresholds keeps
    those blocks for reuse; results are unchanged. Elsewhere this does nothing.
    """
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
    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Forward:
    """Runs a model over a batch in chunks of at most `chunk`, halving the chunk on out-of-memory until it fits,
    and saying so in one line; later batches keep the size that fitted."""

    def __init__(self, model: Callable, runtime: Runtime, chunk: int):
        self.model, self.runtime, self.chunk = model, runtime, max(1, chunk)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        outputs, start, chunk_before = [], 0, self.chunk
        while start < batch.shape[0]:
            piece = batch[start:start + self.chunk]
            try:
                with torch.inference_mode(), self.runtime.autocast():
                    outputs.append(self.model(piece))
            except Exception as exc:  # noqa: BLE001 (only out-of-memory is handled; the rest re-raise)
                if not _is_oom(exc) or self.chunk == 1:
                    raise
                self.chunk //= 2
                if self.runtime.device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            start += piece.shape[0]
        if self.chunk != chunk_before:
            log.warning("out of memory: batch size lowered from %d to %d", chunk_before, self.chunk)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
