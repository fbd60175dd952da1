"""Device resolution, precision contexts and out-of-memory batch halving."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tools.errors import UserError
from tools.runtime import Forward, Precision, Runtime, math_flags_kept, resolve_device


class RunsOutOfMemory(torch.nn.Module):
    """Doubles its input, and raises the out-of-memory error for batches larger than `limit`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.calls = limit, []

    def forward(self, x):
        self.calls.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x * 2


def test_out_of_memory_halves_the_batch_with_one_notice_and_keeps_every_result(caplog):
    model = RunsOutOfMemory(limit=5)
    forward = Forward(model, Runtime(torch.device("cpu")), chunk=32)
    x = torch.arange(24, dtype=torch.float32).view(24, 1)
    with caplog.at_level(logging.WARNING):
        out = forward(x)
        again = forward(x)
    assert torch.equal(out, x * 2) and torch.equal(again, x * 2)
    assert forward.chunk == 4  # 32 -> 16 -> 8 -> 4, then kept for later batches
    assert model.calls[:4] == [32, 16, 8, 4]  # the 24 rows padded to the one batch size
    assert all(n <= 4 for n in model.calls[-6:])
    notices = [r.message for r in caplog.records if "out of memory" in r.message]
    assert notices == ["out of memory: batch size lowered from 32 to 4; results from here on may differ in the last "
                       "bits from a run at 32"]
    assert forward.lowered_from == 32


def test_a_forward_that_fits_was_not_lowered():
    forward = Forward(RunsOutOfMemory(limit=64), Runtime(torch.device("cpu")), chunk=32)
    forward(torch.zeros(40, 1))
    assert forward.chunk == 32 and forward.lowered_from is None


def test_other_errors_are_not_swallowed():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        Forward(Broken(), Runtime(torch.device("cpu")), chunk=8)(torch.zeros(4, 1))


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda:1")


def test_fp32_runs_without_autocast_and_bf16_with_it():
    x = torch.randn(2, 4)
    layer = torch.nn.Linear(4, 3)
    with Runtime(torch.device("cpu")).autocast():
        assert layer(x).dtype == torch.float32
    with Runtime(torch.device("cpu"), Precision.BF16).autocast():
        assert layer(x).dtype == torch.bfloat16
    assert Runtime(torch.device("cpu")).exact and not Runtime(torch.device("cpu"), Precision.BF16).exact


