"""The aligned_gemms Mod: a high-precision GEMM off the 16-byte alignment runs padded, except a
mat-vec product or one whose dim to pad is below the alignment, which keeps its op and layouts.
The rule per shape, the rewrite's numerics, the pass (high-precision CUDA sites only, never in
the probe phase or with the Mod off), and deepctr-torch's MMoE built as the library builds it:
its batched gate products keep the bmm and strides Inductor gives them without loka.

The Mod acts on CUDA only; the CPU tests here let the pass see CPU sites as it sees CUDA ones
(`pads_on`), which is the only difference."""

import copy
import dataclasses
import importlib.util

import pytest
import torch

import loka_compile
from loka_compile import LokaConfig
from loka_compile.passes import Phase, run_passes
from loka_compile.passes.mods import aligned_gemms
from loka_compile.passes.mods.aligned_gemms import align_gemms, alignment_padding, pad_gemm
from graphs import aot_graphs, make_ctx
from numerics import rel_error, sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

aten = torch.ops.aten
GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
# Zero padding adds exact zeros to each dot product; only the summation order of the padded
# kernel may differ (fp32 on CPU: 0 to 1e-7 relative measured). Floor with margin.
REL_ERROR = 1e-5
# The public-model suite's floor for emulated FP8 against fp32 eager (tests/integration/test_public_models.py).
PREDICTION_SQNR_DB = 20.0


def _gemm_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in GEMMS]


def as_on_cuda(monkeypatch, compute_bound=False):
    """The pass sees CPU GEMMs as it sees CUDA ones; Inductor's compute-bound test (which reads
    the GPU's FLOPs and bandwidth) answers `compute_bound`."""
    monkeypatch.setattr(aligned_gemms, "pads_on", lambda device: True)
    monkeypatch.setattr(aligned_gemms.pad_mm, "is_mm_compute_bound", lambda m, k, n, dtype: compute_bound)


def _forward_gemm(fn, *shapes, dtype=torch.bfloat16):
    """The one GEMM node of fn's forward ATen graph on fresh random inputs of `shapes`."""
    inputs = [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]
    forward = aot_graphs(fn, *inputs)[0]
    (node,) = _gemm_nodes(forward)
    return node


@pytest.mark.parametrize("fn, shapes, expected", [
    (torch.bmm, [(8, 1, 4), (8, 4, 32)], ((0, 0, 0), "matrix_vector")),     # MMoE: softmax(gate) @ experts
    (torch.bmm, [(8, 1, 12), (8, 12, 32)], ((0, 0, 0), "matrix_vector")),   # a K above the alignment too
    (torch.mm, [(64, 109), (109, 1)], ((0, 0, 0), "matrix_vector")),       # a 1-wide head
    (torch.mm, [(64, 1), (1, 109)], ((0, 0, 0), "outer_product")),         # its input gradient
    (torch.mm, [(64, 16), (16, 4)], ((0, 0, 0), "thin")),                  # 4 gate logits
    (torch.mm, [(64, 4), (4, 32)], ((0, 0, 0), "thin")),
    (torch.bmm, [(8, 65, 64), (8, 64, 65)], ((7, 0, 7), "")),              # attention over 65 positions
    (torch.mm, [(64, 77), (77, 32)], ((0, 3, 0), "")),
    (torch.mm, [(64, 32), (32, 16)], ((0, 0, 0), "aligned")),
])
def test_padding_rule_by_shape(fn, shapes, expected):
    assert alignment_padding(_forward_gemm(fn, *shapes)) == expected


def test_compute_bound_gemms_keep_inductors_own_benchmarked_choice(monkeypatch):
    """Inductor's pad_mm times padding a compute-bound GEMM itself, in the joint graph, and keeps
    the faster form: the Mod does not second-guess it (on a device where it pads)."""
    node = _forward_gemm(torch.mm, (64, 77), (77, 32))
    assert alignment_padding(node) == ((0, 3, 0), "")          # on CPU: no such benchmark
    as_on_cuda(monkeypatch, compute_bound=True)
    assert alignment_padding(node) == ((0, 0, 0), "inductor_judged")
    as_on_cuda(monkeypatch, compute_bound=False)
    assert alignment_padding(node) == ((0, 3, 0), "")


def test_fp32_aligns_to_four_elements():
    assert alignment_padding(_forward_gemm(torch.mm, (64, 30), (30, 32), dtype=torch.float32)) == ((0, 2, 0), "")
    assert alignment_padding(_forward_gemm(torch.mm, (64, 3), (3, 32), dtype=torch.float32))[1] == "thin"


