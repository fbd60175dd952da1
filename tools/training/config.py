"""train.py's vocabulary and flags: methods, adapters, freezing, and the checked `TrainConfig` they become."""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tools.cli import ArgumentParser, examples, BooleanFlag, add_log_level_argument
from tools.distributed import DEFAULT_TIMEOUT_MINUTES
from tools.options import add_dist_timeout_argument, add_model_source_arguments
from tools.errors import UserError
from tools.in9 import VARIATIONS, Variation
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
        if self.lr is not None and self.lr <= 0:
            raise UserError(f"--lr must be positive, not {self.lr}")
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
        """--precision, else the default on `device`: bf16 autocast on a CUDA GPU that computes bf16 natively,
        fp32 elsewhere."""
        if self.precision is not None:
            return self.precision
        if device.type == "cuda" and tuple(torch.cuda.get_device_capability(device)) >= BF16_NATIVE_CAPABILITY:
            return Precision.BF16
        return Precision.FP32

    def settle(self, device: torch.device) -> None:
        """Fill in the batch size and learning rate left to their defaults, once the device is known; the run's
        record (checkpoint, resume key) then holds the values that ran."""
        chosen = self.batch_size is None  # the toolkit picks the batch: the rate follows it
        if chosen:
            self.batch_size = default_train_batch_size(device)
        if self.lr is None:  # a batch the user gave keeps the reference rate, as before the GPU default existed
            self.lr = default_lr(self.batch_size) if chosen else REFERENCE_LR

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
    method.add_argument("--method", nargs="+", type=Method, choices=list(Method), default=[Method.ERM],
                        dest="methods", metavar=_choices(Method),
                        help="erm alone, or any of bg-swap, mixup, cutmix together (mixup with cutmix: one of the "
                             "two per batch) (default: erm)")
    method.add_argument("--swap-prob", type=float, default=1.0, metavar="P",
                        help="bg-swap: share of images whose foreground is pasted on another background (default: 1.0)")
    method.add_argument("--swap-same-class-prob", type=float, default=0.0, metavar="P",
                        help="bg-swap: share of swaps whose background comes from the image's own class, as in "
                             "Mixed-Same; the rest are drawn from all classes as in Mixed-Rand (default: 0.0)")
    method.add_argument("--mixup-alpha", type=float, default=0.2, metavar="A",
                        help="mixup: Beta(A, A) mixing weights (default: 0.2)")
    method.add_argument("--cutmix-alpha", type=float, default=1.0, metavar="A",
                        help="cutmix: Beta(A, A) box areas (default: 1.0)")
    method.add_argument("--swa", action="store_true",
                        help="stochastic weight averaging of the epochs from --swa-start-epoch on (default: off)")
    method.add_argument("--swa-start-epoch", type=int, default=None, metavar="E",
                        help="first epoch (from 0) averaged by --swa (default: three quarters of --epochs)")
    method.add_argument("--swa-lr", type=float, default=None, metavar="LR",
                        help="constant learning rate during SWA (default: half of --lr)")
    method.add_argument("--peft", type=Adapter, choices=list(Adapter), default=None, metavar=_choices(Adapter),
                        help="train adapters on --peft-modules with the peft package, merged into the checkpoint "
                             "(default: none, train every weight)")
    method.add_argument("--peft-modules", nargs="+", default=[], metavar="PATTERN",
                        help="module-name patterns to adapt, such as 'layer4.*.conv2' (default: none)")
    method.add_argument("--lora-rank", type=int, default=4, metavar="R", help="LoRA rank (default: 4)")
    method.add_argument("--oft-block-size", type=int, default=32, metavar="B",
                        help="OFT block size; must divide each adapted layer's input size (default: 32)")
    method.add_argument("--freeze", type=Freeze, choices=list(Freeze), default=Freeze.NONE, metavar=_choices(Freeze),
                        help="backbone: train the classification head alone, a linear probe (default: none)")

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=int, default=1, metavar="N", help="passes over the training set (default: 1)")
    optim.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help=f"global batch size, split over torchrun's processes (default: {GPU_TRAIN_BATCH_SIZE} on a "
                            f"CUDA GPU, {REFERENCE_BATCH_SIZE} elsewhere)")
    optim.add_argument("--optimizer", type=Optimizer, choices=list(Optimizer), default=Optimizer.ADAMW,
                       metavar=_choices(Optimizer), help="optimiser (default: adamw)")
    optim.add_argument("--lr", type=float, default=None, metavar="LR",
                       help=f"peak learning rate (default: {REFERENCE_LR:g}; with --batch-size left to its default, "
                            f"{REFERENCE_LR:g} x that batch / {REFERENCE_BATCH_SIZE}, scaled linearly)")
    optim.add_argument("--weight-decay", type=float, default=0.05, metavar="WD", help="weight decay (default: 0.05)")
    optim.add_argument("--momentum", type=float, default=0.9, metavar="M", help="SGD momentum (default: 0.9)")
    optim.add_argument("--warmup-epochs", type=float, default=0.0, metavar="E",
                       help="linear warm-up before the cosine decay, in epochs (default: 0)")
    optim.add_argument("--label-smoothing", type=float, default=0.1, metavar="S",
                       help="label smoothing of the cross-entropy (default: 0.1)")
    optim.add_argument("--augment", action=BooleanFlag, default=True,
                       help="random resized crop and horizontal flip, after the swap (default: on)")
    optim.add_argument("--crop-scale", type=float, default=0.35, metavar="S",
                       help="smallest random crop, as a share of the image's area (default: 0.35)")

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
    run.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                     help=f"DataLoader worker processes per training process (0: the main process) and decoding threads "
                          f"for the decoded store "
                          f"(default: {default_workers()})")
    run.add_argument("--seed", type=int, default=0, metavar="N",
                     help="seed of every random choice: order, crops, swaps, mixing, initialisation (default: 0)")
    run.add_argument("--eval-batch-size", type=int, default=None, metavar="N",
                     help=f"batch size of the final evaluation (default: {BATCH_SIZE_DEFAULTS})")
    add_dist_timeout_argument(run)

    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("train_runs"), metavar="DIR",
                     help="checkpoint.pt, the resume state, train_log.jsonl and the report go here "
                          "(default: train_runs)")
    out.add_argument("--save-every", type=int, default=100, metavar="STEPS",
                     help="steps between saves of the resume state; epochs' ends are always saved (default: 100)")
    out.add_argument("--resume", action="store_true",
                     help="continue from the resume state in --output-dir (default: start afresh)")
    out.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    add_log_level_argument(out)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data_path=args.data_path, output_dir=args.output_dir, methods=list(dict.fromkeys(args.methods)),
        train_variation=args.train_variation, arch=args.arch, weights=args.weights, checkpoint=args.checkpoint,
        checkpoint_key=args.checkpoint_key, trust_checkpoint=args.trust_checkpoint, epochs=args.epochs,
        batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        momentum=args.momentum, warmup_epochs=args.warmup_epochs, label_smoothing=args.label_smoothing,
        augment=args.augment, crop_scale=args.crop_scale, swap_prob=args.swap_prob,
        swap_same_class_prob=args.swap_same_class_prob, mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha,
        swa=args.swa, swa_start_epoch=args.swa_start_epoch, swa_lr=args.swa_lr, peft=args.peft,
        peft_modules=list(args.peft_modules), lora_rank=args.lora_rank, oft_block_size=args.oft_block_size,
        freeze=args.freeze, device=args.device, precision=args.precision, channels_last=args.channels_last,
        compile=args.compile,
        dist_timeout=args.dist_timeout, workers=args.workers, seed=args.seed, save_every=args.save_every,
        resume=args.resume,
        eval_data=args.eval_data, eval_challenge=args.eval_challenge, eval_batch_size=args.eval_batch_size,
        progress=not args.no_progress)
