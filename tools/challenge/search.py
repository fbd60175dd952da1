"""The search loop (launching batches one ahead, the progress bar, the save cadence) and the whole run."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tools import distributed
from tools.challenge.data import ChallengeData, ChallengeFiles, load_challenge_data
from tools.challenge.predictor import CompositePredictor
from tools.challenge.result import ChallengeResult
from tools.challenge.scheduler import ChallengeConfig, Scheduler
from tools.challenge.state import STATE_NAME, UNKNOWN, SearchState
from tools.models import LoadedModel
from tools.provenance import provenance
from tools.runtime import Runtime
from tools.shards import Shard

log = logging.getLogger(__name__)

STATE_FORMAT = "state-2"  # statistics closed per round (a state saved by an earlier version is not resumed)


class Search:
    """The loop: batches from a `Scheduler`, predicted by a `CompositePredictor` one batch ahead (so the
    device works while the last results are recorded), a progress bar, and the state saved every
    `save_every` seconds and at the end."""

    def __init__(self, predictor: CompositePredictor, data: ChallengeData, config: ChallengeConfig,
                 state: SearchState, state_path: Path | None, key: str):
        self.predictor, self.config, self.state = predictor, config, state
        self.scheduler = Scheduler(state, data.fg_labels, data.bg_labels, config)
        self.state_path, self.key = state_path, key

    def _launch(self, pairs: np.ndarray):
        preds, margins = self.predictor.predict_pairs(pairs)
        return pairs, preds, margins

    def _finish(self, launched) -> None:
        """Wait for a launched batch and record it."""
        pairs, preds, margins = launched
        self.scheduler.record(pairs, preds.cpu().numpy().astype(np.int64),
                              None if margins is None else margins.float().cpu().numpy())

    def progress_bar(self) -> tqdm:
        plan = self.scheduler
        return tqdm(total=plan.total(), initial=plan.resolved(), unit="pair" if plan.full else "fg",
                    desc="all pairs" if plan.full else "searching", disable=not self.config.progress,
                    dynamic_ncols=True, smoothing=0.05)

    def run(self) -> SearchState:
        if self.predictor.runtime.group.distributed:
            return ShardedSearch(self).run()
        s, plan = self.state, self.scheduler
        bar = self.progress_bar()
        start, last_save, evaluated0 = time.monotonic(), time.monotonic(), s.evaluated
        elapsed0 = s.elapsed
        pending = self._launch(s.pending) if len(s.pending) else None
        with bar:
            while True:
                pairs = plan.next_batch(self.predictor.forward.chunk)
                if pairs is None:
                    if pending is not None:  # finish the round before planning the next
                        self._finish(pending)
                        pending, s.pending = None, np.zeros((0, 2), np.int64)
                    elif not plan.new_round():
                        break
                    bar.update(plan.resolved() - bar.n)
                    continue
                launched = self._launch(pairs)
                if pending is not None:
                    self._finish(pending)
                    bar.update(plan.resolved() - bar.n)
                pending, s.pending = launched, launched[0]
                now = time.monotonic()
                rate = (s.evaluated - evaluated0) / max(now - start, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} composites/s", refresh=False)
                if self.state_path is not None and now - last_save >= self.config.save_every:
                    s.elapsed = elapsed0 + now - start
                    s.save(self.state_path, self.key)
                    last_save = now
        s.elapsed = elapsed0 + time.monotonic() - start
        plan.finish()
        if self.state_path is not None:
            s.save(self.state_path, self.key)
        return s


class ShardedSearch:
    """The search shared by torchrun's processes, giving what one process gives.

    Rounds are synchronous: every process plans the same round from the same state; the round's open
    foregrounds are dealt out by their pair counts (largest first, to the least loaded process), so that
    robust and vulnerable foregrounds spread evenly; each process tests its own, and at the round's end
    the outcomes are gathered into every process's state. Since a round's plan and its statistics depend
    only on the outcomes (see `Scheduler`), the verdicts, fooling backgrounds and statistics equal a single
    process's. With --full, each process takes a block of foreground rows. The state is saved by rank 0 at
    round ends, so a resumed run (with any number of processes) goes on from the last closed round.
    """

    def __init__(self, search: Search):
        self.search, self.state, self.plan = search, search.state, search.scheduler
        self.group = search.predictor.runtime.group
        self.device = search.predictor.runtime.device
        self.busy_s = 0.0  # this process's time testing pairs, for the balance figure

    def run(self) -> SearchState:
        s, plan = self.state, self.plan
        started, elapsed0 = time.monotonic(), s.elapsed
        with self.search.progress_bar() as bar:
            if plan.full:
                self._full()
            else:
                remainder = np.concatenate([s.pending.astype(np.int64), s.worklist[s.position:].astype(np.int64)])
                s.pending, s.position = np.zeros((0, 2), np.int64), len(s.worklist)
                while True:
                    self._round(remainder)
                    bar.update(plan.resolved() - bar.n)
                    s.elapsed = elapsed0 + time.monotonic() - started
                    self._save()
                    if not plan.new_round():
                        break
                    remainder, s.position = s.worklist.astype(np.int64), len(s.worklist)
            bar.update(plan.resolved() - bar.n)
        # rank 0's last save may fail: no process waits in the gather below
        with distributed.agree(self.group, self.device):
            s.elapsed = elapsed0 + time.monotonic() - started
            plan.finish()
            self._save()
        loads = distributed.all_gather_floats(self.busy_s, self.device)
        log.info("time testing pairs per process: %s s (slowest / mean = %.2f)",
                 ", ".join(f"{t:.1f}" for t in loads), max(loads) / max(np.mean(loads), 1e-9))
        return s

    def _deal(self, pairs: np.ndarray) -> np.ndarray:
        """The pairs whose foregrounds fall to this process: open foregrounds by pair count, largest first, each
        to the least loaded process (ties to the lower rank)."""
        open_pairs = pairs[self.state.verdict[pairs[:, 0]] == UNKNOWN]
        fgs, counts = np.unique(open_pairs[:, 0], return_counts=True)
        loads = [0] * self.group.world_size
        mine = np.zeros(self.plan.n_fg, bool)
        for index in np.lexsort((fgs, -counts)):
            rank = loads.index(min(loads))
            loads[rank] += int(counts[index])
            mine[fgs[index]] = rank == self.group.rank
        return open_pairs[mine[open_pairs[:, 0]]]

    def _test(self, batches) -> None:
        """Predict and record batches, one launched ahead of the one being recorded."""
        began = time.perf_counter()
        pending = None
        for pairs in batches:
            launched = self.search._launch(pairs)
            if pending is not None:
                self.search._finish(pending)
            pending = launched
        if pending is not None:
            self.search._finish(pending)
        self.busy_s += time.perf_counter() - began

    def _round(self, pairs: np.ndarray) -> None:
        s, plan = self.state, self.plan
        mine = self._deal(pairs)
        owned = np.zeros(plan.n_fg, bool)
        owned[mine[:, 0]] = True
        evaluated0 = s.evaluated
        size = self.search.predictor.forward.chunk

        def batches():
            position = 0
            while True:
                batch, position = plan.take_open(mine, position, size)
                if batch is None:
                    return
                yield batch

        # a batch may fail in one process alone, as may rank 0's last save
        with distributed.agree(self.group, self.device):
            self._test(batches())
        self._gather(owned, evaluated0)

    def _full(self) -> None:
        s, plan = self.state, self.plan
        n_bg = plan.n_bg
        rows = np.array_split(np.arange(plan.n_fg), self.group.world_size)[self.group.rank]
        # pairs before `done` are in the matrix; a state saved by one process also holds the batch it had
        # launched but not yet recorded, the pairs just before its position
        done = int(s.position) - len(s.pending)
        s.pending = np.zeros((0, 2), np.int64)
        begin = max(done, int(rows[0]) * n_bg) if len(rows) else 0
        end = (int(rows[-1]) + 1) * n_bg if len(rows) else 0
        size = self.search.predictor.forward.chunk
        evaluated0 = s.evaluated
        with distributed.agree(self.group, self.device):  # a batch may fail in this process alone
            self._test(np.stack([idx // n_bg, idx % n_bg], axis=1)
                       for idx in (np.arange(p, min(end, p + size), dtype=np.int64) for p in range(begin, end, size)))
        owned = np.zeros(plan.n_fg, bool)
        owned[rows] = True
        s.matrix = (distributed.all_reduce(np.where(owned[:, None], s.matrix.astype(np.int32) + 2, 0), "sum",
                                           self.device) - 2).astype(np.int8)
        s.position = plan.n_fg * n_bg
        self._gather(owned, evaluated0, rows_only=True)

    def _gather(self, owned: np.ndarray, evaluated0: int, rows_only: bool = False) -> None:
        """Every process's state takes each foreground's outcome from the process that tested it."""
        s = self.state
        reduce = lambda array, op="sum": distributed.all_reduce(array, op, self.device)  # noqa: E731
        s.evaluated = evaluated0 + int(reduce(np.array([s.evaluated - evaluated0], np.int64))[0])
        taken = reduce(owned.astype(np.int32)) > 0  # the foregrounds some process tested
        margins = reduce(np.where(owned, s.min_margin, np.inf).astype(np.float32), "min")
        s.min_margin = np.where(taken, margins, s.min_margin).astype(np.float32)
        s.tested |= reduce(np.where(owned[:, None], s.tested, False).astype(np.uint8), "max").astype(bool)
        if rows_only:
            return
        verdict = reduce(np.where(owned, s.verdict.astype(np.int32) + 2, 0)) - 2
        fool_bg = reduce(np.where(owned, s.fool_bg + 1, 0)) - 1
        fool_pred = reduce(np.where(owned, s.fool_pred + 2, 0)) - 2
        s.verdict = np.where(taken, verdict, s.verdict).astype(np.int8)
        s.fool_bg = np.where(taken, fool_bg, s.fool_bg).astype(np.int64)
        s.fool_pred = np.where(taken, fool_pred, s.fool_pred).astype(np.int64)

    def _save(self) -> None:
        if self.search.state_path is not None and self.group.is_main:
            self.state.save(self.search.state_path, self.search.key)


def _run_key(data: ChallengeData, loaded: LoadedModel, runtime: Runtime, config: ChallengeConfig) -> str:
    parts = [STATE_FORMAT, data.fingerprint["sha256"], data.arithmetic.value, loaded.sha256 or "", loaded.normalization,
             runtime.precision.value, config.criterion.value, str(config.full), str(config.first_k),
             str(config.recheck_margin)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def run_challenge(loaded: LoadedModel, runtime: Runtime, data: ChallengeData | ChallengeFiles | Path,
                  config: ChallengeConfig, output_dir: Path | None = None, resume: bool = False, workers: int = 4,
                  cache_dir: Path | None = None, sure_margin: float = 1.0, shard: Shard | None = None
                  ) -> ChallengeResult:
    """The challenge's verdict for every foreground, exactly as an exhaustive search would give it.

    `data`: decoded data (`load_challenge_data`), listed files, or the data folder (decoded here with
    `config.mask_arithmetic`, through `cache_dir`). `shard`: search only that share of the foregrounds
    (tools.shards); the result then covers those alone."""
    # decoding or predicting may fail in one process: all leave together
    with distributed.agree(runtime.group, runtime.device):
        if not isinstance(data, ChallengeData):
            data = load_challenge_data(data, workers, cache_dir, config.progress, config.mask_arithmetic)
        key = _run_key(data, loaded, runtime, config)
        state_name = STATE_NAME
        if shard is not None:
            data = data.foreground_subset(shard.take(len(data.foregrounds)))
            state_name = f"{Path(STATE_NAME).stem}-shard-{shard.index}-of-{shard.count}.npz"
        data = data.to(runtime.device)
        predictor = CompositePredictor(loaded, runtime, data, config.batch_size, config.recheck_margin)
        state_path = Path(output_dir) / state_name if output_dir is not None else None
        state = None
        if resume and state_path is not None and state_path.is_file():
            state = SearchState.load(state_path, key)
            log.info("resuming from %s: %d composites already evaluated", state_path, state.evaluated)
        else:
            if resume:
                log.warning("no saved state in %s: starting afresh", output_dir)
            measure = config.batch_size is None and runtime.device.type == "cpu"
            bg_pred = predictor.predict_backgrounds(measure=measure)
    if state is None:
        # every process plans from rank 0's background predictions (and batch size), so all plan alike
        bg_pred = distributed.broadcast(bg_pred, runtime.group, runtime.device)
        predictor.forward.chunk = int(distributed.broadcast(np.array([predictor.forward.chunk]), runtime.group,
                                                            runtime.device)[0])
        state = SearchState.fresh(len(data.foregrounds), len(data.backgrounds), bg_pred, config.full)
    Search(predictor, data, config, state, state_path, key).run()
    if runtime.group.distributed:
        predictor.rechecked, predictor.recheck_changed = (int(v) for v in distributed.all_reduce(
            np.array([predictor.rechecked, predictor.recheck_changed], np.int64), "sum", runtime.device))
    info = provenance(runtime.describe(), loaded.describe(), data.fingerprint)
    info["mask_arithmetic"] = data.arithmetic.value
    info["batch_size"] = predictor.forward.chunk
    unsure = None
    if not runtime.exact:
        threshold = config.recheck_margin if config.recheck_margin > 0 else sure_margin
        unsure = int((state.min_margin < threshold).sum())
    return ChallengeResult(data, state, config.criterion, info, predictor.rechecked, predictor.recheck_changed, unsure,
                           key)
