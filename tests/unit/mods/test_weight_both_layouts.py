"""The weight_both_layouts Mod: a training weight that FP8 forward GEMMs and FP8 dgrads read
is cast once, in the forward, by loka.quantize_dual_axis, and the backward reads the copy
the forward saved. Graph structure before/after (the forward casts the weight once, the
backward casts no weight), numerics against the Mod off (bit for bit: the same casts) and
fp32, the report, the forms public recsys code writes (sparse EmbeddingBags, a shared
tower, `x @ W` with fp32 master weights under autocast, activation checkpointing with
`dynamic=True`), what it declines, and a failing rewrite; on CUDA, the real kernels with
and without CUDA graphs."""

import copy

import pytest
import torch
import torch.nn as nn

import loka_compile
import loka_compile.inductor_passes
from loka_compile.passes import Decision, Reason
from loka_compile.passes.mods import weight_both_layouts
from loka_compile.passes.find_sites import WEIGHT_BOTH_LAYOUTS, operands
from graphs import cuda_training_with_and_without, fail_second_call, train_step
from numerics import rel_error


class Ranker(nn.Module):
    """Sparse EmbeddingBags -> a tower (Linear, LayerNorm, ReLU, Linear) -> a 1-wide head."""

    def __init__(self, rows=1000, dim=32, hidden=128):
        super().__init__()
        self.users = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.items = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.fc1 = nn.Linear(2 * dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, users, items, offsets):
        x = torch.cat([self.users(users, offsets), self.items(items, offsets)], dim=1)
        return self.head(self.fc2(self.norm(self.fc1(x)).relu()).relu())


def ranker_batch(n=512):
    return torch.randint(0, 1000, (n,)), torch.randint(0, 1000, (n,)), torch.arange(0, n, 2)


def step(model, inputs, mods=(), **options):
    """One training step of a copy of `model` (inputs a tuple), every eligible site FP8:
    (output, dense gradients, report, the Mod's record)."""
    loka_compile.reset()
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", dynamic=options.pop("dynamic", None),
                             options=dict(recipe=options.pop("recipe", "rowwise"), probe_steps=0, speed_check=False,
                                          disabled_mods=mods, **options))
    out = compiled(*inputs)
    out.float().square().mean().backward()
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in model.parameters()]
    return out, grads, loka_compile.report(compiled), \
        loka_compile.state_of(compiled).records[-1].mod_results.get("weight_both_layouts")


def ops_in(report, kind) -> list:
    return [str(n.target) for n in report.graph_modules[f"{report.graphs[0].name}/{kind}"].graph.nodes
            if n.op == "call_function"]


@pytest.fixture(scope="module")
def ranker_runs():
    torch.manual_seed(0)
    model, batch = Ranker().to(torch.bfloat16), ranker_batch()
    on = step(model, batch)
    off = step(model, batch, mods=("weight_both_layouts",))
    return {"model": model, "batch": batch, "on": on, "off": off}


def test_the_forward_casts_each_weight_once_for_both_layouts(ranker_runs):
    report, layouts = ranker_runs["on"][2], ranker_runs["on"][3]
    # fc1 and fc2: forward and dgrad FP8; the head (N = 1) stays in high precision
    assert sorted(sorted(w.sites) for w in layouts.weights) == [
        ["backward/fc1:dgrad#1", "forward/fc1:fwd#1"], ["backward/fc2:dgrad#1", "forward/fc2:fwd#1"]]
    assert [w.outcome for w in layouts.weights] == ["fp8", "fp8"]
    assert ops_in(report, "forward").count("loka.quantize_dual_axis.default") == 2
    assert "loka.quantize_dual_axis.default" not in ops_in(report, "backward")
    assert report.mods["weight_both_layouts"] == 2
    shared = {s.id for s in report.sites if s.casts.get("b") == WEIGHT_BOTH_LAYOUTS}
    assert shared == {"forward/fc1:fwd#1", "forward/fc2:fwd#1", "backward/fc1:dgrad#1", "backward/fc2:dgrad#1"}
    assert report.mods["cached_weights"] == 4


