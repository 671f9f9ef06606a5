"""loka's graph passes, in the one order they run. The Mods, and where each runs, are in
`passes/mods/` (`loka_compile.passes.mods`, the registry).

Each pass is `fn(graph, ctx) -> int` (how many things it found or changed), lives in a
file named after it, and runs under its name: the `loka.passes` logger at DEBUG prints
the graph before and after each pass.
"""

from __future__ import annotations

import logging

import torch

from .amax_guard import amax_guard
from .context import Amendment, Decision, GraphKind, PassContext, Phase, Reason, Role, Site
from .dispatch_sites import dispatch_sites
from .find_sites import find_sites, graph_kind
from .hop_sites import hop_sites
from .keepdim_outputs import keepdim_outputs
from .lower import lower
from .mods import MODS
from .mods.aligned_gemms import align_gemms
from .probe import probe

log = logging.getLogger("loka.passes")

PIPELINE = (
    ("find_sites", find_sites),
    ("dispatch_sites", dispatch_sites),
    ("probe", probe),
    ("lower", lower),
    ("amax_guard", amax_guard),  # after lower: the guards its casts put in the graph, as one op
    ("aligned_gemms", align_gemms),  # after lower: only the high-precision GEMMs are left to pad
    ("hop_sites", hop_sites),  # after the rest: no pass sees the sites inside higher-order ops
    ("keepdim_outputs", keepdim_outputs),  # last: the graph's outputs as Inductor will return them
)


def run_passes(graph: torch.fx.Graph, ctx: PassContext) -> PassContext:
    for name, fn in PIPELINE:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s/%s before %s:\n%s", ctx.graph, ctx.kind.value, name, graph)
        ctx.changes[name] = fn(graph, ctx)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s/%s after %s (%d):\n%s", ctx.graph, ctx.kind.value, name, ctx.changes[name], graph)
    graph.lint()
    return ctx


__all__ = ["MODS", "PIPELINE", "run_passes", "graph_kind", "Amendment", "Decision", "GraphKind", "PassContext",
           "Phase", "Reason", "Role", "Site"]
