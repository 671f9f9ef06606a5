"""no_bias (opt-in architecture Mod, `arch_mods=["no_bias"]`): on the Dynamo graph, linears
lose their bias, except heads, so their GEMM epilogue has nothing to add. It changes the model.

    linear(x, w, b)  ->  linear(x, w)          (F.linear, aten.linear, nn.Linear modules)
    declines: heads, and linears without a bias

A head is a linear whose output reaches a graph output along some path that passes through no
other linear (the final projection, each task tower's last layer, a linear whose output is also
returned). The rule is per graph: with a graph break, the last linears before the break count as
heads and keep their bias. Bias parameters that a rewritten linear no longer reads stay in the
model, unused (their .grad stays None). The head rule is a reachability question over the whole
graph, so this Mod walks nodes rather than using Inductor's pattern matcher.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

from ..dynamo_graph import arg, called_module, module_parameter, replace_call
from .mod import Mod, Stage, total_of_counts

_LINEARS = {F.linear, torch.ops.aten.linear, torch.ops.aten.linear.default}


def _is_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _LINEARS) or \
        called_module(gm, node, torch.nn.Linear) is not None


def _heads(gm: torch.fx.GraphModule) -> set:
    """Linears reached walking back from the output without crossing another linear."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    heads, seen, todo = set(), {output}, collections.deque([output])
    while todo:
        for producer in todo.popleft().all_input_nodes:
            if producer in seen:
                continue
            seen.add(producer)
            if _is_linear(gm, producer):
                heads.add(producer)
            else:
                todo.append(producer)
    return heads


def drop_biases(gm: torch.fx.GraphModule) -> int:
    heads = _heads(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if node in heads or not _is_linear(gm, node):
            continue
        if node.op == "call_module":
            if gm.get_submodule(node.target).bias is None:
                continue
            replace_call(gm, node, F.linear, (arg(node, 0, "input"), module_parameter(gm, node, "weight")), {})
        else:
            bias = arg(node, 2, "bias")
            if bias is None:
                continue
            node.args, node.kwargs = (arg(node, 0, "input"), arg(node, 1, "weight")), {}
            if isinstance(bias, torch.fx.Node) and bias.op == "get_attr" and not bias.users:
                gm.graph.erase_node(bias)
        count += 1
    return count


MOD = Mod("no_bias", Stage.DYNAMO_GRAPH, False, "linears lose their bias, except heads", arch=True,
          counters=("arch:no_bias",), count=total_of_counts("arch:no_bias", "no_bias"), run=drop_biases)
