"""loka under torch.distributed, two ranks: both DDP forms and FSDP2 train as one process on
the ranks' joint batch would, every rank compiles the same plan when each sees different
data, a recompile on every rank keeps the collectives lined up, and sparse embedding
gradients stay sparse. On CPU over gloo (FP8 emulated), and, marked `cuda`, on two GPUs over
NCCL (real FP8 kernels; the speed check off, so the tiny GEMMs run FP8 all the same).

The two ranks run once per module and device (`ranks`, `nccl_ranks`: each scenario in turn
in one process group, so the file pays for one spawn each); each test checks its scenario. A
deadlock fails at the join's timeout (the process group's own timeout is shorter)."""

import dataclasses
import functools
import os
import time
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_compile
from loka_compile.report import plan_of
from models import LinearReLU
from numerics import rel_error
from spawn_ranks import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 300
STEPS = 3
BATCH = 16  # per rank
# Joint-batch training against DDP's and FSDP2's averaged gradients: the default recipe's
# scales are per row (whatever the batch), so only float summation order differs. Measured:
# <= 1e-6 relative on the dense layers' updates, 6e-4 on the sparse table's (an fp32 difference
# flips a few e4m3 roundings of its gradient). The floor is a sixth of one e4m3 rounding step
# (2^-3 relative).
UPDATE_REL_ERROR_FLOOR = 0.02
# Plan agreement: the per-site rule in tensorwise, where rank 1's outliers would send sites rowwise.
WINDOW = {"recipe": "tensorwise", "probe_steps": 2, "max_probe_error": 0.1, "recheck_every": 3}
CPU_FORMS = ("ddp_compile", "compile_ddp", "sparse")
# NCCL reduces no sparse gradients: the sparse-embedding scenario runs over gloo only.
NCCL_FORMS = ("ddp_compile", "compile_ddp")


def options(device, **extra):
    """loka's options on `device`: FP8 from the first call; on a GPU without the speed check,
    which would keep these tiny GEMMs in bf16."""
    return {"probe_steps": 0, **({"speed_check": False} if device.type == "cuda" else {}), **extra}


def rank_device(rank, backend):
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


class Mlp(nn.Module):
    """Its 1 MB middle layer makes DDP's graph splitting (buckets of 1 MB) compile several buckets."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(32, 512), nn.LayerNorm(512), nn.Linear(512, 16)
        self.mid = nn.Linear(512, 512)

    def forward(self, x):
        return self.fc2(torch.relu(self.mid(torch.relu(self.norm(self.fc1(x))))))


class SparseTower(nn.Module):
    """Embedding lookups (sparse gradients) into a dense layer."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(100, 32, sparse=True)
        self.fc = nn.Linear(32, 16)

    def forward(self, ids):
        return self.fc(self.table(ids).mean(dim=1))


