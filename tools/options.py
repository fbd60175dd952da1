"""The flags both evaluation scripts share (data, model, device, output), and the commands' first steps from
them: every cheap input is checked before any model is built."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from tools import distributed
from tools.cli import (
    MAX_SEED,
    ArgumentParser,
    BooleanFlag,
    add_log_level_argument,
    positive_number,
    seed_number,
    whole_number,
    worker_count,
)
from tools.data.layout import DATA_ENV, DEFAULT_DATA_ROOT, check_data_root
from tools.data.store import DecodedCache, default_cache_dir
from tools.errors import UserError
from tools.in9 import Normalization
from tools.models.architectures import DEFAULT_ARCH, SMALL_CNN, architecture_family
from tools.models.boundary import LoadedModel
from tools.models.checkpoints import STATE_DICT_KEYS
from tools.models.device_check import ALLOW_FLAG, CHECK_IMAGES, TOLERANCE
from tools.models.programs import program_kind
from tools.models.sources import load_model
from tools.models.spec import ModelSpec
from tools.provenance import check_outputs
from tools.runtime import CPU_BATCH_SIZE, GPU_BATCH_SIZE, Precision, Runtime, resolve_device, seed_everything
from tools.shards import shard_spec
from tools.threads import default_workers, import_in_background, wait_for_background_imports

log = logging.getLogger(__name__)

# --batch-size's help in each command's words: the CPU default differs between an IN-9 run and the challenge
_BATCH_KEY = (f"(default: {GPU_BATCH_SIZE} on a GPU, {CPU_BATCH_SIZE} on the CPU); part of a saved state's key: "
              f"results may differ in the last bits at another batch size")
BATCH_HELP = {
    "in9": f"images per forward pass, halved on out-of-memory {_BATCH_KEY}",
    "challenge": f"composite images per forward pass, halved on out-of-memory {_BATCH_KEY}",
    "zoo": f"images per forward pass of the IN-9 runs and of the challenge's composites, halved on out-of-memory "
           f"{_BATCH_KEY} and of each model's identity",
}


def _group(parser: argparse.ArgumentParser, title: str, advanced: bool = False):
    """A named group, shown after the basic ones where `advanced` (by tools.cli.ArgumentParser)."""
    if advanced and isinstance(parser, ArgumentParser):
        return parser.add_argument_group(title, advanced=True)
    return parser.add_argument_group(title)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Data, model, device and output flags, the same names in both scripts (and the zoo)."""
    add_data_arguments(parser)
    add_model_arguments(parser)
    add_running_arguments(parser, device_check=True)
    add_output_arguments(parser)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", type=Path, default=None, metavar="DIR",
                      help=f"folder holding original/, only_fg/, ..., fg_mask/ (the release's bg_challenge/) "
                           f"(default: ${DATA_ENV} if set, else {DEFAULT_DATA_ROOT})")


def add_cache_arguments(group) -> None:
    """--cache-dir, --shared-cache and --no-cache: the decoded-data cache every command shares (tools.data.store)."""
    group.add_argument("--cache-dir", type=Path, default=default_cache_dir(), metavar="DIR",
                       help=f"decoded-data cache, keyed by the files' content (default: {default_cache_dir()})")
    group.add_argument("--shared-cache", action="store_true",
                       help="--cache-dir is shared with other users: use the packs any user wrote there (each still "
                            "checked against its digests and its files), recorded in the provenance; without it only "
                            "packs this user wrote, in a folder only this user can write, are used (default: off)")
    group.add_argument("--no-cache", action="store_true",
                       help="neither read nor write the decoded-data cache (default: off)")


def cache_from_args(args: argparse.Namespace) -> DecodedCache | None:
    return None if args.no_cache else DecodedCache(args.cache_dir, args.shared_cache)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    add_model_source_arguments(model)
    special = _group(parser, "model: LoRA state dicts and remote code", advanced=True)
    add_remote_code_argument(special)
    model.add_argument("--in9", action=BooleanFlag, default=None,
                       help="a 9-class model trained on IN-9 (--in9) or a 1000-class ImageNet model (--no-in9), "
                            "checked against the checkpoint (default: inferred from the checkpoint's class count)")
    special.add_argument("--lora-alpha", type=positive_number("alpha"), default=None, metavar="ALPHA",
                       help="the lora_alpha a LoRA state dict saved from a peft-wrapped model "
                            "(torch.save(model.state_dict())) was trained with, which the file does not hold; its "
                            "rank is read from the tensors; rsLoRA needs --lora-rslora too, and an alpha_pattern a "
                            "folder saved with save_pretrained (default: none; an adapter folder's config holds it)")
    special.add_argument("--lora-rslora", action=BooleanFlag, default=False,
                       help="such a LoRA state dict was trained with rsLoRA (use_rslora=True: scaled by "
                            "lora_alpha/sqrt(rank), not lora_alpha/rank), which the file does not say (default: off)")
    model.add_argument("--normalize", type=Normalization, choices=list(Normalization), default=Normalization.AUTO,
                       metavar="{" + ",".join(n.value for n in Normalization) + "}",
                       help="normalisation inside the model: auto uses the checkpoint's normaliser buffers, else "
                            "ImageNet statistics for 1000 classes and IN-9 statistics for 9 (default: auto)")


