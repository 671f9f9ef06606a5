"""saved_fp8: the Mod that saves FP8 copies of activations for the backward's FP8 GEMMs.

A backward GEMM that Dispatch sends to FP8 casts both its operands in the backward. One of
them may be an activation the forward computed: X of a weight gradient (dW = dY^T X, FP8
under the `rowwise` and `tensorwise` recipes), or the activation operand of a batched
GEMM's dgrad (attention: dQ = dS K). As written, the partitioner saves that activation in
high precision and the backward casts it. This Mod moves the cast into the forward, in the
joint graph (Inductor's `joint_custom_post_pass`, before the partitioner decides what is
saved), so that the partitioner saves the FP8 copy and its scales instead: 1 byte per
element where bf16 took 2, and the backward reads FP8. It is the backward's own cast
(scaling, format, layout), so the GEMM computes the same values as without the Mod.

Runs on loka's training compiles past the probe window (the Probe measures each backward
GEMM on its high-precision operands), on the sites `find_sites` finds in the joint graph
and the decisions Dispatch gives them there, which are those of the backward graph's
sites (the same ids, from the same nodes).

Matches, per backward GEMM site (dgrad, wgrad) decided FP8, each operand that:
  - carries no incoming gradient;
  - is computed by the forward (declined: `graph_input`; a weight or the model's input is
    kept by the caller anyway);
  - is read by GEMMs only, through views (declined: `read_by_other_ops`; a ReLU output,
    which the ReLU's backward reads, stays saved, and its FP8 copy would add memory);
  - is cast tensorwise or rowwise and unpadded (declined: `scaling`, `padded`).
Becomes:
    X' = dequantize(q, s), with q, s = cast(X) as the backward GEMM casts it -> the GEMM reads X'
`lower` then hands q and s to the FP8 GEMM (`find_sites.saved_operand`), and the site reports the
operand as "saved in FP8 by the forward". The dequantization is an opaque op
(`loka::dequantize_saved`): written as ATen pointwise ops, the partitioner (which doubles
the cost of saving a value only fusible ops read) kept the bf16 activation instead. What
the partitioner does is checked in the forward graph it made (`check_saves`,
`SavedOperand.outcome`), and `saved_bytes` is what that graph keeps for the backward.

A walk from each FP8 site, not the pattern matcher: what matches is decided by Dispatch's
decision and by every reader of the operand, not by the shape of a subgraph.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import torch

from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.kernels.scaled_gemm import GemmSpec, cast_to_save
from ..shapes import size_hint

from ..context import PassContext, Role
from ..find_sites import (GEMM_OPS, SAVED_IN_FP8, VIEW_LIKE, find_sites, forward_output_count, operands, saved_operand,
                         skip_views_up)
from ..rewrite import insert_traced
from .mod import Evidence, Mod, Stage, total

# What lays the FP8 copy out for the GEMM without converting it (`_views_down`)
_VIEWS = VIEW_LIKE - {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


@dataclasses.dataclass
class SavedOperand:
    site: str             # the backward site's id
    operand: str          # "a" or "b"
    activation: str       # the activation's node (in the joint graph and the forward graph)
    q: tuple              # its FP8 copy's nodes: as the GEMM reads it, and under those views and copies
    scale: tuple          # its scales' nodes, likewise
    # what the partitioner made of it (`check_saves`): "fp8" (the forward returns the FP8
    # copy and scales, not the activation), "recomputed" (neither: the backward recomputes
    # the activation and casts it), "both" (the activation too: read by another op of the
    # backward after all), "activation" (the FP8 copy is made in the backward)
    outcome: str = ""


@dataclasses.dataclass
class SavedFp8:
    """What the saved_fp8 Mod did to one training graph."""

    forward_outputs: int = 0  # the joint graph's outputs that are the forward's own
    operands: list = dataclasses.field(default_factory=list)  # SavedOperand
    declined: Counter = dataclasses.field(default_factory=Counter)
    saved_bytes: int = 0      # activations the forward graph returns for the backward, at compile-time sizes

    @classmethod
    def of_joint_graph(cls, graph: torch.fx.Graph) -> "SavedFp8":
        return cls(forward_outputs=forward_output_count(graph))

    def summary(self) -> dict:
        return {"operands": len(self.operands), "outcomes": dict(Counter(o.outcome for o in self.operands)),
                "saved_for_backward_bytes": self.saved_bytes, "declined": dict(self.declined)}


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return (size_hint(val.numel()) or 0) * val.element_size()


def _read_by_gemms_only(node: torch.fx.Node) -> bool:
    """Every op that reads `node`, looking through views, is a GEMM."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "call_function" and user.target in VIEW_LIKE:
                stack.append(user)
            elif user.op != "call_function" or user.target not in GEMM_OPS:
                return False
    return True


