"""Copies to the device, checked without a GPU: asynchronous only from pinned memory to a CUDA device, and a
blocking copy everywhere else (on MPS a non-blocking copy from ordinary memory may read it after it is freed)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tools import runtime
from tools.challenge.data import list_challenge_files, load_challenge_data
from tools.challenge.predictor import CompositePredictor
from tools.models.sources import load_model
from tools.runtime import Runtime
from tools.training.data import device_batch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@dataclass(frozen=True)
class Copy:
    """One `Tensor.to` towards a device other than the CPU."""

    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pinned: bool
    non_blocking: bool

    @property
    def unsafe(self) -> bool:
        return self.non_blocking and not (self.pinned and self.device == "cuda")


def _target(args, kwargs) -> torch.device | None:
    target = kwargs.get("device", args[0] if args else None)
    return torch.device(target) if isinstance(target, (str, torch.device)) else None


@pytest.fixture
def copies(monkeypatch):
    """Every `Tensor.to` towards a non-CPU device, recorded, and a CUDA device faked for copies alone:
    `pin_memory` gives a marked CPU copy (the tensor itself when already marked), and a copy to "cuda" returns
    its source, which stands for the device copy in what follows."""
    real_to = torch.Tensor.to
    pinned: list[torch.Tensor] = []
    recorded: list[Copy] = []

    def is_pinned(self, *args, **kwargs):
        return any(self is p for p in pinned)

    def pin_memory(self, *args, **kwargs):
        if is_pinned(self):
            return self
        pinned.append(self.clone())
        return pinned[-1]

    def to(self, *args, **kwargs):
        target = _target(args, kwargs)
        if target is None or target.type == "cpu":
            return real_to(self, *args, **kwargs)
        non_blocking = bool(kwargs.get("non_blocking", False))
        recorded.append(Copy(target.type, self.dtype, tuple(self.shape), is_pinned(self), non_blocking))
        return self if target.type == "cuda" else real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return recorded


META = torch.device("meta")  # a device other than the CPU that every machine has


def test_runtime_copies_ordinary_memory_blocking(copies):
    batch = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    for channels_last in (False, True):
        out = Runtime(META, channels_last=channels_last).to_device(batch)
        assert out.device.type == "meta" and out.shape == batch.shape
    assert len(copies) == 2
    assert not [c for c in copies if c.unsafe], copies


@pytest.mark.parametrize("augment", [False, True])
def test_training_batches_copy_ordinary_memory_blocking(copies, augment):
    n = 3
    gen = torch.Generator().manual_seed(0)
    batch = {"image": torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=gen),
             "background": torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=gen),
             "mask": torch.rand(n, 224, 224, generator=gen) > 0.5,
             "label": torch.arange(n),
             "crop": torch.tensor([[0, 0, 200, 200]] * n), "flip": torch.tensor([True, False, True])}
    images, labels = device_batch(batch, META, augment)
    assert images.device.type == labels.device.type == "meta" and images.shape == (n, 3, 224, 224)
    assert {c.shape for c in copies} >= {(n, 3, 224, 224), (n, 224, 224), (n,)}
    assert not [c for c in copies if c.unsafe], copies


def test_a_cuda_copy_goes_through_pinned_memory_and_does_not_wait(copies):
    ordinary = torch.arange(6)
    runtime.to_device(ordinary, torch.device("cuda"))
    already = torch.arange(6).pin_memory()
    runtime.to_device(already, torch.device("cuda"))
    assert [(c.pinned, c.non_blocking) for c in copies] == [(True, True), (True, True)]
    runtime.to_device(ordinary, torch.device("cuda:0"))
    assert copies[-1].pinned and copies[-1].non_blocking
    # the already pinned batch (a loader's) is not copied again on the host
    assert torch.Tensor.pin_memory(already) is already


def test_the_challenge_index_copies_go_through_pinned_memory(copies, dataset, color_ts):
    data = load_challenge_data(list_challenge_files(dataset.root, 1), workers=1, progress=False)
    loaded = load_model(checkpoint=color_ts[9], trust=True)  # TorchScript: code, trusted
    predictor = CompositePredictor(loaded, Runtime(torch.device("cpu")), data, 8)
    expected = predictor.predict_pairs(np.array([[0, 1], [2, 0], [1, 3]], dtype=np.int64))[0]
    predictor.runtime = Runtime(torch.device("cuda"))  # data and model stay on the CPU: only the copies are seen
    pairs = np.array([[0, 1], [2, 0], [1, 3]], dtype=np.int64)
    preds = predictor.predict_pairs(pairs)[0]
    assert torch.equal(preds, expected)
    index_copies = [c for c in copies if c.dtype == torch.int64]
    assert index_copies and all(c.pinned and c.non_blocking for c in index_copies), copies
    assert not [c for c in copies if c.unsafe], copies


def test_only_the_runtime_decides_whether_a_copy_waits():
    """`non_blocking` is spelled in tools/runtime/__init__.py alone: every other module copies through its helper."""
    offenders = []
    for path in sorted(TOOLS.rglob("*.py")):
        if path == TOOLS / "runtime" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.keyword) and node.arg == "non_blocking":
                offenders.append(f"{path.relative_to(TOOLS.parent)}:{node.value.lineno}")
    assert not offenders, offenders


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fresh_pinned_memory_per_batch_is_not_overwritten_while_copies_wait():
    """Every batch is staged in pinned memory of its own, freed as soon as its copy is queued: the caching host
    allocator hands a block out again only after the copy that read it has finished, so batches queued behind
    a long kernel still arrive intact (a staging buffer reused by hand would deliver the last batch's values)."""
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy: every copy below is still queued when the next is staged
    arrived = [runtime.to_device(torch.full((1 << 20,), i, dtype=torch.int32), device) for i in range(16)]
    assert [int(t.min()) for t in arrived] == list(range(16))
    assert [int(t.max()) for t in arrived] == list(range(16))
