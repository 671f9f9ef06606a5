"""What a loka compile costs in its first steps: each graph pays one Inductor compile per ATen
graph (forward and backward), the FP8 variant's, while its probe variant runs as traced; with
`compile_probe` the probe variant is compiled too, and a graph none of whose sites is a candidate
keeps it (one compile). benchmarks.public.first_steps' phase table reads cProfile."""

import copy
import cProfile
import json
import logging
import pstats

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile import inductor_compile
from loka_compile.passes import Phase, Reason
from numerics import rel_error

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# fp32, every site in high precision: compiled and eager differ by Inductor's summation order
REL_ERROR = 1e-5


def _mlp(width: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(dropout), nn.Linear(width, 1))


def _train(model, x, steps=4, **options):
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 2, **options})
    for _ in range(steps):
        out = compiled(x)
        out.square().mean().backward()
        ref = eager(x)
        ref.square().mean().backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())]
    return compiled, out, ref, grads


@pytest.mark.parametrize("compile_probe", [False, True])
def test_a_graph_without_candidates_compiles_once(inductor_compiles, compile_probe):
    """Every GEMM below min_gemm_dim (16): nothing to probe. Its one compile is the FP8
    variant's, after the window; with compile_probe the probe variant's, which runs on."""
    compiled, out, ref, grads = _train(_mlp(8), torch.randn(32, 8), compile_probe=compile_probe)
    assert inductor_compiles == {"forward": 1, "backward": 1}
    report = loka_compile.report(compiled)
    assert report.sites and all(s.reason == Reason.TOO_SMALL.value for s in report.sites), report.table()
    assert {s.role for s in report.sites} >= {"fwd", "dgrad", "wgrad"}
    assert torch.isfinite(out).all() and rel_error(ref.detach(), out.detach()) < REL_ERROR
    for got, want in grads:  # four steps' accumulated gradients, compiled and eager
        assert torch.isfinite(got).all() and rel_error(want, got) < REL_ERROR


@pytest.mark.parametrize("compile_probe, per_graph", [(False, 1), (True, 2)])
def test_a_training_graph_with_a_window_compiles_once_per_aten_graph(inductor_compiles, compile_probe, per_graph):
    """The probe variant runs as traced: the forward and the backward graph are compiled by
    Inductor once each, as the FP8 variant. compile_probe: twice (probe, then FP8)."""
    compiled, out, ref, grads = _train(_mlp(32), torch.randn(64, 32), compile_probe=compile_probe, recipe="rowwise")
    assert inductor_compiles == {"forward": per_graph, "backward": per_graph}
    report = loka_compile.report(compiled)
    assert any(s.fp8 for s in report.sites), report.table()
    assert {s.kind for s in report.sites if s.fp8} == {"forward", "backward"}
    assert torch.isfinite(out).all() and rel_error(ref.detach(), out.detach()) < 0.1  # rowwise e4m3 in the GEMMs
    for got, want in grads:
        assert torch.isfinite(got).all() and rel_error(want, got) < 0.2


def test_each_graph_is_traced_by_aotautograd_once(inductor_compiles, monkeypatch):
    """The probe variant's AOTAutograd capture serves the FP8 variant and the graph speed check's
    high-precision variant: three compiles of the graph, one trace (`aot_capture`)."""
    from torch._functorch import aot_autograd
    from loka_compile import graph_speed
    from test_whole_graph_speed import fixed_time_steps

    traces = []
    real = aot_autograd.aot_stage1_graph_capture

    def counting(aot_state, flat_fn):
        traces.append(aot_state.needs_autograd)
        return real(aot_state, flat_fn)

    monkeypatch.setattr(aot_autograd, "aot_stage1_graph_capture", counting)
    monkeypatch.setattr(graph_speed, "time_steps", fixed_time_steps(1.0, 2.0, []))  # FP8 kept
    compiled, out, ref, grads = _train(_mlp(32), torch.randn(64, 32), recipe="rowwise", graph_speed_check="always")
    assert traces == [True]
    assert inductor_compiles == {"forward": 2, "backward": 2}  # the FP8 variant's, the high-precision one's
    graph = loka_compile.state_of(compiled).records[0]
    assert graph.graph_speed.timed and graph.graph_speed.kept == "fp8"
    report = loka_compile.report(compiled)
    assert {s.kind for s in report.sites if s.fp8} == {"forward", "backward"}
    assert torch.isfinite(out).all() and rel_error(ref.detach(), out.detach()) < 0.1  # rowwise e4m3 in the GEMMs
    for got, want in grads:
        assert torch.isfinite(got).all() and rel_error(want, got) < 0.2


