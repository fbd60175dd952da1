"""Programs as classifiers: torch.export and TorchScript archives, told apart by content (`program_kind`), refused
unless trusted where they could run code of their own (`check_program_trusted`), and loaded for one device with the
devices their code names pointed there (`load_program`).
"""

from __future__ import annotations

import logging
import re
import warnings
import zipfile
import zlib
from pathlib import Path

import torch
from torch import nn

from tools.errors import UserError, first_line, key_list, option
from tools.models import export_archive, torchscript

log = logging.getLogger(__name__)


def program_kind(path: Path) -> str | None:
    """"export" or "torchscript" when the file is such a program (read from its zip directory), else None."""
    if not zipfile.is_zipfile(path):
        return None
    try:  # is_zipfile reads only the end record: the rest may be damaged (a name flagged UTF-8 that is not: ValueError)
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise UserError(f"cannot read checkpoint {path}: its zip directory is damaged ({first_line(exc)}); "
                        f"is the file complete?") from None
    # torch.export's archive: `<name>/archive_format` in the layout of newer torch, a top-level
    # `serialized_exported_program.json` in that of older releases (2.6 and before)
    if any(n.endswith("/archive_format") for n in names) or "serialized_exported_program.json" in names:
        return "export"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    return None


def program_problem(exc: Exception) -> str:
    """The useful line of a program's failure (TorchScript puts the cause after the program's code)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"\w+(Error|Exception): ", line)]
    if lines and "TorchScript interpreter" in lines[0] and causes:
        return causes[-1]
    return first_line(exc)


class Program(nn.Module):
    """A TorchScript or torch.export program as a module, loaded for one device: the devices its code names point there,
    so it refuses a later move elsewhere, which would take only its weights."""

    def __init__(self, program: nn.Module, kind: str, device: torch.device, names_devices: bool):
        super().__init__()
        self.program, self.kind, self.names_devices = program, kind, names_devices
        self.device = torch.empty(0, device=device).device  # with its index ("cuda" is "cuda:0"), as tensors say

    def _apply(self, fn, recurse: bool = True):
        target = fn(torch.empty(0, device=self.device)).device  # where this conversion (to, cuda, cpu) sends tensors
        if target != self.device and self.names_devices:
            raise RuntimeError(f"this {self.kind} program was loaded for {self.device}, and its code names devices; "
                               f"load it for {target} instead (load_model with a runtime on {target})")
        self.device = target
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.program(x)


EXPORT_BATCH_HINT = "export it with a dynamic batch dimension (dynamic_shapes with torch.export.Dim)"
ATTENTION = "aten.scaled_dot_product_attention"


def exact_kernel_hint(program: nn.Module) -> str | None:
    """Why an export program may fail in the exact mode's kernels: torch 2.6 exported attention in its kernel's layout,
    which the math kernel does not take. None without attention."""
    if not any(str(node.target).startswith(ATTENTION) for sub in program.modules()
               if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes):
        return None
    return ("; a program's attention exported by torch 2.6 is laid out for the fused attention kernel, and the exact "
            "mode runs the math one: export it under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or with a "
            "newer torch")


class ExportedModule(Program):
    """An exported program, its mode fixed at export: train()/eval() set this wrapper's flag only."""

    def __init__(self, program: nn.Module, kind: str, device: torch.device, names_devices: bool):
        super().__init__(program, kind, device, names_devices)
        found = batch_range(self)
        self.largest_batch = found[1] if found is not None else None  # a dynamic batch's maximum, if it has one

    def train(self, mode: bool = True) -> ExportedModule:
        self.training = mode
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.largest_batch is not None and x.shape[0] > self.largest_batch:  # the program's guard: a traceback
            raise UserError(f"this torch.export program takes batches of at most {self.largest_batch} images (its "
                            f"batch dimension was exported with a maximum), not {x.shape[0]}; pass "
                            f"{option('--batch-size', self.largest_batch)} or less, or {EXPORT_BATCH_HINT}")
        return super().forward(x)


def exported_module(program, device: torch.device) -> tuple[ExportedModule, set[str]]:
    """A torch.export program as a module on `device`, its code's devices moved too; and those devices."""
    from torch.export.passes import move_to_device_pass  # noqa: PLC0415 (torch.export loads only for programs)
    named = graph_devices(program.graph_module)
    return ExportedModule(move_to_device_pass(program, device).module(), "export", device, bool(named)), named


