"""The public suite's GEMM coverage audit (benchmarks/public/coverage.py): its FLOP counts of
ATen graphs agree with torch's FlopCounterMode, its Inductor post-grad counter sees the
forward and backward GEMMs of a training step, and `loka_coverage` splits a loka report's
graphs into site FLOPs and GEMM ops no site covers."""

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

import loka_compile
from benchmarks.public.coverage import GemmCounter, graph_gemm_flops, loka_coverage

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")


class Mixed(nn.Module):
    """A linear, an interaction bmm, a baddbmm, a matrix-vector product and a 3-wide
    convolution (no 1x1: the conv1x1 Mod leaves it a convolution)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 48)
        self.conv = nn.Conv1d(8, 16, kernel_size=3, padding=1)
        self.vector = nn.Parameter(torch.randn(48) / 7)
        self.bias = nn.Parameter(torch.randn(8) / 7)

    def forward(self, x):  # x [B, 8, 32]
        h = self.linear(x)                                     # [B, 8, 48]
        pairs = torch.bmm(h, h.transpose(1, 2))                # [B, 8, 8]
        mixed = torch.baddbmm(self.bias, pairs, pairs)         # [B, 8, 8]
        scores = torch.mv(h.flatten(0, 1), self.vector)        # [B * 8]
        return self.conv(x).sum() + mixed.sum() + scores.sum()


def _eager_flops(fn, *args):
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def test_graph_flops_match_the_flop_counter():
    """Every GEMM-like op of an ATen graph, by op, against FlopCounterMode (plus the mv,
    which it does not count: 2 * rows * cols)."""
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(4, 8, 32)
    gm = make_fx(model)(x)
    counted = graph_gemm_flops(gm.graph)
    assert set(counted) == {"addmm", "bmm", "baddbmm", "mv", "convolution"}, counted
    assert counted["mv"] == 2 * 32 * 48
    assert sum(counted.values()) - counted["mv"] == _eager_flops(model, x)


@pytest.mark.slow
def test_inductor_counter_sees_a_training_step():
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(4, 8, 32)
    counter = GemmCounter()
    compiled = torch.compile(model, backend="inductor", options={"post_grad_custom_post_pass": counter,
                                                                 "fx_graph_cache": False})
    compiled(x).backward()
    expected = _eager_flops(lambda: model(x).backward())
    assert set(counter.flops) == {"forward", "backward"}
    total = counter.total()
    mv = sum(c.get("mv", 0) for c in counter.flops.values())
    assert total - mv == expected, counter.flops


@pytest.mark.slow
def test_loka_coverage_names_the_gemms_no_site_covers():
    """Under loka the linear, the bmm and the baddbmm are sites; the convolution is left in
    its graph, unseen, with its FLOPs (the matrix-vector product reaches it decomposed into
    a multiply and a sum: no GEMM there)."""
    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(4, 8, 32)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        compiled(x)
    covered = loka_coverage(loka_compile.report(compiled))
    assert set(covered["unseen"]) == {"convolution"}, covered
    assert covered["unseen"]["convolution"] == 2 * 4 * 16 * 32 * 8 * 3
    linear, pairs, mixed = 2 * (4 * 8) * 32 * 48, 2 * 4 * 8 * 48 * 8, 2 * 4 * 8 * 8 * 8
    assert covered["loka_flops"] == linear + pairs + mixed, covered
    assert 0 < covered["seen_share"] < 1 and covered["fp8_share"] <= covered["seen_share"]
