"""What a loka compile costs in its first steps: a graph none of whose sites is a candidate
for FP8 is compiled once (its probe variant runs on after the window), one with candidates
twice (probe, then FP8), and benchmarks.public.first_steps' phase table reads cProfile."""

import copy
import cProfile
import pstats

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile import compiled_graph
from loka_compile.passes import Reason
from numerics import rel_error

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# fp32, every site in high precision: compiled and eager differ by Inductor's summation order
REL_ERROR = 1e-5


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def _train_counting_compiles(monkeypatch, model, x, steps=4):
    compiles = []
    real = compiled_graph.LokaCompiledGraph._compile

    def counting(self, gm, example_inputs, phase):
        compiles.append(phase)
        return real(self, gm, example_inputs, phase)

    monkeypatch.setattr(compiled_graph.LokaCompiledGraph, "_compile", counting)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 2})
    for _ in range(steps):
        out = compiled(x)
        out.square().mean().backward()
        ref = eager(x)
        ref.square().mean().backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())]
    return compiles, out, ref, grads, loka_compile.report(compiled)


def test_a_graph_without_candidates_compiles_once(monkeypatch):
    """Every GEMM below min_gemm_dim (16): nothing to probe, so the probe variant is final."""
    model = _mlp(8)
    compiles, out, ref, grads, report = _train_counting_compiles(monkeypatch, model, torch.randn(32, 8))
    assert compiles == ["probe"]
    assert report.sites and all(s.reason == Reason.TOO_SMALL.value for s in report.sites), report.table()
    assert {s.role for s in report.sites} >= {"fwd", "dgrad", "wgrad"}
    assert torch.isfinite(out).all() and rel_error(ref.detach(), out.detach()) < REL_ERROR
    for got, want in grads:  # four steps' accumulated gradients, compiled and eager
        assert torch.isfinite(got).all() and rel_error(want, got) < REL_ERROR


def test_a_graph_with_candidates_compiles_its_fp8_variant(monkeypatch):
    model = _mlp(32)
    compiles, out, ref, _, report = _train_counting_compiles(monkeypatch, model, torch.randn(64, 32))
    assert compiles == ["probe", "fp8"]
    assert any(s.fp8 for s in report.sites), report.table()
    assert torch.isfinite(out).all()


def test_phase_table_sums_cumulative_time_per_function():
    from benchmarks.public.first_steps import phase_times

    def inner():
        return sum(i * i for i in range(20000))

    def outer():
        return inner() + inner()

    profiler = cProfile.Profile()
    profiler.enable()
    outer()
    profiler.disable()
    here = "tests/integration/test_first_steps.py"
    phases = (("outer", here, "outer"), ("inner", here, "inner"), ("absent", here, "never_called"))
    got = {p["phase"]: p for p in phase_times(pstats.Stats(profiler), phases)}
    assert got["outer"]["calls"] == 1 and got["inner"]["calls"] == 2
    assert got["outer"]["seconds"] >= got["inner"]["seconds"] > 0
    assert got["absent"] == {"phase": "absent", "seconds": 0.0, "calls": 0}


def test_planned_rows_name_their_base_loka_config(tmp_path):
    """run.py's `<loka config>_planned` rows load the plan their base row saved."""
    pytest.importorskip("tabulate")
    from benchmarks.public.run import plan_path, resolve_row_config
    cfg, base = resolve_row_config("loka_ro_planned")
    assert (cfg.name, cfg.kind, cfg.mode, base) == ("loka_ro_planned", "loka", "reduce-overhead", "loka_ro")
    cfg, base = resolve_row_config("loka_ro")
    assert (cfg.name, base) == ("loka_ro", None)
    with pytest.raises(ValueError, match="only a loka config"):
        resolve_row_config("inductor_bf16_planned")
    with pytest.raises(ValueError, match="unknown config"):
        resolve_row_config("nonsense_planned")
    path = plan_path(tmp_path, "deepctr_torch.DeepFM", "tiny", 32, "train", "loka_ro")
    assert path.parent == tmp_path / "plans" and "loka_ro" in path.name and path.suffix == ".json"
    assert path != plan_path(tmp_path, "deepctr_torch.DeepFM", "tiny", 32, "infer", "loka_ro")
