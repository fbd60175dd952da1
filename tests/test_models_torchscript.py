"""A traced program's convolutions read cuDNN's flags when they run, not the tracing process's: tracing bakes them
into each `aten::_convolution` as constants (TF32 on by torch's defaults), where no flag a runtime sets reaches
them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tools.models.programs import Program
from tools.models.sources import load_model
from tools.runtime import Runtime


class OldConvolution(nn.Module):
    """A scripted 1x1 convolution through the 12-input `aten::_convolution` (no allow_tf32: older torch's
    traces), called from the traced program as a submodule with its own graph."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6, 1, 1) / 6)

    def forward(self, x):
        return torch._convolution(x, self.weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, True, False, True)


class Convolutions(nn.Module):
    """Every kind of convolution a traced classifier holds: plain with batch norm, strided and dilated, depthwise,
    without bias, transposed, and a scripted submodule's."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.depthwise = nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=6, bias=False)
        self.up = nn.ConvTranspose2d(6, 6, 2, stride=2)
        self.old = torch.jit.script(OldConvolution())
        self.head = nn.Linear(6, 9)

    def forward(self, x):
        x = self.old(self.up(self.depthwise(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def baked(module: nn.Module) -> list[int]:
    """The input counts of the `aten::_convolution` nodes in the graphs of every method of every TorchScript module
    in `module`, and in the graphs their nodes hold (a fork's subgraph: the forked code)."""
    def nodes(block):
        for node in block.nodes():
            yield node
            for inner in node.blocks():
                yield from nodes(inner)
            for name in node.attributeNames():
                if node.kindOf(name) == "g":
                    yield from nodes(inlined(node.g(name)))
    def inlined(graph):  # a copy with every function call (prim::CallFunction) inlined: the code that runs
        graph = graph.copy()
        torch._C._jit_pass_inline(graph)
        return graph
    return [len(list(node.inputs())) for sub in module.modules() if isinstance(sub, torch.jit.ScriptModule)
            for name in sub._c._method_names() for node in nodes(inlined(sub._c._get_method(name).graph))
            if node.kind() == "aten::_convolution"]


def traced_with_torchs_defaults(frozen: bool) -> tuple[nn.Module, torch.jit.ScriptModule]:
    torch.manual_seed(0)
    net = Convolutions().eval()
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
        traced = torch.jit.trace(net, torch.zeros(2, 3, 32, 32))
    return net, torch.jit.freeze(traced) if frozen else traced


@pytest.mark.parametrize("frozen", [False, True], ids=["traced", "frozen"])
def test_a_loaded_traced_program_holds_no_baked_flags_and_computes_what_eager_does(tmp_path, frozen):
    net, traced = traced_with_torchs_defaults(frozen)
    # the scripted old form; stem, depthwise, transposed: traced, in each (sub)module's graph and inlined in its
    # parents' (the top's three, the stem's and its convolution's, the depthwise's, the transposed's)
    assert sorted(baked(traced)) == ([12, 13, 13, 13] if frozen else [12, 12] + [13] * 7)
    path = tmp_path / "program.ts"
    torch.jit.save(traced, str(path))
    loaded = load_model(checkpoint=path, runtime=Runtime(torch.device("cpu")), trust=True)
    program = next(m for m in loaded.model.modules() if isinstance(m, Program)).program
    assert baked(program) == []
    x = torch.rand(5, 3, 32, 32)
    with torch.inference_mode():
        eager, rewritten, unrewritten = net(x), program(x), traced(x)
    assert torch.equal(rewritten, unrewritten)  # on the CPU the flags change nothing
    assert frozen or torch.equal(rewritten, eager)  # (freezing folds the batch norm into the convolution)
    # the rewrite is the program's code: saved and loaded again, it stays
    again_path = tmp_path / "again.ts"
    torch.jit.save(program, str(again_path))
    again = torch.jit.load(str(again_path))
    assert baked(again) == []
    with torch.inference_mode():
        assert torch.equal(again(x), unrewritten)


def _convolve(x, weight):
    return torch.nn.functional.conv2d(x, weight, padding=1)


class CallsATracedFunction(nn.Module):
    """A module whose forward calls a traced function: tracing records a `prim::CallFunction` to the function's
    own graph, with its convolution's flags baked in there."""

    def __init__(self, function):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(9, 3, 3, 3) / 9)
        self.function = function

    def forward(self, x):
        return self.function(x, self.weight).mean(dim=(2, 3))


