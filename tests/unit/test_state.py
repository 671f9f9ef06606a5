"""One LokaState per torch.compile call: reports, plans and Probe statistics of two compiles
never mix, anything that is not a loka-compiled model is refused, and the state is found
through every form a compiled model takes (module, function, DDP around or inside)."""

import collections
import datetime

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile.report import plan_of
from numerics import sqnr_db

# Rowwise e4m3 on random data: about 28 dB; tensorwise around an outlier row loses the others.
OUTPUT_SQNR_FLOOR_DB = 20.0

# The per-site rule alone: these small sites each move the output by more than the default
# output budget would allow, which would keep them in high precision.
PER_SITE = {"max_output_error": None}


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _outlier_batch() -> torch.Tensor:
    """Unit rows and one huge element: tensorwise FP8 flushes every other row, rowwise does not."""
    x = torch.randn(32, 32)
    x[3, 5] = 1e6
    return x


@pytest.mark.usefixtures("fresh_compile_state")
def test_two_compiles_of_one_module_keep_two_reports_and_plans(tmp_path):
    """One module compiled twice with different options: each report lists its own compile's
    graphs, and each plan holds its own decisions (the second, after a probe window on an
    outlier batch, sends fc1 rowwise; the first keeps the recipe's tensorwise everywhere)."""
    model = Tower()
    first = torch.compile(model, backend="loka", options={**PER_SITE, "recipe": "tensorwise", "probe_steps": 0})
    second = torch.compile(model, backend="loka", options={**PER_SITE, "recipe": "tensorwise", "probe_steps": 1,
                                                           "max_probe_error": 0.1})
    x = _outlier_batch()
    with torch.no_grad():
        out = first(x)
        second(x)
        second(x)  # closes the window
    assert sqnr_db(model(x), out) > 0  # the tensorwise FP8 output ran (the outlier costs it its other rows)
    states = loka_compile.state_of(first), loka_compile.state_of(second)
    assert states[0] is not states[1]
    (first_graph,), (second_graph,) = (s.records for s in states)
    assert first_graph.name != second_graph.name
    reports = loka_compile.report(first), loka_compile.report(second)
    assert [g.name for g in reports[0].graphs] == [first_graph.name]
    assert [g.name for g in reports[1].graphs] == [second_graph.name]
    assert {s.scaling for s in reports[0].sites} == {"tensorwise"}
    fc1 = next(s for s in reports[1].sites if s.module == "fc1")
    assert fc1.fp8 and fc1.scaling == "rowwise", reports[1].table()

    plans = [loka_compile.save_plan(compiled, tmp_path / f"{i}.json") for i, compiled in enumerate((first, second))]
    fc1_id = "inference/fc1:fwd#1"
    assert plans[0].sites[fc1_id].scaling == "tensorwise" and plans[0].upgraded == {}
    assert plans[1].sites[fc1_id].scaling == "rowwise" and fc1_id in plans[1].upgraded
    # the Probe statistics are the second compile's alone (the first had no window)
    assert not states[0].store.keys() and states[1].store.keys()
    assert all(key.startswith(second_graph.name + "/") for key in states[1].store.keys())


@pytest.mark.parametrize("argument", [42, "model", None, Tower(), torch.compile(Tower(), backend="eager")])
def test_anything_but_a_loka_compiled_model_is_refused(argument):
    for read in (loka_compile.report, plan_of, lambda compiled: loka_compile.save_plan(compiled, "unused.json")):
        with pytest.raises(ValueError, match="not a model or function compiled with backend=\"loka\""):
            read(argument)


@pytest.mark.usefixtures("fresh_compile_state")
def test_a_compile_served_with_an_earlier_compiles_graphs_says_so():
    """Dynamo serves a second compile of the same class with equal options with the first's
    graphs: the second has none of its own, and its report says where they are."""
    options = {"probe_steps": 0}
    first, second = (torch.compile(Tower(), backend="loka", options=options) for _ in range(2))
    with pytest.raises(ValueError, match="compiled no graph of its own: call it first"):
        loka_compile.report(first)
    x = torch.randn(16, 32)
    with torch.no_grad():
        first(x)
        second(x)
    assert len(loka_compile.report(first).graphs) == 1
    with pytest.raises(ValueError, match="compiled no graph of its own"):
        loka_compile.report(second)


