"""The Python API: `benchmark(model, ...)`, both evaluations of the scripts in one call, returning a typed
`BenchmarkResult`. It runs what the scripts run, so its numbers and files are theirs, and leaves no state behind
(docs/python-api.md, "Nothing left behind", "Under torchrun")."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import nn

from tools import distributed
from tools.challenge import ChallengeConfig
from tools.cli import MAX_SEED, MAX_WORKERS
from tools.data import cache_admin
from tools.data.compositing import MaskArithmetic
from tools.data.layout import check_data_root
from tools.data.store import DecodedCache, default_cache_dir
from tools.errors import UserError, Word, first_line, spoken_as
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES, SUPPORTED_CLASS_COUNTS, VARIATIONS, Normalization
from tools.in9.evaluate import In9Config, bg_gap
from tools.models.adapters import LoraScaling
from tools.models.boundary import LoadedModel, ModelOrigin, state_sha256, wrap
from tools.models.checkpoints import check_class_count
from tools.models.programs import ExportedModule, check_any_batch, exported_module, graph_devices
from tools.models.record import ModelRecord
from tools.models.sources import load_model
from tools.prepared_run import Request, list_data, prepare
from tools.provenance import check_outputs
from tools.results.publish import publish_challenge, publish_in9
from tools.runtime import Precision, Runtime, math_flags_kept, resolve_device, seed_everything
from tools.threads import default_workers

log = logging.getLogger(__name__)

AUTO = "auto"  # mean/std: the class-count rule (ImageNet statistics for 1000 classes, IN-9's for 9)
IN9_RESULTS_FILE, CHALLENGE_RESULTS_FILE = "in9.json", "challenge.json"  # under output_dir
MODULE_FORMAT, EXPORT_FORMAT = "nn.Module (Python API)", "torch.export program (Python API)"
LORA_KEYWORDS = ("lora_alpha=ALPHA", "lora_rslora=True")  # how benchmark() takes a LoRA state dict's scaling


def _normalisation(value) -> str:
    if value is None:
        return "mean"
    if value == Normalization.NONE.value:
        return "mean=None"
    return f"the module itself as model with {value}'s statistics as mean= and std="


# How benchmark() takes what each flag of the scripts says, for every message a call passes on (tools.errors.option):
# an argument (written name=value with a value), a setting, or a function of the flag's value (None: no value).
API_WORDS: Mapping[str, Word] = MappingProxyType({
    "--data-path": "data_path", "--output-dir": "output_dir", "--resume": "resume=True",
    "--arch": "model", "--checkpoint": lambda path: f"model='ARCH@file:{path or 'PATH'}'", "--weights": "weights",
    "--in9": "num_classes=9", "--no-in9": "num_classes=1000", "--normalize": _normalisation,
    "--trust-checkpoint": "trust_checkpoint=True", "--checkpoint-key": "checkpoint_key",
    "--trust-remote-code": "trust_remote_code=True", "--lora-alpha": "lora_alpha", "--lora-rslora": "lora_rslora=True",
    "--device": "device", "--precision": "precision", "--batch-size": "batch_size", "--workers": "workers",
    "--seed": "seed", "--cache-dir": "cache_dir", "--no-cache": "cache=False", "--shared-cache": "shared_cache=True",
    "--eval-dataset": "variations",
    "--full": "full=True", "--mask-arithmetic": "mask_arithmetic",
    "--allow-inexact-device": "allow_inexact_device=True",
})


@dataclass(frozen=True)
class BenchmarkResult:
    """What `benchmark` measured (percent; the BG-gap in points), the results files' contents and the paths
    written."""

    accuracy: Mapping[str, float]  # per variation
    bg_gap: float | None  # accuracy(mixed_same) - accuracy(mixed_rand); None unless both were evaluated
    challenge_accuracy: float | None  # None without the challenge
    vulnerable: int | None  # foregrounds some background makes the model misclassify
    foregrounds: int | None
    in9: Mapping = field(repr=False)
    challenge: Mapping | None = field(repr=False)
    files: Mapping[str, Path] = field(default_factory=dict)  # what was written: in9, challenge, state, matrix files


def _in_api_words(function):
    """`function` with the messages it causes naming its arguments (API_WORDS), not the scripts' flags."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with spoken_as(API_WORDS):
            return function(*args, **kwargs)
    return call