def test_the_traced_probe_finds_and_judges_what_the_compiled_one_does():
    """The probe variant run as traced sees the graph Inductor would lower: the same sites,
    the same verdicts, the same decisions as with compile_probe."""
    x = torch.randn(64, 32)
    tables = []
    for compile_probe in (False, True):
        torch._dynamo.reset()
        compiled, out, _, _ = _train(_mlp(32), x, compile_probe=compile_probe)
        report = loka_compile.report(compiled)
        tables.append(sorted((s.id, s.kind, s.role, s.fp8, s.reason, s.scaling) for s in report.sites))
        assert torch.isfinite(out).all()
    assert tables[0] == tables[1] and any(fp8 for *_, fp8, _, _ in tables[0])


def test_a_traced_probe_that_fails_at_its_first_run_is_compiled(inductor_compiles, monkeypatch, caplog):
    """A probe variant whose traced graph fails at its first run is compiled with Inductor, and
    the window goes on: the call runs, its sites are observed once, the FP8 variant follows."""
    real = inductor_compile._as_traced

    def fails_first(gm, example_inputs, **kwargs):
        traced = real(gm, example_inputs, **kwargs)
        if kwargs.get("is_backward"):
            return traced

        def run(args):
            raise RuntimeError("no kernel for this op outside Inductor")
        run._boxed_call = True
        return run

    monkeypatch.setattr(inductor_compile, "_as_traced", fails_first)
    with caplog.at_level(logging.WARNING, logger="loka"):
        compiled, out, ref, grads = _train(_mlp(32), torch.randn(64, 32))
    assert sum("failed at its first run as traced" in r.getMessage() for r in caplog.records) == 1
    assert inductor_compiles == {"forward": 2, "backward": 2}  # the probe variant's compile, then the FP8 variant's
    state = loka_compile.state_of(compiled)
    assert state.counters["first_run_fallbacks"] == 0
    graph = state.records[0]
    assert graph.phase is Phase.FP8 and graph.fallback is None
    observed = [state.store.observed(s.key) for ctx in graph.contexts_of(Phase.PROBE).values() for s in ctx.sites
                if ctx.decisions[s.id].reason is Reason.PROBING]
    assert observed and set(observed) == {2}  # the window's two calls, the failed one not among them
    report = loka_compile.report(compiled)
    assert any(s.fp8 for s in report.sites) and not any(s.reason == "graph_fallback" for s in report.sites)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g, _ in grads)


def test_output_budget_not_measured_where_the_traced_probe_draws_its_own_random_numbers():
    """Dropout draws in Inductor's code in the FP8 variant and in eager kernels in the traced
    probe: their outputs are not comparable, so the FP8 variant's discrepancy is not measured,
    and the report says why; without dropout it is measured, near its prediction."""
    x = torch.randn(64, 32)
    budgets = {}
    for dropout in (0.0, 0.25):
        torch._dynamo.reset()
        compiled, out, _, _ = _train(_mlp(32, dropout), x, steps=3, recipe="rowwise")
        budgets[dropout] = loka_compile.state_of(compiled).records[0].output_budget
        assert torch.isfinite(out).all()
    plain, dropped = budgets[0.0], budgets[0.25]
    assert plain.measured is not None and not plain.why_unmeasured
    assert plain.measured <= 1.5 * plain.predicted_after + plain.floor.value
    assert dropped.measured is None and "random numbers" in dropped.why_unmeasured
    assert dropped.predicted_after is not None and dropped.predicted_after > 0


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


def test_every_phase_names_a_function_that_exists():
    """Each phase row's file defines its function, in this checkout or in the installed
    torch and triton (a renamed function would read 0 s for ever)."""
    import pathlib

    import triton
    from benchmarks.public.first_steps import PHASES

    roots = [pathlib.Path(__file__).resolve().parents[2], pathlib.Path(torch.__file__).parent.parent,
             pathlib.Path(triton.__file__).parent.parent]
    for label, path, name in PHASES:
        files = [root / path for root in roots if (root / path).is_file()]
        assert files, (label, path)
        assert any(f"def {name}(" in f.read_text() for f in files), (label, path, name)


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


def test_a_failed_loka_row_still_saves_its_plan(tmp_path, monkeypatch):
    """A row that fails after loka compiled (a crash the GPU's decisions cause) leaves the plan
    of those decisions, from which another machine compiles the same graphs."""
    pytest.importorskip("tabulate")
    pytest.importorskip("deepctr_torch")
    from benchmarks.public import run

    def failing_timing(*args, **kwargs):
        raise RuntimeError("synthetic failure after the first steps")

    monkeypatch.setattr(run, "_time_batch", failing_timing)
    path = run.main(["--preset", "tiny", "--device", "cpu", "--models", "deepctr_torch.DeepFM", "--configs", "loka",
                     "--modes", "train", "--first-steps", "4", "--warmup", "0", "--steps", "1",
                     "--out", str(tmp_path), "--name", "failed"])
    row, = json.loads(path.read_text())["rows"]
    assert "synthetic failure" in row["error"]
    saved = run.plan_path(tmp_path, "deepctr_torch.DeepFM", "tiny", row["batch"], "train", "loka")
    assert row["plan_saved"] == str(saved) and json.loads(saved.read_text())