@pytest.mark.usefixtures("fresh_compile_state")
def test_a_compiled_function_and_a_module_compiled_in_place_have_their_state():
    model = Tower()
    x = torch.randn(16, 32)

    def forward(inputs):
        return model(inputs)

    function = torch.compile(forward, backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        function(x)
    assert [s.module for s in loka_compile.report(function).sites] == ["fc1", "fc2"]
    in_place = Tower()
    in_place.compile(backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        in_place(x)
    assert [s.module for s in loka_compile.report(in_place).sites] == ["fc1", "fc2"]
    assert loka_compile.state_of(function) is not loka_compile.state_of(in_place)


def test_the_backend_called_directly_makes_a_state_per_call():
    gm = torch.fx.symbolic_trace(Tower())
    x = torch.randn(16, 32)
    graphs = [loka_compile.loka_backend(gm, [x], options={"probe_steps": 0}) for _ in range(2)]
    states = [loka_compile.state_of(graph) for graph in graphs]
    assert states[0] is not states[1] and [len(s.records) for s in states] == [1, 1]
    assert [s.module for s in loka_compile.report(graphs[0]).sites] == ["fc1", "fc2"]


def test_observations_of_a_graph_whose_compile_is_gone_are_dropped(store):
    """The observers' sink routes by the key's graph name; a name no live state owns is dropped."""
    from loka_compile import probe

    kept = probe.ProbeStore()
    probe.route_observations("g_test_route", kept)
    stats = {"a_rms": torch.tensor(1.0), "b_rms": torch.tensor(1.0), "rel_error": torch.tensor(0.01)}
    probe.deliver("g_test_route/forward/mm", stats)
    probe.deliver("g_nobody/forward/mm", stats)
    assert kept.keys() == ["g_test_route/forward/mm"] and not store.keys()


@pytest.mark.usefixtures("fresh_compile_state")
def test_a_compiled_ddp_model_reports(tmp_path):
    """torch.compile(DDP(model)) over gloo (one rank): DDPOptimizer calls the backend once per
    bucket, from the same compile, so every graph joins one state, and DDP(torch.compile(model))
    reaches the state of the module it wraps."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.randn(16, 32)
        around = torch.compile(nn.parallel.DistributedDataParallel(Tower()), backend="loka",
                               options={"probe_steps": 0})
        around(x).sum().backward()
        # Options of its own: Dynamo would serve an equal compile of Tower with the first's graphs.
        inside = nn.parallel.DistributedDataParallel(torch.compile(Tower(), backend="loka",
                                                                   options={"probe_steps": 0, "recipe": "rowwise"}))
        inside(x).sum().backward()
        for compiled in (around, inside):
            report = loka_compile.report(compiled)
            assert {(s.module.rsplit(".", 1)[-1], s.role) for s in report.sites} >= {("fc1", "fwd"), ("fc2", "fwd")}
            assert any(s.fp8 for s in report.sites), report.table()
        assert loka_compile.state_of(around) is not loka_compile.state_of(inside)
    finally:
        dist.destroy_process_group()



@pytest.mark.usefixtures("fresh_compile_state")
def test_a_budget_demotion_is_an_amendment_in_the_report():
    """The output budget keeps fc1 in high precision after Dispatch let it go FP8: the change is
    an amendment by the budget, with its reason, on the site, in the state and in the summary;
    fc2, which nothing changed, has none."""
    from test_output_budget import ABSOLUTE, D, PlantedSensitivity, _run, _sites

    compiled, _ = _run(PlantedSensitivity(), ABSOLUTE, x=torch.randn(D, D))
    report = loka_compile.report(compiled)
    sites = _sites(compiled)
    (amendment,) = sites["fc1"].amendments
    assert amendment.by == "output_budget" and amendment.site_id == sites["fc1"].id
    assert ("fp8", True, False) in amendment.changes and ("reason", "fp8", "probe_unsafe") in amendment.changes
    assert "max_output_error 0.003" in amendment.why and amendment.why == sites["fc1"].detail
    assert sites["fc2"].fp8 and sites["fc2"].amendments == ()
    assert loka_compile.state_of(compiled).amendments == [amendment]
    summary = report.summary()
    assert "decisions amended after Dispatch: output_budget 1" in summary
    assert f"{sites['fc1'].id}: output_budget: fp8 True -> False, reason 'fp8' -> 'probe_unsafe'" in summary
    (row,) = [line for line in report.table().splitlines() if sites["fc1"].id in line]
    assert row.rstrip().endswith("output_budget")


@pytest.mark.usefixtures("fresh_compile_state")
def test_dispatch_decides_each_site_once_in_a_training_compile(monkeypatch):
    """The joint graph's Mods (weight_both_layouts, saved_fp8) decide the dgrad and wgrad sites
    and the forward's twins first; the forward and backward graphs read those decisions."""
    from loka_compile import dispatch

    calls, real = [], dispatch.decide

    def counting(site, **kwargs):
        calls.append(site.id)
        return real(site, **kwargs)

    monkeypatch.setattr(dispatch, "decide", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 32))
    compiled = torch.compile(model, backend="loka",
                             options={"recipe": "rowwise", "probe_steps": 0, "speed_check": False, **PER_SITE})
    x = torch.randn(64, 64)
    out = compiled(x)
    out.square().mean().backward()
    record = loka_compile.state_of(compiled).records[0]
    assert {"saved_fp8", "weight_both_layouts"} <= set(record.mod_results)  # the joint graph's Mods ran
    sites = loka_compile.report(compiled).sites
    roles = {s.role for s in sites}
    assert roles == {"fwd", "dgrad", "wgrad"} and all(s.fp8 for s in sites), [(s.id, s.reason) for s in sites]
    assert sorted(calls) == sorted(s.id for s in sites), collections.Counter(calls)  # one call per site, no more
    assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
