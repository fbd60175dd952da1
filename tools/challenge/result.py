"""A finished challenge run: the original's summary lines, the results JSON and the per-foreground CSV (the
rest the commands write is composed in `tools.results.publish`)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from tools.challenge.config import Criterion
from tools.challenge.data import Pairs
from tools.challenge.state import VULNERABLE, SearchState
from tools.in9 import class_names
from tools.provenance import atomic_write


@dataclass
class ChallengeResult:
    data: Pairs  # what was searched: its records and labels
    state: SearchState
    criterion: Criterion
    provenance: dict
    rechecked: int = 0
    recheck_changed: int = 0
    unsure: int | None = None  # verdicts resting on a margin below the sure threshold (reduced precision)
    key: str = ""  # the run's identity (data, model, settings): the same for every shard of one run

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
        with atomic_write(path, newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["stem", "class", "vulnerable", "fooling_background", "fooled_prediction"])
            for i, rec in enumerate(self.data.foregrounds):
                b = int(self.state.fool_bg[i])
                pred = int(self.state.fool_pred[i])
                writer.writerow([rec.stem, names[rec.label], int(self.state.verdict[i] == VULNERABLE),
                                 self.data.backgrounds[b].relpath if b >= 0 else "",
                                 (names[pred] if pred >= 0 else "none of IN-9") if b >= 0 else ""])
