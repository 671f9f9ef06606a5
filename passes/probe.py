"""probe: insert a Probe observer before each FP8-candidate GEMM (probe phase only).

Matches: every site whose Dispatch decision is `Reason.PROBING` (it would go FP8 but the
graph is still in its probe window).

Becomes:
    C = aten.mm(A, B)
->
    loka.observe_gemm(A, B, site_key, scaling, a_format, b_format, a_is_grad, b_is_grad)
    C = aten.mm(A, B)
The observer reads A and B and reports their statistics and the FP8 error of each
candidate recipe to the Probe's store (the gradient flags say which operands may take
e5m2); the GEMM itself stays in high precision.

Declines: sites that would not go FP8 anyway (nothing to learn), and every graph outside
the probe phase.
"""

from __future__ import annotations

import torch

from .context import PassContext, Reason
from .find_sites import operands


def probe(graph: torch.fx.Graph, ctx: PassContext) -> int:
    if ctx.phase != "probe":
        return 0
    inserted = 0
    for site in ctx.sites:
        decision = ctx.decisions[site.key]
        if decision.reason is not Reason.PROBING:
            continue
        a, b, _, _ = operands(site.node)
        with graph.inserting_before(site.node):
            observer = graph.call_function(
                torch.ops.loka.observe_gemm.default,
                (a, b, site.key, decision.scaling, decision.a_format, decision.b_format,
                 bool(getattr(site, "a_is_grad", False)), bool(getattr(site, "b_is_grad", False))))
        observer.meta["val"] = None
        inserted += 1
    return inserted
