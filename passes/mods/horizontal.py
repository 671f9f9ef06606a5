"""horizontal: sibling linears that read the same input become one GEMM. A Mod that
is on by default (`disabled_mods=["horizontal"]` switches it off); it runs on the Dynamo
graph (torch-level IR), before AOTAutograd, so the backward follows from the forward.

Matches, in a Dynamo graph, n >= 2 linears (`torch._C._nn.linear`, `F.linear`,
`aten.linear`, `nn.Linear` call_module nodes) whose input is the same node x:

    y_1 = linear(x, W_1, b_1)                 W = cat([W_1, ..., W_n], 0)     # (N_1+...+N_n, K)
    ...                                  ->   b = cat([b_1, ..., b_n], 0)     # zeros(N_i) for a
    y_n = linear(x, W_n, b_n)                 y = linear(x, W, b)             #   sibling without bias
                                              y_1, ..., y_n = split(y, [N_1, ..., N_n], -1)

(b is dropped when no sibling has a bias; the split is `unsafe_split_with_sizes`, whose
outputs autograd does not treat as views of one buffer, so a consumer may modify one in
place as it could a linear's own output; AOTAutograd functionalizes that.) The math is the
model's; only the GEMM's rounding order changes. What it buys: the shared input is cast to FP8 once instead of n
times in the forward; in the backward the siblings' dgrads become one GEMM over the
concatenated N (their sum is the GEMM's reduction) and their wgrads one GEMM that reads x
once; one bigger GEMM, where FP8 pays more (MaskNet's 8 MaskBlocks each apply
Linear(1728 -> 3456) to the same embeddings: one 1728 -> 27648 GEMM).

Declines a linear (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module      its module is under `exclude_modules` (the exclusion stays exact)
    single_linear        no other linear reads its input
    other_state_region   the other linears of its input run under another grad mode or autocast
                         state (`with torch.no_grad()`, `torch.autocast(...)` between them): fused,
                         one would pass gradients eager does not, or compute in another dtype
    depends_on_sibling   its weight or bias is computed from another sibling's output
                         (the fused GEMM would depend on itself)
    weight_not_parameter its weight or bias is not an nn.Parameter graph input or a
                         get_attr, or not 2-D / 1-D (a computed weight such as
                         weight_norm's or LoRA's; a plain-tensor input from
                         functional_call, which loka tells from a weight only by its path
                         to the linear, and the concatenation would hide that)
    k_or_dtype_differs   no other sibling has its weight's K, dtype and device
    repeated_call        the same linear (weight and bias, or nn.Linear module) applied
                         to x again in the same state region, as DeepCTR's per-field
                         bilinear layer does: its users read the first call's output, so
                         the product is computed once
                         (AOTAutograd's CSE keeps both calls' GEMMs, forward and backward:
                         torch 2.13; fused, each repeat would concatenate the weight again);
                         where either output may be written in place or is a graph output,
                         the repeat stays its own linear
    not_worth_it         (n - 1) * M < N_1 + ... + N_n: concatenating the weights copies
                         K * N_total values every step, more than the (n - 1) * M * K input
                         reads the fusion saves (M: the input's rows; a symbolic M counts
                         as its hint; byte accounting, not yet timed on a GPU)

The bodies of higher-order ops that call a graph module on the operands that follow it (an
activation-checkpointed region is one) are fused the same way, each graph all or nothing;
a body's weights count as parameters where the op's operands are.

In inference graphs the `cached_weights` Mod keeps the concatenated weight's FP8 copy, made
once per version of the siblings' weights; a fused site left in bf16 concatenates its
weights on every call, which the not_worth_it rule bounds.

Inductor's pattern matcher (DESIGN convention 5) matches fixed patterns; a sibling group
has any number of members, found by grouping the users of each node, so this pass walks
the graph.

The fused linear's module path (`nn_module_stack`, which names its forward, dgrad and
wgrad sites in the report) joins the siblings' paths: the common prefix and suffix, the
differing middle in braces, "blocks.{0,1,2}.mask.0", or "{a,b}" when nothing is shared.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator

import torch

from ..dynamo_graph import (LINEARS, Rewrites, arg, copy_provenance, fake_mode, fetch_attr, graph_inputs,
                            matches_to_rewrite, module_of, module_stack, set_example_values, state_regions,
                            tensor_of, written_or_returned)
from ..rewrite import all_or_nothing
from .mod import Evidence, Mod, Stage, total

log = logging.getLogger("loka.passes")

@dataclasses.dataclass
class HorizontalFusion(Rewrites):
    """What the pass did to one graph: `rewritten` fused GEMMs made, which replaced `linears` linears."""

    linears: int = 0


@dataclasses.dataclass
class _Linear:
    node: torch.fx.Node
    x: torch.fx.Node
    weight: object        # fx.Node (or None for a call_module found to lack one)
    bias: object          # fx.Node or None
    module: str
    call_module: str = ""  # target of an nn.Linear call_module node


def joined_module_path(paths) -> str:
    """"blocks.0.mask.0", "blocks.1.mask.0" -> "blocks.{0,1}.mask.0"; "a", "b" -> "{a,b}"."""
    parts = [p.split(".") if p else [] for p in paths]
    if all(p == parts[0] for p in parts):
        return ".".join(parts[0])
    head = 0
    while all(len(p) > head for p in parts) and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while all(len(p) - head > tail for p in parts) and len({p[len(p) - 1 - tail] for p in parts}) == 1:
        tail += 1
    middles = [".".join(p[head:len(p) - tail]) for p in parts]
    return ".".join([*parts[0][:head], "{" + ",".join(middles) + "}", *parts[0][len(parts[0]) - tail:]])


def _linear_of(gm, node, inputs: dict) -> "_Linear | None":
    """The linear `node` computes, else None."""
    if node.op == "call_function" and node.target in LINEARS:
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        if isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node) \
                and (b is None or isinstance(b, torch.fx.Node)):
            return _Linear(node, x, w, b, module_of(node))
    elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Linear):
        x = arg(node, 0, "input")
        if isinstance(x, torch.fx.Node):
            return _Linear(node, x, None, None, node.target, call_module=node.target)
    return None


def _decline_reason(gm, lin: _Linear, inputs: dict) -> None:
    """Every reason but an excluded module depends on the linear's siblings (a repeat of a linear with a
    computed weight still reads the first call's output), so the groups decide them."""
    return None


