"""weight_both_layouts: the Mod that casts a training weight once per step for its forward
GEMMs and its dgrads, with one kernel writing both FP8 layouts.

A linear's weight W [N, K] is read by two GEMMs of a training step: the forward reads it
as B = W^T (scales per output column n, the amax along K), the dgrad as B = W (scales per
column k, the amax along N). As lowered alone, each GEMM casts W itself: the forward in the
forward graph and the dgrad again in the backward, each a reduction and a cast over W.
This Mod, in the joint graph (Inductor's `joint_custom_post_pass`, before the partitioner),
casts W once in the forward with `loka::quantize_dual_axis` (both amaxes in one read, both
layouts written in the next: `kernels/triton_quant.py`), hands each GEMM the half it reads,
and the partitioner saves the dgrad's FP8 copy (1 byte per element) and its scales for the
backward. They are the casts each GEMM made before, so the products are the same (bit for
bit on CPU; on CUDA the Triton kernel rounds as the eager reference does, and Inductor's
compiled cast differed from it in 0-2 FP8 codes per zoo weight).

Matches: 2-D GEMM sites (`mm`, `addmm`) decided FP8 with rowwise scaling, unpadded, whose
B operand is a weight of the graph (a parameter, a slice of a stacked one, or several
concatenated by the horizontal Mod: `find_sites.weight_source`) seen directly or transposed, through dtype casts, when
the same weight is read in both orientations by such sites (a forward GEMM and its dgrad;
a shared tower's calls all read the one cast). Either form of the forward works: `x @ W^T`
(`nn.Linear`) reads the row-scaled half, `x @ W` the column-scaled half.
Becomes, with S the weight under the GEMMs' transpositions and dtype casts (an fp32
parameter under autocast: its own values are cast, as Inductor's fused cast of the bf16
copy computes them, and no bf16 copy is written):
    q_row, s_row, q_col, s_col = loka.quantize_dual_axis(S)        (forward)
    GEMM(.., S^T) -> GEMM(.., dequantize_weight_layout(q_row^T, s_row^T, B))
    GEMM(.., S)   -> GEMM(.., dequantize_weight_layout(q_col, s_col, B))
and `lower` hands each GEMM its FP8 operand and scales (`find_sites.saved_operand`). B, the
operand as written, is what a GEMM then kept in high precision reads, and what a graph
that falls back reads (`restore_original`, `strip`): carried where it is a view of a
parameter (which the partitioner keeps for free), rebuilt from the cast's input in the
forward otherwise; only a backward GEMM on a computed weight (a cat, an autocast copy) is
left with the dequantized FP8 copy, and says so.
Declines (counted by reason): a weight read in one orientation only (one cast serves it
already), tensorwise or blockwise scaling, padding, batched GEMMs, symbolic or
non-contiguous weights, and on CUDA weights under MIN_CUDA_ELEMENTS.

A walk, not the pattern matcher: a match is a weight and every FP8 site that reads it, in any
number and through any chain of casts and transposes, which no fixed pattern states.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import Counter

import torch
from torch.fx.experimental.symbolic_shapes import free_symbols

from loka_compile.kernels.quantize import Scaling

from ..context import GraphKind, PassContext, Role
from ..find_sites import find_sites, operands, site_id, weight_placeholders, weight_source
from ..rewrite import insert_traced
from .mod import Mod, Stage

aten = torch.ops.aten

# On CUDA, weights smaller than this keep each GEMM's own cast: the dual-axis pair (a fill and
# two launches) has a time floor two fused casts of a small weight stay under
# (docs/mods/weight_both_layouts.md). On CPU FP8 is emulated and the Mod always applies.
MIN_CUDA_ELEMENTS = 128 * 256


@dataclasses.dataclass
class SharedWeight:
    weight: str           # the node both orientations are views of (the weight, its cast, a cat)
    fmt: str
    sites: tuple          # ids of the GEMM sites that read the one cast (as the report has them)
    q_col: str            # the dgrad layout's FP8 copy and scales: what the partitioner should save
    scale_col: str
    nbytes: int           # of that copy and its scales (what the forward keeps for the backward)
    # what the partitioner made of it (`check_shared`): "fp8" (the forward returns the copy and
    # its scales for the backward) or "not_saved" (no backward GEMM reads them, or the
    # partitioner chose to cast again there)
    outcome: str = ""


@dataclasses.dataclass
class WeightLayouts:
    """What the weight_both_layouts Mod did to one training graph."""

    weights: list = dataclasses.field(default_factory=list)  # SharedWeight
    declined: Counter = dataclasses.field(default_factory=Counter)

    def summary(self) -> dict:
        return {"weights": len(self.weights), "sites": sum(len(w.sites) for w in self.weights),
                "outcomes": dict(Counter(w.outcome for w in self.weights)),
                "saved_fp8_weight_bytes": sum(w.nbytes for w in self.weights if w.outcome == "fp8"),
                "declined": dict(self.declined)}


def _is_transpose(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is aten.t.default:
        return True
    val = node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return False


def _is_dtype_cast(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}


def untransposed(node: torch.fx.Node) -> tuple:
    """(the node under `node`'s 2-D transpositions and dtype casts, whether an odd number
    of transpositions). Under autocast a weight reaches its GEMMs as a bf16 copy of the
    fp32 parameter: the Mod casts the parameter itself, as Inductor's fused cast did, and
    no bf16 copy is written."""
    flips = 0
    while _is_transpose(node) or _is_dtype_cast(node):
        node, flips = node.args[0], flips + _is_transpose(node)
    return node, flips % 2 == 1


def _forward_twin(site):
    """A forward-role site of the joint graph as the forward graph will see it: Dispatch
    decides there under the forward id (the joint graph names it as recomputed)."""
    ordinal = int(site.id.rsplit("#", 1)[1])
    return dataclasses.replace(site, kind=GraphKind.FORWARD,
                               id=site_id(GraphKind.FORWARD, f"{site.module or '<root>'}:fwd", ordinal))


def _decline(site, decision, source: torch.fx.Node, weights: dict) -> str:
    """Why an FP8 site's weight is not shared ("" when it is, or when the site is not FP8:
    nothing to share)."""
    if not decision.fp8:
        return ""
    if site.batch is not None or site.op not in ("mm", "addmm"):
        return "batched"
    if decision.scaling != Scaling.ROWWISE.value:
        return "scaling"
    if decision.pad_k or decision.pad_n:
        return "padded"
    if weight_source(source, weights) is None:
        return "not_a_weight"
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or free_symbols(val):
        return "symbolic"
    if not val.is_contiguous():
        return "layout"
    if val.device.type == "cuda" and val.numel() < MIN_CUDA_ELEMENTS:
        return "small"
    return ""


def find_shared_weights(graph: torch.fx.Graph, ctx: PassContext, result: WeightLayouts) -> dict:
    """(weight node, B format) -> [(site, B operand, transposed)] for the weights the Mod
    rewrites, counting the declined reads into `result`; changes nothing. `ctx` is a
    joint-graph context whose `decide` is Dispatch's."""
    find_sites(graph, ctx)
    weights = weight_placeholders(graph, ctx.param_input_indices)
    groups: dict = {}
    for site in ctx.sites:
        if site.role is Role.WGRAD or site.b_is_grad:
            continue
        decision = ctx.decide(_forward_twin(site) if site.role is Role.FWD else site)
        b = operands(site.node)[1]
        source, transposed = untransposed(b)
        why = _decline(site, decision, source, weights)
        if why:
            result.declined[why] += 1
        elif decision.fp8 and b is not operands(site.node)[0]:
            groups.setdefault((source, decision.b_format), []).append((site, b, transposed))
    shared = {}
    for key, reads in groups.items():
        if len({transposed for _, _, transposed in reads}) == 2:
            shared[key] = reads
        else:
            result.declined["one_orientation"] += len(reads)
    return shared


