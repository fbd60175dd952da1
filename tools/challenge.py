"""The adversarial-background search: which foregrounds can some test background make the model misclassify.

Everything is decoded once onto the device as uint8; composites are made there (`where(mask, fg, bg)`,
which equals `bg * (1 - m) + fg * m` for a 0/1 mask) and normalised inside the model. Batches hold
(foreground, background) pairs of many foregrounds at once. A foreground leaves the search the moment
it is found vulnerable; a robust one is tested against every background, so the verdicts equal those
of an exhaustive search whatever the order. The order only decides how much work is done: each round
offers every open foreground its next k untested backgrounds by a score (the model's prediction on the
background alone, refined by how often each background has fooled foregrounds of that class so far),
with k doubling from round to round.

All scheduling state lives in `SearchState`, saved atomically under the output folder, so a run stopped
at any point (even by kill -9) resumes into exactly the sequence of batches it would have run.
"""

from __future__ import annotations

import csv
import enum
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tools import datasets
from tools.compositing import MaskArithmetic, blend, byte_masks, composite
from tools.hashing import fingerprint
from tools.data import quick_check
from tools.errors import UserError
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED, PredictionMap, Variation, class_names
from tools.models import LoadedModel
from tools.provenance import atomic_write, provenance, write_json_atomic
from tools.runtime import CPU_BATCH_CANDIDATES, Forward, Runtime, default_batch_size

log = logging.getLogger(__name__)

UNKNOWN, ROBUST, VULNERABLE = -1, 0, 1
STATE_NAME = "challenge_state.npz"
MATRIX_NAME = "predictions.npy"
CACHE_VERSION = 3


class Criterion(str, enum.Enum):
    """`any`: some background changes the prediction (the leaderboard's). `bg-class`: some background of
    another class makes the model predict that background's class (the paper's stricter reading)."""

    ANY = "any"
    BG_CLASS = "bg-class"


# ----------------------------------------------------------------------------------------------------------
# Data: decoded once, cached on disk by fingerprint

@dataclass
class ChallengeFiles:
    """What the challenge reads: foregrounds (image and mask), backgrounds, and their content fingerprint."""

    root: Path
    foregrounds: list[datasets.ForegroundRecord]
    backgrounds: list[datasets.ImageRecord]
    fingerprint: dict


@dataclass
class ChallengeData:
    foregrounds: list[datasets.ForegroundRecord]
    backgrounds: list[datasets.ImageRecord]
    fg_images: torch.Tensor  # uint8 (F, 3, H, W)
    # binary: uint8 (F, 3, H, W), 255 on the foreground, 0 elsewhere (for bitwise compositing);
    # original: uint8 (F, 1, H, W), the original's weight numerators (w = value / 255)
    masks: torch.Tensor
    bg_images: torch.Tensor  # uint8 (B, 3, H, W)
    fingerprint: dict
    arithmetic: MaskArithmetic = MaskArithmetic.BINARY

    @property
    def fg_labels(self) -> np.ndarray:
        return np.array([r.label for r in self.foregrounds], dtype=np.int64)

    @property
    def bg_labels(self) -> np.ndarray:
        return np.array([r.label for r in self.backgrounds], dtype=np.int64)

    def to(self, device: torch.device) -> "ChallengeData":
        return ChallengeData(self.foregrounds, self.backgrounds, self.fg_images.to(device), self.masks.to(device),
                             self.bg_images.to(device), self.fingerprint, self.arithmetic)


def list_challenge_files(root: Path, workers: int = 4) -> ChallengeFiles:
    """Check and list the foregrounds and backgrounds, and hash their content: cheap, before any model is built."""
    quick_check(root, [Variation.ONLY_BG_T.value], need_masks=True)
    root = Path(root)
    foregrounds = datasets.list_foregrounds(root)
    backgrounds = datasets.list_variation(root, Variation.ONLY_BG_T.value)
    relpaths = [p for r in foregrounds for p in (r.image_relpath, r.mask_relpath)] + [r.relpath for r in backgrounds]
    return ChallengeFiles(root, foregrounds, backgrounds, fingerprint(root, relpaths, workers))


