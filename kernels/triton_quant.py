"""Triton FP8 quantization kernels: rowwise / columnwise, tensorwise, blockwise, dual-axis.

Every kernel matches the pure-PyTorch references of `quantize.py` bit for bit (fp8 bytes
and fp32 scales), on the device the tensors live on:

- the scale is `max(amax, AMAX_EPS) / fp8_max`, computed the way PyTorch computes the
  reference there: CUDA turns a division by a Python scalar into a multiplication by its
  fp32 reciprocal, the CPU divides; a division by a tensor is an IEEE division on both,
  so the cast uses `div_rn` (Triton's plain `/` is an approximate division on GPUs);
- the non-finite policy of `quantize.py`: rowwise, a NaN in a group makes its scale NaN
  and every fp8 byte of the group 0x7F (the byte the reference's cast writes for a
  positive NaN quotient), an infinity in a group without a NaN makes its scale +inf,
  each +-inf byte +-1.0 and the others +-0; tensorwise and blockwise, scales from the
  finite values and each inf or NaN element by itself 0x7F, or +-inf in e5m2; an
  all-zero group gets scale 1;
- power-of-two scales are rounded up exactly, from the fp32 bits (see `_scale_from_amax`
  for where this can differ from the reference's log2/ceil/exp2).

Layouts (each FP8 output is laid out as the GEMM wants it, see `quantize_dual_axis`):
- `quantize_rowwise(x [M, K])`: q like x (row-major in, row-major out), scale [M, 1].
- `quantize_columnwise(x [K, N])`: one scale per column, [1, N]; q like x, so a
  column-major B operand (`w.t()`) gives a column-major q, what cuBLASLt wants for B.
- `quantize_tensorwise(x)`: q like x (contiguous), 0-d scale; amax stays on the device.
- `quantize_blockwise(x [R, C], br, bc)`: q like x, scale [ceil(R/br), ceil(C/bc)]
  row-major; 1x128 for activations, 128x128 for weights.
- `quantize_dual_axis(x [M, K])`: q_row [M, K] row-major with scale [M, 1], and q_col
  [M, K] column-major (q_col.t() is a contiguous [K, M]) with scale [1, K].

The ops run the Triton kernels on CUDA devices with FP8 conversion (sm89+) and on CPU
under TRITON_INTERPRET=1; elsewhere they run the reference, so the ops work everywhere.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .quantize import (
    Fp8Format,
    quantize_along,
    quantize_blockwise as reference_quantize_blockwise,
    quantize_tensorwise as reference_quantize_tensorwise,
)

# Byte written for every element of a NaN-scaled group (positive fp8 NaN in both e4m3fn
# and e5m2): what `cast_with_scale` produces when it divides by a NaN scale.
NAN_BYTE = 0x7F
_NAN_BYTE = tl.constexpr(NAN_BYTE)
# e5m2's +inf (a tensorwise e5m2 cast keeps infinities; sign bit 0x80).
E5M2_INF_BYTE = 0x7C
_E5M2_INF_BYTE = tl.constexpr(E5M2_INF_BYTE)

# Rows whose padded width fits this many elements are read once and kept in registers;
# wider ones are read twice (amax pass, then cast pass).
MAX_SINGLE_PASS_COLS = 16384


# ---------------------------------------------------------------------------------------
# shared device helpers
# ---------------------------------------------------------------------------------------

@triton.jit
def _magnitude_bits(x):
    """|x|'s bits as int32 (x fp32): they order like |x| over the finite values and inf,
    and every NaN above inf, so their integer max is an amax in which a NaN wins over an
    inf and an inf over any finite value (a float max may drop NaN)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _amax(x, AXIS: tl.constexpr):
    """fp32 max |x| along AXIS: NaN if the slice holds a NaN, else inf if it holds an inf."""
    return tl.max(_magnitude_bits(x), axis=AXIS).to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(x):
    return tl.abs(x) < float("inf")  # false for inf and NaN


@triton.jit
def _scale_from_amax(amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL: tl.constexpr, POW2: tl.constexpr):
    """fp32 dequantization scale from a non-negative amax: NaN for a NaN amax, +inf for
    an infinite one (the groups of `_cast_to_fp8_bytes`).

    Power of two: the scale is rounded up from its bits (exact). The reference rounds
    through ceil(log2(s)), which for s a hair above a power of two can round down; only
    scales within a few ulp of a power of two can differ."""
    clamped = tl.maximum(amax, 7.888609052210118e-31)  # quantize.AMAX_EPS = 2**-100
    if RECIPROCAL:
        scale = clamped * INV_FP8_MAX
    else:
        scale = tl.math.div_rn(clamped, FP8_MAX)
    scale = tl.where(amax == 0.0, 1.0, scale)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & 0x7F800000
        bits = tl.where((bits & 0x007FFFFF) != 0, exponent + 0x00800000, exponent)
        scale = bits.to(tl.float32, bitcast=True)
    scale = tl.where(amax == float("inf"), float("inf"), scale)
    return tl.where(amax != amax, float("nan"), scale)


