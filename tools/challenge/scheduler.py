"""Which pairs to test next, and what their predictions mean: scores, rounds, the next batch, recording
results into the state, and the verdicts of a --full matrix. No model, no I/O: numpy over `SearchState`."""

from __future__ import annotations

import numpy as np

from tools.challenge.config import ChallengeConfig, Criterion
from tools.challenge.state import ROBUST, UNKNOWN, VULNERABLE, SearchState
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED

FIRST_ROUND_BACKGROUNDS = 1  # offered to each open foreground in the first round; doubling each round


def fooling(predictions: np.ndarray, fg_labels: np.ndarray, bg_labels: np.ndarray, criterion: Criterion) -> np.ndarray:
    """Whether each prediction fools its foreground (arrays broadcast): `any`, any class but the foreground's;
    `bg-class`, the background's class where that is not the foreground's."""
    if criterion is Criterion.ANY:
        return predictions != fg_labels
    return (predictions == bg_labels) & (bg_labels != fg_labels)


def split_untested(tested: np.ndarray, parts: int) -> np.ndarray:
    """Cut the untested pairs of `tested` (F, B), foreground-major, into `parts` runs differing by one at most: the
    parts + 1 flat start positions, the last the end (F * B)."""
    left_per_row = tested.shape[1] - tested.sum(axis=1)
    left_before = np.cumsum(left_per_row)  # untested pairs up to the end of each row
    total = int(left_before[-1]) if len(left_before) else 0
    bounds = np.full(parts + 1, tested.size, np.int64)
    bounds[0] = 0
    for part in range(1, parts):
        k = total * part // parts  # the first pair of the part is the k-th untested (from 0)
        if k < total:
            row = int(np.searchsorted(left_before, k, side="right"))
            column = np.flatnonzero(~tested[row])[k - (left_before[row] - left_per_row[row])]
            bounds[part] = row * tested.shape[1] + column
    return bounds


def state_problem(state: SearchState, fg_labels: np.ndarray, bg_labels: np.ndarray, criterion: Criterion,
                  tested: bool = True) -> str | None:
    """What makes `state` (arrays checked by `SearchState.load`) other than one the search writes for these
    classes under `criterion`; None when nothing does. Verdicts must fit: a vulnerable foreground names a background
    that fools it (with the matrix, its row's first), a robust one none; with `tested` (not a shard's) a verdict rests
    on tested pairs, an untested pair has no prediction, and no background fooled more than it was tried on."""
    s, rows = state, np.arange(len(fg_labels))
    vulnerable, robust = s.verdict == VULNERABLE, s.verdict == ROBUST
    fool_bg = np.where(vulnerable, s.fool_bg, 0)
    named = vulnerable & (s.fool_bg >= 0)
    fools = fooling(s.fool_pred, fg_labels, bg_labels[fool_bg], criterion)
    checks = [(vulnerable & ~(named & fools), "vulnerable without a background that fools it"),
              (~vulnerable & ((s.fool_bg != -1) | (s.fool_pred != UNMAPPED)), "not vulnerable, yet naming a "
                                                                             "fooling background")]
    if s.matrix is not None:
        fooled = fooling(s.matrix.astype(np.int64), fg_labels[:, None], bg_labels[None, :], criterion)
        first = fooled.argmax(axis=1)
        done = s.verdict != UNKNOWN
        checks += [(done & (fooled.any(axis=1) != vulnerable), "of a verdict its matrix row does not give"),
                   (vulnerable & ((s.fool_bg != first) | (s.matrix[rows, fool_bg] != s.fool_pred)),
                    "vulnerable to another background or prediction than its matrix row's first")]
    if tested:
        eligible = np.ones((NUM_IN9_CLASSES, len(bg_labels)), bool) if criterion is Criterion.ANY else \
            bg_labels[None, :] != np.arange(NUM_IN9_CLASSES)[:, None]
        checks += [(robust & (~s.tested & eligible[fg_labels]).any(axis=1), "robust without being tested against "
                                                                             "every background"),
                   (vulnerable & ~s.tested[rows, fool_bg], "vulnerable to a background it was not tested on")]
        if s.matrix is not None and (s.matrix[~s.tested] != UNMAPPED).any():
            return "its matrix holds predictions of pairs it never tested"
        if (s.successes > s.trials).any():
            return "a background fooled more foregrounds than it was tried on"
    for wrong, what in checks:
        if wrong.any():
            return f"{int(wrong.sum())} foreground(s) {what} (the first: foreground {int(np.argmax(wrong))})"
    return None