@_in_api_words
def benchmark(model: nn.Module | str, data_path: Path | str | None = None, *,
              mean: Sequence[float] | str | None = AUTO, std: Sequence[float] | None = None,
              num_classes: int | None = None, challenge: bool = True, full: bool = False,
              variations: Sequence[str] = VARIATIONS, device: str | torch.device | None = None,
              precision: Precision | str = Precision.FP32, channels_last: bool = False, batch_size: int | None = None,
              workers: int | None = None,
              output_dir: Path | str | None = None, resume: bool = False, cache_dir: Path | str | None = None,
              cache: bool = True, shared_cache: bool = False, weights: str | None = None,
              trust_checkpoint: bool = False, seed: int = 0,
              progress: bool = True, lora_alpha: float | None = None, lora_rslora: bool = False,
              allow_inexact_device: bool = False, checkpoint_key: str | None = None, trust_remote_code: bool = False,
              mask_arithmetic: MaskArithmetic | str = MaskArithmetic.BINARY) -> BenchmarkResult:
    """Evaluate `model` on the IN-9 variations and, with `challenge`, the Backgrounds Challenge.

    model: an `nn.Module` taking a normalised (N, 3, 224, 224) float batch, wrapped to normalise with `mean`
    and `std` (default: the class-count rule; `mean=None` for a module that normalises itself); or a model
    name as `--arch` takes it (`resnet50`, `timm:NAME`, `clip:ARCH/TAG`, `file:PATH`, `ARCH@file:PATH`), with
    its source's normalisation (`mean=None`: none) and `weights` as `--weights`.
    data_path: the release's folder (default: as the scripts, $BG_CHALLENGE_DATA, else data/bg_challenge).
    num_classes: 1000 (ImageNet, mapped to IN-9) or 9 (IN-9); checked against the model's output (default:
    the output's width). full: every pair of the challenge (the prediction matrix), as --full.
    output_dir: where the results files (in9.json, challenge.json), the resumable state and --full's matrix
    go, as the scripts write them (default: nothing is written). device, precision, channels_last, batch_size,
    workers, cache_dir/cache/shared_cache, seed, progress, lora_alpha, lora_rslora, allow_inexact_device,
    checkpoint_key, trust_remote_code, mask_arithmetic: as the scripts' flags (lora_alpha and lora_rslora: the
    scaling of a LoRA state dict saved from a peft-wrapped model, named by `model`). The start-up device check
    runs too, and both results record it. Errors (`UserError`) and log lines name these arguments, not flags.
    """
    precision = _precision(precision)
    arithmetic = _choice(MaskArithmetic, mask_arithmetic, "mask_arithmetic")
    group = distributed.joined_group()
    data_path = check_data_root(Path(data_path) if data_path is not None else None)
    output_dir = Path(output_dir) if output_dir is not None else None
    check_outputs(folders={"output_dir": output_dir})
    if num_classes is not None and num_classes not in SUPPORTED_CLASS_COUNTS:
        raise UserError(f"num_classes must be 1000 (ImageNet) or 9 (IN-9), not {num_classes}")
    if full and not challenge:
        raise UserError("full=True is the challenge's whole prediction matrix: it needs challenge=True")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be at least 1, not {batch_size}")
    if workers is not None and not 1 <= workers <= MAX_WORKERS:
        raise UserError(f"workers must be from 1 to {MAX_WORKERS}, not {workers}")
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed must be from 0 to {MAX_SEED}, not {seed}")
    decoded_cache = DecodedCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), shared_cache) \
        if cache else None
    workers = default_workers() if workers is None else workers
    progress = progress and group.is_main
    request = Request(data_path, In9Config(tuple(_variations(variations)), batch_size, workers, progress),
                      ChallengeConfig(full=full, batch_size=batch_size, progress=progress,
                                      mask_arithmetic=arithmetic) if challenge else None,
                      workers, decoded_cache, progress, allow_inexact_device)
    cache_admin.written_line()  # what was cached before the call is not this call's to say
    data = list_data(request)  # every cheap input is checked before any model is built or moved
    with _state_kept(model), math_flags_kept():
        runtime = Runtime(group.device(resolve_device(None if device is None else str(device))), precision,
                          channels_last, group=group)
        seed_everything(seed)
        lora = LoraScaling(lora_alpha, lora_rslora, LORA_KEYWORDS)
        prepared = prepare(request, runtime, lambda: _loaded(model, mean, std, num_classes, weights, trust_checkpoint,
                                                             lora, runtime, progress, checkpoint_key,
                                                             trust_remote_code, decoded_cache), data)
        in9 = prepared.in9(output_dir, resume)
        found = prepared.challenge(output_dir, resume) if challenge else None
    files = {}
    if output_dir is not None and group.is_main:  # as the scripts: rank 0 writes what one process would
        files["in9"] = output_dir / IN9_RESULTS_FILE
        publish_in9(in9, results_file=files["in9"])
        if found is not None:
            files["challenge"] = output_dir / CHALLENGE_RESULTS_FILE
            publish_challenge(found, output_dir, data_path, prepared.model.num_classes,
                              results_file=files["challenge"])
    written = cache_admin.written_line()  # where and how much this call cached, as the commands say it
    if written is not None:
        log.info("%s", written)
    accuracy = {name: result.accuracy for name, result in in9.results.items()}
    return BenchmarkResult(
        MappingProxyType(accuracy), bg_gap(in9.results),
        None if found is None else found.challenge_accuracy, None if found is None else found.vulnerable,
        None if found is None else found.total, in9.to_json(), None if found is None else found.to_json(),
        MappingProxyType(files))


