"""Accuracy on IN-9 variations: decode every image once, batch to the device, predict and map there."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tools import distributed
from tools.data import image_sets, layout
from tools.data.image_sets import ImageSet
from tools.data.store import DecodedCache
from tools.errors import UserError, option
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, UNMAPPED, VARIATIONS, PredictionMap, Variation, class_names
from tools.models.boundary import LoadedModel
from tools.models.device_check import ALLOW_FLAG, record_check, verified
from tools.progress import progress_bar
from tools.provenance import decoder as decoder_build
from tools.provenance import read_json, write_json_atomic
from tools.runtime import RECHECK_MARGIN, Forward, Runtime, to_device
from tools.runtime.inflight import Launched, Pipeline, launch, near_ties, top_two_margins
from tools.shards import NOT_MINE, Shard
from tools.threads import default_workers

log = logging.getLogger(__name__)


@dataclass
class VariationResult:
    """One variation's predictions, and the figures derived from them."""

    name: str
    relpaths: list[str]
    labels: np.ndarray  # int64 (N,)
    predictions: np.ndarray  # int64 (N,), IN-9 index or -1
    rechecked: int = 0  # in reduced precision: near ties re-run in fp32 (in this run)
    recheck_changed: int = 0  # of which the fp32 prediction differed

    @property
    def correct(self) -> int:
        return int((self.predictions == self.labels).sum())

    @property
    def total(self) -> int:
        return int(self.labels.shape[0])

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / self.total

    def confusion(self) -> np.ndarray:
        """9x9 counts, rows true class, columns predicted class (predictions of -1 are not in it)."""
        matrix = np.zeros((NUM_IN9_CLASSES, NUM_IN9_CLASSES), dtype=np.int64)
        mapped = self.predictions != UNMAPPED
        np.add.at(matrix, (self.labels[mapped], self.predictions[mapped]), 1)
        return matrix

    def to_json(self) -> dict:
        names = class_names()
        per_class = {}
        for k, name in enumerate(names):
            rows = self.labels == k
            total, correct = int(rows.sum()), int((self.predictions[rows] == k).sum())
            per_class[name] = {"correct": correct, "total": total,
                               "accuracy": round(100.0 * correct / total, 4) if total else None,
                               "unmapped": int((self.predictions[rows] == UNMAPPED).sum())}
        return {"accuracy": round(self.accuracy, 4), "correct": self.correct, "total": self.total,
                "per_class": per_class, "confusion": self.confusion().tolist(), "rechecked_fp32": self.rechecked,
                "recheck_changed": self.recheck_changed}


def bg_gap(results: dict[str, VariationResult]) -> float | None:
    """accuracy(mixed_same) - accuracy(mixed_rand), in points; None unless both were evaluated."""
    same, rand = results.get(Variation.MIXED_SAME.value), results.get(Variation.MIXED_RAND.value)
    if same is None or rand is None:
        return None
    return same.accuracy - rand.accuracy


def accuracy_line(result: VariationResult) -> str:
    """The original script's line, kept exactly."""
    return f"Accuracy on {result.name} is {result.accuracy:.2f}%"


