"""Calibration: static activation scales from the Probe, saved in the plan, cast with a
constant (no amax) in inference graphs; training graphs ignore them."""

import json

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile import perfdb, speed
from loka_compile.passes import GraphKind, Reason
from numerics import rel_error
from graphs import targets

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

E4M3_MAX = 448.0
STATIC = "static scale (calibrated amax)"
# Output error vs fp32 of the static-scale MLP below: measured 0.049 (dynamic rowwise 0.048).
FLOOR = 0.08


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def batches(n=3, rows=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 32, generator=g) for _ in range(n)]


# These models' sites each carry the whole output (sensitivity ~1 x FP8 error ~0.04), so the
# default output budget (max_output_error 0.003) keeps them all in high precision: the tests
# of static scales judge sites by the per-site bound alone.
PER_SITE = {"max_output_error": None}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    torch._dynamo.reset()
    loka_compile.reset()
    torch.manual_seed(0)
    model = MLP()
    plan = loka_compile.calibrate(model, batches(), options=PER_SITE)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return model, plan, str(path)


def inference_graph(compiled):
    (record,) = [r for r in loka_compile.state_of(compiled).records if ("fp8", GraphKind.INFERENCE) in r.graph_modules]
    return record.graph_modules[("fp8", GraphKind.INFERENCE)].graph


def test_calibrate_stores_one_static_scale_per_site_and_round_trips(calibrated):
    model, plan, path = calibrated
    with pytest.raises(ValueError, match="not a model or function compiled"):  # the calibration's graphs are its own
        loka_compile.report(model)
    assert sorted(plan.a_scales) == ["inference/fc1:fwd#1", "inference/fc2:fwd#1"]
    for entry in plan.a_scales.values():
        assert entry["policy"] == "amax" and entry["scale"] == pytest.approx(entry["range"] / E4M3_MAX)
        assert entry["error"] < 0.1  # max_probe_error
    assert max(b.abs().max() for b in batches()) == pytest.approx(plan.a_scales["inference/fc1:fwd#1"]["range"])
    assert loka_compile.load_plan(path).a_scales == plan.a_scales
    # a version-1 plan from before calibration (no "a_scales") still loads
    data = json.load(open(path))
    data.pop("a_scales")
    old = pathlib_write(path + ".old.json", data)
    assert loka_compile.load_plan(old).a_scales == {}
    data["a_scales"] = {"inference/fc1:fwd#1": {"scale": -1.0, "range": 1.0, "policy": "amax", "error": 0.0}}
    with pytest.raises(ValueError, match="damaged.*not finite and positive"):
        loka_compile.load_plan(pathlib_write(path + ".bad.json", data))


def pathlib_write(path, data):
    with open(path, "w") as f:
        json.dump(data, f)
    return path


def test_inference_with_plan_casts_a_with_its_constant_scale(calibrated):
    model, plan, path = calibrated
    x = torch.randn(32, 32)
    with torch.no_grad():
        ref = model(x)
        # each site's own static cast (with gemm_norm, fc1's epilogue would write fc2's A: test_gemm_norm)
        served = torch.compile(model, backend="loka", options={"plan": path, "disabled_mods": ["gemm_norm"]})
        static = served(x)
        graph = inference_graph(served)
        report = loka_compile.report(served)
        torch._dynamo.reset()
        unplanned = torch.compile(model, backend="loka", options={"probe_steps": 0})
        dynamic = unplanned(x)
        dynamic_graph = inference_graph(unplanned)
    assert [s.casts["a"] for s in report.sites if s.id.startswith("inference/")] == [STATIC, STATIC]
    # no amax reduction feeds A's cast (B is the cached weight): only pointwise ops before the convert
    assert torch.ops.aten.amax.default not in targets(graph)
    assert targets(graph).count(torch.ops.prims.convert_element_type.default) >= 2
    assert torch.ops.aten.amax.default in targets(dynamic_graph)  # the dynamic cast has one
    static_err, dynamic_err = rel_error(ref, static), rel_error(ref, dynamic)
    assert static_err < FLOOR and abs(static_err - dynamic_err) < 0.02, (static_err, dynamic_err)


