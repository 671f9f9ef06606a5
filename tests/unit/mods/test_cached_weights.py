"""The `cached_weights` Mod on CPU (emulated FP8): inference GEMMs read each weight's FP8
copy as a graph constant, remade whenever the weight's content changes, never served stale."""

import copy
from typing import Optional

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile.kernels import providers
from loka_compile.kernels.quantize import Scaling
from loka_compile.passes.lower import CACHED_WEIGHT
from models import MLPWithNorm
from numerics import rel_error, sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# Emulated e4m3 rowwise on MLPWithNorm against fp32: 25-28 dB measured (2026-11-23).
OUTPUT_SQNR_FLOOR_DB = 20.0


def _infer(compiled, x):
    with torch.no_grad():
        return compiled(x)


def _cached(report):
    return [s for s in report.sites if s.casts.get("b") == CACHED_WEIGHT]


def _refreshes(report) -> int:
    return sum(w.refreshes for w in report.cached_weights)


def test_inference_weights_are_graph_constants_not_casts():
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x = torch.randn(32, 64)
    out = _infer(compiled, x)
    assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert len(_cached(report)) == 3 and all(s.fp8 for s in report.sites)
    assert report.mods["cached_weights"] == 3 and report.mods["standalone_casts"] == 1  # fc1's input
    gm = report.graph_modules[f"{report.graphs[0].name}/inference"]
    constants = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_loka_cached")]
    assert len(constants) == 6  # an FP8 operand and its scales per weight
    weights = {n for n in gm.graph.nodes if n.op == "placeholder"
               and tuple(n.meta["val"].shape) in {(128, 64), (128, 128), (16, 128)}}
    # |x|'s amaxes (each cast also reduces a NaN flag): the activations' casts only
    amax_inputs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.amax.default
                   and n.args[0].target is torch.ops.aten.abs.default]
    assert weights and len(amax_inputs) == 3
    fp8_bytes, bf16_bytes = report.cached_weight_bytes
    assert fp8_bytes < 0.6 * bf16_bytes and "weights cached in FP8: 3 operands" in str(report)


def test_cached_weights_match_in_graph_casts():
    """The eager cast that fills the constants is the recipe the graph would run."""
    model = MLPWithNorm().eval()
    x = torch.randn(32, 64)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    cached = _infer(compiled, x)
    torch._dynamo.reset()
    in_graph = _infer(torch.compile(model, backend="loka",
                                    options={"probe_steps": 0, "disabled_mods": ["cached_weights"]}), x)
    assert rel_error(in_graph, cached) < 1e-2
    assert loka_compile.report(compiled).mods["cached_weights"] == 3


def test_disabled_mod_casts_weights_in_the_graph():
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "disabled_mods": ["cached_weights"]})
    _infer(compiled, torch.randn(32, 64))
    report = loka_compile.report(compiled)
    assert report.mods["cached_weights"] == 0 and not report.cached_weights
    assert all(s.casts["b"].startswith("standalone (graph input") for s in report.sites)


def test_weights_are_quantized_once_until_they_change():
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x = torch.randn(32, 64)
    first = _infer(compiled, x)
    report = loka_compile.report(compiled)
    assert _refreshes(report) == 3
    for _ in range(3):
        torch.testing.assert_close(_infer(compiled, x), first, rtol=0, atol=0)
    assert _refreshes(report) == 3

    with torch.no_grad():   # an in-place update, as an optimizer step makes
        model.fc2.weight.mul_(-2)
    changed = _infer(compiled, x)
    assert _refreshes(report) == 4
    assert sqnr_db(model(x), changed) > OUTPUT_SQNR_FLOOR_DB


def test_load_state_dict_is_never_served_stale():
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x = torch.randn(32, 64)
    _infer(compiled, x)
    other = MLPWithNorm()
    model.load_state_dict(other.state_dict())
    out = _infer(compiled, x)
    assert sqnr_db(other(x), out) > OUTPUT_SQNR_FLOOR_DB


def test_optimizer_steps_between_evaluations_refresh_the_cache():
    """Train eagerly, evaluate compiled under no_grad: each evaluation sees the new weights."""
    model = MLPWithNorm()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(32, 64)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert sqnr_db(model(x), _infer(compiled, x)) > OUTPUT_SQNR_FLOOR_DB


def test_training_graphs_cast_weights_every_step():
    model = MLPWithNorm()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    compiled(torch.randn(32, 64)).sum().backward()
    report = loka_compile.report(compiled)
    assert not _cached(report) and not report.cached_weights


