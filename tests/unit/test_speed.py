"""loka_compile/speed.py: the speed check on small AOTAutograd graphs."""

import dataclasses

import pytest
import torch

from loka_compile import LokaConfig, dispatch, speed
from loka_compile.passes import Phase, Reason
from loka_compile.passes.context import Candidate
from loka_compile.passes.find_sites import find_sites
from loka_compile.passes.mods import benchmarked_reductions
from graphs import make_ctx

aten = torch.ops.aten


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
        monkeypatch.setattr(dispatch.speed, "first_runnable_provider",
                            lambda shape, scaling, a, b, names, fast: names[0])
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

    def test_a_site_decided_elsewhere_is_neither_timed_nor_tried(self, fp8_site, monkeypatch):
        """`untimed` (the output budget keeps the site in high precision): its FP8 decision is
        made without a timing or a provider trial, saying why; without it the site is timed."""
        trials = []
        monkeypatch.setattr(dispatch.speed, "site_timing", lambda *args, **kwargs: trials.append(args))
        monkeypatch.setattr(dispatch.speed, "first_runnable_provider", lambda *args, **kwargs: trials.append(args))
        for speed_check in (True, False):
            decision = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise", speed_check=speed_check), "fp8", {},
                                       untimed="kept by the budget")
            assert decision.fp8 and decision.bf16_us is None and "not timed: kept by the budget" in decision.detail
        assert not trials
        _, calls = self._decide(fp8_site, monkeypatch, bf16_us=10.0, fp8_us=8.0)
        assert len(calls) == 1

    def test_the_output_budget_s_kept_sites_are_not_timed(self, fp8_site, monkeypatch):
        """Dispatch through the post-grad pass's `_decide`: a site the output budget keeps is
        amended to high precision by the budget without being timed; the others are timed."""
        from loka_compile import inductor_passes, probe
        from loka_compile.output_budget import OutputBudget
        from loka_compile.state import GraphRecord

        timed = []

        def timing(shape, scaling, a_format, b_format, providers, fast_accum=False):
            timed.append(shape)
            return speed.SiteTiming(10.0, 5.0, providers[0], {providers[0]: 5.0}, 0.0)

        monkeypatch.setattr(dispatch.speed, "site_timing", timing)
        config = LokaConfig(recipe="rowwise")
        for kept in (True, False):
            record = GraphRecord(name="g0", config=config, store=probe.ProbeStore())
            record.output_budget = OutputBudget(budget=0.01, sensitivity={}, error={}, predicted_before=0.0,
                                                predicted=0.0, kept={fp8_site.id: "predicted 0.02 > 0.01"} if kept else {})
            if kept:  # the budget's kept sites are among the plan's unsafe verdicts
                record.plan.unsafe[fp8_site.id] = 0.5
            ctx = make_ctx(fp8_site.node.graph, config=config)
            decision = inductor_passes._decide(fp8_site, record, Phase.FP8, ctx, inductor_passes.DecidedOnce())
            if kept:
                assert not decision.fp8 and decision.reason is Reason.PROBE_UNSAFE and not timed
                assert [a.by for a in ctx.amendments] == ["output_budget"]
            else:
                assert decision.fp8 and decision.fp8_us == 5.0 and len(timed) == 1 and not ctx.amendments

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
        assert speed.first_runnable_provider(shape, "rowwise", "e4m3", "e4m3", (failing_provider, "emulated")) == \
            "emulated"
        with pytest.raises(speed.NoProviderRuns, match="failing_test"):
            speed.first_runnable_provider(shape, "rowwise", "e4m3", "e4m3", (failing_provider,))

    def test_providers_after_the_first_that_runs_are_not_tried(self, monkeypatch):
        """Only the first runnable provider is chosen, so none after it is tried (a trial of
        loka's Triton GEMM autotunes, compiling each of its configurations)."""
        from loka_compile.kernels import providers

        tried = []

        def counted(name):
            real = providers.get("emulated").gemm

            def gemm(*args, **kwargs):
                tried.append(name)
                return real(*args, **kwargs)
            return dataclasses.replace(providers.get("emulated"), name=name, gemm=gemm)

        for name in ("counted_first", "counted_second"):
            providers.register(counted(name))
        speed.clear_cache()
        try:
            shape = speed.SiteShape(64, 32, 48, "row", "column", True, torch.float32, torch.device("cpu"))
            assert speed.first_runnable_provider(shape, "rowwise", "e4m3", "e4m3",
                                                 ("counted_first", "counted_second")) == "counted_first"
            assert tried == ["counted_first"]
        finally:
            for name in ("counted_first", "counted_second"):
                providers._REGISTRY.pop(name)
            speed.clear_cache()

    @pytest.mark.parametrize("speed_check", [True, False])
    def test_a_site_no_provider_can_run_stays_in_high_precision(self, fp8_site, failing_provider, monkeypatch,
                                                                 speed_check):
        from loka_compile.kernels import providers
        as_hardware = dataclasses.replace(providers.get(failing_provider), emulated=False)
        monkeypatch.setattr(dispatch.providers, "select", lambda request: [as_hardware])
        decision = dispatch.decide(fp8_site, LokaConfig(recipe="rowwise", speed_check=speed_check), "fp8", {})
        assert not decision.fp8 and decision.reason is Reason.PROVIDER_FAILED
        assert "CUBLAS_STATUS_NOT_SUPPORTED" in decision.detail

    def test_high_precision_time_is_that_of_the_aligned_gemms_padded_form(self, monkeypatch):
        """A site off the alignment that stayed high precision would run padded (the aligned_gemms
        Mod): the speed check times that padded GEMM against FP8, not the unaligned one."""
        shape = speed.SiteShape(64, 30, 45, "row", "column", True, torch.float32, torch.device("cpu"),
                                hp_padding=(0, 2, 3))
        timed = []

        def first_call_shape(fn, device):
            out = fn()
            timed.append(tuple(out.shape) if isinstance(out, torch.Tensor) else None)
            return [1.0]

        monkeypatch.setattr(speed, "_time_runs_us", first_call_shape)
        high_precision_outputs = []
        for padding in ((0, 2, 3), (0, 0, 0)):
            timed.clear()
            speed._measure_site(dataclasses.replace(shape, hp_padding=padding), "rowwise", "e4m3", "e4m3",
                                ("emulated",), False)
            high_precision_outputs.append(timed[0])  # the high-precision GEMM is timed first
        assert high_precision_outputs == [(64, 48), (64, 45)]

    def test_dispatch_hands_the_speed_check_the_padding_of_a_cuda_site(self):
        from graphs import aot_graphs
        from loka_compile.passes.mods import aligned_gemms

        x, w = torch.randn(64, 77, requires_grad=True), torch.randn(32, 77, requires_grad=True)
        fwd = aot_graphs(lambda x, w: torch.nn.functional.linear(x, w), x, w)[0]
        ctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, ctx)
        (site,) = ctx.sites
        config = LokaConfig(recipe="rowwise")
        assert dispatch._high_precision_padding(site, config) == (0, 0, 0)  # CPU: the Mod does not pad
        on_cuda = dataclasses.replace(site, device=torch.device("cuda"))
        assert aligned_gemms.pads_on(on_cuda.device)
        assert dispatch._high_precision_padding(on_cuda, config) == (0, 3, 0)  # fp32: K 77 -> 80
        off = LokaConfig(recipe="rowwise", disabled_mods=["aligned_gemms"])
        assert dispatch._high_precision_padding(on_cuda, off) == (0, 0, 0)

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
