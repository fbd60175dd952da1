"""train.py's vocabulary and flags: methods, adapters, freezing, and the checked `TrainConfig` they become."""

from __future__ import annotations

import argparse
import enum
import math
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from tools.cli import (
    MAX_WORKERS,
    ArgumentParser,
    BooleanFlag,
    add_log_level_argument,
    examples,
    number,
    seed_number,
    whole_number,
)
from tools.distributed import DEFAULT_TIMEOUT_MINUTES
from tools.errors import UserError
from tools.in9 import VARIATIONS, Variation
from tools.models.architectures import ARCHITECTURES, architecture_names
from tools.models.device_check import ALLOW_FLAG
from tools.models.spec import ModelSpec
from tools.options import add_dist_timeout_argument, add_model_source_arguments
from tools.runtime import BATCH_SIZE_DEFAULTS, Precision
from tools.threads import default_workers


class Method(str, enum.Enum):
    """What the training data looks like: plain images, swapped backgrounds, mixed batches."""

    ERM = "erm"
    BG_SWAP = "bg-swap"
    MIXUP = "mixup"
    CUTMIX = "cutmix"


class Adapter(str, enum.Enum):
    LORA = "lora"
    OFT = "oft"


class Freeze(str, enum.Enum):
    NONE = "none"
    BACKBONE = "backbone"


class Optimizer(str, enum.Enum):
    ADAMW = "adamw"
    SGD = "sgd"


RANDOM_INIT = "none"  # --weights none: random initialisation
# CUDA GPUs compute bf16 natively from compute capability 8.0 (Ampere) on; older ones (V100, T4) emulate it,
# slower than fp32, so the default precision there is fp32.
BF16_NATIVE_CAPABILITY = (8, 0)
# The reference recipe: AdamW at peak learning rate 0.001 for a global batch of 32. Without --lr the peak rate
# is scaled linearly with the global batch (lr = 0.001 x batch / 32, Goyal et al.'s rule), so a larger batch
# takes the same steps per image seen.
REFERENCE_BATCH_SIZE, REFERENCE_LR = 32, 1e-3
GPU_TRAIN_BATCH_SIZE = 256  # the default global batch on a CUDA GPU: enough to keep a ResNet-50 step compute-bound


def default_train_batch_size(device: torch.device) -> int:
    """--batch-size's default on `device`: GPU_TRAIN_BATCH_SIZE on a CUDA GPU, the reference batch elsewhere."""
    return GPU_TRAIN_BATCH_SIZE if device.type == "cuda" else REFERENCE_BATCH_SIZE


def default_lr(batch_size: int) -> float:
    """--lr's default for a global batch: the reference rate scaled linearly with the batch."""
    return REFERENCE_LR * batch_size / REFERENCE_BATCH_SIZE


FLAGS = {"methods": "--method", "progress": "--no-progress"}  # settings whose flag is not named after them


def flag_of(setting: str) -> str:
    return FLAGS.get(setting, "--" + setting.replace("_", "-"))


def _choices(enum_type) -> str:
    return "{" + ",".join(m.value for m in enum_type) + "}"


