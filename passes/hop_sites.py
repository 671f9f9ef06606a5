"""hop_sites: record each GEMM inside the body of a higher-order op as a site that stays in
high precision. Changes nothing.

Matches: each call of a higher-order op that takes graph modules (its bodies): the two
branches of `torch.cond`, the condition and body of `while_loop`, an `invoke_subgraph`
region (`torch.compiler.nested_compile_region`; training graphs get it inlined), `map`,
`scan`, and the ops nested in a body; each GEMM of a body (`find_sites.GEMM_OPS`), once
per call of the op (a region called twice has its GEMMs twice).

Records: a Site per such GEMM and call, as `find_sites` records one of the graph's own:
module path (the body node's module stack), M x K x N, and role: fwd in forward and
inference graphs; in a backward graph a body's inputs that carry the incoming gradient
are those whose operand of the op does (cond, while_loop and invoke_subgraph pass the
operands after their bodies to each body's inputs one to one; an op that does not is
taken to pass it to all), so a GEMM that reads none is a forward one recomputed
(`<module>:fwd:recomputed`), one whose result becomes a weight's gradient (through the
op's outputs) is wgrad, any other dgrad. Its id continues the graph's numbering
(`<kind>/<module>:<role>#<n>`); its key names the op's node and the body.

Declines: every one, `Reason.HIGHER_ORDER_OP`, the op and the body in the detail. Inductor
runs its post-grad passes on each body as a graph of its own, before the graph that calls
it, and loka's passes leave bodies as they are (`inductor_passes.in_higher_order_op_body`). A body's
inputs are the op's operands, not the compiled graph's: nothing there says which are
weights, and a cached FP8 weight read in a branch is a graph constant the branch's
compiled code cannot see (the graph failed at its first call); the Probe's observers
there would report under keys no verdict reaches, and FP8 rewrites made there ran
unreported (a `torch.cond` tower's output off eager's by 3-7% while the report listed
no site in it).
"""

from __future__ import annotations

import functools
import operator

import torch

from .context import Decision, GraphKind, PassContext, Reason
from .find_sites import (GEMM_OPS, GRAD_ACCUMULATE, gemm_role, gemm_site, gradient_nodes, module_path, operands,
                         site_base, weight_gradient_gemms)

# How the detail names the ops users write.
_OP_NAMES = {"cond": "torch.cond", "while_loop": "while_loop",
             "invoke_subgraph": "invoke_subgraph (a nested_compile_region)"}


def _is_hop(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and isinstance(node.target, torch._ops.HigherOrderOperator)


def _fetch(module: torch.nn.Module, target: str):
    return functools.reduce(lambda m, name: getattr(m, name, None), target.split("."), module)


def _bodies(node: torch.fx.Node, module: torch.nn.Module) -> tuple[list, list]:
    """([(attribute name, graph module)] of the bodies a higher-order op's call takes,
    [the nodes of its operands after the last body, in order])."""
    bodies, last = [], -1
    for i, arg in enumerate(node.args):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            body = _fetch(module, arg.target)
            if isinstance(body, torch.fx.GraphModule):
                bodies.append((arg.target, body))
                last = i
    inputs = []
    torch.fx.node.map_arg((node.args[last + 1:], node.kwargs), inputs.append)
    return bodies, inputs


def _weight_gradient_outputs(graph: torch.fx.Graph, indices) -> dict:
    """Higher-order op node -> indices of its outputs that become (part of) a weight's
    gradient: reached from the graph's outputs at `indices` through the ops a gradient
    passes on its way there (`find_sites.GRAD_ACCUMULATE`)."""
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    stack = [results[i] for i in indices if i < len(results) and isinstance(results[i], torch.fx.Node)]
    found, seen = {}, set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is operator.getitem and _is_hop(node.args[0]):
            found.setdefault(node.args[0], set()).add(node.args[1])
        elif node.target in GRAD_ACCUMULATE:
            stack.extend(node.all_input_nodes)
    return found


def _gradients_from(graph: torch.fx.Graph, seeds: set) -> set:
    """Nodes whose value depends on one of `seeds`."""
    marked = set(seeds)
    for node in graph.nodes:
        if node not in marked and any(inp in marked for inp in node.all_input_nodes):
            marked.add(node)
    return marked


def hop_sites(graph: torch.fx.Graph, ctx: PassContext) -> int:
    backward = ctx.kind is GraphKind.BACKWARD
    names_seen: dict = {}
    for site in ctx.sites:  # this graph's own sites, numbered first
        base = site.id.split("/", 1)[-1].rsplit("#", 1)[0]
        names_seen[base] = names_seen.get(base, 0) + 1
    grads = gradient_nodes(graph) if backward else set()
    weight_outputs = _weight_gradient_outputs(graph, ctx.param_input_indices) if backward else {}
    before = len(ctx.sites)
    _record_calls(graph, graph.owning_module, ctx, f"{ctx.graph}/{ctx.kind.value}/", grads, weight_outputs,
                  names_seen)
    return len(ctx.sites) - before


def _record_calls(graph: torch.fx.Graph, module, ctx: PassContext, prefix: str, grads: set, weight_outputs: dict,
                  names_seen: dict) -> None:
    """Record the GEMMs of the bodies of each higher-order op `graph` calls, nested ones
    included; `grads`: the nodes of `graph` that carry the incoming gradient (backward),
    `weight_outputs`: `_weight_gradient_outputs` of `graph`."""
    backward = ctx.kind is GraphKind.BACKWARD
    for node in graph.nodes:
        if not _is_hop(node):
            continue
        bodies, inputs = _bodies(node, module)
        name = node.target.name()
        for attr, body in bodies:
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            body_grads, wgrads, body_weight_outputs = set(), set(), {}
            if backward:
                known = len(inputs) == len(placeholders)
                seeds = {p for p, arg in zip(placeholders, inputs) if arg in grads} if known else set(placeholders)
                body_grads = _gradients_from(body.graph, seeds)
                indices = frozenset(weight_outputs.get(node, ()))
                wgrads = weight_gradient_gemms(body.graph, indices, body_grads)
                body_weight_outputs = _weight_gradient_outputs(body.graph, indices)
            where = f"{prefix}{node.name}.{attr}."
            detail = (f"inside {_OP_NAMES.get(name, name)} (body {attr}): loka does not rewrite the bodies of "
                      f"higher-order ops")
            for gemm in body.graph.nodes:
                if gemm.op == "call_function" and gemm.target in GEMM_OPS \
                        and all(isinstance(op.meta.get("val"), torch.Tensor) for op in operands(gemm)[:2]):
                    _record(gemm, ctx, where, detail, body_grads, wgrads, names_seen)
            _record_calls(body.graph, body, ctx, where, body_grads, body_weight_outputs, names_seen)


def _record(node: torch.fx.Node, ctx: PassContext, where: str, detail: str, grads: set, wgrads: set,
            names_seen: dict) -> None:
    role, recomputed = gemm_role(node, ctx.kind, grads, wgrads)
    module = module_path(node)
    base = site_base(module, role, recomputed)
    names_seen[base] = names_seen.get(base, 0) + 1
    # A body's nodes carry the op's sequence number, not their own: it would link them all.
    site = gemm_site(node, ctx, base, names_seen[base], role, module, None, grads, {})
    ctx.sites.append(site)
    ctx.decisions[site.id] = Decision(fp8=False, reason=Reason.HIGHER_ORDER_OP, detail=detail)
