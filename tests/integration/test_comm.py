"""FP8 gradient communication (`loka_compile.fp8_gradient_comm`), two ranks: the exchange's
numerics against the fp64 mean, DDP (both forms, with loka-compiled models) and FSDP2 training
with FP8 gradients against the same training with high-precision collectives, the window's
decision the same on every rank, a budget of 0 keeping high precision (bit for bit the plain
DDP run), and the bytes counted. On CPU over gloo, and, marked `cuda`, over NCCL on two GPUs
(eager models there: the exchange's Triton cast and its side stream are what differ).

The ranks run once per module and backend (`ranks`, `nccl_ranks`); each test checks a scenario."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import loka_compile
from loka_compile import comm
from numerics import rel_error
from spawn_ranks import run_ranks

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 300
STEPS = 7
WINDOW = 2  # measured calls per bucket (after its first, a warm-up; DDP's rebuilt buckets may warm up again)
FP8_STEP = WINDOW + 2  # a step every bucket runs in FP8
BATCH = 16  # per rank
# One e4m3 rounding with a scale per 128 elements adds ~0.026 relative error to a reduced bucket
# (measured: 0.026 after the all-to-all alone, `gather="bf16"`; 0.037 with the e4m3 all-gather's
# second rounding, on 1000 and 70000 random elements). The floors leave 2x that.
EXCHANGE_FLOOR = {"e4m3": 0.075, "bf16": 0.055}
# Training: the first FP8 step's gradients carry the exchange's error (the same floor); the
# parameters' total updates after STEPS steps, of which 3 in FP8, carry less of it.
GRAD_REL_ERROR_FLOOR = EXCHANGE_FLOOR["e4m3"]
UPDATE_REL_ERROR_FLOOR = 0.05
LOSS_REL_ERROR_FLOOR = 0.01
FP8_ONLY = {"speed_check": False, "window_steps": WINDOW}


class Mlp(nn.Module):
    """Its 1 MB middle layer puts the gradients in two DDP buckets (buckets of 1 MB)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.mid, self.fc2 = nn.Linear(32, 512), nn.Linear(512, 512), nn.Linear(512, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.mid(torch.relu(self.fc1(x)))))


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1, self.b2, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.head(torch.relu(self.b2(torch.relu(self.b1(x)))))


def on_cpu(tensors):
    return [t.detach().cpu().clone() for t in tensors]


def decisions_of(gradient_comm):
    return {k: (d.fp8, d.reason.value, d.error_bound, d.high_precision_us, d.fp8_us, d.detail)
            for k, d in gradient_comm.decisions.items()}


def train(model, forward, device, rank, on_step=None):
    """SGD on STEPS fresh random batches of this rank, `on_step()` before each: the losses, and
    the gradients of step FP8_STEP."""
    data = torch.Generator().manual_seed(100 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(STEPS):
        if on_step is not None:
            on_step()
        x, y = torch.randn(BATCH, 32, generator=data).to(device), torch.randn(BATCH, 16, generator=data).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        if step == FP8_STEP:
            grads = on_cpu(p.grad if not hasattr(p.grad, "full_tensor") else p.grad.full_tensor()
                           for p in model.parameters())
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


def _exchange(rank, device):
    """fp8_all_reduce and fp8_reduce_scatter on fresh random data, against the fp64 mean/sum."""
    data = torch.Generator().manual_seed(7 + rank)
    out = {}
    for numel in (1000, 4099):  # one not a multiple of the block or of the ranks
        x = (torch.randn(numel, generator=data) * 10.0 ** (rank - 1)).to(device)
        everyone = [torch.empty_like(x) for _ in range(WORLD_SIZE)]
        dist.all_gather(everyone, x)
        mean = torch.stack(everyone).double().mean(0)
        for gather in comm.GATHER_FORMATS:
            value = comm.fp8_all_reduce(x.clone(), None, 128, gather)
            out[(numel, gather)] = (rel_error(mean, value), value.cpu())
    chunks = torch.randn(WORLD_SIZE * 300, generator=data).to(device)
    everyone = [torch.empty_like(chunks) for _ in range(WORLD_SIZE)]
    dist.all_gather(everyone, chunks)
    mine = torch.stack(everyone).double().sum(0).view(WORLD_SIZE, 300)[rank]
    value = comm.fp8_reduce_scatter(torch.empty(300, device=device), chunks, None, 128, average=False)
    out["reduce_scatter"] = rel_error(mine, value)
    bad = torch.randn(1000, generator=data).to(device)
    if rank == 1:
        bad[5] = float("nan")
    else:
        bad[300] = float("inf")
    out["non_finite"] = comm.fp8_all_reduce(bad, None, 128, "e4m3").cpu()
    return out


def _ddp(rank, device):
    """DDP(loka-compiled model) with high-precision all-reduce, against torch.compile(DDP(model))
    with FP8 gradients; eager DDP runs with max_error 0 and with the speed check."""
    ids = [device.index] if device.type == "cuda" else None
    compiled = device.type == "cpu"  # on GPUs the exchange is what is under test (loka's compiles take minutes)
    out = {}
    for run in ("reference", "fp8", "eager_reference", "budget_zero", "speed_checked"):
        torch._dynamo.reset()
        loka_compile.reset()
        torch.manual_seed(0)
        model = Mlp().to(device)
        initial = on_cpu(model.parameters())
        loka = compiled and run in ("reference", "fp8")
        options = {"probe_steps": 0}
        if run == "fp8" and loka:
            forward = torch.compile(nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1),
                                    backend="loka", options=options)
        else:
            inner = torch.compile(model, backend="loka", options=options) if loka else model
            forward = nn.parallel.DistributedDataParallel(inner, device_ids=ids, bucket_cap_mb=1)
        settings = {"fp8": FP8_ONLY, "budget_zero": {**FP8_ONLY, "max_error": 0},
                    "speed_checked": {"window_steps": WINDOW}}.get(run)
        handle = loka_compile.fp8_gradient_comm(forward, **settings) if settings is not None else None
        sent = []  # the bytes sent so far, at the start of each step
        losses, grads = train(model, forward, device, rank, (lambda: sent.append(dict(handle.sent))) if handle else None)
        out[run] = {"initial": initial, "params": on_cpu(model.parameters()), "losses": losses, "grads": grads,
                    "decisions": decisions_of(handle) if handle else None, "sent": sent,
                    "final_sent": dict(handle.sent) if handle else None,
                    "plan_bytes": handle.wire_bytes_per_step() if handle else None,
                    "numels": {k: d.numel for k, d in handle.decisions.items()} if handle else None,
                    "text": str(handle) if handle else "",
                    "report": str(loka_compile.report(forward)) if loka and handle else None}
    return out


