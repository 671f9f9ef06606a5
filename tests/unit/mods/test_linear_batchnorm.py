"""The linear_batchnorm Mod: Linear -> BatchNorm1d (training) -> ReLU with a two-pass BatchNorm
backward (kernels/batch_norm.py). The op against fp64 eager, the Dynamo-graph pass (torch-rechub's
MLP and deepctr-torch's DNN as the libraries build them, each decline), then compiled training
under backend="loka" against fp64 eager, with the running statistics and eval mode checked.

Floors (relative Frobenius error against fp64 eager, `rel_error`): fp32 1e-5 (fp32 sums over a
few hundred rows); bf16 2e-2 (bf16 inputs and outputs, 2^-8 each, through a normalization).
The Linear's bias gradient is zero in exact arithmetic (the normalization cancels the bias): it
is held to the same floors as a fraction of the column L1 norm of dh."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import loka_compile
from loka_compile import LokaConfig
from loka_compile.kernels.batch_norm import linear_batch_norm, reference
from loka_compile.passes.mods.linear_batchnorm import rewrite_linear_batch_norms
from graphs import dynamo_graph, rewritten_against_eager
from numerics import rel_error

ENABLED = dict(enabled_mods=["linear_batchnorm"], probe_steps=0, speed_check=False)
FLOORS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(rows, cols, dtype, bias=True):
    h = (torch.randn(rows, cols) * 2 + torch.randn(cols)).to(dtype)
    params = dict(bias=torch.randn(cols) if bias else None, weight=1 + 0.3 * torch.randn(cols),
                  beta=0.2 * torch.randn(cols), running_mean=torch.randn(cols), running_var=torch.rand(cols) + 0.5)
    return h, params


def _run(fn, h, params, dy, momentum=0.1, eps=1e-5, relu=True, dtype=torch.float64):
    """y, the gradients (h, bias, weight, beta) and the running statistics, with inputs in `dtype`
    (h keeps its own where `dtype` is None)."""
    leaf = lambda t: None if t is None else t.detach().to(dtype or t.dtype).requires_grad_()  # noqa: E731
    hl = h.detach().to(dtype or h.dtype).requires_grad_()
    bias, weight, beta = leaf(params["bias"]), leaf(params["weight"]), leaf(params["beta"])
    rm, rv = (params[k].clone().to(dtype or params[k].dtype) for k in ("running_mean", "running_var"))
    y = fn(hl, bias, weight, beta, rm, rv, momentum, eps, relu)
    y.backward(dy.to(y.dtype))
    return y, [hl.grad, weight.grad, beta.grad], bias.grad if bias is not None else None, (rm, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_op_matches_fp64_eager(dtype, relu, bias):
    h, params = _inputs(96, 40, dtype, bias)
    dy = torch.randn(96, 40)
    y, grads, dbias, stats = _run(linear_batch_norm, h, params, dy, relu=relu, dtype=None)
    y_ref, grads_ref, dbias_ref, stats_ref = _run(reference, h, params, dy, relu=relu)
    floor = FLOORS[dtype]
    assert y.dtype == dtype and not y.isnan().any()
    assert rel_error(y_ref, y) < floor
    for mine, ref in zip(grads, grads_ref):
        assert mine is not None and not mine.isnan().any() and rel_error(ref, mine) < floor
    for mine, ref in zip(stats, stats_ref):   # momentum 0.1, unbiased variance, the bias in the mean
        assert rel_error(ref, mine) < 1e-6
    if bias:
        column_l1 = grads_ref[0].abs().sum(0)
        assert ((dbias.double() - dbias_ref).abs() <= floor * column_l1).all()
    else:
        assert dbias is None


def test_op_rejects_what_it_cannot_normalize():
    h, params = _inputs(1, 8, torch.float32)
    with pytest.raises(ValueError, match="B >= 2"):
        linear_batch_norm(h, *params.values(), 0.1, 1e-5, True)
    with pytest.raises(ValueError, match="come together"):
        linear_batch_norm(torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), torch.zeros(8), None, 0.1, 1e-5, True)


def test_nan_in_a_row_reaches_the_outputs():
    h, params = _inputs(16, 8, torch.float32)
    h[3, 2] = float("nan")
    y, grads, _, _ = _run(linear_batch_norm, h, params, torch.randn(16, 8), dtype=None)
    assert y[:, 2].isnan().all() and grads[1][2].isnan()


def test_off_by_default_and_on_when_enabled():
    assert "linear_batchnorm" in LokaConfig().inactive_mods
    assert "linear_batchnorm" not in LokaConfig(enabled_mods=["linear_batchnorm"]).inactive_mods
    assert "linear_batchnorm" in loka_compile.passes.mods.OPT_IN_MODS


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _rechub_mlp(width=32, dims=(48, 40)):
    from torch_rechub.basic.layers import MLP
    return MLP(width, dims=list(dims))


def _deepctr_dnn(width=32, dims=(48, 40), activation="relu"):
    from benchmarks.public.models import import_deepctr
    import_deepctr()
    from deepctr_torch.layers import DNN
    return DNN(width, dims, activation=activation, use_bn=True)


@pytest.mark.parametrize("build", [_rechub_mlp, _deepctr_dnn])
def test_library_mlps_are_rewritten(build):
    pytest.importorskip("torch_rechub" if build is _rechub_mlp else "deepctr_torch")
    torch.manual_seed(0)
    model, x = build(), torch.randn(24, 32)
    gm, example_inputs = dynamo_graph(model, x)
    result = rewrite_linear_batch_norms(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (2, {})
    ops = _ops(gm)
    assert ops.count(linear_batch_norm) == 2 and F.batch_norm not in ops and F.relu not in ops


class Block(nn.Module):
    """Linear -> BatchNorm1d -> ReLU, with the variants the Mod declines."""

    def __init__(self, case=""):
        super().__init__()
        self.case = case
        self.lin = nn.Linear(16, 24)
        self.bn = nn.BatchNorm1d(5 if case == "three_d" else 24, affine=case != "no_affine")   # [B, C, L]: C = 5

    def forward(self, x):
        if self.case == "no_linear":
            return F.relu(self.bn(x @ self.lin.weight.t()))
        if self.case == "shared_linear":
            h = self.lin(x)
            return F.relu(self.bn(h)) + h
        return F.relu(self.bn(self.lin(x)))


@pytest.mark.parametrize("case, reason", [
    ("eval", "not_training"), ("no_linear", "no_linear"), ("shared_linear", "no_linear"),
    ("no_affine", "no_affine"), ("three_d", "unknown_shape"),
    ("fp64", "dtype"), ("no_grad", "no_grad"), ("excluded", "excluded_module")])
def test_declines(case, reason):
    model, x, options = Block(case), torch.randn(8, 16), {}
    if case == "eval":
        model.eval()
    elif case == "three_d":
        x = torch.randn(8, 5, 16)
    elif case == "fp64":
        model, x = model.double(), x.double()
    elif case == "excluded":
        options = dict(exclude_modules=("bn",))
    if case == "no_grad":
        with torch.no_grad():
            gm, example_inputs = dynamo_graph(model, x)
    else:
        gm, example_inputs = dynamo_graph(model, x)
    result = rewrite_linear_batch_norms(gm, example_inputs, **options)
    assert (result.rewritten, dict(result.declined)) == (0, {reason: 1})
    assert linear_batch_norm not in _ops(gm)


def _train_step(model, x, g, backend, options=None, autocast=False):
    """One forward + backward: (y, gradients of the parameters, buffers after, compiled)."""
    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(model, backend=backend, options=options) if backend else model
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = compiled(x)
    y.float().backward(g)
    return y, [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()], compiled


@pytest.mark.usefixtures("fresh_compile_state")
def test_compiled_training_matches_fp64_eager_and_eval_is_untouched():
    pytest.importorskip("torch_rechub")
    torch.manual_seed(0)
    model, x, g = _rechub_mlp(), torch.randn(64, 32), torch.randn(64, 1)
    reference_model = copy.deepcopy(model).double()
    y_ref, grads_ref, buffers_ref, _ = _train_step(reference_model, x.double(), g.double(), None)

    y, grads, buffers, compiled = _train_step(model, x, g, "loka", dict(ENABLED, emulate=False))

    assert loka_compile.report(compiled).mods["linear_batchnorm"] == 2
    assert rel_error(y_ref, y) < 1e-5
    names = [name for name, _ in model.named_parameters()]
    for name, mine, ref in zip(names, grads, grads_ref):
        if name.endswith("bias") and name.split(".")[1] in ("0", "4"):   # Linear biases ahead of a BatchNorm: ~0
            assert (mine.double() - ref).abs().max() < 1e-5 * grads_ref[names.index(name) - 1].abs().sum()
        else:
            assert rel_error(ref, mine) < 1e-5, name
    for mine, ref in zip(buffers, buffers_ref):   # running mean and variance, num_batches_tracked
        assert rel_error(ref, mine) < 1e-6
    model.eval(), reference_model.eval()
    with torch.no_grad():
        assert rel_error(reference_model(x.double()), compiled(x)) < 1e-5


@pytest.mark.usefixtures("fresh_compile_state")
def test_compiled_autocast_with_fp8_sites_matches_the_mod_off():
    """bf16 autocast with emulated FP8 sites: the Mod on against the Mod off, both against fp64
    eager; the Mod adds no error of its own (its error within 1.1x the Mod off's, plus bf16's floor)."""
    pytest.importorskip("torch_rechub")
    torch.manual_seed(1)
    model, x, g = _rechub_mlp(64, (64, 48)), torch.randn(128, 64), torch.randn(128, 1)
    reference_model = copy.deepcopy(model).double()
    _, grads_ref, _, _ = _train_step(reference_model, x.double(), g.double(), None)
    results = {}
    for enabled in (False, True):
        trained = copy.deepcopy(model)
        options = dict(ENABLED, max_output_error=None, enabled_mods=["linear_batchnorm"] if enabled else [])
        _, grads, _, compiled = _train_step(trained, x, g, "loka", options, autocast=True)
        assert loka_compile.report(compiled).mods.get("linear_batchnorm", 0) == (2 if enabled else 0)
        named = zip(model.named_parameters(), grads, grads_ref)
        results[enabled] = [rel_error(ref, mine) for (name, _), mine, ref in named
                            if not name.endswith(("0.bias", "4.bias"))]   # Linear biases ahead of a BatchNorm: ~0
    for on, off in zip(results[True], results[False]):
        assert on == on and on < 1.1 * off + FLOORS[torch.bfloat16]


@pytest.mark.parametrize("case", ["no_running_stats", "norm_read_twice", "no_bias"])
def test_variants_are_rewritten_and_match_eager(case):
    """Without running statistics, with the norm's output read besides the ReLU (no activation
    folded), and a Linear without bias: rewritten, and the step is eager's within fp32's floor."""
    torch.manual_seed(0)

    class Variant(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 24, bias=case != "no_bias")
            self.bn = nn.BatchNorm1d(24, track_running_stats=case != "no_running_stats")

        def forward(self, x):
            z = self.bn(self.lin(x))
            return F.relu(z) + z if case == "norm_read_twice" else F.relu(z)

    model, x = Variant(), torch.randn(32, 16)
    gm, example_inputs = dynamo_graph(model, x)   # runs the model once: its running statistics move
    reference = copy.deepcopy(model)
    result = rewrite_linear_batch_norms(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (1, {})
    xl, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y_ref = gm(*[xl if t is x else t for t in example_inputs])[0], reference(xr)
    assert rel_error(y_ref, y) < 1e-5
    g = torch.randn_like(y)
    y.backward(g), y_ref.backward(g)
    assert rel_error(xr.grad, xl.grad) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name != "lin.bias":
            assert rel_error(q.grad, p.grad) < 1e-5, name
    for mine, ref in zip(model.buffers(), reference.buffers()):
        assert rel_error(ref.float(), mine.float()) < 1e-6


class AutocastLinearThenBatchNorm(nn.Module):
    """A Linear under `torch.autocast(...)`, its BatchNorm and ReLU after the region (moved to the
    norm's place, the linear computed in fp32: the output's dtype and values changed)."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(32, 32), nn.BatchNorm1d(32)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        return torch.relu(self.bn(h))


def test_a_linear_under_another_autocast_state_is_left_alone():
    x = torch.randn(64, 32, requires_grad=True)
    result, pairs = rewritten_against_eager(AutocastLinearThenBatchNorm().train(), x, rewrite_linear_batch_norms)
    assert (result.rewritten, dict(result.declined)) == (0, {"other_state_region": 1}), result.declined
    for name, got, expected in pairs:
        assert got.dtype == expected.dtype, name
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
