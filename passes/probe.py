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

With `ctx.perturb_outputs` (an output budget, `LokaConfig.max_output_error`), each such
site of role `fwd` in a forward or inference graph also gets
    C = aten.mm(A, B)
    C' = loka.perturb(C, site_key)      # every user of C reads C'
a copy of C unless the backend switches the site on (`kernels.ops.perturbing`), when it is
C * (1 + delta z): what the budget's sensitivity runs measure. Backward graphs get none (their
GEMMs, recomputed forward ones included, do not reach the forward's outputs).

Declines: sites that would not go FP8 anyway (nothing to learn), and every graph outside
the probe phase.
"""

from __future__ import annotations

import contextlib

import torch

from .context import GraphKind, PassContext, Phase, Reason, Role
from .find_sites import operands


def probe(graph: torch.fx.Graph, ctx: PassContext) -> int:
    if ctx.phase is not Phase.PROBE:
        return 0
    inserted = 0
    for site in ctx.sites:
        decision = ctx.decisions[site.id]
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
        if ctx.perturb_outputs and site.role is Role.FWD and ctx.kind is not GraphKind.BACKWARD:
            _perturb_output(graph, site)
    return inserted


def _perturb_output(graph: torch.fx.Graph, site) -> None:
    """Every user of the site's GEMM reads `loka.perturb` of it instead."""
    node = site.node
    with graph.inserting_after(node):
        noisy = graph.call_function(torch.ops.loka.perturb.default, (node, site.key))
    node.replace_all_uses_with(noisy, delete_user_cb=lambda user: user is not noisy)
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        mode = getattr(value, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            noisy.meta["val"] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                                    device=value.device)
    for key in ("stack_trace", "nn_module_stack"):
        if key in node.meta:
            noisy.meta[key] = node.meta[key]
