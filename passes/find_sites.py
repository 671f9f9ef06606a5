"""find_sites: record every GEMM of an ATen graph as a Site. Changes nothing.

Matches:
    aten.mm(A, B)            aten.addmm(bias, A, B, beta, alpha)
    aten.bmm(A, B)           aten.baddbmm(bias, A, B, beta, alpha)
(`linear`, `matmul`, `einsum` and `x @ w` with 2-D or 3-D inputs, transposed or not, reach
the post-grad graph as these after AOTAutograd's decompositions.) A bmm/baddbmm that is one
2-D GEMM is recorded as one, folded (`batch_fold`: M counts every batch's rows, no batch):
a batch of one (einsum's contractions), or B one matrix expanded over the batch (`x @ W`
of a 3-D x that matmul did not fold itself: under no_grad or autocast, x transposed). Also
records, as
`packed_linear` sites that Dispatch keeps in high precision, the linears Inductor's
freezing has already packed for a CPU library (mkl/mkldnn), so the report shows them.

Records for each: role (fwd in forward/inference graphs, and in the backward graph for a
GEMM that reads no incoming gradient: a forward recomputed by activation checkpointing,
named `<module>:fwd:recomputed`; else wgrad when the result flows, through views, casts,
adds, slices and sums over a bmm's batch only, into the gradient of a parameter, else
dgrad), module path (from `nn_module_stack`, or `fwd_nn_module_stack` in the backward
graph; `recovered_provenance` for the addmm Inductor makes of a gradient addition),
M x K x N (symbolic where dynamic), which operands carry the incoming gradient,
producers and consumers, the autograd sequence number that links a backward GEMM to
its forward one, and a stable id (`site_id`) under which plans keep the site.

Declines: nothing to decline; every GEMM is recorded (Dispatch decides what goes FP8).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols, statically_known_true

from .context import GraphKind, PassContext, Role, Site

aten = torch.ops.aten
prims = torch.ops.prims

GEMM_OPS = {
    aten.mm.default: "mm",
    aten.addmm.default: "addmm",
    aten.bmm.default: "bmm",
    aten.baddbmm.default: "baddbmm",
}

# Ops that move or relabel data without changing what it is.
VIEW_LIKE = {
    aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.clone.default,
    aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.alias.default,
    aten.contiguous.default, aten._to_copy.default, prims.convert_element_type.default,
}
# Ops through which a GEMM result may still be (part of) a parameter's gradient. A sum
# counts only over a batched GEMM (a weight broadcast over the batch); a sum over a 2-D
# GEMM's rows is a bias gradient computed from a dgrad result.
# weight_norm's backward takes the gradient of the whole weight and returns those of its
# parameters (g, v) as a tuple; slices and splits hand each weight of a concatenated one
# (horizontal fusion) its part. A weight used as a slice of a stacked parameter (`P[e]`,
# `P[:, :k]`, deepctr-torch's CrossNetMix experts) has its gradient scattered into the
# parameter's (select/slice_scatter, their *_backward) or stacked with its siblings' (stack, cat).
GRAD_ACCUMULATE = VIEW_LIKE | {aten.add.Tensor, operator.getitem, aten._weight_norm_interface_backward.default,
                               aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
                               aten.narrow.default, aten.select_scatter.default, aten.slice_scatter.default,
                               aten.select_backward.default, aten.slice_backward.default, aten.stack.default,
                               aten.cat.default}
GRAD_SUMS = {aten.sum.dim_IntList, aten.sum.default}
BATCHED_GEMMS = {aten.bmm.default, aten.baddbmm.default}


def graph_kind(graph: torch.fx.Graph) -> GraphKind:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return GraphKind.BACKWARD
    if any(n.startswith("primals") for n in names):
        return GraphKind.FORWARD
    return GraphKind.INFERENCE


def clean_module_path(path: str) -> str:
    """Dynamo's "L['self'].layers[0].fc" -> "layers.0.fc" (root -> ""); a module reached
    through a global, "getattr(G.m, '0')", -> "m.0"."""
    path = re.sub(r"getattr\(([^,]*), '([^']*)'\)", r"\1.\2", path)
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"^G\.|^G(?=\[)", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    path = re.sub(r"_modules\.|_parameters\.", "", path)
    return path.strip(".")


def module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cleaned = clean_module_path(path)
    if cleaned:
        return cleaned
    return getattr(cls, "__name__", str(cls)).rsplit(".", 1)[-1]


def as_dim(value) -> object:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if not free_symbols(expr) else str(expr)
    return int(value)


def short_target(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return f"input:{node.name}"
    if node.op == "get_attr":
        return f"constant:{node.name}"
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem:
        return short_target(node.args[0])
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def skip_views_up(node: torch.fx.Node) -> torch.fx.Node:
    while node.op == "call_function" and node.target in VIEW_LIKE and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


# Producers whose output comes from a library kernel or a custom op: a cast cannot join it.
_LIBRARY_PRODUCERS = {*GEMM_OPS, aten._scaled_mm.default, aten.embedding.default,
                      aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
                      aten.convolution.default, aten.index_select.default}


# Views between a concatenation and the A operand that leave each row's K values in place.
_ROW_KEEPING_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                      aten.contiguous.default, aten.alias.default, aten._to_copy.default,
                      prims.convert_element_type.default}


def _last_dim(node: torch.fx.Node):
    val = node.meta.get("val")
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else None


def cat_pieces(operand: torch.fx.Node) -> Optional[tuple]:
    """(pieces, flatten) when A is a concatenation along K, reached through views that keep
    each row's K values (`flatten`: A is the 2-D view of a higher-rank concatenation),
    else None."""
    node, k = operand, _last_dim(operand)
    if k is None:
        return None
    while node.op == "call_function" and node.target in _ROW_KEEPING_VIEWS:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or _last_dim(source) is None \
                or not statically_known_true(_last_dim(source) == k):
            return None
        node = source
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    pieces = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank, a_rank = node.meta["val"].dim(), operand.meta["val"].dim()
    if len(pieces) < 2 or dim % rank != rank - 1 or (a_rank != rank and a_rank != 2) \
            or not all(isinstance(p, torch.fx.Node) and p.meta["val"].dim() == rank for p in pieces):
        return None
    return tuple(pieces), a_rank != rank


def per_piece_cast(operand: torch.fx.Node, scaling: str, fused_casts: bool, static_scale: bool,
                   row_max: Optional[int]) -> Optional[tuple]:
    """(pieces, flatten) where the `cat_casts` Mod casts A one piece of its concatenation at
    a time (`scaled_gemm.cast_a_pieces`), else None: rowwise dynamic fused casts, a K over
    `row_max` (the longest row Inductor reduces in one persistent pass; up to it the whole
    row's cast is one pass already), every piece from a producer its cast fuses into. One
    cast over the concatenation is fused by Inductor with a pointwise cat, which computes
    every piece, masked, for each element: over MaskNet's 8 LayerNorm outputs (K = 8192)
    that kernel took 0.67 ms at 8192 rows and 5.4 ms at 65536 (H100)."""
    if scaling != "rowwise" or not fused_casts or static_scale or row_max is None:
        return None
    k = _last_dim(operand)
    if not isinstance(k, int) or k <= row_max:
        return None
    found = cat_pieces(operand)
    if found is None or not all(_piece_cast(p, scaling).startswith("fused") for p in found[0]):
        return None
    return found


SAVED_IN_FP8 = "saved in FP8 by the forward"
WEIGHT_BOTH_LAYOUTS = "cached weight (cast once per step for the forward and the dgrad, both layouts by one kernel)"
PRECAST = (SAVED_IN_FP8, WEIGHT_BOTH_LAYOUTS)  # casts made before the GEMM's graph runs it


def saved_operand(operand: torch.fx.Node) -> Optional[tuple]:
    """(q, scale) nodes where `operand` is a dequantized FP8 copy made in the forward, by
    the saved_fp8 Mod (`loka::dequantize_saved`) or the weight_both_layouts Mod
    (`loka::dequantize_weight_layout`), else None."""
    if operand.op == "call_function" and operand.target in (torch.ops.loka.dequantize_saved.default,
                                                            torch.ops.loka.dequantize_weight_layout.default):
        return operand.args[0], operand.args[1]
    return None


def precast_origin(operand: torch.fx.Node) -> Optional[str]:
    """SAVED_IN_FP8 or WEIGHT_BOTH_LAYOUTS where the forward cast `operand` already
    (`saved_operand`), else None."""
    if saved_operand(operand) is None:
        return None
    return WEIGHT_BOTH_LAYOUTS if operand.target is torch.ops.loka.dequantize_weight_layout.default else SAVED_IN_FP8


def _piece_cast(piece: torch.fx.Node, scaling: str) -> str:
    """cast_origin of one piece of a concatenated A, in the piece's own layout."""
    return cast_origin(piece, "a", operand_major(piece.meta["val"]), scaling)


def cast_origin(operand: torch.fx.Node, which: str, major: str, scaling: str, fused_casts: bool = True,
                static_scale: bool = False, row_max: Optional[int] = None) -> str:
    """How the FP8 cast of GEMM operand `which` ("a" or "b") runs once Inductor compiles
    the graph: "fused into <op>" where its producer is an ATen op Inductor generates a
    kernel for (a norm, an activation, a residual add; decomposed ops are named by their
    original op) and the cast's scales run along the producer's rows (A row-major, B
    column-major: the K axis contiguous), so one kernel computes the value, its amax and
    its FP8 copy; else "standalone (<why>)": a graph input (a weight, a saved
    activation), a library kernel's or custom op's output, scales across the producer's
    rows (a transposed operand: the cast re-reads it column by column), or tensorwise
    scaling (the whole tensor's amax comes first); SAVED_IN_FP8 for an activation the
    saved_fp8 Mod cast in the forward, WEIGHT_BOTH_LAYOUTS for a weight the
    weight_both_layouts Mod cast there.

    `static_scale`: the cast divides by a calibrated constant (`scaled_gemm.quantize_static`,
    ATen ops whatever `fused_casts`), a pointwise op with no amax, so it fuses into such a
    producer whatever the scaling and the layout.

    `row_max` (the `cat_casts` Mod on): an A that `per_piece_cast` casts piece by piece is
    "fused into <the pieces' ops> (per piece of an n-way cat)"."""
    precast = precast_origin(operand)
    if precast is not None:
        return precast
    if not fused_casts and not static_scale:
        return "standalone (loka.quantize_operand)"
    if which == "a":
        found = per_piece_cast(operand, scaling, fused_casts, static_scale, row_max)
        if found is not None:
            names = sorted({_piece_cast(p, scaling)[len("fused into "):] for p in found[0]})
            return f"fused into {', '.join(names)} (per piece of a {len(found[0])}-way cat)"
    producer = skip_views_up(operand)
    if producer.op == "placeholder":
        return f"standalone (graph input {producer.name})"
    if producer.op != "call_function":
        return f"standalone ({producer.op} {producer.name})"
    target = producer.target
    if target in _LIBRARY_PRODUCERS or not isinstance(target, torch._ops.OpOverload) \
            or target.namespace != "aten":
        return f"standalone (after {getattr(target, '__name__', target)})"
    name = (producer.meta.get("original_aten") or target).__name__.split(".")[0]
    if scaling == "tensorwise" and not static_scale:
        return f"standalone (tensorwise amax of {name}'s output)"
    if major != ("row" if which == "a" else "column") and not static_scale:
        return f"standalone (scales across {name}'s rows)"
    return f"fused into {name}"


def operand_casts(site: Site, scaling: str, fused_casts: bool = True, a_static: bool = False,
                  row_max: Optional[int] = None) -> dict:
    """`cast_origin` of both operands of a site: {"a": ..., "b": ...}; `a_static`: A is
    cast with a calibrated static scale; `row_max`: as cast_origin's (None: the
    `cat_casts` Mod off)."""
    a, b, _, _ = operands(site.node)
    return {"a": cast_origin(a, "a", site.a_major, scaling, fused_casts, static_scale=a_static, row_max=row_max),
            "b": cast_origin(b, "b", site.b_major, scaling, fused_casts)}


def consumers_of(node: torch.fx.Node) -> list:
    """Names of the ops that read `node`'s value, looking through views."""
    return sorted({"output" if user.op == "output" else short_target(user) for user in consumers_through_views(node)})


def gradient_nodes(graph: torch.fx.Graph) -> set:
    """Nodes whose value depends on an incoming gradient (a `tangents_*` input)."""
    marked = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            marked.add(node)
        elif any(inp in marked for inp in node.all_input_nodes):
            marked.add(node)
    return marked


def forward_output_count(joint_graph: torch.fx.Graph) -> int:
    """How many of a joint graph's outputs are the forward's: it returns them, then one
    gradient per forward input (`primals_*`)."""
    output = next(n for n in joint_graph.nodes if n.op == "output")
    primals = sum(1 for n in joint_graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
    return len(output.args[0]) - primals


def weight_gradient_gemms(graph: torch.fx.Graph, param_input_indices: frozenset, grads: set,
                          joint: bool = False) -> set:
    """GEMM nodes whose result becomes (part of) a parameter's gradient, and GEMMs that
    compute the gradient of a weight the forward computed (LoRA's `W + A @ B`): they read
    the incoming gradient transposed, contracting over its rows (the batch), and their
    result feeds only such weight-gradient GEMMs. A backward graph returns one gradient
    per forward input; a `joint` graph returns the forward's outputs first."""
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    if joint:
        results = results[forward_output_count(graph):]
    stack = [results[i] for i in param_input_indices if i < len(results) and isinstance(results[i], torch.fx.Node)]
    found, seen = set(), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op != "call_function":
            continue
        if node.target in GEMM_OPS:
            found.add(node)
        elif node.target in GRAD_ACCUMULATE:
            stack.extend(node.all_input_nodes)
        elif node.target in GRAD_SUMS:
            summed = _batch_summed_gemm(node)
            if summed is not None:
                stack.append(summed)
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default) \
                    or node in found:
                continue
            a, b, _, _ = operands(node)
            reads_gradient_transposed = any(op in grads and _transposed(op) for op in (a, b))
            users = consumers_through_views(node)
            if reads_gradient_transposed and users and all(u in found for u in users):
                found.add(node)
                changed = True
    return found


def _batch_summed_gemm(node: torch.fx.Node):
    """The batched GEMM whose result `node` (a sum) reduces over its batch dim only: the
    gradient of a weight broadcast over the batch. None for any other sum, e.g. a bias
    gradient summed over the rows of a bmm's activation gradient viewed as 2-D."""
    summed = skip_views_up(node.args[0])
    if summed.op != "call_function" or summed.target not in BATCHED_GEMMS:
        return None
    val = node.args[0].meta.get("val")
    dims = node.args[1] if len(node.args) > 1 else None
    if val is None or val.dim() != 3 or dims is None:
        return None
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if sorted(d % 3 for d in dims) != [0] or not statically_known_true(val.shape[0] == summed.meta["val"].shape[0]):
        return None
    return summed


_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}


