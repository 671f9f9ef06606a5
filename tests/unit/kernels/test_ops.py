"""The loka ops and the FP8 providers: opcheck, quantization policy, numerics."""

import math

import pytest
import torch

from loka_compile.kernels import ops, providers
from loka_compile.kernels.quantize import (Fp8Format, Scaling, quantize_along, quantize_blockwise,
                                           quantize_operands, quantize_tensorwise)
from numerics import sqnr_db
from shapes import CUDA_SHAPES, SMALL_SHAPES

# e4m3 has 3 mantissa bits: rowwise quantization of both operands of a random GEMM gives
# about 3.7% relative error (ANCHORS.md), i.e. ~28.6 dB; tensorwise a little less.
GEMM_SQNR_FLOOR_DB = {Scaling.ROWWISE: 25.0, Scaling.TENSORWISE: 23.0, Scaling.BLOCKWISE: 25.0}


def fp8_gemm_args(m, k, n, batch=None, dtype=torch.float32, device="cpu", bias=False):
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, dtype=dtype, device=device)
    b = torch.randn(*lead, k, n, dtype=dtype, device=device)
    c = torch.randn(n, dtype=dtype, device=device) if bias else None
    return a, b, c


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_fp8_gemm(batch, bias):
    a, b, c = fp8_gemm_args(32, 64, 48, batch=batch, bias=bias)
    torch.library.opcheck(torch.ops.loka.fp8_gemm.default, (a, b, c, "rowwise", "e4m3", "e4m3", "emulated"))
    a.requires_grad_(True)
    torch.library.opcheck(torch.ops.loka.fp8_gemm.default, (a, b, c, "tensorwise", "e5m2", "e4m3", "emulated"))


def test_opcheck_observe_gemm():
    a, b, _ = fp8_gemm_args(32, 64, 48)
    seen = []
    ops.set_observer_sink(lambda site, stats: seen.append((site, stats)))
    try:
        torch.library.opcheck(torch.ops.loka.observe_gemm.default, (a, b, "site", "rowwise", "e4m3", "e4m3"))
    finally:
        from loka_compile import probe
        ops.set_observer_sink(probe.deliver)
    assert seen and seen[0][0] == "site"
    stats = seen[0][1]
    assert 0.005 < float(stats["rel_error"]) < 0.08
    assert float(stats["a_amax"]) == pytest.approx(float(a.abs().max()))


@pytest.mark.parametrize("scaling", [Scaling.ROWWISE, Scaling.TENSORWISE])
@pytest.mark.parametrize("m, k, n", SMALL_SHAPES)
def test_emulated_gemm_sqnr_against_fp64(scaling, m, k, n):
    a, b, c = fp8_gemm_args(m, k, n, bias=True)
    out = torch.ops.loka.fp8_gemm(a, b, c, scaling.value, "e4m3", "e4m3", "emulated")
    ref = a.double() @ b.double() + c.double()
    assert out.shape == (m, n) and out.dtype == a.dtype
    assert sqnr_db(ref, out) > GEMM_SQNR_FLOOR_DB[scaling]


@pytest.mark.parametrize("m, k, n", [(13, 96, 48), (16, 96, 200), (33, 256, 80), (8, 384, 272)])
def test_emulated_blockwise_gemm(m, k, n):
    a, b, _ = fp8_gemm_args(m, k, n)
    out = torch.ops.loka.fp8_gemm(a, b, None, "blockwise", "e4m3", "e4m3", "emulated")
    assert sqnr_db(a.double() @ b.double(), out) > GEMM_SQNR_FLOOR_DB[Scaling.BLOCKWISE]


