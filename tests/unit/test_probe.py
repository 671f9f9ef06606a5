"""The Probe's statistics: metrics, Welford/Chan moments, FP8 range fractions, the
reservoir, per-candidate errors and their confidence bounds, and the verdicts."""

import math

import numpy as np
import pytest
import torch

from loka_compile import probe
from loka_compile.kernels import metrics
from loka_compile.kernels import ops
from loka_compile.kernels.quantize import Fp8Format, cast_with_scale, scale_from_amax


# ------------------------------------------------------------------ metrics


def test_metrics_against_hand_computed_values():
    ref = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    val = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
    # ||ref|| = sqrt(26), ||noise|| = 1
    assert metrics.rel_error(ref, val) == pytest.approx(1 / math.sqrt(26))
    assert metrics.sqnr_db(ref, val) == pytest.approx(20 * math.log10(math.sqrt(26)))
    # rows: 0 / 5 and 1 / 1, mean 0.5 (the floor 1e-6 * mean row norm is negligible)
    assert metrics.row_rel_error(ref, val) == pytest.approx(0.5, rel=1e-5)
    # median |ref| (torch: the lower middle value) = 1, eps = 0.01: 0, 0, 0, 1 / 1.01
    assert metrics.mere(ref, val) == pytest.approx(0.25 / 1.01)
    assert metrics.mere(ref, val, eps_rel=0.0) == pytest.approx(0.25, rel=1e-12)
    assert metrics.sqnr_db(ref, ref) == math.inf and metrics.rel_error(ref, ref) == 0.0
    assert metrics.mere(ref, ref) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_metrics_never_pass_non_finite(bad):
    ref = torch.ones(4, 4)
    val = ref.clone()
    val[1, 2] = bad
    for r, v in ((ref, val), (val, ref), (val, val)):
        assert metrics.sqnr_db(r, v) == -math.inf
        assert metrics.rel_error(r, v) == math.inf
        assert metrics.row_rel_error(r, v) == math.inf
        assert metrics.mere(r, v) == math.inf


# ------------------------------------------------------------------ moments


def test_welford_chan_matches_numpy_over_batches(store):
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(m, 32, generator=gen) * torch.linspace(0.1, 50, 32) + 1000.0 for m in (7, 64, 1, 300)]
    b = torch.randn(32, 16, generator=gen)
    for a in batches:
        torch.ops.loka.observe_gemm(a, b, "s", "rowwise", "e4m3", "e4m3")
    a_all = torch.cat(batches).double().numpy()
    ops_a = store.summary("s")["operands"]["a"]
    np.testing.assert_allclose(ops_a["mean"].numpy(), a_all.mean(0), rtol=1e-12)
    # fp32 deviations from the fp64 mean, squared in fp32 and summed in fp64
    np.testing.assert_allclose(ops_a["var"].numpy(), a_all.var(0), rtol=1e-6)
    assert ops_a["count"].tolist() == [372.0] * 32
    assert ops_a["amax"] == pytest.approx(np.abs(a_all).max())
    # B's features are its rows (K): one sample per column per call, same weight 4 times.
    ops_b = store.summary("s")["operands"]["b"]
    np.testing.assert_allclose(ops_b["mean"].numpy(), b.double().numpy().mean(1), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ops_b["var"].numpy(), b.double().numpy().var(1), rtol=1e-6)


def test_moments_skip_non_finite_values():
    moments = probe.Moments()
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")], [5.0, 4.0]])
    stats = ops.operand_statistics(x)
    moments.merge(stats["count"], stats["mean"], stats["m2"])
    assert moments.mean.tolist() == [3.0, 3.0] and moments.variance().tolist() == pytest.approx([8 / 3, 1.0])
    assert float(stats["nonfinite"]) == 1


# ------------------------------------------------------------------ FP8 range fractions


