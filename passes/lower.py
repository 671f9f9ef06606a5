"""lower: replace each GEMM that Dispatch sent to FP8 with `loka.fp8_gemm`.

Matches:
    C = aten.mm(A, B)               C = aten.addmm(bias, A, B)
    C = aten.bmm(A, B)              C = aten.baddbmm(bias, A, B)
Becomes:
    C = loka.fp8_gemm(A, B, bias | None, scaling, a_format, b_format, provider, site_key)
The op quantizes A and B with scales along K and runs the chosen provider; the bias is
added in its epilogue.

Declines: sites whose decision is not FP8 (they keep their ATen op, and the reason is in
the report), addmm/baddbmm with beta or alpha other than 1 (Dispatch marks those).
"""

from __future__ import annotations

import torch

from .context import PassContext
from .find_sites import operands


def lower(graph: torch.fx.Graph, ctx: PassContext) -> int:
    lowered = 0
    for site in ctx.sites:
        decision = ctx.decisions[site.key]
        if not decision.fp8:
            continue
        node = site.node
        a, b, bias, _ = operands(node)
        with graph.inserting_before(node):
            new = graph.call_function(
                torch.ops.loka.fp8_gemm.default,
                (a, b, bias, decision.scaling, decision.a_format, decision.b_format, decision.provider, site.key))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        site.node = new
        lowered += 1
    return lowered