def test_emulated_batched_gemm():
    a, b, _ = fp8_gemm_args(16, 32, 48, batch=4)
    out = torch.ops.loka.fp8_gemm(a, b, None, "rowwise", "e4m3", "e4m3", "emulated")
    assert sqnr_db(a.double() @ b.double(), out) > GEMM_SQNR_FLOOR_DB[Scaling.ROWWISE]


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_gemm_propagates_nan(scaling, bad):
    a, b, _ = fp8_gemm_args(16, 32, 16)
    a[3, 5] = bad
    out = torch.ops.loka.fp8_gemm(a, b, None, scaling, "e4m3", "e4m3", "emulated")
    assert not torch.isfinite(out[3]).any()   # the poisoned row, loudly
    assert torch.isfinite(out[:3]).all() and torch.isfinite(out[4:]).all()
    exact = a.double() @ b.double()
    if scaling == "rowwise" or math.isnan(bad):  # rowwise keeps an infinity's sign; e4m3 tensorwise has no inf
        torch.testing.assert_close(out[3], exact[3].float(), equal_nan=True, rtol=0, atol=0)
    else:
        assert torch.isnan(out[3]).all()


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_a_bad_weight_spoils_no_more_than_in_high_precision(scaling):
    """An inf weight spoils its output column in high precision; in FP8 too, no more."""
    a, b, _ = fp8_gemm_args(16, 32, 16)
    b[7, 2] = float("inf")
    out = torch.ops.loka.fp8_gemm(a, b, None, scaling, "e4m3", "e4m3", "emulated")
    spoiled = ~torch.isfinite(a.double() @ b.double())
    assert (~torch.isfinite(out) <= spoiled).all() and not torch.isfinite(out[:, 2]).any()
    assert sqnr_db(a.double() @ b.double()[:, [0, 1, 3]], out[:, [0, 1, 3]]) > GEMM_SQNR_FLOOR_DB[Scaling(scaling)]


