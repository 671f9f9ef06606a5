"""loka_compile/dispatch.py: the decision per site on small AOTAutograd graphs."""


import torch

from loka_compile import LokaConfig, dispatch
from loka_compile.passes import Reason
from loka_compile.passes.find_sites import find_sites
from graphs import make_ctx

aten = torch.ops.aten


class TestDispatch:
    def test_reasons(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, ctx)
        site = ctx.sites[0]

        def reason(**config):
            return dispatch.decide(site, LokaConfig(**config), "fp8", {}).reason

        assert reason(recipe="rowwise") is Reason.FP8
        assert reason(emulate=False) is Reason.NO_FP8_HARDWARE
        assert reason(min_gemm_dim=64) is Reason.TOO_SMALL
        assert reason(exclude_modules=[site.module]) is Reason.EXCLUDED_BY_CONFIG
        assert reason(providers=["scaled_mm_rowwise"]) is Reason.NO_PROVIDER