def add_model_source_arguments(group, random_init: bool = False) -> None:
    """Where the model comes from (the evaluation scripts and train.py); `random_init`: --weights takes `none`."""
    group.add_argument("--arch", default=None, metavar="NAME",
                       help=f"torchvision classification builder name, timm:NAME[.TAG] with timm installed, "
                            f"clip:ARCH/PRETRAINED (CLIP zero-shot) with open_clip_torch installed, or "
                            f"{SMALL_CNN}; file:PATH or ARCH@file:PATH name a checkpoint as --checkpoint does; a "
                            f"TorchScript, export or trained checkpoint carries its own (default: {DEFAULT_ARCH})")
    none = ", or none for random initialisation" if random_init else ""
    group.add_argument("--weights", default=None, metavar="NAME",
                       help=f"torchvision weights name such as IMAGENET1K_V2{none} (default: IMAGENET1K_V1, the "
                            f"weights the published numbers used, where the architecture has them; else DEFAULT)")
    group.add_argument("--checkpoint", type=Path, default=None, metavar="PATH",
                       help="state dict, trained checkpoint (train.py), robustness-library checkpoint, torch.export "
                            "file, TorchScript file (with --trust-checkpoint), or a peft adapter folder "
                            "(save_pretrained) that goes on --arch (default: none, use pretrained --weights)")
    group.add_argument("--checkpoint-key", default=None, metavar="KEY",
                       help=f"key holding the state dict (default: the first of {', '.join(STATE_DICT_KEYS)})")
    add_trust_argument(group)


def add_trust_argument(group) -> None:
    group.add_argument("--trust-checkpoint", action="store_true",
                       help="load a checkpoint you trust even where that runs code of its own: full unpickling, a "
                            "TorchScript program, a torch.export program holding more than tensors and tensor "
                            "operations (default: off: weights_only unpickling, export programs that are data)")


def add_remote_code_argument(group) -> None:
    group.add_argument("--trust-remote-code", action="store_true",
                       help="run the code an hf: model or its image processor ships (transformers' "
                            "trust_remote_code), for a model whose code you trust (default: off, such a model is "
                            "refused)")


def add_dist_timeout_argument(group) -> None:
    group.add_argument("--dist-timeout", type=positive_number("minutes"), default=distributed.DEFAULT_TIMEOUT_MINUTES,
                       metavar="MINUTES",
                       help=f"under torchrun, how long a process waits for the others in an exchange before the run "
                            f"is aborted (torch's NCCL default of 10 minutes is too short where one process works or "
                            f"writes alone) (default: {distributed.DEFAULT_TIMEOUT_MINUTES:g})")


def add_running_arguments(parser: argparse.ArgumentParser, shard: bool = True, device_check: bool = False) -> None:
    """Device, precision, batch and threads; `--shard` and `--allow-inexact-device` where they apply."""
    run = parser.add_argument_group("running")
    run.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N", help=BATCH_HELP["in9"])
    run.add_argument("--workers", type=worker_count, default=default_workers(), metavar="N",
                     help=f"image-decoding threads (default: {default_workers()})")
    run.add_argument("--device", default=None, metavar="DEV",
                     help="cuda, cuda:N, mps or cpu; under torchrun, each process takes the GPU of its LOCAL_RANK "
                          "(default: the best available)")
    run.add_argument("--precision", type=Precision, choices=list(Precision), default=Precision.FP32,
                     metavar="{" + ",".join(p.value for p in Precision) + "}",
                     help="fp32 is exact; tf32, bf16 and fp16 are faster and may change near-tie predictions "
                          "(default: fp32)")
    run.add_argument("--channels-last", action="store_true", help="channels-last memory format (default: off)")
    run.add_argument("--seed", type=seed_number, default=0, metavar="N",
                     help=f"random seed, from 0 to {MAX_SEED} (default: 0)")
    run.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    if device_check:
        run.add_argument(ALLOW_FLAG, action="store_true",
                         help=f"run on even when the start-up check cannot verify the model: its fp32 logits on the "
                              f"device (on its first {CHECK_IMAGES} images) further from a float64 reference on the "
                              f"CPU than fp32 rounding allows (relative {TOLERANCE:g}), no float64 reference possible "
                              f"(an fp8 matmul, a kernel of one device), or logits that depend on the other images "
                              f"of the batch or on chance (a program traced in training mode); the run is then "
                              f"recorded as unverified, exact: false (default: such a run is refused)")
    several = _group(parser, "several processes (torchrun, shards)", advanced=True)
    add_dist_timeout_argument(several)
    if not shard:
        return
    several.add_argument("--shard", type=shard_spec, default=None, metavar="I/N",
                     help="do share I of N (0-based) of the run, with no process group (a SLURM array, separate "
                          "machines), and write shard results under --output-dir for `python -m tools.merge`; "
                          "not under torchrun, which shares the work itself (default: the whole run)")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument("--results-file", type=Path, default=None, metavar="PATH",
                     help="write the results and their provenance as JSON (default: none)")
    out.add_argument("--output-dir", type=Path, default=Path("bg_results"), metavar="DIR",
                     help="where progress state (for --resume) and larger outputs go (default: bg_results)")
    out.add_argument("--resume", action="store_true",
                     help="continue an interrupted run from the state in --output-dir (default: start afresh)")
    add_log_level_argument(out)


