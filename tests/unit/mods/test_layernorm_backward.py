"""The layernorm_backward Mod: a LayerNorm over a short last dim keeps ATen's forward and gets
loka's Triton backward. The Dynamo-graph pass (each spelling, each decline), then compiled
training under backend="loka" against fp64 eager and against the Mod off. On CPU the Mod
declines (`not_cuda`); these tests let it run there (the kernels under the Triton
interpreter) by adding "cpu" to MOD_DEVICES, and lower MIN_ROWS to tiny shapes.

Floors (relative Frobenius error against fp64 eager, `rel_error`): fp32 1e-5 (fp32 sums over
a few hundred rows); bf16 autocast 1e-2 (one bf16 rounding of each gradient, 2^-8)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import loka_compile
from loka_compile import LokaConfig
from loka_compile.kernels.layer_norm_backward import layer_norm
from loka_compile.passes.mods import layernorm_backward as mod
from loka_compile.passes.mods.layernorm_backward import rewrite_layer_norm_backwards
from graphs import dynamo_graph
from numerics import rel_error

ENABLED = dict(enabled_mods=["layernorm_backward"], probe_steps=0, speed_check=False)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(mod, "MOD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(mod, "MIN_ROWS", 1)


class WukongNorm(nn.Module):
    """Public Wukong's pattern: LayerNorm over d of cat(two blocks) + the residual, x [B, n, d]."""

    def __init__(self, d=32, k=3, spelling="module", affine=True, bias=True):
        super().__init__()
        self.k, self.spelling = k, spelling
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.norm = nn.LayerNorm(d, elementwise_affine=affine, bias=bias)
        if affine:
            with torch.no_grad():
                self.norm.weight.add_(0.3 * torch.randn(d))
                if bias:
                    self.norm.bias.add_(0.1 * torch.randn(d))

    def forward(self, x):
        z = torch.cat([x[:, :self.k] * self.scale, x[:, self.k:]], 1) + x
        norm, d = self.norm, z.shape[-1]
        if self.spelling == "module":
            return norm(z)
        if self.spelling == "functional":
            return F.layer_norm(z, (d,), norm.weight, norm.bias, norm.eps)
        if self.spelling == "torch":
            return torch.layer_norm(z, [d], norm.weight, norm.bias, norm.eps)
        if self.spelling == "aten":
            return torch.ops.aten.layer_norm(z, [d], norm.weight, norm.bias, norm.eps)
        y, mean, rstd = torch.ops.aten.native_layer_norm(z, [d], norm.weight, norm.bias, norm.eps)
        return y if self.spelling == "native" else y * rstd   # "native_stats": reads rstd


def _norm_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is layer_norm]


def test_off_by_default_and_on_when_enabled():
    assert "layernorm_backward" in LokaConfig().inactive_mods
    assert "layernorm_backward" not in LokaConfig(enabled_mods=["layernorm_backward"]).inactive_mods
    assert "layernorm_backward" in loka_compile.passes.mods.OPT_IN_MODS


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("spelling", ["module", "functional", "torch", "aten", "native"])
def test_each_spelling_is_rewritten(spelling):
    model, x = WukongNorm(spelling=spelling), torch.randn(4, 6, 32)
    expected = model(x)
    gm, example_inputs = dynamo_graph(model, x)

    result = rewrite_layer_norm_backwards(gm, example_inputs)

    assert (result.rewritten, dict(result.declined)) == (1, {})
    assert len(_norm_nodes(gm)) == 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target in mod._LAYER_NORMS
                | mod._NATIVE_LAYER_NORMS]
    assert torch.equal(gm(*example_inputs)[0], expected)   # the forward is ATen's, bit for bit


def _declined(model, x, monkeypatch, **options):
    gm, example_inputs = dynamo_graph(model, x)
    result = rewrite_layer_norm_backwards(gm, example_inputs, **options)
    assert result.rewritten == 0 and not _norm_nodes(gm)
    return dict(result.declined)


class TwoDimNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(6, 32)), nn.Parameter(torch.zeros(6, 32))

    def forward(self, x):
        return F.layer_norm(x, (6, 32), self.weight, self.bias)


@pytest.mark.parametrize("case, reason", [
    ("no_weight", "no_weight"), ("wide", "wide_rows"), ("two_dims", "not_last_dim"), ("few_rows", "few_rows"),
    ("cpu", "not_cuda"), ("no_grad", "no_grad"), ("stats", "statistics_used"), ("fp64", "dtype"),
    ("excluded", "excluded_module")])
