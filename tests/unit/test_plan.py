"""Plans: stable site ids, the compiled model's own plan, save / load / reject, and one
plan for every rank."""

import dataclasses
import json
import logging

import pytest
import torch
from torch import nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func

import loka_compile
from loka_compile import LokaConfig, dispatch
from loka_compile.passes import Decision, GraphKind, PassContext, Phase, Reason, graph_kind
from loka_compile.passes.context import Candidate
from loka_compile.passes.find_sites import find_sites
from loka_compile.plan import Plan, SitePlan
from loka_compile.report import plan_of
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


class Tower(nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(32, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def site_ids(record, phase):
    return [s.id for (p, _), ctx in sorted(record.contexts.items(), key=lambda kv: (kv[0][0], kv[0][1].value))
            if p == phase for s in ctx.sites]


def step(compiled, x):
    compiled(x).pow(2).mean().backward()


def outlier_batch(batch=32):
    """A row with one huge value: tensorwise scaling flushes the other rows."""
    x = torch.randn(batch, 32)
    x[3, 5] = 1e6
    return x


# The per-site rule alone: the output budget (max_output_error, tests/unit/test_output_budget.py) would
# keep these small models' sites, each moving the output by ~0.04 against its default 0.003.
PER_SITE = {"max_output_error": None}


# -- stable site ids -----------------------------------------------------------------

@torch._dynamo.config.patch(automatic_dynamic_local_pgo=False)  # no dynamic dims from earlier processes
def test_site_ids_are_stable_across_instances_reset_and_recompiles():
    compiled = torch.compile(Tower(), backend="loka", options={**PER_SITE, "recipe": "rowwise", "probe_steps": 1})
    with torch.no_grad():
        compiled(torch.randn(16, 32))
        compiled(torch.randn(16, 32))  # closes the window: the FP8 variant compiles
        (record,) = loka_compile.state_of(compiled).records
        ids = site_ids(record, "fp8")
        assert ids == site_ids(record, "probe") == ["inference/fc1:fwd#1", "inference/fc2:fwd#1"]
        report = loka_compile.report(compiled)
        assert [s.id for s in report.sites] == ids and all(i in report.table() for i in ids)

        compiled(torch.randn(24, 32))  # another batch: Dynamo recompiles (a new graph)
        first, second = loka_compile.state_of(compiled).records
        assert second is not first and site_ids(second, second.phase) == ids
        assert isinstance(second.contexts[(second.phase, GraphKind.INFERENCE)].sites[0].shape[0], str)  # dynamic batch
        # the site keys (graph and node names) do change
        assert not {s.key for ctx in second.contexts.values() for s in ctx.sites} & \
            {s.key for ctx in first.contexts.values() for s in ctx.sites}

        torch._dynamo.reset()
        loka_compile.reset()
        again = torch.compile(Tower(), backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
        again(torch.randn(16, 32))
        (fresh,) = loka_compile.state_of(again).records
        assert site_ids(fresh, "fp8") == ids


def test_site_ids_count_repeated_modules_in_order():
    """A module called twice: #1, #2 in the forward; a different module has other ids."""
    def fn(x, w):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w).relu(), w)

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot_function(fn, fw_compiler=keep, bw_compiler=keep)(torch.randn(16, 32), torch.randn(32, 32, requires_grad=True))
    ctx = PassContext(graph="t", kind=graph_kind(graphs[0].graph), phase=Phase.FP8, param_input_indices=frozenset(),
                      decide=None)
    find_sites(graphs[0].graph, ctx)
    assert [s.id for s in ctx.sites] == ["forward/<root>:fwd#1", "forward/<root>:fwd#2"]
    assert all(s.node.name not in s.id for s in ctx.sites)


# -- plans: owned, saved, loaded, rejected --------------------------------------------

TENSORWISE_PROBE = {**PER_SITE, "recipe": "tensorwise", "probe_steps": 1, "max_probe_error": 0.1}


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    """A Tower trained through a probe window on an outlier batch, and its saved plan
    (made once for the module; each test then starts from a reset)."""
    torch._dynamo.reset()
    loka_compile.reset()
    tmp_path = tmp_path_factory.mktemp("plan")
    model = Tower()
    compiled = torch.compile(model, backend="loka", options=TENSORWISE_PROBE)
    x = outlier_batch()
    step(compiled, x)
    probing = loka_compile.report(compiled).sites
    with pytest.raises(ValueError, match="still in their probe window"):
        loka_compile.save_plan(compiled, tmp_path / "early.json")
    step(compiled, x)
    path = tmp_path / "plan.json"
    plan = loka_compile.save_plan(compiled, path)
    return dict(model=model, compiled=compiled, x=x, path=path, plan=plan, probing=probing,
                sites=loka_compile.report(compiled).sites, records=list(loka_compile.state_of(compiled).records))


def test_plan_holds_decisions_and_verdicts_by_id(saved_plan):
    plan, sites = saved_plan["plan"], saved_plan["sites"]
    assert {s.reason for s in saved_plan["probing"]} == {"probing"}
    # The outlier row wrecks tensorwise fc1:fwd; rowwise holds it.
    assert "forward/fc1:fwd#1" in plan.upgraded, (plan.upgraded, plan.unsafe)
    assert set(plan.sites) == {s.id for s in sites} == {
        "forward/fc1:fwd#1", "forward/fc2:fwd#1", "backward/fc2:dgrad#1", "backward/fc2:wgrad#1",
        "backward/fc1:wgrad#1"}
    fc1 = plan.sites["forward/fc1:fwd#1"]
    assert fc1.fp8 and fc1.scaling == "rowwise" and fc1.provider == "emulated" and fc1.fast_accum
    assert plan.sites["forward/fc2:fwd#1"].scaling == "tensorwise"
    assert plan.params["fc1.weight"] == ((64, 32), "float32") and set(plan.params) == {
        n for n, _ in saved_plan["model"].named_parameters()}
    data = json.loads(saved_plan["path"].read_text())
    assert data["version"] == 1 and data["device_type"] == "cpu" and data["recipe"] == "tensorwise"
    assert Plan.from_json(data).sites == plan.sites
    # No process-wide table keeps the verdicts: only the graph's own plan does.
    (record,) = saved_plan["records"]
    assert record.plan.upgraded == plan.upgraded and not hasattr(record, "upgraded")


def test_loaded_plan_skips_the_probe_window_and_takes_its_decisions(saved_plan):
    model = Tower()
    model.load_state_dict(saved_plan["model"].state_dict())
    compiled = torch.compile(model, backend="loka", options={**TENSORWISE_PROBE, "plan": str(saved_plan["path"])})
    x = saved_plan["x"]
    out = compiled(x)  # first call already FP8: no window
    out.pow(2).mean().backward()
    sites = {s.id: s for s in loka_compile.report(compiled).sites}
    assert set(sites) == set(saved_plan["plan"].sites)
    for sid, entry in saved_plan["plan"].sites.items():
        assert (sites[sid].fp8, sites[sid].reason) == (entry.fp8, entry.reason), sid
        assert sites[sid].scaling == (entry.scaling if entry.fp8 else ""), sid
        assert "from plan" in sites[sid].detail
    assert sites["forward/fc1:fwd#1"].scaling == "rowwise"  # the upgrade came with the plan
    assert sqnr_db(saved_plan["model"](x), out) > 20


@pytest.mark.parametrize("change, message", [
    (dict(model=lambda: Tower(hidden=48)), r"parameters differ: \['fc1.bias: \(64,\) float32 in the plan, \(48,\)"),
    (dict(model=lambda: Tower().to(torch.bfloat16)), r"fc1.bias: \(64,\) float32 in the plan, \(64,\) bfloat16 here"),
    (dict(model=lambda: nn.Sequential(nn.Linear(32, 64))), r"parameters not in the plan: \['0.bias', '0.weight'\]"),
    (dict(recipe="rowwise"), r"recipe 'tensorwise' in the plan, 'rowwise' in the config"),
    (dict(json={"device_type": "cuda"}), r"device type 'cuda' in the plan, 'cpu' here"),
    (dict(json={"version": 0}), r"format version 0, this loka reads version 1"),
    (dict(json={"sites": 3}), r"is damaged"),
])
def test_plan_for_another_model_or_setup_is_rejected(saved_plan, tmp_path, change, message):
    path = saved_plan["path"]
    if "json" in change:
        path = tmp_path / "edited.json"
        path.write_text(json.dumps({**json.loads(saved_plan["path"].read_text()), **change["json"]}))
    torch._dynamo.reset()
    model = change.get("model", Tower)()
    x = saved_plan["x"].to(next(model.parameters()).dtype)
    config = LokaConfig(recipe=change.get("recipe", "tensorwise"), plan=path)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=message) as caught:
        torch.compile(model, backend="loka", options=config)(x)
    assert isinstance(caught.value.inner_exception, ValueError)


