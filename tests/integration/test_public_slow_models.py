"""Regressions from the public models loka ran slower than Inductor bf16 (issue 33: deepctr-torch
DCN-Mix, torch-rechub DIN and BST), each model built as its library builds it
(benchmarks/public/models.py, tiny preset) and trained under loka on CPU (emulated FP8).

DCN-Mix: its cross experts' weights are slices of stacked parameters (`V_list[i][e]`, a select of
an [experts, d, r] Parameter); their gradients reach the parameter through select_scatter. They were
taken for activation gradients (dgrad) and went FP8, which the default recipe keeps for the
forward and the dgrad: GEMMs contracting over the batch, each operand cast standalone across the
batch (rowwise scales over a transposed activation), 36 such GEMMs per step at the production preset.

DCN-Mix again: a slice of a stacked parameter was no weight to loka, so each expert weight was cast
by each GEMM that read it, every step, in training and inference alike.

Needs the `public` extra (pip install -e ".[public]"); skipped without it.
"""

import importlib.util

import pytest
import torch

pytest.importorskip("requests", reason="the public extra is not installed (deepctr-torch imports requests)")
if importlib.util.find_spec("deepctr_torch") is None:
    pytest.skip("the public extra is not installed: pip install -e '.[public]'", allow_module_level=True)

import loka_compile  # noqa: E402

from benchmarks.public.models import build, clone_model  # noqa: E402
from numerics import sqnr_db  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# Measured (CPU, seed 0, tiny preset, 2026-11-28): the cross experts' weight gradients in high
# precision under loka (FP8 forward and dgrads upstream) against eager fp32: 26.5-27.0 dB.
EXPERT_GRAD_SQNR_FLOOR_DB = 20.0


@pytest.mark.slow
def test_dcn_mix_expert_weight_gradients_are_wgrad_in_high_precision():
    bench = build("deepctr_torch.DCNMix", "tiny", seed=0)
    eager = bench.model.crossnet
    model = clone_model(eager)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    inputs, _ = bench.batch(0)
    batch, p = inputs.shape[0], bench.preset
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, model.U_list[0].shape[1], generator=g)
    projection = torch.randn(x.shape[1], generator=g)
    (compiled(x) @ projection).square().mean().backward()
    (eager(x) @ projection).square().mean().backward()

    backward = [s for s in loka_compile.report(compiled).sites if s.kind == "backward"]
    contracting_over_batch = [s for s in backward if s.shape[1] == batch]
    # per layer and expert: the gradients of V, C and U (the gates' wgrads are too small for FP8 anyway)
    experts = [s for s in contracting_over_batch if "gating" not in s.module]
    assert len(experts) == p.cross_layers * p.experts * 3, [(s.id, s.shape) for s in backward]
    assert all(s.role == "wgrad" for s in contracting_over_batch), \
        [(s.id, s.shape) for s in contracting_over_batch if s.role != "wgrad"]
    assert not any(s.fp8 for s in contracting_over_batch)
    assert all(s.reason == "recipe_high_precision" for s in experts), {s.id: s.reason for s in experts}
    # the input gradient through the experts stays dgrad, in FP8
    assert any(s.role == "dgrad" and s.fp8 for s in backward)

    reference = dict(eager.named_parameters())
    weights = {name: w for name, w in model.named_parameters() if name.startswith(("U_list", "V_list", "C_list"))}
    assert len(weights) == 3 * p.cross_layers
    for name, w in weights.items():
        got, want = w.grad, reference[name].grad
        assert got is not None and torch.isfinite(got).all(), name
        assert want.abs().sum() > 0, name
        db = sqnr_db(got.double(), want.double())
        assert db > EXPERT_GRAD_SQNR_FLOOR_DB, (name, db)


def _crossnet_step(bench, options, grad=True):
    """DCN-Mix's cross network (the built model's own CrossNetMix) compiled under loka with `options`:
    one forward (and backward) on a fixed batch; (report sites, output, gradients by name)."""
    torch._dynamo.reset()
    model = clone_model(bench.model.crossnet)
    if not grad:
        model.eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, **options})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(bench.preset.batch, model.U_list[0].shape[1], generator=g)
    with torch.set_grad_enabled(grad):
        out = compiled(x)
    grads = {}
    if grad:
        (out @ torch.randn(x.shape[1], generator=g)).square().mean().backward()
        grads = {name: w.grad for name, w in model.named_parameters()}
    return loka_compile.report(compiled).sites, out.detach(), grads


@pytest.mark.slow
def test_dcn_mix_expert_weights_are_cast_once_a_step_bit_for_bit():
    """A slice of a stacked parameter is a weight: an unpadded FP8 expert weight is cast once for its
    forward and its dgrad (weight_both_layouts), with the products the same as each GEMM casting it."""
    bench = build("deepctr_torch.DCNMix", "tiny", seed=0)
    sites, out, grads = _crossnet_step(bench, {})
    _, out_off, grads_off = _crossnet_step(bench, {"disabled_mods": ["weight_both_layouts", "saved_fp8"]})
    shared = [s for s in sites if s.fp8 and s.casts.get("b", "").startswith("cached weight") and s.padding == (0, 0)]
    unpadded = [s for s in sites if s.fp8 and s.padding == (0, 0) and s.role in ("fwd", "dgrad")]
    assert unpadded and len(shared) == len(unpadded), {s.id: s.casts for s in unpadded}
    assert torch.equal(out, out_off)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_off[name]), name


@pytest.mark.slow
def test_dcn_mix_inference_caches_its_expert_weights_bit_for_bit():
    """In inference, each FP8 expert weight (a slice of a stacked parameter) is read as a cached FP8
    constant (cached_weights), padded or not, with the output the same as casting it in the graph."""
    bench = build("deepctr_torch.DCNMix", "tiny", seed=0)
    sites, out, _ = _crossnet_step(bench, {}, grad=False)
    _, out_off, _ = _crossnet_step(bench, {"disabled_mods": ["cached_weights"]}, grad=False)
    fp8 = [s for s in sites if s.fp8]
    assert fp8 and all(s.casts["b"].startswith("cached weight") for s in fp8), {s.id: s.casts for s in fp8}
    assert torch.isfinite(out).all()
    assert torch.equal(out, out_off)
