"""The start-up check of a run's arithmetic, the one place where a run's `exact` is decided: no program made in training
mode; the model's fp32 logits on the run's device, on its first few images at its batch shape, within `TOLERANCE` of a
float64 reference on the CPU (`Float64Everywhere`); an image's logits alone equal, bit for bit, to its logits beside
others (never compared across shapes: kernels differ by shape). Whatever it cannot verify is refused unless
`--allow-inexact-device`, then recorded as unverified. The reasons and measurements (the tolerance's too):
docs/how-it-works.md, "Exactness and behaviour on each device".
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tools import distributed
from tools.data.image_sets import ImageSet, decode_images
from tools.errors import UserError, option
from tools.models import torchscript
from tools.models.boundary import LoadedModel
from tools.models.programs import Program, program_problem
from tools.runtime import Forward, Runtime

log = logging.getLogger(__name__)

TOLERANCE = 1e-4
# the run's first images. float64 on the CPU is slow: seconds for a ResNet-50, over a minute for a ConvNeXt-T on
# two cores (measured: 110 s for 4 images), so two
CHECK_IMAGES = 2
ALLOW_FLAG = "--allow-inexact-device"


class Float64Everywhere(TorchDispatchMode):
    """Every floating dtype an operation asks for becomes float64, every device the CPU, and any other floating result
    is widened: the mathematics a model's code means, whatever casts it makes (TorchScript and torch.export programs'
    operations too). An operation that fails so is named in `failed`."""

    def __init__(self):
        super().__init__()
        self.failed: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_widen_argument, (_numbers_as_tensors(func, args), kwargs or {}))
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            self.failed = self.failed or f"{func}: {program_problem(exc)}"
            raise
        if func.is_view or func._schema.is_mutable:  # the result is (a view of) an input, already widened
            return out
        return tree_map(_widen_result, out)


def _numbers_as_tensors(func, args: tuple) -> tuple:
    """`args` with tensors back where the dispatcher handed a Python number (TorchScript's `prim::NumToTensor` scalars,
    which the operation would refuse); floats as float64."""
    tensor_places = [isinstance(argument.type, torch.TensorType) for argument in func._schema.arguments]
    return tuple(torch.tensor(a, dtype=torch.float64 if isinstance(a, float) else None)
                 if isinstance(a, (bool, int, float)) and i < len(tensor_places) and tensor_places[i] else a
                 for i, a in enumerate(args))


def _widen_argument(value):
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _widen_result(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(torch.float64)
    return value


# ----------------------------------------------------------------------------------------------------------
# Operations a program made in training mode holds

MODE_ARGUMENTS = ("training", "train", "use_input_stats")  # the argument that puts an operation in training mode
# normalised by the batch's statistics in training mode, by the running ones in eval mode (when it has them: an
# instance norm without them normalises each image by its own in either mode, a batch norm without them by the
# batch's in either mode, which no model.eval() changes: the comparison at the run's batch shape finds that)
BATCH_STATISTICS = frozenset({"batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit",
                              "_native_batch_norm_legit_functional", "cudnn_batch_norm", "miopen_batch_norm",
                              "_batch_norm_impl_index", "_batch_norm_with_update",
                              "_batch_norm_with_update_functional"})
ALWAYS_TRAINING = frozenset({"_batch_norm_with_update", "_batch_norm_with_update_functional"})  # no argument: named so
RANDOM_IN_TRAINING = frozenset({"dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout",
                                "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
                                "dropout1d", "dropout2d", "dropout3d", "rrelu", "rrelu_", "rrelu_with_noise",
                                "rrelu_with_noise_functional"})
_UNKNOWN = object()  # an argument computed when the program runs (a scripted module's `self.training`)


def _training_form(name: str, arguments: dict) -> str | None:
    """How operation `name` (no namespace) with `arguments` by schema name (`_UNKNOWN` where not a constant) computes
    what eval mode would not, or None."""
    if name in BATCH_STATISTICS:
        given = {k: v for k, v in arguments.items() if k in MODE_ARGUMENTS}
        if name not in ALWAYS_TRAINING and not any(v is True for v in given.values()):
            return None
        if arguments.get("running_mean") is None:  # no running statistics that eval mode would use
            return None
        whose = "each image's" if name == "instance_norm" else "the batch's"
        return f"{whose} statistics, not the running ones" + "".join(f", {k}=True" for k in given)
    if name in RANDOM_IN_TRAINING:
        mode = next(((k, v) for k, v in arguments.items() if k in MODE_ARGUMENTS), None)
        # native_dropout's train=None is training, as its kernel reads it
        if mode is None or not (mode[1] is True or (mode[1] is None and name == "native_dropout")):
            return None
        if arguments.get("p") == 0:  # drops nothing
            return None
        rate = f", p={arguments['p']}" if isinstance(arguments.get("p"), float) else ""
        return f"random, {mode[0]}=True{rate}"
    return None


def _script_arguments(node) -> dict:
    """A TorchScript node's inputs by their schema's names: constants as values, the rest `_UNKNOWN`."""
    names = [argument.name for argument in torch._C.parse_schema(node.schema()).arguments]
    return {name: value.toIValue() if value.node().kind() == "prim::Constant" else _UNKNOWN
            for name, value in zip(names, node.inputs())}


def _fx_arguments(node: torch.fx.Node) -> tuple[str, dict] | None:
    """An fx call's operation name and arguments (nodes: `_UNKNOWN`) for the operations above, aten's or
    torch.nn.functional's (a symbolic trace bakes `training=self.training` in); else None."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name, schema = target._schema.name.split("::")[-1], target._schema.arguments
    elif callable(target) and getattr(target, "__module__", None) == "torch.nn.functional":
        name, schema = target.__name__, None
    else:
        return None
    if name not in BATCH_STATISTICS and name not in RANDOM_IN_TRAINING:
        return None
    if schema is not None:
        arguments = {argument.name: argument.default_value for argument in schema if argument.has_default_value()}
        arguments.update(zip([argument.name for argument in schema], node.args))
        arguments.update(node.kwargs)
    else:
        try:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
        except (TypeError, ValueError):
            return None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
    return name, {k: _UNKNOWN if isinstance(v, torch.fx.Node) else v for k, v in arguments.items()}


