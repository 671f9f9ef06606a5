"""arch_mods: the opt-in LRM architecture Mods, applied to a Dynamo graph (torch-level IR,
what a torch.compile backend receives), before AOTAutograd and Inductor.

They change the model, so each runs only when named in `LokaConfig.arch_mods`:

    blocknorm   layer_norm(x, (D,), w, b, eps)        ->  block_norm(x, eps=eps, weight=w, bias=b)
                (F.layer_norm, torch.layer_norm, aten.layer_norm, nn.LayerNorm modules)
                declines: a norm over more than the last dimension, normalized_shape (C, D)
    hardswish   silu(x, inplace)                      ->  hardswish(x, inplace)
                (F.silu, aten.silu, nn.SiLU modules)
    no_bias     linear(x, w, b)                       ->  linear(x, w)
                (F.linear, aten.linear, nn.Linear modules)
                declines: heads, and linears without a bias

A head is a linear whose output reaches a graph output along some path that passes
through no other linear (the final projection, each task tower's last layer, a linear
whose output is also returned). The rule is per graph: with a graph break, the last
linears before the break count as heads and keep their bias. Bias parameters that a
rewritten linear no longer reads stay in the model, unused (their .grad stays None).

`block_norm` (kernels/block_norm.py) is a plain function; AOTAutograd traces it into ATen
ops, so the rewritten graph compiles with `compile_fx` like any other. The head rule is a
reachability question over the whole graph, so this pass walks nodes rather than using
Inductor's pattern matcher.
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

from loka_compile.kernels.block_norm import block_norm

ARCH_MODS = ("blocknorm", "no_bias", "hardswish")

_LAYER_NORMS = {F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm, torch.ops.aten.layer_norm.default}
_LINEARS = {F.linear, torch.ops.aten.linear, torch.ops.aten.linear.default}
_SILU_TO_HARDSWISH = {
    F.silu: F.hardswish,
    torch.ops.aten.silu: torch.ops.aten.hardswish,
    torch.ops.aten.silu.default: torch.ops.aten.hardswish.default,
}


def apply_arch_mods(gm: torch.fx.GraphModule, mods) -> dict[str, int]:
    """Rewrite `gm` in place with each Mod named in `mods` (names in ARCH_MODS); return
    the number of rewrites per named Mod. `mods=()` leaves `gm` untouched and returns {}."""
    unknown = [m for m in mods if m not in ARCH_MODS]
    if unknown:
        raise ValueError(f"unknown arch_mods {unknown}; valid arch_mods: {list(ARCH_MODS)}")
    if not mods:
        return {}
    rewrites = {"blocknorm": _to_block_norm, "hardswish": _to_hardswish, "no_bias": _drop_biases}
    counts = {mod: rewrites[mod](gm) for mod in dict.fromkeys(mods)}
    gm.graph.lint()
    gm.recompile()
    return counts


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _module(gm: torch.fx.GraphModule, node: torch.fx.Node, kind: type):
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, kind) else None


def _param(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str):
    """A get_attr node for parameter `name` of the module that call_module `node` calls."""
    if getattr(gm.get_submodule(node.target), name) is None:
        return None
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(f"{node.target}.{name}")


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, target, args, kwargs) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args, kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _to_block_norm(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        module = _module(gm, node, torch.nn.LayerNorm)
        if module is not None:
            shape, eps = module.normalized_shape, module.eps
            if len(shape) != 1:
                continue
            weight, bias = _param(gm, node, "weight"), _param(gm, node, "bias")
        elif node.op == "call_function" and node.target in _LAYER_NORMS:
            shape = _arg(node, 1, "normalized_shape")
            if not isinstance(shape, int) and len(shape) != 1:
                continue
            weight, bias, eps = _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5)
        else:
            continue
        _replace(gm, node, block_norm, (_arg(node, 0, "input"),), {"eps": eps, "weight": weight, "bias": bias})
        count += 1
    return count


def _to_hardswish(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        module = _module(gm, node, torch.nn.SiLU)
        if module is not None:
            _replace(gm, node, F.hardswish, (_arg(node, 0, "input"),), {"inplace": module.inplace})
        elif node.op == "call_function" and node.target in _SILU_TO_HARDSWISH:
            node.target = _SILU_TO_HARDSWISH[node.target]
        else:
            continue
        count += 1
    return count


def _is_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _LINEARS) or \
        _module(gm, node, torch.nn.Linear) is not None


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


def _drop_biases(gm: torch.fx.GraphModule) -> int:
    heads = _heads(gm)
    count = 0
    for node in list(gm.graph.nodes):
        if node in heads or not _is_linear(gm, node):
            continue
        if node.op == "call_module":
            if gm.get_submodule(node.target).bias is None:
                continue
            _replace(gm, node, F.linear, (_arg(node, 0, "input"), _param(gm, node, "weight")), {})
        else:
            bias = _arg(node, 2, "bias")
            if bias is None:
                continue
            node.args, node.kwargs = (_arg(node, 0, "input"), _arg(node, 1, "weight")), {}
            if isinstance(bias, torch.fx.Node) and bias.op == "get_attr" and not bias.users:
                gm.graph.erase_node(bias)
        count += 1
    return count