class BlockNet(nn.Module):
    """Blocks for FSDP2: each compiled, then sharded (FSDP2's pattern: the all-gather runs in
    fully_shard's hooks, outside the compiled graphs)."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.head = LinearReLU(32, 64), LinearReLU(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(self.b2(self.b1(x)))


def compiled_blocks(model, device):
    for block in (model.b1, model.b2):
        block.compile(backend="loka", options=options(device))
    return model


def batches(rank, model_kind, device):
    """STEPS (input, target) pairs of this rank on `device`, fresh random per rank."""
    data = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        if model_kind == "sparse":
            x = torch.randint(0, 100, (BATCH, 4), generator=data)
        else:
            x = torch.randn(BATCH, 32, generator=data)
        out.append((x.to(device), torch.randn(BATCH, 16, generator=data).to(device)))
    return out


def autocast(device):
    """bf16 GEMMs on a GPU (where loka's FP8 kernels take bf16), fp32 master weights."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train(model, forward, steps):
    """SGD on `steps`; returns the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in steps:
        optimizer.zero_grad(set_to_none=True)
        with autocast(x.device):
            out = forward(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fresh(model_kind, device):
    torch.manual_seed(0)
    return {"sparse": SparseTower, "blocks": BlockNet}.get(model_kind, Mlp)().to(device)


def on_cpu(tensors):
    return [t.detach().cpu().clone() for t in tensors]


def _train_form(rank, form, device):
    """One DDP form: (initial, final parameters, losses, whether the embedding grad was sparse)."""
    torch._dynamo.reset()
    loka_compile.reset()
    kind = "sparse" if form == "sparse" else "dense"
    model = fresh(kind, device)
    initial = on_cpu(model.parameters())
    ids = [device.index] if device.type == "cuda" else None
    if form == "compile_ddp":
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1)
        forward = torch.compile(ddp, backend="loka", options=options(device))
    else:  # "ddp_compile" and "sparse"
        forward = nn.parallel.DistributedDataParallel(torch.compile(model, backend="loka", options=options(device)),
                                                      device_ids=ids)
    sparse_grads = []
    if kind == "sparse":
        model.table.weight.register_post_accumulate_grad_hook(lambda p: sparse_grads.append(p.grad.is_sparse))
    losses = train(model, forward, batches(rank, kind, device))
    sites = [(s.graph, s.module, s.role, s.fp8, s.reason) for s in loka_compile.report(forward).sites]
    return {"initial": initial, "params": on_cpu(model.parameters()), "losses": losses,
            "sparse_grads": sparse_grads, "sites": sites}


def _window_in_ddp_buckets(rank, device, store_dir):
    """`torch.compile(DDP(model))` with a probe window: DDP's graph splitting compiles one graph per
    bucket, and each bucket's FP8 variant (compiled when the window closes) gets its own backward.
    Rank 0 saves the plan (`_planned_ddp_buckets` runs it)."""
    torch._dynamo.reset()
    loka_compile.reset()
    model = fresh("dense", device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1)
    forward = torch.compile(ddp, backend="loka", options=options(device, probe_steps=2))
    losses = train(model, forward, batches(rank, "dense", device))
    report = loka_compile.report(forward)
    if rank == 0:
        loka_compile.save_plan(forward, bucket_plan_path(store_dir))
    torch.distributed.barrier()
    return {"losses": losses, "params": on_cpu(model.parameters()), "graphs": len(report.graphs),
            "phases": sorted({g.phase for g in report.graphs}), "fp8_sites": sum(s.fp8 for s in report.sites)}


def _planned_ddp_buckets(rank, device, store_dir):
    """A fresh `torch.compile(DDP(model))` with the plan `_window_in_ddp_buckets` saved (its
    windows closed on each rank's own data, the plan saved by rank 0): every bucket's graph runs
    the plan from its first call, on every rank (as the benchmark's larger worlds run the plan
    of its smallest)."""
    from loka_compile.types import Phase

    torch._dynamo.reset()
    loka_compile.reset()
    path = bucket_plan_path(store_dir)
    model = fresh("dense", device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1)
    forward = torch.compile(ddp, backend="loka", options=options(device, plan=path))
    losses = train(model, forward, batches(rank, "dense", device))
    records = loka_compile.state_of(forward).records

    def table(plan):
        return {sid: (e.fp8, e.scaling, e.reason) for sid, e in plan.sites.items()}

    return {"graphs": len(records), "losses": losses, "saved": table(loka_compile.load_plan(path)),
            "planned": table(plan_of(forward)),
            "windowless": all(r.plan.source == path and r.phase is Phase.FP8 for r in records)}


def bucket_plan_path(store_dir):
    return os.path.join(store_dir, "ddp_buckets_plan.json")


def _fsdp2(rank, device):
    """FSDP2: loka-compiled blocks, each sharded over the ranks, the root too."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    loka_compile.reset()
    model = compiled_blocks(fresh("blocks", device), device)
    initial = on_cpu(model.parameters())
    for block in (model.b1, model.b2):
        fully_shard(block)
    fully_shard(model)
    losses = train(model, model, batches(rank, "dense", device))
    sites = [(s.graph, s.module, s.role, s.fp8, s.reason) for block in (model.b1, model.b2)
             for s in loka_compile.report(block).sites]
    return {"initial": initial, "params": on_cpu(p.full_tensor() for p in model.parameters()),
            "losses": losses, "sites": sites}


def _plans(rank, device):
    """A window closing on different data per rank (rank 1's inputs 1000x larger with an
    outlier), an amax guard tripping on rank 1 alone, re-checks, then a new batch size on
    both ranks (Dynamo recompiles; the new graph opens its own window)."""
    from loka_compile import amax_guard

    # The ranks merge their guards' trips at every call, as one process reads them: the trip
    # acts at the next call (by default they merge every RANK_MERGE_EVERY calls).
    with unittest.mock.patch.object(amax_guard, "RANK_MERGE_EVERY", 1):
        return _plans_merging_every_call(rank, device)


def _plans_merging_every_call(rank, device):
    from loka_compile import compiled_graph

    torch._dynamo.reset()
    loka_compile.reset()
    model = fresh("dense", device)
    compiled = torch.compile(model, backend="loka", options=options(device, **WINDOW), dynamic=False)
    data = torch.Generator().manual_seed(7 + rank)

    def batch(rows, outlier=0.0):
        x = torch.randn(rows, 32, generator=data) * (1000.0 if rank == 1 else 1.0)
        if outlier and rank == 1:
            x[3, 5] = outlier
        return x.to(device), torch.randn(rows, 16, generator=data).to(device)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with autocast(device):
            out = compiled(x)
        F.mse_loss(out.float(), y).backward()
        optimizer.step()

    for _ in range(WINDOW["probe_steps"]):
        step(*batch(BATCH, outlier=1e9))  # tensorwise flushes rank 1's other rows: alone, it would go rowwise
    state = loka_compile.state_of(compiled)
    first = state.records[0]
    ids = {s.key: s.id for (phase, _), ctx in first.contexts.items() if phase == "probe" for s in ctx.sites}
    own = compiled_graph._verdicts_by_id(ids, first.config, first.store)  # this rank's verdicts, alone
    step(*batch(BATCH))  # the window closes on this call's local batch
    closed = plan_of(compiled)
    budget = first.output_budget
    # Call 4 runs the FP8 variant (re-checks come at calls 5 and 8): rank 1's outlier, far beyond
    # its window, trips its guard; every rank demotes the site at call 5, then re-checks it.
    step(*batch(BATCH, outlier=1e15))
    for _ in range(4):
        step(*batch(BATCH))
    after = plan_of(compiled)
    for _ in range(WINDOW["probe_steps"] + 2):  # a new batch size on every rank: a recompile and its window
        step(*batch(2 * BATCH))
    final = plan_of(compiled)

    def table(plan):
        return {sid: (e.fp8, e.scaling, e.reason) for sid, e in plan.sites.items()}

    return {"own": own, "closed": table(closed), "after": table(after), "final": table(final),
            "unsafe": dict(final.unsafe), "upgraded": dict(final.upgraded),
            "history": {sid: [(h["from"], h["to"], h.get("by")) for h in entries]
                        for sid, entries in final.history.items()},
            "budget": None if budget is None else (dict(budget.kept), dict(budget.sensitivity)),
            "graphs": len(state.records)}


def _decisions(rank, store_dir):
    """`ranks.decide_once` on its own: a speed check timed on rank 0 alone (each rank with its
    own performance database), a failure on rank 0 raised on both, trips merged."""
    from loka_compile import ranks, speed

    os.environ["LOKA_CACHE_DIR"] = os.path.join(store_dir, f"cache{rank}")
    speed.clear_cache()
    shape = speed.SiteShape(64, 32, 48, "row", "column", True, torch.float32, torch.device("cpu"))
    timing = speed.site_timing(shape, "rowwise", "e4m3", "e4m3", ("emulated",))
    stored = os.path.exists(os.path.join(store_dir, f"cache{rank}"))

    def fail():
        raise speed.NoProviderRuns({"emulated": f"raised on rank {rank}"})

    try:
        ranks.decide_once(fail)
        raised = None
    except speed.NoProviderRuns as error:
        raised = error.failed
    merged = ranks.decide_once(lambda: {f"site{rank}": rank}, merge=lambda views: sorted(k for v in views for k in v))
    # Inductor's passes, the speed check's caller, run under a fake-tensor mode.
    with torch._subclasses.fake_tensor.FakeTensorMode():
        shape = speed.SiteShape(80, 32, 48, "row", "column", True, torch.float32, torch.device("cpu"))
        under_fake = speed.site_timing(shape, "rowwise", "e4m3", "e4m3", ("emulated",))
        merged_under_fake = ranks.decide_once(lambda: rank, merge=sorted)
    speed.clear_cache()
    return {"timing": dataclasses.asdict(timing), "stored": stored, "raised": raised, "merged": merged,
            "under_fake": dataclasses.asdict(under_fake), "merged_under_fake": merged_under_fake}


def _graph_speed_under_ddp(rank, device):
    """DDP(torch.compile(model)) with the graph speed check on every graph, its timer stood in
    for so that the ranks disagree: rank 0 times high precision faster, rank 1 FP8. Rank 0's
    timing decides on both (`decide_once`). DDP's graph splitting runs each piece once inside
    Dynamo's compile, with probe_steps=0 its FP8 variant's first run: the check waits for the next call."""
    from loka_compile import graph_speed

    torch._dynamo.reset()
    loka_compile.reset()
    from test_whole_graph_speed import fixed_time_steps

    fp8_ms, hp_ms = (2.0, 1.0) if rank == 0 else (1.0, 2.0)
    timed = []
    real = graph_speed.time_steps
    graph_speed.time_steps = fixed_time_steps(fp8_ms, hp_ms, timed)
    try:
        model = fresh("dense", device)
        ids = [device.index] if device.type == "cuda" else None
        forward = nn.parallel.DistributedDataParallel(
            torch.compile(model, backend="loka", options=options(device, graph_speed_check="always")), device_ids=ids)
        losses = train(model, forward, batches(rank, "dense", device))
    finally:
        graph_speed.time_steps = real
    report = loka_compile.report(forward)
    return {"timed": timed, "kept": [g.graph_speed.kept for g in report.graphs], "losses": losses,
            "fp8_sites": sum(s.fp8 for s in report.sites), "params": on_cpu(model.parameters())}


def _rank(rank, store_dir, backend):
    """Every scenario in turn; result["seconds"]: each one's wall time on this rank."""
    device = rank_device(rank, backend)
    scenarios = {form: functools.partial(_train_form, rank, form, device)
                 for form in (CPU_FORMS if backend == "gloo" else NCCL_FORMS)}
    scenarios["fsdp2"] = functools.partial(_fsdp2, rank, device)
    scenarios["window_in_buckets"] = functools.partial(_window_in_ddp_buckets, rank, device, store_dir)
    if backend == "gloo":
        scenarios["decisions"] = functools.partial(_decisions, rank, store_dir)
        scenarios["planned_buckets"] = functools.partial(_planned_ddp_buckets, rank, device, store_dir)
        scenarios["graph_speed"] = functools.partial(_graph_speed_under_ddp, rank, device)
    scenarios["plans"] = functools.partial(_plans, rank, device)
    result, seconds = {}, {}
    for name, scenario in scenarios.items():
        began = time.perf_counter()
        result[name] = scenario()
        seconds[name] = round(time.perf_counter() - began, 1)
    result["seconds"] = seconds
    return result


def _report_seconds(per_rank, backend):
    """Where the ranks' time went (shown with pytest -rP or -s): each scenario's seconds per rank."""
    print(f"{backend} ranks, seconds per scenario:",
          {name: [r["seconds"][name] for r in per_rank] for name in per_rank[0]["seconds"]})
    return per_rank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    store = tmp_path_factory.mktemp("ranks")
    return _report_seconds(run_ranks(_rank, (str(store), "gloo"), WORLD_SIZE, JOIN_TIMEOUT_S, store), "gloo")


@pytest.fixture(scope="module")
def nccl_ranks(tmp_path_factory):
    if torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs for NCCL ranks, found {torch.cuda.device_count()}")
    store = tmp_path_factory.mktemp("nccl_ranks")
    return _report_seconds(run_ranks(_rank, (str(store), "nccl"), WORLD_SIZE, JOIN_TIMEOUT_S, store, backend="nccl"),
                           "nccl")


@functools.lru_cache(maxsize=None)  # the same reference for every form that trains `kind` (it is deterministic)
def single_process(kind, device):
    """The same training in one process on both ranks' batches joined (the mean loss over
    equal halves is the mean of the ranks' losses: the same gradient DDP averages)."""
    torch._dynamo.reset()
    loka_compile.reset()
    model = fresh(kind, device)
    per_rank = [batches(rank, "dense" if kind == "blocks" else kind, device) for rank in range(WORLD_SIZE)]
    joint = [tuple(torch.cat(parts) for parts in zip(*steps)) for steps in zip(*per_rank)]
    if kind == "blocks":
        compiled = compiled_blocks(model, device)
    else:
        compiled = torch.compile(model, backend="loka", options=options(device))
    train(model, compiled, joint)
    return on_cpu(model.parameters())


def check_trains_as_one_process(ranks, form, device):
    r0, r1 = ranks[0][form], ranks[1][form]
    for r in (r0, r1):
        assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
        assert any(fp8 for *_, fp8, _ in r["sites"]), r["sites"]  # loka ran FP8 sites under DDP
    assert r0["losses"] != r1["losses"]  # each rank trained on its own data
    for p0, p1 in zip(r0["params"], r1["params"]):
        assert torch.equal(p0, p1)  # the gradients were averaged: the same steps on both ranks
    reference = single_process({"sparse": "sparse", "fsdp2": "blocks"}.get(form, "dense"), device)
    for start, ddp, one in zip(r0["initial"], r0["params"], reference):
        assert not torch.equal(start, one)
        error = rel_error(ddp - start, one - start)
        assert error <= UPDATE_REL_ERROR_FLOOR, (form, error)


def check_window_in_ddp_buckets(ranks):
    r0, r1 = ranks[0]["window_in_buckets"], ranks[1]["window_in_buckets"]
    assert r0["graphs"] >= 2 and r0["phases"] == ["fp8"] and r0["fp8_sites"] > 0, r0
    assert all(torch.isfinite(torch.tensor(r0["losses"] + r1["losses"])))
    for p0, p1 in zip(r0["params"], r1["params"]):
        assert torch.equal(p0, p1)


def check_one_plan(ranks):
    p0, p1 = ranks[0]["plans"], ranks[1]["plans"]
    assert p0["own"] != p1["own"]  # alone, the ranks would have decided differently
    for stage in ("closed", "after", "final"):
        assert p0[stage] == p1[stage], stage
    assert p0["unsafe"] == p1["unsafe"] and p0["upgraded"] == p1["upgraded"]
    assert p0["budget"] is not None and p0["budget"] == p1["budget"]  # rank 0's measurement, on both
    # rank 1's outlier tripped its amax guard: the site left tensorwise on both ranks, alike
    tripped = {sid for sid, entries in p0["history"].items() if any(by == "amax_guard" for *_, by in entries)}
    assert tripped and p0["history"] == p1["history"]


def check_recompile_on_every_rank(ranks):
    for r in ranks:
        assert r["plans"]["graphs"] >= 2  # the new batch size compiled a graph of its own, on both ranks
    assert ranks[0]["plans"]["final"] == ranks[1]["plans"]["final"]


@pytest.mark.parametrize("form", [*CPU_FORMS, "fsdp2"])
def test_ddp_and_fsdp2_train_as_one_process(ranks, form):
    check_trains_as_one_process(ranks, form, torch.device("cpu"))


def test_probe_window_closes_in_every_ddp_bucket(ranks):
    check_window_in_ddp_buckets(ranks)


@pytest.mark.cuda
def test_nccl_probe_window_closes_in_every_ddp_bucket(nccl_ranks):
    check_window_in_ddp_buckets(nccl_ranks)


def test_ranks_compile_one_plan_on_different_data(ranks):
    check_one_plan(ranks)


def test_recompile_on_every_rank_keeps_collectives_lined_up(ranks):
    check_recompile_on_every_rank(ranks)


@pytest.mark.cuda
@pytest.mark.parametrize("form", [*NCCL_FORMS, "fsdp2"])
def test_nccl_ddp_and_fsdp2_train_as_one_process(nccl_ranks, form):
    check_trains_as_one_process(nccl_ranks, form, torch.device("cuda", 0))


@pytest.mark.cuda
def test_nccl_ranks_compile_one_plan_on_different_data(nccl_ranks):
    check_one_plan(nccl_ranks)


@pytest.mark.cuda
def test_nccl_recompile_on_every_rank_keeps_collectives_lined_up(nccl_ranks):
    check_recompile_on_every_rank(nccl_ranks)


def test_a_saved_plan_serves_every_ddp_bucket_on_every_rank(ranks):
    p0, p1 = ranks[0]["planned_buckets"], ranks[1]["planned_buckets"]
    assert p0["graphs"] == ranks[0]["window_in_buckets"]["graphs"] >= 2  # a graph per bucket, with the plan too
    assert p1["graphs"] == p0["graphs"]
    assert p0["windowless"] and p1["windowless"]  # every bucket's graph ran the plan from its first call
    assert any(fp8 for fp8, *_ in p0["saved"].values())
    assert p0["planned"] == p1["planned"] == p0["saved"]  # the plan's decisions, the same on both ranks
    assert all(torch.isfinite(torch.tensor(p0["losses"] + p1["losses"])))


def test_sparse_embedding_grads_stay_sparse(ranks):
    for r in ranks:
        assert r["sparse"]["sparse_grads"] == [True] * STEPS


def test_rank0_decides_timings_and_failures_for_all(ranks):
    d0, d1 = ranks[0]["decisions"], ranks[1]["decisions"]
    assert d0["timing"] == d1["timing"] and d0["timing"]["bf16_us"] > 0  # rank 0's wall-clock timing, on both
    assert d0["stored"] and not d1["stored"]  # rank 1 measured nothing, stored nothing
    assert d0["raised"] == d1["raised"] == {"emulated": "raised on rank 0"}  # the same exception type on both
    assert d0["merged"] == d1["merged"] == ["site0", "site1"]
    # Under a compile's fake-tensor mode too (the broadcast had failed there, so sites went FP8 untimed).
    assert d0["under_fake"] == d1["under_fake"] and d0["under_fake"]["bf16_us"] > 0
    assert d0["merged_under_fake"] == d1["merged_under_fake"] == [0, 1]


def test_rank0_times_the_graph_speed_check_for_all(ranks):
    g0, g1 = ranks[0]["graph_speed"], ranks[1]["graph_speed"]
    # DDP's graph splitting: one graph per bucket, each timed once, on rank 0; rank 1's timer never ran.
    assert g0["kept"] and g0["timed"] == [False] * len(g0["kept"]) and g1["timed"] == []
    assert g0["kept"] == g1["kept"] == ["high precision"] * len(g0["kept"]) and g0["fp8_sites"] == g1["fp8_sites"] == 0
    assert all(map(torch.isfinite, map(torch.tensor, g0["losses"] + g1["losses"])))
    for p0, p1 in zip(g0["params"], g1["params"]):  # one replica: DDP averaged the same gradients
        torch.testing.assert_close(p0, p1, rtol=1e-6, atol=1e-7)