@pytest.mark.parametrize("args, message", [
    ((torch.randn(4, 8), torch.randn(9, 4)), "shape mismatch"),
    ((torch.randn(4, 8), torch.randn(2, 8, 4)), "equal rank"),
    ((torch.randn(4, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)), "bf16, fp16 or fp32"),
])
def test_fp8_gemm_rejects_bad_operands(args, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.loka.fp8_gemm(*args, None, "rowwise", "e4m3", "e4m3", "emulated")


def test_fp8_gemm_rejects_unknown_names():
    a, b, _ = fp8_gemm_args(16, 32, 16)
    with pytest.raises(ValueError, match="scalings"):
        torch.ops.loka.fp8_gemm(a, b, None, "columnwise", "e4m3", "e4m3", "emulated")
    with pytest.raises(ValueError, match="registered"):
        torch.ops.loka.fp8_gemm(a, b, None, "rowwise", "e4m3", "e4m3", "nope")


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise", "blockwise"])
def test_opcheck_quantize_operand(operand, scaling):
    x = torch.randn(48, 160)
    torch.library.opcheck(torch.ops.loka.quantize_operand.default, (x, operand, scaling, "e4m3"))
    q, _ = torch.ops.loka.quantize_operand(x, operand, scaling, "e4m3")
    assert q.stride(-1 if operand == "a" else -2) == 1  # K-major


def test_empty_operands_give_empty_or_zero_results():
    """A data-dependent selection that selects nothing: M = 0 gives an empty product, K = 0
    (the weight gradient of an empty batch) a zero one, as in high precision."""
    for scaling in ("rowwise", "tensorwise"):
        out = torch.ops.loka.fp8_gemm(torch.randn(0, 32), torch.randn(32, 16), None, scaling, "e4m3", "e4m3",
                                      "emulated")
        assert out.shape == (0, 16)
        out = torch.ops.loka.fp8_gemm(torch.randn(16, 0), torch.randn(0, 32), None, scaling, "e4m3", "e4m3",
                                      "emulated")
        assert out.shape == (16, 32) and not out.any()


class TestQuantizationPolicy:
    def test_rowwise_scales_and_range(self):
        x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
        q, scale = quantize_along(x, -1, Fp8Format.E4M3)
        assert scale.shape == (8, 1) and q.dtype == torch.float8_e4m3fn
        # each row uses the full e4m3 range: its amax maps to 448
        torch.testing.assert_close(q.float().abs().amax(-1), torch.full((8,), 448.0))

    def test_zero_group_gets_unit_scale(self):
        x = torch.zeros(4, 32)
        x[1] = 1.0
        q, scale = quantize_along(x, -1, Fp8Format.E4M3)
        assert scale[0].item() == 1.0 and (q[0].float() == 0).all()

    @pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
    def test_non_finite_group_gets_nan_or_inf_scale(self, bad):
        x = torch.randn(4, 32)
        x[2, 7] = bad
        q, scale = quantize_along(x, -1, Fp8Format.E4M3)
        if math.isnan(bad):
            assert math.isnan(scale[2].item()) and q[2].float().isnan().all()
        else:  # an infinity is its sign, the row's finite values zeros, the scale +inf
            assert scale[2].item() == math.inf and q[2, 7].item() == math.copysign(1.0, bad)
            assert (q[2].float().abs().sum() == 1.0)
        assert torch.isfinite(scale[[0, 1, 3]]).all()
        # tensorwise: the scale comes from the finite values, the bad element alone is NaN,
        # or keeps its infinity in e5m2
        q, tscale = quantize_tensorwise(x, Fp8Format.E5M2)
        assert tscale.item() == pytest.approx(x[torch.isfinite(x)].abs().max().item() / 57344.0)
        assert q.float()[2, 7].isnan() if math.isnan(bad) else q.float()[2, 7].item() == bad
        assert torch.isfinite(q.float()).sum() == x.numel() - 1

    def test_power_of_two_scales(self):
        x = torch.randn(16, 64)
        _, scale = quantize_along(x, -1, Fp8Format.E4M3, power_of_two=True)
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        assert (x.abs().amax(-1, keepdim=True) / scale <= 448).all()

    def test_blockwise_tiles(self):
        x = torch.randn(130, 260)
        q, scale = quantize_blockwise(x, 128, 128, Fp8Format.E4M3)
        assert scale.shape == (2, 3) and q.shape == x.shape
        with pytest.raises(ValueError, match="2-D"):
            quantize_blockwise(torch.randn(2, 3, 4), 1, 128, Fp8Format.E4M3)

    def test_e5m2_keeps_range(self):
        a, b, _ = fp8_gemm_args(32, 64, 32)
        a_q, a_s, b_q, b_s = quantize_operands(a, b, Scaling.TENSORWISE, Fp8Format.E5M2, Fp8Format.E4M3)
        assert a_q.dtype == torch.float8_e5m2 and b_q.dtype == torch.float8_e4m3fn


def test_provider_registry():
    assert {"emulated", "scaled_mm_rowwise", "scaled_mm_tensorwise"} <= set(providers.names())
    cpu = providers.GemmRequest(torch.device("cpu"), Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3,
                                torch.float32, False)
    assert [p.name for p in providers.select(cpu)] == ["emulated"]
    with pytest.raises(ValueError, match="already registered"):
        providers.register(providers.get("emulated"))
    with pytest.raises(ValueError, match="scalings"):
        providers.GemmProvider("bad", frozenset({"rowwise"}), False, False, lambda d: True, lambda *a: None)


@pytest.mark.cuda
@pytest.mark.parametrize("scaling, provider", [("rowwise", "scaled_mm_rowwise"), ("tensorwise", "scaled_mm_tensorwise")])
@pytest.mark.parametrize("m, k, n", CUDA_SHAPES)
def test_scaled_mm_providers_match_emulation(scaling, provider, m, k, n):
    a, b, c = fp8_gemm_args(m, k, n, dtype=torch.bfloat16, device="cuda", bias=True)
    b = b.t().contiguous().t()  # weights arrive as a transposed view
    out = torch.ops.loka.fp8_gemm(a, b, c, scaling, "e4m3", "e4m3", provider)
    emulated = ops.fp8_gemm_reference(a, b, c, scaling, "e4m3", "e4m3")
    ref = a.double() @ b.double() + c.double()
    assert out.dtype == torch.bfloat16
    assert sqnr_db(ref, out) > GEMM_SQNR_FLOOR_DB[Scaling(scaling)]
    # same quantization, so real and emulated differ by accumulation order and bf16 output only
    assert sqnr_db(emulated.double(), out) > 40


@pytest.mark.cuda
def test_scaled_mm_e5m2_gradient_operand():
    a, b, _ = fp8_gemm_args(256, 512, 256, dtype=torch.bfloat16, device="cuda")
    out = torch.ops.loka.fp8_gemm(a, b, None, "tensorwise", "e5m2", "e4m3", "scaled_mm_tensorwise")
    assert sqnr_db(a.double() @ b.double(), out) > 18


@pytest.mark.cuda
def test_opcheck_on_cuda():
    a, b, c = fp8_gemm_args(64, 128, 64, dtype=torch.bfloat16, device="cuda", bias=True)
    torch.library.opcheck(torch.ops.loka.fp8_gemm.default, (a, b, c, "rowwise", "e4m3", "e4m3", "scaled_mm_rowwise"))