def _differing(saved, key: dict) -> str:
    """The parts of a saved state's key that differ from this run's, as a message names them ("" where it has none)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("key"), dict):
        return ""
    differ = sorted(name for name in {*saved["key"], *key} - {"verified"} if saved["key"].get(name) != key.get(name))
    parts = [f"it differs in {', '.join(differ)}"] if differ else []
    if saved["key"].get("verified") != key.get("verified"):  # exact results are never made of an unverified run's
        whose = "the run that wrote it, not in this one" if saved["key"].get("verified") else \
            f"this run, not in the one that wrote it ({option(ALLOW_FLAG)})"
        parts.append(f"the start-up device check verified the model in {whose}")
    return f" ({'; '.join(parts)})" if parts else ""


class _Resume:
    """Finished variations saved under --output-dir, so an interrupted `all` run picks up where it stopped."""

    def __init__(self, path: Path | None, key: dict, resume: bool):
        self.path, self.key = path, key
        self.done: dict[str, list[int]] = {}
        if path is not None and resume and path.is_file():
            try:
                saved = read_json(path)
            except (OSError, ValueError) as exc:
                raise UserError(f"cannot read the saved state {path} ({exc}); rerun without {option('--resume')}") \
                    from None
            if not isinstance(saved, dict) or saved.get("key") != key:
                raise UserError(f"{path} was written for another model, data or setting{_differing(saved, key)}; "
                                f"rerun without {option('--resume')} or use another {option('--output-dir')}")
            done = saved.get("done")
            if not isinstance(done, dict) or not set(done) <= set(VARIATIONS):
                raise UserError(f"{path} does not hold predictions by variation name; rerun without "
                                f"{option('--resume')}")
            self.done = done
            log.info("resuming: %s already evaluated", ", ".join(self.done) or "nothing")

    def predictions(self, name: str, count: int) -> np.ndarray | None:
        """The saved predictions of variation `name`, checked to be `count` IN-9 predictions (0..8, or -1); None when
        none are saved."""
        if name not in self.done:
            return None
        values = self.done[name]
        if not (isinstance(values, list) and len(values) == count and all(type(v) is int for v in values)
                and all(UNMAPPED <= v < NUM_IN9_CLASSES for v in values)):
            raise UserError(f"{self.path} does not hold {count} IN-9 predictions (0..{NUM_IN9_CLASSES - 1}, or "
                            f"{UNMAPPED}) for {name}, as this run's {name} has {count} images; rerun without "
                            f"{option('--resume')}")
        return np.array(values, dtype=np.int64)

    def save(self, name: str, predictions: np.ndarray) -> None:
        if self.path is None:
            return
        self.done[name] = predictions.tolist()
        write_json_atomic(self.path, {"key": self.key, "done": self.done})


class _Stream:
    """in9's stream of batches through a `Pipeline` (tools.runtime.inflight), predictions read `IN_FLIGHT` batches
    later; in reduced precision, images whose margin is below `margin` are re-run in true fp32 in full batches (and
    at every `drain`), replacing the fast predictions in `preds` (see docs/how-it-works.md, the fp32 re-check)."""

    def __init__(self, eager: torch.nn.Module, forward: Forward, runtime: Runtime, batch_size: int, margin: float,
                 to_in9: PredictionMap, size: int):
        self.forward, self.to_in9 = forward, to_in9
        self.margin = runtime.recheck_margin(margin)
        self.recheck = Forward(eager, runtime, batch_size, exact=True, what="the fp32 re-check's batch size")
        self.preds = np.full(size, NOT_MINE, np.int64)  # by stream position, as recorded
        self.images: dict[int, torch.Tensor] = {}  # a launched batch's images on the device, by its first position
        self.ties: list[torch.Tensor] = []  # the held batches' near ties, in launch order
        self.rechecked: list[np.ndarray] = []  # stream positions re-checked so far
        self.changed: list[np.ndarray] = []  # and of those, the ones whose prediction changed
        self.pipeline = Pipeline(self, self._record)

    def submit(self, images: torch.Tensor, start: int) -> None:
        """Launch the batch at stream position `start` (recording the batches `IN_FLIGHT` before it)."""
        self.images[start] = images
        self.pipeline.launch(np.arange(start, start + images.shape[0]))

    def drain(self) -> None:
        self.pipeline.drain()

    def launch(self, positions: np.ndarray) -> Launched:
        logits = self.forward(self.images[int(positions[0])])
        return launch(positions, self.to_in9(logits), top_two_margins(logits) if self.margin > 0 else None)

    def near_tie_mask(self, margins: np.ndarray | None) -> np.ndarray:
        return near_ties(margins, self.margin)

    def hold(self, positions: np.ndarray, is_tie: np.ndarray) -> None:
        images = self.images.pop(int(positions[0]))
        rows = np.flatnonzero(is_tie)
        if len(rows):
            self.ties.append(images[to_device(torch.from_numpy(rows), images.device)])  # keeps the memory format

    def fp32_predictions(self, positions: np.ndarray, fast: np.ndarray) -> np.ndarray:
        if not len(positions):
            return fast
        exact = self.to_in9(self.recheck(torch.cat(self.ties))).cpu().numpy().astype(np.int64)
        self.ties = []
        self.rechecked.append(positions)
        self.changed.append(positions[exact != fast])
        return exact

    def _record(self, positions: np.ndarray, preds: np.ndarray, margins: np.ndarray | None) -> None:
        self.images.pop(int(positions[0]), None)
        self.preds[positions] = preds

    def flags(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stream position re-checked so far, and those whose prediction that changed."""
        return (np.concatenate(self.rechecked or [np.zeros(0, np.int64)]),
                np.concatenate(self.changed or [np.zeros(0, np.int64)]))

    def counts(self, lo: int, hi: int) -> tuple[int, int]:
        """Re-checked and changed among stream positions lo..hi-1."""
        return tuple(int(((at >= lo) & (at < hi)).sum()) for at in self.flags())


