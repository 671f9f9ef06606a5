"""The graph speed check end to end (`LokaConfig.graph_speed_check`): the FP8 variant timed
against a high-precision compile of the same graph before its first run, the faster kept.
The timer is stood in for (a CPU timing of emulated FP8 means nothing); the variants it is
handed run for real, and what the graph keeps is checked by its numerics."""

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile import graph_speed
from loka_compile.passes import Reason
from models import MLPWithNorm

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# No probe window and no output budget: the FP8 variant is the graph's first compile.
FAST = {"probe_steps": 0, "max_output_error": None}


def fixed_time_steps(fp8_ms: float, hp_ms: float, calls: list):
    """A stand-in for `graph_speed.time_steps`: each step runs once, for real, the times are
    the given ones, and `calls` collects the `captured` flags it is called with."""
    def time_steps(steps, device, captured):
        for step in steps.values():
            step()
        calls.append(captured)
        return {"fp8": [fp8_ms] * graph_speed.ROUNDS, "hp": [hp_ms] * graph_speed.ROUNDS}
    return time_steps


def _timer(monkeypatch, fp8_ms: float, hp_ms: float) -> list:
    """`fixed_time_steps` in place of `graph_speed.time_steps`; returns its `captured` flags."""
    calls = []
    monkeypatch.setattr(graph_speed, "time_steps", fixed_time_steps(fp8_ms, hp_ms, calls))
    return calls


def _train(model, options, steps=2, seed=1) -> tuple:
    """(compiled model, per step: output and every parameter's gradient)."""
    compiled = torch.compile(model, backend="loka", options=options)
    torch.manual_seed(seed)
    results = []
    for _ in range(steps):
        model.zero_grad()
        out = compiled(torch.randn(16, 32))
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    return compiled, results


def _assert_same(got, want):
    for (out, grads), (want_out, want_grads) in zip(got, want):
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        for grad, want_grad in zip(grads, want_grads):
            torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def _mlp():
    torch.manual_seed(0)
    return MLPWithNorm(d_in=32, hidden=64, d_out=16)


def test_high_precision_faster_runs_high_precision_with_its_sites_amended(monkeypatch):
    calls = _timer(monkeypatch, fp8_ms=2.0, hp_ms=1.0)
    compiled, got = _train(_mlp(), {**FAST, "graph_speed_check": "always"})
    assert calls == [False]
    # The same graph with no FP8 site: every linear excluded.
    _, want = _train(_mlp(), {**FAST, "graph_speed_check": "always", "exclude_modules": ("fc1", "fc2", "head")})
    _assert_same(got, want)
    report = loka_compile.report(compiled)
    amended = [s for s in report.sites if s.reason == Reason.GRAPH_SLOWER_THAN_BF16.value]
    assert {s.role for s in amended} == {"fwd", "dgrad"} and not any(s.fp8 for s in report.sites)
    for site in amended:
        (amendment,) = site.amendments
        assert amendment.by == "graph_speed" and ("fp8", True, False) in amendment.changes
        assert "FP8 2.000 ms vs high precision 1.000 ms (forward + backward" in amendment.why
    assert f"graph speed {report.graphs[0].name}: predicted gain unknown" in str(report)
    assert f"kept high precision, {len(amended)} site(s) amended" in report.summary()


def test_fp8_faster_keeps_the_fp8_variant_and_leaves_buffers_and_rng_alone(monkeypatch):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 16))

    calls = _timer(monkeypatch, fp8_ms=1.0, hp_ms=2.0)
    checked_model = model()
    compiled, got = _train(checked_model, {**FAST, "graph_speed_check": "always"})
    assert calls == [False]
    # Default ("thin"): on CPU FP8 is emulated, so nothing is timed.
    unchecked_model = model()
    unchecked, want = _train(unchecked_model, FAST)
    assert len(calls) == 1
    _assert_same(got, want)  # the dropout masks too: the check's steps drew from a forked RNG
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(checked_model[1], name), getattr(unchecked_model[1], name)), name
    report = loka_compile.report(compiled)
    assert any(s.fp8 for s in report.sites) and not report.sites[0].amendments
    line = f"graph speed {report.graphs[0].name}: "
    assert "FP8 1.000 ms vs high precision 2.000 ms" in report.summary() and "kept fp8" in report.summary()
    assert f"{line}" in str(report)
    skipped = loka_compile.report(unchecked).summary()
    assert "not timed (FP8 is emulated on cpu: a timing here says nothing of an FP8 GPU)" in skipped


def test_cuda_graph_modes_time_copies_and_compile_the_winner_again(monkeypatch):
    """In a CUDA-graph mode the variants are timed as copies compiled without Inductor's CUDA
    graphs (stood in for here: CPU has none); high precision winning is compiled once more, its
    lazily compiled backward amended with the times too."""
    monkeypatch.setattr(graph_speed, "captures", lambda mode, device: True)
    calls = _timer(monkeypatch, fp8_ms=3.0, hp_ms=1.5)
    compiled, got = _train(_mlp(), {**FAST, "graph_speed_check": "always"})
    assert calls == [True]
    report = loka_compile.report(compiled)
    amended = [s for s in report.sites if s.amendments]
    assert {s.kind for s in amended} == {"forward", "backward"} and not any(s.fp8 for s in report.sites)
    assert all("FP8 3.000 ms vs high precision 1.500 ms" in s.amendments[0].why for s in amended)


def test_a_graph_that_writes_an_input_that_takes_a_gradient_is_not_timed(monkeypatch):
    calls = _timer(monkeypatch, fp8_ms=2.0, hp_ms=1.0)
    weight = torch.randn(32, 64, requires_grad=True)

    def scaled_in_place(h):
        h.mul_(2)
        return torch.nn.functional.linear(h, weight)

    compiled = torch.compile(scaled_in_place, backend="loka", options={**FAST, "graph_speed_check": "always"})
    h = torch.randn(16, 64, requires_grad=True) * 1
    compiled(h).sum().backward()
    assert not calls
    report = loka_compile.report(compiled)
    assert "not timed (it writes its input 0 in place, which is a parameter or takes a gradient)" in str(report)
    assert any(s.fp8 for s in report.sites)
