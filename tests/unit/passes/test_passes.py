"""Each pass on small AOTAutograd graphs, with a negative case each."""

import dataclasses
import functools

import pytest
import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from loka_compile import LokaConfig, dispatch, speed
from loka_compile.passes import GraphKind, PassContext, Phase, Reason, Role, graph_kind, run_passes
from loka_compile.passes.context import Candidate
from loka_compile.passes.dispatch_sites import dispatch_sites
from loka_compile.passes.find_sites import clean_module_path, find_sites
from loka_compile.passes.lower import lower
from loka_compile.passes.mods import benchmarked_reductions
from numerics import sqnr_db

aten = torch.ops.aten


def aot_graphs(fn, *args):
    """Forward and backward ATen graphs of fn, as AOTAutograd hands them to a compiler."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep)(*args)
    out.sum().backward()
    return graphs


def linear_relu_linear(x, w1, b1, w2):
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2)


def make_ctx(graph, phase=Phase.FP8, params=frozenset(), config=None, unsafe=None):
    config = config or LokaConfig(recipe="rowwise")
    decide = functools.partial(dispatch.decide, config=config, phase=phase, unsafe_sites=unsafe or {})
    return PassContext(graph="t", kind=graph_kind(graph), phase=phase, param_input_indices=params, decide=decide,
                       inactive_mods=config.inactive_mods)


def targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.fixture
def mlp_graphs():
    x = torch.randn(32, 64)
    w1, b1, w2 = (torch.randn(128, 64, requires_grad=True), torch.randn(128, requires_grad=True),
                  torch.randn(48, 128, requires_grad=True))
    return aot_graphs(linear_relu_linear, x, w1, b1, w2)


class TestFindSites:
    def test_roles_shapes_and_links(self, mlp_graphs):
        fwd, bwd = mlp_graphs
        fctx = make_ctx(fwd.graph)
        assert fctx.kind is GraphKind.FORWARD
        assert find_sites(fwd.graph, fctx) == 2
        assert [(s.op, s.role, s.shape) for s in fctx.sites] == [
            ("addmm", Role.FWD, (32, 64, 128)), ("mm", Role.FWD, (32, 128, 48))]
        # forward inputs are (x, w1, b1, w2): 1, 2 and 3 are parameters
        bctx = make_ctx(bwd.graph, params=frozenset({1, 2, 3}))
        assert bctx.kind is GraphKind.BACKWARD
        find_sites(bwd.graph, bctx)
        roles = sorted((s.role.value, s.shape) for s in bctx.sites)
        assert roles == [("dgrad", (32, 48, 128)), ("wgrad", (48, 32, 128)), ("wgrad", (128, 32, 64))]
        for site in bctx.sites:
            assert site.a_is_grad and not site.b_is_grad  # the incoming gradient is always A here
        assert {s.seq_nr for s in bctx.sites} <= {s.seq_nr for s in fctx.sites}

    def test_operand_layouts(self, mlp_graphs):
        fwd, bwd = mlp_graphs
        fctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, fctx)
        # x @ W^T: W arrives as a transposed view
        assert [(s.a_major, s.b_major) for s in fctx.sites] == [("row", "column"), ("row", "column")]
        bctx = make_ctx(bwd.graph, params=frozenset({1, 2, 3}))
        find_sites(bwd.graph, bctx)
        layouts = {(s.role.value, s.shape): (s.a_major, s.b_major) for s in bctx.sites}
        assert layouts[("wgrad", (128, 32, 64))][0] == "column"  # dY^T @ x
        assert layouts[("dgrad", (32, 48, 128))] == ("row", "row")  # dY @ W

    def test_no_parameters_means_no_wgrad(self, mlp_graphs):
        _, bwd = mlp_graphs
        ctx = make_ctx(bwd.graph, params=frozenset())
        find_sites(bwd.graph, ctx)
        assert {s.role for s in ctx.sites} == {Role.DGRAD}

    def test_graph_without_gemms(self):
        fwd, _ = aot_graphs(lambda x: torch.relu(x) * 2, torch.randn(8, 8, requires_grad=True))
        ctx = make_ctx(fwd.graph)
        assert find_sites(fwd.graph, ctx) == 0 and ctx.sites == []

    def test_module_paths(self):
        assert clean_module_path("L['self'].layers[0].fc") == "layers.0.fc"
        assert clean_module_path("L['self']._modules['head']") == "head"
        assert clean_module_path("getattr(G.m, '0')") == "m.0"
        assert clean_module_path("L['self']") == ""


def fp8_casts(graph):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.prims.convert_element_type.default
            and n.args[1] in (torch.float8_e4m3fn, torch.float8_e5m2)]


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


class TestSpeedCheck:
    """The speed rule of Dispatch, with the hardware and the timings stood in for (CPU has
    no FP8); the real timing path is exercised on CPU below and on the GPU in -m cuda."""

    @pytest.fixture
    def fp8_site(self, mlp_graphs, monkeypatch):
        from loka_compile.kernels import providers
        fwd, _ = mlp_graphs
        ctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, ctx)
        real = providers.get("scaled_mm_rowwise")
        stand_in = dataclasses.replace(real, available=lambda device: True)
        monkeypatch.setattr(dispatch.providers, "has_fp8_hardware", lambda device: True)
        monkeypatch.setattr(dispatch.providers, "select", lambda request: [stand_in])
        return ctx.sites[0]

    def _decide(self, site, monkeypatch, bf16_us, fp8_us, **config):
        calls = []

        def timing(shape, scaling, a_format, b_format, providers, fast_accum=False):
            calls.append(shape)
            return speed.SiteTiming(bf16_us, fp8_us, providers[0], {providers[0]: fp8_us}, 0.0)

        monkeypatch.setattr(dispatch.speed, "site_timing", timing)
        monkeypatch.setattr(dispatch.speed, "runnable_providers", lambda shape, scaling, a, b, names, fast: names)
        return dispatch.decide(site, LokaConfig(recipe="rowwise", **config), "fp8", {}), calls

    def test_slower_site_stays_in_high_precision_with_timings(self, fp8_site, monkeypatch):
        decision, calls = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=12.0)
        assert decision.reason is Reason.SLOWER_THAN_BF16 and not decision.fp8
        assert (decision.bf16_us, decision.fp8_us) == (10.0, 12.0) and "0.83x" in decision.detail
        shape = calls[0]
        assert (shape.m, shape.k, shape.n, shape.a_major, shape.b_major, shape.has_bias) == \
            (32, 64, 128, "row", "column", True)

    def test_faster_site_goes_fp8_and_margin_applies(self, fp8_site, monkeypatch):
        decision, _ = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=8.0)
        assert decision.fp8 and decision.reason is Reason.FP8 and decision.fp8_us == 8.0
        decision, _ = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=9.8)  # 1.02x < 1.05
        assert decision.reason is Reason.SLOWER_THAN_BF16
        decision, _ = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=9.8, min_fp8_speedup=1.0)
        assert decision.fp8

    def test_speed_check_off_and_every_mode_timed(self, fp8_site, monkeypatch):
        """Device time decides in every compile mode; the shapes differ only where the
        graphs do: multi-kernel (longer persistent rows) runs in CUDA-graph modes only."""
        decision, calls = self._decide(fp8_site, monkeypatch, 10.0, 20.0, speed_check=False)
        assert decision.fp8 and not calls
        _, (graphed,) = self._decide(fp8_site, monkeypatch, 10.0, 5.0, mode="reduce-overhead")
        _, (default,) = self._decide(fp8_site, monkeypatch, 10.0, 5.0)
        assert (graphed.persistent_row_max, default.persistent_row_max) == \
            (benchmarked_reductions.MULTI_KERNEL_PERSISTENT_ROW_MAX, benchmarked_reductions.PERSISTENT_ROW_MAX)
        assert dataclasses.replace(graphed, persistent_row_max=default.persistent_row_max) == default

    def test_a_failed_timing_leaves_the_site_fp8_with_a_warning(self, fp8_site, monkeypatch, caplog):
        def broken(*args, **kwargs):
            raise RuntimeError("CUDA out of memory")

        monkeypatch.setattr(dispatch.speed, "site_timing", broken)
        with caplog.at_level("WARNING", logger="loka"):
            decision = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise"), "fp8", {})
        assert decision.fp8 and "speed not measured" in decision.detail
        assert "could not time" in caplog.text

    @pytest.fixture
    def failing_provider(self):
        """A provider whose GEMM raises at every shape, as cuBLASLt's rowwise GEMM does
        at some (CUBLAS_STATUS_NOT_SUPPORTED)."""
        from loka_compile.kernels import providers

        def gemm(*args, **kwargs):
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul`")

        provider = providers.register(dataclasses.replace(providers.get("emulated"), name="failing_test", gemm=gemm))
        speed.clear_cache()
        yield provider.name
        providers._REGISTRY.pop(provider.name)
        speed.clear_cache()

    def test_a_provider_that_raises_at_the_shape_is_never_chosen(self, failing_provider):
        shape = speed.SiteShape(64, 32, 48, "row", "column", True, torch.float32, torch.device("cpu"))
        timing = speed.site_timing(shape, "rowwise", "e4m3", "e4m3", (failing_provider, "emulated"))
        assert timing.provider == "emulated" and set(timing.gemm_us) == {"emulated"}
        assert "CUBLAS_STATUS_NOT_SUPPORTED" in timing.failed[failing_provider]
        assert speed.runnable_providers(shape, "rowwise", "e4m3", "e4m3", (failing_provider, "emulated")) == \
            ("emulated",)
        with pytest.raises(speed.NoProviderRuns, match="failing_test"):
            speed.runnable_providers(shape, "rowwise", "e4m3", "e4m3", (failing_provider,))

    @pytest.mark.parametrize("speed_check", [True, False])
    def test_a_site_no_provider_can_run_stays_in_high_precision(self, fp8_site, failing_provider, monkeypatch,
                                                                 speed_check):
        from loka_compile.kernels import providers
        as_hardware = dataclasses.replace(providers.get(failing_provider), emulated=False)
        monkeypatch.setattr(dispatch.providers, "select", lambda request: [as_hardware])
        decision = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise", speed_check=speed_check), "fp8", {})
        assert not decision.fp8 and decision.reason is Reason.PROVIDER_FAILED
        assert "CUBLAS_STATUS_NOT_SUPPORTED" in decision.detail

    def test_symbolic_k_n_sites_are_not_timed_batched_ones_are(self, fp8_site):
        assert speed.site_shape(dataclasses.replace(fp8_site, shape=(32, "s1", 128)), "rowwise") is None
        assert speed.site_shape(dataclasses.replace(fp8_site, shape=(32, 64, "s1")), "rowwise") is None
        assert speed.site_shape(dataclasses.replace(fp8_site, batch=4), "rowwise").batch == 4

    def test_m_buckets_are_the_next_power_of_two(self):
        assert [speed.m_bucket(m) for m in (1, 2, 3, 48, 64, 65, 200, 8192)] == [1, 2, 4, 64, 64, 128, 256, 8192]

    def test_symbolic_m_is_timed_at_its_bucket_and_decided_by_the_speed_rule(self, fp8_site, monkeypatch):
        # The graph was traced at 32 rows; with those rows a symbol, its size hint is 24.
        symbolic = dataclasses.replace(fp8_site, shape=("s0", 64, 128))
        monkeypatch.setattr(speed, "m_hint", lambda site: 24 if site is symbolic else site.shape[0])
        decision, calls = self._decide(symbolic, monkeypatch, bf16_us=10.0, fp8_us=12.0)
        assert [shape.m for shape in calls] == [32]
        assert decision.reason is Reason.SLOWER_THAN_BF16 and decision.m_bucket == 32
        assert "M=s0 timed at 32, the power of two at or above its compile-time size 24" in decision.detail
        decision, _ = self._decide(symbolic, monkeypatch, bf16_us=10.0, fp8_us=5.0)
        assert decision.reason is Reason.FP8 and decision.m_bucket == 32
        decision, _ = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=5.0)
        assert decision.m_bucket is None and "timed at" not in decision.detail  # a concrete M is no bucket

    def test_symbolic_m_without_a_size_hint_is_not_timed(self, fp8_site, monkeypatch):
        monkeypatch.setattr(speed, "m_hint", lambda site: None)
        decision, calls = self._decide(dataclasses.replace(fp8_site, shape=("u0", 64, 128)), monkeypatch, 10.0, 20.0)
        assert not calls and decision.reason is Reason.FP8 and decision.m_bucket is None

    def test_candidates_are_recorded_per_provider(self, fp8_site, monkeypatch):
        def timing(shape, scaling, a_format, b_format, providers, fast_accum=False):
            return speed.SiteTiming(10.0, 5.0, "p1", {"p1": 4.0, "p2": 6.0}, 1.0,
                                    failed={"p3": "RuntimeError: no (kernel)"})

        monkeypatch.setattr(dispatch.speed, "site_timing", timing)
        decision = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise"), "fp8", {})
        assert decision.fp8 and decision.provider == "p1"
        assert decision.candidates == (Candidate("p1", 4.0, True, ""),
                                       Candidate("p2", 6.0, False, "slower GEMM (6.0 us vs 4.0 us)"),
                                       Candidate("p3", None, False, "cannot run here (RuntimeError: no (kernel))"))
        slower = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise", min_fp8_speedup=3.0), "fp8", {})
        assert slower.reason is Reason.SLOWER_THAN_BF16 and not any(c.chosen for c in slower.candidates)
        assert slower.candidates[0].lost == "the site stays in high precision"

    def test_fused_cast_charge_follows_the_persistent_row_limit(self, fp8_site):
        # A bf16 row that fits one persistent reduction costs the fused cast its FP8 byte of 3.
        assert speed._fused_fraction(torch.bfloat16, 1024) == pytest.approx(1 / 3)
        assert speed._fused_fraction(torch.bfloat16, 3456) == speed._fused_fraction(torch.bfloat16, 8192, benchmarked_reductions.MULTI_KERNEL_PERSISTENT_ROW_MAX) == 1.0
        assert speed._fused_fraction(torch.bfloat16, 3456, benchmarked_reductions.MULTI_KERNEL_PERSISTENT_ROW_MAX) == \
            pytest.approx(1 / 3)
        assert speed.site_shape(fp8_site, "rowwise").persistent_row_max == benchmarked_reductions.PERSISTENT_ROW_MAX
        assert speed.site_shape(fp8_site, "rowwise", benchmarked_reductions=True).persistent_row_max == \
            benchmarked_reductions.MULTI_KERNEL_PERSISTENT_ROW_MAX

    def test_a_static_scale_cast_is_pointwise(self, mlp_graphs):
        """A calibrated A is cast clamp(A / s) -> fp8 with no amax: it fuses into its
        producer whatever the scaling, and costs its FP8 byte there at any row length."""
        fwd, _ = mlp_graphs
        ctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, ctx)
        first, second = ctx.sites  # second's A is relu of first's output
        dynamic = speed.site_shape(second, "tensorwise")
        assert not dynamic.a_static and not dynamic.a_fused  # the whole tensor's amax comes first
        static = speed.site_shape(second, "tensorwise", a_static=True)
        assert static.a_static and static.a_fused
        assert not speed.site_shape(first, "rowwise", a_static=True).a_fused  # a graph input: standalone
        assert speed._fused_fraction(torch.bfloat16, 8192, static=True) == pytest.approx(1 / 3)

    def test_real_timing_on_cpu(self):
        speed.clear_cache()
        shape = speed.SiteShape(64, 32, 48, "row", "column", True, torch.float32, torch.device("cpu"))
        timing = speed.site_timing(shape, "rowwise", "e4m3", "e4m3", ("emulated",))
        assert 0 < timing.bf16_us < 1e6 and 0 < timing.fp8_us < 1e6
        assert timing.provider == "emulated" and 0 < timing.cast_us < timing.fp8_us
        assert speed.site_timing(shape, "rowwise", "e4m3", "e4m3", ("emulated",)) is timing
        static = speed.site_timing(dataclasses.replace(shape, a_static=True), "rowwise", "e4m3", "e4m3",
                                   ("emulated",))
        assert static is not timing and 0 < static.cast_us < static.fp8_us
        speed.clear_cache()

    def test_config_validation(self):
        with pytest.raises(ValueError, match="min_fp8_speedup"):
            LokaConfig(min_fp8_speedup=0)
        with pytest.raises(ValueError, match="speed_check"):
            LokaConfig(speed_check="yes")
