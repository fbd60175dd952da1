"""The command-line surface both scripts share: flags, logging, and turning user errors into one line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable

from tools.errors import UserError
from tools.in9 import Normalization
from tools.models import LoadedModel, load_model
from tools.runtime import Precision, Runtime, default_workers, resolve_device, seed_everything

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Data, model, device and output flags, the same names in both scripts."""
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", type=Path, required=True, metavar="DIR",
                      help="folder holding original/, only_fg/, ..., fg_mask/ (the release's bg_challenge/)")

    model = parser.add_argument_group("model")
    add_model_source_arguments(model)
    model.add_argument("--in9", action="store_true", default=None,
                       help="a 9-class model trained on IN-9 (default: inferred from the checkpoint)")
    model.add_argument("--normalize", type=Normalization, choices=list(Normalization), default=Normalization.AUTO,
                       metavar="{" + ",".join(n.value for n in Normalization) + "}",
                       help="normalisation inside the model: auto uses the checkpoint's normaliser buffers, else "
                            "ImageNet statistics for 1000 classes and IN-9 statistics for 9 (default: auto)")

    run = parser.add_argument_group("running")
    run.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="images per forward pass (default: 256 on a GPU, 16 on the CPU, where smaller batches stay in cache; halved on out-of-memory)")
    run.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                     help=f"image-decoding threads (default: {default_workers()})")
    run.add_argument("--device", default=None, metavar="DEV",
                     help="cuda, cuda:N, mps or cpu (default: the best available)")
    run.add_argument("--precision", type=Precision, choices=list(Precision), default=Precision.FP32,
                     metavar="{" + ",".join(p.value for p in Precision) + "}",
                     help="fp32 is exact; tf32, bf16 and fp16 are faster and may change near-tie predictions "
                          "(default: fp32)")
    run.add_argument("--channels-last", action="store_true", help="channels-last memory format (default: off)")
    run.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")

    out = parser.add_argument_group("output")
    out.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                     help="write the results and their provenance as JSON (default: none)")
    out.add_argument("--output-dir", type=Path, default=Path("bg_results"), metavar="DIR",
                     help="where progress state (for --resume) and larger outputs go (default: bg_results)")
    out.add_argument("--resume", action="store_true",
                     help="continue an interrupted run from the state in --output-dir (default: start afresh)")
    out.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    add_log_level_argument(out)


def add_model_source_arguments(group, random_init: bool = False) -> None:
    """Where the model comes from: --arch, --weights, --checkpoint, --checkpoint-key, --trust-checkpoint.

    random_init: --weights also takes `none` (train.py's random initialisation)."""
    group.add_argument("--arch", default=None, metavar="NAME",
                       help="torchvision classification builder name, timm:NAME with timm installed, or "
                            "toolkit:small_cnn (default: the architecture a trained checkpoint names, else resnet50)")
    none = ", or none for random initialisation" if random_init else ""
    group.add_argument("--weights", default=None, metavar="NAME",
                       help=f"torchvision weights name such as IMAGENET1K_V2{none} (default: IMAGENET1K_V1, the "
                            f"weights the published numbers used, where the architecture has them; else DEFAULT)")
    group.add_argument("--checkpoint", type=Path, default=None, metavar="PATH",
                       help="state dict, trained checkpoint, robustness-library checkpoint, TorchScript or "
                            "torch.export file (default: none, use pretrained --weights)")
    group.add_argument("--checkpoint-key", default=None, metavar="KEY",
                       help="key holding the state dict (default: the first of model, state_dict, state_dict_ema)")
    group.add_argument("--trust-checkpoint", action="store_true",
                       help="allow full unpickling of a checkpoint you trust (default: off, weights_only loading)")


def add_log_level_argument(parser) -> None:
    """The --log-level flag every command line of the toolkit takes."""
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging detail (default: INFO)")


def runtime_from_args(args: argparse.Namespace, compile: bool = False) -> Runtime:
    seed_everything(args.seed)
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, not {args.batch_size}")
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    return Runtime(resolve_device(args.device), args.precision, args.channels_last, compile)


def model_from_args(args: argparse.Namespace) -> LoadedModel:
    loaded = load_model(args.arch, args.weights, args.checkpoint, args.in9, args.normalize, args.trust_checkpoint,
                        args.checkpoint_key)
    log.info("model: %s, %d classes, normalisation %s", loaded.checkpoint_format, loaded.num_classes,
             loaded.normalization)
    return loaded


def run_main(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], int | None],
             argv: list[str] | None = None, on_interrupt: str | None = None) -> int:
    """Parse, set up logging once, run; a user error is one line on stderr and exit code 2.

    `on_interrupt` says what to do after Ctrl-C (default: resume from --output-dir where there is one).
    """
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, getattr(args, "log_level", "INFO")),
                        format="%(levelname)s: %(message)s", stream=sys.stderr, force=True)
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415
        with logging_redirect_tqdm():
            return int(main(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if on_interrupt is None:
            on_interrupt = (f"progress so far is saved under {args.output_dir}; rerun with --resume to continue"
                            if getattr(args, "output_dir", None) is not None else "rerun the same command")
        print(f"interrupted: {on_interrupt}", file=sys.stderr)
        return EXIT_INTERRUPTED