def test_values_beyond_the_calibrated_range_clamp_to_e4m3_max(calibrated):
    model, plan, path = calibrated
    bound = plan.a_scales["inference/fc1:fwd#1"]["scale"] * E4M3_MAX
    x = torch.randn(32, 32)
    x[0, :4] = torch.tensor([10.0, -10.0, 50.0, -50.0]) * bound  # far beyond the calibrated range
    with torch.no_grad():
        compiled = torch.compile(model, backend="loka", options={"plan": path})
        out, clamped = compiled(x), compiled(x.clamp(-bound, bound))
        ref = model(x)
    torch.testing.assert_close(out, clamped, rtol=0, atol=0)  # saturated, exactly as if clamped
    assert rel_error(ref[0], out[0]) > 0.2  # documented: a static scale does not follow outliers
    assert rel_error(ref[1:], out[1:]) < FLOOR


def test_a_site_over_budget_with_its_static_scale_stays_bf16(tmp_path):
    data = batches()
    data[1][3, 5] = 1e6  # one outlier sets fc1's amax: every other row flushes to ~0
    model = MLP()
    plan = loka_compile.calibrate(model, data, options=PER_SITE)
    fc1 = plan.sites["inference/fc1:fwd#1"]
    assert not fc1.fp8 and fc1.reason == Reason.PROBE_UNSAFE.value
    assert "calibrated static scale (amax): row_rel_error" in fc1.detail and "> 0.1" in fc1.detail
    assert "inference/fc1:fwd#1" not in plan.a_scales and "inference/fc2:fwd#1" in plan.a_scales
    path = plan.save(tmp_path / "plan.json").source
    with torch.no_grad():
        served = torch.compile(model, backend="loka", options={"plan": path})
        served(data[0])
    sites = {s.id: s for s in loka_compile.report(served).sites}
    assert sites["inference/fc1:fwd#1"].reason == Reason.PROBE_UNSAFE.value
    assert "calibrated static scale (amax)" in sites["inference/fc1:fwd#1"].detail
    assert sites["inference/fc2:fwd#1"].casts["a"] == STATIC


def test_percentile_policy_gives_a_smaller_scale_than_amax_on_heavy_tails():
    model = nn.Sequential(nn.Linear(32, 32))
    t = torch.distributions.StudentT(2.0)
    data = [t.sample((32, 32)) for _ in range(2)]
    amax = loka_compile.calibrate(model, data, options=PER_SITE).a_scales["inference/0:fwd#1"]
    pct = loka_compile.calibrate(model, data, policy="percentile", percentile=99.9,
                                 options=PER_SITE).a_scales["inference/0:fwd#1"]
    assert pct["policy"] == "percentile 99.9" and amax["policy"] == "amax"
    assert pct["scale"] < 0.8 * amax["scale"], (pct, amax)
    # the percentile is over the reservoir's rows: here every calibration row
    expected = torch.quantile(torch.cat(data).abs().flatten(), 0.999)
    assert pct["range"] == pytest.approx(float(expected), rel=1e-5)


def test_training_graphs_ignore_static_scales(calibrated):
    model, plan, path = calibrated
    compiled = torch.compile(model, backend="loka", options={"plan": path})
    compiled(torch.randn(32, 32))  # the training forward (the backward compiles alike, lazily)
    (record,) = loka_compile.state_of(compiled).records
    forward = record.contexts[("fp8", GraphKind.FORWARD)]
    assert forward.static_a_scales == {}
    assert forward.casts and all(not c["a"].startswith("static") for c in forward.casts.values() if c)
    assert torch.ops.aten.amax.default in targets(record.graph_modules[("fp8", GraphKind.FORWARD)].graph)