def evaluate_variations(loaded: LoadedModel, runtime: Runtime, files: In9Files, batch_size: int, workers: int,
                        progress: bool = True, recheck_margin: float = RECHECK_MARGIN, shard: Shard | None = None,
                        saved: _Resume | None = None) -> tuple[dict[str, VariationResult], dict]:
    """Predict the listed variations in one stream of batches: the results by variation, and the batch size run.
    `recheck_margin`: near ties re-run in fp32 (0: none); `saved`: variations finished before, taken as they are."""
    saved = saved or _Resume(None, {}, False)
    images = files.image_set
    results: dict[str, VariationResult] = {}
    todo = []
    for name, records in files.listings.items():
        labels = np.array([r.label for r in records], dtype=np.int64)
        relpaths = [r.relpath for r in records]
        done = saved.predictions(name, len(records))
        if done is not None:
            results[name] = VariationResult(name, relpaths, labels, done)
        else:
            todo.append((name, relpaths, labels))
    if not todo:
        return {name: results[name] for name in files.listings}, {"batch_size": batch_size}

    eager = runtime.prepare(loaded.model)
    forward = Forward(runtime.compiled(eager), runtime, batch_size)
    to_in9 = PredictionMap(loaded.num_classes)
    all_paths = [p for _, relpaths, _ in todo for p in relpaths]
    stream = _Stream(eager, forward, runtime, batch_size, recheck_margin, to_in9, len(all_paths))
    bounds = np.cumsum([0] + [len(relpaths) for _, relpaths, _ in todo])
    if runtime.group.distributed or shard is not None:
        share = shard or Shard(runtime.group.rank, runtime.group.world_size)
        predictions, rechecked, changed = _predict_share(images, all_paths, batch_size, workers, runtime, stream,
                                                         progress, share)
        for (name, relpaths, labels), lo, hi in zip(todo, bounds[:-1], bounds[1:]):
            results[name] = VariationResult(name, relpaths, labels, predictions[lo:hi], int(rechecked[lo:hi].sum()),
                                            int(changed[lo:hi].sum()))
            if shard is None and runtime.group.is_main:  # a shard's predictions are the others' NOT_MINE: tools.merge
                saved.save(name, predictions[lo:hi])
        return {name: results[name] for name in files.listings}, forward.provenance()
    held = [(name, images.decoder, tuple(relpaths)) for name, relpaths, _ in todo]  # what a decoding depends on
    memory = [images.held.get(key) for key in held] if images.held is not None else []
    kept = torch.empty((len(all_paths), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8) \
        if any(m is None for m in memory) else None  # filled on the host for the next runs
    if memory and kept is None:
        batches = _batches_in_memory(memory, batch_size)
    else:
        batches = image_sets.iter_decoded_batches(images, all_paths, batch_size, workers, runtime.pin(),
                                                device=None if kept is not None else runtime.device)
    finished = 0
    bar = progress_bar(total=len(all_paths), unit="img", desc="evaluating", disable=not progress, dynamic_ncols=True)
    with bar:
        for start, batch in batches:
            if kept is not None:
                kept[start:start + batch.shape[0]] = batch
            stream.submit(runtime.to_device(batch), start)
            bar.update(batch.shape[0])
            end = start + batch.shape[0]
            if finished < len(todo) and end >= bounds[finished + 1]:
                stream.drain()  # a variation ends in this batch: a fixed point
            while finished < len(todo) and end >= bounds[finished + 1]:
                lo, hi = bounds[finished], bounds[finished + 1]
                name, relpaths, labels = todo[finished]
                preds = stream.preds[lo:hi].copy()
                results[name] = VariationResult(name, relpaths, labels, preds, *stream.counts(lo, hi))
                saved.save(name, preds)
                finished += 1
    if kept is not None:
        for key, lo, hi in zip(held, bounds[:-1], bounds[1:]):
            images.held[key] = kept[lo:hi]
    return {name: results[name] for name in files.listings}, forward.provenance()


def _batches_in_memory(groups: list[torch.Tensor], batch_size: int):
    """(start, batch) over decoded groups as one stream, in batches of `batch_size`: views of the groups, a small
    copy only for a batch that straddles two."""
    start, pieces, filled = 0, [], 0
    for group in groups:
        lo = 0
        while lo < group.shape[0]:
            pieces.append(group[lo:lo + batch_size - filled])
            filled += pieces[-1].shape[0]
            lo += pieces[-1].shape[0]
            if filled == batch_size:
                yield start, pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                start, pieces, filled = start + filled, [], 0
    if pieces:
        yield start, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _predict_share(images: ImageSet, relpaths: list[str], batch_size: int, workers: int, runtime: Runtime,
                   stream: _Stream, progress: bool, share: Shard) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The stream's batches dealt out in turn (batch i to share i mod N), each image predicted in the batch one
    process would put it in; under torchrun gathered into every process, an independent shard keeping NOT_MINE (-2)
    where others predict. Also per position: re-checked in fp32, and changed by it (gathered alike)."""
    starts = list(range(0, len(relpaths), batch_size))[share.index::share.count]
    # an image only this process decodes may fail: all leave together
    with distributed.agree(runtime.group, runtime.device):
        with progress_bar(total=len(relpaths), unit="img", desc="evaluating", disable=not progress,
                          dynamic_ncols=True) as bar:
            for start, batch in image_sets.iter_decoded_batches(images, relpaths, batch_size, workers, runtime.pin(),
                                                              starts, runtime.device):
                stream.submit(runtime.to_device(batch), start)
                bar.update(batch.shape[0] * share.count)
            stream.drain()
    preds = stream.preds  # this process's predictions, NOT_MINE elsewhere
    rechecked, changed = stream.flags()
    flags = np.zeros((3, len(relpaths)), np.int64)  # prediction - NOT_MINE where this process predicted, else 0
    flags[0] = preds - NOT_MINE
    flags[1, rechecked], flags[2, changed] = 1, 1
    gathered = distributed.all_reduce(flags.reshape(-1), "sum", runtime.device)
    n = len(relpaths)
    return gathered[:n] + NOT_MINE, gathered[n:2 * n], gathered[2 * n:]


@dataclass
class In9Run:
    """A finished in9_eval run: per-variation results, the BG-gap and provenance."""

    results: dict[str, VariationResult]
    provenance: dict
    key: dict | None = None  # the run's identity (data, model, settings): the same for every shard of one run

    @property
    def bg_gap(self) -> float | None:
        return bg_gap(self.results)

    def to_json(self) -> dict:
        payload: dict = {name: result.to_json() for name, result in self.results.items()}
        gap = self.bg_gap
        payload["bg_gap"] = None if gap is None else round(gap, 4)
        payload["rechecked_fp32"] = sum(r.rechecked for r in self.results.values())
        payload["recheck_changed"] = sum(r.recheck_changed for r in self.results.values())
        payload["provenance"] = self.provenance
        return payload

    def lines(self) -> list[str]:
        """The original's accuracy line per variation; with several, a table and the BG-gap too."""
        out = [accuracy_line(r) for r in self.results.values()]
        if len(self.results) > 1:
            out += ["", f"{'variation':<12} {'accuracy':>9} {'correct/total':>14}"]
            out += [f"{r.name:<12} {r.accuracy:>8.2f}% {f'{r.correct}/{r.total}':>14}" for r in self.results.values()]
        gap = self.bg_gap
        if gap is not None:
            out.append(f"BG-gap (mixed_same - mixed_rand): {gap:.2f} points")
        return out


@dataclass
class In9Files:
    """The images of the named variations, listed and checked, and their image set (content, decoder, cache)."""

    listings: dict[str, list[layout.ImageRecord]]
    image_set: ImageSet


def list_in9_files(root: Path, names: Sequence[str], workers: int | None = None, cache: DecodedCache | None = None,
                   hold: bool = False) -> In9Files:
    """List the variations (folders checked first: `tools.prepared_run.check_folders`) and hash their content in
    `workers` threads; `cache`, `hold`: as `image_sets.read_image_set`."""
    workers = default_workers() if workers is None else workers
    listings = {name: layout.list_variation(Path(root), name) for name in names}
    relpaths = [r.relpath for name in names for r in listings[name]]
    return In9Files(listings, image_sets.read_image_set(root, relpaths, relpaths, workers, cache, hold))


@dataclass
class In9Config:
    """An in9 run's settings; their defaults are in9_eval.py's (`all` aside: its --eval-dataset names one)."""

    variations: tuple[str, ...] = VARIATIONS  # what is listed (`tools.prepared_run`) and evaluated (`run_in9`)
    batch_size: int | None = None  # None: the runtime's default (`Runtime.batch_size`)
    workers: int = field(default_factory=default_workers)  # image-decoding threads
    progress: bool = True
    recheck_margin: float = RECHECK_MARGIN  # in reduced precision, near ties below it are re-run in fp32; 0: off


def run_in9(loaded: LoadedModel, runtime: Runtime, files: In9Files, config: In9Config, *,
            output_dir: Path | None = None, resume: bool = False, shard: Shard | None = None,
            device_check: dict | None = None) -> In9Run:
    """Evaluate the listed variations and gather the provenance a results file cites. output_dir: where finished
    variations are saved for `resume`. shard: predict only that share (tools.shards; the rest NOT_MINE, for
    tools.merge). device_check: the start-up check's record, recorded in the provenance; a run resumes only
    predictions made under its own verdict. It evaluates the variations `config` names, in its order, of
    those listed (ValueError for one not listed)."""
    unlisted = [name for name in config.variations if name not in files.listings]
    if unlisted:
        raise ValueError(f"run_in9: {', '.join(unlisted)} not listed; list_in9_files lists {', '.join(files.listings)}")
    files = In9Files({name: files.listings[name] for name in config.variations}, files.image_set)
    images = files.image_set
    key = {"data": images.fingerprint, "decoder": decoder_build(images.decoder.value),
           "model_identity": loaded.identity, "normalization": loaded.normalization, **runtime.arithmetic(),
           "num_classes": loaded.num_classes, "recheck_margin": runtime.recheck_margin(config.recheck_margin),
           "batch_size": runtime.batch_size(config.batch_size)}  # another shape may change the last bits
    state_path = Path(output_dir) / "in9_state.json" if output_dir is not None and shard is None else None
    saved = _Resume(state_path, {**key, "verified": verified(device_check)}, resume)
    results, batch = evaluate_variations(loaded, runtime, files, key["batch_size"], config.workers, config.progress,
                                         config.recheck_margin, shard, saved)
    images.contents.clear()  # decoded: the bytes are not needed again
    info = images.provenance(runtime.describe(), loaded.describe())
    info.update(batch)
    if device_check is not None:
        record_check(info, device_check)
    return In9Run(results, info, key)
