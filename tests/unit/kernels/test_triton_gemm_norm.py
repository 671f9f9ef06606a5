"""Triton FP8 GEMM with a row norm in its epilogue (`kernels/triton_gemm_norm.py`) against
its fp64 reference.

Floors as for the plain GEMM (tests/unit/kernels/test_triton_gemm.py): a bf16 output (and the
pre-norm sum written in bf16) >= 40 dB against the fp64 reference, whose bf16 rounding
alone sits near 48 dB here; an FP8 output agrees with the reference cast code for code
except where the fp32 epilogue lands across a rounding boundary (under 1% of elements,
one code apart under the interpreter; 3% with fast accumulation), and keeps e4m3's precision against the exact value
(>= 25 dB). A wrong statistic, scale or unwritten tile lands far below.
"""

import pytest
import torch

from loka_compile.kernels import triton_gemm_norm as tgn
from loka_compile.kernels.quantize import Fp8Format, Scaling
from tests.numerics import sqnr_db
from tests.unit.kernels.test_triton_gemm import make_operands, run_opcheck

interpreter = pytest.mark.interpreter
E4M3 = Fp8Format.E4M3


def epilogue(m, n, norm, device="cpu", residual=True, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(m * 1000 + n)
    return dict(
        bias=torch.randn(n, generator=g).to(device, dtype),
        residual=(torch.randn(m, n, generator=g) * 4).to(device, dtype) if residual else None,
        norm=norm, norm_weight=(torch.rand(n, generator=g) + 0.5).to(device, dtype),
        norm_bias=torch.randn(n, generator=g).to(device, dtype) if norm == "layer" else None,
    )


def check(a_q, a_s, b_q, b_s, scaling, fp8_out=False, write_pre=True, **kw):
    """The kernel's (Y, S) against the reference's; returns them."""
    kw = dict(kw)
    fast = kw.get("fast_accum", False)
    if fp8_out:
        exact, _ = tgn.reference_fp8_gemm_norm(a_q, a_s, b_q, b_s, scaling, out_dtype=torch.float64,
                                               **{k: v for k, v in kw.items() if k != "fast_accum"})
        kw["out_scale"] = (exact.abs().amax() / E4M3.max).float().reshape(1).to(a_q.device)
        kw["out_dtype"] = E4M3.dtype
    y, pre = tgn.fp8_gemm_norm(a_q, a_s, b_q, b_s, scaling, write_pre=write_pre, **kw)
    kw.pop("fast_accum", None)  # the reference is exact
    ref_y, ref_pre = tgn.reference_fp8_gemm_norm(a_q, a_s, b_q, b_s, scaling, write_pre=write_pre, **kw)
    exact_kw = {k: v for k, v in kw.items() if k not in ("out_scale", "out_dtype")}
    exact, exact_pre = tgn.reference_fp8_gemm_norm(a_q, a_s, b_q, b_s, scaling, out_dtype=torch.float64,
                                                   write_pre=True, pre_dtype=torch.float64, **exact_kw)
    assert not torch.isnan(y.float()).any()
    if fp8_out:
        # Fast accumulation's reduced-precision partial sums move more values across an
        # FP8 rounding boundary (H100, 4000 x 1024 x 200, RMS norm: 1.46%).
        allowed = 0.03 if fast else 0.01
        differ = y.view(torch.uint8) != ref_y.view(torch.uint8)
        assert differ.float().mean() < allowed, f"{differ.float().mean():.2%} of FP8 codes differ"
        assert sqnr_db(exact, y.double() * kw["out_scale"].double()) >= 25.0
    else:
        assert y.dtype == torch.bfloat16 and sqnr_db(exact, y) >= 40.0
    if write_pre:
        assert pre.shape == y.shape and sqnr_db(exact_pre, pre) >= 40.0
    else:
        assert pre is None
    return y, pre


@interpreter
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
@pytest.mark.parametrize("shape", [(13, 96, 48), (33, 64, 256), (20, 40, 24)], ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, scaling, norm):
    operands = make_operands(*shape, scaling)
    check(*operands, scaling, activation="relu", post_activation="silu", **epilogue(shape[0], shape[2], norm))


@interpreter
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_fp8_output_without_pre_or_residual(norm):
    operands = make_operands(40, 64, 80, Scaling.ROWWISE)
    check(*operands, Scaling.ROWWISE, fp8_out=True, write_pre=False, **epilogue(40, 80, norm, residual=False))


@interpreter
def test_non_finite_rows_stay_in_their_row():
    operands = make_operands(16, 32, 32, Scaling.TENSORWISE)
    kw = epilogue(16, 32, "layer")
    kw["residual"][3, 5] = float("nan")
    scale = torch.ones(1)
    y, pre = tgn.fp8_gemm_norm(*operands, Scaling.TENSORWISE, out_dtype=E4M3.dtype, out_scale=scale,
                               write_pre=True, **kw)
    nan_rows = torch.isnan(y.float()).any(dim=1)
    assert nan_rows.tolist() == [i == 3 for i in range(16)] and torch.isnan(y[3].float()).all()
    assert torch.isnan(pre[3, 5]) and torch.isfinite(pre[torch.arange(16) != 3]).all()


@pytest.mark.parametrize("case,match", [
    ("too_wide", "N <= 256"), ("rms_bias", "RMS norm takes no bias"), ("norm", "unknown norm"),
    ("post", "unknown post_activation"), ("weight", "norm_weight must be"), ("blockwise", "not blockwise"),
    ("batched", "2-D operands"), ("eps", "eps must be"),
])
def test_bad_arguments_raise(case, match):
    n = 272 if case == "too_wide" else 32
    scaling = Scaling.BLOCKWISE if case == "blockwise" else Scaling.ROWWISE
    a_q, a_s, b_q, b_s = make_operands(16, 32, n, scaling)
    kw = dict(norm="rms" if case == "rms_bias" else "layer", norm_bias=torch.ones(n, dtype=torch.bfloat16))
    if case == "norm":
        kw["norm"] = "group"
    if case == "post":
        kw["post_activation"] = "tanh"
    if case == "weight":
        kw["norm_weight"] = torch.ones(n + 1, dtype=torch.bfloat16)
    if case == "eps":
        kw["eps"] = float("nan")
    if case == "batched":
        a_q, a_s, b_q, b_s = (t.unsqueeze(0) for t in (a_q, a_s, b_q, b_s))
    with pytest.raises(ValueError, match=match):
        tgn.fp8_gemm_norm(a_q, a_s, b_q, b_s, scaling, **kw)


@interpreter
@pytest.mark.parametrize("write_pre", [True, False])
def test_opcheck(write_pre):
    a_q, a_s, b_q, b_s = make_operands(16, 32, 48, Scaling.ROWWISE)
    kw = epilogue(16, 48, "layer")
    args = (a_q, a_s, b_q, b_s, "rowwise", kw["bias"], kw["residual"], "relu", "layer", kw["norm_weight"],
            kw["norm_bias"], 1e-5, "none", E4M3.dtype, torch.full((1,), 0.05), write_pre, torch.bfloat16)
    run_opcheck(args, torch.ops.loka.triton_fp8_gemm_norm.default)


@pytest.mark.cuda
@pytest.mark.parametrize("fast_accum", [False, True], ids=["precise", "fast"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("shape", [(2048, 256, 256), (8192, 512, 256), (4000, 1024, 200), (532480, 256, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cuda_matches_reference(shape, norm, fast_accum):
    scaling = Scaling.ROWWISE
    operands = make_operands(*shape, scaling, device="cuda")
    kw = epilogue(shape[0], shape[2], norm, device="cuda")
    check(*operands, scaling, fp8_out=True, fast_accum=fast_accum, **kw)
    check(*operands, scaling, fast_accum=fast_accum, **kw)