def test_plan_option_is_validated(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{}")
    assert LokaConfig(plan=path).plan == str(path)  # os.PathLike taken, kept as str
    for bad, message in [(3, "plan must be None or a path"), ("", "plan must be None or a path"),
                         (b"p.json", "plan must be None or a path"),
                         (str(tmp_path / "missing.json"), "no such file")]:
        with pytest.raises(ValueError, match=message):
            LokaConfig(plan=bad)
    with pytest.raises(ValueError, match="format version"):
        loka_compile.load_plan(path)


def test_dispatch_rechecks_a_planned_site(caplog):
    """A planned decision is taken where it still holds: its provider can serve the site,
    its reason is a measurement. Otherwise the site is decided here, with a warning."""
    def fn(x, w):
        return torch.nn.functional.linear(x, w)

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot_function(fn, fw_compiler=keep)(torch.randn(32, 64), torch.randn(48, 64))
    ctx = PassContext(graph="t", kind=GraphKind.INFERENCE, phase=Phase.FP8, param_input_indices=frozenset(), decide=None)
    find_sites(graphs[0].graph, ctx)
    (site,) = ctx.sites
    config = LokaConfig(recipe="rowwise")
    fresh = dispatch.decide(site, config, "fp8")
    assert fresh.fp8 and fresh.provider == "emulated"
    planned = SitePlan.from_decision(fresh, site.shape, site.dtype)

    def decide(entry):
        return dispatch.decide(site, config, "fp8", plan=Plan(sites={site.id: entry}, source="p.json"))

    slower = dataclasses.replace(planned, fp8=False, reason="slower_than_bf16", bf16_us=1.0, fp8_us=2.0)
    assert decide(slower).reason is Reason.SLOWER_THAN_BF16 and decide(slower).fp8_us == 2.0
    assert decide(planned) == dataclasses.replace(fresh, detail="from plan p.json")
    with caplog.at_level(logging.WARNING, logger="loka"):
        assert decide(dataclasses.replace(planned, provider="scaled_mm_rowwise")) == fresh  # no CUDA here
        assert decide(dataclasses.replace(planned, shape=(32, 64, 64))) == fresh  # another N
    assert "cannot run as planned" in caplog.text and "planned at K x N 64x64" in caplog.text
    # reasons that follow from model and config are decided again
    assert decide(dataclasses.replace(planned, fp8=False, reason="too_small")) == fresh
    # a plan made here (not loaded) holds no decisions to take
    assert dispatch.decide(site, config, "fp8", plan=Plan(sites={site.id: slower})) == fresh


def test_plan_keeps_speed_candidates_and_m_bucket_and_older_plans_load(tmp_path):
    """A decision's timed providers and symbolic-M bucket go through a saved plan into the
    decision it gives back; an entry saved before those fields loads with none."""
    timed = (Candidate("p1", 2.0, True), Candidate("p3", None, False, "cannot run here (RuntimeError: no kernel)"))
    decision = Decision(fp8=True, reason=Reason.FP8, provider="p1", scaling="rowwise", a_format="e4m3",
                        b_format="e4m3", detail="M=s0 timed at 64", bf16_us=4.0, fp8_us=3.0, candidates=timed,
                        m_bucket=64)
    plan = Plan(device_type="cpu", recipe="rowwise",
                sites={"forward/fc:fwd#1": SitePlan.from_decision(decision, ("s0", 64, 32), torch.float32)})
    loaded = loka_compile.load_plan(plan.save(tmp_path / "plan.json").source)
    back = loaded.sites["forward/fc:fwd#1"].decision(loaded.source)
    assert back.candidates == timed and back.m_bucket == 64 and back.fp8_us == 3.0

    older = json.loads((tmp_path / "plan.json").read_text())
    for entry in older["sites"].values():
        del entry["candidates"], entry["m_bucket"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    entry = loka_compile.load_plan(tmp_path / "older.json").sites["forward/fc:fwd#1"]
    assert entry.candidates == () and entry.m_bucket is None and entry.fp8 and entry.provider == "p1"


# -- distributed: rank 0 decides the verdicts, every rank compiles them ----------------

WORLD_SIZE = 2


def _rank(rank):
    torch.manual_seed(0)
    model = Tower()
    compiled = torch.compile(model, backend="loka", options=TENSORWISE_PROBE)
    x = outlier_batch() if rank == 1 else torch.randn(32, 32)  # only rank 1 sees the outlier
    with torch.no_grad():
        compiled(x)
        (record,) = loka_compile.state_of(compiled).records
        ids = {s.key: s.id for s in record.contexts[("probe", GraphKind.INFERENCE)].sites}
        own = loka_compile.compiled_graph._verdicts_by_id(ids, record.config, record.store)  # this rank's alone
        compiled(x)
    plan = plan_of(compiled)
    return {"own": own, "upgraded": plan.upgraded, "unsafe": plan.unsafe,
            "scalings": {sid: e.scaling for sid, e in plan.sites.items()}}


@pytest.mark.slow
def test_ranks_share_rank0_probe_verdicts_over_gloo(tmp_path):
    from spawn_ranks import run_ranks

    r0, r1 = run_ranks(_rank, (), WORLD_SIZE, 180, tmp_path)
    assert r1["own"][1] and not r0["own"][1]  # alone, rank 1 would have sent a site rowwise
    assert r0["upgraded"] == r1["upgraded"] == {} and r0["unsafe"] == r1["unsafe"] == {}
    assert r0["scalings"] == r1["scalings"] and set(r1["scalings"].values()) == {"tensorwise"}
