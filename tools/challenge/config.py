"""The challenge's settings: the criterion of being fooled, and `ChallengeConfig` (challenge_eval.py's flags read
their defaults here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tools.data.compositing import MaskArithmetic
from tools.runtime import RECHECK_MARGIN


class Criterion(str, enum.Enum):
    """`any`: some background changes the prediction (the leaderboard's). `bg-class`: some background of
    another class makes the model predict that background's class (the paper's stricter reading)."""

    ANY = "any"
    BG_CLASS = "bg-class"


@dataclass
class ChallengeConfig:
    """The challenge run's settings; their defaults are challenge_eval.py's (its flags read them here)."""

    criterion: Criterion = Criterion.ANY
    full: bool = False
    batch_size: int | None = None  # None: the runtime's default on a GPU; on the CPU, measured at start-up
    save_every: float = 5.0  # seconds between state saves
    # in reduced precision, near ties below it are re-run in fp32; 0 turns it off
    recheck_margin: float = RECHECK_MARGIN
    progress: bool = True
    mask_arithmetic: MaskArithmetic = MaskArithmetic.BINARY
