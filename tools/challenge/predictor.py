"""Predicting composites: (foreground, background) index pairs composited on the device and classified, a few
batches in flight without waiting for the device, the fp32 re-check of near ties in reduced precision at fixed
points, and the background-alone predictions."""

from __future__ import annotations

import logging

import numpy as np
import torch

from tools.challenge.data import ChallengeData
from tools.data.compositing import MaskArithmetic, blend, composite
from tools.in9 import PredictionMap
from tools.models.boundary import LoadedModel
from tools.runtime import Forward, Runtime, to_device
from tools.runtime.inflight import Launched, launch, near_ties, top_two_margins

log = logging.getLogger(__name__)

class CompositePredictor:
    """IN-9 predictions for (foreground, background) index pairs, composited on the device. In reduced precision,
    composites whose top-two margin is below `recheck_margin` are re-run in true fp32 by the eager module; that
    re-check halves its own batch on out-of-memory (fp32 needs more than the batch size was fitted to)."""

    def __init__(self, loaded: LoadedModel, runtime: Runtime, data: ChallengeData, batch_size: int | None,
                 recheck_margin: float = 0.0):
        self.runtime, self.data = runtime, data
        eager = runtime.prepare(loaded.model)
        chunk = runtime.batch_size(batch_size)
        self.forward = Forward(runtime.compiled(eager), runtime, chunk)
        self.recheck = Forward(eager, runtime, chunk, exact=True, what="the fp32 re-check's batch size")
        self.to_in9 = PredictionMap(loaded.num_classes)
        self.recheck_margin = recheck_margin
        self.rechecked = self.recheck_changed = 0

    def composite(self, fg_idx: torch.Tensor, bg_idx: torch.Tensor) -> torch.Tensor:
        """The pairs' composites on the device: uint8 on the byte path, float in [0, 1] with the original arithmetic."""
        d = self.data
        join = composite if d.arithmetic is MaskArithmetic.BINARY else blend
        batch = join(d.fg_images.index_select(0, fg_idx), d.bg_images.index_select(0, bg_idx),
                     d.masks.index_select(0, fg_idx))
        return self.runtime.to_device(batch)

    def predict_images(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(predictions, top-two margins or None in fp32) on the device, without waiting for them."""
        logits = self.forward(images)
        preds = self.to_in9(logits)
        if self.runtime.exact:
            return preds, None
        return preds, top_two_margins(logits)

    def _pair_images(self, pairs: np.ndarray) -> torch.Tensor:
        idx = to_device(torch.from_numpy(pairs), self.runtime.device)
        return self.composite(idx[:, 0], idx[:, 1])

    def predict_pairs(self, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.predict_images(self._pair_images(pairs))

    def launch(self, pairs: np.ndarray) -> Launched:
        """Predict the pairs, results copying back to the host; nothing here waits for the device."""
        return launch(pairs, *self.predict_pairs(pairs))

    def near_tie_mask(self, margins: np.ndarray | None) -> np.ndarray:
        """Which rows are near ties to re-check in fp32 (none in fp32, or with the re-check off)."""
        return near_ties(margins, self.recheck_margin)

    def hold(self, pairs: np.ndarray, is_tie: np.ndarray) -> None:
        """Nothing to keep for a held batch: its ties are composited again from their pairs."""

    def recheck_rows(self, images: torch.Tensor, preds: np.ndarray) -> np.ndarray:
        """The fp32 predictions of `images` (near ties whose reduced-precision predictions are `preds`), counted."""
        exact = self.to_in9(self.recheck(images)).cpu().numpy().astype(np.int64)
        self.rechecked += len(exact)
        self.recheck_changed += int((exact != preds).sum())
        return exact

    def fp32_predictions(self, pairs: np.ndarray, preds: np.ndarray) -> np.ndarray:
        return self.recheck_rows(self._pair_images(pairs), preds) if len(pairs) else preds

    def predict_backgrounds(self) -> np.ndarray:
        """The model's prediction on every background alone, at the search's batch shape, near ties re-checked."""
        images = self.data.bg_images
        preds, margins = [], []
        step = self.forward.chunk  # fixed here: an out-of-memory halving inside the loop lowers forward.chunk
        for begin in range(0, len(images), step):
            p, m = self.predict_images(self.runtime.to_device(images[begin:begin + step]))
            preds.append(p.cpu().numpy().astype(np.int64))
            margins.append(None if m is None else m.cpu().numpy())
        preds = np.concatenate(preds) if preds else np.zeros(0, np.int64)
        is_tie = self.near_tie_mask(None if self.runtime.exact else np.concatenate(margins))
        if is_tie.any():
            rows = np.flatnonzero(is_tie)
            preds[rows] = self.recheck_rows(self.runtime.to_device(images[torch.from_numpy(rows)]), preds[rows])
        return preds