OUTPUT_FILE_ARGUMENTS = ("results_file", "report", "html", "per_foreground_csv")  # those a script has


def check_output_arguments(args: argparse.Namespace) -> None:
    """Every output path of an evaluation script, checked before any data is read or model built."""
    check_outputs(files={f"--{name.replace('_', '-')}": getattr(args, name) for name in OUTPUT_FILE_ARGUMENTS
                         if hasattr(args, name)},
                  folders={"--output-dir": args.output_dir})


@dataclass(frozen=True)
class CheckedArguments:
    """What the shared flags' defaults resolve to: the data folder, checked, and whether this process shows
    progress bars (under torchrun only rank 0 does)."""

    data_path: Path
    progress: bool


def check_arguments(args: argparse.Namespace) -> CheckedArguments:
    """Check the cheap inputs before any device or model; the arguments are left as parsed."""
    data_path = check_data_root(args.data_path)
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, not {args.batch_size}")
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    group = distributed.from_environment()
    if group.distributed and getattr(args, "shard", None) is not None:
        raise UserError("--shard splits a run between separate launches; under torchrun the processes share the "
                        "work already: drop --shard")
    return CheckedArguments(data_path, progress=not args.no_progress and group.is_main)


def start(args: argparse.Namespace, compile: bool = False) -> tuple[CheckedArguments, Runtime]:  # noqa: A002
    """What every evaluation command does first: outputs and cheap inputs checked, the `Runtime` made, the model's
    libraries imported in the background."""
    check_output_arguments(args)
    checked = check_arguments(args)
    runtime = runtime_from_args(args, compile)
    preload_model_libraries(args.arch, args.checkpoint)
    return checked, runtime


def runtime_from_args(args: argparse.Namespace, compile: bool = False) -> Runtime:  # noqa: A002 (torch's word)
    """Seed, resolve the device and, under torchrun, join the process group."""
    seed_everything(args.seed)
    group = distributed.from_environment()
    device = resolve_device(args.device)
    if group.distributed:
        device = group.device(device)
        distributed.setup(device, args.dist_timeout)
        if not group.is_main:  # only rank 0 prints and writes; the others say only what goes wrong
            logging.getLogger().setLevel(logging.ERROR)
        log.info("%d processes share the work (this is rank %d, on %s)", group.world_size, group.rank, device)
    runtime = Runtime(device, args.precision, args.channels_last, compile, group)
    runtime.batch_size(args.batch_size)  # a batch the device cannot hold is refused before any model is built
    return runtime


def preload_model_libraries(arch: str | None, checkpoint: Path | None) -> None:
    """Import the model's libraries (seconds: torchvision.ops pulls in torch._dynamo) in a background thread while
    the data is checked; none for a TorchScript or export file. A bad model name fails here, before decoding."""
    spec = ModelSpec.parse(arch or DEFAULT_ARCH)
    checkpoint = spec.path or checkpoint
    if checkpoint is not None and Path(checkpoint).is_file() and program_kind(Path(checkpoint)) is not None:
        return
    names = ["torchvision"]
    if spec.model is not None:
        try:
            names += [name for name in architecture_family(spec).libraries if name not in names]
        except UserError:  # not an architecture: its source says so where the model is loaded
            pass
    import_in_background(names)  # model building waits for it (tools.threads.wait_for_background_imports)


def model_from_args(args: argparse.Namespace, runtime: Runtime, progress: bool) -> LoadedModel:
    wait_for_background_imports()  # never import a model library while the preload thread imports one
    loaded = load_model(args.arch, args.weights, args.checkpoint, args.in9, args.normalize, args.trust_checkpoint,
                        args.checkpoint_key, runtime, progress, args.lora_alpha, args.lora_rslora,
                        trust_remote_code=args.trust_remote_code, cache=cache_from_args(args))
    log.info("model: %s, %d classes, normalisation %s", loaded.checkpoint_format, loaded.num_classes,
             loaded.normalization)
    return loaded

