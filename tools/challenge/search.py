"""The search loop (launching batches one ahead, the progress bar, the save cadence) and the whole run."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tools.challenge.data import ChallengeData, ChallengeFiles, load_challenge_data
from tools.challenge.predictor import CompositePredictor
from tools.challenge.result import ChallengeResult
from tools.challenge.scheduler import ChallengeConfig, Scheduler
from tools.challenge.state import STATE_NAME, SearchState
from tools.models import LoadedModel
from tools.provenance import provenance
from tools.runtime import Runtime

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

    def run(self) -> SearchState:
        s, plan = self.state, self.scheduler
        bar = tqdm(total=plan.total(), initial=plan.resolved(), unit="pair" if plan.full else "fg",
                   desc="all pairs" if plan.full else "searching", disable=not self.config.progress,
                   dynamic_ncols=True, smoothing=0.05)
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


def _run_key(data: ChallengeData, loaded: LoadedModel, runtime: Runtime, config: ChallengeConfig) -> str:
    parts = [STATE_FORMAT, data.fingerprint["sha256"], data.arithmetic.value, loaded.sha256 or "", loaded.normalization,
             runtime.precision.value, config.criterion.value, str(config.full), str(config.first_k),
             str(config.recheck_margin)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def run_challenge(loaded: LoadedModel, runtime: Runtime, data: ChallengeData | ChallengeFiles | Path,
                  config: ChallengeConfig, output_dir: Path | None = None, resume: bool = False, workers: int = 4,
                  cache_dir: Path | None = None, sure_margin: float = 1.0) -> ChallengeResult:
    """The challenge's verdict for every foreground, exactly as an exhaustive search would give it.

    `data`: decoded data (`load_challenge_data`), listed files, or the data folder (decoded here with
    `config.mask_arithmetic`, through `cache_dir`)."""
    if not isinstance(data, ChallengeData):
        data = load_challenge_data(data, workers, cache_dir, config.progress, config.mask_arithmetic)
    data = data.to(runtime.device)
    predictor = CompositePredictor(loaded, runtime, data, config.batch_size, config.recheck_margin)
    key = _run_key(data, loaded, runtime, config)
    state_path = Path(output_dir) / STATE_NAME if output_dir is not None else None
    if resume and state_path is not None and state_path.is_file():
        state = SearchState.load(state_path, key)
        log.info("resuming from %s: %d composites already evaluated", state_path, state.evaluated)
    else:
        if resume:
            log.warning("no saved state in %s: starting afresh", output_dir)
        bg_pred = predictor.predict_backgrounds(measure=config.batch_size is None and runtime.device.type == "cpu")
        state = SearchState.fresh(len(data.foregrounds), len(data.backgrounds), bg_pred, config.full)
    Search(predictor, data, config, state, state_path, key).run()
    info = provenance(runtime.describe(), loaded.describe(), data.fingerprint)
    info["mask_arithmetic"] = data.arithmetic.value
    info["batch_size"] = predictor.forward.chunk
    unsure = None
    if not runtime.exact:
        threshold = config.recheck_margin if config.recheck_margin > 0 else sure_margin
        unsure = int((state.min_margin < threshold).sum())
    return ChallengeResult(data, state, config.criterion, info, predictor.rechecked, predictor.recheck_changed, unsure)
