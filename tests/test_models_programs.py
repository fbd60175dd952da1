"""TorchScript and torch.export programs keep the devices they were traced or exported on in their code; the
loader points those at the run's device before the first run and probes the program there.

No GPU here: the `meta` device stands in for the run's GPU, and a program whose code names `cuda` (made on the
CPU, then rewritten as a GPU-traced or GPU-exported file reads) stands in for one made on a GPU."""

from __future__ import annotations

import warnings
import zipfile

import pytest
import torch
from torch import nn

from tools.errors import UserError
from tools.models.sources import load_model
from tools.runtime import Runtime

META = torch.device("meta")
IMAGE = (3, 224, 224)  # the loader's probe feeds full-size images


class MakesTensorsOnItsInputsDevice(nn.Module):
    """A tiny classifier that creates a tensor with `device=x.device`: tracing and export write that device in."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.fc = nn.Linear(3, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.arange(9, dtype=x.dtype, device=x.device)
        return self.fc(x.mean((2, 3))) + offset


def pixels() -> torch.Tensor:
    return torch.randint(0, 256, (2, *IMAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def expected_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The model on the images as the pixel wrapper feeds it (the 9-class rule's statistics)."""
    mean = torch.tensor((0.4717, 0.4499, 0.3837)).view(1, 3, 1, 1)
    std = torch.tensor((0.2600, 0.2516, 0.2575)).view(1, 3, 1, 1)
    with torch.inference_mode():
        return model((images.float() / 255 - mean) / std)


def save_traced(path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(MakesTensorsOnItsInputsDevice().eval(), torch.zeros(2, *IMAGE)), str(path))


