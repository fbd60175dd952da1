"""The saved prediction matrix of `challenge_eval.py --full` (files: docs/results.md, "Files under --output-dir"),
written from a finished challenge and read back, checked, without the model."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tools.errors import NUMPY_READ_ERRORS, UserError, key_list
from tools.in9 import NUM_IN9_CLASSES, UNMAPPED
from tools.provenance import atomic_write, read_json, read_npy, write_csv_atomic, write_json_atomic

if TYPE_CHECKING:
    from tools.challenge import ChallengeResult

PREDICTIONS_FILE = "predictions.npy"
FOREGROUNDS_FILE = "foregrounds.csv"
BACKGROUNDS_FILE = "backgrounds.csv"
META_FILE = "challenge_meta.json"
FOREGROUND_COLUMNS = ["index", "stem", "label", "image", "mask"]
BACKGROUND_COLUMNS = ["index", "stem", "label", "image"]


@dataclass
class ChallengeMatrix:
    """The saved prediction matrix with the foregrounds and backgrounds its rows and columns stand for."""

    predictions: np.ndarray  # int64 (n_fg, n_bg), IN-9 index or -1
    fg_labels: np.ndarray  # int64 (n_fg,)
    fg_stems: list[str]
    bg_labels: np.ndarray  # int64 (n_bg,)
    bg_stems: list[str]
    bg_images: list[str]  # relative to the data root
    meta: dict
    fg_images: list[str] = field(default_factory=list)  # relative to the data root
    fg_masks: list[str] = field(default_factory=list)  # relative to the data root


def write_matrix(output_dir: Path | str, result: ChallengeResult, data_path: Path | str,
                 num_classes: int) -> ChallengeMatrix:
    """Write a --full challenge `result`'s matrix and index files under `output_dir`; returns what they hold.
    `data_path`: the data root the run read."""
    output_dir = Path(output_dir)
    fgs, bgs = result.data.foregrounds, result.data.backgrounds
    meta = {"data_path": str(Path(data_path).resolve()), "criterion": result.criterion.value,
            "num_classes": num_classes, "provenance": result.provenance}
    with atomic_write(output_dir / PREDICTIONS_FILE, "wb") as fh:
        np.save(fh, result.state.matrix)
    write_csv_atomic(output_dir / FOREGROUNDS_FILE, FOREGROUND_COLUMNS,
                     ([i, r.stem, r.label, r.image_relpath, r.mask_relpath] for i, r in enumerate(fgs)))
    write_csv_atomic(output_dir / BACKGROUNDS_FILE, BACKGROUND_COLUMNS,
                     ([i, r.stem, r.label, r.relpath] for i, r in enumerate(bgs)))
    write_json_atomic(output_dir / META_FILE, meta)
    return ChallengeMatrix(
        predictions=result.state.matrix.astype(np.int64), fg_labels=result.data.fg_labels,
        fg_stems=[r.stem for r in fgs], bg_labels=result.data.bg_labels, bg_stems=[r.stem for r in bgs],
        bg_images=[str(r.relpath) for r in bgs], meta=json.loads(json.dumps(meta)),
        fg_images=[str(r.image_relpath) for r in fgs], fg_masks=[str(r.mask_relpath) for r in fgs])


def require_two_classes(matrix: ChallengeMatrix, output_dir: Path) -> ChallengeMatrix:
    if len(np.unique(matrix.fg_labels)) < 2:
        raise UserError(f"{output_dir / FOREGROUNDS_FILE} has foregrounds of fewer than two classes; ASR and fool "
                        f"rates compare a class's backgrounds with the other classes' foregrounds")
    return matrix


def _read_index_csv(path: Path, columns: list[str]) -> list[dict]:
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            rows = list(reader)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if header != columns:
        raise UserError(f"{path} has columns {key_list(header, separator=',') or '(none)'}, expected "
                        f"{','.join(columns)}; it was not written by challenge_eval.py --full (rerun it)")
    for position, row in enumerate(rows):
        try:
            index, label = int(row["index"]), int(row["label"])
        except (TypeError, ValueError):
            raise UserError(f"{path} row {position + 2}: index and label must be integers "
                            f"(got {row['index']!r}, {row['label']!r})") from None
        if index != position:
            raise UserError(f"{path} row {position + 2} has index {index}, expected {position}; "
                            f"rows must be in index order 0, 1, 2, ...")
        if not 0 <= label < NUM_IN9_CLASSES:
            raise UserError(f"{path} row {position + 2} has label {label}; labels are IN-9 classes 0..8")
    return rows


def load_matrix(output_dir: Path | str) -> ChallengeMatrix:
    """Read predictions.npy, foregrounds.csv, backgrounds.csv and challenge_meta.json, checked to agree."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise UserError(f"{output_dir} is not a folder; pass the --output-dir of `challenge_eval.py --full`")
    missing = [name for name in (PREDICTIONS_FILE, FOREGROUNDS_FILE, BACKGROUNDS_FILE, META_FILE)
               if not (output_dir / name).is_file()]
    if missing:
        raise UserError(f"{output_dir} lacks {', '.join(missing)}; the analysis reads the saved matrix of "
                        f"`challenge_eval.py --full --output-dir {output_dir}` (run that first)")
    try:
        raw = read_npy(output_dir / PREDICTIONS_FILE)
    except NUMPY_READ_ERRORS as exc:
        raise UserError(f"cannot read {output_dir / PREDICTIONS_FILE}: {exc}; rerun challenge_eval.py --full") from None
    try:
        meta = read_json(output_dir / META_FILE)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {output_dir / META_FILE}: {exc}; rerun challenge_eval.py --full") from None
    if not isinstance(meta, dict):
        raise UserError(f"{output_dir / META_FILE} holds no JSON object; rerun challenge_eval.py --full")
    foregrounds = _read_index_csv(output_dir / FOREGROUNDS_FILE, FOREGROUND_COLUMNS)
    backgrounds = _read_index_csv(output_dir / BACKGROUNDS_FILE, BACKGROUND_COLUMNS)
    if raw.ndim != 2 or not np.issubdtype(raw.dtype, np.integer):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} is a {raw.dtype} array of shape {raw.shape}; expected a "
                        f"2-D integer array (foregrounds x backgrounds)")
    if raw.shape != (len(foregrounds), len(backgrounds)):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} has shape {raw.shape} but {FOREGROUNDS_FILE} lists "
                        f"{len(foregrounds)} foregrounds and {BACKGROUNDS_FILE} {len(backgrounds)} backgrounds; "
                        f"the files come from different runs (rerun challenge_eval.py --full)")
    predictions = raw.astype(np.int64)
    if predictions.size and (predictions.min() < UNMAPPED or predictions.max() >= NUM_IN9_CLASSES):
        raise UserError(f"{output_dir / PREDICTIONS_FILE} holds values from {predictions.min()} to "
                        f"{predictions.max()}; predictions are IN-9 classes 0..8 or -1")
    return require_two_classes(ChallengeMatrix(
        predictions=predictions, fg_labels=np.array([int(r["label"]) for r in foregrounds], dtype=np.int64),
        fg_stems=[r["stem"] for r in foregrounds],
        bg_labels=np.array([int(r["label"]) for r in backgrounds], dtype=np.int64),
        bg_stems=[r["stem"] for r in backgrounds], bg_images=[r["image"] for r in backgrounds], meta=meta,
        fg_images=[r["image"] for r in foregrounds], fg_masks=[r["mask"] for r in foregrounds]), output_dir)
