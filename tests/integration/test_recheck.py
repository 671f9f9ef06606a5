"""Probe re-checks (`recheck_every`): after the probe window, every N calls one call runs the
probe variant, and a site whose bound drifts over the budget is demoted along the upgrade
chain, then promoted back when it recovers, each change logged with its call."""

import logging

import pytest
import torch

import loka_compile
from loka_compile import compiled_graph
from loka_compile.passes import GraphKind
from loka_compile.plan import Plan
from loka_compile.report import plan_of

from numerics import row_rel_error, sqnr_db
from test_probe_verdicts import N, PlantedLinear, _planted

# Floors: outputs within the Probe's budget (row relative error 0.1, what each FP8 site is
# held to); gradients as tests/integration/test_end_to_end.py holds them (SQNR 10 dB).
BUDGET = 0.1
GRAD_SQNR_FLOOR_DB = 10.0

# probe_steps 2, recheck_every 3: calls 1-2 probe, re-checks at calls 5, 8, 11, judged at the call after.
# The output budget off: it would keep the one site (sensitivity 1 x error 0.04 > 0.003); re-checks
# judge the per-site bound (tests/unit/test_output_budget.py covers the two together).
# The amax guard off: it would send the site rowwise at the first outlier call, before the
# re-check (tests/integration/test_nonfinite_outliers.py covers it, and the two together).
OPTIONS = {"recipe": "tensorwise", "probe_steps": 2, "max_probe_error": BUDGET, "recheck_every": 3,
           "max_output_error": None, "amax_guard": False}
OUTLIER_CALLS = range(6, 10)  # the planted outlier feature appears after the window, then goes away


def _batch(call: int):
    return _planted(call, (0,) if call in OUTLIER_CALLS else ())[0]


def _observer_nodes(gm) -> int:
    return sum(n.target is torch.ops.loka.observe_gemm.default for n in gm.graph.nodes)


def _standing(site) -> str:
    return site.scaling if site.fp8 else "high precision"


@pytest.mark.usefixtures("fresh_compile_state")
def test_drift_demotes_at_a_logged_call_and_recovery_promotes_back(caplog):
    model = PlantedLinear()
    compiled = torch.compile(model, backend="loka", options=OPTIONS)
    standing, errors, observations = {}, {}, {}
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="loka"):
        for call in range(1, 14):
            x = _batch(call)
            out = compiled(x)
            errors[call] = row_rel_error(x.double() @ model.fc.weight.double().t(), out)
            site = loka_compile.report(compiled).sites[0]
            store = loka_compile.state_of(compiled).store
            standing[call], observations[call] = _standing(site), store.observed(site.key)
    assert {standing[c] for c in (3, 4, 5, 6, 7, 8)} == {"tensorwise"}
    assert {standing[c] for c in (9, 10, 11)} == {"blockwise"}
    assert {standing[c] for c in (12, 13)} == {"tensorwise"}

    history = site.history
    assert [(e["step"], e["observed_at"], e["from"], e["to"], e["change"]) for e in history] == [
        (9, 8, "tensorwise", "blockwise", "demoted"), (12, 11, "blockwise", "tensorwise", "promoted")]
    assert "blockwise rel. error" in history[0]["detail"] and "> 0.1" in history[0]["detail"]
    assert [(a.by, a.changes) for a in site.amendments] == [
        ("re-check", (("verdict", "tensorwise", "blockwise"),)), ("re-check", (("verdict", "blockwise", "tensorwise"),))]
    assert [a.why for a in site.amendments] == [e["detail"] for e in history]
    demoted = [r for r in caplog.records if "demoted tensorwise -> blockwise from call 9" in r.getMessage()]
    promoted = [r for r in caplog.records if "promoted blockwise -> tensorwise from call 12" in r.getMessage()]
    assert [r.levelno for r in demoted] == [logging.WARNING] and [r.levelno for r in promoted] == [logging.INFO]
    assert "FP8 variant reused" in caplog.text  # the promotion went back to the window's build
    assert (f"re-checked {site.graph} {site.id}: demoted tensorwise -> blockwise at call 9, promoted blockwise -> tensorwise "
            "at call 12") in loka_compile.report(compiled).summary().splitlines()

    # Outputs: the outliers cost tensorwise FP8 about the whole signal until the re-check saw
    # them (what every call would measure without re-checks); from the demotion on, in budget.
    assert min(errors[c] for c in (6, 7)) > 0.5, errors
    assert max(errors[c] for c in range(9, 14)) < BUDGET, errors
    # The re-check calls run the probe variant (high precision), the others the plain FP8 graph:
    # between re-checks the store sees nothing new, and that graph holds no observer.
    assert all(errors[c] < 1e-5 for c in (5, 8, 11)), errors
    assert loka_compile.state_of(compiled).counters["rechecks"] == 3
    assert [observations[c] for c in (3, 4, 5, 6, 7, 8, 9, 10)] == [2, 2, 1, 1, 1, 1, 1, 1]
    graphs = loka_compile.report(compiled).graphs[0]
    assert _observer_nodes(graphs.graph_modules["inference"]) == 0
    (graph,) = loka_compile.state_of(compiled).rechecking
    assert _observer_nodes(graph.record.graph_modules[("probe", GraphKind.INFERENCE)]) == 1

    # The plan keeps the history; a plan file without one (written before re-checks) loads.
    plan = plan_of(compiled)
    assert plan.history[site.id] == list(history)
    assert Plan.from_json(plan.to_json()).history == plan.history
    older = plan.to_json()
    del older["history"]
    assert Plan.from_json(older).history == {}


