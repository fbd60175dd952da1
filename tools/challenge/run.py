"""The search loop (launching batches one ahead, the progress bar, the save cadence) and the whole run."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from tools import distributed
from tools.challenge.config import ChallengeConfig
from tools.challenge.data import ChallengeData, ChallengeFiles, load_challenge_data
from tools.challenge.predictor import CompositePredictor
from tools.challenge.result import ChallengeResult
from tools.challenge.scheduler import Scheduler, split_untested, state_problem
from tools.challenge.state import STATE_NAME, UNKNOWN, SearchState
from tools.data.compositing import MaskArithmetic
from tools.errors import UserError, option
from tools.in9 import UNMAPPED
from tools.models.boundary import LoadedModel
from tools.models.device_check import record_check, verified
from tools.progress import ProgressBar, progress_bar
from tools.provenance import decoder as decoder_build
from tools.runtime import RECHECK_MARGIN, Runtime
from tools.runtime.inflight import Pipeline
from tools.shards import Shard
from tools.threads import ContextThreadPool

log = logging.getLogger(__name__)

STATE_FORMAT = "state-2"  # statistics closed per round (a state saved by an earlier version is not resumed)


class Search:
    """The loop: batches from a `Scheduler` through a `Pipeline` (a few in flight, near ties re-checked at fixed
    points), a progress bar, and the state saved every `save_every` seconds and at the end by a thread of its own."""

    def __init__(self, predictor: CompositePredictor, data: ChallengeData, config: ChallengeConfig,
                 state: SearchState, state_path: Path | None, key: str):
        self.predictor, self.config, self.state = predictor, config, state
        self.scheduler = Scheduler(state, data.fg_labels, data.bg_labels, config)
        self.pipeline = Pipeline(predictor, self.scheduler.record)
        self.state_path, self.key = state_path, key
        self._saver: ContextThreadPool | None = None  # made at the first save
        self._saving: Future | None = None

    def save(self) -> None:
        """Save a snapshot of the state (launched pairs as pending) off the loop, once the last save is through."""
        if self.state_path is None:
            return
        self.wait_saved()
        snapshot = self.state.snapshot(self.pipeline.unrecorded())
        if self._saver is None:
            self._saver = ContextThreadPool(max_workers=1, thread_name_prefix="state-save")
        self._saving = self._saver.submit(snapshot.save, self.state_path, self.key)

    def wait_saved(self) -> None:
        if self._saving is not None:
            self._saving.result()
            self._saving = None

    def progress_bar(self) -> ProgressBar:
        plan = self.scheduler
        return progress_bar(total=plan.total(), initial=plan.resolved(), unit="pair" if plan.full else "fg",
                            desc="all pairs" if plan.full else "searching", disable=not self.config.progress,
                            dynamic_ncols=True, smoothing=0.05)

    def run(self) -> SearchState:
        if self.predictor.runtime.group.distributed:
            return ShardedSearch(self).run()
        s, plan, pipe = self.state, self.scheduler, self.pipeline
        bar = self.progress_bar()
        start, last_save, evaluated0 = time.monotonic(), time.monotonic(), s.evaluated
        elapsed0 = s.elapsed
        for batch in s.pending_batches():  # relaunched as they were: the same records at the same points
            pipe.launch(batch)
        s.pending, s.pending_sizes = np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
        try:
            with bar:
                while True:
                    pairs = plan.next_batch(self.predictor.forward.chunk)
                    if pairs is None:
                        if pipe.busy():  # finish the round before planning the next
                            pipe.drain()
                        elif not plan.new_round():
                            break
                        bar.update(plan.resolved() - bar.n)
                        continue
                    pipe.launch(pairs)
                    bar.update(plan.resolved() - bar.n)
                    now = time.monotonic()
                    rate = (s.evaluated - evaluated0) / max(now - start, 1e-9)
                    bar.set_postfix_str(f"{rate:,.0f} composites/s", refresh=False)
                    if now - last_save >= self.config.save_every:
                        s.elapsed = elapsed0 + now - start
                        self.save()
                        last_save = now
                bar.update(plan.resolved() - bar.n)  # the last round's planning found the exhausted ones robust
            s.elapsed = elapsed0 + time.monotonic() - start
            plan.finish()
            self.save()
        finally:
            self.wait_saved()
            if self._saver is not None:
                self._saver.shutdown()
        return s


class ShardedSearch:
    """The search shared by torchrun's processes, giving what one process gives: synchronous rounds dealt out by
    foreground (largest pair count first, to the least loaded), --full cut into one run per process, and a meeting
    every `save_every` seconds where outcomes are gathered and rank 0 saves. See docs/how-it-works.md, Sharded runs."""

    def __init__(self, search: Search):
        self.search, self.state, self.plan = search, search.state, search.scheduler
        self.group = search.predictor.runtime.group
        self.device = search.predictor.runtime.device
        self.busy_s = 0.0  # this process's time testing pairs, for the balance figure
        self.started, self.elapsed0 = time.monotonic(), self.state.elapsed

    def run(self) -> SearchState:
        s, plan = self.state, self.plan
        with self.search.progress_bar() as bar:
            if plan.full:
                self._full(bar)
            else:
                while True:
                    self._round(bar)
                    if not plan.new_round():
                        break
            bar.update(plan.resolved() - bar.n)
        # rank 0's last save may fail: no process waits in the gather below
        with distributed.agree(self.group, self.device):
            plan.finish()
            self._save()
        loads = distributed.all_gather_floats(self.busy_s, self.device)
        log.info("time testing pairs per process: %s s (slowest / mean = %.2f)",
                 ", ".join(f"{t:.1f}" for t in loads), max(loads) / max(np.mean(loads), 1e-9))
        return s

    def _deal(self, pairs: np.ndarray) -> np.ndarray:
        """The pairs whose foregrounds fall to this process (largest pair count first, to the least loaded; ties to
        the lower rank)."""
        open_pairs = pairs[self.state.verdict[pairs[:, 0]] == UNKNOWN]
        fgs, counts = np.unique(open_pairs[:, 0], return_counts=True)
        loads = [0] * self.group.world_size
        mine = np.zeros(self.plan.n_fg, bool)
        for index in np.lexsort((fgs, -counts)):
            rank = loads.index(min(loads))
            loads[rank] += int(counts[index])
            mine[fgs[index]] = rank == self.group.rank
        return open_pairs[mine[open_pairs[:, 0]]]

    @staticmethod
    def _batches(take, position: int):
        while True:
            batch, position = take(position)
            if batch is None:
                return
            yield batch

    def _round(self, bar) -> None:
        """The round's pairs still to test (all of them, or what a resumed state left), this process's share."""
        plan = self.plan
        mine = self._deal(self.state.worklist[plan.left_in_round()].astype(np.int64))
        owned = np.zeros(plan.n_fg, bool)
        owned[mine[:, 0]] = True
        size = self.search.predictor.forward.chunk
        self._share(self._batches(lambda position: plan.take_open(mine, position, size), 0), owned, bar)

    def _full(self, bar) -> None:
        """Every pair still to test, this process's run of them."""
        plan = self.plan
        bounds = split_untested(self.state.tested, self.group.world_size)
        start, end = int(bounds[self.group.rank]), int(bounds[self.group.rank + 1])
        size = self.search.predictor.forward.chunk
        self._share(self._batches(lambda position: plan.take_untested(position, end, size), start), None, bar)

    def _share(self, batches, owned: np.ndarray | None, bar) -> None:
        """Test this process's batches, meeting the others every `save_every` seconds and once done, until every
        process is done. `owned`: the foregrounds this process tests in the round (None with --full)."""
        through = False
        while True:
            evaluated0 = self.state.evaluated
            with distributed.agree(self.group, self.device):  # a batch may fail in this process alone
                through = through or self._test(batches)
            everyone_through = self._gather(owned, evaluated0, through)
            bar.update(self.plan.resolved() - bar.n)
            with distributed.agree(self.group, self.device):  # as may rank 0's save
                self._save()
            if everyone_through:
                return

    def _test(self, batches) -> bool:
        """Predict and record batches for `save_every` seconds (one batch at least); True when none is left."""
        began = time.perf_counter()
        through = False
        while True:
            pairs = next(batches, None)
            if pairs is None:
                through = True
                break
            self.search.pipeline.launch(pairs)
            if time.perf_counter() - began >= self.search.config.save_every:
                break
        self.search.pipeline.drain()
        self.busy_s += time.perf_counter() - began
        return through

    def _gather(self, owned: np.ndarray | None, evaluated0: int, through: bool) -> bool:
        """Take into every process's state the outcomes found since the last meeting (with --full per pair, in a round
        per owned foreground); True when every process is through its share."""
        s = self.state
        reduce = lambda array, op="sum": distributed.all_reduce(array, op, self.device)  # noqa: E731
        evaluated, busy = reduce(np.array([s.evaluated - evaluated0, not through], np.int64))
        s.evaluated = evaluated0 + int(evaluated)
        if owned is None:  # a tested pair's prediction, shifted past 0 (which stands for untested)
            code = reduce(np.where(s.tested, s.matrix.astype(np.int16) + 2, 0).astype(np.uint8), "max")
            s.tested = code > 0
            s.matrix = np.where(s.tested, code.astype(np.int16) - 2, UNMAPPED).astype(np.int8)
            s.min_margin = reduce(s.min_margin, "min").astype(np.float32)
            return busy == 0
        taken = reduce(owned.astype(np.int32)) > 0  # the foregrounds some process tested
        margins = reduce(np.where(owned, s.min_margin, np.inf).astype(np.float32), "min")
        s.min_margin = np.where(taken, margins, s.min_margin).astype(np.float32)
        s.tested |= reduce(np.where(owned[:, None], s.tested, False).astype(np.uint8), "max").astype(bool)
        verdict = reduce(np.where(owned, s.verdict.astype(np.int32) + 2, 0)) - 2
        fool_bg = reduce(np.where(owned, s.fool_bg + 1, 0)) - 1
        fool_pred = reduce(np.where(owned, s.fool_pred + 2, 0)) - 2
        s.verdict = np.where(taken, verdict, s.verdict).astype(np.int8)
        s.fool_bg = np.where(taken, fool_bg, s.fool_bg).astype(np.int64)
        s.fool_pred = np.where(taken, fool_pred, s.fool_pred).astype(np.int64)
        return busy == 0

    def _save(self) -> None:
        """Rank 0 saves the gathered state, pointed at the first pair still to test (`Scheduler.rewind`)."""
        self.state.elapsed = self.elapsed0 + time.monotonic() - self.started
        self.plan.rewind()
        if self.search.state_path is not None and self.group.is_main:
            self.state.save(self.search.state_path, self.search.key)