def test_the_backward_reads_the_saved_copies_not_the_weights(ranker_runs):
    """With the Mod off the backward graph takes fc1's and fc2's weights to cast them;
    with it on, their column-scaled FP8 copies instead."""
    report_on, report_off = ranker_runs["on"][2], ranker_runs["off"][2]

    def backward_inputs(report):
        gm = report.graph_modules[f"{report.graphs[0].name}/backward"]
        return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor)]

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    weights = {(128, 64), (64, 128)}
    on, off = backward_inputs(report_on), backward_inputs(report_off)
    assert {tuple(v.shape) for v in on if v.dtype in fp8} >= weights
    assert not {tuple(v.shape) for v in off if v.dtype in fp8} & weights
    assert {tuple(v.shape) for v in off if v.dtype == torch.bfloat16} >= weights
    assert "loka.quantize_dual_axis.default" not in ops_in(report_off, "forward")


def test_the_same_products_as_the_mod_off(ranker_runs):
    out_on, grads_on = ranker_runs["on"][:2]
    out_off, grads_off = ranker_runs["off"][:2]
    assert torch.equal(out_on, out_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    assert all(torch.isfinite(g).all() for g in grads_on)


class SharedTower(nn.Module):
    """Two-tower model whose towers share one MLP, as retrieval models write it."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h))
        self.head = nn.Linear(h, 16)

    def forward(self, u, v):
        return self.head(self.tower(u) * self.tower(v))


def test_a_shared_tower_reads_one_cast_from_all_its_calls():
    """Each call of the shared tower's second layer and each of its dgrads read one cast;
    its first layer, whose inputs need no gradient, has no dgrad: one layout, declined."""
    torch.manual_seed(0)
    model = SharedTower().to(torch.bfloat16)
    u, v = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    on = step(model, (u, v))
    off = step(model, (u, v), mods=("weight_both_layouts",))
    assert sorted(len(w.sites) for w in on[3].weights) == [2, 4]  # the head; tower.2 twice
    assert on[3].declined["one_orientation"] == 2
    assert torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))


class MatmulForm(nn.Module):
    """Weights kept as [K, N] and applied as x @ W, and an fp32 copy of a Linear's."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.fc2 = nn.Linear(h, 32)

    def forward(self, x):
        return self.fc2(torch.relu(x @ self.w1))


def test_x_at_w_with_fp32_master_weights_under_autocast():
    """x @ W (W [K, N]): the forward takes the column-scaled half and the dgrad the
    row-scaled one, the mirror of nn.Linear. Public training code keeps fp32 weights and
    runs the step under bf16 autocast. The
    Mod casts the fp32 parameter, as Inductor's cast fused with the bf16 conversion does in
    the forward (the same output, bit for bit); with the Mod off the backward cast the bf16
    copy the forward saved, one rounding more, so the gradients differ within FP8's error."""
    torch.manual_seed(0)
    model = MatmulForm()
    x = torch.randn(256, 64, requires_grad=True)
    runs = []
    for mods in ((), ("weight_both_layouts",)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(step(model, (x,), mods=mods))
    on, off = runs
    assert len(on[3].weights) == 2
    assert torch.equal(on[0], off[0])
    ref = copy.deepcopy(model)
    ref(x.detach()).square().mean().backward()
    for g_on, g_off, p in zip(on[1], off[1], ref.parameters()):
        assert g_on.dtype == torch.float32 and torch.isfinite(g_on).all()
        assert rel_error(g_on, p.grad) <= 1.25 * rel_error(g_off, p.grad) + 1e-3


class CheckpointedTower(nn.Module):
    def __init__(self, d=64, h=128):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 32)

    def forward(self, x):
        h = self.inp(x).relu()
        h = torch.utils.checkpoint.checkpoint(lambda t: self.mid(t).relu(), h, use_reentrant=False)
        return self.out(h)


def test_checkpointing_with_a_dynamic_batch():
    torch.manual_seed(0)
    model = CheckpointedTower().to(torch.bfloat16)
    x = torch.randn(192, 64, dtype=torch.bfloat16, requires_grad=True)
    on = step(model, (x,), dynamic=True)
    off = step(model, (x,), mods=("weight_both_layouts",), dynamic=True)
    assert not [g.fallback for g in on[2].graphs if g.fallback]
    assert len(on[3].weights) == 3
    assert torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    assert all(torch.isfinite(g).all() for g in on[1])


def test_declines(ranker_runs):
    """Tensorwise scaling (one scale serves both layouts: not this Mod's), the Mod off, and
    the probe window."""
    torch.manual_seed(0)
    model = SharedTower().to(torch.bfloat16)
    u, v = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    tensorwise = step(model, (u, v), recipe="tensorwise")[3]
    assert not tensorwise.weights and tensorwise.declined["scaling"] >= 4
    assert ranker_runs["off"][3] is None
    loka_compile.reset()
    torch._dynamo.reset()
    trained = copy.deepcopy(model)
    compiled = torch.compile(trained, backend="loka", options=dict(recipe="rowwise", probe_steps=1))
    compiled(u, v).float().sum().backward()  # the probe window's call
    assert "weight_both_layouts" not in loka_compile.state_of(compiled).records[-1].mod_results


def test_a_failing_rewrite_leaves_the_joint_graph_as_written(ranker_runs, monkeypatch, caplog):
    fail_second_call(monkeypatch, weight_both_layouts, "insert_traced")
    out, grads, report, layouts = step(ranker_runs["model"], ranker_runs["batch"])
    assert "weight_both_layouts Mod failed on the joint graph" in caplog.text
    assert layouts is None and report.mods["weight_both_layouts"] == 0
    assert not [s for s in report.sites if s.casts.get("b") == WEIGHT_BOTH_LAYOUTS]
    assert all(torch.equal(a, b) for a, b in zip(grads, ranker_runs["off"][1]))
    fail_second_call(monkeypatch, weight_both_layouts, "insert_traced")
    with pytest.raises(Exception, match="injected"):
        step(ranker_runs["model"], ranker_runs["batch"], fallback=False)


def test_a_gemm_then_kept_in_high_precision_reads_the_weight_as_written(ranker_runs, monkeypatch):
    """The joint graph's decision took the dgrads for FP8, the backward graph's keeps them
    in high precision (where the speed check's timings differ): they read the weights
    themselves, not the FP8 copies, and their gradients are bf16's."""
    decide = loka_compile.inductor_passes._decide

    def keep_shared_dgrads_high_precision(site, **kwargs):
        if site.role.value == "dgrad" and weight_both_layouts.is_weight_layout(operands(site.node)[1]):
            return Decision(fp8=False, reason=Reason.SLOWER_THAN_BF16, detail="forced by the test")
        return decide(site, **kwargs)

    monkeypatch.setattr(loka_compile.inductor_passes, "_decide", keep_shared_dgrads_high_precision)
    _, grads, report, layouts = step(ranker_runs["model"], ranker_runs["batch"])
    dgrads = {s.module: s for s in report.sites if s.role == "dgrad"}
    assert not dgrads["fc1"].fp8 and not dgrads["fc2"].fp8
    assert len(layouts.weights) == 2
    assert "loka.dequantize_weight_layout.default" not in ops_in(report, "backward")
    assert not dgrads["fc1"].casts and not dgrads["fc2"].casts
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_one_weight_cast_per_step(mode):
    """On an FP8 GPU: the dual-axis Triton kernels cast each weight in the forward, the
    dgrads read the saved copies on a real provider, under CUDA graphs too, and the
    products are those of the Mod off."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.ReLU(), nn.Linear(512, 256))
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    runs = cuda_training_with_and_without(model, x, "weight_both_layouts", mode)
    (out_on, on, report), (out_off, off, _) = runs["on"], runs["off"]
    shared = [s for s in report.sites if s.casts.get("b") == WEIGHT_BOTH_LAYOUTS]
    assert {(s.module, s.role) for s in shared} == {("0", "fwd"), ("3", "fwd"), ("0", "dgrad"), ("3", "dgrad")}
    assert all(s.fp8 and not s.provider.startswith("emulated") for s in shared)
    # The Triton kernel rounds as the eager reference; Inductor's compiled cast of the Mod
    # off may differ in a code or two per weight (benchmarks/weight_casts.py counts them):
    # judged against fp32, as precise as the Mod off.
    ref = copy.deepcopy(model).float()
    x_ref = x.detach().float().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.square().mean().backward()
    assert rel_error(out_on.float(), out_ref) <= 1.25 * rel_error(out_off.float(), out_ref) + 1e-3
    for g_on, g_off, g_ref in zip(on, off, [p.grad for p in ref.parameters()] + [x_ref.grad]):
        assert torch.isfinite(g_on).all()
        assert rel_error(g_on.float(), g_ref) <= 1.25 * rel_error(g_off.float(), g_ref) + 1e-3