@pytest.mark.usefixtures("fresh_compile_state")
def test_no_recheck_when_the_option_is_off():
    compiled = torch.compile(PlantedLinear(), backend="loka", options={**OPTIONS, "recheck_every": 0})
    with torch.no_grad():
        for call in range(1, 10):
            compiled(_batch(call))
    site = loka_compile.report(compiled).sites[0]
    # the window's two observations only; the outliers of calls 6-9 stay unseen
    state = loka_compile.state_of(compiled)
    assert state.store.observed(site.key) == 2 and site.fp8 and site.scaling == "tensorwise" and site.history == ()
    assert not state.rechecking and state.counters["rechecks"] == 0


@pytest.mark.usefixtures("fresh_compile_state")
def test_training_graph_rechecks_forward_and_backward(caplog):
    """The planted weight trains: forward and wgrad sites, the backward compiled lazily for
    each variant; the re-check call's backward runs the probe variant's, with observers."""
    model = PlantedLinear()
    compiled = torch.compile(model, backend="loka", options=OPTIONS)
    grads, outs = {}, {}
    with caplog.at_level(logging.INFO, logger="loka"):
        for call in range(1, 13):
            x = _batch(call)
            model.zero_grad()
            out = compiled(x)
            out.square().sum().backward()
            reference = x.double() @ model.fc.weight.double().t()
            outs[call] = row_rel_error(reference, out)
            grads[call] = sqnr_db(2 * reference.t() @ x.double(), model.fc.weight.grad.double())
    sites = {s.role: s for s in loka_compile.report(compiled).sites}
    assert set(sites) == {"fwd", "wgrad"}
    assert [(e["step"], e["to"]) for e in sites["fwd"].history] == [(9, "blockwise"), (12, "tensorwise")]
    # the last re-check (call 11) observed the backward too, in a window of its own
    assert all(loka_compile.state_of(compiled).store.observed(s.key) == 1 for s in sites.values())
    wgrad = [(e["step"], e["change"]) for e in sites["wgrad"].history]
    assert wgrad[0] == (9, "demoted") and wgrad[-1] == (12, "promoted"), sites["wgrad"].history
    assert all(s.fp8 and s.scaling == "tensorwise" for s in sites.values())
    # Outputs and gradients of the demoted graph (calls 9-10) and the promoted one (call 12).
    for call in (9, 10, 12):
        assert outs[call] < BUDGET and grads[call] > GRAD_SQNR_FLOOR_DB, (call, outs[call], grads[call])


@pytest.mark.usefixtures("fresh_compile_state")
def test_a_failed_recheck_keeps_the_running_graph(caplog, monkeypatch):
    def fail():
        raise RuntimeError("planted failure")

    window_compile = compiled_graph.LokaCompiledGraph._compile_fp8  # the window's own compile still runs
    monkeypatch.setattr(compiled_graph.LokaCompiledGraph, "_compile_fp8",
                        lambda self: fail() if self._builds else window_compile(self))
    model = PlantedLinear()
    compiled = torch.compile(model, backend="loka", options={**OPTIONS, "probe_steps": 1, "recheck_every": 2})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        for call in range(1, 5):
            x = _planted(call, (0,) if call >= 3 else ())[0]
            compiled(x)
        assert "re-check at call 3 failed (RuntimeError: planted failure); the graph keeps its decisions" \
            in caplog.text
        site = loka_compile.report(compiled).sites[0]
        assert site.fp8 and site.scaling == "tensorwise" and site.history == ()
        assert plan_of(compiled).upgraded == {}  # the verdicts the running graph was built with
        # the re-check call itself fails: that call runs the FP8 variant instead
        (graph,) = loka_compile.state_of(compiled).rechecking
        graph.variants["probe"] = lambda *args: fail()
        x = _planted(5, ())[0]
        out = compiled(x)
    assert "re-check at call 5 failed (RuntimeError: planted failure); the call runs the FP8 variant" \
        in caplog.text
    assert row_rel_error(x.double() @ model.fc.weight.double().t(), out) < BUDGET


@pytest.mark.usefixtures("fresh_compile_state")
def test_a_failing_observer_keeps_the_step_and_sends_the_site_to_high_precision(monkeypatch, caplog):
    """Observers run inside the model's step (a re-check's backward too): one that fails
    reports the failure instead of raising, and an unmeasured site is not trusted in FP8."""
    from loka_compile import probe
    from loka_compile.kernels import ops

    def fail(*args, **kwargs):
        raise RuntimeError("planted observer failure")

    monkeypatch.setattr(ops, "gemm_statistics", fail)
    model = PlantedLinear()
    compiled = torch.compile(model, backend="loka", options={**OPTIONS, "probe_steps": 1})
    x = _planted(0, ())[0]
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        compiled(x)
        out = compiled(x)
    site = loka_compile.report(compiled).sites[0]
    assert site.probe == {"observations": 1, "failed": "RuntimeError: planted observer failure"}
    assert not site.fp8 and site.reason == "probe_unsafe", (site.reason, site.detail)
    assert "an observation failed (RuntimeError: planted observer failure)" in caplog.text
    assert probe.verdicts(loka_compile.state_of(compiled).store, [site.key], BUDGET) == ({site.key: float("inf")}, {})
    assert row_rel_error(x.double() @ model.fc.weight.double().t(), out) < 1e-5  # high precision
