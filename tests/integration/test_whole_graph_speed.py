"""The graph speed check end to end (`LokaConfig.graph_speed_check`): the FP8 variant timed
against a high-precision compile of the same graph before its first run, the faster kept.
The timer is stood in for (a CPU timing of emulated FP8 means nothing); the variants it is
handed run for real, and what the graph keeps is checked by its numerics."""

import json

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile import graph_speed
from loka_compile.passes import Reason
from models import MLPWithNorm

# Each test its own performance database: a verdict one test timed is not another's.
pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread", "cache_dir")

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


def _again(model_fn, options, steps=2):
    """A later process's run of the same model: Dynamo's code and loka's in-process timings forgotten."""
    torch._dynamo.reset()
    loka_compile.reset()
    return _train(model_fn(), options, steps)


@pytest.mark.parametrize("fp8_ms, hp_ms", [(1.0, 2.0), (2.0, 1.0)])
def test_a_warm_database_keeps_the_timed_verdict_without_timing_again(monkeypatch, inductor_compiles, fp8_ms, hp_ms):
    """The second run of the same graph reads the verdict from the performance database: no timing,
    no copy for the check; FP8 kept compiles once, high precision's forward once more (the FP8
    variant's forward digest is part of the key; its backward, never run, is never compiled).
    Numerics and the sites' amendments as when timed."""
    options = {**FAST, "graph_speed_check": "always"}
    calls = _timer(monkeypatch, fp8_ms, hp_ms)
    _, timed = _train(_mlp(), options)
    assert calls == [False] and inductor_compiles == {"forward": 2, "backward": 2}  # FP8 and high precision
    inductor_compiles.clear()
    compiled, remembered = _again(_mlp, options)
    assert calls == [False], "timed again"
    assert inductor_compiles == {"forward": 1 if fp8_ms < hp_ms else 2, "backward": 1}
    _assert_same(remembered, timed)
    (graph,) = loka_compile.report(compiled).graphs
    speed = graph.graph_speed
    assert (speed.fp8_ms, speed.hp_ms, speed.remembered) == (fp8_ms, hp_ms, "the performance database")
    assert speed.kept == ("fp8" if fp8_ms < hp_ms else "high precision")
    report = loka_compile.report(compiled)
    assert any(s.fp8 for s in report.sites) == (speed.kept == "fp8")
    assert "remembered from the performance database" in report.summary()
    if speed.kept != "fp8":
        assert all("remembered from the performance database" in s.amendments[0].why
                   for s in report.sites if s.reason == Reason.GRAPH_SLOWER_THAN_BF16.value)


def test_a_changed_graph_config_or_timing_method_is_timed_again(monkeypatch):
    """The verdict's key holds the graph, its inputs, the config and how the check times: any of
    them changed, the graph is timed afresh."""
    options = {**FAST, "graph_speed_check": "always"}
    calls = _timer(monkeypatch, fp8_ms=2.0, hp_ms=1.0)
    _train(_mlp(), options)
    _again(_mlp, options)
    assert len(calls) == 1

    def wider():
        torch.manual_seed(0)
        return MLPWithNorm(d_in=32, hidden=96, d_out=16)

    _again(wider, options)  # another graph (other shapes)
    assert len(calls) == 2
    _again(_mlp, {**options, "recipe": "rowwise"})  # another config
    assert len(calls) == 3
    monkeypatch.setattr(graph_speed, "captures", lambda mode, device: True)  # timed as CUDA-graph copies
    _again(_mlp, options)
    assert calls == [False, False, False, True]


def test_a_saved_plan_keeps_the_verdict_and_an_edited_plan_is_timed_again(monkeypatch, tmp_path, inductor_compiles):
    """A plan saved after the check holds its verdict: loaded (with an empty database), the graph
    compiles once and is not timed. A plan whose decisions were edited since is timed again."""
    options = {**FAST, "graph_speed_check": "always"}
    calls = _timer(monkeypatch, fp8_ms=1.0, hp_ms=2.0)
    compiled, timed = _train(_mlp(), options)
    path = tmp_path / "plan.json"
    loka_compile.save_plan(compiled, path)
    saved = json.loads(path.read_text())
    assert list(saved["graph_speed"]["verdicts"].values()) == [
        {"fp8_ms": 1.0, "hp_ms": 2.0, "kept": "fp8", "training": True, "runs": graph_speed.ROUNDS}]
    monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path / "empty"))  # the database plays no part
    inductor_compiles.clear()
    planned, got = _again(_mlp, {**options, "plan": str(path)})
    assert calls == [False] and inductor_compiles == {"forward": 1, "backward": 1}
    _assert_same(got, timed)
    speed = loka_compile.report(planned).graphs[0].graph_speed
    assert speed.kept == "fp8" and speed.remembered == f"plan {path}"
    # Saved again from the planned run (its details name the plan now), the verdict carries over.
    again = tmp_path / "again.json"
    loka_compile.save_plan(planned, again)
    assert loka_compile.load_plan(again).graph_speed == saved["graph_speed"]["verdicts"]

    # One site's decision edited: the plan decides otherwise now, so its verdict is not taken.
    edited = json.loads(path.read_text())
    sid = next(sid for sid, entry in edited["sites"].items() if entry["fp8"])
    edited["sites"][sid].update(fp8=False, reason=Reason.SLOWER_THAN_BF16.value)
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert not loka_compile.load_plan(tmp_path / "edited.json").graph_speed
    monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path / "empty2"))
    _again(_mlp, {**options, "plan": str(tmp_path / "edited.json")})
    assert len(calls) == 2
