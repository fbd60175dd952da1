"""Device resolution, precision contexts and out-of-memory batch halving."""

from __future__ import annotations

import logging

import pytest
import torch

from tools.errors import UserError
from tools.runtime import Forward, Precision, Runtime, resolve_device


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
    assert model.calls[:4] == [24, 16, 8, 4]
    assert all(n <= 4 for n in model.calls[-6:])
    notices = [r.message for r in caplog.records if "out of memory" in r.message]
    assert notices == ["out of memory: batch size lowered from 32 to 4"]


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
