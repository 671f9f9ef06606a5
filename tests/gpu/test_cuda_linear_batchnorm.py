"""The linear_batchnorm Mod on a GPU: Inductor's Triton code for a BatchNorm MLP's training step
has fewer backward kernels with the Mod (no separate column sum for each Linear's bias gradient),
and its gradients are as close to the fp32 model's as the Mod off's."""

import copy

import pytest
import torch
import torch.nn as nn

import loka_compile
from graphs import generated_kernels
from numerics import rel_error

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_compile_state")]

# bf16 weights and activations: one bf16 rounding (2^-8) of each value, through a normalization
BF16_FLOOR = 2e-2


def _mlp():
    layers = []
    for a, b in ((256, 1024), (1024, 512)):
        layers += [nn.Linear(a, b), nn.BatchNorm1d(b), nn.ReLU(), nn.Dropout(0.0)]
    return nn.Sequential(*layers, nn.Linear(512, 1))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_backward_needs_fewer_kernels_and_keeps_the_gradients(fp8):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    master = _mlp().cuda().bfloat16()
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4096, 1, device="cuda", dtype=torch.bfloat16)
    options = dict(probe_steps=0, speed_check=False, max_output_error=None,
                   disabled_mods=["benchmarked_reductions"])   # one kernel per reduction, not two
    if not fp8:
        options["providers"] = ["emulated"]   # does not run where FP8 hardware is: every site bf16
    reference = copy.deepcopy(master).float()
    reference(x.float()).backward(dy.float())
    results = {}
    for enabled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(master)
        compiled = torch.compile(model, backend="loka",
                                 options=dict(options, enabled_mods=["linear_batchnorm"] if enabled else []))

        def step():
            compiled(x).backward(dy)

        _, code = run_and_get_code(step)
        assert loka_compile.report(compiled).mods.get("linear_batchnorm", 0) == (2 if enabled else 0)
        results[enabled] = generated_kernels(code), [p.grad.float() for p in model.parameters()]
    (kernels_off, grads_off), (kernels_on, grads_on) = results[False], results[True]
    print(f"\nkernels: Mod off {kernels_off}, on {kernels_on}")
    assert kernels_on <= kernels_off - 2   # at least the bias gradient's column sum of each BatchNorm
    for (name, ref), on, off in zip(reference.named_parameters(), grads_on, grads_off):
        if name in ("0.bias", "4.bias"):   # Linear biases ahead of a BatchNorm: zero in exact arithmetic
            continue
        assert on.isfinite().all(), name
        assert rel_error(ref.grad, on) <= 1.1 * rel_error(ref.grad, off) + BF16_FLOOR, name