def _right_after(weight: torch.fx.Node) -> torch.fx.Node:
    """Where a weight's cast goes: right after the weight (after the last input, for an
    input), at the start of the step, since it depends on nothing else."""
    node = weight.next
    while node.op == "placeholder":
        node = node.next
    return node


def _dual_cast(weight, *, fmt: str):
    return torch.ops.loka.quantize_dual_axis(weight, fmt)


def _as_b(q, scale, *original, transposed: bool, dtype: torch.dtype):
    """The B operand a GEMM reads, as the FP8 half it takes: S^T takes the row-scaled
    half (its columns are S's rows), S the column-scaled one."""
    if transposed:
        q, scale = q.t(), scale.t()
    return torch.ops.loka.dequantize_weight_layout(q, scale, dtype, *original)


def _free_to_keep(operand: torch.fx.Node) -> bool:
    """`operand` is a graph input seen through transpositions: the partitioner keeps it
    for the backward at no cost. Given a computed weight (a cat of sibling weights, a bf16
    copy under autocast), it ran the dequantization in the forward and kept its bf16 output
    instead of the FP8 copy (eager dequantize and copy kernels in the forward, and a slower
    step than with the Mod off: docs/mods/weight_both_layouts.md)."""
    while _is_transpose(operand):
        operand = operand.args[0]
    return operand.op == "placeholder"


