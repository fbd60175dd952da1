"""Independent shards (`--shard I/N`, no process group: a SLURM array, separate machines): writing them, and
reading them back for the merge, believed only as far as they fit. What a merge guarantees, and why a challenge
shard's arrays are written before its JSON: docs/how-it-works.md, "Sharded runs".
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.data.hashing import sha256_file
from tools.errors import NUMPY_READ_ERRORS, UserError
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED
from tools.provenance import atomic_write, checked_array, read_json, read_npz, write_json_atomic

CHALLENGE_PATTERN = "challenge-shard-{index}-of-{count}"
IN9_PATTERN = "in9-shard-{index}-of-{count}.json"
NOT_MINE = -2  # an in9 shard's prediction for an image another shard predicts
MAX_COUNT = 2**63 - 1  # a count a shard records (of numpy's int64, as the run counted it)
MAX_SHARDS = 2**31 - 1  # the most shards a run is split into (--shard I/N; numpy holds the positions' arithmetic)
NAME = re.compile(r"^(challenge|in9)-shard-(\d+)-of-(\d+)\.json$")
FORMAT = 2  # the layout of the shard files: written into each, and a shard of another layout is refused
FIELDS = {"challenge": ("shard", "key", "arrays_sha256", "results", "num_classes", "data_path", "foregrounds",
                        "backgrounds"),
          "in9": ("shard", "key", "provenance", "variations")}


@dataclass(frozen=True)
class Shard:
    """This run's share: index I of N (0-based)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def take(self, items: int) -> np.ndarray:
        """The positions of `items` things that fall to this shard: I, I+N, I+2N, ..."""
        return np.arange(self.index, items, self.count)

    def owns_batches(self, items: int, batch_size: int) -> np.ndarray:
        """Whether each of `items` stream positions falls to this shard (batch i to shard i mod N): in9's share."""
        return (np.arange(items) // batch_size) % self.count == self.index


def shard_spec(text: str) -> Shard:
    """argparse type for --shard I/N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not (0 <= int(match.group(1)) < int(match.group(2)) <= MAX_SHARDS):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 0 <= I < N <= {MAX_SHARDS} (e.g. 0/4 for the "
                                         f"first of four)")
    return Shard(int(match.group(1)), int(match.group(2)))


# ----------------------------------------------------------------------------------------------------------
# Writing a shard

def write_challenge_shard(output_dir: Path, shard: Shard, result, files, data_path: Path, num_classes: int) -> Path:
    """The shard's verdicts (by global foreground index) and what the merge needs to rebuild the whole run."""
    s = result.state
    stem = Path(output_dir) / CHALLENGE_PATTERN.format(index=shard.index, count=shard.count)
    arrays = {"indices": shard.take(len(files.foregrounds)), "verdict": s.verdict, "fool_bg": s.fool_bg,
              "fool_pred": s.fool_pred, "min_margin": s.min_margin, "bg_pred": s.bg_pred}
    if s.matrix is not None:
        arrays["matrix"] = s.matrix
    arrays["key"] = np.frombuffer(result.key.encode(), np.uint8)
    npz = stem.with_suffix(".npz")
    with atomic_write(npz, "wb") as fh:
        np.savez(fh, **arrays)
    write_json_atomic(stem.with_suffix(".json"), {  # last: it names the arrays it was written with
        "format": FORMAT, "shard": [shard.index, shard.count], "key": result.key, "arrays_sha256": sha256_file(npz),
        "results": result.to_json(),
        "num_classes": num_classes, "data_path": str(Path(data_path).resolve()),
        "foregrounds": [[r.stem, r.label, r.image_relpath, r.mask_relpath] for r in files.foregrounds],
        "backgrounds": [[r.relpath, r.label] for r in files.backgrounds]})
    return stem.with_suffix(".json")


def written_line(shard: Shard, path: Path, output_dir: Path) -> str:
    """What a command prints when it has written its shard."""
    return f"shard {shard} written to {path}; when all are done: python -m tools.merge {output_dir}"


def write_in9_shard(output_dir: Path, shard: Shard, run) -> Path:
    """The shard's predictions (the others' NOT_MINE) for every variation of the run."""
    path = Path(output_dir) / IN9_PATTERN.format(index=shard.index, count=shard.count)
    write_json_atomic(path, {
        "format": FORMAT, "shard": [shard.index, shard.count], "key": run.key, "provenance": run.provenance,
        "variations": {name: {"relpaths": r.relpaths, "labels": r.labels.tolist(),
                              "predictions": r.predictions.tolist(), "rechecked_fp32": r.rechecked,
                              "recheck_changed": r.recheck_changed}
                       for name, r in run.results.items()}})
    return path


# ----------------------------------------------------------------------------------------------------------
# Finding and checking shards

def find_shards(folders: list[Path]) -> dict[str, list[tuple[Path, dict]]]:
    """Every shard file in the folders, by kind ("challenge", "in9"), read and checked to form whole runs."""
    found: dict[str, list[tuple[Path, dict]]] = {}
    for folder in folders:
        if not Path(folder).is_dir():
            raise UserError(f"{folder} is not a folder; pass the --output-dir of each --shard run")
        for path in sorted(Path(folder).iterdir()):
            match = NAME.match(path.name)
            if match:
                kind, index, count = match.group(1), int(match.group(2)), int(match.group(3))
                if not index < count <= MAX_SHARDS:
                    raise UserError(f"{path} names shard {index} of {count}, which no run is split into (I < N <= "
                                    f"{MAX_SHARDS}); move it out of {folder}")
                found.setdefault(kind, []).append((path, _read_meta(path, kind, Shard(index, count))))
    if not found:
        raise UserError(f"no shard results (challenge-shard-I-of-N.json, in9-shard-I-of-N.json) in "
                        f"{', '.join(map(str, folders))}; run the scripts with --shard I/N first")
    for kind, shards in found.items():
        _check_complete(kind, shards)
    return found


def _check_complete(kind: str, shards: list[tuple[Path, dict]]) -> None:
    counts = {meta["shard"][1] for _, meta in shards}
    if len(counts) != 1:
        raise UserError(f"{kind} shards of different splits ({', '.join(f'N={n}' for n in sorted(counts))}); "
                        f"merge the shards of one run")
    count = counts.pop()
    indices = sorted(meta["shard"][0] for _, meta in shards)
    present = set(indices)
    missing = list(itertools.islice((i for i in range(count) if i not in present), 8))  # never all of a huge N
    more = count - len(present) - len(missing)
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if missing or twice:
        problem = (f"missing shard(s) {', '.join(map(str, missing))}{f' and {more} more' if more else ''}"
                   if missing else "") + \
                  ("; " if missing and twice else "") + \
                  (f"shard(s) {', '.join(map(str, twice))} found twice" if twice else "")
        raise UserError(f"{kind} shards of {count}: {problem}; run the missing ones (--shard I/{count}) or pass each "
                        f"shard's folder once")
    keys = {json.dumps(meta["key"], sort_keys=True) for _, meta in shards}
    if len(keys) != 1:
        raise UserError(f"the {kind} shards come from different runs (model, data or settings differ): "
                        f"{', '.join(str(path) for path, _ in shards)}")


def _rerun(shard: Shard) -> str:
    return f"rerun that shard (--shard {shard}) with the run's other settings unchanged"


def _read_meta(path: Path, kind: str, named: Shard) -> dict:
    """A shard's JSON, refused unless it is whole and of this format (`named`: the shard its file name gives)."""
    try:
        meta = read_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read shard file {path} ({exc}); {_rerun(named)}") from None
    missing = [field for field in FIELDS[kind] if field not in meta] if isinstance(meta, dict) else list(FIELDS[kind])
    if missing or meta.get("format") != FORMAT:
        raise UserError(f"{path} is not a {kind} shard of this toolkit's format {FORMAT} (written by another version, "
                        f"or not a shard{'; lacks ' + ', '.join(missing) if missing else ''}); {_rerun(named)}")
    if meta["shard"] != [named.index, named.count]:
        raise UserError(f"{path} holds shard {meta['shard']!r}, not the shard {named} its name says; {_rerun(named)}")
    problem = _challenge_meta_problem(meta) if kind == "challenge" else _in9_meta_problem(meta, named)
    if problem is not None:
        raise UserError(f"{path} is not a shard this toolkit writes: {problem}; {_rerun(named)}")
    return meta


def _is_int(value, low: int = 0, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def _challenge_meta_problem(meta: dict) -> str | None:
    """What in a challenge shard's JSON is not of the form the toolkit writes; None when nothing."""
    foregrounds, backgrounds, results = meta["foregrounds"], meta["backgrounds"], meta["results"]
    if not (isinstance(foregrounds, list) and all(
            isinstance(r, list) and len(r) == 4 and _is_int(r[1], 0, NUM_IN9_CLASSES - 1)
            and all(isinstance(v, str) for v in (r[0], r[2], r[3])) for r in foregrounds)):
        return "its foregrounds are not [stem, class 0..8, image, mask] rows"
    if not (isinstance(backgrounds, list) and all(
            isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and _is_int(r[1], 0, NUM_IN9_CLASSES - 1)
            for r in backgrounds)):
        return "its backgrounds are not [image, class 0..8] rows"
    if not _is_int(meta["num_classes"], 1):
        return f"its class count {meta['num_classes']!r} is not a positive integer"
    counts = ("composites_evaluated", "rechecked_fp32", "recheck_changed")
    if not (isinstance(results, dict) and all(_is_int(results.get(k), 0, MAX_COUNT) for k in counts)
            and (results.get("unsure_verdicts") is None or _is_int(results.get("unsure_verdicts"), 0, MAX_COUNT))
            and type(results.get("wall_time_s")) in (int, float) and 0 <= results["wall_time_s"] < math.inf
            and isinstance(results.get("full"), bool) and isinstance(results.get("criterion"), str)
            and isinstance(results.get("provenance"), dict)):
        return "its results are not a challenge run's (counts, time, criterion, provenance)"
    return None


def _in9_meta_problem(meta: dict, shard: Shard) -> str | None:
    """What in an in9 shard's JSON is not of the toolkit's form or not shard I of N's; None when nothing."""
    variations, key = meta["variations"], meta["key"]
    batch_size = key.get("batch_size") if isinstance(key, dict) else None
    if not _is_int(batch_size, 1):
        return "its key names no batch size"
    if not isinstance(variations, dict) or not variations:
        return "it holds no variations"
    for name, v in variations.items():
        if not (isinstance(v, dict) and isinstance(v.get("relpaths"), list) and isinstance(v.get("labels"), list)
                and isinstance(v.get("predictions"), list)
                and len(v["relpaths"]) == len(v["labels"]) == len(v["predictions"])
                and all(isinstance(r, str) for r in v["relpaths"])
                and all(_is_int(label, 0, NUM_IN9_CLASSES - 1) for label in v["labels"])
                and all(_is_int(p, min(NOT_MINE, UNMAPPED), NUM_IN9_CLASSES - 1) for p in v["predictions"])
                and _is_int(v.get("rechecked_fp32", 0)) and _is_int(v.get("recheck_changed", 0))):
            return (f"its {name} is not images with classes 0..8 and predictions {UNMAPPED}..8 ({NOT_MINE}: another "
                    f"shard's)")
    predictions = np.array([p for v in variations.values() for p in v["predictions"]], np.int64)
    owned = shard.owns_batches(len(predictions), batch_size)
    if (predictions[~owned] != NOT_MINE).any() or ((predictions[owned] < UNMAPPED)
                                                   | (predictions[owned] >= NUM_IN9_CLASSES)).any():
        return (f"it does not predict exactly the images of batches {shard.index}, {shard.index + shard.count}, ... "
                f"(of {batch_size}) as IN-9 classes 0..8 or {UNMAPPED}")
    return None


def read_challenge_arrays(path: Path, meta: dict) -> dict[str, np.ndarray]:
    """The arrays of the challenge shard whose JSON is `path`, refused unless they are the very file that JSON was
    written with (same key, the SHA-256 it records)."""
    npz, shard = path.with_suffix(".npz"), Shard(*meta["shard"])
    if not npz.is_file():
        raise UserError(f"{npz} is missing: the arrays of {path.name}; {_rerun(shard)}")
    try:
        arrays = read_npz(npz)
        key = bytes(arrays.pop("key")).decode()
    except (*NUMPY_READ_ERRORS, KeyError) as exc:  # a bad key decodes with a ValueError
        raise UserError(f"cannot read {npz} ({exc}), the arrays of {path.name}; {_rerun(shard)}") from None
    if key != meta["key"]:
        raise UserError(f"{npz} holds another run's results than {path.name} (a rerun stopped between writing the "
                        f"two?); {_rerun(shard)}")
    if sha256_file(npz) != meta["arrays_sha256"]:
        raise UserError(f"{npz} is not the file {path.name} was written with (a rerun stopped between writing the "
                        f"two?); {_rerun(shard)}")
    try:
        return _checked_challenge_arrays(arrays, shard, len(meta["foregrounds"]), len(meta["backgrounds"]),
                                         bool(meta["results"].get("full")))
    except (ValueError, KeyError) as exc:
        raise UserError(f"{npz} does not hold shard {shard}'s results ({exc}); {_rerun(shard)}") from None


def _checked_challenge_arrays(arrays: dict[str, np.ndarray], shard: Shard, n_fg: int, n_bg: int,
                              full: bool) -> dict[str, np.ndarray]:
    """A challenge shard's arrays, checked to be the finished search of the foregrounds shard I of N owns, every
    value in range; a ValueError says what is not."""
    mine = shard.take(n_fg)
    n, classes = len(mine), NUM_IN9_CLASSES - 1
    indices = checked_array(arrays, "indices", (None,), "iu", dtype=np.int64)
    if not np.array_equal(indices, mine):
        raise ValueError(f"it claims other foregrounds than {shard.index}, {shard.index + shard.count}, ... of "
                         f"{n_fg}, which are shard {shard}'s")
    checked = {"indices": indices,
               # a finished search: every verdict robust (0) or vulnerable (1)
               "verdict": checked_array(arrays, "verdict", (n,), "iu", 0, 1, np.int8),
               "fool_bg": checked_array(arrays, "fool_bg", (n,), "iu", -1, n_bg - 1, np.int64),
               "fool_pred": checked_array(arrays, "fool_pred", (n,), "iu", UNMAPPED, classes, np.int64),
               "min_margin": checked_array(arrays, "min_margin", (n,), "f", 0, dtype=np.float32),
               "bg_pred": checked_array(arrays, "bg_pred", (n_bg,), "iu", UNMAPPED, classes, np.int64)}
    if full != ("matrix" in arrays):
        raise ValueError("its --full matrix is missing" if full else "it holds a matrix its results do not make")
    if full:
        checked["matrix"] = checked_array(arrays, "matrix", (n, n_bg), "iu", UNMAPPED, classes, np.int8)
    return checked