@pytest.mark.parametrize("fn, shapes", [
    (torch.mm, [(40, 77), (77, 30)]),
    (torch.bmm, [(3, 65, 24), (3, 24, 65)]),
    (lambda bias, a, b: torch.addmm(bias, a, b), [(30,), (40, 77), (77, 30)]),
])
def test_padded_gemm_computes_the_same_values(fn, shapes):
    inputs = [torch.randn(*s) for s in shapes]
    forward = aot_graphs(fn, *[x.clone().requires_grad_() for x in inputs])[0]
    (node,) = _gemm_nodes(forward)
    # fp32 aligns to 4 elements: each of these has dims to pad
    assert pad_gemm(node)
    forward.recompile()
    (padded,) = _gemm_nodes(forward)
    a_val, b_val = (x.meta["val"] for x in padded.args[-2:]) if padded.target is aten.addmm.default \
        else (x.meta["val"] for x in padded.args)
    assert all(d % 4 == 0 or d == 1 for d in (*a_val.shape[-2:], b_val.shape[-1]))
    assert any(n.target is aten.constant_pad_nd.default for n in forward.graph.nodes)
    out = forward(*inputs)[0]
    ref = fn(*inputs)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel_error(out, ref) < REL_ERROR


def _ctx_with_sites_on(graph, device, phase=Phase.FP8, config=None, unsafe=None):
    """find_sites and Dispatch on `graph` (a CPU graph), its sites then seen on `device`."""
    from loka_compile.passes import dispatch_sites, find_sites

    ctx = make_ctx(graph, phase=phase, config=config or LokaConfig(recipe="rowwise", emulate=False), unsafe=unsafe)
    find_sites(graph, ctx)
    dispatch_sites(graph, ctx)
    ctx.sites = [dataclasses.replace(s, device=torch.device(device)) for s in ctx.sites]
    return ctx


def _attention(q, k, v):
    return torch.bmm(torch.nn.functional.silu(torch.bmm(q, k.transpose(1, 2))), v)


def test_pass_pads_high_precision_cuda_sites_only():
    shapes = [(4, 65, 24)] * 3
    for device, phase, disabled, padded in [("cuda", Phase.FP8, (), True), ("cpu", Phase.FP8, (), False),
                                            ("cuda", Phase.PROBE, (), False),
                                            ("cuda", Phase.FP8, ("aligned_gemms",), False)]:
        forward = aot_graphs(_attention, *[torch.randn(*s, dtype=torch.bfloat16, requires_grad=True)
                                           for s in shapes])[0]
        config = LokaConfig(recipe="rowwise", emulate=False, disabled_mods=list(disabled))
        ctx = _ctx_with_sites_on(forward.graph, device, phase, config)
        assert all(not d.fp8 for d in ctx.decisions.values())
        count = align_gemms(forward.graph, ctx)
        # both bmms have a dim of 65: padded to 72 (16 bytes of bf16) where the pass acts
        assert count == (2 if padded else 0), (device, phase, disabled)
        inner = sorted(n.args[0].meta["val"].shape[-1] for n in _gemm_nodes(forward))
        assert inner == ([24, 72] if padded else [24, 65])


def test_pass_leaves_fp8_sites_to_lower():
    """An FP8 site is gone once `lower` ran: the pass pads only what stayed high precision
    (two backward GEMMs with N = 77, one kept high precision by the Probe; CPU sites seen as CUDA)."""
    from loka_compile.passes import lower

    x = torch.randn(64, 77, requires_grad=True)
    w = torch.randn(32, 77, requires_grad=True)
    backward = aot_graphs(lambda x, w: torch.nn.functional.linear(x, w), x, w)[1]
    kept = "backward/<root>:dgrad#1"
    ctx = _ctx_with_sites_on(backward.graph, "cuda", config=LokaConfig(recipe="rowwise"), unsafe={kept: 1.0})
    assert {s.id: ctx.decisions[s.id].fp8 for s in ctx.sites} == {kept: False, "backward/<root>:dgrad#2": True}
    lower(backward.graph, ctx)
    assert align_gemms(backward.graph, ctx) == 1
    backward.graph.lint()
    padded = [n for n in _gemm_nodes(backward) if n.args[1].target is aten.constant_pad_nd.default]
    assert len(padded) == 1 and padded[0].args[1].meta["val"].shape[-1] == 80  # fp32: N 77 -> 80


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepctr_torch") is None or importlib.util.find_spec("requests") is None,
                    reason="the public extra is not installed: pip install -e '.[public]'")
