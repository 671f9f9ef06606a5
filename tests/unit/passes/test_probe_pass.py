"""passes/probe.py: observers on the GEMM sites of small AOTAutograd graphs."""

import functools

import torch

from loka_compile import LokaConfig, dispatch
from loka_compile.passes import Phase, Reason, run_passes
from loka_compile.passes.dispatch_sites import dispatch_sites
from loka_compile.passes.find_sites import find_sites
from loka_compile.passes.lower import lower
from graphs import make_ctx, targets

aten = torch.ops.aten


class TestProbe:
    def test_probe_phase_inserts_observers_and_keeps_gemms(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = run_passes(fwd.graph, make_ctx(fwd.graph, phase=Phase.PROBE))
        assert ctx.changes["probe"] == 2 and ctx.changes["lower"] == 0
        assert targets(fwd.graph).count(torch.ops.loka.observe_gemm.default) == 2
        assert aten.addmm.default in targets(fwd.graph)
        # observers stand right before the GEMM they watch
        nodes = [n for n in fwd.graph.nodes if n.op == "call_function"]
        for i, n in enumerate(nodes):
            if n.target is torch.ops.loka.observe_gemm.default:
                assert nodes[i + 1].target in (aten.mm.default, aten.addmm.default)

    def test_fp8_phase_inserts_no_observers(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = run_passes(fwd.graph, make_ctx(fwd.graph, phase=Phase.FP8))
        assert ctx.changes["probe"] == 0
        assert torch.ops.loka.observe_gemm.default not in targets(fwd.graph)

    def test_unsafe_verdict_keeps_site_in_high_precision(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, ctx)
        first = ctx.sites[0].id
        ctx.decide = functools.partial(dispatch.decide, config=LokaConfig(recipe="rowwise"), phase=Phase.FP8,
                                       unsafe_sites={first: 0.5})
        dispatch_sites(fwd.graph, ctx)
        assert ctx.decisions[first].reason is Reason.PROBE_UNSAFE
        assert lower(fwd.graph, ctx) == 1
