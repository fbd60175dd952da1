"""The challenge search's command-line flags (challenge_eval.py and the zoo), defaults from `ChallengeConfig`."""

from __future__ import annotations

import argparse

from tools.challenge.config import ChallengeConfig, Criterion
from tools.cli import number
from tools.data.compositing import MaskArithmetic
from tools.options import add_cache_arguments, cache_from_args

__all__ = ["add_search_arguments", "cache_from_args", "challenge_config_from_args"]

DEFAULTS = ChallengeConfig()


def add_search_arguments(group) -> None:
    """The challenge search's flags (challenge_eval.py and the zoo)."""
    group.add_argument("--criterion", type=Criterion, choices=list(Criterion), default=DEFAULTS.criterion,
                       metavar="{" + ",".join(c.value for c in Criterion) + "}",
                       help=f"any: some background changes the prediction (the leaderboard's); bg-class: some "
                            f"background of another class makes the model predict that class (default: "
                            f"{DEFAULTS.criterion.value})")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model; not exact, even in fp32: near ties are re-checked in fp32 as "
                            "in the speed modes (default: off)")
    group.add_argument("--recheck-margin", type=number(0), default=DEFAULTS.recheck_margin, metavar="M",
                       help=f"in bf16/fp16/tf32, re-run every composite whose top-two logit margin is below M in true "
                            f"fp32 (autocast and TF32 off for that pass), so near ties get fp32's verdict (default: "
                            f"{DEFAULTS.recheck_margin} in reduced precision; 0 turns it off)")
    group.add_argument("--mask-arithmetic", type=MaskArithmetic, choices=list(MaskArithmetic),
                       default=DEFAULTS.mask_arithmetic,
                       metavar="{" + ",".join(m.value for m in MaskArithmetic) + "}",
                       help=f"binary: masks must hold 0/1 (or booleans) and are composited exactly on bytes; masks "
                            f"with other values are refused. original: the original script's arithmetic for any "
                            f"values, weight = (uint8(mask) * 255 mod 256) / 255 blended in float, to reproduce "
                            f"its numbers on such masks (default: {DEFAULTS.mask_arithmetic.value})")
    add_cache_arguments(group)
    group.add_argument("--save-every", type=number(0, unit="seconds"), default=DEFAULTS.save_every, metavar="SECONDS",
                       help=f"seconds between saves of the search state (default: {DEFAULTS.save_every:g})")


def challenge_config_from_args(args: argparse.Namespace, progress: bool, full: bool = False) -> ChallengeConfig:
    """The ChallengeConfig the search flags describe (`progress`: whether this process shows progress bars)."""
    return ChallengeConfig(criterion=args.criterion, full=full, batch_size=args.batch_size,
                           save_every=args.save_every, recheck_margin=args.recheck_margin, progress=progress,
                           mask_arithmetic=args.mask_arithmetic)