def _run_key(data: ChallengeData, loaded: LoadedModel, runtime: Runtime, config: ChallengeConfig) -> str:
    parts = [STATE_FORMAT, data.image_set.fingerprint["sha256"],
             json.dumps(decoder_build(data.image_set.decoder.value), sort_keys=True),
             data.arithmetic.value, loaded.identity or "", loaded.normalization,
             json.dumps(runtime.arithmetic(), sort_keys=True), config.criterion.value, str(config.full),
             str(runtime.recheck_margin(config.recheck_margin)),
             str(runtime.batch_size(config.batch_size))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def state_key(key: str, device_check: dict | None) -> str:
    """The key a run's state is saved under: the run's (`_run_key`, shared by its shards) and whether its start-up
    check verified the model, so no run resumes a state made under another verdict."""
    return hashlib.sha256(f"{key}|verified={verified(device_check)}".encode()).hexdigest()


def run_challenge(loaded: LoadedModel, runtime: Runtime, data: ChallengeData | ChallengeFiles,
                  config: ChallengeConfig, output_dir: Path | None = None, resume: bool = False, workers: int = 4,
                  shard: Shard | None = None, device_check: dict | None = None) -> ChallengeResult:
    """The challenge's verdict for every foreground, exactly as an exhaustive search gives it. `data`: decoded
    (`load_challenge_data`, with `config.mask_arithmetic`: other data is refused) or listed (decoded here).
    `shard`: only that share of the foregrounds (tools.shards). `device_check`: the start-up check, recorded in the
    provenance and saved state (as `run_in9` does)."""
    # decoding or predicting may fail in one process: all leave together
    with distributed.agree(runtime.group, runtime.device):
        if not isinstance(data, ChallengeData):
            data = load_challenge_data(data, workers, config.progress, config.mask_arithmetic)
        if data.arithmetic != config.mask_arithmetic:  # it would composite, and key the state, by the data's
            raise ValueError(f"run_challenge: the data was decoded with mask arithmetic {data.arithmetic.value}, "
                             f"the config asks {MaskArithmetic(config.mask_arithmetic).value}")
        key = _run_key(data, loaded, runtime, config)
        saved_as = state_key(key, device_check)
        state_name = STATE_NAME
        if shard is not None:
            data = data.foreground_subset(shard.take(len(data.foregrounds)))
            state_name = f"{Path(STATE_NAME).stem}-shard-{shard.index}-of-{shard.count}.npz"
        data = data.to(runtime.device)
        predictor = CompositePredictor(loaded, runtime, data, config.batch_size,
                                       runtime.recheck_margin(config.recheck_margin))
        state_path = Path(output_dir) / state_name if output_dir is not None else None
        state = None
        if resume and state_path is not None and state_path.is_file():
            state = SearchState.load(state_path, saved_as, len(data.foregrounds), len(data.backgrounds), config.full)
            problem = state_problem(state, data.fg_labels, data.bg_labels, config.criterion)
            if problem is not None:
                raise UserError(f"the saved state {state_path} is not one this run writes: {problem}; rerun without "
                                f"{option('--resume')}")
            log.info("resuming from %s: %d composites already evaluated", state_path, state.evaluated)
        else:
            if resume:
                log.warning("no saved state in %s: starting afresh", output_dir)
            bg_pred = predictor.predict_backgrounds()
    if state is None:
        # every process plans from rank 0's background predictions, so all plan alike
        bg_pred = distributed.broadcast(bg_pred, runtime.group, runtime.device)
        state = SearchState.fresh(len(data.foregrounds), len(data.backgrounds), bg_pred, config.full)
    Search(predictor, data, config, state, state_path, saved_as).run()
    if runtime.group.distributed:
        predictor.rechecked, predictor.recheck_changed = (int(v) for v in distributed.all_reduce(
            np.array([predictor.rechecked, predictor.recheck_changed], np.int64), "sum", runtime.device))
    info = data.image_set.provenance(runtime.describe(), loaded.describe())
    info["mask_arithmetic"] = data.arithmetic.value
    info.update(predictor.forward.provenance())
    if device_check is not None:
        record_check(info, device_check)
    unsure = None
    if not runtime.exact:
        threshold = config.recheck_margin if config.recheck_margin > 0 else RECHECK_MARGIN
        unsure = int((state.min_margin < threshold).sum())
    return ChallengeResult(data, state, config.criterion, info, predictor.rechecked, predictor.recheck_changed, unsure,
                           key)