class Scheduler:
    """Plans the pairs of a `SearchState` and folds their predictions back into it: rounds offering each open
    foreground its next k untested eligible backgrounds by score (k = FIRST_ROUND_BACKGROUNDS, doubling); with
    --full, every pair in foreground-major order."""

    def __init__(self, state: SearchState, fg_labels: np.ndarray, bg_labels: np.ndarray, config: ChallengeConfig):
        self.state, self.config = state, config
        self.fg_labels, self.bg_labels = fg_labels, bg_labels
        self.n_fg, self.n_bg = len(fg_labels), len(bg_labels)
        # eligible[c, b]: may a background b count against a foreground of class c?
        self.eligible = np.ones((NUM_IN9_CLASSES, self.n_bg), bool)
        if config.criterion is Criterion.BG_CLASS:
            self.eligible = self.bg_labels[None, :] != np.arange(NUM_IN9_CLASSES)[:, None]

    @property
    def full(self) -> bool:
        return self.state.matrix is not None

    def resolved(self) -> int:
        """Progress so far: foregrounds with a verdict, or pairs evaluated with --full."""
        return int(self.state.evaluated) if self.full else int((self.state.verdict != UNKNOWN).sum())

    def total(self) -> int:
        return self.n_fg * self.n_bg if self.full else self.n_fg

    # -- planning ----------------------------------------------------------------------------------------------
    def scores(self) -> np.ndarray:
        """(9, B): how promising each background is against each class's foregrounds."""
        s = self.state
        c = np.arange(NUM_IN9_CLASSES)[:, None]
        if self.config.criterion is Criterion.ANY:
            prior = (s.bg_pred[None, :] != c).astype(np.float64)
        else:
            prior = np.broadcast_to((s.bg_pred == self.bg_labels).astype(np.float64)[None, :],
                                    (NUM_IN9_CLASSES, self.n_bg))
        rate_class = (s.successes + prior) / (s.trials + 1.0)
        rate_all = (s.successes.sum(0) + prior.mean(0)) / (s.trials.sum(0) + 1.0)
        return rate_class + 0.5 * rate_all[None, :]

    def new_round(self) -> bool:
        """Close the ended round and plan the next; False when nothing is left (or with --full)."""
        if self.full:
            return False
        self._commit_round()
        self.state.worklist, self.state.position = self._round_pairs(), 0
        return len(self.state.worklist) > 0

    def _commit_round(self) -> None:
        """Add the ended round to the per-class statistics as if each foreground's pairs had been tested one by one
        in rank order up to its first fooling one: so the next rounds depend on plan and outcomes alone, not on batching
        or processes."""
        s = self.state
        pairs = s.worklist.astype(np.int64)
        if not len(pairs):
            return
        f, b = pairs[:, 0], pairs[:, 1]
        order = np.argsort(f, kind="stable")  # each foreground's pairs, in rank order
        position = np.empty(len(f), np.int64)
        starts = np.r_[0, np.flatnonzero(np.diff(f[order])) + 1]
        position[order] = np.arange(len(f)) - np.repeat(starts, np.diff(np.r_[starts, len(f)]))
        fooled_here = (s.verdict[f] == VULNERABLE) & (s.fool_bg[f] == b)
        cutoff = np.full(self.n_fg, np.iinfo(np.int64).max)
        cutoff[f[fooled_here]] = position[fooled_here]
        counted = position <= cutoff[f]
        labels = self.fg_labels[f]
        np.add.at(s.trials, (labels[counted], b[counted]), 1)
        np.add.at(s.successes, (labels[fooled_here], b[fooled_here]), 1)

    def _round_pairs(self) -> np.ndarray:
        """The next round's pairs: each open foreground's next k untested eligible backgrounds, rank-major."""
        s = self.state
        k = FIRST_ROUND_BACKGROUNDS << min(s.round, 40)
        scores = self.scores()
        open_fg = np.nonzero(s.verdict == UNKNOWN)[0]
        fgs, bgs, ranks = [], [], []
        for c in np.unique(self.fg_labels[open_fg]):
            members = open_fg[self.fg_labels[open_fg] == c]
            order = np.lexsort((np.arange(self.n_bg), -scores[c]))  # best first, ties by index
            order = order[self.eligible[c, order]]
            untested = ~s.tested[members][:, order]
            exhausted = ~untested.any(axis=1)
            s.verdict[members[exhausted]] = ROBUST
            rank = np.cumsum(untested, axis=1)
            rows, cols = np.nonzero(untested & (rank <= k))
            fgs.append(members[rows])
            bgs.append(order[cols])
            ranks.append(rank[rows, cols])
        s.round += 1
        if not fgs:
            return np.zeros((0, 2), np.int64)
        fgs, bgs, ranks = np.concatenate(fgs), np.concatenate(bgs), np.concatenate(ranks)
        order = np.lexsort((fgs, ranks))
        return np.stack([fgs[order], bgs[order]], axis=1).astype(np.int32)

    def next_batch(self, size: int) -> np.ndarray | None:
        """Up to `size` next pairs of this round still to test; None at the end of the round."""
        s = self.state
        if self.full:  # the untested pairs in foreground-major order, from the position on
            batch, s.position = self.take_untested(s.position, self.n_fg * self.n_bg, size)
        else:
            batch, s.position = self.take_open(s.worklist, s.position, size)
        return batch

    def take_untested(self, position: int, end: int, size: int) -> tuple[np.ndarray | None, int]:
        """With --full: up to `size` untested pairs (foreground-major) from flat `position` up to `end`, and the
        position after them; None when none is left (pairs past `position` may be tested already by other
        processes)."""
        flat = self.state.tested.reshape(-1)
        picked = []
        count = 0
        while position < end and count < size:
            stop = min(end, position + size - count)
            picked.append(position + np.flatnonzero(~flat[position:stop]))
            count += len(picked[-1])
            position = stop
        if not count:
            return None, position
        idx = np.concatenate(picked)
        return np.stack([idx // self.n_bg, idx % self.n_bg], axis=1), position

    def left_in_round(self) -> np.ndarray:
        """Where in this round's worklist the pairs still to test are: untested, of a foreground still open."""
        s = self.state
        f, b = s.worklist[:, 0], s.worklist[:, 1]
        return np.flatnonzero(~s.tested[f, b] & (s.verdict[f] == UNKNOWN))

    def rewind(self) -> None:
        """Point the state at the first pair still to test, none in flight, after pairs were tested out of order
        (processes sharing the work): a resumed run skips the tested pairs after it."""
        s = self.state
        s.pending, s.pending_sizes = np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
        if self.full:
            rows = np.flatnonzero(~s.tested.all(axis=1))
            s.position = int(rows[0]) * self.n_bg + int(np.argmin(s.tested[rows[0]])) if len(rows) else s.tested.size
        else:
            left = self.left_in_round()
            s.position = int(left[0]) if len(left) else len(s.worklist)

    def take_open(self, pairs: np.ndarray, position: int, size: int) -> tuple[np.ndarray | None, int]:
        """Up to `size` pairs of `pairs` from `position` on, untested and of an open foreground, and the position after
        them; None when none is left."""
        s = self.state
        picked = []
        count = 0
        while position < len(pairs) and count < size:
            chunk = pairs[position:position + (size - count) * 2]
            keep = (s.verdict[chunk[:, 0]] == UNKNOWN) & ~s.tested[chunk[:, 0], chunk[:, 1]]
            taken = chunk[keep][:size - count].astype(np.int64)
            # advance past what was taken, and past the skipped pairs before it
            used = np.nonzero(keep)[0][len(taken) - 1] + 1 if len(taken) else len(chunk)
            position += int(used)
            picked.append(taken)
            count += len(taken)
        return (np.concatenate(picked) if count else None), position

    # -- results -----------------------------------------------------------------------------------------------
    def record(self, pairs: np.ndarray, preds: np.ndarray, margins: np.ndarray | None) -> None:
        """Fold one batch's predictions (and, in reduced precision, top-two margins) into the state."""
        s = self.state
        f, b = pairs[:, 0], pairs[:, 1]
        fooled = fooling(preds, self.fg_labels[f], self.bg_labels[b], self.config.criterion)
        s.tested[f, b] = True
        s.evaluated += len(pairs)
        if margins is not None:
            open_rows = s.verdict[f] == UNKNOWN
            np.minimum.at(s.min_margin, f[open_rows & ~fooled], margins[open_rows & ~fooled])
        if self.full:  # verdicts come from the whole matrix at the end
            s.matrix[f, b] = preds
            return
        hits = np.nonzero(fooled)[0]
        _, first = np.unique(f[hits], return_index=True)  # each foreground's first fooling pair in the batch
        won = hits[first]
        won = won[s.verdict[f[won]] == UNKNOWN]
        s.verdict[f[won]], s.fool_bg[f[won]], s.fool_pred[f[won]] = VULNERABLE, b[won], preds[won]
        if margins is not None:
            s.min_margin[f[won]] = margins[won]

    def finish(self) -> None:
        """With --full, the verdicts from the whole matrix; otherwise the search already holds them."""
        if not self.full:
            return
        s = self.state
        m = s.matrix.astype(np.int64)
        fooled = fooling(m, self.fg_labels[:, None], self.bg_labels[None, :], self.config.criterion)
        vulnerable = fooled.any(axis=1)
        s.verdict = np.where(vulnerable, VULNERABLE, ROBUST).astype(np.int8)
        first = fooled.argmax(axis=1)
        s.fool_bg = np.where(vulnerable, first, -1)
        s.fool_pred = np.where(vulnerable, m[np.arange(len(m)), first], UNMAPPED)