def _rebuilt(source, *, transposed: bool, dtype: torch.dtype):
    return (source.t() if transposed else source).to(dtype)


def _original_of(layout: torch.fx.Node, before: torch.fx.Node):
    """The operand as written for one dequantized weight layout: its `original` argument,
    else, where the dual cast is in this graph (the forward), rebuilt from the weight it
    cast, inserted before `before`; else None (the backward has only the FP8 copy)."""
    if len(layout.args) > 3 and layout.args[3] is not None:
        return layout.args[3]
    q, flips = layout.args[0], 0
    while _is_transpose(q):
        q, flips = q.args[0], flips + 1
    dual = q.args[0] if q.op == "call_function" and q.target is operator.getitem else None
    if dual is None or dual.target is not torch.ops.loka.quantize_dual_axis.default:
        return None
    _, value = insert_traced(before, functools.partial(_rebuilt, transposed=flips % 2 == 1, dtype=layout.args[2]),
                             [dual.args[0]], meta_from=before)
    return value


def is_weight_layout(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and node.target is torch.ops.loka.dequantize_weight_layout.default


def restore_original(gemm: torch.fx.Node, operand: torch.fx.Node) -> bool:
    """Where `operand` of `gemm` is the Mod's dequantized weight layout, make the GEMM
    read the operand as written instead (a GEMM kept in high precision, or cast another
    way than the Mod's): True if it did, False where it cannot (`_original_of`)."""
    if not is_weight_layout(operand):
        return False
    original = _original_of(operand, gemm)
    if original is None:
        return False
    gemm.replace_input_with(operand, original)
    if not operand.users:
        operand.graph.erase_node(operand)
    return True


def strip(graph: torch.fx.Graph) -> tuple:
    """Undo the Mod in one partitioned graph that will run without loka's lowering (its
    passes failed): each GEMM reads its operand as written, in high precision, where
    `_original_of` finds it. Returns (operands restored, operands left reading the
    dequantized FP8 copy)."""
    restored = left = 0
    for node in [n for n in graph.nodes if is_weight_layout(n)]:
        original = _original_of(node, node)
        if original is None:
            left += 1
            continue
        node.replace_all_uses_with(original)
        graph.erase_node(node)
        restored += 1
    return restored, left


def share_weight_casts(shared: dict, result: WeightLayouts) -> None:
    """Rewrite the joint graph for the weights `find_shared_weights` found (module
    docstring), recording each into `result`."""
    for (weight, fmt), reads in shared.items():
        first = reads[0][0].node
        _, (q_row, s_row, q_col, s_col) = insert_traced(
            _right_after(weight), functools.partial(_dual_cast, fmt=fmt), [weight], meta_from=first)
        for site, b, transposed in reads:
            q, scale = (q_row, s_row) if transposed else (q_col, s_col)
            _, operand = insert_traced(
                site.node, functools.partial(_as_b, transposed=transposed, dtype=site.dtype),
                [q, scale] + ([b] if _free_to_keep(b) else []), meta_from=site.node)
            site.node.replace_input_with(b, operand)
        val = weight.meta["val"]
        result.weights.append(SharedWeight(
            weight=weight.name, fmt=fmt, sites=tuple(_forward_twin(site).id if site.role is Role.FWD else site.id
                                                     for site, _, _ in reads), q_col=q_col.name,
            scale_col=s_col.name, nbytes=val.numel() + 4 * val.shape[1]))


def check_shared(forward: torch.fx.Graph, result: WeightLayouts) -> None:
    """Record what the partitioner made of each shared weight cast, from the forward graph
    it made: whether it returns the column-scaled FP8 copy and its scales for the backward."""
    output = next(n for n in forward.nodes if n.op == "output")
    returned = {n.name for n in output.args[0] if isinstance(n, torch.fx.Node)}
    for entry in result.weights:
        entry.outcome = "fp8" if {entry.q_col, entry.scale_col} <= returned else "not_saved"


MOD = Mod("weight_both_layouts", Stage.JOINT_GRAPH, True,
          "a weight cast once per step, both FP8 layouts by one kernel pair, for its forward GEMM and dgrad",
          counters=("weight_both_layouts",),
          count=lambda evidence: {"weight_both_layouts": sum(len(r.weights) for r in evidence.results_of(MOD))})