def save_exported(path) -> torch.export.ExportedProgram:
    program = torch.export.export(MakesTensorsOnItsInputsDevice().eval(), (torch.zeros(2, *IMAGE),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, str(path))
    return program


def script_devices(model: nn.Module) -> list[torch.device]:
    """Every device constant in the code of every method of the TorchScript modules in `model`, blocks and the graphs
    nodes hold (a fork's subgraph) included."""
    def nodes(block):
        for node in block.nodes():
            yield node
            for inner in node.blocks():
                yield from nodes(inner)
            for name in node.attributeNames():
                if node.kindOf(name) == "g":
                    yield from nodes(node.g(name))
    return [node.output().toIValue() for sub in model.modules() if isinstance(sub, torch.jit.ScriptModule)
            for name in sub._c._method_names()
            for node in nodes(sub._c._get_method(name).graph)
            if node.kind() == "prim::Constant" and isinstance(node.output().type(), torch._C.DeviceObjType)]


def export_devices(model: nn.Module) -> list[torch.device]:
    """Every device an operation of the exported graphs in `model` is given (the `device` keyword)."""
    return [torch.device(node.kwargs["device"]) for sub in model.modules() if isinstance(sub, torch.fx.GraphModule)
            for node in sub.graph.nodes if node.kwargs.get("device") is not None]


def rewrite_archive(path, old: bytes, new: bytes) -> None:
    """Replace `old` by `new` in the code files of a TorchScript archive (what a file traced elsewhere reads)."""
    with zipfile.ZipFile(path) as zf:
        entries = [(info, zf.read(info)) for info in zf.infolist()]
    with zipfile.ZipFile(path, "w") as zf:
        for info, data in entries:
            zf.writestr(info, data.replace(old, new) if info.filename.endswith(".py") else data)


def test_a_traced_program_is_loaded_with_its_device_constants_on_the_runs_device(tmp_path):
    path = tmp_path / "traced.ts"
    save_traced(path)
    traced = torch.jit.load(str(path))
    assert script_devices(traced) == [torch.device("cpu")]  # tracing on the CPU wrote the CPU in
    runtime = Runtime(META)
    loaded = load_model(checkpoint=path, runtime=runtime, trust=True)
    devices = script_devices(loaded.model)
    assert devices and set(devices) == {META}, devices
    model = runtime.prepare(loaded.model)
    with torch.inference_mode():
        logits = model(runtime.to_device(pixels()))
    assert (logits.device, tuple(logits.shape)) == (META, (2, 9))


def _offsets(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(9, dtype=x.dtype, device=x.device)


class ForksAWorkOnItsInputsDevice(MakesTensorsOnItsInputsDevice):
    """The same classifier, its tensor made in a branch run by `torch.jit.fork`: tracing writes that device into the
    fork node's subgraph, which no method's own nodes show."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.jit.fork(_offsets, x)
        return self.fc(x.mean((2, 3))) + torch.jit.wait(offset)


def test_a_device_in_a_forked_branch_is_pointed_at_the_runs_device(tmp_path):
    path = tmp_path / "forks.ts"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(ForksAWorkOnItsInputsDevice().eval(), torch.zeros(2, *IMAGE)), str(path))
    assert script_devices(torch.jit.load(str(path))) == [torch.device("cpu")]
    runtime = Runtime(META)
    # the probe on meta failed before: a cpu tensor in a fork
    loaded = load_model(checkpoint=path, runtime=runtime, trust=True)
    assert set(script_devices(loaded.model)) == {META}
    with torch.inference_mode():
        logits = runtime.prepare(loaded.model)(runtime.to_device(pixels()))
    assert (logits.device, tuple(logits.shape)) == (META, (2, 9))
    images = pixels()
    cpu = load_model(checkpoint=path, trust=True)
    with torch.inference_mode():
        assert torch.equal(cpu.model(images), expected_logits(MakesTensorsOnItsInputsDevice().eval(), images))


def test_an_exported_program_is_moved_with_the_device_of_its_operations(tmp_path):
    path = tmp_path / "exported.pt2"
    program = save_exported(path)
    assert export_devices(program.graph_module) == [torch.device("cpu")]
    runtime = Runtime(META)
    loaded = load_model(checkpoint=path, runtime=runtime)
    devices = export_devices(loaded.model)
    assert devices and set(devices) == {META}, devices
    model = runtime.prepare(loaded.model)
    with torch.inference_mode():
        logits = model(runtime.to_device(pixels()))
    assert (logits.device, tuple(logits.shape)) == (META, (2, 9))


def test_a_program_exported_on_a_gpu_is_probed_and_run_on_the_runs_device(tmp_path):
    path = tmp_path / "exported_on_gpu.pt2"
    program = save_exported(path)
    for node in program.graph_module.graph.nodes:  # what the file holds when exported on a GPU
        if node.kwargs.get("device") is not None:
            node.kwargs = {**node.kwargs, "device": torch.device("cuda")}
    torch.export.save(program, str(path))
    loaded = load_model(checkpoint=path)  # the CPU: the probe ran the program's cuda code before the fix
    assert set(export_devices(loaded.model)) == {torch.device("cpu")}
    images = pixels()
    with torch.inference_mode():
        assert torch.equal(loaded.model(images), expected_logits(MakesTensorsOnItsInputsDevice().eval(), images))


def test_a_program_traced_on_a_gpu_is_probed_and_run_on_the_runs_device(tmp_path):
    path = tmp_path / "traced_on_gpu.ts"
    save_traced(path)
    rewrite_archive(path, b'torch.device("cpu")', b'torch.device("cuda")')
    assert script_devices(torch.jit.load(str(path))) == [torch.device("cuda")]
    loaded = load_model(checkpoint=path, trust=True)
    assert set(script_devices(loaded.model)) == {torch.device("cpu")}
    images = pixels()
    with torch.inference_mode():
        assert torch.equal(loaded.model(images), expected_logits(MakesTensorsOnItsInputsDevice().eval(), images))


@pytest.mark.parametrize("save", [save_traced, save_exported], ids=["torchscript", "export"])
def test_a_program_that_names_a_device_refuses_to_be_moved_off_it(save, tmp_path):
    """Its device constants were fixed for the device it was loaded for (a graph that has run keeps its plan), so
    a later `.to(other)` that would move only the weights is refused, naming the way to load it for the other."""
    path = tmp_path / "program"
    save(path)
    loaded = load_model(checkpoint=path, trust=save is save_traced)
    with pytest.raises(RuntimeError, match=r"loaded for cpu.*load it for meta"):
        Runtime(META).prepare(loaded.model)
    Runtime(torch.device("cpu")).prepare(loaded.model)  # its own device, and other conversions, stay allowed


@torch.jit.script
def _offsets_on(n: int, where: str) -> torch.Tensor:
    return torch.arange(n, device=torch.device(where))  # a device made when it runs: no constant to point


class CallsAFunctionThatNamesADevice(nn.Module):
    """A scripted program whose free function makes a device from a string when it runs: out of the loader's reach
    (it points device constants, the called functions' included), so the probe finds it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 9)
        self.where = "meta"  # an attribute, read when it runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean((2, 3))) + _offsets_on(9, self.where)


def test_a_program_that_cannot_run_on_the_runs_device_is_one_error_line_with_the_cause(tmp_path):
    path = tmp_path / "scripted.ts"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(CallsAFunctionThatNamesADevice()), str(path))
    with pytest.raises(UserError, match=r"fails on a 3x3x224x224 input on cpu: RuntimeError: .*meta") as info:
        load_model(checkpoint=path, trust=True)
    assert "\n" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("save", [save_traced, save_exported], ids=["torchscript", "export"])
def test_a_program_made_on_the_cpu_runs_on_the_gpu(save, tmp_path):
    path = tmp_path / "program"
    save(path)
    runtime = Runtime(torch.device("cuda"))
    model = runtime.prepare(load_model(checkpoint=path, runtime=runtime, trust=save is save_traced).model)
    images = pixels()
    with torch.inference_mode():
        logits = model(runtime.to_device(images)).cpu()
    torch.testing.assert_close(logits, expected_logits(MakesTensorsOnItsInputsDevice().eval(), images))