def load_challenge_data(files: ChallengeFiles | Path, workers: int, cache_dir: Path | None = None,
                        progress: bool = True, arithmetic: MaskArithmetic = MaskArithmetic.BINARY) -> ChallengeData:
    """Decode foregrounds, masks and backgrounds once; reuse a decoded copy from `cache_dir` when the content
    fingerprint (and the mask arithmetic) match."""
    if not isinstance(files, ChallengeFiles):
        files = list_challenge_files(files, workers)
    root, fp = files.root, files.fingerprint
    cache = datasets.DecodedCache(cache_dir, f"{fp['sha256'][:24]}-{arithmetic.value}-v{CACHE_VERSION}",
                                  {"fingerprint": fp, "mask_arithmetic": arithmetic.value})
    cached = cache.load(("fg", "bg", "masks"))
    if cached is not None:
        fg, bg, masks = (torch.from_numpy(cached[name]) for name in ("fg", "bg", "masks"))
    else:
        masks_np = datasets.load_masks(root, [r.mask_relpath for r in files.foregrounds], arithmetic)
        fg = datasets.decode_images(root, [r.image_relpath for r in files.foregrounds], workers, progress,
                                    "decoding foregrounds")
        bg = datasets.decode_images(root, [r.relpath for r in files.backgrounds], workers, progress,
                                    "decoding backgrounds")
        masks = torch.from_numpy(masks_np)
        cache.save({"fg": fg.numpy(), "bg": bg.numpy(), "masks": masks_np})
    masks = byte_masks(masks) if arithmetic is MaskArithmetic.BINARY else masks.unsqueeze(1).contiguous()
    return ChallengeData(files.foregrounds, files.backgrounds, fg, masks, bg, fp, arithmetic)


# ----------------------------------------------------------------------------------------------------------
# Predicting composites

class CompositePredictor:
    """IN-9 predictions for (foreground, background) index pairs, composited on the device.

    In reduced precision (bf16, fp16, tf32), composites whose top-two logit margin is below `recheck_margin`
    are run again in true fp32 (`Runtime.fp32_math`: no autocast, TF32 off), so the fast mode gives the
    fp32 prediction wherever a near tie could flip it.
    """

    def __init__(self, loaded: LoadedModel, runtime: Runtime, data: ChallengeData, batch_size: int | None,
                 recheck_margin: float = 0.0):
        self.runtime, self.data = runtime, data
        self.model = runtime.prepare(loaded.model)
        self.forward = Forward(self.model, runtime, batch_size or default_batch_size(runtime.device))
        self.to_in9 = PredictionMap(loaded.num_classes)
        self.recheck_margin = recheck_margin if not runtime.exact else 0.0
        self.rechecked = self.recheck_changed = 0

    def composite(self, fg_idx: torch.Tensor, bg_idx: torch.Tensor) -> torch.Tensor:
        """The composites of the pairs, on the device: uint8 on the byte path, float in [0, 1] with the
        original's arithmetic (see tools.compositing)."""
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
                with torch.inference_mode(), self.runtime.fp32_math():
                    exact_logits = self.model(images[idx])
                exact = self.to_in9(exact_logits.float())
                self.rechecked += int(idx.numel())
                self.recheck_changed += int((exact != preds[idx]).sum())
                preds = preds.clone()
                preds[idx] = exact
                margin = margin.clone()
                margin[idx] = float("inf")
        return preds, margin

    def predict_pairs(self, pairs: np.ndarray):
        device = self.data.fg_images.device
        idx = torch.from_numpy(pairs).to(device)
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
            self.forward.chunk = min(timings, key=timings.get)
            log.info("batch size %d chosen by timing %s", self.forward.chunk,
                     ", ".join(f"{k}: {1e3 * v:.1f} ms/image" for k, v in timings.items()))
        size = self.forward.chunk
        for begin in range(start, len(images), size):
            preds.append(self.predict_images(self.runtime.to_device(images[begin:begin + size]))[0])
        return torch.cat(preds).cpu().numpy().astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Search state