def training_mode_operations(model: nn.Module) -> tuple[str, ...]:
    """The operations in the TorchScript and fx graphs in `model` that tracing or export in training mode fixed to
    compute what eval mode would not (batch statistics, dropout), each kind once."""
    found = []
    for graph in torchscript.method_graphs(model):
        for node in torchscript.graph_nodes(graph):
            kind = node.kind()
            name = kind.split("::")[-1]
            if kind.startswith("aten::") and (name in BATCH_STATISTICS or name in RANDOM_IN_TRAINING):
                form = _training_form(name, _script_arguments(node))
                if form is not None:
                    found.append(f"{kind} ({form})")
    for sub in model.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                called = _fx_arguments(node) if node.op == "call_function" else None
                form = None if called is None else _training_form(*called)
                if form is not None:
                    found.append(f"{called[0]} ({form})")
    return tuple(dict.fromkeys(found))


# ----------------------------------------------------------------------------------------------------------
# The check

@dataclass(frozen=True)
class DeviceCheck:
    """What the start-up check found, as the provenance records it."""

    device: str
    images: int
    deviation: float | None  # the largest |logit - reference| over an image's largest |reference logit|
    unavailable: str | None = None  # why no reference could be built
    allowed: bool = False  # the run went on past a finding (--allow-inexact-device)
    tolerance: float = TOLERANCE
    batch_size: int | None = None  # the run's batch shape, at which an image alone and beside others were compared
    batch_dependence: str | None = None  # what differed there, if anything
    training_mode: tuple[str, ...] = ()  # operations of a program made in training mode
    repeatable: bool = True  # False where two passes over one batch gave other last bits (then compared in tolerance)
    not_finite: bool = False  # a logit on the device was NaN: an argmax of it means nothing, whatever float64 says

    @property
    def passed(self) -> bool | None:
        """The comparison with the reference: within the tolerance (None: no reference)."""
        return None if self.deviation is None else self.deviation <= self.tolerance

    @property
    def verified(self) -> bool:
        """Every comparison made and passed: only then is a run in the exact mode `exact`."""
        return bool(self.passed) and self.batch_dependence is None and not self.training_mode and not self.not_finite

    def describe(self) -> dict:
        info = {"device": self.device, "reference": "float64 on the CPU", "images": self.images,
                "max_relative_deviation": None if self.deviation is None else float(f"{self.deviation:.3g}"),
                "tolerance": self.tolerance, "passed": self.passed, "batch_size": self.batch_size,
                "batch_dependence": self.batch_dependence, "training_mode": list(self.training_mode),
                "not_finite": self.not_finite,
                "verified": self.verified}
        if self.unavailable is not None:
            info["reference"], info["unavailable"] = None, self.unavailable
        if not self.repeatable:
            info["repeatable"] = False
        if self.allowed and not self.verified:
            info["allowed_inexact"] = True
        return info


