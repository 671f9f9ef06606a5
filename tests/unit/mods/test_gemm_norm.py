"""The `gemm_norm` Mod: a GEMM whose output, through an optional residual add, is
row-normalized (LayerNorm, RMSNorm) before it becomes the next FP8 GEMM's A computes the
norm in its epilogue and writes that FP8 operand (and the pre-norm sum, where it is read
again).

Hand-built inference graphs (positive and negative), the fused path's numerics against the
unfused path's (the same graph with the Mod off), and calibrated end-to-end compiles of
an HSTU-style residual stream with a normed tower head, also with `dynamic=True` over
batch and sequence length.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_compile
from graphs import (OUTPUT_SQNR_DB, assert_no_loss, calibrated_plan, compile_with, inference_graph, run_lowering,
                    with_and_without)
from loka_compile.passes.mods.gemm_epilogue import EPILOGUE_CAST
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

GEMM_NORM = torch.ops.loka.triton_fp8_gemm_norm.default
_NORM_OPS = (torch.ops.aten.native_layer_norm.default, torch.ops.aten.var_mean.correction,
             torch.ops.aten.mean.dim, torch.ops.aten.rsqrt.default)


def fused_norms(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is GEMM_NORM]


def norm_ops_left(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _NORM_OPS]


def params(*shapes, dtype=torch.bfloat16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * (shape[-1] ** -0.5 if len(shape) == 2 else 0.5) + (
        1.0 if len(shape) == 1 else 0.0)).to(dtype) for shape in shapes]


def residual_stream(x, w_out, b_out, ln_w, ln_b, w_next, w_last):
    """HSTU's pattern: y = out(h) + x; the next block normalizes y for its GEMM and adds y
    to its own output."""
    b, n, d = x.shape
    y = F.linear(x.reshape(b * n, d), w_out, b_out).view(b, n, d) + x
    h = F.linear(F.layer_norm(y, (d,), ln_w, ln_b), w_next)
    return F.linear(F.silu(h), w_last).view(b, n, d) + y


def stream_inputs(d=64, dtype=torch.bfloat16):
    x = torch.randn(4, 6, d, dtype=dtype)
    return [x, *params((d, d), (d,), (d,), (d,), (2 * d, d), (d, 2 * d), dtype=dtype)]


def run_both(fn, args, **lowering):
    """(exact fp64 output, the fused graph's output, the unfused one's, the fused graph, ctx)."""
    exact = fn(*[a.double() for a in args])
    fused_gm, unfused_gm = inference_graph(fn, *args), inference_graph(fn, *args)
    ctx = run_lowering(fused_gm, **lowering)
    run_lowering(unfused_gm, disabled=("gemm_norm",), **lowering)
    with torch.no_grad():
        return exact, fused_gm(*args)[0], unfused_gm(*args)[0], fused_gm, ctx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_residual_stream_writes_the_operand_and_the_pre_norm_sum(dtype):
    args = stream_inputs(dtype=dtype)
    exact, fused, unfused, gm, ctx = run_both(residual_stream, args)
    (node,) = fused_norms(gm)
    assert node.args[8] == "layer" and node.args[15] is True  # norm, write_pre
    assert node.args[13] == torch.float8_e4m3fn
    # the LayerNorm is gone; the last GEMM's residual add reads the pre-norm sum the kernel wrote
    assert not norm_ops_left(gm)
    pre_readers = [user for getitem in node.users if getitem.args[1] == 1 for user in getitem.users]
    assert pre_readers, "nothing reads the pre-norm sum"
    assert ctx.casts["inference/<root>:fwd#2"]["a"] == \
        f"{EPILOGUE_CAST} <root>:fwd's GEMM (residual add, normalized (layer norm))"
    assert "layer norm (and the pre-norm value)" in ctx.decisions["inference/<root>:fwd#1"].detail
    assert_no_loss(exact, fused, unfused)


def tower_block(x, w1, ln_w, ln_b, w2, *, norm, post):
    """Linear -> norm -> activation -> Linear, as recsys towers and MaskNet's blocks are written."""
    h = F.linear(x, w1)
    if norm == "layer":
        h = F.layer_norm(h, (h.shape[-1],), ln_w, ln_b)
    elif norm == "layer_plain":
        h = F.layer_norm(h, (h.shape[-1],))
    else:
        h = F.rms_norm(h, (h.shape[-1],), ln_w, 1e-6)
    return F.linear(post(h), w2)


