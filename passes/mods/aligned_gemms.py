"""aligned_gemms: a high-precision GEMM whose M, K or N is off the 16-byte alignment runs at the
padded size (CUDA): its operands zero-padded, the GEMM at the aligned shape, C sliced back, as
Inductor's own `pad_mm` rewrite writes it. Left to its benchmark, Inductor pads only
compute-bound GEMMs, and an unaligned cuBLAS kernel is several times slower
(docs/mods/aligned_gemms.md has the measurements).

Matches (each high-precision site of a forward, backward or inference graph past its probe
window; FP8 sites are the `pad` Mod's):

    C = aten.mm(A, B)        ->  C = aten.mm(pad(A), pad(B))[:M, :N]
    C = aten.addmm(bias, A, B)   (bias padded along N where it is not broadcast)
    C = aten.bmm(A, B)       ->  C = aten.bmm(pad(A), pad(B))[:, :M, :N]

Declines, keeping the GEMM exactly as Inductor would run it without loka (the reason logged at
DEBUG):
    matrix_vector   M or N is 1: the GEMM reads its matrix operand once (cuBLAS's gemv, which
                    needs no alignment) and padding K would copy that operand first
                    (a gate's mixture of experts, `softmax(gate).unsqueeze(1) @ experts`; a
                    1-wide head)
    outer_product   K is 1: the GEMM writes its output once, and padding M or N would write a
                    larger one to slice (a 1-wide head's input gradient)
    thin            a dim to pad is smaller than the alignment: padding at least doubles it
                    (K = 4 experts, N = 4 gate logits)
    inductor_judged compute-bound (Inductor's `is_mm_compute_bound`): Inductor's pad_mm timed
                    padding it, in the joint graph, and kept the faster form
    symbolic        no dim of known size to pad (Inductor pads static dims only)
Dims of 1 are never padded (Inductor's rule). Nothing is padded when Inductor's
`shape_padding` is off, or off CUDA, where Inductor pads nothing either.

Why a post-grad pass and not Inductor's `force_shape_pad`: forcing pads every GEMM, mat-vec and
outer products included, each then reading or writing a padded copy of its large operand; here
each site is judged by its shape (docs/mods/aligned_gemms.md says what forcing cost).
"""

from __future__ import annotations

import logging

import torch
from torch._inductor import config as inductor_config
from torch._inductor.fx_passes import pad_mm

from ..context import Phase
from ..rewrite import replace_with_traced
from .mod import Mod, Stage

log = logging.getLogger("loka.passes")
aten = torch.ops.aten

# The ops Inductor's pad_mm rewrites (its replacements are reused here).
_PADDED_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _operands(node: torch.fx.Node):
    """(bias or None, A, B) of an mm, addmm or bmm node."""
    if node.target is aten.addmm.default:
        return node.args[0], node.args[1], node.args[2]
    return None, node.args[0], node.args[1]


def alignment_padding(node: torch.fx.Node) -> "tuple[tuple, str]":
    """((zeros added to M, K, N), "") when `node`'s GEMM should run padded, else ((0, 0, 0), why
    not): "aligned" (nothing to pad), "symbolic", "matrix_vector", "outer_product", "thin",
    "inductor_judged", "not_a_padded_op", "not_floating", "no_value"."""
    none = (0, 0, 0)
    if node.op != "call_function" or node.target not in _PADDED_OPS:
        return none, "not_a_padded_op"
    _, a, b = _operands(node)
    a_val, b_val = a.meta.get("val"), b.meta.get("val")
    if not isinstance(a_val, torch.Tensor) or not isinstance(b_val, torch.Tensor):
        return none, "no_value"
    alignment = pad_mm.get_alignment_size(a_val)
    if alignment == 0 or pad_mm.get_alignment_size(b_val) != alignment:
        return none, "not_floating"
    dims = (*a_val.shape[-2:], b_val.shape[-1])  # M, K, N
    known = [type(d) is int for d in dims]        # symbolic sizes are never compared (no guard)
    pads = tuple(pad_mm.get_padded_length(d, alignment) for d in dims)
    if not any(pads):
        return none, "aligned" if all(known) else "symbolic"
    if (known[0] and dims[0] == 1) or (known[2] and dims[2] == 1):
        return none, "matrix_vector"
    if known[1] and dims[1] == 1:
        return none, "outer_product"
    if any(pad and d < alignment for d, pad in zip(dims, pads)):
        return none, "thin"
    if all(known) and inductor_judges(dims, a_val):
        return none, "inductor_judged"
    return pads, ""


def inductor_judges(dims: tuple, a_val: torch.Tensor) -> bool:
    """Whether Inductor's pad_mm decides this GEMM's padding by its own benchmark, in the joint
    graph: a compute-bound GEMM on a device where it pads."""
    return pads_on(a_val.device) and pad_mm.is_mm_compute_bound(*dims, a_val.dtype)


def pad_gemm(node: torch.fx.Node) -> bool:
    """Replace `node` (mm, addmm or bmm) with its padded form when `alignment_padding` says so;
    return whether it did."""
    pads, why = alignment_padding(node)
    if not any(pads):
        log.debug("aligned_gemms: %s stays as it is (%s)", node.name, why)
        return False
    bias, a, b = _operands(node)
    if node.target is aten.mm.default:
        replace_with_traced(node, pad_mm.mm_replace, [a, b])
    elif node.target is aten.bmm.default:
        replace_with_traced(node, pad_mm.bmm_replace, [a, b])
    else:
        beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
        alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        replace_with_traced(node, lambda bias_, a_, b_: pad_mm.addmm_replace(bias_, a_, b_, beta, alpha),
                            [bias, a, b])
    log.debug("aligned_gemms: %s padded by (M, K, N) = %s", node.name, pads)
    return True


def pads_on(device: torch.device) -> bool:
    """Where the Mod pads: CUDA, where loka's FP8 recipes run (Inductor's pad_mm pads CUDA GEMMs)."""
    return device.type == "cuda"


def align_gemms(graph: torch.fx.Graph, ctx) -> int:
    """Pad each high-precision CUDA site of `graph` that `alignment_padding` admits (module
    docstring); return how many were padded. Runs after `lower`, so FP8 sites are gone; not in
    the probe phase, whose variant runs as traced for its statistics."""
    if not MOD.on(ctx.inactive_mods) or ctx.phase is Phase.PROBE or not inductor_config.shape_padding:
        return 0
    present = set(graph.nodes)
    padded = 0
    for site in ctx.sites:
        decision = ctx.decisions.get(site.id)
        if decision is None or decision.fp8 or site.node not in present or not pads_on(site.device):
            continue
        padded += pad_gemm(site.node)
    return padded


MOD = Mod("aligned_gemms", Stage.POST_GRAD, True,
          "high-precision GEMMs off the 16-byte alignment run padded, mat-vec and thin ones as they are")
