"""Batches in flight without waiting for the device, near ties held and re-checked in fp32 at points fixed by the
data alone; shared by the challenge's search and in9's stream (docs/how-it-works.md, "The device loop")."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tools.runtime import to_host

IN_FLIGHT = 2  # batches launched and not yet waited for


@dataclass
class Launched:
    """A batch on its way: its keys, and its predictions and margins (None in fp32) copying to the host until
    `event` (None: done) has passed."""

    keys: np.ndarray
    preds: torch.Tensor
    margins: torch.Tensor | None
    event: torch.cuda.Event | None

    def wait(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.event is not None:
            self.event.synchronize()
        return (self.preds.numpy().astype(np.int64),
                None if self.margins is None else self.margins.numpy().astype(np.float32))


def launch(keys: np.ndarray, preds: torch.Tensor, margins: torch.Tensor | None) -> Launched:
    """The batch's device results copying back to the host, without waiting for them."""
    host, event = to_host(*(t for t in (preds, margins) if t is not None))
    return Launched(keys, host[0], host[1] if len(host) > 1 else None, event)


def top_two_margins(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the top logit minus the second, in fp32; 0 where that is NaN (overflowed logits), so such a row is a
    near tie, never a sure prediction."""
    top2 = logits.float().topk(2, dim=1).values
    return (top2[:, 0] - top2[:, 1]).nan_to_num(nan=0.0, posinf=torch.inf)


def near_ties(margins: np.ndarray | None, margin: float) -> np.ndarray:
    """Which rows to re-check in fp32: margins below `margin` (none in fp32 or with `margin` 0)."""
    if margins is None or margin <= 0:
        return np.zeros(0 if margins is None else len(margins), bool)
    return margins < margin


class Predicts(Protocol):
    """What a `Pipeline` drives; `recheck` is a `Forward` whose chunk sets when held ties are re-checked."""

    recheck: object

    def launch(self, keys: np.ndarray) -> Launched: ...

    def near_tie_mask(self, margins: np.ndarray | None) -> np.ndarray: ...

    def hold(self, keys: np.ndarray, is_tie: np.ndarray) -> None:
        """A waited-for batch is held until its near ties (`is_tie`) are re-checked: keep what that needs."""

    def fp32_predictions(self, keys: np.ndarray, preds: np.ndarray) -> np.ndarray:
        """The fp32 predictions of the held near ties `keys`, whose reduced-precision predictions are `preds`."""


class Pipeline:
    """Batches launched `IN_FLIGHT` ahead of the one being recorded. A batch with near ties (reduced precision) is
    held, with every batch after it, until a batch's worth of ties has gathered or `drain`; the ties are re-checked
    in full fp32 batches, then the held batches recorded in launch order, so at one batch shape no prediction
    depends on where a run was stopped and resumed."""

    def __init__(self, predictor: Predicts, record: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None]):
        self.predictor, self.record = predictor, record
        self.in_flight: deque[Launched] = deque()
        self.held: list[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]] = []
        self.ties = 0

    def launch(self, keys: np.ndarray) -> None:
        self.in_flight.append(self.predictor.launch(keys))
        while len(self.in_flight) > IN_FLIGHT:
            self._finish(self.in_flight.popleft())

    def busy(self) -> bool:
        return bool(self.in_flight or self.held)

    def unrecorded(self) -> list[np.ndarray]:
        """The batches launched and not yet recorded, in launch order (a saved state's pending batches)."""
        return [held[0] for held in self.held] + [launched.keys for launched in self.in_flight]

    def drain(self) -> None:
        """Wait for every batch, re-check the held ties and record everything."""
        while self.in_flight:
            self._finish(self.in_flight.popleft())
        self._recheck()

    def _finish(self, launched: Launched) -> None:
        preds, margins = launched.wait()
        is_tie = self.predictor.near_tie_mask(margins)
        if not self.held and not is_tie.any():
            self.record(launched.keys, preds, margins)
            return
        self.predictor.hold(launched.keys, is_tie)
        self.held.append((launched.keys, preds, margins, is_tie))
        self.ties += int(is_tie.sum())
        if self.ties >= self.predictor.recheck.chunk:
            self._recheck()

    def _recheck(self) -> None:
        if not self.held:
            return
        keys = np.concatenate([h[0][h[3]] for h in self.held]).astype(np.int64)
        fast = np.concatenate([h[1][h[3]] for h in self.held])
        exact, at = self.predictor.fp32_predictions(keys, fast), 0
        for batch, preds, margins, is_tie in self.held:
            rows = np.flatnonzero(is_tie)
            preds[rows], margins[rows] = exact[at:at + len(rows)], np.inf
            at += len(rows)
            self.record(batch, preds, margins)
        self.held, self.ties = [], 0
