"""Keepdim reductions a graph returns, on a GPU, where Inductor's mix-order reduction fuses a
row reduction and a column sum of the same data (torch 2.11 hands the column sum back without
its kept dims; `passes/keepdim_outputs.py`): under loka each output keeps its shape, and the
fused kernel did run (else the first test would not test it).

deepctr-torch AFN's LogTransformLayer is the case the public suite met: its [1, 1, N] bias's
gradient beside the row-wise FP8 cast of the same output gradient (the dgrad's A). Inductor
did not fuse those two for this layer on an H200 (torch 2.11), so that test checks the shapes
and gradients whether or not it does."""

import copy
import importlib.util

import pytest
import torch
from torch._inductor import metrics


pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_compile_state")]

# Rows and columns past the sizes where Inductor fuses the two reductions (at least 4096 rows,
# twice as many rows as columns, 5 * 2**20 elements: torch 2.11's MixOrderReduction.can_fuse).
ROWS, COLUMNS = 2048 * 16, 256


def _row_max_and_column_sum(g):
    flat = g.reshape(-1, g.shape[-1])
    return flat.abs().amax(-1, keepdim=True) * 2.0, g.sum((0, 1), keepdim=True)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_column_sum_fused_with_a_row_reduction_keeps_its_kept_dims(mode):
    g = torch.randn(ROWS // 16, 16, COLUMNS, device="cuda")
    metrics.reset()
    # fallback off: a misshaped output must fail here, not run the graph without loka's passes
    compiled = torch.compile(_row_max_and_column_sum, backend="loka", options={"mode": mode, "fallback": False})
    for _ in range(3):  # reduce-overhead records its CUDA graph at the second call
        row_max, column_sum = compiled(g)
    expected = _row_max_and_column_sum(g)
    assert metrics.codegen_mix_order_reduction > 0, "Inductor did not fuse the two reductions: nothing tested"
    assert row_max.shape == expected[0].shape and column_sum.shape == expected[1].shape == (1, 1, COLUMNS)
    torch.testing.assert_close(column_sum, expected[1], rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(row_max, expected[0])


@pytest.mark.skipif(importlib.util.find_spec("deepctr_torch") is None, reason="the public extra is not installed")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_log_transform_layer_trains_with_its_bias_gradient_in_shape(mode):
    from test_afn_bias_gradient import afn_layer, train_against_eager

    layer = afn_layer(hidden=COLUMNS, device="cuda")
    eager = copy.deepcopy(layer)
    # The speed check off: the dgrad goes FP8 (its row-wise cast is the row reduction) whatever it
    # times; fallback off: a misshaped gradient must fail here, not send the backward to its fallback.
    compiled = torch.compile(layer, backend="loka", options={"recipe": "rowwise", "probe_steps": 0, "fallback": False,
                                                              "speed_check": False, "mode": mode})
    train_against_eager(compiled, layer, eager, rows=ROWS // 16, steps=3)
