"""dispatch_sites: ask Dispatch for a decision on every site. Changes nothing.

Dispatch lives in the backend (it knows the config, the hardware, the providers and the
Probe's verdicts); this pass only calls `ctx.decide` for each site found, telling it
whether the site's A has a calibrated static scale (`ctx.static_a_scale`, as `lower` will
cast it), so that the passes after it (probe, lower) and the report read one decision per
site.
"""

from __future__ import annotations

import torch

from .context import PassContext


def dispatch_sites(graph: torch.fx.Graph, ctx: PassContext) -> int:
    for site in ctx.sites:
        ctx.decisions[site.id] = ctx.decide(site, a_static=ctx.static_a_scale(site) is not None)
    return sum(d.fp8 for d in ctx.decisions.values())