@pytest.fixture
def timed(fp8_hardware, cache_dir, monkeypatch):
    """Each shape the speed check asks a timing for on stand-in FP8 hardware;
    the measurement is faked: FP8 pays at these small sites only where A has a static
    scale (a dynamic cast's amax costs more than FP8 saves, as on the H100 for small sites)."""
    calls = []
    site_timing = speed.site_timing

    def asked(shape, scaling, a_format, b_format, providers, fast_accum=False):
        calls.append(shape)
        return site_timing(shape, scaling, a_format, b_format, providers, fast_accum)

    def measure(shape, scaling, a_format, b_format, providers, fast_accum):
        fp8_us = 5.0 if shape.a_static else 20.0
        return speed.SiteTiming(10.0, fp8_us, providers[0], {providers[0]: 4.0}, fp8_us - 4.0)

    monkeypatch.setattr(speed, "site_timing", asked)
    monkeypatch.setattr(speed, "_measure_site", measure)
    speed.clear_cache()
    yield calls
    speed.clear_cache()


def test_calibration_leaves_the_speed_check_to_the_serving_compile(timed, cache_dir, tmp_path):
    """Sites a dynamic-scale compile finds slower still get their static scale; the plan
    holds no speed decision, so the compile that loads it times each site in its own mode
    (CUDA graphs) with A cast by its static scale."""
    model, data, mode = MLP(), batches(), {"mode": "reduce-overhead"}
    with torch.no_grad():
        unplanned = torch.compile(model, backend="loka", options={**mode, "probe_steps": 0})
        unplanned(data[0])
    assert {s.reason for s in loka_compile.report(unplanned).sites} == {Reason.SLOWER_THAN_BF16.value}
    assert len(timed) == 2 and not any(shape.a_static for shape in timed)  # dynamic casts
    torch._dynamo.reset()
    loka_compile.reset()
    timed.clear()

    plan = loka_compile.calibrate(model, data, options={**mode, **PER_SITE})
    assert not timed  # calibration times nothing
    assert sorted(plan.a_scales) == ["inference/fc1:fwd#1", "inference/fc2:fwd#1"]
    assert all(entry.fp8 and entry.reason == Reason.FP8.value and entry.fp8_us is None and entry.bf16_us is None
               and not entry.candidates for entry in plan.sites.values())
    path = plan.save(tmp_path / "plan.json").source
    with torch.no_grad():
        served = torch.compile(model, backend="loka", options={**mode, "plan": path})
        served(data[0])
    assert len(timed) == 2 and all(shape.a_static for shape in timed)
    for site in loka_compile.report(served).sites:
        assert site.fp8 and site.reason == Reason.FP8.value and site.casts["a"] == STATIC
        assert "A with its static scale" in site.detail and "from plan" not in site.detail
    stored = [e["key"] for e in perfdb.PerfDB(cache_dir / perfdb.FILE_NAME).entries()
              if e["key"].get("kind") != "epilogue"]  # the sites' timings (not the gemm_norm chain's)
    assert sorted(key["a_static"] for key in stored) == [False, False, True, True]


def test_calibrate_rejects_bad_arguments(calibrated):
    model, _, path = calibrated
    with pytest.raises(ValueError, match="policy must be one of"):
        loka_compile.calibrate(model, batches(1), policy="max")
    with pytest.raises(ValueError, match="at least one batch"):
        loka_compile.calibrate(model, [])
    with pytest.raises(ValueError, match="percentile"):
        loka_compile.calibrate(model, batches(1), policy="percentile", percentile=0)
    with pytest.raises(ValueError, match="leave the `plan` option unset"):
        loka_compile.calibrate(model, batches(1), options={"plan": path})


