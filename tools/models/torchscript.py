"""TorchScript programs made to compute where and as the run says.

The graphs of every method of every module in them (frozen programs, called functions and methods, forked subgraphs
included) are rewritten once, before the first run:
- devices tracing wrote into the code as constants, which `.to()` does not move, point at the run's device;
- `aten::_convolution`, whose cuDNN flags tracing baked in (torch's defaults: TF32 on), becomes `aten::convolution` of
  the same first nine inputs, which reads the flags when it runs, as eager code does.

A program that has run once (tracing runs it) keeps running the code it ran first: a program in memory is rewritten as a
fresh copy (`rewritten`). What else tracing bakes, and why it is left: docs/how-it-works.md, "What is exact on each
device, and why" (traced convolutions).
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
    """Every node of a graph or block, nested blocks included; not the graphs a node holds (`subgraphs`)."""
    for node in block.nodes():
        yield node
        for inner in node.blocks():
            yield from graph_nodes(inner)


def subgraphs(graph):
    """The graphs the nodes of `graph` hold at any depth (a fork's, an awaitable's, any graph attribute)."""
    for node in graph_nodes(graph):
        for name in node.attributeNames():
            kind = node.kindOf(name)
            if kind == "g":
                yield node.g(name)
            elif kind == "gs":
                yield from node.gs(name)


def _inlined(graph):
    torch._C._jit_pass_inline(graph)
    held = list(subgraphs(graph))
    yield graph
    for sub in held:
        yield from _inlined(sub)


def method_graphs(module: torch.nn.Module):
    """Every method's graph of every TorchScript module in `module`, and the graphs its nodes hold, calls inlined first
    (as the graph executor does): all the code that runs."""
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
    """Replace every `aten::_convolution` by `aten::convolution` of its first nine inputs; how many. Equal to the
    unrewritten program where flags agree, and to eager code everywhere."""
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
    """How many `aten::_convolution` the TorchScript programs in `module` hold (read on copies: nothing changes)."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, torch.jit.ScriptModule):
            for name in sub._c._method_names():
                for graph in _inlined(sub._c._get_method(name).graph.copy()):
                    count += sum(node.kind() == BAKED_CONVOLUTION for node in graph_nodes(graph))
    return count


def rewritten(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with each TorchScript program that bakes a convolution replaced by a rewritten, reloaded copy (the
    caller's left as is). One that cannot be saved keeps its flags, with a warning."""
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