def find_operands(graph: torch.fx.Graph, ctx: PassContext, result: SavedFp8) -> list:
    """The operands to save, as (site, "a" or "b", operand node, decision, the site's amax
    guard or None), counting the declined ones into `result`; changes nothing. `ctx` is a
    backward-kind context whose `decide` is Dispatch's."""
    found = []
    find_sites(graph, ctx)
    for site in ctx.sites:
        if site.role not in (Role.DGRAD, Role.WGRAD):
            continue
        decision = ctx.decide(site)
        if not decision.fp8:
            continue
        a, b, _, _ = operands(site.node)
        for which, operand, is_grad in (("a", a, site.a_is_grad), ("b", b, site.b_is_grad)):
            if is_grad or saved_operand(operand) is not None:  # the weight_both_layouts Mod's already
                continue
            why = _decline(operand, decision)
            if why:
                result.declined[why] += 1
            else:
                guard = ctx.amax_guard(site, GemmSpec(Scaling(decision.scaling), Fp8Format(decision.a_format),
                                                      Fp8Format(decision.b_format), decision.provider, site.dtype))
                found.append((site, which, operand, decision, guard))
    return found


def save_fp8_operands(found: list, fused_casts: bool, result: SavedFp8) -> None:
    """Rewrite the joint graph for the operands `find_operands` found (module docstring),
    recording each into `result`."""
    for site, which, operand, decision, guard in found:
        result.operands.append(_save(site, which, operand, decision, fused_casts, guard))


def _decline(operand: torch.fx.Node, decision) -> str:
    if decision.scaling not in (Scaling.TENSORWISE.value, Scaling.ROWWISE.value):
        return "scaling"
    if decision.pad_k or decision.pad_n:
        return "padded"
    producer = skip_views_up(operand)
    if producer.op != "call_function":
        return "graph_input"
    if not _read_by_gemms_only(producer):
        return "read_by_other_ops"
    return ""


def _save(site, which: str, operand: torch.fx.Node, decision, fused_casts: bool, guard=None) -> SavedOperand:
    spec = GemmSpec(Scaling(decision.scaling), Fp8Format(decision.a_format), Fp8Format(decision.b_format),
                    decision.provider, site.dtype, fused_casts=fused_casts, amax_guard=guard)
    producer = skip_views_up(operand)
    _, (dequantized, q, scale) = insert_traced(
        site.node, functools.partial(cast_to_save, operand=which, spec=spec), [operand], meta_from=producer)
    site.node.replace_input_with(operand, dequantized)
    return SavedOperand(site.id, which, producer.name, _views_down(q), _views_down(scale))


def _views_down(node: torch.fx.Node) -> tuple:
    """Names of `node` and the nodes under its views and copies (not under a dtype
    conversion, as skip_views_up goes): any of them is what the partitioner may save."""
    names = [node.name]
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
        names.append(node.name)
    return tuple(names)


def check_saves(forward: torch.fx.Graph, saved: SavedFp8) -> None:
    """Record what the partitioner's forward graph returns for the backward: per saved
    operand its outcome, and the bytes of all it returns (at compile-time sizes)."""
    output = next(n for n in forward.nodes if n.op == "output")
    for_backward = [n for n in output.args[0][saved.forward_outputs:] if isinstance(n, torch.fx.Node)]
    returned = {n.name for n in for_backward}
    # graph inputs (parameters, the model's input) live on whatever the forward returns
    saved.saved_bytes = sum(_bytes(n) for n in for_backward
                            if n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
    for entry in saved.operands:
        fp8 = bool(returned.intersection(entry.q)) and bool(returned.intersection(entry.scale))
        activation = entry.activation in returned
        entry.outcome = {(True, False): "fp8", (False, False): "recomputed", (True, True): "both",
                         (False, True): "activation"}[(fp8, activation)]


def _count(evidence: Evidence) -> dict:
    # saved_for_backward_bytes is measured with the Mod off too, to compare against.
    return {"saved_fp8": sum(c == SAVED_IN_FP8 for c in evidence.fp8_casts),
            "saved_for_backward_bytes": total(evidence.results_of(MOD), "saved_bytes")}


MOD = Mod("saved_fp8", Stage.JOINT_GRAPH, True,
          "the backward's FP8 copy of an activation saved by the forward instead of the bf16 activation",
          counters=("saved_fp8", "saved_for_backward_bytes"), count=_count)