def batch_range(module: nn.Module) -> tuple[int, int | None] | None:
    """The batch sizes an exported module takes, (lowest, highest or None), from its first input's recorded shape; None
    where unrecorded."""
    graph = module.program if isinstance(module, Program) else module
    if not isinstance(graph, torch.fx.GraphModule):
        return None
    first = next((node for node in graph.graph.nodes if node.op == "placeholder"), None)
    shape = getattr(first.meta.get("val"), "shape", None) if first is not None else None
    if shape is None or not len(shape):
        return None
    size = shape[0]
    if type(size) is int:
        return size, size
    try:  # a symbol's range, as export's shape environment keeps it (upper: int_oo where unbounded)
        bounds = size.node.shape_env.var_to_range[size.node.expr]
        lowest = int(bounds.lower)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    try:
        highest = int(bounds.upper)
    except (AttributeError, TypeError, ValueError, OverflowError):  # int_oo: no bound
        highest = None
    return lowest, highest


def check_any_batch(module: nn.Module, what: str, also: str = "") -> None:
    """Refuse an exported program with one batch size (export's default) or a dynamic batch bounded below past 2 (export
    specialises 0 and 1): a run's last batch and the device check's single images fail. A maximum (3 or more) is kept
    to: `ExportedModule` refuses a larger batch in one line."""
    found = batch_range(module)
    if found is None:
        return
    lowest, highest = found
    sizes = ""
    if lowest == highest:
        sizes = f"of exactly {lowest} image{'s' if lowest != 1 else ''} (it was exported with a fixed batch size, " \
                f"torch.export's default)"
    elif lowest > 2:
        sizes = f"of {lowest} or more images (its batch dimension was exported with a minimum)"
    if sizes:
        raise UserError(f"{what} takes batches {sizes}; {EXPORT_BATCH_HINT}{also}")


def graph_devices(module: nn.Module) -> set[str]:
    """The devices the operations of a torch.fx graph module (and its graph submodules) are given."""
    return {str(torch.device(node.kwargs["device"])) for sub in module.modules()
            if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes
            if node.kwargs.get("device") is not None}


def check_program_trusted(path: Path, kind: str, trust: bool) -> None:
    """Refuse, unless trusted, every TorchScript file and an export archive that is not data."""
    if trust:
        log.info("loading the %s program %s unchecked (%s)", kind, path, option("--trust-checkpoint"))
        return
    if kind == "torchscript":
        raise UserError(f"checkpoint {path} is a TorchScript program, which is code (it can read and write any file) "
                        f"that the toolkit cannot check; if you trust the file, rerun with "
                        f"{option('--trust-checkpoint')}, or save the model as a state dict "
                        f"(torch.save(model.state_dict(), PATH), read with {option('--arch')}) or a torch.export "
                        f"program (torch.export.save)")
    try:
        found = export_archive.untrusted_content(path)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError, ValueError) as exc:
        raise UserError(f"cannot read checkpoint {path}: {first_line(exc)}; is the file complete?") from None
    if found:
        raise UserError(f"checkpoint {path} is a torch.export program with more than tensors and tensor operations "
                        f"({key_list(found, limit=3)}), which would run code when loaded; if you trust the file, "
                        f"rerun with {option('--trust-checkpoint')}")


def _read_program(path: Path, kind: str, device: torch.device):
    try:
        if kind == "torchscript":
            with warnings.catch_warnings():  # TorchScript is deprecated upstream, yet users' files are TorchScript
                warnings.simplefilter("ignore", FutureWarning)
                return torch.jit.load(str(path), map_location=device)
        return torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001 (a broken archive is the user's file)
        raise UserError(f"cannot load the {kind} program {path}: {first_line(exc)}") from None


def load_program(path: Path, kind: str, device: torch.device) -> Program:
    """The program, its weights and the devices its code names all on `device`, before its first run."""
    loaded = _read_program(path, kind, device)
    if kind == "torchscript":
        named = torchscript.point_devices(loaded, device)
        torchscript.unbake_convolutions(loaded)
        program = Program(loaded, kind, device, bool(named))
    else:
        program, named = exported_module(loaded, device)
        check_any_batch(program, f"the torch.export program in {path}", " or save it as TorchScript/state dict")
    elsewhere = sorted(named - {str(device)})
    if elsewhere:
        log.info("the %s program in %s names %s in its code (where it was made); pointed at %s", kind, path,
                 ", ".join(elsewhere), device)
    return program