def test_calibration_applies_the_output_budget():
    """calibrate closes each window on a call (its last batch again), so the output budget
    weighs the sites: here each carries the output, and the absolute budget 0.003 keeps them
    in high precision with its reason; off, both get static scales (above)."""
    model = MLP()
    plan = loka_compile.calibrate(model, batches(), options={"max_output_error": 0.003})
    assert not plan.a_scales
    for sid in ("inference/fc1:fwd#1", "inference/fc2:fwd#1"):
        entry = plan.sites[sid]
        assert not entry.fp8 and entry.reason == Reason.PROBE_UNSAFE.value
        assert "output budget: sensitivity" in entry.detail, entry.detail


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_the_output_budget_weighs_static_scales_at_their_own_error():
    """One row 1e5 times the others sets each amax scale: the other rows fall into e4m3's
    subnormals, and the static cast's row error (measured 0.32-0.42) is ten times the
    dynamic rowwise cast's (0.036) the window's budget weighed. calibrate weighs the sites
    again at their static errors: with a budget of 0.05 no static scale survives. Each site
    over the budget first casts dynamically (its window's error), and stays in high precision
    only where the budget cannot afford even that (seeds 0-2: one or neither of the two)."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 64, generator=g) for _ in range(3)]
    for x in data:
        x[0] *= 1e5
    loose = {"max_probe_error": 0.9}  # the per-site bound lets the static scales through
    torch.manual_seed(0)
    plan = loka_compile.calibrate(TwoLinears(), data, options={**loose, "max_output_error": None})
    assert len(plan.a_scales) == 2 and all(e["error"] > 0.2 for e in plan.a_scales.values())
    torch._dynamo.reset()
    loka_compile.reset()
    torch.manual_seed(0)
    plan = loka_compile.calibrate(TwoLinears(), data, options={**loose, "max_output_error": 0.05})
    assert not plan.a_scales
    dynamic = [e for e in plan.sites.values() if e.fp8]
    assert dynamic and all("(static scale)" in e.detail and "made safe by dynamic rowwise scaling" in e.detail
                           for e in dynamic), plan.sites
    assert all(e.reason == Reason.PROBE_UNSAFE.value and "output budget" in e.detail
               for e in plan.sites.values() if not e.fp8)


@pytest.mark.parametrize("measured, kept", [(None, set()), (0.0067, {"inference/a:fwd#1"})])
def test_calibration_scales_the_budget_by_what_the_fp8_variant_measured(measured, kept):
    """Sensitivities predicted D = sqrt(0.002^2 + 0.001^2) = 0.00224, within a budget of
    0.003. When the FP8 variant measured 3x that (as MaskNet's calibration did on the H100:
    0.00606 measured, 0.00172 predicted), the prediction is scaled by it and the larger
    share stays in high precision, losing its static scale."""
    from loka_compile.calibrate import _rebudget
    from loka_compile.config import LokaConfig
    from loka_compile.output_budget import OutputBudget
    from loka_compile.plan import Plan, SitePlan

    errors = {"inference/a:fwd#1": 0.002, "inference/b:fwd#1": 0.001}
    record = type("Record", (), {"name": "g", "output_budget": OutputBudget(
        budget=0.003, sensitivity=dict.fromkeys(errors, 1.0), error=dict(errors), kept={},
        predicted_before=0.00224, predicted=0.00224, predicted_after=0.00224, measured=measured)})()
    plan = Plan(sites={sid: SitePlan(fp8=True, reason="fp8") for sid in errors},
                a_scales={sid: {"scale": 0.01, "range": 4.48, "policy": "amax", "error": e} for sid, e in errors.items()})
    _rebudget(record, plan, LokaConfig(max_output_error=0.003), row_errors=errors)
    assert {sid for sid, entry in plan.sites.items() if not entry.fp8} == kept
    assert set(plan.a_scales) == set(errors) - kept
    for sid in kept:
        assert plan.sites[sid].reason == Reason.PROBE_UNSAFE.value
        assert "x 3 (the prediction's measured shortfall)" in plan.sites[sid].detail, plan.sites[sid].detail


# ---- task quality: the metric with labels, the predicted NE increase without -----------

class CtrTower(nn.Module):
    """Linear-LayerNorm-ReLU x2 and a one-logit head: a CTR model's dense tower."""

    def __init__(self, d=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d), nn.LayerNorm(d),
                                  nn.ReLU())
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def _ctr_data(n=2, rows=256, seed=2):
    """Batches with labels drawn from the model's own probabilities (a calibrated model)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = CtrTower()
    xs = [torch.randn(rows, 64, generator=g) for _ in range(n)]
    with torch.no_grad():
        labels = [torch.bernoulli(torch.sigmoid(model(x)), generator=g) for x in xs]
    return model, xs, labels


def test_the_defaults_calibrate_an_mlp_to_fp8_sites():
    """Linear-LayerNorm-ReLU, batch 256, no options: the relative budget keeps FP8 sites."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 128), nn.LayerNorm(128),
                          nn.ReLU(), nn.Linear(128, 16))
    plan = loka_compile.calibrate(model, [torch.randn(256, 64) for _ in range(2)])
    fp8 = [sid for sid, entry in plan.sites.items() if entry.fp8]
    assert len(fp8) >= 2 and all(sid in plan.a_scales for sid in fp8)