def _precision(value: Precision | str) -> Precision:
    return _choice(Precision, value, "precision")


def _choice(vocabulary, value, argument: str):
    try:
        return vocabulary(value)
    except ValueError:
        raise UserError(f"unknown {argument} {value!r}; valid: {', '.join(v.value for v in vocabulary)}") from None


def _variations(names: Sequence[str]) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    unknown = [name for name in names if name not in VARIATIONS]
    if unknown or not names:
        raise UserError(f"unknown variation(s) {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                        f"{', '.join(VARIATIONS)}")
    return names


def _loaded(model: nn.Module | str, mean, std, num_classes: int | None, weights: str | None, trust: bool,
            lora: LoraScaling, runtime: Runtime, progress: bool, checkpoint_key: str | None = None,
            trust_remote_code: bool = False, cache: DecodedCache | None = None) -> LoadedModel:
    """The model wrapped to take pixels: a module with the given statistics, a name through its source."""
    in9 = None if num_classes is None else num_classes == NUM_IN9_CLASSES
    if isinstance(model, str):
        if not (mean is None or _is_auto(mean)) or std is not None:
            raise UserError(f"{model} takes its normalisation from its source: pass mean=None (no normalisation) "
                            f"or leave mean and std out")
        normalize = Normalization.AUTO if _is_auto(mean) else Normalization.NONE
        return load_model(model, weights, in9=in9, normalize=normalize, trust=trust, checkpoint_key=checkpoint_key,
                          runtime=runtime, progress=progress, lora_alpha=lora.alpha, lora_rslora=lora.rslora,
                          lora_options=lora.options, trust_remote_code=trust_remote_code, cache=cache)
    name = type(model).__qualname__
    model = _as_module(model, runtime.device)
    if weights is not None:
        raise UserError("weights= names the pretrained weights of a model name; a module brings its own")
    if checkpoint_key is not None or trust_remote_code:
        raise UserError(f"{'checkpoint_key=' if checkpoint_key is not None else 'trust_remote_code=True'} applies to "
                        f"a model name that loads a file or a hub model; a module is loaded already")
    if lora.given():
        raise lora.misplaced("named as model; a module brings its own weights")
    if isinstance(mean, str) and not _is_auto(mean):
        raise UserError(f"mean must be three numbers, {AUTO!r} or None, not {mean!r}")
    if (mean is None or _is_auto(mean)) and std is not None:
        raise UserError("std without mean: pass both (or neither, for the class-count rule)")
    stats = None if mean is None or _is_auto(mean) else _statistics(mean, std)
    width = _output_width(model, runtime.device)
    check_class_count(width, in9, f"the module ({name.rpartition('.')[2]})")
    origin = ModelOrigin(f"module:{name}",
                         checkpoint_format=EXPORT_FORMAT if isinstance(model, ExportedModule) else MODULE_FORMAT)
    record = ModelRecord()  # a module's weights and the code it runs
    record.setting("module state sha256", state_sha256(model))
    record.code(model)
    loaded = wrap(model, num_classes=width, origin=origin, stats=stats, stats_origin="mean/std given", record=record,
                  normalize=Normalization.NONE if mean is None else Normalization.AUTO)
    record.close()
    if mean is None:
        loaded.normalization = "none (mean=None: the module normalises its input itself)"
    return loaded


def _as_module(model, device: torch.device) -> nn.Module:
    """The caller's model as a module the toolkit can evaluate: a `torch.export` program as its module on the run's
    device; an exported `.module()` (whose train()/eval() raise) in a wrapper that keeps its mode; else as it is."""
    export = sys.modules.get("torch.export")  # loaded wherever a caller holds an ExportedProgram
    if export is not None and isinstance(model, export.ExportedProgram):
        buffer = io.BytesIO()  # a copy to move: torch's move_to_device_pass changes the program it is given
        export.save(model, buffer)
        buffer.seek(0)
        module = exported_module(export.load(buffer), device)[0]
        check_any_batch(module, "the torch.export program")
        return module
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be an nn.Module, a torch.export program or a model name, not "
                        f"{type(model).__name__}")
    try:
        model.train(model.training)  # the modes are restored after the call (_state_kept)
    except NotImplementedError:  # torch.export's .module(): it runs in the mode it was exported in
        named = graph_devices(model) - {str(torch.empty(0, device=device).device)}
        if named:
            raise UserError(f"the exported module's code names {', '.join(sorted(named))}, where it was exported, "
                            f"and cannot be moved to {device}: pass the ExportedProgram itself (before .module()), "
                            f"which benchmark() moves, or export it on {device}") from None
        check_any_batch(model, "the exported module")
        parameter = next(iter(model.parameters()), None)
        return ExportedModule(model, "export", parameter.device if parameter is not None else device, False)
    return model