def _transposed(node: torch.fx.Node) -> bool:
    """Whether `node` reaches its producer through a transpose."""
    while node.op == "call_function" and node.target in VIEW_LIKE:
        if node.target in _TRANSPOSES:
            return True
        node = node.args[0]
    return False


def consumers_through_views(node: torch.fx.Node) -> list:
    """The nodes that read `node`'s value, looking through views."""
    found, stack, seen = [], list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "call_function" and user.target in VIEW_LIKE:
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def _has_module_stack(node: torch.fx.Node) -> bool:
    return bool(node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack"))


def _gradient_slot(gemm: torch.fx.Node, gradient: torch.fx.Node) -> str:
    """Which gradient of a forward `A @ B` a backward GEMM reading `gradient` (view-free)
    computes: "a" (gradient @ B^T) or "b" (A^T @ gradient, or gradient^T @ A)."""
    a = operands(gemm)[0]
    return "a" if skip_views_up(a) is gradient and not _transposed(a) else "b"


PROVENANCE_KEY = "loka_gemm"  # in node.meta["custom"], which Inductor's rewrites carry over


def keep_gemm_provenance(graph: torch.fx.Graph) -> int:
    """To run before Inductor's post-grad patterns (`post_grad_custom_pre_pass`): on each
    `add(mm(x, y), other)` of a backward graph, the module path and seq_nr of each mm it
    adds, under the names of the mm's operands, so that the addmm Inductor makes of the
    two (it keeps the add's meta, "custom" included) still says where its product comes
    from. Returns how many adds it stamped."""
    if graph_kind(graph) is not GraphKind.BACKWARD:
        return 0
    stamped = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.add.Tensor:
            continue
        kept = [{"operands": [arg.name for arg in mm.args[:2]], "module": module_path(mm),
                 "seq_nr": mm.meta.get("seq_nr")}
                for mm in node.args[:2] if isinstance(mm, torch.fx.Node) and mm.target is aten.mm.default
                and _has_module_stack(mm)]
        if kept:
            node.meta.setdefault("custom", {})[PROVENANCE_KEY] = kept
            stamped += 1
    return stamped


def recovered_provenance(node: torch.fx.Node, grads: set, wgrads: set) -> tuple:
    """(module path, seq_nr) of a backward GEMM that lost its own. Inductor's post-grad
    pass turns a gradient addition `mm(x, y) + other` into one addmm carrying the add's
    meta (no module stack, no seq_nr). Recovered, in order:
      - from `keep_gemm_provenance`'s stamp, where it ran before that pass;
      - from the GEMMs that read the same incoming gradient: those of one forward GEMM
        (one seq_nr) compute its other gradients; taken when exactly one forward GEMM
        among them lacks the gradient this node computes (dgrad <-> wgrad);
      - for a weight-gradient accumulation (a layer applied twice), the module of the
        other contribution `other`, without a seq_nr (it names the other application).
    Else ("", None): e.g. a frozen layer's dgrad added to another path's (LoRA's base)
    leaves no trace of its module in the backward graph."""
    a, b, _, _ = operands(node)
    for kept in (node.meta.get("custom") or {}).get(PROVENANCE_KEY, ()):
        if kept["operands"] == [a.name, b.name]:
            return kept["module"], kept["seq_nr"]
    gradient = next((skip_views_up(op) for op in (a, b) if op in grads), None)
    if gradient is not None:
        slot = _gradient_slot(node, gradient)
        by_forward: dict = {}
        for user in consumers_through_views(gradient):
            if user is not node and user.op == "call_function" and user.target in GEMM_OPS \
                    and _has_module_stack(user) and user.meta.get("seq_nr") is not None:
                by_forward.setdefault(user.meta["seq_nr"], []).append(user)
        free = [users[0] for users in by_forward.values()
                if all(_gradient_slot(u, gradient) != slot for u in users)]
        if len(free) == 1:
            return module_path(free[0]), free[0].meta["seq_nr"]
    seen = {node}
    while node in wgrads and node.target in (aten.addmm.default, aten.baddbmm.default):
        other = skip_views_up(node.args[0])
        if other in seen or other not in wgrads:
            break
        seen.add(other)
        if _has_module_stack(other):
            return module_path(other), None
        node = other
    return "", None


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """Where a GEMM operand comes from when it is made of weights alone."""

    indices: tuple       # graph input index of each weight it reads, in the order first read
    placeholders: tuple  # their placeholders, same order
    nodes: tuple         # the views, casts and concatenations from them to the operand, inputs first


# Views that take one weight out of a stacked parameter (deepctr-torch's CrossNetMix: `V_list[i][e]`).
_WEIGHT_SLICES = {aten.select.int, aten.slice.Tensor}


def weight_source(operand: torch.fx.Node, weight_inputs: dict) -> Optional[WeightSource]:
    """How `operand` is made from weight inputs of the graph (`weight_inputs`: placeholder
    -> index) through views, slices of a stacked parameter, dtype casts and concatenations
    only (sibling linears fused by horizontal_fusion read their weights concatenated), else
    None."""
    nodes, leaves, seen = [], [], set()

    def visit(node) -> bool:  # depth first, each node after its inputs
        if node in seen:
            return True
        seen.add(node)
        if node.op == "placeholder":
            leaves.append(node)
            return node in weight_inputs  # any other input: not a weight operand
        if node.op != "call_function" or not (node.target is aten.cat.default or (
                node.target in VIEW_LIKE | _WEIGHT_SLICES and len(node.all_input_nodes) == 1)):
            return False
        if not all(visit(n) for n in node.all_input_nodes):
            return False
        nodes.append(node)
        return True

    if not visit(operand):
        return None
    return WeightSource(tuple(weight_inputs[p] for p in leaves), tuple(leaves), tuple(nodes))


def weight_placeholders(graph: torch.fx.Graph, param_input_indices: frozenset) -> dict:
    """Placeholder -> input index of the forward/inference graph's weight inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return {placeholders[i]: i for i in param_input_indices if i < len(placeholders)}


# Why a batched GEMM is one 2-D GEMM (`batch_fold`), as Site.fold says it
FOLD_SINGLE = "a batch of one (einsum writes its contractions so)"
FOLD_BROADCAST = "B one matrix expanded over the batch (a 3-D activation @ a 2-D weight that matmul did not fold)"


# Views between a broadcast matrix's `expand` and the bmm that keep each matrix's element order:
# past a transpose the expanded matrix would be the transpose of B's.
_ORDER_KEEPING = VIEW_LIKE - {aten.expand.default, aten.t.default, aten.permute.default, aten.transpose.int}


def broadcast_matrix(operand: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The node holding the one matrix that `operand` (a bmm's 3-D B) repeats over its batch:
    the input of the `expand` it is read through (views that keep the element order between),
    a 2-D [K, N] or a [1, K, N]; None when B is not such a broadcast."""
    node = operand
    while node.op == "call_function" and node.target in _ORDER_KEEPING:
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return None
    if node.op != "call_function" or node.target is not aten.expand.default:
        return None
    source = node.args[0]
    val, b_val = source.meta.get("val"), operand.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(b_val, torch.Tensor) or val.dim() not in (2, 3) \
            or (val.dim() == 3 and not statically_known_true(val.shape[0] == 1)) \
            or not all(statically_known_true(x == y) for x, y in zip(val.shape[-2:], b_val.shape[-2:])):
        return None
    return source


def batch_fold(node: torch.fx.Node) -> str:
    """Why a bmm/baddbmm is one 2-D GEMM over A's rows, "" when it is not: a batch of one
    (FOLD_SINGLE), or a B that is one matrix expanded over the batch while A is not
    (FOLD_BROADCAST: `x @ W` of a 3-D x that matmul could not fold into an mm without
    copying x, as under no_grad or autocast). As 2-D sites they get every 2-D provider,
    padding and cached weights; `lower` writes them as mm/addmm of A viewed [B * M, K]
    (FP8 sites only: the cast of A makes the copy the view may need). A baddbmm folds
    when its scalars are 1 and its bias broadcasts over the rows."""
    if node.target not in BATCHED_GEMMS:
        return ""
    a, b, bias, unit = operands(node)
    a_val, b_val = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(a_val, torch.Tensor) and isinstance(b_val, torch.Tensor) and a_val.dim() == b_val.dim() == 3):
        return ""
    if bias is not None:
        bias_val = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not unit or not isinstance(bias_val, torch.Tensor) or bias_val.dim() == 0 \
                or not all(statically_known_true(d == 1) for d in bias_val.shape[:-1]):
            return ""
    if statically_known_true(a_val.shape[0] == 1):
        return FOLD_SINGLE
    if broadcast_matrix(b) is not None and not statically_known_true(a_val.stride(0) == 0):
        return FOLD_BROADCAST
    return ""


