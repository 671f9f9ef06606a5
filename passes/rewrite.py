"""Graph surgery the passes share: insert the traced graph of a function, or replace one
node with it.

`replace_with_traced(node, fn, args)` traces `fn(*args)` with the fake values of the
argument nodes (Inductor's `fwd_only`, the tracer its pattern matcher uses for
replacements), inlines the traced nodes before `node` with their fake values as
metadata, and points every user of `node` at the result. Symbolic sizes stay symbolic;
a function that branches on one would add a guard, so the functions traced here never
do. A replacement whose result has another rank, dtype or size than the node's is refused
(`MisshapedReplacement`, the graph left as it was): its readers, and a backward graph's
caller (autograd checks each gradient's shape), would get another tensor than the graph
promised. Strides may differ (a padded GEMM's output is a slice).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true


class MisshapedReplacement(ValueError):
    """A rewrite whose result is not the tensor the replaced node promised."""


def _fake_value(arg):
    if isinstance(arg, torch.fx.Node):
        return arg.meta["val"]
    return arg


def insert_traced(before: torch.fx.Node, fn, args: list, meta_from: torch.fx.Node):
    """Insert the nodes of `fn(*args)` (args: nodes carrying a fake "val") before `before`,
    their provenance metadata copied from `meta_from`. Returns (the inserted nodes, the
    node or tuple of nodes `fn` returned)."""
    graph = before.graph
    values = [_fake_value(a) for a in args]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        traced = fwd_only(fn, values, run_functional_passes=False)
    env: dict = {}
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    inserted = []
    result = None
    with graph.inserting_before(before):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = torch.fx.map_arg(n.args[0], lambda x: env[x])
                continue
            new = graph.node_copy(n, lambda x: env[x])
            for key in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "seq_nr", "original_aten"):
                if key in meta_from.meta and key not in new.meta:
                    new.meta[key] = meta_from.meta[key]
            env[n] = new
            inserted.append(new)
    return inserted, result


def replace_with_traced(node: torch.fx.Node, fn, args: list) -> list:
    """Replace `node` with the nodes of `fn(*args)` (args: nodes carrying a fake "val").
    Returns the inserted nodes."""
    inserted, result = insert_traced(node, fn, args, meta_from=node)
    why = "" if isinstance(result, torch.fx.Node) else f"returns {result!r}, not one tensor"
    if not why:
        why = _differs(node.meta.get("val"), result.meta.get("val"))
    if why:
        for new in reversed(inserted):
            node.graph.erase_node(new)
        raise MisshapedReplacement(f"replacement for {node.name} ({node.target}) refused: {why}")
    node.replace_all_uses_with(result)
    node.graph.erase_node(node)
    return inserted


def _differs(before, after) -> str:
    """Why a replacement's value `after` is not the node's value `before` (rank, dtype, a size
    provably different), "" when it may stand for it."""
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return "" if not isinstance(before, torch.Tensor) else "no tensor value"
    if after.dim() != before.dim() or after.dtype != before.dtype or any(
            statically_known_true(a != b) for a, b in zip(after.shape, before.shape)):
        return f"gives {after.dtype} {list(after.shape)} where the node gives {before.dtype} {list(before.shape)}"
    return ""


def users_within(node: torch.fx.Node, limit: int) -> list:
    """The call_function nodes reachable from `node` through its users, breadth first, at
    most `limit` of them: where a pattern rooted downstream of `node` may end."""
    frontier, seen = [node], []
    while frontier and len(seen) < limit:
        current = frontier.pop(0)
        for user in current.users:
            if user not in seen and user.op == "call_function":
                seen.append(user)
                frontier.append(user)
    return seen


@contextlib.contextmanager
def all_or_nothing(gm: torch.fx.GraphModule):
    """The rewrites of `gm`'s graph made inside either all land (the graph linted, the module
    recompiled) or, on any error, none: the graph is restored and the error raised."""
    pristine = copy.deepcopy(gm.graph)
    # Dynamo tags its placeholders with an attribute AOTAutograd reads; a deep copy drops it.
    for original, kept in zip(gm.graph.find_nodes(op="placeholder"), pristine.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            kept._dynamo_source = original._dynamo_source
    try:
        yield
        gm.graph.lint()
    except Exception:
        gm.graph = pristine
        gm.recompile()
        raise
    gm.recompile()