@triton.jit
def _fp8_bits_software(y, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    """Round-to-nearest-even fp32 -> fp8 bits for finite |y| <= fp8 max, in integer
    arithmetic. Used under TRITON_INTERPRET only: the interpreter's own fp8 conversion
    rounds half up and drops the carry into the exponent (triton 3.6)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - FP8_MANT
    rounded = (mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift
    normal = rounded - ((127 - FP8_BIAS) << FP8_MANT)
    # Below the smallest normal the spacing is 2^(1 - bias - mant): scale to units of it
    # (exact, a power of two) and round to an integer with the 2^23 trick (RNE in fp32).
    units = tl.abs(y) * (2.0 ** (FP8_BIAS - 1 + FP8_MANT))
    subnormal = ((units + 8388608.0) - 8388608.0).to(tl.int32)
    min_normal: tl.constexpr = 2.0 ** (1 - FP8_BIAS)
    return (tl.where(tl.abs(y) < min_normal, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def _cast_to_fp8_bytes(x, scale, FP8_MAX, OUT_DTYPE: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
                       FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    """Saturating fp8 cast of x / scale (fp32 in, broadcasting scale), returned as bytes:
    a NaN scale gives its group NaN bytes, and an infinite element its sign, +-1.0 (its
    group's scale is +inf, so its finite elements divide to +-0)."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    nan_group = scale != scale
    infinite = tl.abs(x) == float("inf")
    if SOFTWARE_CAST:
        q = _fp8_bits_software(tl.where(nan_group, 0.0, tl.where(infinite, 0.0, y)), FP8_MANT, FP8_BIAS)
    else:
        q = y.to(OUT_DTYPE).to(tl.uint8, bitcast=True)
    if FP8_MANT == 3:
        one = 0x38  # the bits of 1.0: e4m3
    else:
        one = 0x3C  # e5m2
    q = tl.where(infinite, tl.where(x < 0, 0x80 + one, one), q.to(tl.int32))
    return tl.where(nan_group, _NAN_BYTE, q).to(tl.uint8)


@triton.jit
def _tensorwise_bytes(x, q, FP8_MANT: tl.constexpr):
    """The bytes q of x cast with a scale from the finite values, each non-finite element
    by itself: NaN, or +-inf in e5m2 (which has infinities)."""
    infinite = tl.abs(x) == float("inf")
    if FP8_MANT == 2:
        q = tl.where(infinite, tl.where(x < 0, 0x80 + _E5M2_INF_BYTE, _E5M2_INF_BYTE), q.to(tl.int32))
    else:
        q = tl.where(infinite, _NAN_BYTE, q.to(tl.int32))
    return tl.where(x != x, _NAN_BYTE, q).to(tl.uint8)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _quantize_rows_kernel(
    x_ptr,          # [R, C] input, any strides
    q_ptr,          # [R, C] uint8 view of the fp8 output, any strides
    scale_ptr,      # [R] fp32
    R, C,
    stride_xr, stride_xc, stride_qr, stride_qc,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    SINGLE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One scale per row of a logical [R, C] view (reduction over C)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    x_rows = x_ptr + rows[:, None] * stride_xr
    q_rows = q_ptr + rows[:, None] * stride_qr
    cols = tl.arange(0, BLOCK_C)
    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < C)
        x = tl.load(x_rows + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
        amax = _amax(x, 1)
        scale = _scale_from_amax(amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        q = _cast_to_fp8_bytes(x, scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
        tl.store(q_rows + cols[None, :] * stride_qc, q, mask=mask)
    else:
        amax_bits = tl.zeros([BLOCK_R], dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cols
            mask = row_mask[:, None] & (c[None, :] < C)
            x = tl.load(x_rows + c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
            amax_bits = tl.maximum(amax_bits, tl.max(_magnitude_bits(x), axis=1))
        scale = _scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cols
            mask = row_mask[:, None] & (c[None, :] < C)
            x = tl.load(x_rows + c[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
            q = _cast_to_fp8_bytes(x, scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
            tl.store(q_rows + c[None, :] * stride_qc, q, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _rows_amax_kernel(
    x_ptr,          # [R, C] input, any strides
    amax_ptr,       # [R] int32: bits of each row's running fp32 amax, zero-initialised
    R, C, stride_xr, stride_xc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, C_TILES: tl.constexpr,
):
    """Split-reduction row amax: a program walks C_TILES tiles along C, then one atomic
    per row (on `_magnitude_bits`: the integer max is exact, NaN above inf)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    c0 = tl.program_id(1).to(tl.int64) * (BLOCK_C * C_TILES)
    acc = tl.zeros([BLOCK_R], dtype=tl.int32)
    for t in range(C_TILES):
        cols = c0 + t * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(_magnitude_bits(x.to(tl.float32)), axis=1))
    tl.atomic_max(amax_ptr + rows, acc, mask=row_mask)


@triton.jit
def _rows_cast_kernel(
    x_ptr,          # [R, C] input, any strides
    q_ptr,          # [R, C] uint8 view of the fp8 output, any strides
    amax_ptr,       # [R] int32 bits from _rows_amax_kernel
    scale_ptr,      # [R] fp32
    R, C, stride_xr, stride_xc, stride_qr, stride_qc,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < R
    amax = tl.load(amax_ptr + rows, mask=row_mask, other=0).to(tl.float32, bitcast=True)
    scale = _scale_from_amax(amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
    mask = row_mask[:, None] & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    q = _cast_to_fp8_bytes(x.to(tl.float32), scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :] * stride_qc, q, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _amax_flat_kernel(
    x_ptr,          # [N] contiguous input
    amax_ptr,       # [1] int32: bits of the running fp32 amax, zero-initialised
    N, ITERS,
    BLOCK: tl.constexpr,
):
    """Grid-stride amax of a flat tensor's finite values (the tensorwise policy); one
    atomic per program. Non-negative fp32 values order like their int32 bits, so an
    integer atomic max is exact."""
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(0, ITERS):
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.where(_is_finite(x), tl.abs(x), 0.0))
        offs += step
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _cast_tensorwise_kernel(
    x_ptr,          # [N] contiguous input
    q_ptr,          # [N] uint8 view of the fp8 output
    amax_ptr,       # [1] int32 bits of the amax from _amax_flat_kernel
    scale_ptr,      # [] fp32 output scale
    N,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    scale = _scale_from_amax(amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = _cast_to_fp8_bytes(x, scale, FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
    tl.store(q_ptr + offs, _tensorwise_bytes(x, q, FP8_MANT), mask=mask)
    if pid == 0:
        tl.store(scale_ptr, scale)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,          # [R, C] input, any strides
    q_ptr,          # [R, C] uint8 view of the fp8 output, any strides
    scale_ptr,      # [ceil(R / GROUP_R), ceil(C / GROUP_C)] fp32, row-major
    R, C, n_col_groups,
    stride_xr, stride_xc, stride_qr, stride_qc,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    GROUP_R: tl.constexpr, GROUP_C: tl.constexpr, TILE_R: tl.constexpr,
):
    """One scale per [GROUP_R, GROUP_C] tile. GROUP_R == 1: a tile of TILE_R rows holds
    TILE_R groups; otherwise TILE_R == GROUP_R and the tile is one group."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r.to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c.to(tl.int64) * GROUP_C + tl.arange(0, GROUP_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    # Scales from the finite values, each non-finite element by itself (`_tensorwise_bytes`).
    row_amax = tl.max(tl.where(_is_finite(x), tl.abs(x), 0.0), axis=1)
    if GROUP_R == 1:
        scale = _scale_from_amax(row_amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        q = _cast_to_fp8_bytes(x, scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
        tl.store(scale_ptr + rows * n_col_groups + pid_c, scale, mask=rows < R)
    else:
        scale = _scale_from_amax(tl.max(row_amax, axis=0), FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        q = _cast_to_fp8_bytes(x, scale, FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
        tl.store(scale_ptr + pid_r * n_col_groups + pid_c, scale)
    q = _tensorwise_bytes(x, q, FP8_MANT)
    tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :] * stride_qc, q, mask=mask)


@triton.jit
def _dual_amax_kernel(
    x_ptr,          # [M, K] row-major input
    row_amax_ptr,   # [M] int32 bits, zero-initialised
    col_amax_ptr,   # [K] int32 bits, zero-initialised
    M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr,
):
    """Row and column amax in one read: a program walks ROW_TILES tiles down a column
    strip, one atomic per (row, strip) and one per (column, program)."""
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask = cols < K
    col_acc = tl.zeros([BLOCK_K], dtype=tl.int32)
    row0 = tl.program_id(0).to(tl.int64) * (BLOCK_M * ROW_TILES)
    for t in range(ROW_TILES):
        rows = row0 + t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        a = _magnitude_bits(x.to(tl.float32))
        # relaxed: only atomicity is needed, the next kernel reads the result
        tl.atomic_max(row_amax_ptr + rows, tl.max(a, axis=1), mask=row_mask, sem="relaxed")
        col_acc = tl.maximum(col_acc, tl.max(a, axis=0))
    tl.atomic_max(col_amax_ptr + cols, col_acc, mask=col_mask, sem="relaxed")


@triton.jit
def _dual_cast_kernel(
    x_ptr,          # [M, K] row-major input
    q_row_ptr,      # [M, K] uint8, row-major
    q_col_ptr,      # [M, K] uint8, column-major (element (m, k) at k * M + m)
    row_amax_ptr, col_amax_ptr,   # int32 bits from _dual_amax_kernel
    row_scale_ptr,  # [M] fp32
    col_scale_ptr,  # [K] fp32
    M, K, stride_xm,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < K
    row_amax = tl.load(row_amax_ptr + rows, mask=row_mask, other=0).to(tl.float32, bitcast=True)
    col_amax = tl.load(col_amax_ptr + cols, mask=col_mask, other=0).to(tl.float32, bitcast=True)
    row_scale = _scale_from_amax(row_amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
    col_scale = _scale_from_amax(col_amax, FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q_row = _cast_to_fp8_bytes(x, row_scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
    q_col = _cast_to_fp8_bytes(x, col_scale[None, :], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
    tl.store(q_row_ptr + rows[:, None] * K + cols[None, :], q_row, mask=mask)
    tl.store(q_col_ptr + cols[None, :] * M + rows[:, None], q_col, mask=mask)
    if pid_k == 0:
        tl.store(row_scale_ptr + rows, row_scale, mask=row_mask)
    if pid_m == 0:
        tl.store(col_scale_ptr + cols, col_scale, mask=col_mask)


# ---------------------------------------------------------------------------------------
# launch helpers
# ---------------------------------------------------------------------------------------

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _cuda_fp8_conversion(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether Triton kernels can run on t's device at all: CUDA, or CPU under the interpreter."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


def use_triton(t: torch.Tensor) -> bool:
    """Whether the FP8 Triton kernels can run on t's device (else the op runs the reference)."""
    if t.device.type == "cuda":
        return interpreting() or _cuda_fp8_conversion(t.device.index or 0)
    return triton_runs_on(t)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    # The interpreter runs programs one by one; a small grid keeps it fast.
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _fp32_reciprocal(value: float) -> float:
    """1 / value rounded to fp32, as CUDA's scalar division computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32))


def format_args(fmt: Fp8Format, device: torch.device) -> dict:
    """Kernel arguments that make the scale match the reference on `device`."""
    return dict(
        FP8_MAX=fmt.max,
        INV_FP8_MAX=_fp32_reciprocal(fmt.max),
        OUT_DTYPE=tl.float8e4nv if fmt is Fp8Format.E4M3 else tl.float8e5,
        RECIPROCAL=device.type == "cuda",
        SOFTWARE_CAST=interpreting(),
        FP8_MANT=3 if fmt is Fp8Format.E4M3 else 2,
        FP8_BIAS=7 if fmt is Fp8Format.E4M3 else 15,
    )


def parse_format(fmt) -> Fp8Format:
    try:
        return Fp8Format(fmt)
    except ValueError:
        raise ValueError(f"unknown fp8 format {fmt!r}; valid: {[f.value for f in Fp8Format]}") from None


_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_input(x: torch.Tensor, what: str, dims: Optional[int] = 2) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{what}: input dtype must be one of {_INPUT_DTYPES}, got {x.dtype}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{what}: expects a {dims}-D tensor, got shape {tuple(x.shape)}")


def is_row_or_column_major(x: torch.Tensor) -> bool:
    """Whether a 2-D x is dense in row-major or column-major order (the layouts these
    kernels read)."""
    rows, cols = x.shape
    row_major = x.stride(1) == 1 and (x.stride(0) == cols or rows <= 1)
    col_major = x.stride(0) == 1 and (x.stride(1) == rows or cols <= 1)
    return row_major or col_major


def _check_row_or_column_major(x: torch.Tensor, what: str) -> None:
    if not is_row_or_column_major(x):
        raise ValueError(f"{what}: x must be row-major or column-major contiguous, got strides "
                         f"{x.stride()} for shape {tuple(x.shape)}; call .contiguous() first")


def _empty_fp8_like(x: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp8 tensor with x's shape and layout (row- or column-major)."""
    return torch.empty_like(x, dtype=fmt.dtype)


OUT_MAJORS = (None, "row", "column")


def _empty_fp8(x: torch.Tensor, fmt: Fp8Format, out_major: Optional[str]) -> torch.Tensor:
    """fp8 tensor of x's 2-D shape: x's layout (out_major None), row- or column-major."""
    if out_major not in OUT_MAJORS:
        raise ValueError(f"out_major must be one of {OUT_MAJORS}, got {out_major!r}")
    if out_major is None:
        return _empty_fp8_like(x, fmt)
    rows, cols = x.shape
    if out_major == "row":
        return torch.empty((rows, cols), dtype=fmt.dtype, device=x.device)
    return torch.empty((cols, rows), dtype=fmt.dtype, device=x.device).t()


def _rows_config(view_stride_c: int, n_cols: int, out_stride_c: int = 1) -> Optional[dict]:
    """Tile shape for `_quantize_rows_kernel` on a logical [R, C] view, or None where the
    split-reduction kernels serve better: a strided reduction axis (columnwise on a
    row-major tensor, or the grad-weight operand X^T), a transposing cast, or rows longer
    than one program holds. A program per row (block) would leave few programs walking
    long rows there: the grad-weight operand of a [32768, 256] activation has 256 rows."""
    if view_stride_c == 1 and out_stride_c == 1 and triton.next_power_of_2(n_cols) <= MAX_SINGLE_PASS_COLS:
        block_c = triton.next_power_of_2(n_cols)
        # About 2048+ elements per program, 4 warps up to 4096: the fastest of the tilings
        # timed (docs/kernels.md).
        block_r = max(1, min(64, 2048 // block_c))
        return dict(BLOCK_R=block_r, BLOCK_C=block_c, SINGLE_PASS=True,
                    num_warps=4 if block_c <= 4096 else 8)
    return None


# Split-reduction tiles: 64x64 keeps loads and stores coalesced along whichever axis is
# contiguous; the amax pass walks SPLIT_C_TILES tiles per program before its atomics.
SPLIT_BLOCK = 64
SPLIT_C_TILES = 8


def _launch_rows_split(view_x, view_q, scale, fmt, power_of_two) -> None:
    rows, cols = view_x.shape
    amax_bits = torch.zeros(rows, dtype=torch.int32, device=view_x.device)
    grid = (triton.cdiv(rows, SPLIT_BLOCK), triton.cdiv(cols, SPLIT_BLOCK * SPLIT_C_TILES))
    _rows_amax_kernel[grid](view_x, amax_bits, rows, cols, view_x.stride(0), view_x.stride(1),
                            BLOCK_R=SPLIT_BLOCK, BLOCK_C=SPLIT_BLOCK, C_TILES=SPLIT_C_TILES, num_warps=4)
    grid = (triton.cdiv(rows, SPLIT_BLOCK), triton.cdiv(cols, SPLIT_BLOCK))
    _rows_cast_kernel[grid](
        view_x, view_q.view(torch.uint8), amax_bits, scale, rows, cols,
        view_x.stride(0), view_x.stride(1), view_q.stride(0), view_q.stride(1),
        POW2=power_of_two, BLOCK_R=SPLIT_BLOCK, BLOCK_C=SPLIT_BLOCK, num_warps=4,
        **format_args(fmt, view_x.device))


def _launch_rows(view_x: torch.Tensor, view_q: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                 power_of_two: bool, config: Optional[dict]) -> None:
    rows, cols = view_x.shape
    cfg = dict(config) if config else _rows_config(view_x.stride(1), cols, view_q.stride(1) if rows > 1 and cols > 1 else 1)
    if cfg is None:
        _launch_rows_split(view_x, view_q, scale, fmt, power_of_two)
        return
    num_warps = cfg.pop("num_warps", 4)
    grid = (triton.cdiv(rows, cfg["BLOCK_R"]),)
    _quantize_rows_kernel[grid](
        view_x, view_q.view(torch.uint8), scale, rows, cols,
        view_x.stride(0), view_x.stride(1), view_q.stride(0), view_q.stride(1),
        POW2=power_of_two, num_warps=num_warps, **format_args(fmt, view_x.device), **cfg,
    )


# ---------------------------------------------------------------------------------------
# launchers (Python entry points; the ops below wrap them)
# ---------------------------------------------------------------------------------------

def quantize_rowwise_triton(x: torch.Tensor, fmt, power_of_two: bool = False,
                            config: Optional[dict] = None, out_major: Optional[str] = None):
    """x [M, K] -> (q [M, K], scale [M, 1] fp32). q has x's layout, or the one `out_major`
    names ("row" / "column"): the cast then also does the transposition a GEMM needs."""
    fmt = parse_format(fmt)
    check_input(x, "quantize_rowwise")
    _check_row_or_column_major(x, "quantize_rowwise")
    q = _empty_fp8(x, fmt, out_major)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.numel():
        _launch_rows(x, q, scale, fmt, power_of_two, config)
    else:
        scale.fill_(1.0)
    return q, scale


def quantize_columnwise_triton(x: torch.Tensor, fmt, power_of_two: bool = False,
                               config: Optional[dict] = None, out_major: Optional[str] = None):
    """x [K, N] -> (q [K, N], scale [1, N] fp32): one scale per column. q has x's layout,
    or the one `out_major` names ("row" / "column")."""
    fmt = parse_format(fmt)
    check_input(x, "quantize_columnwise")
    _check_row_or_column_major(x, "quantize_columnwise")
    q = _empty_fp8(x, fmt, out_major)
    scale = torch.empty((1, x.shape[1]), dtype=torch.float32, device=x.device)
    if x.numel():
        _launch_rows(x.t(), q.t(), scale, fmt, power_of_two, config)
    else:
        scale.fill_(1.0)
    return q, scale


# Tensorwise: 4096 elements per program (8 warps, 16 per thread) in both kernels: near copy
# bandwidth for the 5 bytes/element it reads and writes (docs/kernels.md).
TENSORWISE_BLOCK = 4096


def quantize_tensorwise_triton(x: torch.Tensor, fmt, power_of_two: bool = False,
                               amax_programs_per_sm: int = 4):
    """x (any shape, contiguous) -> (q like x, 0-d fp32 scale). Two launches and one
    4-byte memset; the amax never leaves the device."""
    fmt = parse_format(fmt)
    check_input(x, "quantize_tensorwise", dims=None)
    if not x.is_contiguous():
        raise ValueError(f"quantize_tensorwise: x must be contiguous, got strides {x.stride()}")
    q = torch.empty_like(x, dtype=fmt.dtype, memory_format=torch.contiguous_format)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    n = x.numel()
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        blocks = triton.cdiv(n, TENSORWISE_BLOCK)
        programs = min(blocks, amax_programs_per_sm * sm_count(x.device))
        _amax_flat_kernel[(programs,)](x, amax_bits, n, triton.cdiv(blocks, programs),
                                       BLOCK=TENSORWISE_BLOCK, num_warps=8)
        _cast_tensorwise_kernel[(blocks,)](
            x, q.view(torch.uint8), amax_bits, scale, n, POW2=power_of_two,
            BLOCK=TENSORWISE_BLOCK, num_warps=8, **format_args(fmt, x.device))
    else:
        scale.fill_(1.0)
    return q, scale


def _check_group(n: int, what: str, allow_one: bool) -> None:
    ok = (n == 1 and allow_one) or (16 <= n <= 256 and n & (n - 1) == 0)
    if not ok:
        raise ValueError(f"quantize_blockwise: {what} must be a power of two in [16, 256]"
                         f"{' or 1' if allow_one else ''}, got {n}")


def quantize_blockwise_triton(x: torch.Tensor, block_rows: int, block_cols: int, fmt,
                              power_of_two: bool = False, tile_rows: int = 32,
                              out_major: Optional[str] = None):
    """x [R, C] -> (q, scale [ceil(R/br), ceil(C/bc)]). 1x128 on activations, 128x128 on
    weights. q has x's layout, or the one `out_major` names ("row" / "column")."""
    fmt = parse_format(fmt)
    check_input(x, "quantize_blockwise")
    _check_row_or_column_major(x, "quantize_blockwise")
    _check_group(block_rows, "block_rows", allow_one=True)
    _check_group(block_cols, "block_cols", allow_one=False)
    rows, cols = x.shape
    n_rb, n_cb = triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols)
    q = _empty_fp8(x, fmt, out_major)
    scale = torch.empty((n_rb, n_cb), dtype=torch.float32, device=x.device)
    if x.numel():
        tile_r = tile_rows if block_rows == 1 else block_rows
        grid = (triton.cdiv(rows, tile_r), n_cb)
        _quantize_blocks_kernel[grid](
            x, q.view(torch.uint8), scale, rows, cols, n_cb,
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), POW2=power_of_two,
            GROUP_R=block_rows, GROUP_C=block_cols, TILE_R=tile_r,
            num_warps=8 if tile_r * block_cols >= 8192 else 4, **format_args(fmt, x.device))
    return q, scale


# Dual-axis defaults: amax tiles 32x128 walking 8 tiles (256 rows) per program; cast
# tiles 64x64 (each fp8 output is written coalesced along its own contiguous axis).
# The cast tiles tie for fastest of those timed (docs/kernels.md).
DUAL_AMAX_CONFIG = dict(BLOCK_M=32, BLOCK_K=128, ROW_TILES=8, num_warps=4)
# Programs per SM the amax pass keeps before it walks several row tiles per program: a
# program's tiles load one after another, so on a small grid the walk is all latency
# (docs/kernels.md).
DUAL_AMAX_PROGRAMS_PER_SM = 2


def _dual_amax_row_tiles(rows: int, cols: int, cfg: dict, device: torch.device) -> int:
    """Row tiles per program: up to cfg's ROW_TILES, as many as leave every SM
    DUAL_AMAX_PROGRAMS_PER_SM programs (fewer atomics on tall inputs, no serial walk on
    small ones)."""
    tiles = triton.cdiv(rows, cfg["BLOCK_M"]) * triton.cdiv(cols, cfg["BLOCK_K"])
    return max(1, min(cfg["ROW_TILES"], tiles // (DUAL_AMAX_PROGRAMS_PER_SM * sm_count(device))))
DUAL_CAST_CONFIG = dict(BLOCK_M=64, BLOCK_K=64, num_warps=4)


def quantize_dual_axis_triton(x: torch.Tensor, fmt, power_of_two: bool = False,
                              amax_config: Optional[dict] = None, cast_config: Optional[dict] = None):
    """x [M, K] row-major -> (q_row [M, K] row-major, row_scale [M, 1],
    q_col [M, K] column-major, col_scale [1, K]).

    q_row/row_scale equal quantize_along(x, -1); q_col/col_scale equal
    quantize_along(x, -2). A per-column scale spans all M rows, so no column can be cast
    before the whole of x has been seen: x is read twice (amax of both axes in one read,
    then both casts in one read), against three reads for the two casts done apart."""
    fmt = parse_format(fmt)
    check_input(x, "quantize_dual_axis")
    rows, cols = x.shape
    if not x.is_contiguous():  # the kernels read x.stride(0) and a unit column stride
        raise ValueError(f"quantize_dual_axis: x must be row-major contiguous, got strides {x.stride()}")
    q_row = torch.empty((rows, cols), dtype=fmt.dtype, device=x.device)
    q_col = torch.empty((cols, rows), dtype=fmt.dtype, device=x.device).t()
    row_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    col_scale = torch.empty((1, cols), dtype=torch.float32, device=x.device)
    if not x.numel():
        row_scale.fill_(1.0)
        col_scale.fill_(1.0)
        return q_row, row_scale, q_col, col_scale
    amax_bits = torch.zeros(rows + cols, dtype=torch.int32, device=x.device)
    row_amax, col_amax = amax_bits[:rows], amax_bits[rows:]
    a_cfg = dict(amax_config or DUAL_AMAX_CONFIG)
    if amax_config is None:
        a_cfg["ROW_TILES"] = _dual_amax_row_tiles(rows, cols, a_cfg, x.device)
    a_warps = a_cfg.pop("num_warps", 4)
    grid = (triton.cdiv(rows, a_cfg["BLOCK_M"] * a_cfg["ROW_TILES"]), triton.cdiv(cols, a_cfg["BLOCK_K"]))
    _dual_amax_kernel[grid](x, row_amax, col_amax, rows, cols, x.stride(0), num_warps=a_warps, **a_cfg)
    c_cfg = dict(cast_config or DUAL_CAST_CONFIG)
    c_warps = c_cfg.pop("num_warps", 4)
    grid = (triton.cdiv(rows, c_cfg["BLOCK_M"]), triton.cdiv(cols, c_cfg["BLOCK_K"]))
    _dual_cast_kernel[grid](
        x, q_row.view(torch.uint8), q_col.view(torch.uint8), row_amax, col_amax, row_scale, col_scale,
        rows, cols, x.stride(0), POW2=power_of_two, num_warps=c_warps,
        **c_cfg, **format_args(fmt, x.device))
    return q_row, row_scale, q_col, col_scale


# ---------------------------------------------------------------------------------------
# pure-PyTorch references (the ones in quantize.py, in the ops' output layouts)
# ---------------------------------------------------------------------------------------

def _into_layout(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(like)
    out.copy_(value)
    return out


def quantize_rowwise_reference(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    q, scale = quantize_along(x, -1, fmt, power_of_two)
    return _into_layout(_empty_fp8_like(x, fmt), q), scale


def quantize_columnwise_reference(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    q, scale = quantize_along(x, -2, fmt, power_of_two)
    return _into_layout(_empty_fp8_like(x, fmt), q), scale


def quantize_tensorwise_reference(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    q, scale = reference_quantize_tensorwise(x, fmt, power_of_two)
    return q.contiguous(), scale


def quantize_blockwise_reference(x, block_rows, block_cols, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    q, scale = reference_quantize_blockwise(x, block_rows, block_cols, fmt, power_of_two)
    return _into_layout(_empty_fp8_like(x, fmt), q), scale


def quantize_dual_axis_reference(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    q_row, row_scale = quantize_along(x, -1, fmt, power_of_two)
    q_col, col_scale = quantize_along(x, -2, fmt, power_of_two)
    q_col_t = torch.empty((x.shape[1], x.shape[0]), dtype=fmt.dtype, device=x.device).t()
    q_col_t.copy_(q_col)
    return q_row.contiguous(), row_scale, q_col_t, col_scale


# ---------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------

@torch.library.custom_op("loka::quantize_rowwise", mutates_args=())
def quantize_rowwise(x: torch.Tensor, fmt: str, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of x [M, K]: (q [M, K] in x's layout, scale [M, 1])."""
    if use_triton(x):
        return quantize_rowwise_triton(x, fmt, power_of_two)
    check_input(x, "quantize_rowwise")
    _check_row_or_column_major(x, "quantize_rowwise")
    return quantize_rowwise_reference(x, fmt, power_of_two)


@quantize_rowwise.register_fake
def _(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    check_input(x, "quantize_rowwise")
    return _empty_fp8_like(x, fmt), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("loka::quantize_columnwise", mutates_args=())
def quantize_columnwise(x: torch.Tensor, fmt: str, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per column of x [K, N] (a B operand): (q [K, N] in x's layout, scale [1, N])."""
    if use_triton(x):
        return quantize_columnwise_triton(x, fmt, power_of_two)
    check_input(x, "quantize_columnwise")
    _check_row_or_column_major(x, "quantize_columnwise")
    return quantize_columnwise_reference(x, fmt, power_of_two)


@quantize_columnwise.register_fake
def _(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    check_input(x, "quantize_columnwise")
    return _empty_fp8_like(x, fmt), x.new_empty((1, x.shape[1]), dtype=torch.float32)


@torch.library.custom_op("loka::quantize_tensorwise", mutates_args=())
def quantize_tensorwise(x: torch.Tensor, fmt: str, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of x (contiguous): (q like x, 0-d scale), no host sync."""
    if use_triton(x):
        return quantize_tensorwise_triton(x, fmt, power_of_two)
    check_input(x, "quantize_tensorwise", dims=None)
    return quantize_tensorwise_reference(x, fmt, power_of_two)


@quantize_tensorwise.register_fake
def _(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    check_input(x, "quantize_tensorwise", dims=None)
    q = torch.empty_like(x, dtype=fmt.dtype, memory_format=torch.contiguous_format)
    return q, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("loka::quantize_blockwise", mutates_args=())
def quantize_blockwise(x: torch.Tensor, block_rows: int, block_cols: int, fmt: str,
                       power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per [block_rows, block_cols] tile of x [R, C]: (q in x's layout,
    scale [ceil(R/br), ceil(C/bc)])."""
    if use_triton(x):
        return quantize_blockwise_triton(x, block_rows, block_cols, fmt, power_of_two)
    check_input(x, "quantize_blockwise")
    _check_row_or_column_major(x, "quantize_blockwise")
    return quantize_blockwise_reference(x, block_rows, block_cols, fmt, power_of_two)


@quantize_blockwise.register_fake
def _(x, block_rows, block_cols, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    check_input(x, "quantize_blockwise")
    n_rb = -(-x.shape[0] // block_rows)
    n_cb = -(-x.shape[1] // block_cols)
    return _empty_fp8_like(x, fmt), x.new_empty((n_rb, n_cb), dtype=torch.float32)


# Defined through torch.library.Library rather than custom_op, as `triton_fp8_gemm` is: the
# weight_both_layouts Mod puts this op in every FP8 training forward, and custom_op's Python
# autograd layer is host time at every call of a graph run without CUDA graphs (docs/kernels.md
# has the measurement). It has no autograd formula: FP8 copies carry no gradient.
_DUAL_AXIS_LIB = torch.library.Library("loka", "FRAGMENT")
_DUAL_AXIS_LIB.define("quantize_dual_axis(Tensor x, str fmt, bool power_of_two=False) "
                      "-> (Tensor, Tensor, Tensor, Tensor)")


def quantize_dual_axis(x: torch.Tensor, fmt: str, power_of_two: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] row-major -> (q_row row-major, scale [M, 1], q_col column-major, scale [1, K])."""
    if use_triton(x):
        return quantize_dual_axis_triton(x, fmt, power_of_two)
    check_input(x, "quantize_dual_axis")
    if not x.is_contiguous():
        raise ValueError(f"quantize_dual_axis: x must be row-major contiguous, got strides {x.stride()}")
    return quantize_dual_axis_reference(x, fmt, power_of_two)


for _key in ("CPU", "CUDA"):
    _DUAL_AXIS_LIB.impl("quantize_dual_axis", quantize_dual_axis, _key)


@torch.library.register_fake("loka::quantize_dual_axis", lib=_DUAL_AXIS_LIB)
def _(x, fmt, power_of_two=False):
    fmt = parse_format(fmt)
    check_input(x, "quantize_dual_axis")
    rows, cols = x.shape
    return (x.new_empty((rows, cols), dtype=fmt.dtype), x.new_empty((rows, 1), dtype=torch.float32),
            x.new_empty((cols, rows), dtype=fmt.dtype).t(), x.new_empty((1, cols), dtype=torch.float32))