def test_range_fractions_of_a_planted_outlier():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=gen)
    x[5, 7] = 1e6                 # sets the tensorwise scale: 1e6 / 448
    x[9, :4] = 1000.0             # beyond e4m3's max (448) unscaled, within e5m2's (57344)
    c = {k: float(v) / x.numel() for k, v in ops._range_fractions(x).items()}
    # Tensorwise e4m3: everything under 1e6 / 448 * 2^-10 ~ 2.2 flushes, about 97% of N(0, 1).
    assert c["e4m3/tensorwise/flush"] > 0.9
    # Rowwise: only the outlier's row (1/64 of the values) loses its small values.
    assert c["e4m3/rowwise/flush"] < 1.5 / 64
    # e5m2 keeps 2^15 more range: tensorwise flushes almost nothing.
    assert c["e5m2/tensorwise/flush"] < 0.01
    assert c["e4m3/unscaled/saturate"] == pytest.approx(5 / x.numel())  # 4 x 1000 and the 1e6
    assert c["e5m2/unscaled/saturate"] == pytest.approx(1 / x.numel())
    assert c["e4m3/tensorwise/saturate"] == 0 and c["e4m3/rowwise/saturate"] == 0
    # The flush and subnormal counts agree with the cast itself.
    for fmt in Fp8Format:
        scale = scale_from_amax(x.abs().amax(), fmt)
        q = cast_with_scale(x, scale, fmt).float()
        tiny = torch.finfo(fmt.dtype).smallest_normal
        assert c[f"{fmt.value}/tensorwise/flush"] == pytest.approx(float(((q == 0) & (x != 0)).float().mean()))
        sub = (q != 0) & (q.abs() < tiny)
        assert c[f"{fmt.value}/tensorwise/subnormal"] == pytest.approx(float(sub.float().mean()))


def test_non_finite_values_saturate_under_every_scaling():
    x = torch.ones(4, 16)
    x[0, 0] = float("inf")
    x[1, 1] = float("nan")
    c = ops._range_fractions(x)
    assert all(float(c[f"{f}/{s}/saturate"]) == 2 for f in ("e4m3", "e5m2") for s in ("tensorwise", "rowwise"))


# ------------------------------------------------------------------ reservoir


def test_no_per_feature_moments_past_moment_features():
    from loka_compile.kernels import ops

    wide = ops.operand_statistics(torch.randn(4, ops.MOMENT_FEATURES + 1))
    assert wide["mean"] is None and wide["m2"] is None and wide["count"] is None
    assert wide["numel"] == 4 * (ops.MOMENT_FEATURES + 1) and torch.isfinite(wide["amax"])
    stats = probe._OperandStats()
    stats.record(wide)
    summary = stats.summary()
    assert summary["mean"] is None and summary["var"] is None and summary["rows_seen"] == 4


def test_reservoir_holds_at_most_reservoir_elements_per_operand():
    """Long rows (a wgrad site's are as long as the batch) get fewer slots, at least one."""
    res = probe.Reservoir()
    res.offer(torch.randn(300, 20000))
    assert res.capacity == probe.RESERVOIR_ELEMENTS // 20000 and res.sample().shape == (res.capacity, 20000)
    huge = probe.Reservoir()
    huge.offer(torch.randn(3, 2 * probe.RESERVOIR_ELEMENTS))
    assert huge.sample().shape == (1, 2 * probe.RESERVOIR_ELEMENTS) and huge.seen == 3
    short = probe.Reservoir()
    short.offer(torch.randn(300, 64))
    assert short.sample().shape == (probe.RESERVOIR_ROWS, 64)