def test_declines(case, reason, monkeypatch):
    monkeypatch.setattr(mod, "MOD_DEVICES", ("cuda",) if case == "cpu" else ("cuda", "cpu"))
    monkeypatch.setattr(mod, "MIN_ROWS", 10 ** 6 if case == "few_rows" else 1)
    x, model, options = torch.randn(4, 6, 32), WukongNorm(), {}
    if case == "no_weight":
        model = WukongNorm(affine=False)
    elif case == "wide":
        model, x = WukongNorm(d=mod.MAX_WIDTH + 128), torch.randn(2, 6, mod.MAX_WIDTH + 128)
    elif case == "two_dims":
        model = TwoDimNorm()
    elif case == "stats":
        model = WukongNorm(spelling="native_stats")
    elif case == "fp64":
        model, x = model.double(), x.double()
    elif case == "excluded":
        options = dict(exclude_modules=("norm",))
    if case == "no_grad":
        with torch.no_grad():
            assert _declined(model, x, monkeypatch) == {reason: 1}
    else:
        assert _declined(model, x, monkeypatch, **options) == {reason: 1}


@pytest.mark.usefixtures("on_cpu")
def test_call_module_node_of_a_traced_graph():
    model, x = nn.Sequential(WukongNorm().norm), torch.randn(4, 6, 32)   # the norm reads the input
    gm = torch.fx.symbolic_trace(model)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0"]
    result = rewrite_layer_norm_backwards(gm, (x,))
    assert result.rewritten == 1 and result.modules == ["0"] and len(_norm_nodes(gm)) == 1
    xl = x.clone().requires_grad_()
    y = gm(xl)
    assert torch.equal(y, model(x))
    g = torch.randn_like(y)
    y.backward(g)
    xr = x.double().requires_grad_()
    reference = copy.deepcopy(model).double()
    reference(xr).backward(g.double())
    assert rel_error(xr.grad, xl.grad) < 1e-5
    assert rel_error(reference[0].weight.grad, model[0].weight.grad) < 1e-5


def _train(model, x, g, options, autocast=False):
    """One backward of model(x) . g under loka: (gradients of x and the parameters, report)."""
    loka_compile.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="loka", options=options)
    xl = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = compiled(xl)
    y.float().backward(g)
    return [xl.grad] + [p.grad for p in model.parameters()], loka_compile.report(compiled)