class SharedTower(nn.Module):
    """One tower scores users and items: its weights feed two GEMMs each."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, users, items):
        return (self.tower(users) * self.tower(items)).sum(-1)


def test_a_weight_two_sites_share_is_cached_once():
    model = SharedTower().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    users, items = torch.randn(16, 32), torch.randn(16, 32)
    with torch.no_grad():
        out = compiled(users, items)
    assert sqnr_db(model(users, items), out) > 15.0
    report = loka_compile.report(compiled)
    assert len(_cached(report)) == 4 and len(report.cached_weights) == 2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_other_scalings_cache_their_scales(recipe):
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": recipe})
    x = torch.randn(64, 128)
    out = _infer(compiled, x)
    assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert len(_cached(report)) == 2, report.table()
    with torch.no_grad():
        model[2].weight.mul_(3)
    assert sqnr_db(model(x), _infer(compiled, x)) > OUTPUT_SQNR_FLOOR_DB


def test_dynamic_batches_keep_one_cache():
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0})
    for batch in (8, 24, 40):
        x = torch.randn(batch, 64)
        assert sqnr_db(model(x), _infer(compiled, x)) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert len(report.cached_weights) == 3 and _refreshes(report) == 3


def test_inference_mode_tensors_are_refreshed_when_they_change():
    """Weights made under inference_mode have no version counter; their content tells."""
    with torch.inference_mode():
        model = MLPWithNorm().eval()
        compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
        x = torch.randn(32, 64)
        compiled(x)
        model.fc1.weight.mul_(2)
        out = compiled(x)
        assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
    assert _refreshes(loka_compile.report(compiled)) == 4  # three at the first call, then fc1


def test_functional_call_with_new_parameters_is_not_stale():
    module = MLPWithNorm().eval()
    step = torch.compile(lambda p, x: torch.func.functional_call(module, p, (x,)), backend="loka",
                         options={"probe_steps": 0})
    x = torch.randn(32, 64)
    params = {k: v.detach().clone().requires_grad_() for k, v in module.named_parameters()}
    with torch.no_grad():
        step(params, x)
        other = {k: (torch.randn_like(v) / 8).requires_grad_() for k, v in params.items()}
        out = step(other, x)
        reference = torch.func.functional_call(module, other, (x,))
    assert sqnr_db(reference, out) > OUTPUT_SQNR_FLOOR_DB
    assert len(loka_compile.report(step).cached_weights) == 3


@torch.library.custom_op("loka_test::opaque_gemm", mutates_args=())
def _opaque_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return providers.get("emulated").gemm(a_q, a_scale, b_q, b_scale, Scaling.ROWWISE, bias, out_dtype)


@_opaque_gemm.register_fake
def _(a_q, a_scale, b_q, b_scale, bias, out_dtype):
    return a_q.new_empty((a_q.shape[0], b_q.shape[1]), dtype=out_dtype)


@pytest.fixture
def opaque_provider():
    """A provider whose GEMM is one custom op, as the Triton GEMM is on CUDA."""
    provider = providers.register(providers.GemmProvider(
        name="opaque_test", scalings=frozenset({Scaling.ROWWISE}), batched=False, emulated=True,
        available=lambda device: True,
        gemm=lambda a_q, a_scale, b_q, b_scale, scaling, bias, out_dtype, fast_accum=False:
            _opaque_gemm(a_q, a_scale, b_q, b_scale, bias, out_dtype)))
    yield provider.name
    providers._REGISTRY.pop(provider.name)


def test_cached_weights_reach_a_custom_op_gemm(opaque_provider):
    """Inductor re-runs a custom op on its inputs' example values, and a cached weight's is
    the real constant (this failed every inference graph of the Triton GEMM on CUDA)."""
    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka",
                             options={"probe_steps": 0, "providers": [opaque_provider], "fallback": False})
    x = torch.randn(32, 64)
    out = _infer(compiled, x)
    assert sqnr_db(model(x), out) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert len(_cached(report)) == 3 and {s.provider for s in report.sites} == {opaque_provider}


def test_weights_stay_resizable_after_cached_inference():
    """FSDP2 frees an all-gathered parameter by resizing its storage to 0 after each forward;
    reading a weight for its fingerprint or a constant for the graph cache's digest must
    leave its storage resizable (a NumPy view of it would not)."""
    from loka_compile.graph_cache import _tensor_digest

    model = MLPWithNorm().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    assert torch.isfinite(_infer(compiled, torch.randn(32, 64))).all()
    assert _refreshes(loka_compile.report(compiled)) > 0  # the weights were read for the cache
    constant = torch.randn(8, 4)
    _tensor_digest(constant)
    for tensor in [*model.parameters(), constant]:
        assert tensor.untyped_storage().resizable()