@pytest.mark.parametrize("norm", ["layer", "layer_plain", "rms"])
@pytest.mark.parametrize("post", ["none", "relu", "silu"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_norm_then_activation_then_next_gemm(norm, post, recipe):
    act = {"none": lambda t: t, "relu": torch.relu, "silu": F.silu}[post]

    def fn(x, w1, ln_w, ln_b, w2):
        return tower_block(x, w1, ln_w, ln_b, w2, norm=norm, post=act)

    args = [torch.randn(40, 96, dtype=torch.bfloat16), *params((128, 96), (128,), (128,), (32, 128))]
    exact, fused, unfused, gm, ctx = run_both(fn, args, recipe=recipe)
    (node,) = fused_norms(gm)
    kind = "rms" if norm == "rms" else "layer"
    assert node.args[8] == kind and node.args[12] == post and node.args[15] is False
    assert (node.args[9] is None) == (norm == "layer_plain") and (node.args[10] is None) == (norm != "layer")
    assert not norm_ops_left(gm)
    assert loka_compile.kernels.triton_gemm_norm is not None
    assert_no_loss(exact, fused, unfused)


@pytest.mark.parametrize("case", ["mod_disabled", "too_wide", "norm_over_another_dim", "variance_corrected",
                                  "no_static_scale", "pre_read_as_another_shape"])
def test_declines(case):
    d, static_sites, disabled = 64, None, ()
    if case == "too_wide":
        d = 320

    def fn(x, w1, ln_w, ln_b, w2):
        h = F.linear(x, w1)
        if case == "pre_read_as_another_shape":  # S is 3-D, read elsewhere, and no residual gives its shape
            h = h.view(8, 5, d)
        if case == "norm_over_another_dim":
            y = F.layer_norm(h.view(8, 5, d).transpose(1, 2), (5,)).transpose(1, 2).reshape(40, d)
        elif case == "variance_corrected":
            y = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True) + 1e-5)
        else:
            y = F.layer_norm(h, (d,), ln_w, ln_b)
        out = F.linear(y.reshape(40, d), w2)
        if case == "pre_read_as_another_shape":
            return out, h
        return out

    if case == "mod_disabled":
        disabled = ("gemm_norm",)
    if case == "no_static_scale":
        static_sites = [1]  # the consumer's A has no calibrated scale
    args = [torch.randn(40, 96, dtype=torch.bfloat16), *params((d, 96), (d,), (d,), (32, d))]
    gm = inference_graph(fn, *args)
    run_lowering(gm, disabled=disabled, static_sites=static_sites)
    assert not fused_norms(gm)


def test_the_kernel_write_keeps_graph_outputs_and_later_readers():
    """The pre-norm sum read by a graph output and by a later op reads the kernel's copy."""
    def fn(x, w1, ln_w, ln_b, w2):
        h = F.linear(x, w1)
        return F.linear(F.layer_norm(h, (64,), ln_w, ln_b), w2), h * 2.0, h

    args = [torch.randn(40, 96, dtype=torch.bfloat16), *params((64, 96), (64,), (64,), (32, 64))]
    exact = fn(*[a.double() for a in args])
    gm = inference_graph(fn, *args)
    run_lowering(gm)
    (node,) = fused_norms(gm)
    assert node.args[15] is True
    with torch.no_grad():
        out = gm(*args)
    for got, want in zip(out[1:], exact[1:]):
        assert sqnr_db(want, got.double()) >= OUTPUT_SQNR_DB
    assert sqnr_db(exact[0], out[0].double()) >= OUTPUT_SQNR_DB


