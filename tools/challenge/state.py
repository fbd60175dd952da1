"""The search's state: everything needed to continue exactly where a run stopped, saved atomically."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from tools.errors import NUMPY_READ_ERRORS, UserError, option
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED
from tools.provenance import atomic_write, read_npz

UNKNOWN, ROBUST, VULNERABLE = -1, 0, 1
STATE_NAME = "challenge_state.npz"


@dataclass
class SearchState:
    """Everything the search needs to continue exactly where it stopped."""

    verdict: np.ndarray  # int8 (F,): UNKNOWN / ROBUST / VULNERABLE
    fool_bg: np.ndarray  # int64 (F,): the first fooling background found, or -1
    fool_pred: np.ndarray  # int64 (F,): the prediction it caused
    min_margin: np.ndarray  # float32 (F,): smallest top-two margin a verdict rests on (reduced precision)
    tested: np.ndarray  # bool (F, B)
    # per foreground class and background, over the rounds closed so far (Scheduler._commit_round):
    successes: np.ndarray  # int64 (9, B): foregrounds fooled first by the background
    trials: np.ndarray  # int64 (9, B): pairs tested up to each foreground's first fooling one
    bg_pred: np.ndarray  # int64 (B,): the model's prediction on each background alone
    worklist: np.ndarray  # int32 (N, 2): this round's pairs, rank-major (empty in --full mode)
    position: int = 0  # next worklist entry to batch
    pending: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # launched, unprocessed
    pending_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their batches' sizes, in order
    round: int = 0
    evaluated: int = 0
    matrix: np.ndarray | None = None  # int8 (F, B) in --full mode
    elapsed: float = 0.0

    @classmethod
    def fresh(cls, n_fg: int, n_bg: int, bg_pred: np.ndarray, full: bool) -> "SearchState":
        return cls(verdict=np.full(n_fg, UNKNOWN, np.int8), fool_bg=np.full(n_fg, -1, np.int64),
                   fool_pred=np.full(n_fg, UNMAPPED, np.int64), min_margin=np.full(n_fg, np.inf, np.float32),
                   tested=np.zeros((n_fg, n_bg), bool), successes=np.zeros((NUM_IN9_CLASSES, n_bg), np.int64),
                   trials=np.zeros((NUM_IN9_CLASSES, n_bg), np.int64), bg_pred=bg_pred,
                   worklist=np.zeros((0, 2), np.int32),
                   matrix=np.full((n_fg, n_bg), UNMAPPED, np.int8) if full else None)

    def snapshot(self, pending: list[np.ndarray]) -> "SearchState":
        """A copy to save while the search goes on, with `pending` (the batches launched and not yet recorded)."""
        copied = {f.name: getattr(self, f.name) for f in fields(self)}
        copied = {name: value.copy() if isinstance(value, np.ndarray) else value for name, value in copied.items()}
        copied["pending"] = np.concatenate(pending).astype(np.int64) if pending else np.zeros((0, 2), np.int64)
        copied["pending_sizes"] = np.array([len(batch) for batch in pending], np.int64)
        return SearchState(**copied)

    def pending_batches(self) -> list[np.ndarray]:
        """The pending pairs as the batches they were launched in (one batch where the sizes are not known)."""
        if not len(self.pending):
            return []
        sizes = self.pending_sizes if self.pending_sizes.sum() == len(self.pending) else [len(self.pending)]
        return np.split(self.pending, np.cumsum(sizes)[:-1])

    def save(self, path: Path, key: str) -> None:
        arrays = {name: getattr(self, name) for name in ("verdict", "fool_bg", "fool_pred", "min_margin", "successes",
                                                         "trials", "bg_pred", "worklist", "pending",
                                                         "pending_sizes")}
        arrays["tested"] = np.packbits(self.tested, axis=1)
        arrays["shape"] = np.array(self.tested.shape)
        arrays["scalars"] = np.array([self.position, self.round, self.evaluated], np.int64)
        arrays["elapsed"] = np.array(self.elapsed)
        arrays["key"] = np.frombuffer(key.encode(), np.uint8)
        if self.matrix is not None:
            arrays["matrix"] = self.matrix
        with atomic_write(path, "wb") as fh:
            np.savez(fh, **arrays)

    @classmethod
    def load(cls, path: Path, key: str) -> "SearchState":
        try:
            z = read_npz(path)
            if bytes(z["key"]).decode() != key:
                raise UserError(f"{path} belongs to another run (model, data or settings differ); rerun without "
                                f"{option('--resume')}, or pick another {option('--output-dir')}")
            shape = tuple(z["shape"])
            position, round_, evaluated = (int(v) for v in z["scalars"])
            return cls(verdict=z["verdict"], fool_bg=z["fool_bg"], fool_pred=z["fool_pred"],
                       min_margin=z["min_margin"],
                       tested=np.unpackbits(z["tested"], axis=1, count=shape[1]).astype(bool),
                       successes=z["successes"], trials=z["trials"], bg_pred=z["bg_pred"],
                       worklist=z["worklist"], position=position, pending=z["pending"], round=round_,
                       pending_sizes=z["pending_sizes"] if "pending_sizes" in z else np.zeros(0, np.int64),
                       evaluated=evaluated, matrix=z["matrix"] if "matrix" in z else None,
                       elapsed=float(z["elapsed"]))
        except (*NUMPY_READ_ERRORS, KeyError) as exc:
            raise UserError(f"cannot read the saved state {path} ({exc}); rerun without {option('--resume')}") \
                from None
