"""passes/lower.py on small AOTAutograd graphs: FP8 casts and GEMMs where Dispatch says FP8, with a negative case each."""


import torch

from loka_compile import LokaConfig
from loka_compile.passes import Reason, Role, run_passes
from loka_compile.passes.dispatch_sites import dispatch_sites
from loka_compile.passes.find_sites import find_sites
from loka_compile.passes.lower import lower
from numerics import sqnr_db
from graphs import aot_graphs, fp8_casts, linear_relu_linear, make_ctx, targets

aten = torch.ops.aten


class TestLower:
    def test_eligible_gemms_become_casts_and_fp8_gemm(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = run_passes(fwd.graph, make_ctx(fwd.graph))
        assert ctx.changes["lower"] == 2
        assert aten.addmm.default not in targets(fwd.graph)
        # each operand's cast is its own nodes, ending in an FP8 convert
        assert len(fp8_casts(fwd.graph)) == 4
        # the emulated GEMM reads only dequantized FP8 operands (q * scale, zeros kept zero)
        for mm in (n for n in fwd.graph.nodes if n.target is aten.mm.default):
            for operand in mm.args:
                assert operand.target is aten.where.self
                assert operand.args[1].args[0].meta["val"].dtype == torch.float8_e4m3fn
        by_name = {s.name.split(":")[1]: s for s in ctx.sites}
        casts = [ctx.casts.get(s.id, {}) for s in ctx.sites]
        assert casts[0]["a"].startswith("standalone (graph input") and casts[1]["a"] == "fused into relu"
        assert all(c["b"].startswith("standalone (graph input") for c in casts)
        assert by_name
        fwd.recompile()
        x, w1, b1, w2 = torch.randn(32, 64), torch.randn(128, 64), torch.randn(128), torch.randn(48, 128)
        out = fwd(x, w1, b1, w2)[0]
        assert sqnr_db(linear_relu_linear(x, w1, b1, w2), out) > 20  # two e4m3 rowwise GEMMs: ~26 dB

    def test_casts_across_the_producers_rows_are_standalone(self, mlp_graphs):
        """wgrad reads the gradient transposed: its scales run across the rows of the op that
        produced it, so no kernel can compute both; dgrad's run along them."""
        _, bwd = mlp_graphs
        ctx = run_passes(bwd.graph, make_ctx(bwd.graph, params=frozenset({1, 2, 3})))
        by_role = {(s.role, s.module): ctx.casts.get(s.id, {}) for s in ctx.sites}
        dgrad = next(c for (role, _), c in by_role.items() if role is Role.DGRAD)
        assert dgrad["a"].startswith("standalone (graph input tangents")
        wgrads = [c for (role, _), c in by_role.items() if role is Role.WGRAD]
        assert any(c["a"] == "standalone (scales across threshold_backward's rows)" for c in wgrads), wgrads
        tensorwise = run_passes(mlp_graphs[0].graph, make_ctx(mlp_graphs[0].graph, config=LokaConfig(recipe="tensorwise")))
        assert tensorwise.casts[tensorwise.sites[1].id]["a"] == "standalone (tensorwise amax of relu's output)"

    def test_unfused_casts_are_one_opaque_node_per_operand(self, mlp_graphs):
        fwd, _ = mlp_graphs
        ctx = run_passes(fwd.graph, make_ctx(fwd.graph, config=LokaConfig(recipe="rowwise",
                                                                          disabled_mods=("fused_casts",))))
        assert targets(fwd.graph).count(torch.ops.loka.quantize_operand.default) == 4
        assert not fp8_casts(fwd.graph)
        assert all(c == "standalone (loka.quantize_operand)" for s in ctx.sites for c in ctx.casts.get(s.id, {}).values())
        fwd.recompile()
        x, w1, b1, w2 = torch.randn(32, 64), torch.randn(128, 64), torch.randn(128), torch.randn(48, 128)
        assert sqnr_db(linear_relu_linear(x, w1, b1, w2), fwd(x, w1, b1, w2)[0]) > 20

    def test_misaligned_gemm_is_padded(self):
        args = (torch.randn(32, 24), torch.randn(64, 24, requires_grad=True), torch.randn(64, requires_grad=True),
                torch.randn(40, 64, requires_grad=True))
        fwd, _ = aot_graphs(linear_relu_linear, *args)
        ctx = run_passes(fwd.graph, make_ctx(fwd.graph))
        assert ctx.changes["lower"] == 2
        details = [d.detail for d in ctx.decisions.values()]
        assert [(d.pad_k, d.pad_n) for d in ctx.decisions.values()] == [(8, 0), (0, 8)]
        assert details == ["K padded 24->32", "N padded 40->48"]
        pads = [n for n in fwd.graph.nodes if n.target is aten.constant_pad_nd.default
                and n.meta["val"].shape[-1] in (32, 48) or n.target is aten.constant_pad_nd.default
                and n.meta["val"].shape[0] in (32, 48)]
        assert pads, "no zero padding in the graph"
        fwd.recompile()
        out = fwd(*(a.detach() for a in args))[0]
        assert out.shape == (32, 40)
        assert sqnr_db(linear_relu_linear(*args).detach(), out) > 20

    def test_misaligned_gemm_keeps_aten_without_the_pad_mod(self):
        fwd, _ = aot_graphs(linear_relu_linear, torch.randn(32, 24), torch.randn(64, 24, requires_grad=True),
                            torch.randn(64, requires_grad=True), torch.randn(40, 64, requires_grad=True))
        ctx = make_ctx(fwd.graph, config=LokaConfig(recipe="rowwise", disabled_mods=("pad",)))
        find_sites(fwd.graph, ctx)
        dispatch_sites(fwd.graph, ctx)
        assert lower(fwd.graph, ctx) == 0
        assert [d.reason for d in ctx.decisions.values()] == [Reason.K_NOT_MULTIPLE_OF_16, Reason.N_NOT_MULTIPLE_OF_16]
        assert not fp8_casts(fwd.graph)

    def test_forward_gemms_accumulate_fast_and_gradients_precisely(self, mlp_graphs):
        fwd, bwd = mlp_graphs
        fctx = run_passes(fwd.graph, make_ctx(fwd.graph))
        bctx = run_passes(bwd.graph, make_ctx(bwd.graph, params=frozenset({1, 2, 3})))
        assert all(d.fast_accum for d in fctx.decisions.values())
        assert not any(d.fast_accum for d in bctx.decisions.values())

    def test_recipe_keeps_wgrad_in_high_precision(self, mlp_graphs):
        _, bwd = mlp_graphs
        ctx = make_ctx(bwd.graph, params=frozenset({1, 2, 3}), config=LokaConfig())  # default recipe
        run_passes(bwd.graph, ctx)
        by_role = {s.role: ctx.decisions[s.id] for s in ctx.sites}
        assert by_role[Role.WGRAD].reason is Reason.RECIPE_HIGH_PRECISION and by_role[Role.DGRAD].fp8
        # the two wgrad GEMMs keep their ATen mm on high-precision operands; the dgrad's mm
        # is the emulation's, on dequantized FP8 operands
        high_precision = [n for n in bwd.graph.nodes if n.target is aten.mm.default
                          and all(a.meta["val"].dtype == torch.float32 and a.target is not aten.where.self
                                  for a in n.args)]
        assert len(high_precision) == 2
