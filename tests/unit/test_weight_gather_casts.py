"""The FP8 weight all-gather's casts (`loka_compile.weight_gather`), one process: a weight cast
shard by shard, gathered, dequantized to the compute dtype and cast again by the GEMM's own
weight cast (the forward's rowwise or tensorwise, the dgrad's columnwise) gives back the gathered
FP8 bits and the gathered scale, bit for bit; non-finite values included (the casts' policy is
idempotent), and for every significand a group's amax can have. Plus the errors
`fp8_all_gather` gives a model it cannot take. The two-rank behaviour is
tests/integration/test_weight_gather.py."""

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile.kernels.quantize import (Fp8Format, cast_with_scale, dequantize, quantize_along, quantize_tensorwise,
                                           scale_from_amax)
from loka_compile.weight_gather import dequantize_into, quantize_shard

SHARDS = 2


def weight(rows=64, cols=48, seed=0):
    """Fresh random rows over 24 binades, one all-zero row, one of e4m3-subnormal-sized values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 12 - 6)
    w[5] = 0.0
    w[9, 1:] *= 1e-4  # most of the row far below its max: e4m3 subnormals after the cast
    return w


def gemm_weight_cast(w, scaling, fmt):
    """The cast an nn.Linear's GEMMs make of its weight: the forward's B = W^T one scale per column
    of B (per row of W) rowwise, one for all tensorwise; a rowwise dgrad's B = W one per column
    of W (columnwise)."""
    if scaling == "rowwise":
        q, scale = quantize_along(w.t(), -2, fmt)
        return q.t(), scale.t()
    if scaling == "columnwise":
        return quantize_along(w, -2, fmt)
    return quantize_tensorwise(w, fmt)


def gathered(w, scaling, fmt):
    """What the all-gather delivers: each shard of rows cast alone (rowwise), or the whole
    (tensorwise, columnwise: their scales are all-reduced over the shards, so the whole's)."""
    if scaling != "rowwise":
        return quantize_shard(w, scaling, fmt)
    parts = [quantize_shard(shard, scaling, fmt) for shard in w.chunk(SHARDS)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def same_fp8_values(a, b):
    """Equal FP8 values, NaN where NaN (the NaN encodings' sign may differ)."""
    fa, fb = a.float(), b.float()
    return torch.equal(fa.isnan(), fb.isnan()) and torch.equal(fa.nan_to_num(0.0), fb.nan_to_num(0.0))


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise", "columnwise"])
def test_recast_of_gathered_weight_gives_the_gathered_fp8_operand(scaling, dtype, fmt):
    w = weight().to(dtype)
    q, scale = gathered(w, scaling, fmt)
    direct_q, direct_scale = gemm_weight_cast(w, scaling, fmt)
    # cast shard by shard = the GEMM's cast of the whole weight
    assert torch.equal(q.view(torch.uint8), direct_q.view(torch.uint8)) and torch.equal(scale, direct_scale)
    unsharded = dequantize_into(q, scale, dtype)
    assert unsharded.dtype == dtype and not torch.equal(unsharded, w)  # the FP8 rounding really happened
    recast_q, recast_scale = gemm_weight_cast(unsharded, scaling, fmt)
    assert torch.equal(recast_q.view(torch.uint8), q.view(torch.uint8))  # bit for bit
    assert torch.equal(recast_scale, scale)  # bit for bit too (test_the_round_trip_keeps_every_scale)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_round_trip_keeps_every_scale(dtype, fmt):
    """Every significand a group's amax can have (a power of two scales amax and scale exactly, so
    one binade holds every case; every 64th of them near AMAX_EPS and at 2^100 to check that), in
    the compute dtype: the largest element casts to the format's max,
    dequantizes to max x scale, rounds to the compute dtype, and the re-cast's scale from it is
    the gathered scale, bit for bit. So the GEMM fed the gathered bytes and scale as they are
    computes what it computes today."""
    significands = (torch.arange(2 ** 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # [1, 2)
    significands = torch.unique(significands.to(dtype)).float()
    for exponent, every in ((0, 1), (-99, 64), (100, 64)):
        amax = torch.ldexp(significands[::every], torch.tensor(exponent))
        scale = scale_from_amax(amax, fmt)
        top = cast_with_scale(amax, scale, fmt)
        assert (top.float() == fmt.max).all(), exponent
        recast = scale_from_amax(dequantize(top, scale).to(dtype).float(), fmt)
        assert torch.equal(recast, scale), (exponent, (recast != scale).sum().item())


def test_out_receives_the_dequantized_weight():
    w = weight(seed=1).to(torch.bfloat16)
    q, scale = gathered(w, "rowwise", Fp8Format.E4M3)
    out = torch.empty_like(w)
    assert dequantize_into(q, scale, torch.bfloat16, out) is out
    assert torch.equal(out, dequantize_into(q, scale, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise", "columnwise"])
def test_non_finite_weights_keep_the_casts_policy(scaling, dtype):
    """A NaN and an infinity in the weight: the gathered, dequantized and re-cast operand is the
    GEMM's own cast of the raw weight (rowwise: the NaN's row NaN, the infinity's row its sign
    and zeros; tensorwise: each non-finite element NaN, the rest scaled by the finite amax).
    NaN never becomes finite."""
    w = weight(seed=2)
    w[3, 7], w[40, 2], w[41, 0] = float("nan"), float("inf"), -float("inf")
    w = w.to(dtype)
    q, scale = gathered(w, scaling, Fp8Format.E4M3)
    direct_q, direct_scale = gemm_weight_cast(w, scaling, Fp8Format.E4M3)
    assert same_fp8_values(q, direct_q)
    unsharded = dequantize_into(q, scale, dtype)
    recast_q, recast_scale = gemm_weight_cast(unsharded, scaling, Fp8Format.E4M3)
    assert same_fp8_values(recast_q, q) and same_fp8_values(recast_scale, scale)  # NaN scales where NaN
    value, reference = dequantize(recast_q, recast_scale), dequantize(direct_q, direct_scale)
    assert torch.equal(value.isnan(), reference.isnan()) and torch.equal(value.isinf(), reference.isinf())
    assert value[3, 7].isnan()
    if scaling == "rowwise":
        assert value[3].isnan().all() and value[40, 2] == float("inf") and value[41, 0] == -float("inf")
        assert (value[40, 3:] == 0).all()
    elif scaling == "columnwise":
        assert value[:, 7].isnan().all() and value[40, 2] == float("inf") and value[41, 0] == -float("inf")
        assert (value[:40, 2] == 0).all() and torch.isfinite(value[:, 1]).all()
    else:
        assert value[40, 2].isnan() and torch.isfinite(value[0]).all()


def test_fp8_all_gather_needs_a_sharded_model():
    with pytest.raises(ValueError, match="fully_shard"):
        loka_compile.fp8_all_gather(nn.Linear(16, 16))