def _backward_ops(report):
    return [n.target for name, gm in report.graph_modules.items() if name.endswith("backward")
            for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.usefixtures("on_cpu", "fresh_compile_state")
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_fp32_gradients_match_fp64(bias):
    model, x = WukongNorm(bias=bias), torch.randn(8, 6, 32)
    g = torch.randn(8, 6, 32)
    reference = copy.deepcopy(model).double()
    xr = x.double().requires_grad_()
    reference(xr).backward(g.double())
    expected = [xr.grad] + [p.grad for p in reference.parameters()]

    grads, report = _train(model, x, g, ENABLED)

    assert report.mods["layernorm_backward"] == 1
    assert _backward_ops(report).count(torch.ops.loka.layer_norm_backward.default) == 1
    for mine, ref in zip(grads, expected):
        assert rel_error(ref, mine) < 1e-5


class LinearNorm(nn.Module):
    """A linear (bf16 under autocast) feeding the LayerNorm, as in an MLP block."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.block = WukongNorm(d)

    def forward(self, x):
        return self.block(self.lin(x))


@pytest.mark.usefixtures("on_cpu", "fresh_compile_state")
def test_compiled_autocast_gradients_match_the_mod_off_and_eager():
    torch.manual_seed(0)
    model, x, g = LinearNorm(), torch.randn(8, 6, 32), torch.randn(8, 6, 32)
    options = dict(ENABLED, exclude_modules=["lin"])   # no FP8 GEMM: the runs differ only in the norm
    eager = copy.deepcopy(model)
    xe = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = eager(xe)
    y.float().backward(g)
    expected = [xe.grad] + [p.grad for p in eager.parameters()]

    on, report_on = _train(copy.deepcopy(model), x, g, options, autocast=True)
    off, report_off = _train(copy.deepcopy(model), x, g, dict(options, enabled_mods=[]), autocast=True)

    assert report_on.mods["layernorm_backward"] == 1 and report_off.mods["layernorm_backward"] == 0
    assert torch.ops.loka.layer_norm_backward.default in _backward_ops(report_on)
    assert torch.ops.loka.layer_norm_backward.default not in _backward_ops(report_off)
    for mine, without, ref in zip(on, off, expected):
        assert rel_error(without, mine) < 1e-2 and rel_error(ref, mine) < 1e-2


@pytest.mark.usefixtures("fresh_compile_state")
def test_cpu_keeps_inductors_backward_even_when_enabled():
    model, x, g = WukongNorm(), torch.randn(8, 6, 32), torch.randn(8, 6, 32)
    _, report = _train(model, x, g, ENABLED)
    assert report.mods["layernorm_backward"] == 0
    assert torch.ops.loka.layer_norm_backward.default not in _backward_ops(report)
    assert dict(report.mod_results["layernorm_backward"][-1].declined) == {"few_rows": 1}


# ---- CUDA: compiled kernels, bf16 autocast and bf16 weights --------------------------

@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_compile_state")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_cuda_training_gradients(mode, precision):
    """autocast: a linear (kept out of FP8) makes a bf16 input, which LayerNorm normalizes in
    fp32; bf16: public Wukong's block with bf16 weights and activations."""
    torch.manual_seed(0)
    if precision == "autocast":
        model, options = nn.Sequential(nn.Linear(128, 128), WukongNorm(d=128).norm), dict(exclude_modules=["0"])
    else:
        model, options = WukongNorm(d=128, k=32), {}
    model, x = model.cuda(), torch.randn(512, 64, 128, device="cuda")
    g = torch.randn_like(x)
    reference = copy.deepcopy(model).double()
    xr = x.double().requires_grad_()
    reference(xr).backward(g.double())
    expected = [xr.grad] + [p.grad for p in reference.parameters()]
    if precision == "bf16":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    compiled = torch.compile(model, backend="loka", options=dict(ENABLED, mode=mode, **options))
    for _ in range(3):   # CUDA graphs record after warm-up calls
        model.zero_grad()
        xl = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16, enabled=precision == "autocast"):
            y = compiled(xl)
        y.float().backward(g)
    report = loka_compile.report(compiled)
    assert report.mods["layernorm_backward"] == 1
    assert torch.ops.loka.layer_norm_backward.default in _backward_ops(report)
    for mine, ref in zip([xl.grad] + [p.grad for p in model.parameters()], expected):
        assert rel_error(ref, mine) < 2e-2


@pytest.mark.usefixtures("one_thread")
def test_benchmark_runs_on_cpu(tmp_path):
    import json

    from benchmarks import layernorm_backward as bench

    path = bench.main(["--shapes", "4x8x32", "--precisions", "bf16", "--variants",
                       "eager,loka_mod,mod_eager,bwd_aten,bwd_loka", "--steps", "2", "--warmup", "1",
                       "--out", str(tmp_path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager", "loka_mod", "mod_eager", "bwd_aten", "bwd_loka"]
    for r in rows:
        assert r["error"] is None and r["ms"] > 0
        assert max(r["dx_err"], r["dweight_err"], r["dbias_err"]) < 1e-2   # bf16 against fp64
    assert path.with_suffix(".md").exists()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = WukongNorm()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = WukongNorm(), WukongNorm()

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.usefixtures("on_cpu", "fresh_compile_state")
@pytest.mark.parametrize("case", ["checkpointed", "failing_rewrite"])
def test_checkpointed_body_and_a_failing_rewrite(case, monkeypatch):
    from graphs import fail_second_call

    model = Checkpointed() if case == "checkpointed" else TwoNorms()
    if case == "failing_rewrite":
        fail_second_call(monkeypatch, mod, "_rewrite")   # the graph is restored, the Mod logged as failed
    x, g = torch.randn(8, 6, 32), torch.randn(8, 6, 32)
    reference = copy.deepcopy(model).double()
    xr = x.double().requires_grad_()
    reference(xr).backward(g.double())
    expected = [xr.grad] + [p.grad for p in reference.parameters()]

    grads, report = _train(model, x, g, ENABLED)

    rewritten = 1 if case == "checkpointed" else 0
    assert report.mods["layernorm_backward"] == rewritten
    assert _backward_ops(report).count(torch.ops.loka.layer_norm_backward.default) == rewritten
    for mine, ref in zip(grads, expected):
        assert rel_error(ref, mine) < 1e-5
