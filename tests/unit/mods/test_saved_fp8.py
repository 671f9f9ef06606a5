"""The saved_fp8 Mod: activations that backward FP8 GEMMs read are cast in the forward (joint
graph), so the partitioner saves their FP8 copies. What the backward GEMMs read, what the
forward keeps for the backward, gradients against the Mod off and fp32, attention's batched
dgrads under the default recipe, the cases it declines, the probe window, dynamic batch, a
sparse-embedding ranker, activation checkpointing, a failing rewrite, and a site the backward
keeps in high precision; on CUDA, real providers with and without CUDA graphs."""

import copy

import pytest
import torch
import torch.nn as nn

import loka_compile
import loka_compile.inductor_passes
from loka_compile.passes import Decision, Reason
from loka_compile.passes.mods import saved_fp8
from loka_compile.passes.find_sites import SAVED_IN_FP8, operands, saved_operand
from graphs import cuda_training_with_and_without, train_step
from numerics import rel_error

# What the forward keeps, measured with the weight_both_layouts Mod off (it keeps the weights'
# FP8 copies for the backward too): this file measures saved_fp8 alone.
ALONE = ("weight_both_layouts",)

class Tower(nn.Module):
    """Linear -> LayerNorm -> Linear -> ReLU -> Linear -> Linear: X of each weight gradient is
    a LayerNorm output (recomputable from its saved statistics), a ReLU output (whose
    backward reads it) and a GEMM output (saved as it is)."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.inp = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.mid = nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.out = nn.Linear(h, 32)

    def forward(self, x):
        return self.out(self.proj(self.mid(self.norm(self.inp(x))).relu()))


def fp32_grads(model, x):
    model = copy.deepcopy(model).float()
    model(x.float()).square().mean().backward()
    return [p.grad for p in model.parameters()]


def fp8_inputs(report, kind):
    gm = report.graph_modules[f"{report.graphs[0].name}/{kind}"]
    return [n.name for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]


def record(report):
    return report.mod_results["saved_fp8"][-1]


@pytest.fixture
def tower():
    return Tower().to(torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tower_runs():
    """One training step of the Tower with the Mod on and off, and fp32 gradients: shared by
    the tests that read them (each compile costs seconds)."""
    torch.manual_seed(0)
    model, x = Tower().to(torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    on = train_step(model, x, mods=ALONE)
    saved = record(on[2])
    off = train_step(model, x, mods=ALONE + ("saved_fp8",))
    return {"model": model, "x": x, "ref": fp32_grads(model, x), "on": on, "saved": saved, "off": off}


def test_wgrads_read_the_forwards_fp8_copies(tower_runs):
    _, _, report = tower_runs["on"]
    saved = tower_runs["saved"]
    wgrads = {s.module: s for s in report.sites if s.role == "wgrad"}
    assert all(s.fp8 for s in wgrads.values())
    # X of mid and out is read by GEMMs only; proj's (a ReLU output) also by the ReLU's
    # backward, so it stays saved whatever; inp's is the model's input
    assert {m for m, s in wgrads.items() if s.casts["b"] == SAVED_IN_FP8} == {"mid", "out"}
    assert wgrads["inp"].casts["b"].startswith("standalone (graph input")
    assert wgrads["proj"].casts["b"] == "standalone (graph input relu)"
    assert report.mods["saved_fp8"] == 2
    assert dict(saved.declined) == {"graph_input": 4, "read_by_other_ops": 1}
    # proj's output (a GEMM's) is kept as its FP8 copy; the LayerNorm output is no longer
    # kept: the backward recomputes it from the statistics its own backward keeps, and casts it
    outcomes = {o.site.split("/")[1].split(":")[0]: o.outcome for o in saved.operands}
    assert outcomes == {"out": "fp8", "mid": "recomputed"}
    assert fp8_inputs(report, "backward")


def test_the_forward_keeps_less_for_the_backward(tower_runs):
    on, off = tower_runs["on"][2], tower_runs["off"][2]
    assert off.mods["saved_fp8"] == 0
    assert 0 < on.mods["saved_for_backward_bytes"] < off.mods["saved_for_backward_bytes"]


def test_gradients_match_the_mod_off_and_fp32(tower_runs):
    (out_on, on, _), (out_off, off, _), ref = tower_runs["on"], tower_runs["off"], tower_runs["ref"]
    # Inductor may fuse a GEMM's bias add with the new cast and hand the forward's next cast
    # the fp32 sum instead of its bf16 rounding: a few FP8 values round apart
    assert rel_error(out_on.float(), out_off.float()) < 0.02
    for g_on, g_off, g_ref in zip(on, off, ref):
        assert torch.isfinite(g_on).all()
        # the same casts feed the same GEMMs; the partitioner may keep the LayerNorm's
        # statistics in another precision, which moves the rounding of its backward
        assert rel_error(g_on.float(), g_ref) <= 1.25 * rel_error(g_off.float(), g_ref) + 1e-3


def test_a_gemm_output_is_kept_as_its_fp8_copy():
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64)).to(torch.bfloat16)
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    ref = fp32_grads(model, x)
    _, on, report = train_step(model, x, mods=ALONE)
    assert [o.outcome for o in record(report).operands] == ["fp8"]
    _, off, report_off = train_step(model, x, mods=ALONE + ("saved_fp8",))
    assert report.mods["saved_fp8"] == 1
    assert len(fp8_inputs(report, "backward")) == 1 and not fp8_inputs(report_off, "backward")
    # the first layer's output, kept in FP8 (1 byte) with its 128 column scales instead of bf16
    assert report.mods["saved_for_backward_bytes"] == 128 * 128 + 128 * 4
    assert report_off.mods["saved_for_backward_bytes"] == 128 * 128 * 2
    # the same cast, but Inductor may hand it the bias add's fp32 sum rather than its bf16
    # rounding: a few FP8 values round apart
    for g_on, g_off, g_ref in zip(on, off, ref):
        assert rel_error(g_on.float(), g_off.float()) < 0.02
        assert rel_error(g_on.float(), g_ref) <= 1.25 * rel_error(g_off.float(), g_ref) + 1e-3


class Attention(nn.Module):
    """Self-attention over a sequence, with the bmm's written out: the dgrads of q @ k^T and
    p @ v read activations (k, q, v) that only GEMMs read, and p, which softmax's
    backward reads too."""

    def __init__(self, d=64):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        p = torch.softmax(q @ k.transpose(1, 2) / 8.0, dim=-1)
        return self.out(p @ v)


# Attention, CPU (emulated FP8), default recipe: gradients' relative errors against fp32
# measured 0.017-0.038, the same with the Mod off; floor with margin:
ATTENTION_GRAD_REL_ERROR = 0.06


def test_default_recipe_saves_the_activation_operands_of_batched_dgrads():
    model = Attention().to(torch.bfloat16)
    x = torch.randn(8, 32, 64, dtype=torch.bfloat16)
    ref = fp32_grads(model, x)
    _, on, report = train_step(model, x, recipe="default")
    saved = sorted((s.name, which) for s in report.sites for which, c in s.casts.items() if c == SAVED_IN_FP8)
    # the default recipe keeps weight gradients bf16: only the bmm's dgrads read FP8 copies
    assert all(not s.fp8 for s in report.sites if s.role == "wgrad")
    assert len(saved) == 3 and all(name.split(":")[1].startswith("dgrad") for name, _ in saved)
    assert all(o.outcome == "fp8" for o in record(report).operands)
    assert record(report).declined["read_by_other_ops"] >= 1  # p, which softmax's backward reads
    for g_on, g_ref in zip(on, ref):
        assert rel_error(g_on.float(), g_ref) <= ATTENTION_GRAD_REL_ERROR


class Reused(nn.Module):
    """h feeds a linear and is read again by the backward of h * h."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h * h