def test_reservoir_keeps_capacity_and_samples_uniformly():
    res = probe.Reservoir(capacity=50, seed=0)
    res.offer(torch.arange(30.0).unsqueeze(1))
    assert res.sample().shape == (30, 1) and sorted(res.sample()[:, 0].tolist()) == list(range(30))
    for start in range(30, 1000, 97):  # ragged calls
        res.offer(torch.arange(start, min(start + 97, 1000), dtype=torch.float32).unsqueeze(1))
    assert res.seen == 1000 and res.sample().shape == (50, 1)
    assert len(set(res.sample()[:, 0].tolist())) == 50  # distinct rows
    # Uniformity: over many runs each decile of the stream holds ~10% of the kept rows.
    hits = np.zeros(10)
    for seed in range(200):
        r = probe.Reservoir(capacity=20, seed=seed)
        for start in range(0, 1000, 128):
            r.offer(torch.arange(start, min(start + 128, 1000), dtype=torch.float32).unsqueeze(1))
        hits += np.bincount((r.sample()[:, 0].numpy() // 100).astype(int), minlength=10)
    share = hits / hits.sum()
    assert np.all(np.abs(share - 0.1) < 0.02), share


def test_store_keeps_real_rows_of_each_operand(store):
    a = torch.randn(600, 32)
    b = torch.randn(32, 48)
    torch.ops.loka.observe_gemm(a, b, "s", "rowwise", "e4m3", "e4m3")
    rows = store.reservoir("s", "a")
    assert rows.shape == (probe.RESERVOIR_ROWS, 32)
    assert all(any(torch.equal(r, x) for x in a) for r in rows[:5])
    assert store.reservoir("s", "b").shape == (48, 32)  # B's columns


# ------------------------------------------------------------------ candidates and bounds


def test_candidates_per_role():
    fwd = ops.candidate_recipes("rowwise", "e4m3", "e4m3")
    assert [ops.candidate_name(*c) for c in fwd] == ["tensorwise/e4m3/e4m3", "rowwise/e4m3/e4m3",
                                                      "blockwise/e4m3/e4m3"]
    dgrad = [ops.candidate_name(*c) for c in ops.candidate_recipes("tensorwise", "e5m2", "e4m3", a_is_grad=True)]
    assert "tensorwise/e5m2/e4m3" in dgrad and "rowwise/e4m3/e4m3" in dgrad and len(dgrad) == 6
    assert not any(c[0].value == "blockwise" for c in ops.candidate_recipes("rowwise", "e4m3", "e4m3", batched=True))


def test_t_quantile_and_bound():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 29, 30, 31, 50, 200):
        assert probe.t_quantile(df) == pytest.approx(scipy_stats.t.ppf(probe.CONFIDENCE, df), abs=2e-3)
    assert probe.upper_bound(0.1, 0.5, 1, 0.3) == 0.3  # one observation: its value
    assert probe.upper_bound(0.1, 0.0, 5, 0.1) == 0.1
    assert probe.upper_bound(0.1, 0.01, 5, math.inf) == math.inf


def _heavy_outlier_batch(gen):
    a = torch.randn(256, 64, generator=gen)
    a[int(torch.randint(0, 256, (1,), generator=gen)), 3] = 1e6 * (1 + torch.rand(1, generator=gen).item())
    return a


def test_heavy_outliers_unsafe_tensorwise_safe_rowwise_by_their_bounds(store):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=gen) / 8
    for _ in range(4):
        torch.ops.loka.observe_gemm(_heavy_outlier_batch(gen), w, "out", "tensorwise", "e4m3", "e4m3")
        torch.ops.loka.observe_gemm(torch.randn(256, 64, generator=gen), w, "clean", "tensorwise", "e4m3", "e4m3")
    s = store.summary("out")
    tw, rw = s["candidates"]["tensorwise/e4m3/e4m3"], s["candidates"]["rowwise/e4m3/e4m3"]
    assert s["chosen"] == "tensorwise/e4m3/e4m3" and tw["n"] == rw["n"] == 4
    assert tw["bound"] > 0.5 and rw["bound"] < 0.06 and s["candidates"]["blockwise/e4m3/e4m3"]["bound"] < 0.06
    # SQNR over the whole product is ruled by the outlier's own row, which tensorwise gets
    # right: it hides the flushed rows that the row-mean error and MERE see.
    assert rw["sqnr_db"]["bound"] > 25 and tw["sqnr_db"]["mean"] > 25
    assert tw["mere"]["mean"] > 0.5 > 0.2 > rw["mere"]["bound"]
    assert s["operands"]["a"]["fractions"]["e4m3/tensorwise/flush"] > 0.9
    unsafe, upgraded = probe.verdicts(store, ["out", "clean"], 0.1)
    assert unsafe == {} and set(upgraded) == {"out"}
    assert upgraded["out"] == (tw["bound"], rw["bound"])
    assert store.summary("clean")["bound_rel_error"] < 0.06
    # Rowwise too fine a budget: unsafe, by the bound.
    unsafe, _ = probe.verdicts(store, ["out"], 0.01)
    assert unsafe == {"out": tw["bound"]}