def _is_auto(mean) -> bool:
    return isinstance(mean, str) and mean == AUTO


def _statistics(mean, std) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if std is None:
        raise UserError("mean without std: pass both (or neither, for the class-count rule)")
    try:
        values = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    except (TypeError, ValueError):
        raise UserError(f"mean and std must be three numbers each, not {mean!r} and {std!r}") from None
    if any(len(v) != 3 for v in values) or not all(s > 0 for s in values[1]):
        raise UserError(f"mean and std must be three numbers each, std positive, not {mean!r} and {std!r}")
    return values


def _output_width(module: nn.Module, device: torch.device) -> int:
    """The class count, from one forward pass on a zero batch of 2 on the run's device."""
    try:
        with torch.inference_mode():
            out = module.to(device).eval()(torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE, device=device))
    except Exception as exc:  # noqa: BLE001 (any failure of the caller's module on the input the toolkit feeds)
        raise UserError(f"the module fails on a 2x3x{IMAGE_SIZE}x{IMAGE_SIZE} input on {device}: "
                        f"{type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2:
        raise UserError("the module does not return a (batch, classes) tensor of logits")
    return int(out.shape[1])


@contextlib.contextmanager
def _state_kept(model: nn.Module | str) -> Iterator[None]:
    """After the block, as before it: the module's modes and very tensors, the caller's autocast and grad mode, and
    the random number generators (every GPU's too)."""
    module = model if isinstance(model, nn.Module) else nn.Module()
    modes = [(m, m.training) for m in module.modules()]
    # nn.Module._apply (.to, channels-last) converts a parameter's and its gradient's data in place: both kept
    parameters = [(m, name, p, p.data, p.grad, None if p.grad is None else p.grad.data)
                  for m in module.modules() for name, p in m.named_parameters(recurse=False)]
    buffers = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    autocast_off = [torch.autocast(device_type=kind, enabled=False) for kind in _autocast_device_types()]
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []), \
                contextlib.ExitStack() as stack:
            for context in autocast_off:  # the caller's mixed precision does not leak into an fp32 evaluation
                stack.enter_context(context)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        for owner, name, parameter, data, grad, grad_data in parameters:
            if getattr(owner, name) is not parameter:
                setattr(owner, name, parameter)
            parameter.data = data
            if grad is not None:
                grad.data = grad_data
            parameter.grad = grad
        for owner, name, buffer in buffers:
            setattr(owner, name, buffer)
        for m, training in modes:
            m.training = training


def _autocast_device_types() -> list[str]:
    kinds = ["cpu"]
    if torch.cuda.is_available():
        kinds.append("cuda")
    if torch.backends.mps.is_available():
        kinds.append("mps")
    return kinds
