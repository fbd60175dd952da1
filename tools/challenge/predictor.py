"""Predicting composites: (foreground, background) index pairs composited on the device and classified,
with the fp32 re-check of near ties in reduced precision, and the background-alone predictions."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tools.challenge.data import ChallengeData
from tools.data.compositing import MaskArithmetic, blend, composite
from tools.in9 import PredictionMap
from tools.models.boundary import LoadedModel
from tools.runtime import CPU_BATCH_CANDIDATES, Forward, Runtime, to_device

log = logging.getLogger(__name__)


class CompositePredictor:
    """IN-9 predictions for (foreground, background) index pairs, composited on the device.

    In reduced precision (bf16, fp16, tf32), composites whose top-two logit margin is below `recheck_margin`
    are run again in true fp32 (`Runtime.fp32_math`: no autocast, TF32 off), so the fast mode gives the
    fp32 prediction wherever a near tie could flip it. The re-check halves its own batch on out-of-memory:
    fp32 needs more memory than the precision the batch size fits.
    """

    def __init__(self, loaded: LoadedModel, runtime: Runtime, data: ChallengeData, batch_size: int | None,
                 recheck_margin: float = 0.0):
        self.runtime, self.data = runtime, data
        self.model = runtime.prepare(loaded.model)
        chunk = runtime.batch_size(batch_size)
        self.forward = Forward(self.model, runtime, chunk)
        self.recheck = Forward(self.model, runtime, chunk, exact=True, what="the fp32 re-check's batch size")
        self.to_in9 = PredictionMap(loaded.num_classes)
        self.recheck_margin = recheck_margin
        self.rechecked = self.recheck_changed = 0

    def composite(self, fg_idx: torch.Tensor, bg_idx: torch.Tensor) -> torch.Tensor:
        """The composites of the pairs, on the device: uint8 on the byte path, float in [0, 1] with the
        original's arithmetic (see tools.data.compositing)."""
        d = self.data
        join = composite if d.arithmetic is MaskArithmetic.BINARY else blend
        batch = join(d.fg_images.index_select(0, fg_idx), d.bg_images.index_select(0, bg_idx),
                     d.masks.index_select(0, fg_idx))
        return self.runtime.to_device(batch)

    def predict_images(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(predictions, top-two margins or None) on the device, without waiting for them."""
        logits = self.forward(images)
        preds = self.to_in9(logits)
        if self.runtime.exact:
            return preds, None
        top2 = logits.float().topk(2, dim=1).values
        margin = top2[:, 0] - top2[:, 1]
        if self.recheck_margin > 0:
            close = margin < self.recheck_margin
            # one synchronisation per batch in reduced precision: the price of fp32 verdicts
            idx = close.nonzero().flatten()
            if idx.numel():
                exact = self.to_in9(self.recheck(images[idx]).float())
                self.rechecked += int(idx.numel())
                self.recheck_changed += int((exact != preds[idx]).sum())
                preds = preds.clone()
                preds[idx] = exact
                margin = margin.clone()
                margin[idx] = float("inf")
        return preds, margin

    def predict_pairs(self, pairs: np.ndarray):
        idx = to_device(torch.from_numpy(pairs), self.runtime.device)
        return self.predict_images(self.composite(idx[:, 0], idx[:, 1]))

    def predict_backgrounds(self, measure: bool = False) -> np.ndarray:
        """The model's prediction on every background alone, in batches of the search's size.

        measure: choose the search's batch size here (the CPU default): each of CPU_BATCH_CANDIDATES runs
        twice on backgrounds that need predicting anyway, the first run warming it up, and the size with
        the shortest time per image in the second run is kept."""
        images, preds, start = self.data.bg_images, [], 0
        timings: dict[int, float] = {}
        for size in (s for s in CPU_BATCH_CANDIDATES for _ in range(2)) if measure else ():
            if start + size > len(images):
                break
            self.forward.chunk = size
            began = time.perf_counter()
            preds.append(self.predict_images(self.runtime.to_device(images[start:start + size]))[0])
            timings[size] = (time.perf_counter() - began) / size
            start += size
        if timings:
            self.forward.chunk = self.recheck.chunk = min(timings, key=timings.get)
            log.info("batch size %d chosen by timing %s", self.forward.chunk,
                     ", ".join(f"{k}: {1e3 * v:.1f} ms/image" for k, v in timings.items()))
        size = self.forward.chunk
        for begin in range(start, len(images), size):
            preds.append(self.predict_images(self.runtime.to_device(images[begin:begin + size]))[0])
        return torch.cat(preds).cpu().numpy().astype(np.int64)