def test_bound_is_above_the_mean_and_shrinks_with_observations(store):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 64, generator=gen)
    bounds = {}
    for n in (1, 3, 30):
        key = f"n{n}"
        for _ in range(n):
            scale = torch.rand(1, 64, generator=gen) * 4 + 0.1  # feature scales differ per batch
            torch.ops.loka.observe_gemm(torch.randn(64, 64, generator=gen) * scale, w, key, "tensorwise",
                                        "e4m3", "e4m3")
        c = store.summary(key)["candidates"]["tensorwise/e4m3/e4m3"]
        assert c["n"] == n and c["bound"] >= c["mean"] and c["mere"]["bound"] >= c["mere"]["mean"]
        assert c["sqnr_db"]["bound"] <= c["sqnr_db"]["mean"]
        bounds[n] = c["bound"] - c["mean"]
    assert bounds[1] == 0 or bounds[1] >= 0  # one observation: the bound is that observation
    assert bounds[30] < bounds[3]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_nan_input_never_yields_a_safe_verdict(store, scaling):
    a = torch.randn(64, 32)
    a[3, 4] = float("nan")
    b = torch.randn(32, 32)
    for _ in range(3):
        torch.ops.loka.observe_gemm(a, b, "nan", scaling, "e4m3", "e4m3")
        torch.ops.loka.observe_gemm(torch.randn(64, 32), b, "nan_once", scaling, "e4m3", "e4m3")
    torch.ops.loka.observe_gemm(a, b, "nan_once", scaling, "e4m3", "e4m3")
    for key in ("nan", "nan_once"):
        s = store.summary(key)
        assert all(c["bound"] == math.inf and c["sqnr_db"]["bound"] == -math.inf for c in s["candidates"].values())
    unsafe, upgraded = probe.verdicts(store, ["nan", "nan_once"], 1e9)
    assert set(unsafe) == {"nan", "nan_once"} and not upgraded


def test_observer_works_on_batched_and_gradient_sites(store):
    a = torch.randn(3, 40, 32)
    b = torch.randn(3, 32, 16)
    torch.ops.loka.observe_gemm(a, b, "bmm", "rowwise", "e4m3", "e4m3", True, False)
    s = store.summary("bmm")
    assert set(s["candidates"]) == {"tensorwise/e4m3/e4m3", "tensorwise/e5m2/e4m3", "rowwise/e4m3/e4m3",
                                    "rowwise/e5m2/e4m3"}
    assert all(c["bound"] < 0.1 for c in s["candidates"].values())
    assert s["operands"]["a"]["count"].tolist() == [120.0] * 32 and s["operands"]["b"]["rows_seen"] == 48


def test_all_zero_operand_observations_do_not_count(store):
    """A zero batch inside the window measures error 0 at every candidate: counted, it would
    widen the site's confidence bound (two real observations and a zero give a large spread);
    it is left out, so the bound is that of the real observations alone."""
    g = torch.Generator().manual_seed(0)
    real = [torch.randn(64, 32, generator=g) for _ in range(2)]
    b = torch.randn(32, 48, generator=g)
    for a in real:
        store.record("with_zero", ops.gemm_statistics(a, b, "rowwise", "e4m3", "e4m3"))
        store.record("real_only", ops.gemm_statistics(a, b, "rowwise", "e4m3", "e4m3"))
    store.record("with_zero", ops.gemm_statistics(torch.zeros(64, 32), b, "rowwise", "e4m3", "e4m3"))
    with_zero, real_only = store.summary("with_zero"), store.summary("real_only")
    assert with_zero["observations"] == 3 and with_zero["informative"] == 2
    chosen = with_zero["chosen"]
    assert with_zero["candidates"][chosen]["n"] == 2
    assert with_zero["bound_rel_error"] == pytest.approx(real_only["bound_rel_error"], rel=1e-9)
    assert with_zero["mean_rel_error"] == pytest.approx(real_only["mean_rel_error"], rel=1e-9)
    assert 0 < with_zero["mean_bf16_rel_error"] < 0.01  # bf16's own error of the product


def test_a_site_seen_only_with_zero_operands_is_unsafe_unmeasured(store):
    b = torch.randn(32, 48)
    for _ in range(2):
        store.record("zero", ops.gemm_statistics(torch.zeros(64, 32), b, "rowwise", "e4m3", "e4m3"))
    unsafe, upgraded = probe.verdicts(store, ["zero"], 0.1, chain=True)
    assert unsafe == {"zero": math.inf} and not upgraded
    assert probe.describe_summary(store.summary("zero"), 0.1) == probe.UNINFORMATIVE
