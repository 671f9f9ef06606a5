"""The Probe's upgrade chain (tensorwise -> rowwise -> blockwise -> bf16) from measured
bounds, the `probe_metric` option, and the report's per-site verdicts and summary."""

import logging

import pytest
import torch

import loka_compile
from loka_compile import LokaConfig, dispatch, probe
from loka_compile.kernels import providers
from loka_compile.passes import Decision, Reason
from loka_compile.passes.context import GraphKind, Role, Site
from loka_compile.report import Report, SiteRecord

from numerics import row_rel_error

M, K, N = 64, 256, 32
# The per-site rule alone: the output budget (max_output_error, tests/unit/test_output_budget.py) would
# keep these small models' sites, each moving the output by ~0.04 against its default 0.003.
PER_SITE = {"max_output_error": None}


def _planted(seed: int, outlier_blocks=(0,)):
    """Each row has a huge feature at the start of each block in `outlier_blocks`; its
    weight row is zero and the rest of block 0 is small, so the signal sits in the block
    without an outlier. One scale per row flushes that signal to zero; 1x128 blocks keep it."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen)
    a[:, 1:128] *= 0.01
    b = torch.randn(K, N, generator=gen)
    for block in outlier_blocks:
        a[:, 128 * block] = 1e6
        b[128 * block] = 0.0
    return a, b


def _observe(key, outlier_blocks, scaling="tensorwise"):
    for seed in range(3):
        a, b = _planted(seed, outlier_blocks)
        torch.ops.loka.observe_gemm(a, b, key, scaling, "e4m3", "e4m3")


def test_planted_outlier_block_goes_blockwise_with_each_steps_bound(store, caplog):
    _observe("s", (0,))
    cands = store.summary("s")["candidates"]
    bounds = {name.split("/")[0]: c["bound"] for name, c in cands.items()}
    assert all(c["n"] == 3 for c in cands.values())
    # measured: tensorwise ~0.96, rowwise ~0.96, blockwise ~0.04
    assert bounds["tensorwise"] > 0.5 and bounds["rowwise"] > 0.5 and bounds["blockwise"] < 0.06, bounds
    # rowwise is about what a product flushed to zero measures
    a, b = _planted(0)
    flushed = row_rel_error(a.double() @ b.double(), torch.zeros(M, N, dtype=torch.float64))
    assert bounds["rowwise"] == pytest.approx(flushed, abs=0.1)

    with caplog.at_level(logging.WARNING, logger="loka"):
        unsafe, upgraded = probe.verdicts(store, ["s"], 0.1, metric="row_rel_error", chain=True)
    assert unsafe == {} and upgraded["s"][0] == "blockwise"
    steps = dict(upgraded["s"][1])
    assert steps == pytest.approx(bounds)
    assert "s goes blockwise" in caplog.text and "rowwise rel. error" in caplog.text
    # the format plans hold today: tensorwise -> rowwise only, else unsafe
    assert probe.verdicts(store, ["s"], 0.1, metric="row_rel_error") == ({"s": steps["tensorwise"]}, {})
    # a budget every scaling meets: no verdict
    assert probe.verdicts(store, ["s"], 2.0, chain=True) == ({}, {})


def test_chain_ends_in_high_precision_when_no_scaling_passes(store, caplog):
    _observe("s", (0, 1))
    bounds = {n.split("/")[0]: c["bound"] for n, c in store.summary("s")["candidates"].items()}
    assert min(bounds.values()) > 0.5, bounds  # every block holds an outlier
    with caplog.at_level(logging.WARNING, logger="loka"):
        unsafe, upgraded = probe.verdicts(store, ["s"], 0.1, chain=True)
    assert upgraded == {} and unsafe == {"s": pytest.approx(bounds["tensorwise"])}
    assert "keeps high precision" in caplog.text and "blockwise rel. error" in caplog.text


def test_a_rowwise_site_chains_to_blockwise_only(store):
    _observe("r", (0,), scaling="rowwise")
    unsafe, upgraded = probe.verdicts(store, ["r"], 0.1, chain=True)
    assert unsafe == {} and upgraded["r"][0] == "blockwise"
    assert [s for s, _ in upgraded["r"][1]] == ["rowwise", "blockwise"]


def _site(role=Role.FWD):
    return Site(id="forward/fc:fwd#1", graph="g0", kind=GraphKind.FORWARD, node=None, op="mm",
                role=role, module="fc", shape=(M, K, N), batch=None, dtype=torch.float32,
                device=torch.device("cpu"), a_is_grad=False, b_is_grad=False, producers=(), consumers=(),
                seq_nr=None)


def test_dispatch_applies_the_target_scaling_and_skips_one_without_a_provider(monkeypatch):
    config = LokaConfig(recipe="tensorwise")
    steps = [["tensorwise", 0.96], ["rowwise", 0.95], ["blockwise", 0.04]]
    decision = dispatch.decide(_site(), config, "fp8", upgraded_sites={"forward/fc:fwd#1": ("blockwise", steps)})
    assert decision.fp8 and decision.scaling == "blockwise" and decision.provider == "emulated"
    assert "blockwise: the Probe measured tensorwise rel. error 0.96 > 0.1" in decision.detail
    assert "blockwise rel. error 0.04 <= 0.1" in decision.detail
    # legacy plans' (tensorwise, rowwise) pairs still go rowwise
    legacy = dispatch.decide(_site(), config, "fp8", upgraded_sites={"forward/fc:fwd#1": (0.9, 0.05)})
    assert legacy.fp8 and legacy.scaling == "rowwise" and "tensorwise rel. error 0.9 > 0.1" in legacy.detail
    # no provider runs blockwise: the chain has no further step, so bf16 with the bounds
    real = providers.select
    monkeypatch.setattr(providers, "select", lambda request: [] if request.scaling.value == "blockwise"
                        else real(request))
    kept = dispatch.decide(_site(), config, "fp8", upgraded_sites={"forward/fc:fwd#1": ("blockwise", steps)})
    assert not kept.fp8 and kept.reason is Reason.PROBE_UNSAFE and "no finer scaling" in kept.detail
    # ... but a passing rowwise step further up the chain is taken
    both = [["tensorwise", 0.96], ["rowwise", 0.05], ["blockwise", 0.04]]
    up = dispatch.decide(_site(), config, "fp8", upgraded_sites={"forward/fc:fwd#1": ("rowwise", both)})
    assert up.fp8 and up.scaling == "rowwise"


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()


@pytest.mark.parametrize("metric, fp8", [("row_rel_error", True), ("mere", False)])
def test_probe_metric_end_to_end(fresh_compile_state, metric, fp8):
    """Clean sites measure ~0.04 row relative error and ~0.12 MERE: under one budget of
    0.1 the metric alone decides."""
    x = torch.randn(64, 64)
    compiled = torch.compile(_mlp(), backend="loka",
                             options={**PER_SITE, "recipe": "rowwise", "probe_steps": 1, "probe_metric": metric,
                                      "max_probe_error": 0.1})
    with torch.no_grad():
        compiled(x)
        compiled(x)
    report = loka_compile.report(compiled)
    assert report.sites and all(s.fp8 == fp8 for s in report.sites), report.table()
    for s in report.sites:
        own = s.verdicts[s.probe["chosen"]]
        assert own["metric"] == metric and own["n"] == 1 and own["within"] == fp8
        if not fp8:
            assert s.reason == "probe_unsafe" and s.detail.startswith("MERE 0.1"), s.detail


def test_mere_takes_lokas_bound_by_default(fresh_compile_state):
    assert LokaConfig(probe_metric="mere").max_probe_error == 0.2
    assert LokaConfig().max_probe_error == 0.1
    assert LokaConfig(probe_metric="mere", max_probe_error=0.3).max_probe_error == 0.3
    x = torch.randn(64, 64)
    compiled = torch.compile(_mlp(), backend="loka", options={**PER_SITE, "recipe": "rowwise",
                                                              "probe_steps": 1, "probe_metric": "mere"})
    with torch.no_grad():
        compiled(x)
        compiled(x)
    sites = loka_compile.report(compiled).sites
    assert sites and all(s.fp8 and s.verdicts[s.probe["chosen"]]["bound"] < 0.2 for s in sites)


def _record(**kw):
    base = dict(name="fc:fwd:mm", module="fc", role="fwd", shape=(64, 256, 32), fp8=True, provider="p1",
                reason="fp8", graph="g0", kind="forward", op="mm", batch=None, dtype="float32", scaling="rowwise",
                formats="e4m3 x e4m3", producers=(), consumers=(), forward_site="", key="k", probe={},
                id="forward/fc:fwd#1")
    return SiteRecord(**{**base, **kw})


def test_report_candidates_and_summary():
    from loka_compile.passes.context import Candidate
    from loka_compile.report import _candidates
    timed = (Candidate("p1", 2.0, True), Candidate("p2", 2.6, False, "slower GEMM (2.6 us vs 2.0 us)"),
             Candidate("p3", None, False, "cannot run here (RuntimeError: no (kernel))"))
    decision = Decision(fp8=True, reason=Reason.FP8, provider="p1", detail="no timings in this text",
                        candidates=timed)
    cands = _candidates(decision, True)
    assert cands["p1"] == {"gemm_us": 2.0, "chosen": True, "lost": ""}
    assert cands["p2"]["lost"] == "slower GEMM (2.6 us vs 2.0 us)" and not cands["p2"]["chosen"]
    assert cands["p3"] == {"gemm_us": None, "chosen": False, "lost": "cannot run here (RuntimeError: no (kernel))"}
    # the graph fell back: the chosen provider runs nothing
    assert _candidates(decision, False)["p1"] == {"gemm_us": 2.0, "chosen": False,
                                                  "lost": "the site stays in high precision"}
    # timings in a detail's text are no longer read back
    detail = "fp8 3.0 us (p1 GEMM 2.0 us; casts 1.0 us) vs 4.0 us"
    assert _candidates(Decision(fp8=True, reason=Reason.FP8, provider="p1", detail=detail), True) == {}

    report = Report([])
    report.sites = [_record(),
                    _record(fp8=False, reason="probe_unsafe", detail="rel. error 0.9 > 0.1", shape=(64, 512, 64),
                            id="forward/big:fwd#0", provider="aten"),
                    _record(fp8=False, reason="too_small", shape=(8, 16, 16), id="forward/tiny:fwd#0"),
                    _record(fp8=False, reason="probe_unsafe", shape=("s0", 64, 64), id="forward/sym:fwd#0")]
    text = report.summary(largest=1)
    lines = text.splitlines()
    flops_fp8, flops_all = 64 * 256 * 32, 64 * 256 * 32 + 64 * 512 * 64 + 8 * 16 * 16
    assert f"4 GEMM sites in 0 graph(s), 1 in FP8 ({100 * flops_fp8 / flops_all:.0f}% of GEMM FLOPs" in lines[0]
    assert lines[1] == "kept in high precision: probe_unsafe 2, too_small 1"
    assert "forward/big:fwd#0 64x512x64 (4.19 MFLOP): probe_unsafe (rel. error 0.9 > 0.1)" in text
    assert "tiny" not in text and "sym" not in text  # largest=1; symbolic sites have no FLOP count
    overview = str(report)
    assert "FP8 per role: fwd 1/4" in overview and "forward/tiny:fwd#0" in overview
    assert overview.endswith("every site: print(report.table())")
    # negative case: everything in FP8 has no kept lines
    report.sites = [_record()]
    assert report.summary() == report.summary().splitlines()[0] and "kept" not in report.summary()
    assert "100% of GEMM FLOPs" in report.summary()


class PlantedLinear(torch.nn.Module):
    """One linear whose weight zeroes the input's outlier feature (see `_planted`)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(K, N, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(_planted(0)[1].t())

    def forward(self, x):
        return self.fc(x)


@pytest.mark.usefixtures("fresh_compile_state")
def test_compiled_probe_window_sends_a_planted_site_blockwise():
    """End to end: the backend asks the Probe for the whole chain, so a site that only 1x128
    blocks save goes blockwise after the window, and its output is close to fp32."""
    model = PlantedLinear()
    compiled = torch.compile(model, backend="loka",
                             options={**PER_SITE, "recipe": "tensorwise", "probe_steps": 2, "max_probe_error": 0.1})
    with torch.no_grad():
        for seed in range(3):
            out = compiled(_planted(seed)[0])
    site = next(s for s in loka_compile.report(compiled).sites if s.role == "fwd")
    assert site.fp8 and site.scaling == "blockwise", (site.reason, site.scaling, site.detail)
    assert "blockwise" in site.detail and "tensorwise rel. error" in site.detail
    x = _planted(2)[0]
    reference = x.double() @ model.fc.weight.double().t()
    assert row_rel_error(reference, out) < 0.1
