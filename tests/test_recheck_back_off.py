"""Out-of-memory back-off where a model runs in true fp32 beside a reduced-precision batch size: the challenge's
fp32 re-check and CLIP's text head, checked on the CPU with models that run out of memory above a batch size."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.helpers import TINY_CLIP
from tools.challenge import ROBUST, VULNERABLE, ChallengeConfig, list_challenge_files, run_challenge
from tools.models.boundary import LoadedModel, PixelModel
from tools.models.sources import load_model
from tools.runtime import Precision, Runtime

OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class FitsOnlyInBf16(torch.nn.Module):
    """A random convolutional 9-class classifier that runs out of memory on more than `limit` images at once
    in fp32 (autocast off), as a batch size fitted in bf16 may on a GPU; `limit=None`: it always fits."""

    def __init__(self, limit: int | None):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.conv = torch.nn.Conv2d(3, 8, 5, stride=4)
        self.fc = torch.nn.Linear(8, 9)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.limit, self.fp32_calls = limit, []

    def forward(self, x):
        if not torch.is_autocast_enabled("cpu"):
            self.fp32_calls.append(x.shape[0])
            if self.limit is not None and x.shape[0] > self.limit:
                raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def _loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel(PixelModel(model, (0.5,) * 3, (0.25,) * 3), 9, None, None, None, None, "test", "test")


@pytest.mark.slow
def test_the_fp32_recheck_halves_its_own_batch_on_out_of_memory(dataset, tmp_path, caplog, one_thread):
    exact = run_challenge(_loaded(FitsOnlyInBf16(limit=None)), Runtime(torch.device("cpu")),
                          list_challenge_files(dataset.root, 1),
                          ChallengeConfig(batch_size=16, progress=False, full=True), workers=1)
    model = FitsOnlyInBf16(limit=5)
    with caplog.at_level(logging.WARNING):
        fast = run_challenge(_loaded(model), Runtime(torch.device("cpu"), Precision.BF16),
                             list_challenge_files(dataset.root, 1),
                             ChallengeConfig(batch_size=16, progress=False, full=True, recheck_margin=1e9),
                             workers=1)
    assert (exact.state.verdict == VULNERABLE).any() and (exact.state.verdict == ROBUST).any()
    assert fast.state.tested.all()  # full: every pair, and every one re-checked in fp32, as every background
    assert fast.rechecked == fast.state.tested.size + len(fast.state.bg_pred)
    for field in ("verdict", "fool_bg", "fool_pred", "bg_pred"):
        assert np.array_equal(getattr(fast.state, field), getattr(exact.state, field)), field
    assert fast.provenance["batch_size"] == 16  # the bf16 batch keeps the size that fits it
    assert max(model.fp32_calls) == 16 and model.fp32_calls.count(16) == 1  # tried once at full size
    assert all(n <= 4 for n in model.fp32_calls[3:])  # 16 -> 8 -> 4, kept for the later re-checks
    notices = [r.message for r in caplog.records if "out of memory" in r.message]
    assert notices == ["out of memory: the fp32 re-check's batch size lowered from 16 to 4; results from here on may "
                       "differ in the last bits from a run at 16"]


@pytest.mark.slow
def test_the_clip_text_head_halves_its_prompt_batch_on_out_of_memory(tiny_clip, tmp_path, monkeypatch, caplog):
    import open_clip  # noqa: PLC0415 (tiny_clip skips without it)

    spec = f"clip:{TINY_CLIP}/none+head=in9"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fits"))
    expected = load_model(spec, runtime=Runtime(torch.device("cpu"))).model.classifier.head

    encode_text, sizes = open_clip.CLIP.encode_text, []

    def runs_out_above_100(self, text, *args, **kwargs):
        sizes.append(text.shape[0])
        if text.shape[0] > 100:
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB")
        return encode_text(self, text, *args, **kwargs)

    monkeypatch.setattr(open_clip.CLIP, "encode_text", runs_out_above_100)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "runs_out"))  # encoded again, not read from the cache
    with caplog.at_level(logging.WARNING):
        head = load_model(spec, runtime=Runtime(torch.device("cpu"))).model.classifier.head
    torch.testing.assert_close(head, expected, rtol=0, atol=1e-6)
    assert sizes[:2] == [256, 128] and max(sizes[2:]) <= 64
    notices = [r.message for r in caplog.records if "out of memory" in r.message]
    assert notices == ["out of memory: prompts per batch lowered from 256 to 64"]


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.TF32])
@pytest.mark.slow
def test_the_clip_text_head_is_the_fp32_head_in_every_speed_mode(tiny_clip, tmp_path, monkeypatch, precision):
    """The text head is encoded in true fp32 in its own batches, as in the exact mode: neither padded to a fixed
    size (token batches are 2-D, and a head's bits must not depend on the run's precision, which its cache key
    does not hold) nor given the image batches' memory format."""
    import open_clip  # noqa: PLC0415 (tiny_clip skips without it)

    spec = f"clip:{TINY_CLIP}/none+head=in9"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "exact"))
    encode_text, sizes = open_clip.CLIP.encode_text, []
    monkeypatch.setattr(open_clip.CLIP, "encode_text",
                        lambda self, text, *a, **k: sizes.append(text.shape[0]) or encode_text(self, text, *a, **k))
    expected = load_model(spec, runtime=Runtime(torch.device("cpu"))).model.classifier.head
    exact_sizes, sizes[:] = list(sizes), []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fast"))  # encoded again, not read from the cache
    fast = Runtime(torch.device("cpu"), precision, channels_last=True)
    head = load_model(spec, runtime=fast).model.classifier.head
    assert sizes == exact_sizes
    assert torch.equal(head, expected)