def _ancestors(nodes) -> set:
    seen, stack = set(), [n for n in nodes if isinstance(n, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _rows(x: torch.fx.Node, inputs: dict):
    value = inputs.get(x, x.meta.get("example_value", x.meta.get("val")))
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    rows = 1
    for size in value.shape[:-1]:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            if hint is None:
                return None
            size = hint
        rows *= int(size)
    return rows


def fuse_sibling_linears(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> HorizontalFusion:
    """Fuse each group of sibling linears of `gm` in place (module docstring); return what
    was fused and declined. `example_inputs`: the graph's inputs in placeholder order (what
    tells a Parameter)."""
    result = HorizontalFusion()
    inputs = graph_inputs(gm, example_inputs)
    regions = state_regions(gm.graph)
    by_input = collections.defaultdict(list)  # (x, state region) -> its linears
    for _, lin in matches_to_rewrite(gm, example_inputs, "horizontal", _linear_of, _decline_reason, result.declined,
                                     exclude_modules):
        by_input[(lin.x, regions[lin.node])].append(lin)
    inputs_read = collections.Counter(x for x, _ in by_input)

    def decline(lins, reason):
        for lin in lins:
            result.declined[reason] += 1
            log.debug("horizontal: %s (%s) declined: %s", lin.node.name, lin.module or "<root>", reason)

    groups, repeats = [], []
    for (x, _), lins in by_input.items():
        lins = _first_calls(lins, repeats, decline)
        if len(lins) < 2:
            decline(lins, "other_state_region" if inputs_read[x] > 1 else "single_linear")
            continue
        outputs = {lin.node for lin in lins}
        candidates = []
        for lin in lins:
            if lin.call_module:
                candidates.append(lin)
            elif _ancestors([lin.weight, lin.bias]) & (outputs - {lin.node}):
                decline([lin], "depends_on_sibling")
            else:
                candidates.append(lin)
        by_kind = collections.defaultdict(list)
        for lin in candidates:
            key = _weight_key(gm, lin, inputs)
            if key is None:
                decline([lin], "weight_not_parameter")
            else:
                by_kind[key].append(lin)
        for key, members in by_kind.items():
            if len(members) < 2:
                decline(members, "k_or_dtype_differs" if len(candidates) > 1 else "single_linear")
                continue
            n_total = sum(_weight_shape(gm, lin, inputs)[0] for lin in members)
            rows = _rows(x, inputs)
            if rows is not None and (len(members) - 1) * rows < n_total:
                decline(members, "not_worth_it")
                continue
            groups.append(members)

    for body, body_inputs in _bodies(gm, inputs):  # higher-order ops' bodies: checkpointed regions, ...
        result.add(fuse_sibling_linears(body, body_inputs, exclude_modules=exclude_modules))
    if not groups and not repeats:
        return result
    with all_or_nothing(gm):
        for repeat, first in repeats:
            repeat.node.replace_all_uses_with(first.node)
            gm.graph.erase_node(repeat.node)
        for members in groups:
            _fuse(gm, members, inputs)
            result.rewritten += 1
            result.linears += len(members)
            result.modules.append(joined_module_path([lin.module for lin in members]))
            log.debug("horizontal: fused %d linears into %s", len(members), result.modules[-1])
    return result


def _first_calls(lins: list, repeats: list, decline) -> list:
    """The linears of one input less the repeats of one linear (the same weight and bias,
    or the same nn.Linear module) on it. A repeat joins `repeats` with its first call,
    whose output it will read, unless either output may be written in place or leaves the
    graph (then the two must stay different tensors; the repeat stays a linear of its
    own, unfused)."""
    first, kept = {}, []
    for lin in lins:
        key = ("module", lin.call_module) if lin.call_module else ("function", lin.weight, lin.bias)
        if key not in first:
            first[key] = lin
            kept.append(lin)
            continue
        decline([lin], "repeated_call")
        if not any(written_or_returned(lin.node) + written_or_returned(first[key].node)):
            repeats.append((lin, first[key]))
    return kept


def _bodies(gm: torch.fx.GraphModule, inputs: dict) -> list:
    """(body, its inputs' values in placeholder order) of each higher-order op that calls a
    graph module of `gm` on the arguments after it (activation checkpointing's
    `tag_activation_checkpoint(body, *args)`, the `wrap_with_*` ops): the values are the
    arguments' (a Parameter where the argument is one), so that the body's weights count as
    parameters. Ops that pass their operands otherwise (cond, map) are left alone."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        for i, value in enumerate(node.args):
            body = fetch_attr(gm, value.target) if isinstance(value, torch.fx.Node) and value.op == "get_attr" else None
            if isinstance(body, torch.fx.GraphModule):
                break
        else:
            continue
        operands = node.args[i + 1:]
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(operands) != len(placeholders) or not all(isinstance(a, torch.fx.Node) for a in operands):
            continue
        values = [tensor_of(gm, a, inputs)[0] if a.op in ("placeholder", "get_attr")
                  else a.meta.get("example_value", a.meta.get("val")) for a in operands]
        if any(isinstance(v, torch.fx.GraphModule) for v in values):
            continue
        found.append((body, values))
    return found


def _params(gm, lin: _Linear):
    """(weight, bias) tensors of a call_module linear."""
    module = gm.get_submodule(lin.call_module)
    return module.weight, module.bias


def _weight_shape(gm, lin: _Linear, inputs: dict):
    if lin.call_module:
        return tuple(_params(gm, lin)[0].shape)
    return tuple(tensor_of(gm, lin.weight, inputs)[0].shape)


def _weight_key(gm, lin: _Linear, inputs: dict):
    """(K, dtype, device) of a linear whose weight and bias are parameters, else None."""
    if lin.call_module:
        weight, bias = _params(gm, lin)
    else:
        weight, is_param = tensor_of(gm, lin.weight, inputs)
        if weight is None or not is_param:
            return None
        bias = None
        if lin.bias is not None:
            bias, is_param = tensor_of(gm, lin.bias, inputs)
            if bias is None or not is_param:
                return None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if bias is not None and (bias.dim() != 1 or bias.dtype != weight.dtype or bias.shape[0] != weight.shape[0]):
        return None
    return int(weight.shape[1]), weight.dtype, weight.device


def _fused_meta(members) -> dict:
    """The first sibling's metadata, with an nn_module_stack that names all siblings: their
    common ancestors, then one entry whose path is the joined path."""
    meta = {k: v for k, v in members[0].node.meta.items() if k not in ("example_value", "val")}
    stacks = [list(module_stack(lin.node).items()) for lin in members]
    common = []
    for entries in zip(*stacks):
        if any(e != entries[0] for e in entries):
            break
        common.append(entries[0])
    paths = [lin.module for lin in members]
    joined = joined_module_path(paths)
    if joined not in paths:
        common.append((f"horizontal:{joined}", (joined, torch.nn.Linear)))
    meta["nn_module_stack"] = dict(common)
    return meta


def _fuse(gm: torch.fx.GraphModule, members, inputs: dict) -> None:
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min((lin.node for lin in members), key=order.get)
    with graph.inserting_before(first):
        for lin in members:
            if lin.call_module:
                lin.weight = graph.get_attr(f"{lin.call_module}.weight")
                lin.bias = graph.get_attr(f"{lin.call_module}.bias") if _params(gm, lin)[1] is not None else None
    for lin in members:
        for node in (lin.weight, lin.bias):
            # A get_attr after the insertion point moves up (it reads nothing).
            if node is not None and node.op == "get_attr" and order.get(node, -1) > order[first]:
                first.prepend(node)
    sizes = [_weight_shape(gm, lin, inputs)[0] for lin in members]
    any_bias = any(lin.bias is not None for lin in members)
    new = []
    with graph.inserting_before(first):
        biases = []
        for lin, n in zip(members, sizes):
            if lin.bias is not None:
                biases.append(lin.bias)
            elif any_bias:
                weight = _params(gm, lin)[0] if lin.call_module else tensor_of(gm, lin.weight, inputs)[0]
                biases.append(graph.call_function(torch.zeros, (n,), {"dtype": weight.dtype, "device": weight.device}))
                new.append(biases[-1])
        new.append(graph.call_function(torch.cat, ([lin.weight for lin in members], 0)))
        if any_bias:
            new.append(graph.call_function(torch.cat, (biases, 0)))
        fused = graph.call_function(torch._C._nn.linear, (members[0].x, new[-2] if any_bias else new[-1],
                                                          new[-1] if any_bias else None))
        fused.meta.update(_fused_meta(members))
        parts = graph.call_function(torch.unsafe_split_with_sizes, (fused, sizes, -1))
        outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(members))]
        new += [fused, parts, *outs]
    set_example_values(gm, new, fake_mode([members[0].x, *(lin.weight for lin in members)]))
    for lin, out in zip(members, outs):
        copy_provenance(lin.node, [out])
        if "example_value" not in out.meta and "example_value" in lin.node.meta:
            out.meta["example_value"] = lin.node.meta["example_value"]
        lin.node.replace_all_uses_with(out)
        graph.erase_node(lin.node)


def _count(evidence: Evidence) -> dict:
    runs = evidence.results_of(MOD)
    return {"horizontal": total(runs, "rewritten"), "horizontal_linears": total(runs, "linears")}


MOD = Mod("horizontal", Stage.DYNAMO_GRAPH, True, "sibling linears that read one input fused into one GEMM",
          counters=("horizontal", "horizontal_linears"), count=_count, if_failed="its linears stay apart",
          run=lambda gm, example_inputs, config: fuse_sibling_linears(gm, example_inputs,
                                                                      exclude_modules=config.exclude_modules))