class RecordsItsMath(torch.nn.Module):
    """A 9-class model whose logits are near ties, recording the TF32 flags and autocast state of every call."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 9)
        self.calls: list[tuple[bool, bool, bool]] = []

    def forward(self, x):
        self.calls.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                           torch.is_autocast_enabled("cpu")))
        return self.linear(x.mean(dim=(2, 3))) * 1e-3


@pytest.mark.parametrize("precision", [Precision.TF32, Precision.BF16])
@pytest.mark.slow
def test_the_recheck_runs_in_true_fp32_and_restores_the_flags(precision, dataset):
    from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge  # noqa: PLC0415
    from tools.models.boundary import LoadedModel, PixelModel  # noqa: PLC0415

    torch.manual_seed(0)
    recorder = RecordsItsMath()
    loaded = LoadedModel(PixelModel(recorder, (0.5,) * 3, (0.25,) * 3), 9, None, None, None, None, "test", "test")
    runtime = Runtime(torch.device("cpu"), precision)
    tf32 = precision is Precision.TF32
    config = ChallengeConfig(batch_size=16, progress=False, recheck_margin=1e9)
    result = run_challenge(loaded, runtime, list_challenge_files(dataset.root, 1), config, workers=1)
    assert result.rechecked > 0
    fast = (tf32, tf32, precision is Precision.BF16)
    exact = (False, False, False)
    assert set(recorder.calls) == {fast, exact}
    assert sum(call == exact for call in recorder.calls) >= 1
    # the process-wide flags are as the precision set them, after every re-check
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)


def math_flags() -> dict:
    """The process-wide flags a Runtime sets; they exist on every build (they act on CUDA only)."""
    return {"matmul_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "autotuning": torch.backends.cudnn.benchmark, "deterministic": torch.backends.cudnn.deterministic}


EXACT_FLAGS = {"matmul_tf32": False, "cudnn_tf32": False, "autotuning": False, "deterministic": True}
FLAGS = {Precision.FP32: EXACT_FLAGS,
         Precision.TF32: {"matmul_tf32": True, "cudnn_tf32": True, "autotuning": True, "deterministic": False},
         Precision.BF16: {"matmul_tf32": False, "cudnn_tf32": False, "autotuning": True, "deterministic": False},
         Precision.FP16: {"matmul_tf32": False, "cudnn_tf32": False, "autotuning": True, "deterministic": False}}


@pytest.fixture
def restore_math_flags():
    with math_flags_kept():  # every leaf (tests/test_runtime_precision.py checks that it restores them)
        yield


@pytest.mark.parametrize("precision", list(Precision))
def test_each_precision_sets_its_flags_whatever_ran_before(precision, restore_math_flags):
    """fp32: no TF32, no autotuning, deterministic cuDNN; the speed modes autotune. A runtime made after
    another one (the zoo makes several) leaves no flag of the earlier one behind, either way."""
    for before in Precision:
        Runtime(torch.device("cpu"), before)
        Runtime(torch.device("cpu"), precision)
        assert math_flags() == FLAGS[precision], f"{precision.value} after {before.value}"


@pytest.mark.parametrize("precision", [Precision.TF32, Precision.BF16])
def test_the_fp32_block_has_the_exact_mode_s_flags_and_restores_the_runtime_s(precision, restore_math_flags):
    runtime = Runtime(torch.device("cpu"), precision)
    with runtime.fp32_math():
        assert math_flags() == EXACT_FLAGS
    assert math_flags() == FLAGS[precision]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback is what is checked")
def test_no_gpu_is_an_informational_line(caplog):
    with caplog.at_level(logging.INFO):
        assert resolve_device(None) == torch.device("cpu")
    records = [r for r in caplog.records if "no GPU found" in r.message]
    assert len(records) == 1 and records[0].levelno == logging.INFO


FREED_MEMORY_KEPT = """
import ctypes, sys, torch
from tools import api
from tools.runtime import Runtime
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1])
size = 64 << 20  # above glibc's largest dynamic mmap threshold: given back to the system when freed, by default
before = rss()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print((rss() - before) * 4096 > size // 2)
"""


SETUPS = ["Runtime(torch.device('cpu'))",
          "from tools.data import synthetic\nroot = synthetic.generate(sys.argv[1], per_class=1, seed=1).root\n"
          "head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 9))\n"
          "api.benchmark(head, root, challenge=False, device='cpu', progress=False, workers=1, cache=False)"]


@pytest.fixture(scope="module")
def allocator_runs(tmp_path_factory) -> dict:
    """FREED_MEMORY_KEPT after each setup, as `python -c` runs it (tests.helpers.run_forked: one start-up for
    both, each in a fork of an interpreter that has only imported torch, as the code's first line does)."""
    from tests.helpers import run_forked  # noqa: PLC0415
    folder = tmp_path_factory.mktemp("allocator")
    commands = [["-c", FREED_MEMORY_KEPT.format(setup=setup), str(folder / f"data{k}")]
                for k, setup in enumerate(SETUPS)]
    return dict(zip(SETUPS, run_forked(commands, Path.cwd())))


@pytest.mark.skipif(not __import__("platform").libc_ver()[0] == "glibc", reason="glibc's allocator only")
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.slow
def test_the_library_leaves_the_callers_allocator_as_it_was(setup, allocator_runs):
    """Only the command lines keep freed memory in the process (tune_cpu_allocator): a library caller's process
    gives a freed large block back to the system as glibc does by default."""
    out = allocator_runs[setup]
    assert out.stdout.strip() == "False", out.stderr