def operands(node: torch.fx.Node):
    """(A, B, bias, unit_scalars) of a GEMM node."""
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        bias, a, b = node.args[:3]
        beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
        alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        return a, b, bias, beta == 1 and alpha == 1
    return node.args[0], node.args[1], None, True


def operand_major(val: torch.Tensor) -> str:
    """"row" when the last dim is contiguous, "column" when the one before is (a transposed
    view, as weights and grad-weight operands arrive), else "row" (the kernels copy it)."""
    strides = val.stride()[-2:]
    if strides[-1] == 1:
        return "row"
    return "column" if strides[0] == 1 else "row"


# Linears that Inductor's freezing (`torch._inductor.config.freezing`) packs for a CPU
# library before post-grad passes run: the weight is no longer an operand loka can cast.
PACKED_LINEAR_PREFIXES = ("mkl._mkl_linear", "mkldnn._linear_pointwise", "onednn.qlinear_pointwise")


def is_packed_linear(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(PACKED_LINEAR_PREFIXES)


def _packed_linear_site(node: torch.fx.Node, ctx: PassContext, sid: str) -> Site:
    x_val, out_val = node.args[0].meta["val"], node.meta["val"]
    rows = as_dim(x_val.numel() // x_val.shape[-1]) if x_val.shape[-1] else 0
    return Site(id=sid, graph=ctx.graph, kind=ctx.kind,
                node=node, op="packed_linear", role=Role.FWD, module=module_path(node),
                shape=(rows, as_dim(x_val.shape[-1]), as_dim(out_val.shape[-1])), batch=None, dtype=x_val.dtype,
                device=x_val.device, a_is_grad=False, b_is_grad=False,
                producers=(short_target(skip_views_up(node.args[0])), "packed weight"),
                consumers=tuple(consumers_of(node)), seq_nr=node.meta.get("seq_nr"))


def site_id(kind: GraphKind, base: str, ordinal: int) -> str:
    """The site's stable id, "<kind>/<module>:<role>[:recomputed]#<n>" (n: 1-based order
    among the graph's sites of that module and role): the same for the same model code
    across recompiles, reset(), the probe and FP8 variants and processes, since it reads
    no node name and no graph counter."""
    return f"{kind.value}/{base}#{ordinal}"


def find_sites(graph: torch.fx.Graph, ctx: PassContext) -> int:
    grads = gradient_nodes(graph) if ctx.kind is GraphKind.BACKWARD else set()
    wgrads = weight_gradient_gemms(graph, ctx.param_input_indices, grads, ctx.joint) \
        if ctx.kind is GraphKind.BACKWARD else set()
    weights = weight_placeholders(graph, ctx.param_input_indices) if ctx.kind is not GraphKind.BACKWARD else {}
    names_seen: dict = {}
    for node in graph.nodes:
        if is_packed_linear(node):
            base = f"{module_path(node) or '<root>'}:fwd"
            names_seen[base] = names_seen.get(base, 0) + 1
            ctx.sites.append(_packed_linear_site(node, ctx, site_id(ctx.kind, base, names_seen[base])))
            continue
        if node.op != "call_function" or node.target not in GEMM_OPS:
            continue
        module, seq_nr = module_path(node), node.meta.get("seq_nr")
        role, recomputed = gemm_role(node, ctx.kind, grads, wgrads)
        if role is not Role.FWD and seq_nr is None and not _has_module_stack(node):
            module, seq_nr = recovered_provenance(node, grads, wgrads)
        base = site_base(module, role, recomputed)
        names_seen[base] = names_seen.get(base, 0) + 1
        ctx.sites.append(gemm_site(node, ctx, base, names_seen[base], role, module, seq_nr, grads, weights))
    return len(ctx.sites)


def gemm_role(node: torch.fx.Node, kind: GraphKind, grads: set, wgrads: set) -> tuple:
    """(role, recomputed) of a GEMM node: fwd outside backward graphs; in a backward graph,
    a GEMM that reads no incoming gradient is a forward one recomputed (activation
    checkpointing), one whose result becomes a weight's gradient wgrad, any other dgrad."""
    if kind is not GraphKind.BACKWARD:
        return Role.FWD, False
    if node not in grads:
        return Role.FWD, True
    return (Role.WGRAD if node in wgrads else Role.DGRAD), False


def site_base(module: Optional[str], role: Role, recomputed: bool) -> str:
    """A site id's name before its count: `<module>:<role>[:recomputed]`."""
    return f"{module or '<root>'}:{role.value}{':recomputed' if recomputed else ''}"


def gemm_site(node: torch.fx.Node, ctx: PassContext, base: str, ordinal: int, role: Role, module: str,
              seq_nr: Optional[int], grads: set, weights: dict) -> Site:
    """The Site of GEMM `node`: `base` is "<module>:<role>[:recomputed]", `ordinal` its
    1-based order among the graph's sites of that base; `grads`: the nodes that carry the
    incoming gradient; `weights`: the weight placeholders (`weight_placeholders`)."""
    a, b, _, unit = operands(node)
    a_val, b_val = a.meta["val"], b.meta["val"]
    fold = batch_fold(node)
    rows = as_dim(a_val.shape[0] * a_val.shape[1]) if fold else as_dim(a_val.shape[-2])
    return Site(
        id=site_id(ctx.kind, base, ordinal),
        graph=ctx.graph,
        kind=ctx.kind,
        node=node,
        op=GEMM_OPS[node.target],
        role=role,
        module=module,
        shape=(rows, as_dim(a_val.shape[-1]), as_dim(b_val.shape[-1])),
        batch=as_dim(a_val.shape[0]) if a_val.dim() == 3 and not fold else None,
        dtype=a_val.dtype,
        device=a_val.device,
        a_is_grad=a in grads,
        b_is_grad=b in grads,
        producers=(short_target(skip_views_up(a)), short_target(skip_views_up(b))),
        consumers=tuple(consumers_of(node)),
        seq_nr=seq_nr,
        unit_scalars=unit,
        a_major=operand_major(a_val),
        b_major=operand_major(b_val),
        b_is_weight=weight_source(b, weights) is not None,
        fold=fold,
    )