def test_calibration_with_labels_measures_ne_and_backs_off_until_within_tolerance():
    """NE with a loose tolerance: the plan keeps its FP8 sites and NE before = after (moved
    from high precision's, in either direction: FP8 noise on 512 labels). A metric only high
    precision meets (the logits' distance from its own) backs off every FP8 site, largest
    budget share first, until it does."""
    model, xs, labels = _ctr_data()
    loose = loka_compile.calibrate(model, xs, labels=labels, tolerance=0.5)
    record = loose.task_metric
    assert record["metric"] == "ne" and record["measured"] and not record["backed_off"]
    assert record["before"] == record["after"] and 0.3 < record["high_precision"] < 1.0
    assert record["after"] != record["high_precision"]  # FP8 sites ran: NE moved (a little)
    assert any(entry.fp8 for entry in loose.sites.values())

    with torch.no_grad():
        reference = torch.cat([model(x).double() for x in xs])

    def distance(logits, y):
        return float((logits - reference).abs().max())

    strict = loka_compile.calibrate(model, xs, labels=labels, metric=distance, tolerance=0.0)
    record = strict.task_metric
    assert record["before"] > 0 and record["backed_off"] and not any(entry.fp8 for entry in strict.sites.values())
    assert record["high_precision"] == 0 and record["after"] < 1e-5  # compiled vs eager fp32 rounding
    assert all("calibrate: distance" in strict.sites[sid].detail for sid in record["backed_off"])


def test_calibration_with_labels_takes_auc_and_a_callable():
    model, xs, labels = _ctr_data()
    plan = loka_compile.calibrate(model, xs, labels=labels, metric="auc", tolerance=0.5)
    assert plan.task_metric["metric"] == "auc" and 0.5 < plan.task_metric["high_precision"] <= 1.0

    def logloss(logits, y):
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item()

    plan = loka_compile.calibrate(model, xs, labels=labels, metric=logloss, tolerance=0.5)
    assert plan.task_metric["metric"] == "logloss" and plan.task_metric["high_precision"] > 0
    with pytest.raises(ValueError, match="one tensor per batch"):
        loka_compile.calibrate(model, xs, labels=labels[:1])
    with pytest.raises(ValueError, match="metric must be one of"):
        loka_compile.calibrate(model, xs, labels=labels, metric="accuracy")


def test_without_labels_the_predicted_ne_increase_stands_in():
    """A sigmoid head, no labels: the output budget's predicted NE increase is brought
    within the tolerance by backing off sites; a tiny tolerance backs off every weighed site."""
    model, xs, _ = _ctr_data()
    tower = nn.Sequential(model, nn.Sigmoid())
    plan = loka_compile.calibrate(tower, xs, tolerance=1e-9, options={"max_ne_increase": 1.0})
    record = plan.task_metric
    assert record["metric"] == "predicted relative NE increase" and not record["measured"]
    assert record["before"] > 1e-9 >= record["after"] and record["backed_off"]