@dataclass
class TrainConfig:
    """Everything a training run depends on; `to_record` is what the checkpoint's train_args holds."""

    data_path: Path
    output_dir: Path
    methods: list[Method] = field(default_factory=lambda: [Method.ERM])
    train_variation: str = Variation.ORIGINAL.value
    arch: str | None = None
    weights: str | None = None
    checkpoint: Path | None = None
    checkpoint_key: str | None = None
    trust_checkpoint: bool = False
    epochs: int = 1
    batch_size: int | None = None  # None: decided by `settle` on the device (default_train_batch_size)
    optimizer: Optimizer = Optimizer.ADAMW
    lr: float | None = None  # None: decided by `settle` from the batch size (default_lr)
    weight_decay: float = 0.05
    momentum: float = 0.9
    warmup_epochs: float = 0.0
    label_smoothing: float = 0.1
    augment: bool = True
    crop_scale: float = 0.35
    swap_prob: float = 1.0
    swap_same_class_prob: float = 0.0
    mixup_alpha: float = 0.2
    cutmix_alpha: float = 1.0
    swa: bool = False
    swa_start_epoch: int | None = None
    swa_lr: float | None = None
    peft: Adapter | None = None
    peft_modules: list[str] = field(default_factory=list)
    lora_rank: int = 4
    oft_block_size: int = 32
    freeze: Freeze = Freeze.NONE
    device: str | None = None
    precision: Precision | None = None
    channels_last: bool = False
    compile: bool = False  # torch.compile the model (not the loss or the optimiser)
    dist_timeout: float = DEFAULT_TIMEOUT_MINUTES  # minutes, under torchrun
    workers: int = field(default_factory=default_workers)  # DataLoader worker processes
    seed: int = 0
    save_every: int = 100
    resume: bool = False
    eval_data: Path | None = None
    eval_challenge: bool = False
    eval_batch_size: int | None = None
    allow_inexact_device: bool = False  # evaluate past a start-up device check that cannot verify the model
    progress: bool = True

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        for name in ("epochs", "batch_size", "lora_rank", "oft_block_size", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise UserError(f"--eval-batch-size must be at least 1, not {self.eval_batch_size}")
        if self.workers < 0:
            raise UserError(f"--workers must be 0 or more, not {self.workers}")
        for name in ("swap_prob", "swap_same_class_prob", "label_smoothing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"--{name.replace('_', '-')} is a probability in [0, 1], not {getattr(self, name)}")
        if not 0.0 < self.crop_scale <= 1.0:
            raise UserError(f"--crop-scale is the smallest crop's share of the image, in (0, 1], not {self.crop_scale}")
        for name in ("mixup_alpha", "cutmix_alpha"):  # the A of Beta(A, A)
            if not 0 < getattr(self, name) < math.inf:
                raise UserError(f"--{name.replace('_', '-')} is the parameter A of Beta(A, A), which must be positive "
                                f"and finite, not {getattr(self, name)}")
        if Method.ERM in self.methods and len(self.methods) > 1:
            raise UserError(f"--method erm is plain training and combines with nothing; drop erm from "
                            f"{' '.join(m.value for m in self.methods)}")
        if self.peft is not None and not self.peft_modules:
            raise UserError(f"--peft {self.peft.value} needs --peft-modules, the modules to adapt "
                            f"(e.g. 'layer4.*.conv2' for resnet50)")
        if self.peft is None and self.peft_modules:
            raise UserError("--peft-modules applies to --peft lora|oft; add --peft or drop --peft-modules")
        if self.peft is not None and self.freeze is Freeze.BACKBONE:
            raise UserError("--freeze backbone trains the head alone; adapters (--peft) would never train: pick one")
        if self.swa_start_epoch is not None and not 0 <= self.swa_start_epoch < self.epochs:
            raise UserError(f"--swa-start-epoch must be in 0..{self.epochs - 1} (epochs count from 0), "
                            f"not {self.swa_start_epoch}")
        if self.eval_challenge and self.eval_data is None:
            raise UserError("--eval-challenge runs on the test data: add --eval-data DIR")
        self._check_arch()
        self._check_rates()

    def _check_arch(self) -> None:
        """Refuse from its name, before anything is read, a source that is no architecture (CLIP, transformers)."""
        from tools.models.sources import SOURCES  # noqa: PLC0415 (the sources load for a run, not for -h)
        spec = ModelSpec.parse(self.arch) if self.arch is not None else None
        if spec is not None and spec.model is not None and spec.prefix in set(SOURCES) - set(ARCHITECTURES):
            raise UserError(f"train.py cannot fine-tune {spec.model}: it trains the architectures it builds, "
                            f"{architecture_names()}, from their pretrained weights, random ones (--weights none) "
                            f"or a checkpoint of one; evaluate {spec.model} with in9_eval.py and challenge_eval.py")

    def _check_rates(self) -> None:
        for name in ("lr", "swa_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UserError(f"{flag_of(name)} must be a positive number, not {value}")
        for name in ("weight_decay", "warmup_epochs"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"{flag_of(name)} must be 0 or more, not {value}")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise UserError(f"--momentum is the share of the last update kept, in [0, 1), not {self.momentum}")
        if self.warmup_epochs > 0 and self.warmup_epochs >= self.epochs:
            raise UserError(f"--warmup-epochs {self.warmup_epochs:g} is as long as training (--epochs {self.epochs}) "
                            f"or longer: the rate would never reach its peak; warm up for fewer epochs")
        if self.swa and self.warmup_epochs > 0 and self.warmup_epochs > self.swa_start():
            raise UserError(f"--warmup-epochs {self.warmup_epochs:g} outlasts the epochs before --swa averages (from "
                            f"epoch {self.swa_start()}), whose constant rate would cut the warm-up short; warm up for "
                            f"at most {self.swa_start()} epochs or start averaging later (--swa-start-epoch)")

    @property
    def names_checkpoint(self) -> bool:
        """Whether the starting point is read from a file: --checkpoint, or file:PATH in --arch."""
        return self.checkpoint is not None or (self.arch is not None and ModelSpec.parse(self.arch).file is not None)

    @property
    def swap(self) -> bool:
        return Method.BG_SWAP in self.methods

    @property
    def method_name(self) -> str:
        parts = [m.value for m in self.methods]
        if self.swa:
            parts.append("swa")
        if self.peft is not None:
            parts.append(self.peft.value)
        if self.freeze is Freeze.BACKBONE:
            parts.append("linear-probe")
        return "+".join(parts)

    def precision_on(self, device: torch.device) -> Precision:
        """--precision, else bf16 on a CUDA GPU that computes bf16 natively, fp32 elsewhere."""
        if self.precision is not None:
            return self.precision
        if device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= BF16_NATIVE_CAPABILITY:
            return Precision.BF16
        return Precision.FP32

    def settle(self, device: torch.device) -> str:
        """Fill in the batch size and learning rate left to their defaults (the run's record then holds the values
        that ran); a line saying what they are and where they come from."""
        batch_origin = "--batch-size" if self.batch_size is not None else f"the default on {device.type}"
        if self.batch_size is None:
            self.batch_size = default_train_batch_size(device)
        lr_origin = "--lr"
        if self.lr is None:  # the reference rate scaled with the batch, whoever chose the batch
            self.lr = default_lr(self.batch_size)
            lr_origin = f"{REFERENCE_LR:g} x {self.batch_size} / {REFERENCE_BATCH_SIZE}, scaled with the batch"
        return f"global batch {self.batch_size} ({batch_origin}), peak learning rate {self.lr:g} ({lr_origin})"

    def swa_start(self) -> int:
        return self.swa_start_epoch if self.swa_start_epoch is not None else (3 * self.epochs) // 4

    def to_record(self) -> dict:
        """Plain str/int/float/bool/list values only, so a weights-only load reads them."""
        record = {}
        for key, value in asdict(self).items():
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, list):
                value = [v.value if isinstance(v, enum.Enum) else v for v in value]
            record[key] = value
        return record


@dataclass(frozen=True)
class Needs:
    """Settings that act only where `acts(config)` holds, which `condition` names: "without --swa"."""

    settings: tuple[str, ...]
    acts: Callable[[TrainConfig], bool]
    condition: str
    remedy: str  # what to do instead of dropping the flag: "add --swa"


# Every flag of train.py whose setting can go unused; a flag given where it would do nothing is refused, as a
# mistake in the command line (the user meant something that will not happen) rather than ignored.
NEEDS = (
    Needs(("swap_prob", "swap_same_class_prob"), lambda c: c.swap, "without --method bg-swap",
          "add bg-swap to --method"),
    Needs(("swap_same_class_prob",), lambda c: c.swap_prob > 0, "with --swap-prob 0 (no swaps)", "raise --swap-prob"),
    Needs(("mixup_alpha",), lambda c: Method.MIXUP in c.methods, "without mixup in --method", "add mixup to --method"),
    Needs(("cutmix_alpha",), lambda c: Method.CUTMIX in c.methods, "without cutmix in --method",
          "add cutmix to --method"),
    Needs(("swa_start_epoch", "swa_lr"), lambda c: c.swa, "without --swa", "add --swa"),
    Needs(("lora_rank",), lambda c: c.peft is Adapter.LORA, "without --peft lora", "add --peft lora"),
    Needs(("oft_block_size",), lambda c: c.peft is Adapter.OFT, "without --peft oft", "add --peft oft"),
    Needs(("momentum",), lambda c: c.optimizer is Optimizer.SGD,
          "without --optimizer sgd (AdamW keeps its own moment estimates)", "add --optimizer sgd"),
    Needs(("crop_scale",), lambda c: c.augment, "with --no-augment (no crops)", "drop --no-augment"),
    Needs(("eval_batch_size",), lambda c: c.eval_data is not None, "without --eval-data (no evaluation)",
          "add --eval-data DIR"),
    Needs(("checkpoint_key", "trust_checkpoint"), lambda c: c.names_checkpoint,
          "without a checkpoint to read (--checkpoint, or file:PATH in --arch)", "add --checkpoint PATH"),
)


def refuse_idle_flags(config: TrainConfig, given: set[str]) -> None:
    """A UserError for the first flag in `given` (settings set on the command line) that `config` would not use."""
    for needs in NEEDS:
        for setting in needs.settings:
            if setting in given and not needs.acts(config):
                raise UserError(f"{flag_of(setting)} does nothing {needs.condition}: drop it, or {needs.remedy}")


def _default(setting: str):
    """TrainConfig's default for a setting: the help shows it, the dataclass decides it."""
    found = next(f for f in fields(TrainConfig) if f.name == setting)
    return found.default if found.default is not MISSING else found.default_factory()


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(description=description, epilog=examples(
        "python train.py --data-path data/in9_train --arch resnet18 --epochs 5 --output-dir runs/r18",
        "python train.py --data-path data/in9_train --method bg-swap --peft lora --output-dir runs/lora"))
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", type=Path, required=True, metavar="DIR",
                      help="IN-9-style folder with <variation>/train/<class>/ and fg_mask/train/<class>/ (required)")
    data.add_argument("--train-variation", default=Variation.ORIGINAL.value, choices=VARIATIONS, metavar="NAME",
                      help=f"the variation trained on, one of {', '.join(VARIATIONS)}; mixed_rand reproduces the "
                           f"paper's Mixed-Rand training (default: original)")
    data.add_argument("--eval-data", type=Path, default=None, metavar="DIR",
                      help="test data (the release's bg_challenge/): evaluate all variations before and after, "
                           "and write report.md and report.html (default: no evaluation)")
    data.add_argument("--eval-challenge", action="store_true",
                      help="with --eval-data, also run the Backgrounds Challenge (default: off)")

    model = parser.add_argument_group("model")
    add_model_source_arguments(model, random_init=True)

    method = parser.add_argument_group("method")
    # list flags given twice add up (action "extend"), as their words in one flag do; None: not given
    method.add_argument("--method", nargs="+", action="extend", type=Method, choices=list(Method), default=None,
                        dest="methods", metavar=_choices(Method),
                        help="erm alone, or any of bg-swap, mixup, cutmix together (mixup with cutmix: one of the "
                             "two per batch) (default: erm)")
    # flags that act only with another (NEEDS) default to None, "not given"; TrainConfig holds their defaults
    method.add_argument("--swap-prob", type=number(0, 1), default=None, metavar="P",
                        help=f"bg-swap: share of images whose foreground is pasted on another background "
                             f"(default: {_default('swap_prob')})")
    method.add_argument("--swap-same-class-prob", type=number(0, 1), default=None, metavar="P",
                        help=f"bg-swap: share of swaps whose background comes from the image's own class, as in "
                             f"Mixed-Same; the rest are drawn from all classes as in Mixed-Rand "
                             f"(default: {_default('swap_same_class_prob')})")
    method.add_argument("--mixup-alpha", type=number(0, above=True), default=None, metavar="A",
                        help=f"mixup: Beta(A, A) mixing weights (default: {_default('mixup_alpha')})")
    method.add_argument("--cutmix-alpha", type=number(0, above=True), default=None, metavar="A",
                        help=f"cutmix: Beta(A, A) box areas (default: {_default('cutmix_alpha')})")
    method.add_argument("--swa", action="store_true",
                        help="stochastic weight averaging of the epochs from --swa-start-epoch on (default: off)")
    method.add_argument("--swa-start-epoch", type=whole_number(0), default=None, metavar="E",
                        help="first epoch (from 0) averaged by --swa (default: three quarters of --epochs)")
    method.add_argument("--swa-lr", type=number(0, above=True), default=None, metavar="LR",
                        help="constant learning rate during SWA (default: half of --lr)")
    method.add_argument("--peft", type=Adapter, choices=list(Adapter), default=None, metavar=_choices(Adapter),
                        help="train adapters on --peft-modules with the peft package, merged into the checkpoint "
                             "(default: none, train every weight)")
    method.add_argument("--peft-modules", nargs="+", action="extend", default=None, metavar="PATTERN",
                        help="module-name patterns to adapt, such as 'layer4.*.conv2' (default: none)")
    method.add_argument("--lora-rank", type=whole_number(1), default=None, metavar="R",
                        help=f"LoRA rank (default: {_default('lora_rank')})")
    method.add_argument("--oft-block-size", type=whole_number(1), default=None, metavar="B",
                        help=f"OFT block size; must divide each adapted layer's input size "
                             f"(default: {_default('oft_block_size')})")
    method.add_argument("--freeze", type=Freeze, choices=list(Freeze), default=_default("freeze"),
                        metavar=_choices(Freeze), help=f"backbone: train the classification head alone, a linear "
                                                       f"probe (default: {_default('freeze').value})")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=whole_number(1), default=_default("epochs"), metavar="N",
                       help=f"passes over the training set (default: {_default('epochs')})")
    optim.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                       help=f"global batch size, split over torchrun's processes (default: {GPU_TRAIN_BATCH_SIZE} on a "
                            f"CUDA GPU, {REFERENCE_BATCH_SIZE} elsewhere)")
    optim.add_argument("--optimizer", type=Optimizer, choices=list(Optimizer), default=_default("optimizer"),
                       metavar=_choices(Optimizer), help=f"optimiser (default: {_default('optimizer').value})")
    optim.add_argument("--lr", type=number(0, above=True), default=None, metavar="LR",
                       help=f"peak learning rate (default: {REFERENCE_LR:g} x the global batch / "
                            f"{REFERENCE_BATCH_SIZE}, scaled linearly with the batch)")
    optim.add_argument("--weight-decay", type=number(0), default=_default("weight_decay"), metavar="WD",
                       help=f"weight decay (default: {_default('weight_decay'):g})")
    optim.add_argument("--momentum", type=number(0, 1, below=True), default=None, metavar="M",
                       help=f"SGD momentum (default: {_default('momentum')})")
    optim.add_argument("--warmup-epochs", type=number(0, unit="epochs"), default=_default("warmup_epochs"),
                       metavar="E", help=f"linear warm-up before the cosine decay, in epochs (default: "
                                         f"{_default('warmup_epochs'):g})")
    optim.add_argument("--label-smoothing", type=number(0, 1), default=_default("label_smoothing"), metavar="S",
                       help=f"label smoothing of the cross-entropy (default: {_default('label_smoothing'):g})")
    optim.add_argument("--augment", action=BooleanFlag, default=_default("augment"),
                       help="random resized crop and horizontal flip, after the swap (default: on)")
    optim.add_argument("--crop-scale", type=number(0, 1, above=True), default=None, metavar="S",
                       help=f"smallest random crop, as a share of the image's area (default: {_default('crop_scale')})")

    run = parser.add_argument_group("running")
    run.add_argument("--device", default=None, metavar="DEV", help="cuda, cuda:N, mps or cpu (default: the best "
                                                                   "available; torchrun: the local rank's GPU)")
    run.add_argument("--precision", type=Precision, choices=[Precision.FP32, Precision.BF16], default=None,
                     metavar="{fp32,bf16}",
                     help="bf16 autocast or exact fp32 (default: bf16 on CUDA GPUs of compute capability 8.0 or more, "
                          "else fp32)")
    run.add_argument("--channels-last", action="store_true", help="channels-last memory format (default: off)")
    run.add_argument("--compile", action="store_true",
                     help="torch.compile the model's forward and backward (one static batch shape; the loss and "
                          "the optimiser step stay eager); not bit-equal to eager, so a resume keeps the setting "
                          "(default: off)")
    run.add_argument("--workers", type=whole_number(0, MAX_WORKERS), default=_default("workers"), metavar="N",
                     help=f"DataLoader worker processes per training process (0: the main process) and decoding "
                          f"threads for the decoded store (default: {_default('workers')})")
    run.add_argument("--seed", type=seed_number, default=_default("seed"), metavar="N",
                     help=f"seed of every random choice: order, crops, swaps, mixing, initialisation (default: "
                          f"{_default('seed')})")
    run.add_argument("--eval-batch-size", type=whole_number(1), default=None, metavar="N",
                     help=f"batch size of the final evaluation (default: {BATCH_SIZE_DEFAULTS})")
    run.add_argument(ALLOW_FLAG, action="store_true",
                     help="with --eval-data, evaluate even when the start-up device check (as in9_eval.py's) cannot "
                          "verify the model's fp32 arithmetic on the device; the evaluation's results then say "
                          "exact: false (default: such an evaluation is refused)")
    add_dist_timeout_argument(run)

    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("train_runs"), metavar="DIR",
                     help="checkpoint.pt, the resume state, train_log.jsonl and the report go here "
                          "(default: train_runs)")
    out.add_argument("--save-every", type=whole_number(1), default=_default("save_every"), metavar="STEPS",
                     help=f"steps between saves of the resume state; epochs' ends are always saved (default: "
                          f"{_default('save_every')})")
    out.add_argument("--resume", action="store_true",
                     help="continue from the resume state in --output-dir (default: start afresh)")
    out.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    add_log_level_argument(out)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe (a flag left out takes the dataclass's default; an idle one is refused)."""
    names = {f.name for f in fields(TrainConfig)}
    settings = {name: value for name, value in vars(args).items() if name in names}
    settings.update(methods=list(dict.fromkeys(args.methods)) if args.methods is not None else None,
                    peft_modules=list(args.peft_modules) if args.peft_modules is not None else None,
                    progress=not args.no_progress)
    config = TrainConfig(**{name: value for name, value in settings.items() if value is not None})
    # given: a value flag's value (None when left out), a switch's True (False when left out)
    refuse_idle_flags(config, {name for name, value in settings.items() if value is not None and value is not False})
    return config