def test_deepctr_mmoe_gate_products_keep_their_bmm_and_layouts(monkeypatch):
    """deepctr-torch's MMoE, built as the library builds it (benchmarks.public registry, 4
    experts), trained one step under bf16 autocast as the public suite runs it, the Mod acting
    on CPU as on CUDA: each task's `softmax(gate).unsqueeze(1) @ expert_outs` stays the bmm of
    [B, 1, E] by [B, E, D], and its backward's [B, 1, D] by [B, D, E], with the layouts AOTAutograd
    gives them (no padding, no copy), while unaligned GEMMs elsewhere run padded; predictions
    and loss match eager's."""
    from benchmarks.public.models import PRESETS, build, clone_model
    from benchmarks.public.run import TrainUnit

    as_on_cuda(monkeypatch)
    preset = dataclasses.replace(PRESETS["tiny"], experts=4)
    bench = build("deepctr_torch.MMOE", preset, seed=0)
    eager = clone_model(bench.model)
    inputs, labels = bench.batch(0)
    compiled = torch.compile(TrainUnit(bench, bench.model, amp=True), backend="loka",
                             options={"probe_steps": 0, "speed_check": False})
    loss, pred = compiled(inputs, labels)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = eager(inputs)
    ref_loss, ref_pred = bench.loss(ref_out, labels, eager), bench.prediction(ref_out)

    report = loka_compile.report(compiled)
    b, e, d = preset.batch, preset.experts, preset.expert[-1]
    bmms = {kind: [(tuple(n.args[0].meta["val"].shape), n.args[0].meta["val"].stride(),
                    tuple(n.args[1].meta["val"].shape), n.args[1].meta["val"].stride())
                   for n in gm.graph.nodes if n.target is aten.bmm.default]
            for kind, gm in ((name.split("/")[-1], gm) for name, gm in report.graph_modules.items())}
    # one gate product per task in the forward; its gradient by the gate in the backward (the
    # other gradient, by the experts, has K = 1 and is no GEMM)
    assert bmms["forward"] == [((b, 1, e), (e, e, 1), (b, e, d), (e * d, d, 1))] * 2, bmms
    assert bmms["backward"] == [((b, 1, d), (d, d, 1), (b, d, e), (e * d, 1, d))] * 2, bmms
    # the Mod was at work: the weight gradients of the 77-wide input (4 fields of 16, 13 dense) run padded
    padded = [n for gm in report.graph_modules.values() for n in _gemm_nodes(gm)
              if any(a.target is aten.constant_pad_nd.default for a in n.args if isinstance(a, torch.fx.Node))]
    assert padded and all(n.target is aten.mm.default for n in padded)
    assert torch.isfinite(pred).all() and torch.isfinite(loss)
    assert sqnr_db(ref_pred.double(), pred.double()) > PREDICTION_SQNR_DB
    assert abs(loss.item() - ref_loss.item()) < 0.05 * abs(ref_loss.item())


def test_run_passes_pads_in_the_pipeline(monkeypatch):
    """The Mod runs as a pass of `passes.PIPELINE`, after `lower`."""
    as_on_cuda(monkeypatch)
    forward = aot_graphs(_attention, *[torch.randn(4, 65, 24, dtype=torch.bfloat16, requires_grad=True)
                                       for _ in range(3)])[0]
    ctx = run_passes(forward.graph, make_ctx(forward.graph, config=LokaConfig(recipe="rowwise", emulate=False)))
    assert ctx.changes["aligned_gemms"] == 2


def test_dynamic_batch_pads_the_static_dims_and_trains_as_eager(monkeypatch):
    """A dynamic batch (symbolic M): K and N padded, M left symbolic with no guard added; two
    batch sizes, one compile; output and gradients as eager's (every site high precision)."""
    as_on_cuda(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(77, 30), torch.nn.ReLU(), torch.nn.Linear(30, 20))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", dynamic=True,
                             options={"probe_steps": 0, "emulate": False, "speed_check": False})
    for batch in (24, 40):
        x = torch.randn(batch, 77)
        out, ref = compiled(x), eager(x)
        out.square().mean().backward()
        ref.square().mean().backward()
        assert torch.isfinite(out).all() and rel_error(out, ref) < REL_ERROR
    for p, q in zip(model.parameters(), eager.parameters()):
        assert rel_error(p.grad, q.grad) < REL_ERROR
    graphs = loka_compile.report(compiled).graph_modules
    assert len(graphs) == 2  # one forward, one backward: no recompile for the second batch
    padded = [n for gm in graphs.values() for n in _gemm_nodes(gm)
              if any(isinstance(a, torch.fx.Node) and a.target is aten.constant_pad_nd.default for a in n.args)]
    assert padded