# ---------------------------------------------------------------------------------------
# end to end: calibrate, then compile with the plan
# ---------------------------------------------------------------------------------------

class HstuLikeStream(nn.Module):
    """Pre-norm blocks on a residual stream over [B, L, d] (HSTU's layout), then a tower
    with a LayerNorm between its linears."""

    def __init__(self, d=64, blocks=2):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        self.ins = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(blocks))
        self.outs = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(blocks))
        self.head = nn.Sequential(nn.Linear(d, 128, bias=False), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 16))

    def forward(self, x):
        for norm, fc_in, fc_out in zip(self.norms, self.ins, self.outs):
            x = fc_out(F.silu(fc_in(norm(x)))) + x
        return self.head(x[:, -1])


def test_residual_stream_end_to_end(tmp_path):
    torch.manual_seed(0)
    model = HstuLikeStream().to(torch.bfloat16).eval()
    batches = [torch.randn(16, 12, 64, dtype=torch.bfloat16) for _ in range(3)]
    path = calibrated_plan(model, batches, tmp_path)
    x = torch.randn(16, 12, 64, dtype=torch.bfloat16)
    exact, fused, report, unfused, _ = with_and_without(model, path, x, "gemm_norm")
    normalized = sorted(s.module for s in report.sites if "normalized (layer norm" in s.casts.get("a", ""))
    # outs.0 -> +x -> norms.1 -> ins.1 (x read again by the next residual add), head.0 -> LN -> relu -> head.3
    assert normalized == ["head.3", "ins.1"]
    assert report.mods["gemm_norm"] == 2 and "gemm_norm 2" in str(report)
    assert_no_loss(exact, fused, unfused)


def test_dynamic_batch_and_length(tmp_path):
    """dynamic=True over batch and sequence length: the pre-norm sum the kernel writes is
    viewed back to the residual's symbolic shape."""
    torch.manual_seed(0)
    model = HstuLikeStream().to(torch.bfloat16).eval()
    path = calibrated_plan(model, [torch.randn(16, 12, 64, dtype=torch.bfloat16) for _ in range(3)], tmp_path)
    compiled = compile_with(model, path, dynamic=True)
    with torch.no_grad():
        for batch, length in ((16, 12), (24, 12), (17, 9)):
            x = torch.randn(batch, length, 64, dtype=torch.bfloat16)
            out = compiled(x)
            assert out.shape == (batch, 16) and not torch.isnan(out).any()
            assert sqnr_db(model(x).double(), out.double()) >= OUTPUT_SQNR_DB
    assert loka_compile.report(compiled).mods["gemm_norm"] == 2


@pytest.mark.cuda
def test_cuda_residual_stream_drops_the_norm_kernels(tmp_path):
    torch.manual_seed(0)
    model = HstuLikeStream(d=256, blocks=3).to("cuda", torch.bfloat16).eval()
    batches = [torch.randn(512, 65, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    path = calibrated_plan(model, batches, tmp_path)
    x = torch.randn(512, 65, 256, device="cuda", dtype=torch.bfloat16)
    exact, fused, report, unfused, ((fused_code,), (unfused_code,)) = with_and_without(
        model, path, x, "gemm_norm", {"speed_check": False})
    assert report.mods["gemm_norm"] == 3  # ins.1, ins.2 and head.3
    # each fused chain's norm (+ residual add, cast) kernel is gone
    kernels = [re.findall(r"^def (triton_\w+)\(", code, re.M) for code in (fused_code, unfused_code)]
    assert len(kernels[1]) - len(kernels[0]) == 3, kernels
    calls = [line for line in fused_code.splitlines()
             if "triton_fp8_gemm_norm.default(" in line and not line.lstrip().startswith("#")]
    assert len(calls) == 3, calls
    assert_no_loss(exact, fused, unfused)