def relative_deviation(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """The worst image's largest |logits - reference| over its largest |reference logit|; equal values deviate by 0, a
    NaN on one side only by infinity."""
    logits, reference = logits.double().flatten(1), reference.double().flatten(1)
    both_nan = logits.isnan() & reference.isnan()
    diff = torch.where((logits == reference) | both_nan, 0.0, (logits - reference).abs()).nan_to_num(nan=torch.inf)
    scale = reference.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1)
    worst = diff.amax(dim=1)
    ratio = torch.where(worst == 0, 0.0, worst / scale)  # a zero scale with a deviation: infinite
    return float(ratio.max()) if ratio.numel() else 0.0


def float64_logits(loaded: LoadedModel, images: torch.Tensor) -> torch.Tensor:
    """The model's logits on `images`, computed in float64 on the CPU by a copy of it (the model is not changed)."""
    with torch.no_grad():  # copied without autograd history (a TorchScript module's copies would carry some)
        reference = copy.deepcopy(loaded.model)
        for module in reference.modules():
            if isinstance(module, Program):  # the devices its code names become the CPU under Float64Everywhere
                module.names_devices = False
        reference = reference.cpu().double().eval()
    mode = Float64Everywhere()
    try:
        with torch.inference_mode(), mode:
            return reference(images.cpu())
    except Exception as exc:
        if mode.failed is not None:  # the operation that has no float64 form, out of an interpreter's message too
            raise RuntimeError(mode.failed) from exc
        raise


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN; 0.0 and -0.0 differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(integer), b.contiguous().view(integer)
    return torch.equal(a, b)


def device_logits(loaded: LoadedModel, runtime: Runtime, images: torch.Tensor, batch_size: int
                  ) -> tuple[torch.Tensor, str | None, bool]:
    """The model's eager fp32 logits on `images` on the runtime's device at the run's padded batch shape; the batch
    dependence found, if any; and whether two passes over one batch gave the same bits.

    The first image alone against beside others must match bit for bit; where not, the lone batch runs again: the same
    bits mean batch dependence; other bits mean unrepeatable kernels (atomic sums, MPS), and both differences are then
    measured against `TOLERANCE`: randomness beyond it, else batch dependence beyond it, else a pass."""
    model = loaded.model.to(runtime.device).eval()  # as `Runtime.prepare` moves it, eager
    if runtime.channels_last:
        model = model.to(memory_format=torch.channels_last)
    forward = Forward(model, runtime, batch_size, exact=True, what="the device check's batch size")
    beside = forward(runtime.to_device(torch.cat([images, 255 - images[:1]])))
    alone = forward(runtime.to_device(images[:1]))
    logits = beside[:len(images)].float().cpu()
    if same_bits(alone[:1], beside[:1]):
        return logits, None, True
    again = forward(runtime.to_device(images[:1]))
    repeatable = same_bits(again, alone)
    device = runtime.device
    eval_hint = " (if it was traced or exported in training mode, call model.eval() before tracing or exporting it)"
    if not repeatable and relative_deviation(again.cpu(), alone.cpu()) > TOLERANCE:
        return logits, (f"the model's fp32 logits on {device} differ between two passes over the same batch "
                        f"(dropout or other randomness in its forward pass), so its results depend on chance"
                        f"{eval_hint}"), repeatable
    if repeatable or relative_deviation(beside[:1].cpu(), alone.cpu()) > TOLERANCE:
        return logits, (f"the model's fp32 logits for an image on {device} change with the other images in its "
                        f"batch of {forward.chunk} (batch statistics: a BatchNorm without running statistics, or the "
                        f"like), so its results depend on {option('--batch-size')} and on which images share a "
                        f"batch"
                        f"{eval_hint}"), repeatable
    return logits, None, repeatable


def _unverified(message: str, allow_inexact: bool) -> None:
    """Refuse a finding in one line, or with `allow_inexact` say it and go on (recorded as unverified)."""
    if not allow_inexact:
        raise UserError(f"{message}; pass {option(ALLOW_FLAG)} to run anyway (recorded in the results' provenance as "
                        f"unverified, exact: false)")
    log.warning("%s; running anyway (%s, recorded in the provenance as unverified)", message, option(ALLOW_FLAG))


