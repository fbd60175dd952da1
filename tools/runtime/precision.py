"""Precision and the process-wide math it sets (torch's fp32 precision flags, cuDNN's autotuning and determinism,
the exact kernels) so that fp32 is IEEE fp32 on every device."""

from __future__ import annotations

import contextlib
import enum
import functools

import torch


class Precision(str, enum.Enum):
    """fp32 is exact; the others are opt-in speed that may change a near-tie prediction."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"


AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


# Torch's fp32 precision API (torch >= 2.9): one `fp32_precision` per leaf, parents first, so that a saved state
# written back in this order ends where it began (a parent's write reaches the children left at "none").
PRECISION_LEAVES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")
TF32_LEAVES = ("cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn")  # "tf32" in --precision tf32, all else "ieee"


def _backend(path: str):  # the object a path names under torch.backends ("": torch.backends)
    return functools.reduce(getattr, filter(None, path.split(".")), torch.backends)


def precision_api() -> bool:
    """Whether this torch has the leaves; older ones have the legacy flags alone (`allow_tf32`, matmul precision)."""
    return all(hasattr(_backend(leaf), "fp32_precision") for leaf in PRECISION_LEAVES)


def math_flags_for(precision: Precision) -> dict:
    """Every process-wide math flag `precision` sets, the legacy two first (fp32: oneDNN's leaf "ieee" too, where
    "medium" would multiply in bf16)."""
    tf32, exact = precision is Precision.TF32, precision is Precision.FP32
    flags = {"float32_matmul_precision": "high" if tf32 else "highest", "cudnn.allow_tf32": tf32}
    if precision_api():
        flags.update({f"{leaf}.fp32_precision".lstrip("."): "tf32" if tf32 and leaf in TF32_LEAVES else "ieee"
                      for leaf in PRECISION_LEAVES})
    return {**flags, "cudnn.benchmark": not exact, "cudnn.deterministic": exact}


# The legacy flags torch keeps beside the leaves, and leaves at which their getters can read them: the getters
# raise where the leaves disagree (as after `torch.backends.cudnn.conv.fp32_precision = "tf32"`).
LEGACY_PROBES = {"float32_matmul_precision": {"cuda.matmul": "ieee", "mkldnn.matmul": "ieee"},
                 "cudnn.allow_tf32": {"cudnn.conv": "tf32", "cudnn.rnn": "tf32"}}


def _read_flag(name: str):
    if name not in LEGACY_PROBES:
        return getattr(_backend(name.rpartition(".")[0]), name.rpartition(".")[2])
    probe = {_backend(leaf): value for leaf, value in LEGACY_PROBES[name].items()} if precision_api() else {}
    saved = {leaf: leaf.fp32_precision for leaf in probe}
    try:
        for leaf, value in probe.items():
            leaf.fp32_precision = value
        return torch.backends.cudnn.allow_tf32 if name == "cudnn.allow_tf32" else torch.get_float32_matmul_precision()
    except RuntimeError:  # at "tf32" on both leaves, cuDNN's getter refuses a legacy False
        return False
    finally:
        for leaf, value in saved.items():
            leaf.fp32_precision = value


def _read_math_flags() -> dict:
    return {name: _read_flag(name) for name in math_flags_for(Precision.FP32)}


def _write_math_flags(flags: dict) -> None:
    for name, value in flags.items():  # the legacy flags first, then the leaves, parents before children
        if name == "float32_matmul_precision":
            torch.set_float32_matmul_precision(value)
        else:
            setattr(_backend(name.rpartition(".")[0]), name.rpartition(".")[2], value)


@contextlib.contextmanager
def math_flags_kept():
    """The process-wide math flags as they were before the block, whatever a `Runtime` made in it sets."""
    saved = _read_math_flags()
    try:
        yield
    finally:
        _write_math_flags(saved)


def set_math_flags(precision: Precision) -> None:
    """Set every process-wide math flag for `precision`, so no earlier runtime's setting survives."""
    _write_math_flags(math_flags_for(precision))


# Switched off in the exact mode (`exact_kernels`), as name: (getter, setter): MultiheadAttention's fast path (a
# fused kernel that `sdpa_kernel` does not reach) and TorchScript's fusers (they compile kernels of their own).
EXACT_SWITCHES = {"mha_fastpath": (torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled),
                  "jit_fuse_cpu": (torch._C._jit_can_fuse_on_cpu, torch._C._jit_override_can_fuse_on_cpu),
                  "jit_fuse_gpu": (torch._C._jit_can_fuse_on_gpu, torch._C._jit_override_can_fuse_on_gpu),
                  "jit_texpr_fuser": (torch._C._jit_texpr_fuser_enabled, torch._C._jit_set_texpr_fuser_enabled)}


@contextlib.contextmanager
def exact_kernels():
    """The exact kernels inside the block: SDPA's math backend (the fused ones sum in other orders; CUDA's
    memory-efficient one multiplies in 3xTF32 whatever the flags), `EXACT_SWITCHES` off, TorchScript unoptimised."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415 (needed only around a forward pass)
    saved = {name: get() for name, (get, _) in EXACT_SWITCHES.items()}
    try:
        for _, switch in EXACT_SWITCHES.values():
            switch(False)
        with sdpa_kernel([SDPBackend.MATH]), torch.jit.optimized_execution(False):
            yield
    finally:
        for name, (_, switch) in EXACT_SWITCHES.items():
            switch(saved[name])


def math_in_effect() -> dict:
    """The math that runs now (the provenance's): the flags, attention backends, `EXACT_SWITCHES`, TorchScript's."""
    cuda = torch.backends.cuda
    backends = {"math": cuda.math_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
                "efficient": cuda.mem_efficient_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled()}
    return {**_read_math_flags(), "sdpa_backends": [name for name, on in backends.items() if on],
            **{name: get() for name, (get, _) in EXACT_SWITCHES.items()},
            "torchscript_optimized": torch._C._get_graph_executor_optimize()}
