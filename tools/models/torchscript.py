"""TorchScript programs made to compute where and as the run says, by rewriting the graphs of every method of
every module in them (frozen programs included), once, before the first run.

- Devices: tracing writes the device it ran on into the code as constants (`torch.zeros(..., device=x.device)`),
  which `.to()` does not move; they are pointed at the run's device.
- Function calls: a method calling a traced or scripted function (`prim::CallFunction`) or another module's method
  (`prim::CallMethod`) is inlined first, so the rewrites reach the callee's code too; every graph a node holds
  (`torch.jit.fork`'s subgraph, an awaitable's: code that runs beside the method's own) is rewritten as a graph
  of its own, its calls inlined as well.
- Convolutions: tracing records `aten::_convolution(..., benchmark, deterministic, cudnn_enabled, allow_tf32)`
  with cuDNN's flags of the tracing process as constants (torch's defaults: TF32 on, any algorithm), so the
  flags a `Runtime` sets never reach them. Each becomes `aten::convolution` of the same first nine inputs,
  which reads the flags when it runs, as eager code does.

Other constants of that kind that tracing bakes are left as they are, because they cannot change a result here:
`batch_norm`'s and `layer_norm`'s `cudnn_enabled` (`torch.backends.cudnn.enabled`, which the toolkit never turns
off) and `dropout`'s `train` (False in an eval-mode trace; a trace in training mode is refused by the start-up
check, `tools.models.device_check.training_mode_operations`). `scaled_dot_product_attention` stays one operation
whose backend is chosen when it runs (`tools.runtime.exact_kernels`). Not rewritten, and able to change the last
bits: `aten::_native_multi_head_attention`, which a MultiheadAttention traced under no_grad records and which the
`mha_fastpath` switch cannot reach; it still computes in fp32, by another kernel than the math backend.

A program that has run once (tracing runs it) keeps running the code it ran first, which no later rewrite
reaches: a program in memory is rewritten as a fresh copy (`rewritten`).
"""

from __future__ import annotations

import copy
import io
import logging

import torch

log = logging.getLogger(__name__)

BAKED_CONVOLUTION = "aten::_convolution"  # both forms: 13 inputs (with allow_tf32) and the older 12
CONVOLUTION = "aten::convolution"
CONVOLUTION_INPUTS = 9  # input, weight, bias, stride, padding, dilation, transposed, output_padding, groups


def graph_nodes(block):
    """Every node of a graph or block, the nodes of nested blocks (if, loop) included. A node may also hold graphs of
    its own (`subgraphs`): they are not entered here, since their nodes are inserted through their own graph."""
    for node in block.nodes():
        yield node
        for inner in node.blocks():
            yield from graph_nodes(inner)


def subgraphs(graph):
    """The graphs the nodes of `graph` hold (at any depth of blocks, not within each other): `torch.jit.fork`'s
    `Subgraph`, which runs the forked code, an awaitable's, any graph attribute."""
    for node in graph_nodes(graph):
        for name in node.attributeNames():
            kind = node.kindOf(name)
            if kind == "g":
                yield node.g(name)
            elif kind == "gs":
                yield from node.gs(name)


def _inlined(graph):
    """`graph` with its function and method calls inlined, then every graph its nodes hold, the same way."""
    torch._C._jit_pass_inline(graph)
    held = list(subgraphs(graph))
    yield graph
    for sub in held:
        yield from _inlined(sub)


def method_graphs(module: torch.nn.Module):
    """The graph of every method of every TorchScript module in `module`, and every graph its nodes hold (a forked
    call's), each with its function and method calls inlined first (`prim::CallFunction`, as to a traced or
    scripted function, hides the callee's code in a graph of its own that no module lists): the code that runs,
    all of it in graphs the rewrites see, each graph with nodes of its own (`graph_nodes`). Inlining is what the
    graph executor does before running them anyway."""
    for sub in module.modules():
        if isinstance(sub, torch.jit.ScriptModule):
            for name in sub._c._method_names():
                yield from _inlined(sub._c._get_method(name).graph)


def point_devices(module: torch.jit.ScriptModule, device: torch.device) -> set[str]:
    """Point every device constant in the code of the program's methods at `device`; the devices it named."""
    named = set()
    for graph in method_graphs(module):
        for node in list(graph_nodes(graph)):
            if node.kind() != "prim::Constant" or not isinstance(node.output().type(), torch._C.DeviceObjType):
                continue
            named.add(str(node.output().toIValue()))
            if node.output().toIValue() != device:
                with graph.insert_point_guard(node):
                    node.output().replaceAllUsesWith(graph.insertConstant(device))
                node.destroy()
    return named


def unbake_convolutions(module: torch.jit.ScriptModule) -> int:
    """Replace every `aten::_convolution` (its cuDNN flags fixed when traced) by `aten::convolution` of its first
    nine inputs (the flags read when it runs); how many were replaced. Equal to the unrewritten program wherever
    its flags agree with the process's, and to eager code everywhere."""
    count = 0
    for graph in method_graphs(module):
        for node in list(graph_nodes(graph)):
            if node.kind() != BAKED_CONVOLUTION:
                continue
            with graph.insert_point_guard(node):
                replacement = graph.insertNode(graph.create(CONVOLUTION, list(node.inputs())[:CONVOLUTION_INPUTS]))
            replacement.output().setType(node.output().type())
            node.output().replaceAllUsesWith(replacement.output())
            node.destroy()
            count += 1
    return count


def baked_convolutions(module: torch.nn.Module) -> int:
    """How many `aten::_convolution` the code of the TorchScript programs in `module` holds (read on copies of their
    graphs: nothing is changed)."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, torch.jit.ScriptModule):
            for name in sub._c._method_names():
                for graph in _inlined(sub._c._get_method(name).graph.copy()):
                    count += sum(node.kind() == BAKED_CONVOLUTION for node in graph_nodes(graph))
    return count


def rewritten(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with the convolutions of every TorchScript program in it reading the run's flags, as they run: each
    program (the module itself or one inside it) that bakes a convolution is replaced by a copy, saved and loaded
    again so that no graph executor holds its old code, with its convolutions rewritten (`unbake_convolutions`)
    before it first runs. The caller's module is left as it is: the modules on the way to a replaced program are
    shallow copies (their parameters and the other submodules shared). A program that cannot be saved (code left
    in Python, `torch.jit.ignore`) keeps its flags, with a warning; the start-up device check still measures what
    it computes."""
    if isinstance(module, torch.jit.ScriptModule):
        if not baked_convolutions(module):
            return module
        buffer = io.BytesIO()
        try:
            torch.jit.save(module, buffer)
        except Exception as exc:  # noqa: BLE001 (TorchScript's errors for what it cannot serialise)
            log.warning("a TorchScript program's convolutions keep the cuDNN flags they were traced with (TF32 on, by "
                        "torch's defaults): it cannot be copied to rewrite them (%s)", str(exc).splitlines()[0])
            return module
        buffer.seek(0)
        fresh = torch.jit.load(buffer)
        unbake_convolutions(fresh)
        return fresh
    replaced = {name: rewritten(child) for name, child in module.named_children()}
    changed = {name: new for name, new in replaced.items() if new is not module._modules[name]}
    if not changed:
        return module
    holder = copy.copy(module)
    holder._modules = {**module._modules, **changed}
    return holder