@dataclass
class SearchState:
    """Everything the search needs to continue exactly where it stopped."""

    verdict: np.ndarray  # int8 (F,): UNKNOWN / ROBUST / VULNERABLE
    fool_bg: np.ndarray  # int64 (F,): the first fooling background found, or -1
    fool_pred: np.ndarray  # int64 (F,): the prediction it caused
    min_margin: np.ndarray  # float32 (F,): smallest top-two margin a verdict rests on (reduced precision)
    tested: np.ndarray  # bool (F, B)
    successes: np.ndarray  # int64 (9, B): fooling composites per foreground class and background
    trials: np.ndarray  # int64 (9, B)
    bg_pred: np.ndarray  # int64 (B,): the model's prediction on each background alone
    worklist: np.ndarray  # int32 (N, 2): this round's pairs, rank-major (empty in --full mode)
    position: int = 0  # next worklist entry to batch
    pending: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # launched, unprocessed
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

    def save(self, path: Path, key: str) -> None:
        arrays = {name: getattr(self, name) for name in ("verdict", "fool_bg", "fool_pred", "min_margin", "successes",
                                                         "trials", "bg_pred", "worklist", "pending")}
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
            with np.load(path) as z:
                if bytes(z["key"]).decode() != key:
                    raise UserError(f"{path} belongs to another run (model, data or settings differ); rerun without "
                                    f"--resume, or pick another --output-dir")
                shape = tuple(z["shape"])
                position, round_, evaluated = (int(v) for v in z["scalars"])
                return cls(verdict=z["verdict"], fool_bg=z["fool_bg"], fool_pred=z["fool_pred"],
                           min_margin=z["min_margin"],
                           tested=np.unpackbits(z["tested"], axis=1, count=shape[1]).astype(bool),
                           successes=z["successes"], trials=z["trials"], bg_pred=z["bg_pred"],
                           worklist=z["worklist"], position=position, pending=z["pending"], round=round_,
                           evaluated=evaluated, matrix=z["matrix"] if "matrix" in z.files else None,
                           elapsed=float(z["elapsed"]))
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"cannot read the saved state {path} ({exc}); rerun without --resume") from None


# ----------------------------------------------------------------------------------------------------------
# The search

@dataclass
class ChallengeConfig:
    criterion: Criterion = Criterion.ANY
    full: bool = False
    batch_size: int | None = 64  # None: 256 on a GPU; on the CPU, measured at start-up (CPU_BATCH_CANDIDATES)
    first_k: int = 1  # backgrounds offered to each open foreground in the first round; doubles each round
    save_every: float = 5.0  # seconds between state saves
    recheck_margin: float = 0.0
    progress: bool = True
    mask_arithmetic: MaskArithmetic = MaskArithmetic.BINARY