def _fsdp2(rank, device):
    """FSDP2 with FP8 reduce-scatter against its default one; each rank's window sees its own
    gradient chunks, so the ranks' measured errors differ and the merge must agree."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for run in ("reference", "fp8"):
        torch.manual_seed(0)
        model = BlockNet().to(device)
        initial = on_cpu(model.parameters())
        for block in (model.b1, model.b2):
            fully_shard(block)
        fully_shard(model)
        handle = loka_compile.fp8_gradient_comm(model, **FP8_ONLY) if run == "fp8" else None
        losses, grads = train(model, model, device, rank)
        out[run] = {"initial": initial, "params": on_cpu(p.full_tensor() for p in model.parameters()),
                    "losses": losses, "grads": grads, "decisions": decisions_of(handle) if handle else None,
                    "sent": dict(handle.sent) if handle else None}
    return out


def _overflow(rank, device):
    """A loss-scaling overflow on rank 1 at step 2, in every bucket's window (measured: steps 1-2,
    or 2-3 where DDP's rebuilt buckets warm up again): its gradients (so the all-reduced ones)
    are inf and the step is skipped, as a loss scaler skips it. That call counts towards the
    window but not the bound."""
    ids = [device.index] if device.type == "cuda" else None
    torch.manual_seed(0)
    model = Mlp().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=1)
    handle = loka_compile.fp8_gradient_comm(ddp, **FP8_ONLY)
    data = torch.Generator().manual_seed(100 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(FP8_STEP + 1):
        x, y = torch.randn(BATCH, 32, generator=data).to(device), torch.randn(BATCH, 16, generator=data).to(device)
        optimizer.zero_grad(set_to_none=True)
        scale = math.inf if (step == 2 and rank == 1) else 1.0
        (F.mse_loss(ddp(x), y) * scale).backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            optimizer.step()
    return {"decisions": decisions_of(handle), "calls": {k: d.calls for k, d in handle.decisions.items()},
            "params_finite": all(torch.isfinite(p).all().item() for p in model.parameters())}


def _rank(rank, backend):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    return {"exchange": _exchange(rank, device), "ddp": _ddp(rank, device), "fsdp2": _fsdp2(rank, device),
            "overflow": _overflow(rank, device)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    store = tmp_path_factory.mktemp("comm_ranks")
    return run_ranks(_rank, ("gloo",), WORLD_SIZE, JOIN_TIMEOUT_S, store)


@pytest.fixture(scope="module")
def nccl_ranks(tmp_path_factory):
    if torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"needs {WORLD_SIZE} GPUs for NCCL ranks, found {torch.cuda.device_count()}")
    store = tmp_path_factory.mktemp("comm_nccl_ranks")
    return run_ranks(_rank, ("nccl",), WORLD_SIZE, JOIN_TIMEOUT_S, store, backend="nccl")


# ------------------------------------------------------------------ checks shared by gloo and NCCL


def check_exchange(ranks):
    e0, e1 = ranks[0]["exchange"], ranks[1]["exchange"]
    for numel in (1000, 4099):
        for gather in comm.GATHER_FORMATS:
            error, value = e0[(numel, gather)]
            assert 0 < error <= EXCHANGE_FLOOR[gather], (numel, gather, error)
            assert torch.equal(value, e1[(numel, gather)][1])  # every rank holds the same result
    for e in (e0, e1):
        assert 0 < e["reduce_scatter"] <= EXCHANGE_FLOOR["bf16"], e["reduce_scatter"]
    bad = e0["non_finite"]
    assert torch.equal(bad.nan_to_num(), e1["non_finite"].nan_to_num())
    assert bad[:128].isnan().all()  # a NaN spoils its own block of 128, on every rank
    assert bad[300] == math.inf and not bad[128:].isnan().any()  # an infinity stays one, no NaN made
    assert torch.isfinite(bad[384:]).all()


def check_trains_like_high_precision(run_ref, run_fp8, floor_grad=GRAD_REL_ERROR_FLOOR):
    for ref, fp8 in zip(run_ref["grads"], run_fp8["grads"]):
        error = rel_error(ref, fp8)
        assert 0 < error <= floor_grad, error  # FP8 really ran, within the floor
    for ref, fp8, start in zip(run_ref["params"], run_fp8["params"], run_ref["initial"]):
        assert rel_error(ref - start, fp8 - start) <= UPDATE_REL_ERROR_FLOOR
    assert abs(run_fp8["losses"][-1] / run_ref["losses"][-1] - 1) <= LOSS_REL_ERROR_FLOOR


def check_ddp(ranks):
    d0, d1 = ranks[0]["ddp"], ranks[1]["ddp"]
    check_trains_like_high_precision(d0["reference"], d0["fp8"])
    for p0, p1 in zip(d0["fp8"]["params"], d1["fp8"]["params"]):
        assert torch.equal(p0, p1)  # the replicas stay identical
    decisions = d0["fp8"]["decisions"]
    assert len(decisions) >= 2 and decisions == d1["fp8"]["decisions"]
    assert all(fp8 and reason == "fp8" and bound <= comm.CommOptions().max_error
               for fp8, reason, bound, *_ in decisions.values()), decisions
    if d0["fp8"]["report"] is not None:  # loka's report of the compiled DDP model names the decisions
        assert f"FP8 gradient all-reduce: {len(decisions)} of {len(decisions)} bucket(s) in FP8" in d0["fp8"]["report"]


def check_budget_zero(ranks):
    d0, d1 = ranks[0]["ddp"], ranks[1]["ddp"]
    for r in (d0, d1):
        zero = r["budget_zero"]
        assert zero["decisions"] and all(not fp8 and reason == "over_error_budget" and "> max_error 0" in detail
                                         for fp8, reason, *_, detail in zero["decisions"].values())
        for a, b in zip(zero["params"], r["eager_reference"]["params"]):
            assert torch.equal(a, b)  # high precision throughout: bit for bit the plain DDP run
    assert d0["budget_zero"]["decisions"] == d1["budget_zero"]["decisions"]
    assert "0 of" in d0["budget_zero"]["text"]


def check_speed_checked(ranks):
    d0, d1 = ranks[0]["ddp"]["speed_checked"], ranks[1]["ddp"]["speed_checked"]
    assert d0["decisions"] == d1["decisions"]  # rank 0's timings decide for both
    for fp8, reason, bound, hp_us, fp8_us, detail in d0["decisions"].values():
        assert hp_us > 0 and fp8_us > 0 and bound <= comm.CommOptions().max_error
        assert reason == ("fp8" if fp8 else "not_faster") and (fp8 == (hp_us / fp8_us >= 1.05)), detail


def check_bytes(ranks):
    run = ranks[0]["ddp"]["fp8"]
    first, last = run["sent"][FP8_STEP], run["final_sent"]  # from the start of step FP8_STEP to the end
    steps = STEPS - FP8_STEP
    chunk = {k: comm.chunk_elements(n, WORLD_SIZE, 128) for k, n in run["numels"].items()}
    packed = sum(WORLD_SIZE * (c + 4 * c // 128) for c in chunk.values())  # e4m3 bytes + one fp32 scale a block
    assert last["all_to_all"] - first["all_to_all"] == steps * packed
    assert last["all_gather"] - first["all_gather"] == steps * packed
    assert last["all_reduce"] == first["all_reduce"]  # no high-precision all-reduce once decided
    plan = run["plan_bytes"]
    # fp32 ring all-reduce: 2 (W-1)/W x 4 bytes an element; FP8 both ways: 2 (W-1)/W x (1 + 4/128)
    assert plan["fp8_plan"] / plan["high_precision"] == pytest.approx((1 + 4 / 128) / 4, rel=0.01)
    fsdp = ranks[0]["fsdp2"]["fp8"]["sent"]
    assert fsdp["all_to_all"] > 0 and fsdp["all_gather"] == 0  # FSDP2: the reduce-scatter half alone


def check_fsdp2(ranks):
    f0, f1 = ranks[0]["fsdp2"], ranks[1]["fsdp2"]
    check_trains_like_high_precision(f0["reference"], f0["fp8"])
    decisions = f0["fp8"]["decisions"]
    assert set(decisions) == {"b1", "b2", "root"} and decisions == f1["fp8"]["decisions"]
    assert all(fp8 for fp8, *_ in decisions.values()), decisions


def check_overflow(ranks):
    o0, o1 = ranks[0]["overflow"], ranks[1]["overflow"]
    assert o0["decisions"] == o1["decisions"] and o0["params_finite"]
    assert all(fp8 for fp8, *_ in o0["decisions"].values()), o0["decisions"]
    assert set(o0["calls"].values()) == {WINDOW - 1}, o0["calls"]  # the overflow's call not in the bound


# ------------------------------------------------------------------ gloo, 2 CPU processes

@pytest.mark.slow
def test_exchange_matches_fp64_mean_on_every_rank(ranks):
    check_exchange(ranks)


@pytest.mark.slow
def test_ddp_fp8_gradients_train_like_high_precision_with_one_decision(ranks):
    check_ddp(ranks)


@pytest.mark.slow
def test_budget_zero_keeps_high_precision_with_the_reason(ranks):
    check_budget_zero(ranks)


@pytest.mark.slow
def test_speed_check_decides_by_rank0_timings(ranks):
    check_speed_checked(ranks)


@pytest.mark.slow
def test_bytes_counted_per_collective(ranks):
    check_bytes(ranks)


@pytest.mark.slow
def test_fsdp2_fp8_reduce_scatter_trains_like_high_precision(ranks):
    check_fsdp2(ranks)


@pytest.mark.slow
def test_overflow_in_the_window_counts_but_does_not_bound(ranks):
    check_overflow(ranks)


# ------------------------------------------------------------------ NCCL, 2 GPUs


@pytest.mark.cuda
@pytest.mark.parametrize("check", [check_exchange, check_ddp, check_budget_zero, check_speed_checked, check_bytes,
                                   check_fsdp2, check_overflow], ids=lambda f: f.__name__)
def test_nccl(nccl_ranks, check):
    check(nccl_ranks)


# ------------------------------------------------------------------ one process


def test_options_are_validated():
    for bad in ({"max_error": -1}, {"max_error": math.nan}, {"window_steps": 1}, {"block": 100},
                {"gather": "e5m2"}, {"speed_check": 1}, {"min_speedup": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            comm.CommOptions(**bad)
    with pytest.raises(ValueError, match="unknown fp8_gradient_comm options"):
        loka_compile.fp8_gradient_comm(nn.Linear(4, 4), blocks=128)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        loka_compile.fp8_gradient_comm(nn.Linear(4, 4))


def test_wire_bytes():
    # 1000 fp32 elements on 4 ranks, blocks of 128: chunks of 256 (1000 / 4 rounded up to blocks),
    # 256 FP8 bytes + 2 scales of 4 bytes each; a ring sends 3/4 of each payload.
    hp, fp8 = comm.wire_bytes("all_reduce", 1000, 4, 4, 128, "e4m3")
    assert (hp, fp8) == (round(2 * 0.75 * 4000), round(0.75 * 4 * 2 * 264))
    hp, fp8 = comm.wire_bytes("all_reduce", 1000, 4, 4, 128, "bf16")
    assert fp8 == round(0.75 * 4 * (264 + 512))
    hp, fp8 = comm.wire_bytes("reduce_scatter", 1000, 4, 4, 128, "e4m3")
    assert (hp, fp8) == (3000, round(0.75 * 4 * 264))


def test_packed_bytes_are_the_reference_cast():
    """The bytes sent are the e4m3 cast with one scale per block, read back bit for bit."""
    from loka_compile.kernels.quantize import Fp8Format, dequantize, quantize_along

    chunks = torch.randn(3, 256) * torch.tensor([[1e-3], [1.0], [1e3]])
    chunks[1, 7] = float("nan")
    packed = comm._pack(chunks, 128)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2 * (128 + 4))
    q, scale = quantize_along(chunks.reshape(-1, 128), -1, Fp8Format.E4M3)
    expected = dequantize(q, scale).view(3, 256)
    assert torch.equal(comm._unpack(packed, 256, 128).nan_to_num(), expected.nan_to_num())
    assert comm._unpack(packed, 256, 128)[1, :128].isnan().all()