def test_a_convolution_behind_a_traced_function_call_is_rewritten(tmp_path):
    torch.manual_seed(0)
    x = torch.rand(3, 3, 8, 8)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
        function = torch.jit.trace(_convolve, (x, torch.zeros(9, 3, 3, 3)))
        net = CallsATracedFunction(function).eval()
        traced = torch.jit.trace(net, x)
    assert any(node.kind() == "prim::CallFunction" for node in traced.graph.nodes())
    assert baked(traced) == [13]
    path = tmp_path / "calls.ts"
    torch.jit.save(traced, str(path))
    loaded = load_model(checkpoint=path, runtime=Runtime(torch.device("cpu")), trust=True)
    program = next(m for m in loaded.model.modules() if isinstance(m, Program)).program
    assert baked(program) == []
    with torch.inference_mode():
        assert torch.equal(program(x), net(x))


class Forks(nn.Module):
    """A module that runs two branches with `torch.jit.fork`: tracing records each in its fork node's subgraph, one
    with a convolution (its flags baked in there), the other calling a traced function (`prim::CallFunction`)."""

    def __init__(self, function):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(9, 3, 3, 3) / 9)
        self.other = nn.Parameter(torch.randn(9, 3, 3, 3) / 9)
        self.function = function

    def forward(self, x):
        first = torch.jit.fork(_convolve, x, self.weight)
        second = torch.jit.fork(self.function, x, self.other)
        return (torch.jit.wait(first) + torch.jit.wait(second)).mean(dim=(2, 3))


def test_a_convolution_in_a_forked_branch_is_rewritten(tmp_path):
    """A fork's subgraph is code no method's own nodes show: the rewrite reaches it, and the functions it calls."""
    torch.manual_seed(0)
    x = torch.rand(3, 3, 8, 8)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False, allow_tf32=True):
        function = torch.jit.trace(_convolve, (x, torch.zeros(9, 3, 3, 3)))
        net = Forks(function).eval()
        traced = torch.jit.trace(net, x)
    assert len(traced.graph.findAllNodes("prim::fork")) == 2
    assert baked(traced) == [13, 13]
    path = tmp_path / "forks.ts"
    torch.jit.save(traced, str(path))
    loaded = load_model(checkpoint=path, runtime=Runtime(torch.device("cpu")), trust=True)
    program = next(m for m in loaded.model.modules() if isinstance(m, Program)).program
    assert baked(program) == []
    with torch.inference_mode():
        assert torch.equal(program(x), net(x))
    again_path = tmp_path / "again.ts"  # the rewrite is the program's code
    torch.jit.save(program, str(again_path))
    assert baked(torch.jit.load(str(again_path))) == []


def test_an_in_memory_traced_module_is_rewritten_where_the_toolkit_wraps_it():
    """A ScriptModule handed to the Python API (the top, or a submodule of the user's module) never goes through
    the file loader: wrapping it rewrites it."""
    from tools.in9 import Normalization  # noqa: PLC0415
    from tools.models.boundary import ModelOrigin, wrap  # noqa: PLC0415
    from tools.models.record import ModelRecord  # noqa: PLC0415
    net, traced = traced_with_torchs_defaults(frozen=False)
    inner = traced_with_torchs_defaults(frozen=False)[1]
    holder = nn.Sequential(nn.Identity(), inner)
    x = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        before = traced(x)
    for model in (traced, holder):
        assert baked(model)
        loaded = wrap(model, num_classes=9, origin=ModelOrigin("module"), normalize=Normalization.NONE,
                      record=ModelRecord())
        assert baked(loaded.model) == []
        with torch.inference_mode():  # what runs is the rewritten code (a program that ran keeps its first code)
            assert torch.equal(loaded.model(x), before)
            assert "aten::_convolution" not in str(torch.jit.last_executed_optimized_graph())
    with torch.inference_mode():
        assert torch.equal(traced(x), before)
        assert torch.equal(traced(x), net(x))
    assert holder[1] is inner and baked(holder)  # the caller's module as it was: the copy is the toolkit's
