"""The search's state: everything needed to continue exactly where a run stopped, saved atomically."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from tools.errors import NUMPY_READ_ERRORS, UserError, option
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED
from tools.provenance import atomic_write, checked_array, read_npz

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
    def fresh(cls, n_fg: int, n_bg: int, bg_pred: np.ndarray, full: bool) -> SearchState:
        return cls(verdict=np.full(n_fg, UNKNOWN, np.int8), fool_bg=np.full(n_fg, -1, np.int64),
                   fool_pred=np.full(n_fg, UNMAPPED, np.int64), min_margin=np.full(n_fg, np.inf, np.float32),
                   tested=np.zeros((n_fg, n_bg), bool), successes=np.zeros((NUM_IN9_CLASSES, n_bg), np.int64),
                   trials=np.zeros((NUM_IN9_CLASSES, n_bg), np.int64), bg_pred=bg_pred,
                   worklist=np.zeros((0, 2), np.int32),
                   matrix=np.full((n_fg, n_bg), UNMAPPED, np.int8) if full else None)

    @classmethod
    def finished(cls, n_fg: int, bg_pred: np.ndarray, full: bool) -> SearchState:
        """A finished search's state of `n_fg` foregrounds, for its verdicts (and --full matrix): the merge of
        shards. Nothing of foregrounds x backgrounds is made but the matrix."""
        state = cls.fresh(n_fg, 0, bg_pred, full=False)
        state.bg_pred = bg_pred
        state.matrix = np.full((n_fg, len(bg_pred)), UNMAPPED, np.int8) if full else None
        return state

    def snapshot(self, pending: list[np.ndarray]) -> SearchState:
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
    def load(cls, path: Path, key: str, n_fg: int, n_bg: int, full: bool) -> SearchState:
        """The state saved at `path` by the run of `key`, every array checked for the shape, kind and range such a
        run writes (--full matrix with `full`) before anything of its size is made (`scheduler.state_problem` then
        checks its meaning). Anything else is one UserError."""
        try:
            z = read_npz(path)
            if bytes(z["key"]).decode() != key:
                raise UserError(f"{path} belongs to another run (model, data, settings or whether the start-up device "
                                f"check verified the model differ); rerun without "
                                f"{option('--resume')}, or pick another {option('--output-dir')}")
            return cls._checked(z, n_fg, n_bg, full)
        except (*NUMPY_READ_ERRORS, KeyError) as exc:
            raise UserError(f"cannot read the saved state {path} ({exc}); rerun without {option('--resume')}") \
                from None

    @classmethod
    def _checked(cls, z: dict[str, np.ndarray], n_fg: int, n_bg: int, full: bool) -> SearchState:
        f, b, pairs = n_fg, n_bg, n_fg * n_bg
        shape = tuple(int(v) for v in checked_array(z, "shape", (2,), "iu"))
        if shape != (f, b):
            raise ValueError(f"it is of {shape[0]} foregrounds x {shape[1]} backgrounds, this run of {f} x {b}")
        if full != ("matrix" in z):
            raise ValueError(f"it lacks the whole prediction matrix ({option('--full')})" if full else
                             f"it holds the whole prediction matrix ({option('--full')}), which this run does not make")
        position, round_, evaluated = (int(v) for v in checked_array(z, "scalars", (3,), "iu", 0))
        worklist = _pairs(z, "worklist", f, b, np.int32)
        if full and len(worklist):
            raise ValueError(f"a run with {option('--full')} plans no rounds, but it holds a worklist")
        if position > (pairs if full else len(worklist)):
            raise ValueError(f"its position {position} is past the pairs it plans")
        sizes = checked_array(z, "pending_sizes", (None,), "iu", 0, dtype=np.int64) if "pending_sizes" in z \
            else np.zeros(0, np.int64)
        elapsed = checked_array(z, "elapsed", (), "fiu", 0)
        if not np.isfinite(elapsed):
            raise ValueError("elapsed is not a finite number of seconds")
        tested = np.unpackbits(checked_array(z, "tested", (f, (b + 7) // 8), "u"), axis=1, count=b).astype(bool)
        return cls(verdict=checked_array(z, "verdict", (f,), "iu", UNKNOWN, VULNERABLE, np.int8),
                   fool_bg=checked_array(z, "fool_bg", (f,), "iu", -1, b - 1, np.int64),
                   fool_pred=checked_array(z, "fool_pred", (f,), "iu", UNMAPPED, NUM_IN9_CLASSES - 1, np.int64),
                   min_margin=checked_array(z, "min_margin", (f,), "f", 0, dtype=np.float32),
                   tested=tested,
                   successes=checked_array(z, "successes", (NUM_IN9_CLASSES, b), "iu", 0, f, np.int64),
                   trials=checked_array(z, "trials", (NUM_IN9_CLASSES, b), "iu", 0, f, np.int64),
                   bg_pred=checked_array(z, "bg_pred", (b,), "iu", UNMAPPED, NUM_IN9_CLASSES - 1, np.int64),
                   worklist=worklist, position=position, pending=_pairs(z, "pending", f, b, np.int64), round=round_,
                   pending_sizes=sizes, evaluated=evaluated, elapsed=float(elapsed),
                   matrix=checked_array(z, "matrix", (f, b), "iu", UNMAPPED, NUM_IN9_CLASSES - 1, np.int8)
                   if full else None)


def _pairs(z: dict[str, np.ndarray], name: str, n_fg: int, n_bg: int, dtype) -> np.ndarray:
    """An (N, 2) array of (foreground, background) pairs of a saved state, checked to name this run's."""
    pairs = checked_array(z, name, (None, 2), "iu", 0, dtype=dtype)
    if len(pairs) > n_fg * n_bg:
        raise ValueError(f"{name} holds {len(pairs)} pairs, more than the run's {n_fg} x {n_bg}")
    if len(pairs) and (pairs[:, 0].max() >= n_fg or pairs[:, 1].max() >= n_bg):
        raise ValueError(f"{name} names pairs beyond the run's {n_fg} foregrounds x {n_bg} backgrounds")
    return pairs