def test_an_activation_the_backward_reads_anyway_is_declined():
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    _, _, report = train_step(Reused().to(torch.bfloat16), x)
    assert record(report).declined["read_by_other_ops"] == 1
    assert report.mods["saved_fp8"] == 0


def test_padded_operands_are_declined():
    model = nn.Sequential(nn.Linear(64, 72), nn.Linear(72, 32)).to(torch.bfloat16)
    _, _, report = train_step(model, torch.randn(64, 64, dtype=torch.bfloat16))
    assert record(report).declined["padded"] >= 1
    assert report.mods["saved_fp8"] == 0


def test_nothing_is_rewritten_in_the_probe_window(tower):
    model, x = tower
    loka_compile.reset()
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options=dict(recipe="rowwise", probe_steps=2, speed_check=False))
    for step in range(3):
        compiled(x).float().square().mean().backward()
        if step == 0:
            assert loka_compile.report(compiled).mods["saved_fp8"] == 0  # the probe variant
    report = loka_compile.report(compiled)
    assert report.graphs[0].phase == "fp8"
    assert report.mods["saved_fp8"] == 2


def test_dynamic_batch(tower_runs):
    model, x, ref = tower_runs["model"], tower_runs["x"], tower_runs["ref"]
    _, grads, report = train_step(model, x, dynamic=True)
    assert report.mods["saved_fp8"] == 2
    for g, g_static, g_ref in zip(grads, tower_runs["on"][1], ref):
        assert rel_error(g.float(), g_ref) <= 1.25 * rel_error(g_static.float(), g_ref) + 1e-3


class SparseRanker(nn.Module):
    """Public-style ranker: sparse EmbeddingBags, a shared tower over user and item, a
    dot interaction."""

    def __init__(self, rows=1000, d=64):
        super().__init__()
        self.user = nn.EmbeddingBag(rows, d, mode="sum", sparse=True)
        self.item = nn.EmbeddingBag(rows, d, mode="sum", sparse=True)
        self.tower = nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64))
        self.head = nn.Linear(64, 16)

    def forward(self, users, items, offsets):
        u = self.tower(self.user(users, offsets))
        v = self.tower(self.item(items, offsets))
        return self.head(u * v)


