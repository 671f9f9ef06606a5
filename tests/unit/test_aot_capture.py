"""loka_compile/aot_capture.py: a Dynamo graph's later compiles start from its first compile's
AOTAutograd capture; compiles with other trace settings trace again. Each compiled variant runs
for real, its outputs and gradients against eager."""

import copy

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified

from loka_compile import aot_capture
from numerics import rel_error

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

# fp32 ATen graphs run as traced: the same ops as eager, in the same order
REL_ERROR = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.ReLU(), nn.Linear(48, 8))


def _compile_variants(model, x, trace_settings: list):
    """A backend compiling the Dynamo graph once per entry of `trace_settings` (Inductor patches
    as the capture sees them) under one AotCapture, each variant's forward and backward graphs
    run as traced and counted in `runs[i]`. Returns the capture, the variants, their run
    counts and the Dynamo graph's inputs (the parameters and x)."""
    capture = aot_capture.AotCapture()
    variants, runs, graph_inputs = [], [], []

    def counted(graph, i):
        def run(args):
            runs[i] += 1
            return graph(args)
        run._boxed_call = True
        return run

    def backend(gm, example_inputs):
        graph_inputs.extend(example_inputs)
        for i, settings in enumerate(trace_settings):
            runs.append(0)
            with capture.compiling(settings):
                variants.append(aot_module_simplified(
                    gm, example_inputs, fw_compiler=lambda fw, _inputs, i=i: counted(make_boxed_func(fw.forward), i),
                    bw_compiler=lambda bw, _inputs, i=i: counted(make_boxed_func(bw.forward), i)))
        return variants[0]

    torch.compile(model, backend=backend)(x)
    return capture, variants, runs, graph_inputs


def _check_variant(variant, graph_inputs, model, x):
    """The variant's output and parameter gradients against eager."""
    eager = copy.deepcopy(model)
    want = eager(x)
    want.square().sum().backward()
    params = list(model.parameters())
    for p in params:
        p.grad = None
    (got,) = variant(*graph_inputs)
    got.square().sum().backward()
    assert torch.isfinite(got).all() and rel_error(want.detach(), got.detach()) < REL_ERROR
    for p, q in zip(params, eager.parameters()):
        assert torch.isfinite(p.grad).all() and rel_error(q.grad, p.grad) < REL_ERROR


def _check_variants(variants, runs, graph_inputs, model, x):
    """Each variant runs its own forward and backward graph, with eager's numerics."""
    for i, variant in enumerate(variants):
        before = list(runs)
        _check_variant(variant, graph_inputs, model, x)
        assert [after - b for after, b in zip(runs, before)] == [2 if j == i else 0 for j in range(len(runs))]


def test_later_compiles_reuse_the_first_capture_and_other_settings_trace_again():
    model, x = _model(), torch.randn(16, 32)
    same, other = {"max_autotune": False}, {"max_autotune": False, "fallback_random": True}
    capture, variants, runs, graph_inputs = _compile_variants(model, x, [same, same, other])
    assert (capture.traces, capture.reuses) == (2, 1)
    _check_variants(variants, runs, graph_inputs, model, x)


def test_a_capture_is_reused_by_every_later_compile_and_forgotten_when_dropped():
    model, x = _model(), torch.randn(16, 32)
    capture, variants, runs, graph_inputs = _compile_variants(model, x, [{}] * 3)
    assert (capture.traces, capture.reuses) == (1, 2)
    _check_variants(variants, runs, graph_inputs, model, x)
    capture.drop()
    assert capture._kept is None


def test_inputs_are_described_by_shape_dtype_gradient_and_aliasing():
    base = torch.randn(4, 8)
    a = aot_capture.describe_inputs([base, base[1:], torch.randn(4, 8, requires_grad=True), 3])
    assert a == aot_capture.describe_inputs([base, base[1:], torch.randn(4, 8, requires_grad=True), 3])
    others = ([base, torch.randn(3, 8), torch.randn(4, 8, requires_grad=True), 3],  # no longer aliased
              [base, base[1:], torch.randn(4, 8), 3],                                # no gradient
              [base, base[1:], torch.randn(4, 8, requires_grad=True, dtype=torch.float64), 3],
              [base, base[1:], torch.randn(4, 8, requires_grad=True), 4])
    for inputs in others:
        assert aot_capture.describe_inputs(inputs) != a


def test_trace_settings_leave_out_what_acts_after_the_trace():
    patches = {"max_autotune": True, "triton.cudagraphs": True, "post_grad_custom_post_pass": object()}
    assert aot_capture.trace_settings(patches) == aot_capture.trace_settings(
        {"max_autotune": True, "triton.cudagraphs": False, "post_grad_custom_post_pass": None})
    assert aot_capture.trace_settings(patches) != aot_capture.trace_settings({"max_autotune": False})