class Search:
    """Runs the scheduler over a `SearchState` with a `CompositePredictor`."""

    def __init__(self, predictor: CompositePredictor, data: ChallengeData, config: ChallengeConfig,
                 state: SearchState, state_path: Path | None, key: str):
        self.p, self.config, self.state = predictor, config, state
        self.fg_labels, self.bg_labels = data.fg_labels, data.bg_labels
        self.state_path, self.key = state_path, key
        self.n_fg, self.n_bg = len(self.fg_labels), len(self.bg_labels)
        # eligible[c, b]: may a background b count against a foreground of class c?
        self.eligible = np.ones((NUM_IN9_CLASSES, self.n_bg), bool)
        if config.criterion is Criterion.BG_CLASS:
            self.eligible = self.bg_labels[None, :] != np.arange(NUM_IN9_CLASSES)[:, None]

    # -- scheduling ----------------------------------------------------------------------------------------
    def _scores(self) -> np.ndarray:
        s = self.state
        c = np.arange(NUM_IN9_CLASSES)[:, None]
        if self.config.criterion is Criterion.ANY:
            prior = (s.bg_pred[None, :] != c).astype(np.float64)
        else:
            prior = np.broadcast_to((s.bg_pred == self.bg_labels).astype(np.float64)[None, :], (NUM_IN9_CLASSES, self.n_bg))
        rate_class = (s.successes + prior) / (s.trials + 1.0)
        rate_all = (s.successes.sum(0) + prior.mean(0)) / (s.trials.sum(0) + 1.0)
        return rate_class + 0.5 * rate_all[None, :]

    def _new_round(self) -> np.ndarray:
        """The next round's pairs: each open foreground's next k untested eligible backgrounds, rank-major."""
        s = self.state
        k = self.config.first_k << min(s.round, 40)
        scores = self._scores()
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

    def _next_batch(self) -> np.ndarray | None:
        """The next pairs of this round whose foreground is still open; None at the end of the round."""
        s, size = self.state, self.p.forward.chunk
        if s.matrix is not None:  # --full: every pair in foreground-major order, implicit in the position
            total = self.n_fg * self.n_bg
            if s.position >= total:
                return None
            idx = np.arange(s.position, min(total, s.position + size), dtype=np.int64)
            s.position += len(idx)
            return np.stack([idx // self.n_bg, idx % self.n_bg], axis=1)
        picked = []
        count = 0
        while s.position < len(s.worklist) and count < size:
            chunk = s.worklist[s.position:s.position + (size - count) * 2]
            keep = s.verdict[chunk[:, 0]] == UNKNOWN
            taken = chunk[keep][:size - count].astype(np.int64)
            # advance past what was taken, and past the skipped pairs before it
            used = np.nonzero(keep)[0][len(taken) - 1] + 1 if len(taken) else len(chunk)
            s.position += int(used)
            picked.append(taken)
            count += len(taken)
        if count == 0:
            return None
        return np.concatenate(picked)

    # -- results ---------------------------------------------------------------------------------------------
    def _record(self, pairs: np.ndarray, preds: np.ndarray, margins: np.ndarray | None) -> int:
        """Fold one batch's predictions into the state; returns how many foregrounds it resolved."""
        s = self.state
        f, b = pairs[:, 0], pairs[:, 1]
        labels = self.fg_labels[f]
        if self.config.criterion is Criterion.ANY:
            fooled = preds != labels
        else:
            fooled = (preds == self.bg_labels[b]) & (self.bg_labels[b] != labels)
        s.tested[f, b] = True
        s.evaluated += len(pairs)
        np.add.at(s.trials, (labels, b), 1)
        np.add.at(s.successes, (labels[fooled], b[fooled]), 1)
        if margins is not None:
            open_rows = s.verdict[f] == UNKNOWN
            np.minimum.at(s.min_margin, f[open_rows & ~fooled], margins[open_rows & ~fooled])
        if s.matrix is not None:  # --full: verdicts come from the whole matrix at the end
            s.matrix[f, b] = preds
            return 0
        hits = np.nonzero(fooled)[0]
        _, first = np.unique(f[hits], return_index=True)  # each foreground's first fooling pair in the batch
        won = hits[first]
        won = won[s.verdict[f[won]] == UNKNOWN]
        s.verdict[f[won]], s.fool_bg[f[won]], s.fool_pred[f[won]] = VULNERABLE, b[won], preds[won]
        if margins is not None:
            s.min_margin[f[won]] = margins[won]
        return len(won)

    def _launch(self, pairs: np.ndarray):
        preds, margins = self.p.predict_pairs(pairs)
        return pairs, preds, margins

    def _finish(self, launched) -> int:
        """Wait for a launched batch and record it; returns the progress it made (foregrounds resolved, or
        pairs done with --full)."""
        pairs, preds, margins = launched
        resolved = self._record(pairs, preds.cpu().numpy().astype(np.int64),
                                None if margins is None else margins.float().cpu().numpy())
        return len(pairs) if self.state.matrix is not None else resolved

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self) -> SearchState:
        s = self.state
        done = int((s.verdict != UNKNOWN).sum()) if s.matrix is None else 0
        bar = tqdm(total=self.n_fg if s.matrix is None else self.n_fg * self.n_bg, initial=done if s.matrix is None
                   else s.evaluated, unit="fg" if s.matrix is None else "pair",
                   desc="searching" if s.matrix is None else "all pairs", disable=not self.config.progress,
                   dynamic_ncols=True, smoothing=0.05)
        start, last_save, evaluated0 = time.monotonic(), time.monotonic(), s.evaluated
        elapsed0 = s.elapsed
        pending = self._launch(s.pending) if len(s.pending) else None
        with bar:
            while True:
                pairs = self._next_batch()
                if pairs is None:
                    if pending is not None:  # finish the round before planning the next
                        bar.update(self._finish(pending))
                        pending, s.pending = None, np.zeros((0, 2), np.int64)
                        continue
                    if s.matrix is not None:
                        break
                    s.worklist, s.position = self._new_round(), 0
                    bar.update(int((s.verdict != UNKNOWN).sum()) - bar.n)
                    if len(s.worklist) == 0:
                        break
                    continue
                launched = self._launch(pairs)
                if pending is not None:
                    bar.update(self._finish(pending))
                pending, s.pending = launched, launched[0]
                now = time.monotonic()
                rate = (s.evaluated - evaluated0) / max(now - start, 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} composites/s", refresh=False)
                if self.state_path is not None and now - last_save >= self.config.save_every:
                    s.elapsed = elapsed0 + now - start
                    s.save(self.state_path, self.key)
                    last_save = now
        s.elapsed = elapsed0 + time.monotonic() - start
        if s.matrix is not None:
            self._verdicts_from_matrix()
        if self.state_path is not None:
            s.save(self.state_path, self.key)
        return s

    def _verdicts_from_matrix(self) -> None:
        s = self.state
        m = s.matrix.astype(np.int64)
        if self.config.criterion is Criterion.ANY:
            fooled = m != self.fg_labels[:, None]
        else:
            fooled = (m == self.bg_labels[None, :]) & (self.bg_labels[None, :] != self.fg_labels[:, None])
        vulnerable = fooled.any(axis=1)
        s.verdict = np.where(vulnerable, VULNERABLE, ROBUST).astype(np.int8)
        first = fooled.argmax(axis=1)
        s.fool_bg = np.where(vulnerable, first, -1)
        s.fool_pred = np.where(vulnerable, m[np.arange(len(m)), first], UNMAPPED)


# ----------------------------------------------------------------------------------------------------------
# The whole run

@dataclass
class ChallengeResult:
    data: ChallengeData
    state: SearchState
    criterion: Criterion
    provenance: dict
    rechecked: int = 0
    recheck_changed: int = 0
    unsure: int | None = None  # verdicts resting on a margin below the sure threshold (reduced precision)

    @property
    def vulnerable(self) -> int:
        return int((self.state.verdict == VULNERABLE).sum())

    @property
    def total(self) -> int:
        return len(self.state.verdict)

    @property
    def vulnerable_percent(self) -> float:
        return 100.0 * self.vulnerable / self.total

    @property
    def challenge_accuracy(self) -> float:
        return 100.0 - self.vulnerable_percent

    def lines(self) -> list[str]:
        """The original's summary lines, kept exactly."""
        out = [f"Summary: {self.vulnerable}/{self.total} ({self.vulnerable_percent:.2f}%) are vulnerable foregrounds.",
               f"Challenge accuracy: {self.challenge_accuracy:.2f}%"]
        if self.unsure is not None:
            out.append(f"Reduced precision: {self.total - self.unsure}/{self.total} verdicts are sure "
                       f"({self.rechecked} near-tie composites re-checked in fp32, {self.recheck_changed} changed)")
        return out

    def per_class(self) -> dict:
        labels = self.data.fg_labels
        return {name: {"vulnerable": int(((self.state.verdict == VULNERABLE) & (labels == k)).sum()),
                       "total": int((labels == k).sum())} for k, name in enumerate(class_names())}

    def to_json(self) -> dict:
        s = self.state
        return {"vulnerable": self.vulnerable, "total": self.total,
                "vulnerable_percent": round(self.vulnerable_percent, 4),
                "challenge_accuracy": round(self.challenge_accuracy, 4), "criterion": self.criterion.value,
                "per_class": self.per_class(), "composites_evaluated": int(s.evaluated),
                "background_predictions": len(s.bg_pred), "wall_time_s": round(s.elapsed, 3),
                "composites_per_s": round(s.evaluated / s.elapsed, 1) if s.elapsed > 0 else None,
                "full": s.matrix is not None, "rechecked_fp32": self.rechecked,
                "recheck_changed": self.recheck_changed, "unsure_verdicts": self.unsure,
                "provenance": self.provenance}

    def write_per_foreground_csv(self, path: Path) -> None:
        names = class_names()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["stem", "class", "vulnerable", "fooling_background", "fooled_prediction"])
            for i, rec in enumerate(self.data.foregrounds):
                b = int(self.state.fool_bg[i])
                pred = int(self.state.fool_pred[i])
                writer.writerow([rec.stem, names[rec.label], int(self.state.verdict[i] == VULNERABLE),
                                 self.data.backgrounds[b].relpath if b >= 0 else "",
                                 (names[pred] if pred >= 0 else "none of IN-9") if b >= 0 else ""])

    def write_full_outputs(self, output_dir: Path, data_path: Path, num_classes: int) -> None:
        """The prediction matrix and its index files, for tools.analysis."""
        output_dir.mkdir(parents=True, exist_ok=True)
        np.save(output_dir / MATRIX_NAME, self.state.matrix)
        with open(output_dir / "foregrounds.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["index", "stem", "label", "image", "mask"])
            for i, r in enumerate(self.data.foregrounds):
                writer.writerow([i, r.stem, r.label, r.image_relpath, r.mask_relpath])
        with open(output_dir / "backgrounds.csv", "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["index", "stem", "label", "image"])
            for i, r in enumerate(self.data.backgrounds):
                writer.writerow([i, r.stem, r.label, r.relpath])
        write_json_atomic(output_dir / "challenge_meta.json",
                          {"data_path": str(Path(data_path).resolve()), "criterion": self.criterion.value,
                           "num_classes": num_classes, "provenance": self.provenance})


def _run_key(data: ChallengeData, loaded: LoadedModel, runtime: Runtime, config: ChallengeConfig) -> str:
    parts = [data.fingerprint["sha256"], data.arithmetic.value, loaded.sha256 or "", loaded.normalization,
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