def test_sparse_ranker_with_a_shared_tower():
    torch.manual_seed(0)
    model = SparseRanker().to(torch.bfloat16)
    users, items = torch.randint(0, 1000, (512,)), torch.randint(0, 1000, (512,))
    offsets = torch.arange(0, 512, 4)
    loka_compile.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="loka", options=dict(recipe="rowwise", probe_steps=0, speed_check=False))
    compiled(users, items, offsets).float().square().mean().backward()
    report = loka_compile.report(compiled)
    assert not [g.fallback for g in report.graphs if g.fallback]
    assert report.mods["saved_fp8"] >= 1
    assert all(torch.isfinite(p.grad.to_dense() if p.grad.is_sparse else p.grad).all() for p in model.parameters())


def test_a_site_then_kept_in_high_precision_says_what_it_reads(tower, monkeypatch, caplog):
    """The joint graph's decision took a site for FP8, the backward graph's kept it in
    high precision (where the speed check's timings differ): the GEMM reads the FP8 copy,
    and the report and the log say so."""
    model, x = tower
    decide = loka_compile.inductor_passes._decide

    def keep_saved_sites_high_precision(site, **kwargs):
        a, b, _, _ = operands(site.node)
        if saved_operand(b) is not None:
            return Decision(fp8=False, reason=Reason.SLOWER_THAN_BF16, detail="forced by the test")
        return decide(site, **kwargs)

    monkeypatch.setattr(loka_compile.inductor_passes, "_decide", keep_saved_sites_high_precision)
    ref = fp32_grads(model, x)
    _, grads, report = train_step(model, x)
    kept = {s.module: s for s in report.sites if s.role == "wgrad" and not s.fp8}
    assert {"mid", "out"} <= set(kept)
    assert kept["out"].casts["b"].startswith("dequantized FP8 copy saved by the forward")
    assert "runs in high precision on the FP8 copy" in caplog.text
    assert all(rel_error(g.float(), r) < 0.2 for g, r in zip(grads, ref))


class CheckpointedTower(Tower):
    """Tower whose middle runs under activation checkpointing, as public models write it."""

    def forward(self, x):
        h = self.norm(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: self.proj(self.mid(t).relu()), h, use_reentrant=False)
        return self.out(h)


def test_activation_checkpointing(tower_runs):
    model = CheckpointedTower().to(torch.bfloat16)
    model.load_state_dict(tower_runs["model"].state_dict())
    _, grads, report = train_step(model, tower_runs["x"])
    assert not [g.fallback for g in report.graphs if g.fallback]
    assert report.mods["saved_fp8"] >= 1
    # against the same weights without checkpointing, the Mod off
    for g, g_off, g_ref in zip(grads, tower_runs["off"][1], tower_runs["ref"]):
        assert torch.isfinite(g).all()
        assert rel_error(g.float(), g_ref) <= 1.25 * rel_error(g_off.float(), g_ref) + 1e-3


def test_a_failing_rewrite_leaves_the_joint_graph_as_written(tower_runs, monkeypatch, caplog):
    model, x = tower_runs["model"], tower_runs["x"]
    real = saved_fp8.save_fp8_operands

    def fail_after_rewriting(found, fused_casts, result):
        real(found, fused_casts, result)
        raise RuntimeError("injected")

    monkeypatch.setattr(loka_compile.inductor_passes, "save_fp8_operands", fail_after_rewriting)
    _, grads, report = train_step(model, x)
    assert "saved_fp8 Mod failed on the joint graph" in caplog.text
    assert report.mods["saved_fp8"] == 0
    assert all(s.casts.get("b") != SAVED_IN_FP8 for s in report.sites)
    assert all(torch.equal(g, g_off) for g, g_off in zip(grads, tower_runs["off"][1]))
    with pytest.raises(Exception, match="injected"):
        train_step(model, x, fallback=False)



@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_backward_reads_the_saved_fp8_copy(mode):
    """On an FP8 GPU: the backward GEMM runs on a real provider from the FP8 copy the
    forward kept, under CUDA graphs too, and trains as the Mod off does."""
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 256))
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    ref = fp32_grads(model, x)
    runs = cuda_training_with_and_without(model, x, "saved_fp8", mode)
    (_, on, report), (_, off, report_off) = runs["on"], runs["off"]
    saved = [s for s in report.sites if SAVED_IN_FP8 in s.casts.values()]
    assert {s.module for s in saved} == {"1", "3"}
    assert all(s.fp8 and not s.provider.startswith("emulated") for s in saved)
    assert report.mods["saved_for_backward_bytes"] < report_off.mods["saved_for_backward_bytes"]
    for g_on, g_off, g_ref in zip(on, off, ref):
        assert torch.isfinite(g_on).all()
        assert rel_error(g_on.float(), g_ref) <= 1.25 * rel_error(g_off.float(), g_ref) + 1e-3
