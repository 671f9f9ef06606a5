"""The transposed_linear Mod: a linear of x.transpose(1, 2) computed as W @ x. The Dynamo
graph pass (each spelling of the transpose, and the cases it declines), numerics of the
compiled model with the Mod on against it off, roles of the new batched sites, dynamic
batch, activation checkpointing, a failing rewrite, public-style rankers and the zoo's Wukong
layer; on CUDA, the Triton FP8 GEMM on the broadcast weight."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import loka_compile
from loka_compile.passes.mods.transposed_linear import rewrite_transposed_linears
from graphs import dynamo_graph, fail_second_call, loka_and_eager_grads
from numerics import rel_error, sqnr_db

LINEARS = (torch._C._nn.linear, F.linear)


def linear_count(gm):
    return sum((n.op == "call_function" and n.target in LINEARS)
               or (n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear))
               for n in gm.graph.nodes)


def bmm_count(gm):
    return sum(n.op == "call_function" and n.target is torch.bmm for n in gm.graph.nodes)


class FeatureMix(nn.Module):
    """Linears over the feature axis (n) of x [B, n, d], written as models write them."""

    def __init__(self, n=12, d=32, out=20, spelling="transpose", bias=True):
        super().__init__()
        self.spelling = spelling
        self.mix = nn.Linear(n, out, bias=bias)

    def forward(self, x):
        xt = {"transpose": lambda: x.transpose(1, 2), "negative": lambda: x.transpose(-1, -2),
              "swapped": lambda: x.transpose(2, 1), "permute": lambda: x.permute(0, 2, 1),
              "torch_transpose": lambda: torch.transpose(x, 1, 2),
              "torch_permute": lambda: torch.permute(x, (0, 2, 1)),
              "contiguous": lambda: x.transpose(1, 2).contiguous()}[self.spelling]()
        return self.mix(xt).transpose(1, 2).relu() + x[:, :1]


class FunctionalMix(nn.Module):
    """F.linear with parameters it holds, the output used in both layouts."""

    def __init__(self, n=12, d=32, out=24):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, n) / n ** 0.5)
        self.bias = nn.Parameter(torch.randn(out))

    def forward(self, x):
        y = F.linear(x.transpose(1, 2), self.weight, self.bias)   # [B, d, out]
        return torch.bmm(x, y), y.transpose(1, 2).sum(-1)


@pytest.mark.parametrize("spelling", ["transpose", "negative", "swapped", "permute", "torch_transpose",
                                      "torch_permute", "contiguous"])
def test_each_spelling_becomes_a_batched_gemm(spelling):
    torch.manual_seed(0)
    model, x = FeatureMix(spelling=spelling), torch.randn(8, 12, 32)
    gm, example_inputs = dynamo_graph(model, x)
    assert (linear_count(gm), bmm_count(gm)) == (1, 0)
    expected = model(x)

    result = rewrite_transposed_linears(gm, example_inputs)

    assert (result.rewritten, dict(result.declined)) == (1, {})
    assert (linear_count(gm), bmm_count(gm)) == (0, 1)
    # The transposed copy of x is gone: nothing transposes x any more.
    (x_node,) = [n for n in gm.graph.find_nodes(op="placeholder")
                 if tuple(n.meta["example_value"].shape) == tuple(x.shape)]
    assert not [n for n in x_node.users if n.target in ("transpose", "permute", "contiguous", torch.transpose,
                                                        torch.permute)]
    out = gm(*example_inputs)
    assert rel_error(expected, out[0] if isinstance(out, (tuple, list)) else out) < 1e-5


def test_functional_linear_with_bias_and_both_layouts():
    torch.manual_seed(0)
    model, x = FunctionalMix(), torch.randn(8, 12, 32)
    gm, example_inputs = dynamo_graph(model, x)
    expected = model(x)
    result = rewrite_transposed_linears(gm, example_inputs)
    assert result.rewritten == 1 and linear_count(gm) == 0
    got = gm(*example_inputs)
    for e, g in zip(expected, got):
        assert rel_error(e, g) < 1e-5


class Declined(nn.Module):
    """Linears of transposed inputs the Mod leaves as written, one per reason."""

    def __init__(self):
        super().__init__()
        self.flat = nn.Linear(12, 16)        # x2 [12, 32] transposed: 2-D
        self.four_d = nn.Linear(12, 16)      # x4 [2, 4, 12, 32] transposed(-1, -2): 4-D
        self.narrow = nn.Linear(12, 16)      # d = 8 < 16
        self.again = nn.Linear(12, 16)       # x is a transposed view: its transpose is contiguous
        self.skipped = nn.Linear(12, 16)     # excluded by the config
        self.batch_axis = nn.Linear(8, 16)   # transpose(0, 2): not the last two dims, not counted

    def forward(self, x2, x4, narrow, wide, x):
        t = wide.transpose(1, 2)             # [B, 12, 32] view of a [B, 32, 12] tensor
        return (self.flat(x2.t()), self.four_d(x4.transpose(-1, -2)), self.narrow(narrow.transpose(1, 2)),
                self.again(t.transpose(1, 2)), self.skipped(x.transpose(1, 2)),
                self.batch_axis(x.transpose(0, 2)))


def test_declines_with_reasons():
    inputs = (torch.randn(12, 32), torch.randn(2, 4, 12, 32), torch.randn(8, 12, 8), torch.randn(8, 32, 12),
              torch.randn(8, 12, 32))
    gm, example_inputs = dynamo_graph(Declined(), *inputs)
    before = linear_count(gm)
    result = rewrite_transposed_linears(gm, example_inputs, exclude_modules=("skipped",))
    assert result.rewritten == 0 and linear_count(gm) == before == 6
    assert dict(result.declined) == {"not_3d": 2, "narrow_output": 1, "transposed_input": 1, "excluded_module": 1}


def test_config_switch():
    assert "transposed_linear" in loka_compile.passes.MODS
    assert loka_compile.LokaConfig(disabled_mods=["transposed_linear"]).disabled_mods == ("transposed_linear",)


# ------------------------------------------------------------------ compiled, end to end

# Wukong's layer (benchmarks/zoo/models.py) at n = 16, d = 32, fp32, emulated e4m3, probe
# window off, batch 64, CPU, seeds 0-2, against eager fp32: output SQNR 36.2-36.8 dB and
# input gradient 29.5-33.1 dB with the Mod, the same +-1 dB without it; each parameter
# gradient's error 0.95-1.0x its error without the Mod (the FM path's gradients are 10-16 dB
# from fp32 either way: tiny K in e4m3). With every site in high precision the Mod changes
# only summation order: rel. error <= 1e-6 (test_dynamic_batch, test_checkpointed_feature_mixing).
# Floors, with margin:
HIGH_PRECISION_REL_ERROR = 1e-5
OUTPUT_SQNR_FLOOR_DB = 25.0
INPUT_GRAD_SQNR_FLOOR_DB = 20.0
ERROR_RATIO_TO_UNMODDED = 1.25


def _wukong_layer(seed):
    from benchmarks.zoo.models import WukongLayer
    torch.manual_seed(seed)
    return WukongLayer(16, 32, 8, 8, 16, [32])


def _train_step(model, x, g, options):
    torch._dynamo.reset()
    loka_compile.reset()
    model = copy.deepcopy(model)
    fn = model if options is None else torch.compile(model, backend="loka", options=options)
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.backward(g)
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads["x"] = x.grad
    report = None if options is None else loka_compile.report(fn)
    records = [] if options is None else list(loka_compile.state_of(fn).records)
    return out.detach(), grads, report, records


@pytest.mark.parametrize("seed", [0])
def test_numerics_with_and_without_the_mod(seed):
    layer = _wukong_layer(seed)
    torch.manual_seed(100 + seed)
    x, g = torch.randn(64, 16, 32), torch.randn(64, 16, 32)
    eager = _train_step(layer, x, g, None)
    fp8 = {"probe_steps": 0, "min_gemm_dim": 8}
    on = _train_step(layer, x, g, fp8)
    off = _train_step(layer, x, g, {**fp8, "disabled_mods": ["transposed_linear"]})
    assert off[2].mods["transposed_linear"] == 0
    assert any(s.fp8 and s.batch for s in on[2].sites)
    assert torch.isfinite(on[0]).all()
    assert sqnr_db(eager[0], on[0]) >= OUTPUT_SQNR_FLOOR_DB
    assert sqnr_db(eager[1]["x"], on[1]["x"]) >= INPUT_GRAD_SQNR_FLOOR_DB
    assert rel_error(eager[0], on[0]) <= ERROR_RATIO_TO_UNMODDED * rel_error(eager[0], off[0])
    for name in eager[1]:
        assert torch.isfinite(on[1][name]).all(), name
        assert rel_error(eager[1][name], on[1][name]) <= \
            ERROR_RATIO_TO_UNMODDED * rel_error(eager[1][name], off[1][name]), name


def test_sites_and_roles_of_the_batched_gemm():
    layer = _wukong_layer(0)
    _, _, report, records = _train_step(layer, torch.randn(64, 16, 32), torch.randn(64, 16, 32),
                                        {"probe_steps": 0, "min_gemm_dim": 8})
    (record,) = records
    assert record.mod_results["transposed_linear"].rewritten == 1
    # horizontal_fusion ran first: fm_proj and lcb are one linear, then one batched GEMM.
    mixed = [s for s in report.sites if s.module == "{fm_proj,lcb}"]
    assert sorted(s.role for s in mixed) == ["dgrad", "fwd", "wgrad"]
    fwd = next(s for s in mixed if s.role == "fwd")
    assert fwd.batch == 64 and fwd.shape == (24, 16, 32) and fwd.fp8
    # The broadcast weight is cast once, not once per sample: its amax has no batch dim.
    forward = report.graph_modules[f"{report.graphs[0].name}/forward"]
    amaxes = [n.meta["val"].shape for n in forward.graph.nodes
              if n.op == "call_function" and n.target is torch.ops.aten.amax.default]
    assert (24, 1) in [tuple(s) for s in amaxes]
    assert report.mods["transposed_linear"] == 1 and "transposed_linear 1" in report.summary()


def test_dynamic_batch():
    layer = _wukong_layer(0)
    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(copy.deepcopy(layer), backend="loka", dynamic=True,
                             options={"probe_steps": 0, "min_gemm_dim": 10 ** 6})
    for batch in (8, 12, 20):
        x = torch.randn(batch, 16, 32)
        assert rel_error(layer(x), compiled(x)) <= HIGH_PRECISION_REL_ERROR
    assert loka_compile.report(compiled).mods["transposed_linear"] >= 1
    torch._dynamo.reset()
    loka_compile.reset()


# ------------------------------------------------------------------ CUDA

# H100, Wukong layer n = 64, d = 160, bf16, batch 512, the batched sites on loka's Triton
# FP8 GEMM (the only batched FP8 provider), speed check off: output SQNR against eager
# bf16 (floor with margin):
CUDA_SQNR_FLOOR_DB = 20.0


@pytest.mark.cuda
def test_triton_gemm_reads_the_broadcast_weight():
    from benchmarks.zoo.models import WukongLayer
    torch.manual_seed(0)
    layer = WukongLayer(64, 160, 32, 32, 24, [256]).to("cuda", torch.bfloat16)
    x = torch.randn(512, 64, 160, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(copy.deepcopy(layer), backend="loka",
                             options={"probe_steps": 0, "speed_check": False, "providers": ["triton"]})
    out = compiled(x)
    out.backward(g)
    reference = layer(x)
    report = loka_compile.report(compiled)
    fwd = next(s for s in report.sites if s.module == "{fm_proj,lcb}" and s.role == "fwd")
    assert fwd.fp8 and fwd.provider == "triton" and fwd.batch == 512
    assert torch.isfinite(out).all()
    assert sqnr_db(reference.float(), out.float()) >= CUDA_SQNR_FLOOR_DB
    torch._dynamo.reset()
    loka_compile.reset()


class MixerRanker(nn.Module):
    """Public-style code: sparse EmbeddingBag features stacked [B, F, d], one MLP-Mixer
    block (token mixing over the feature axis, written with transposes), a head."""

    def __init__(self, tables=16, rows=100, d=32, hidden=64):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum", sparse=True) for _ in range(tables))
        self.norm = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(nn.Linear(tables, hidden), nn.GELU(), nn.Linear(hidden, tables))
        self.head = nn.Linear(tables * d, 1)

    def forward(self, ids, offsets):
        x = torch.stack([t(i, o) for t, i, o in zip(self.tables, ids, offsets)], 1)   # [B, F, d]
        x = x + self.token_mlp(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return self.head(x.flatten(1)).squeeze(-1)


# MixerRanker, batch 64, fp32, emulated e4m3, CPU, against eager fp32 with the same start:
# after 3 steps the logits' SQNR was 53.1-54.1 dB (seeds 0-2); floor with margin:
MIXER_SQNR_FLOOR_DB = 35.0


def test_mixer_ranker_trains(fresh_compile_state):
    torch.manual_seed(0)
    model = MixerRanker()
    ids = [torch.randint(0, 100, (64 * 3,)) for _ in range(16)]
    offsets = [torch.arange(0, 64 * 3, 3) for _ in range(16)]
    labels = torch.rand(64)
    runs = {}
    for name in ("eager", "loka"):
        net = copy.deepcopy(model)
        fn = net if name == "eager" else torch.compile(net, backend="loka", options={"probe_steps": 0})
        dense = [p for n, p in net.named_parameters() if not n.startswith("tables")]
        optimizers = [torch.optim.SGD(dense, lr=0.1), torch.optim.SparseAdam(list(net.tables.parameters()))]
        for _ in range(3):
            loss = F.binary_cross_entropy_with_logits(fn(ids, offsets), labels)
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs[name] = (fn(ids, offsets).detach(), None if name == "eager" else loka_compile.report(fn))
    logits, report = runs["loka"]
    assert torch.isfinite(logits).all()
    assert sqnr_db(runs["eager"][0], logits) >= MIXER_SQNR_FLOOR_DB
    assert report.mods["transposed_linear"] >= 1
    mixing = [s for s in report.sites if s.module == "token_mlp.0"]
    assert {s.role for s in mixing} == {"fwd", "dgrad", "wgrad"} and all(s.batch == 64 for s in mixing)


class TwoMixes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(12, 24)

    def forward(self, x):
        return self.a(x.transpose(1, 2)).sum(-1) + self.b(x.transpose(1, 2)).sum(-1)


def test_a_failure_part_way_leaves_the_graph_as_written(monkeypatch):
    from loka_compile.passes.mods import transposed_linear
    gm, example_inputs = dynamo_graph(TwoMixes(), torch.randn(4, 12, 32))
    before = gm.code
    fail_second_call(monkeypatch, transposed_linear, "_rewrite")
    with pytest.raises(RuntimeError, match="injected"):
        rewrite_transposed_linears(gm, example_inputs)
    assert gm.code == before and linear_count(gm) == 2


@pytest.mark.parametrize("fallback", [True, False])
def test_the_backend_runs_the_model_as_written_when_the_mod_fails(monkeypatch, fresh_compile_state, caplog, fallback):
    def fails(*args, **kwargs):
        raise RuntimeError("injected")

    from loka_compile.passes.mods import transposed_linear
    monkeypatch.setattr(transposed_linear, "rewrite_transposed_linears", fails)
    model, x = FeatureMix(), torch.randn(8, 12, 32)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "fallback": fallback})
    if not fallback:
        with pytest.raises(Exception, match="injected"):
            compiled(x)
        return
    with caplog.at_level("WARNING", logger="loka"):
        out = compiled(x)
    assert "the transposed_linear Mod failed" in caplog.text and "stay as written" in caplog.text
    assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
    assert loka_compile.report(compiled).mods["transposed_linear"] == 0


class CheckpointedMixer(nn.Module):
    """Feature mixing inside activation checkpointing, as memory-bound rankers train."""

    def __init__(self):
        super().__init__()
        self.mix = FeatureMix(n=12, d=32, out=12)
        self.head = nn.Linear(12 * 32, 1)

    def forward(self, x):
        y = torch.utils.checkpoint.checkpoint(self.mix, x, use_reentrant=False)
        return self.head(y.flatten(1)).squeeze(-1)


# CheckpointedMixer, batch 16, fp32, probe window off, every site high precision (the Mod
# alone), CPU: gradients against eager within 1e-6 relative; floor with margin:
CHECKPOINT_REL_ERROR = 1e-4


def test_checkpointed_feature_mixing(fresh_compile_state):
    torch.manual_seed(0)
    model, x = CheckpointedMixer(), torch.randn(16, 12, 32)
    report, grads = loka_and_eager_grads(model, x, {"probe_steps": 0, "min_gemm_dim": 10 ** 6})
    assert report.mods["transposed_linear"] == 1
    for name, got, expected in grads:
        assert rel_error(expected, got) <= CHECKPOINT_REL_ERROR, name
    recomputed = [s for s in report.sites if s.name.endswith(":fwd:recomputed")]
    assert any(s.module == "mix.mix" and s.batch == 16 for s in recomputed)


class WideCompression(nn.Module):
    """xDeepFM's compression as conv1x1 writes it: n = 64 fields' products into N = 48
    maps over d = 16: N * n = 3072 > d * (n + N) = 1792."""

    def __init__(self):
        super().__init__()
        self.compress = nn.Linear(64, 48)

    def forward(self, z):
        return self.compress(z.transpose(1, 2)).transpose(1, 2)


def test_a_wide_weight_gradient_declines_in_training_only():
    """Trained, the batched weight gradient would write [B, N, n] per-sample products (64 x
    48 x 64 here), more than the copies W @ x saves: the linear stays 2-D. Under no_grad
    there is no weight gradient, and W @ x is kept."""
    z = torch.randn(4, 64, 16)
    gm, example_inputs = dynamo_graph(WideCompression(), z)
    result = rewrite_transposed_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"wide_weight_gradient": 1}) and linear_count(gm) == 1
    with torch.no_grad():
        gm, example_inputs = dynamo_graph(WideCompression(), z)
        result = rewrite_transposed_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (1, {}) and bmm_count(gm) == 1