def check_device(loaded: LoadedModel, runtime: Runtime, images: torch.Tensor, allow_inexact: bool = False,
                 batch_size: int | None = None) -> DeviceCheck:
    """Check the model on `images` (uint8) at the run's batch shape (`batch_size`, default the runtime's), in fp32
    whatever the run's precision (fp32 is what is exact and what reduced precision is re-checked in). Each finding, and
    no float64 reference, is refused in one line, unless `allow_inexact` (then warned and recorded, not `verified`)."""
    device, batch_size = str(runtime.device), runtime.batch_size(batch_size)
    found = {"device": device, "images": len(images), "batch_size": batch_size, "allowed": allow_inexact}
    findings = []  # refused at the first; allowed, the first is said (the later ones may follow from it)

    def unverified(message: str) -> None:
        if not findings:
            _unverified(message, allow_inexact)
        findings.append(message)

    training = training_mode_operations(loaded.model)
    if training:
        unverified(f"the model is a program traced or exported in training mode: {'; '.join(training)} compute what "
                   f"eval mode would not, so its results are not the trained model's and may depend on "
                   f"{option('--batch-size')} and on chance; call model.eval() before tracing or exporting it")
    if not len(images):
        return DeviceCheck(**found, deviation=None, unavailable="no images to check on", training_mode=training)
    try:  # first, while the model may still be on the CPU
        reference, unavailable = float64_logits(loaded, images), None
    except Exception as exc:  # noqa: BLE001 (any model: the check says why it has no reference)
        reference, unavailable = None, program_problem(exc)
        unverified(f"no float64 reference of the model could be made on the CPU ({unavailable}), so its fp32 "
                   f"arithmetic on {device} cannot be checked")
    logits, dependence, repeatable = device_logits(loaded, runtime, images, batch_size)
    if dependence is not None:
        unverified(dependence)
    elif not repeatable:
        log.info("device check: two passes over one batch on %s differ in their last bits (the device's kernels are "
                 "not repeatable bit for bit), so the batch comparison was made within the tolerance", device)
    deviation = None if reference is None else relative_deviation(logits, reference)
    not_finite = bool(logits.isnan().any())
    if not_finite:
        unverified(f"the model's logits on {device} are NaN on the run's first {len(images)} images (its weights or "
                   f"its code give no number there), so its predictions would mean nothing; check the model")
    check = DeviceCheck(**found, deviation=deviation, unavailable=unavailable, batch_dependence=dependence,
                        training_mode=training, repeatable=repeatable, not_finite=not_finite)
    if check.passed is False:
        unverified(f"the model's fp32 logits on {device} differ from float64 on the CPU by {deviation:.1e} of the "
                   f"largest logit on the run's first {len(images)} images, beyond fp32 rounding (tolerance "
                   f"{TOLERANCE:g}): the model or the device computes in lower precision (a cast to bf16 or fp16, "
                   f"TF32)")
    if check.verified:
        log.info("device check: fp32 logits on %s within %.1e of float64 on the CPU (tolerance %g, %d images), and "
                 "an image's alone equal to its beside others at the batch size, %d", device, deviation, TOLERANCE,
                 len(images), batch_size)
    return check


def first_images(root: Path, relpaths: Sequence[str], workers: int) -> torch.Tensor:
    """The first CHECK_IMAGES of a run's images, decoded (uint8), for `check_run`."""
    return decode_images(ImageSet(root), list(relpaths)[:CHECK_IMAGES], workers, progress=False)


def check_run(loaded: LoadedModel, runtime: Runtime, images: torch.Tensor, allow_inexact: bool = False,
              batch_size: int | None = None) -> dict:
    """`check_device` on a run's first images in every process (which leave together if one refuses), as the provenance
    records it; under torchrun verified only where every process verified it."""
    with distributed.agree(runtime.group, runtime.device):
        check = check_device(loaded, runtime, images[:CHECK_IMAGES], allow_inexact, batch_size).describe()
    if runtime.group.distributed:
        everywhere = bool(distributed.all_reduce(np.array([check["verified"]], np.int64), "min", runtime.device)[0])
        if check["verified"] and not everywhere:
            check.update(verified=False, unverified_elsewhere=True)
    return check


def verified(check: dict | None) -> bool:
    """Whether a check record (None: none) verified the model: what resume states hold, so a state made without it is
    not resumed by a run that claims it."""
    return bool(check is not None and check.get("verified"))


def record_check(provenance: dict, check: dict) -> None:
    """Put a run's check in its provenance and set `exact`: the exact mode (fp32, eager) and a verified check."""
    provenance["device_check"] = check
    provenance["exact"] = bool(provenance.get("exact_mode")) and verified(check)


def combined(provenances: Sequence[dict]) -> dict:
    """A provenance merged from shards: exact only where every shard was, the first unverified check."""
    merged = dict(provenances[0])
    checks = [p["device_check"] for p in provenances if "device_check" in p]
    if checks:
        merged["device_check"] = next((c for c in checks if not c.get("verified")), checks[0])
    merged["exact"] = all(p.get("exact") is True for p in provenances)
    return merged
