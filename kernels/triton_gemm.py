"""FP8 GEMM in Triton: scaled FP8 operands, fp32 accumulation, fused epilogue.

    out[M, N] = act(dequant(A) @ dequant(B) + bias) + residual, cast to out_dtype

A is [M, K], B is [K, N], both float8 (e4m3 or e5m2, in any pairing: e5m2 is for gradient
operands). Scales follow `quantize.py` (`x ~= q.float() * scale`) and `scaling`:

- tensorwise: one fp32 scale per operand (0-d, or any single-element tensor);
- rowwise: A scale [M, 1] (one per row), B scale [1, N] (one per column);
- blockwise: A scale [M, ceil(K/128)] (1x128 tiles), B scale [ceil(K/128), ceil(N/128)]
  (128x128 tiles).

Batched (bmm/baddbmm sites): A [B, M, K] @ B [B, K, N] -> [B, M, N], the pointer kernel
only. Tensorwise keeps one scale per operand for the whole batch (what
`scaled_gemm.cast_operand` gives a 3-D operand: one amax over all of it); rowwise and
blockwise scales are the 2-D shapes prefixed by B ([B, M, 1] and [B, 1, N] rowwise), one
set per matrix of the batch. The bias broadcasts to the output as addmm's and baddbmm's
does ([N], [1, N], [M, N], [B, 1, N], [B, M, N], ...); the residual is the output's shape.

Layouts: each operand may be row-major or column-major (a transposed view); the kernels
take strides, so the forward (A row-major, B = W^T column-major), grad-input and
grad-weight GEMMs run without transposed copies. FP8 tensor cores read K-major operands
only, so a non-K-major operand is transposed on chip, which is slow: the grad-weight
layout (A = dY^T view, B = X row-major) runs well below `_scaled_mm` even counting its two
layout copies (docs/kernels.md). Producers should emit wgrad operands K-major (quantize into
a transposed buffer) and call this in the forward layout.

Epilogue (in this order, in fp32): scales, + bias [N], activation, + residual [M, N],
cast. Activations: none, relu, silu, gelu (exact, erf), gelu_tanh (tanh approximation,
as `F.gelu(approximate="tanh")`), hardswish.

Two kernels share the epilogue:
- `_fp8_gemm_tma_kernel` (Hopper, sm90+): operand tiles through TMA descriptors made on
  the host (`triton.tools.tensor_descriptor.TensorDescriptor`), tiles walked by a grid of
  at most CTAS_PER_SM programs per SM (persistent when 1), output through a TMA store.
  Needs 16-byte aligned operand strides, base pointers and output rows.
- `_fp8_gemm_ptr_kernel`: pointer loads with masks; any strides, any K and N, an
  optional batch (one flat program id over batch x tiles). Used on sm89, for misaligned
  or batched operands, and by default under the interpreter.

Accumulation: by default each BLOCK_K step's (128 or 256 of K) tensor-core product is
added into the fp32 accumulator by a separate fp32 add, as cuBLAS does without fast
accumulation (it promotes every 128); with
`fast_accum=True` the tensor cores accumulate across K in their own reduced precision
(Hopper's FP8 "fast accumulation", cuBLAS `use_fast_accum=True`). Blockwise scaling
always promotes per step, since each K block has its own scales.

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1 set before triton
is first imported); without it, on CPU, the op computes `reference_fp8_gemm` so it works
everywhere. Autotuning is bypassed under the interpreter (a fixed small config).

Host time: several times `_scaled_mm`'s per call (Python checks, three TMA descriptors,
Triton's launcher; docs/kernels.md), so short GEMMs are host-bound unless captured in a CUDA
graph (mode="reduce-overhead").
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .providers import GemmProvider, has_fp8_hardware, names as provider_names, register
from .quantize import Fp8Format, Scaling, cast_with_scale
from .triton_quant import _NAN_BYTE, _fp8_bits_software

SCALE_BLOCK = 128  # blockwise scaling tile: 1x128 on A, 128x128 on B (along K and N)

_SCALING_CODES = {Scaling.TENSORWISE: 0, Scaling.ROWWISE: 1, Scaling.BLOCKWISE: 2}
ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2, "gelu": 3, "gelu_tanh": 4, "hardswish": 5}
IMPLS = ("auto", "tma", "pointer")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_EPILOGUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles in a row reuse the same B column tiles from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


# Accumulation modes (ACCUM constexpr). FP8 tensor cores on Hopper accumulate in reduced
# precision; "promotion" adds their partial sums into a true fp32 accumulator.
ACCUM_FAST = 0          # no promotion (cuBLAS use_fast_accum=True)
ACCUM_PROMOTE_ADD = 1   # partial sum of each BLOCK_K step added in fp32 by the kernel
ACCUM_PROMOTE_MMA = 2   # the same through tl.dot(max_num_imprecise_acc=BLOCK_K)
# The two promotions cost the same, about a quarter of fast accumulation's throughput;
# promoting once per two steps inside one loop iteration was slower and was dropped
# (docs/kernels.md).
ACCUM_MODES = {"fast": ACCUM_FAST, "promote_add": ACCUM_PROMOTE_ADD, "promote_mma": ACCUM_PROMOTE_MMA}


@triton.jit
def _accumulate(acc, a, b, k_start, off_n, offs_m, offs_n, M, N,
                a_scale_ptr, b_scale_ptr, stride_asm, stride_ask, stride_bsk, stride_bsn,
                SCALING: tl.constexpr, ACCUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SCALE_BLOCK: tl.constexpr):
    """acc[BM, BN] (fp32) += a[BM, BK] @ b[BK, BN]; blockwise applies this K block's scales."""
    if SCALING == 2:
        kb = k_start // SCALE_BLOCK
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm + kb * stride_ask, mask=offs_m < M, other=0.0)
        if BLOCK_N <= SCALE_BLOCK:
            # The tile lies inside one 128-column block of B: one B scale, one multiply per element.
            b_s = tl.load(b_scale_ptr + kb * stride_bsk + (off_n // SCALE_BLOCK) * stride_bsn)
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            b_s = tl.load(b_scale_ptr + kb * stride_bsk + (offs_n // SCALE_BLOCK) * stride_bsn,
                          mask=offs_n < N, other=0.0)
            acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
    elif ACCUM == 0:
        acc = tl.dot(a, b, acc)
    elif ACCUM == 2:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc += tl.dot(a, b)
    return acc


@triton.jit
def _load_tiles(a_desc, b_desc, off_m, off_n, off_k, A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """a [BM, BK] and b [BK, BN] tiles; parts past the M, N, K edges arrive as zeros."""
    if A_K_MAJOR:
        a = a_desc.load([off_m, off_k])
    else:
        a = a_desc.load([off_k, off_m]).T
    if B_K_MAJOR:
        b = b_desc.load([off_n, off_k]).T
    else:
        b = b_desc.load([off_k, off_n])
    return a, b


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # relu
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:  # silu
        x = x * tl.sigmoid(x)
    elif ACTIVATION == 3:  # gelu, exact
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == 4:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * tl.sigmoid(2.0 * inner)
    elif ACTIVATION == 5:  # hardswish
        x = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)
    return x


@triton.jit
def _epilogue_values(acc, offs_m, offs_n, M, N,
                     a_scale_ptr, b_scale_ptr, stride_asm, stride_bsn,
                     bias_ptr, stride_bias_m, stride_bias, residual_ptr, stride_rm, stride_rn,
                     SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr):
    """fp32 tile [BM, BN] of act(acc * scales + bias) + residual; the bias is one [N] row
    unless BIAS_ROWS (a bias that varies along M, as baddbmm's may)."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    if SCALING == 0:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr))
    elif SCALING == 1:
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
        b_s = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        if BIAS_ROWS:
            bias = tl.load(bias_ptr + offs_m.to(tl.int64)[:, None] * stride_bias_m
                           + offs_n.to(tl.int64)[None, :] * stride_bias,
                           mask=mask_m[:, None] & mask_n[None, :], other=0.0)
            acc = acc + bias.to(tl.float32)
        else:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
    acc = _activation(acc, ACTIVATION)
    if HAS_RESIDUAL:
        rows = offs_m.to(tl.int64)[:, None]
        cols = offs_n.to(tl.int64)[None, :]
        residual = tl.load(residual_ptr + rows * stride_rm + cols * stride_rn,
                           mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        acc = acc + residual.to(tl.float32)
    return acc


@triton.jit
def _output_values(acc, offs_n, N, out_scale_ptr, stride_os, OUT_DTYPE: tl.constexpr, OUT_FP8: tl.constexpr,
                   OUT_FP8_MAX: tl.constexpr, SOFTWARE_CAST: tl.constexpr):
    """The tile in OUT_DTYPE. An FP8 output (OUT_FP8: 1 e4m3, 2 e5m2; 0 not FP8) is the
    next GEMM's operand: clamp(acc / out_scale) to +-OUT_FP8_MAX, inf and NaN to NaN, as
    `quantize.cast_with_scale(..., non_finite_to_nan=True)`; out_scale is one value
    (stride 0) or one per column. The division is a multiply by each column's reciprocal
    (within an fp32 ulp of acc / out_scale before the FP8 rounding): a correctly rounded
    division per element made the GEMM with FP8 output several times slower than with bf16
    output (docs/kernels.md).
    SOFTWARE_CAST: the interpreter's own fp8 conversion rounds half up and turns NaN into
    a number (triton 3.6), so the bits are computed."""
    if OUT_FP8 == 0:
        return acc.to(OUT_DTYPE)
    scale = tl.load(out_scale_ptr + offs_n * stride_os, mask=offs_n < N, other=1.0)
    y = acc * tl.div_rn(1.0, scale)[None, :]
    y = tl.minimum(tl.maximum(y, -OUT_FP8_MAX), OUT_FP8_MAX)
    finite = tl.abs(acc) < float("inf")  # NaN fails the compare too
    if SOFTWARE_CAST:
        y = tl.where(finite, y, 0.0)
        if OUT_FP8 == 1:
            bits = _fp8_bits_software(y, 3, 7)
        else:
            bits = _fp8_bits_software(y, 2, 15)
        return tl.where(finite, bits, _NAN_BYTE).to(tl.uint8).to(OUT_DTYPE, bitcast=True)
    return tl.where(finite, y, float("nan")).to(OUT_DTYPE)


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc,                    # A [M, K] fp8; tiles [BM, BK] if A_K_MAJOR else A^T [K, M], tiles [BK, BM]
    b_desc,                    # B [K, N] fp8; tiles of B^T [N, K], [BN, BK], if B_K_MAJOR else [BK, BN]
    out_desc,                  # [M, N] out dtype, row-major; tiles [BM, BN] (or [BM, BN / 2] with EPILOGUE_SUBTILE)
    a_scale_ptr, b_scale_ptr,  # fp32; shapes per SCALING (module docstring)
    bias_ptr,                  # [N] or unused
    residual_ptr,              # [M, N] or unused
    out_scale_ptr,             # fp32, one element or [N]; read only for an FP8 output
    M, N, K,
    M_BUCKET,                  # autotune key only: next power of two of M, capped
    stride_asm, stride_ask, stride_bsk, stride_bsn,
    stride_bias_m, stride_bias, stride_rm, stride_rn, stride_os,
    SCALING: tl.constexpr, ACCUM: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    OUT_FP8: tl.constexpr, OUT_FP8_MAX: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, CTAS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    # CTAS_PER_SM only sizes the launcher's grid; the tile loop strides by the grid size.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(0, k_tiles):
            off_k = ki * BLOCK_K
            a, b = _load_tiles(a_desc, b_desc, off_m, off_n, off_k, A_K_MAJOR, B_K_MAJOR)
            acc = _accumulate(acc, a, b, off_k, off_n, offs_m, offs_n, M, N,
                              a_scale_ptr, b_scale_ptr, stride_asm, stride_ask, stride_bsk, stride_bsn,
                              SCALING, ACCUM, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        # The store goes through shared memory and TMA (clipped at the M, N edges): no
        # per-element addresses in registers. Two half-width subtiles halve the epilogue's
        # live registers.
        if EPILOGUE_SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc_lo, acc_hi = tl.split(halves)
            offs_lo = off_n + tl.arange(0, BLOCK_N // 2)
            acc_lo = _epilogue_values(acc_lo, offs_m, offs_lo, M, N, a_scale_ptr, b_scale_ptr, stride_asm,
                                      stride_bsn, bias_ptr, stride_bias_m, stride_bias, residual_ptr, stride_rm,
                                      stride_rn, SCALING, HAS_BIAS, BIAS_ROWS, HAS_RESIDUAL, ACTIVATION)
            out_desc.store([off_m, off_n], _output_values(acc_lo, offs_lo, N, out_scale_ptr, stride_os,
                                                          out_desc.dtype, OUT_FP8, OUT_FP8_MAX, SOFTWARE_CAST))
            acc_hi = _epilogue_values(acc_hi, offs_m, offs_lo + BLOCK_N // 2, M, N, a_scale_ptr, b_scale_ptr,
                                      stride_asm, stride_bsn, bias_ptr, stride_bias_m, stride_bias, residual_ptr,
                                      stride_rm, stride_rn, SCALING, HAS_BIAS, BIAS_ROWS, HAS_RESIDUAL, ACTIVATION)
            out_desc.store([off_m, off_n + BLOCK_N // 2],
                           _output_values(acc_hi, offs_lo + BLOCK_N // 2, N, out_scale_ptr, stride_os,
                                          out_desc.dtype, OUT_FP8, OUT_FP8_MAX, SOFTWARE_CAST))
        else:
            acc = _epilogue_values(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, stride_asm, stride_bsn,
                                   bias_ptr, stride_bias_m, stride_bias, residual_ptr, stride_rm, stride_rn,
                                   SCALING, HAS_BIAS, BIAS_ROWS, HAS_RESIDUAL, ACTIVATION)
            out_desc.store([off_m, off_n], _output_values(acc, offs_n, N, out_scale_ptr, stride_os, out_desc.dtype,
                                                          OUT_FP8, OUT_FP8_MAX, SOFTWARE_CAST))


@triton.jit
def _pointer_main_loop(a_ptr, b_ptr, offs_m, offs_n, off_n, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn,
                       a_scale_ptr, b_scale_ptr, stride_asm, stride_ask, stride_bsk, stride_bsn,
                       SCALING: tl.constexpr, ACCUM: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALE_BLOCK: tl.constexpr):
    """fp32 acc [BM, BN] of A[offs_m, :] @ B[:, offs_n] by pointer loads (the pointer
    kernels' main loop). Rows and columns past the edge wrap onto valid ones, so loads
    need no M/N mask; callers do not store them."""
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = (offs_m % M).to(tl.int64)
    cols_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _accumulate(acc, a, b, ki * BLOCK_K, off_n, offs_m, offs_n, M, N,
                          a_scale_ptr, b_scale_ptr, stride_asm, stride_ask, stride_bsk, stride_bsn,
                          SCALING, ACCUM, BLOCK_N, BLOCK_K, SCALE_BLOCK)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _fp8_gemm_ptr_kernel(
    a_ptr,                     # A [BATCH, M, K] fp8, strides (stride_ab, stride_am, stride_ak)
    b_ptr,                     # B [BATCH, K, N] fp8, strides (stride_bb, stride_bk, stride_bn)
    out_ptr,                   # [BATCH, M, N] out dtype
    a_scale_ptr, b_scale_ptr,  # fp32; per batch, shapes per SCALING (module docstring)
    bias_ptr,                  # broadcast to [BATCH, M, N] by its strides, or unused
    residual_ptr,              # [BATCH, M, N] or unused
    out_scale_ptr,             # fp32, one element or [N]; read only for an FP8 output
    M, N, K,
    BATCH,                     # 1 for a 2-D GEMM (every batch stride 0)
    M_BUCKET, BATCH_BUCKET,    # autotune key only: next powers of two of M and BATCH, capped
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_ob, stride_om, stride_on,
    stride_asb, stride_asm, stride_ask, stride_bsb, stride_bsk, stride_bsn,
    stride_bias_b, stride_bias_m, stride_bias, stride_rb, stride_rm, stride_rn, stride_os,
    SCALING: tl.constexpr, ACCUM: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    OUT_FP8: tl.constexpr, OUT_FP8_MAX: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # One flat program id over batch x tiles (batch outermost): grid axis 0 takes 2^31 - 1
    # programs, axes 1 and 2 only 65535, fewer than an LRM batch of bmm's may need.
    tiles = num_pid_m * num_pid_n
    pid = tl.program_id(0)
    batch = (pid // tiles).to(tl.int64)
    pid_m, pid_n = _tile_coords(pid % tiles, num_pid_m, num_pid_n, GROUP_M)
    a_ptr += batch * stride_ab
    b_ptr += batch * stride_bb
    out_ptr += batch * stride_ob
    a_scale_ptr += batch * stride_asb
    b_scale_ptr += batch * stride_bsb
    bias_ptr += batch * stride_bias_b
    residual_ptr += batch * stride_rb
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _pointer_main_loop(a_ptr, b_ptr, offs_m, offs_n, pid_n * BLOCK_N, M, N, K,
                             stride_am, stride_ak, stride_bk, stride_bn,
                             a_scale_ptr, b_scale_ptr, stride_asm, stride_ask, stride_bsk, stride_bsn,
                             SCALING, ACCUM, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
    acc = _epilogue_values(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, stride_asm, stride_bsn,
                           bias_ptr, stride_bias_m, stride_bias, residual_ptr, stride_rm, stride_rn,
                           SCALING, HAS_BIAS, BIAS_ROWS, HAS_RESIDUAL, ACTIVATION)
    values = _output_values(acc, offs_n, N, out_scale_ptr, stride_os, out_ptr.dtype.element_ty, OUT_FP8,
                            OUT_FP8_MAX, SOFTWARE_CAST)
    rows = offs_m.to(tl.int64)[:, None]
    cols = offs_n.to(tl.int64)[None, :]
    tl.store(out_ptr + rows * stride_om + cols * stride_on, values,
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ---------------------------------------------------------------------------------------
# configs and autotuning
# ---------------------------------------------------------------------------------------

M_BUCKET_MAX = 16384  # batches above this share one tuning (LRM batches go to 32768)


def m_bucket(m: int) -> int:
    """Autotune key for M: next power of two, at least 16, capped, so that a changing
    batch size retunes only when it crosses a power of two."""
    return min(max(1 << (max(m, 1) - 1).bit_length(), 16), M_BUCKET_MAX)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tile configuration; `ctas_per_sm` applies to the TMA kernel only (0: one
    program per tile; 1: persistent, one program per SM)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    ctas_per_sm: int = 0
    flatten: bool = False
    epilogue_subtile: bool = False

    def kwargs(self, tma: bool) -> dict:
        kw = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, GROUP_M=self.group_m)
        if tma:
            kw.update(CTAS_PER_SM=self.ctas_per_sm, FLATTEN=self.flatten, EPILOGUE_SUBTILE=self.epilogue_subtile)
        return kw

    def triton_config(self, tma: bool) -> triton.Config:
        return triton.Config(self.kwargs(tma), num_warps=self.num_warps, num_stages=self.num_stages,
                             pre_hook=_set_descriptor_blocks if tma else None)


# Candidates for sm90 (132 SMs, 228 KB shared memory and 64K registers per SM). Each earns
# its place by the shapes the tuner picks it for; docs/kernels.md has its build figures,
# times and wins.
TMA_CONFIGS = [
    # Fast accumulation, large M and N (pruned for precise and blockwise: two fp32
    # accumulators of 128x256 spill); epilogue in two 128x128 halves.
    GemmConfig(128, 256, 128, num_warps=8, num_stages=3, ctas_per_sm=1, epilogue_subtile=True, flatten=True),
    # 256-deep K steps: promotion every 256 of K, half the promotion adds of BLOCK_K 128
    # (3 stages fill the shared memory).
    GemmConfig(128, 128, 256, num_warps=8, num_stages=3, ctas_per_sm=1, flatten=True),
    # The largest 128-deep tile holding two accumulators without spills; flattened tile
    # loop (next tile's loads overlap this tile's epilogue).
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4, ctas_per_sm=1, flatten=True),
    # Unflattened twin, for blockwise (flattened blockwise spills).
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4, ctas_per_sm=1),
    # Mid shapes: two CTAs share an SM, so one's promotion overlaps the other's MMA.
    GemmConfig(64, 128, 128, num_warps=4, num_stages=3),
    GemmConfig(128, 64, 128, num_warps=4, num_stages=3),
    # Small shapes.
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4),
]

# The pointer kernel (no TMA store): 72-233 registers, no spills, 64-131 KB, when strides
# are specialised (16-divisible) as they are at run time.
PTR_CONFIGS = [
    GemmConfig(128, 256, 128, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
    GemmConfig(128, 64, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4),
]

# Under the interpreter every program runs in Python: small tiles, no tuning. BLOCK_K 32
# divides the 128-wide scale blocks; 4 "SMs" make the TMA kernel loop over several tiles.
INTERPRETER_CONFIG = GemmConfig(32, 32, 32, num_warps=4, num_stages=1, group_m=2, ctas_per_sm=1)
INTERPRETER_SM_COUNT = 4

_AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "SCALING", "ACCUM", "HAS_BIAS", "HAS_RESIDUAL", "OUT_FP8"]
# Only the TMA kernel takes the operand-major flags, only the pointer kernel a batch;
# triton >= 3.7 rejects key names that are not arguments of the kernel being tuned.
_TMA_AUTOTUNE_KEY = _AUTOTUNE_KEY + ["A_K_MAJOR", "B_K_MAJOR"]
_PTR_AUTOTUNE_KEY = _AUTOTUNE_KEY + ["BATCH_BUCKET"]


def _autotune_bench(kernel_call, quantiles):
    # Short runs per candidate: tuning a new (M bucket, N, K) costs well under a second.
    # Known limit: each timed call includes the host's launch work, more than the L2 flush
    # between calls hides, so for short GEMMs the picks are noisy (docs/kernels.md). Timing
    # candidates inside a CUDA graph (triton.testing.do_bench_cudagraph) would fix it; not
    # yet run on a GPU.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _prune_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    blockwise = args["SCALING"] == 2
    two_accumulators = blockwise or args["ACCUM"] != ACCUM_FAST
    kept = []
    for c in configs:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        # Blockwise scaling reads one scale per 128 of K: BLOCK_K must divide 128.
        if blockwise and SCALE_BLOCK % bk:
            continue
        # A per-step accumulator beside the running one: above 128 fp32 registers per
        # thread for the pair, the build spills (128x256, 8 warps: 20-40 LDL).
        if two_accumulators and 2 * bm * bn > 128 * 32 * c.num_warps:
            continue
        if blockwise and c.kwargs.get("FLATTEN"):
            continue
        kept.append(c)
    return kept


def _set_descriptor_blocks(nargs):
    """Give the host-made TMA descriptors the tile shape of the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk] if nargs["A_K_MAJOR"] else [bk, bm]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_K_MAJOR"] else [bk, bn]
    nargs["out_desc"].block_shape = [bm, bn // 2 if nargs["EPILOGUE_SUBTILE"] else bn]


_ptr_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_fp8_gemm_ptr_kernel)
_ptr_kernel_tuned = triton.autotune(
    configs=[c.triton_config(tma=False) for c in PTR_CONFIGS], key=_PTR_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs}, do_bench=_autotune_bench,
)(_ptr_kernel)
_tma_kernel_tuned = triton.autotune(
    configs=[c.triton_config(tma=True) for c in TMA_CONFIGS], key=_TMA_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs}, do_bench=_autotune_bench,
)(_fp8_gemm_tma_kernel)


_last_launch: dict = {}


def last_launch_config() -> Optional[triton.Config]:
    """Tile config of the latest kernel launch (tuned or fixed), for benchmark records."""
    return _last_launch.get("config")


# ---------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------

def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def parse_scaling(scaling) -> Scaling:
    try:
        return Scaling(scaling)
    except ValueError:
        raise ValueError(f"unknown scaling {scaling!r}; valid: {[s.value for s in Scaling]}") from None


def infer_scaling(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> Scaling:
    """Scaling implied by the scale shapes (the provider interface passes no scaling).

    Rowwise is checked before blockwise: the two coincide only when K <= 128 and N == 1,
    where they compute the same product. Batched operands [B, M, K] @ [B, K, N] have
    their scales prefixed by B (module docstring)."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    lead = tuple(a.shape[:-2])
    if a_scale.numel() == 1 and b_scale.numel() == 1 and (m, n) != (1, 1):
        return Scaling.TENSORWISE
    if tuple(a_scale.shape) == (*lead, m, 1) and tuple(b_scale.shape) == (*lead, 1, n):
        return Scaling.ROWWISE
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    if tuple(a_scale.shape) == (*lead, m, kb) and tuple(b_scale.shape) == (*lead, kb, nb):
        return Scaling.BLOCKWISE
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        return Scaling.TENSORWISE
    raise ValueError(
        f"cannot tell the scaling from scale shapes {tuple(a_scale.shape)} and {tuple(b_scale.shape)} "
        f"for A {tuple(a.shape)} @ B {tuple(b.shape)}: expected single-element scales (tensorwise), "
        f"{[*lead, m, 1]} and {[*lead, 1, n]} (rowwise), or {[*lead, m, kb]} and {[*lead, kb, nb]} (blockwise)")


def _is_row_or_col_major(t: torch.Tensor) -> tuple:
    """(row_major, col_major) for a 2-D tensor, or for each matrix of a batched one (any
    batch stride); any leading stride is allowed (views of wider buffers), only the unit
    stride is required."""
    rows, cols = t.shape[-2:]
    row_major = t.stride(-1) == 1 or cols == 1
    col_major = t.stride(-2) == 1 or rows == 1
    return row_major, col_major


@dataclasses.dataclass(frozen=True)
class _Plan:
    m: int
    n: int
    k: int
    scaling: Scaling
    activation: int
    a_k_major: bool  # A row-major: K is its contiguous dim
    b_k_major: bool  # B column-major (B = W^T): K is its contiguous dim
    batch: Optional[int] = None  # B of batched operands [B, M, K] @ [B, K, N]; None for 2-D

    @property
    def out_shape(self) -> tuple:
        return (self.m, self.n) if self.batch is None else (self.batch, self.m, self.n)


def _check_args(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, impl,
                out_scale=None) -> _Plan:
    """Every check that needs no data (shared by the op and its fake)."""
    scaling = parse_scaling(scaling)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; valid: {sorted(ACTIVATIONS)}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid: {list(IMPLS)}")
    if out_dtype not in OUT_DTYPES + FP8_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES + FP8_DTYPES}, got {out_dtype}")
    if (out_dtype in FP8_DTYPES) != (out_scale is not None):
        raise ValueError(f"an FP8 out_dtype needs an out_scale, and out_scale an FP8 out_dtype; got out_dtype "
                         f"{out_dtype} with out_scale {'set' if out_scale is not None else 'None'}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"operand {name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
        if t.dim() not in (2, 3):
            raise ValueError(f"operand {name} must be 2-D, or 3-D (batched), got shape {tuple(t.shape)}")
    if a.dim() != b.dim():
        raise ValueError(f"operands must both be 2-D or both 3-D (batched), got A {tuple(a.shape)} @ "
                         f"B {tuple(b.shape)}")
    m, k = a.shape[-2:]
    k_b, n = b.shape[-2:]
    batch = a.shape[0] if a.dim() == 3 else None
    if batch is not None and b.shape[0] != batch:
        raise ValueError(f"batch sizes differ: A {tuple(a.shape)} @ B {tuple(b.shape)}")
    if k != k_b:
        raise ValueError(f"inner dimensions differ: A {tuple(a.shape)} @ B {tuple(b.shape)}")
    if k == 0:
        raise ValueError("K must be positive")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale), ("bias", bias), ("residual", residual),
                    ("out_scale", out_scale)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, operand a on {a.device}")
    if b.device != a.device:
        raise ValueError(f"operand b is on {b.device}, operand a on {a.device}")
    for name, t in (("a_scale", a_scale), ("b_scale", b_scale)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    lead = () if batch is None else (batch,)  # batched scales: one set per matrix of the batch
    expected = {
        Scaling.TENSORWISE: ("one element", "one element"),
        Scaling.ROWWISE: ((*lead, m, 1), (*lead, 1, n)),
        Scaling.BLOCKWISE: ((*lead, m, kb), (*lead, kb, nb)),
    }[scaling]
    if scaling is Scaling.TENSORWISE:
        ok = a_scale.numel() == 1 and b_scale.numel() == 1
    else:
        ok = tuple(a_scale.shape) == expected[0] and tuple(b_scale.shape) == expected[1]
    if not ok:
        raise ValueError(f"{scaling.value} scaling of A {tuple(a.shape)} @ B {tuple(b.shape)} needs scales "
                         f"{expected[0]} and {expected[1]}, got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    out_shape = (*lead, m, n)
    if out_scale is not None and (out_scale.dtype != torch.float32 or out_scale.numel() not in (1, n)
                                  or (out_scale.numel() == n and n > 1 and out_scale.dim() != 1)):
        raise ValueError(f"out_scale must be float32 with one element, or one per output column ({n},), got "
                         f"{out_scale.dtype} {tuple(out_scale.shape)}")
    if bias is not None:
        # Broadcast as addmm's and baddbmm's: trailing dims equal to the output's or 1.
        # Equality first: a symbolic dim equal to the output's needs no guard on == 1.
        if bias.dim() > len(out_shape) or not all(
                size == full or size == 1 for size, full in zip(reversed(bias.shape), reversed(out_shape))):
            raise ValueError(f"bias must have shape ({n},) or another that broadcasts to the output {out_shape}, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype not in _EPILOGUE_DTYPES:
            raise ValueError(f"bias must be one of {_EPILOGUE_DTYPES}, got {bias.dtype}")
    if residual is not None:
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"residual must have shape {out_shape}, got {tuple(residual.shape)}")
        if residual.dtype not in _EPILOGUE_DTYPES:
            raise ValueError(f"residual must be one of {_EPILOGUE_DTYPES}, got {residual.dtype}")
    a_row, a_col = _is_row_or_col_major(a)
    b_row, b_col = _is_row_or_col_major(b)
    if not (a_row or a_col):
        raise ValueError(f"operand a must be row-major or column-major (a transposed view), got strides "
                         f"{tuple(a.stride())} for shape {tuple(a.shape)}; call .contiguous() first")
    if not (b_row or b_col):
        raise ValueError(f"operand b must be row-major or column-major (a transposed view), got strides "
                         f"{tuple(b.stride())} for shape {tuple(b.shape)}; call .contiguous() first")
    # Prefer K-contiguous operands where both hold (degenerate shapes): FP8 tensor cores read K-major.
    return _Plan(m=m, n=n, k=k, scaling=scaling, activation=ACTIVATIONS[activation],
                 a_k_major=a_row, b_k_major=b_col, batch=batch)


def tma_unsupported_reason(a: torch.Tensor, b: torch.Tensor, plan: _Plan, out_dtype: torch.dtype,
                           device: Optional[torch.device] = None) -> Optional[str]:
    """Why the TMA kernel cannot take these operands, or None. TMA needs a 16-byte aligned
    base and 16-byte aligned strides outside the contiguous dimension. `device`: where the
    operands will be (meta operands describe them, `build_ahead`); default theirs."""
    device = a.device if device is None else device
    if plan.batch is not None:
        # The TMA kernel stays 2-D (2-D descriptors, a 2-D tile loop); batched operands
        # take the pointer kernel, which adds the batch to its program id.
        return "batched operands run on the pointer kernel (the TMA kernel is 2-D)"
    if not interpreting():
        if device.type != "cuda":
            return "the TMA kernel needs a CUDA device (or the interpreter)"
        if _capability(_device_index(device)) < (9, 0):
            return f"TMA needs sm90+, this GPU is sm{''.join(map(str, _capability(_device_index(device))))}"
    for name, t, contiguous_dim in (("a", a, 1 if plan.a_k_major else 0), ("b", b, 0 if plan.b_k_major else 1)):
        outer = t.stride(1 - contiguous_dim)
        if t.data_ptr() % 16:
            return f"operand {name}'s data pointer is not 16-byte aligned"
        if (outer * t.element_size()) % 16:
            return (f"operand {name}'s stride {outer} is not a multiple of 16 bytes "
                    f"(K, and M or N for transposed operands, must be multiples of 16)")
    if (plan.n * out_dtype.itemsize) % 16:
        return f"output rows of {plan.n} x {out_dtype.itemsize} bytes are not a multiple of 16 bytes"
    return None


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------

def _tensorwise_scale(s: torch.Tensor) -> torch.Tensor:
    return s.reshape(())  # one element, any shape


def _batched_strides(t: torch.Tensor) -> tuple:
    """(batch, row, column) strides of a 2-D or 3-D tensor; 0 for the batch of a 2-D one."""
    return (t.stride(0) if t.dim() == 3 else 0, t.stride(-2), t.stride(-1))


# Promotion used for precise accumulation unless a caller names one (benchmarks do).
PRECISE_ACCUM = "promote_add"

# (autotune key) -> triton.Config chosen by the autotuner: later calls with the same key
# launch the JIT function directly, skipping the autotuner's per-call argument handling.
_tuned_configs: dict = {}


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             scaling=None, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
             activation: str = "none", out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False,
             impl: str = "auto", config: Optional[GemmConfig] = None, accum_mode: Optional[str] = None,
             out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(dequant(a) @ dequant(b) + bias) + residual in out_dtype (module docstring):
    a [M, K] @ b [K, N] -> [M, N], or batched a [B, M, K] @ b [B, K, N] -> [B, M, N].
    An FP8 out_dtype is the next GEMM's operand: the result cast with `out_scale` (one
    value, or [N] per column), saturating, inf and NaN to NaN.

    impl: "auto" takes the TMA kernel on sm90+ when the operands allow it, else the
    pointer kernel; "tma" / "pointer" force one (ValueError if "tma" cannot run).
    scaling: a Scaling or its name; None infers it from the scale shapes.
    config: a fixed tile config instead of autotuning (the interpreter always uses one).
    accum_mode: overrides `fast_accum` with one of ACCUM_MODES (for measurements)."""
    if scaling is None:
        scaling = infer_scaling(a, a_scale, b, b_scale)
    plan = _check_args(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, impl, out_scale)
    if accum_mode is None:
        accum_mode = "fast" if fast_accum else PRECISE_ACCUM
    if accum_mode not in ACCUM_MODES:
        raise ValueError(f"unknown accum_mode {accum_mode!r}; valid: {sorted(ACCUM_MODES)}")
    interpret = interpreting()
    if not interpret and a.device.type != "cuda":
        return reference_fp8_gemm(a, a_scale, b, b_scale, plan.scaling, bias, residual, activation, out_dtype,
                                  out_scale=out_scale)
    if a.device.type == "cuda" and not interpret and _capability(_device_index(a.device)) < (8, 9):
        raise ValueError(f"FP8 GEMM needs sm89+, {a.device} is sm{''.join(map(str, _capability(_device_index(a.device))))}")

    if config is None and interpret:
        config = INTERPRETER_CONFIG
    if config is not None and plan.scaling is Scaling.BLOCKWISE and SCALE_BLOCK % config.block_k:
        raise ValueError(f"blockwise scaling needs block_k dividing {SCALE_BLOCK}, got {config.block_k}")
    use_tma = _use_tma(a, b, plan, out_dtype, impl, a.device)
    out = torch.empty(plan.out_shape, dtype=out_dtype, device=a.device)
    if plan.m == 0 or plan.n == 0 or plan.batch == 0:
        return out
    _launch(a, a_scale, b, b_scale, plan, bias, residual, out_dtype, out_scale, out, use_tma, config,
            ACCUM_MODES[accum_mode], a.device)
    return out


def _use_tma(a, b, plan: _Plan, out_dtype, impl: str, device: torch.device) -> bool:
    """Whether the launch takes the TMA kernel; ValueError where impl="tma" cannot."""
    tma_reason = tma_unsupported_reason(a, b, plan, out_dtype, device)
    if impl == "tma" and tma_reason is not None:
        raise ValueError(f"impl='tma' cannot run: {tma_reason}")
    return impl == "tma" or (impl == "auto" and tma_reason is None and not interpreting())


def build_ahead(a, a_scale, b, b_scale, scaling, bias=None, residual=None, activation="none", out_dtype=None,
                fast_accum=False, impl="auto", out_scale=None, *, device: torch.device) -> int:
    """Compile, without running, the kernels the first `loka::triton_fp8_gemm` call with these
    arguments would (the op's arguments, as meta tensors of the real ones' sizes, strides and
    dtypes, which will be on `device`): each tile config the autotuner would time, or the
    config it chose already. Triton keeps them under the key that call computes, so the call
    compiles nothing (an operand off 16-byte alignment specialises differently: it compiles
    as before). Returns the kernels built (0 under the interpreter, which compiles nothing)."""
    if interpreting() or device.type != "cuda" or _capability(_device_index(device)) < (8, 9):
        return 0
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    plan = _check_args(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, impl, out_scale)
    if plan.m == 0 or plan.n == 0 or plan.batch == 0:
        return 0
    out = torch.empty(plan.out_shape, dtype=out_dtype, device="meta")
    accum = ACCUM_MODES["fast" if fast_accum else PRECISE_ACCUM]
    return _launch(a, a_scale, b, b_scale, plan, bias, residual, out_dtype, out_scale, out,
                   _use_tma(a, b, plan, out_dtype, impl, device), None, accum, device, build_only=True)


def _launch(a, a_scale, b, b_scale, plan: _Plan, bias, residual, out_dtype, out_scale, out, use_tma: bool,
            config: Optional[GemmConfig], accum: int, device: torch.device, build_only: bool = False) -> int:
    """Launch the kernel into `out` (tuned at the first call of its autotune key, unless
    `config` is given); with `build_only`, compile what that launch would, run nothing, and
    return the number of kernels built."""
    interpret = interpreting()
    m, n, k, batch = plan.m, plan.n, plan.k, plan.batch

    if plan.scaling is Scaling.TENSORWISE:
        a_scale, b_scale = _tensorwise_scale(a_scale), _tensorwise_scale(b_scale)
        scale_strides = (0, 0, 0, 0, 0, 0)  # (batch, M or K, K or N) of A's scales, then B's
    else:
        scale_strides = (*_batched_strides(a_scale), *_batched_strides(b_scale))
    if bias is not None:
        # The bias as a view of the output's shape: broadcast dims get stride 0.
        bias_strides = _batched_strides(bias.expand(plan.out_shape))
    else:
        bias_strides = (0, 0, 0)
    flags = dict(
        SCALING=_SCALING_CODES[plan.scaling], ACCUM=accum,
        HAS_BIAS=bias is not None, BIAS_ROWS=bias_strides[1] != 0 and m > 1,
        HAS_RESIDUAL=residual is not None, ACTIVATION=plan.activation, SCALE_BLOCK=SCALE_BLOCK,
        OUT_FP8=FP8_DTYPES.index(out_dtype) + 1 if out_scale is not None else 0,
        OUT_FP8_MAX=float(torch.finfo(out_dtype).max) if out_scale is not None else 0.0,
        SOFTWARE_CAST=interpret,
    )
    bucket = m_bucket(m)
    residual_strides = _batched_strides(residual) if residual is not None else (0, 0, 0)
    # Unused pointer arguments get `out` (never read: HAS_BIAS / HAS_RESIDUAL are off).
    ptrs = (a_scale, b_scale, bias if bias is not None else out, residual if residual is not None else out,
            out_scale.reshape(-1) if out_scale is not None else a_scale)
    out_scale_stride = 1 if out_scale is not None and out_scale.numel() > 1 else 0

    if use_tma:
        # Descriptors over the K-contiguous (or M/N-contiguous) storage; the block shape
        # is a placeholder until the config's pre-hook sets it.
        a_view = a if plan.a_k_major else a.t()
        b_view = b.t() if plan.b_k_major else b
        descs = dict(a_desc=TensorDescriptor.from_tensor(a_view, [16, 16]),
                     b_desc=TensorDescriptor.from_tensor(b_view, [16, 16]),
                     out_desc=TensorDescriptor.from_tensor(out, [16, 16]))
        # 2-D only (tma_unsupported_reason): the batch strides are dropped.
        args = (descs["a_desc"], descs["b_desc"], descs["out_desc"], *ptrs, m, n, k, bucket,
                *scale_strides[1:3], *scale_strides[4:6], *bias_strides[1:], *residual_strides[1:], out_scale_stride)
        flags.update(A_K_MAJOR=plan.a_k_major, B_K_MAJOR=plan.b_k_major)
        sms = INTERPRETER_SM_COUNT if interpret else _sm_count(_device_index(device))
        jit_fn, tuner = _fp8_gemm_tma_kernel, _tma_kernel_tuned
    else:
        args = (a, b, out, *ptrs, m, n, k, batch or 1, bucket, m_bucket(batch or 1),
                *_batched_strides(a), *_batched_strides(b), *_batched_strides(out),
                *scale_strides, *bias_strides, *residual_strides, out_scale_stride)
        descs, sms = None, 0
        jit_fn, tuner = _ptr_kernel, _ptr_kernel_tuned

    def grid_for(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, sms * meta["CTAS_PER_SM"]) if use_tma and meta["CTAS_PER_SM"] else tiles * (batch or 1),)

    def build(chosen: triton.Config) -> None:
        if descs is not None:
            _set_descriptor_blocks({**chosen.kwargs, **flags, **descs})
        jit_fn.warmup(*args, grid=(1,), **flags, **chosen.all_kwargs())

    if config is not None:
        chosen = config.triton_config(use_tma)
    else:
        key = (use_tma, bucket, m_bucket(batch) if batch else None, n, k, a.dtype, b.dtype, out_dtype,
               None if bias is None else bias.dtype,
               None if residual is None else residual.dtype, plan.a_k_major, plan.b_k_major,
               tuple(flags.items()))
        chosen = _tuned_configs.get(key)
        if chosen is None and build_only:  # every config the tuner would time (its own pruning)
            candidates = _prune_configs(tuner.configs, dict(zip(tuner.arg_names, args)), **flags)
            for candidate in candidates:
                build(candidate)
            return len(candidates)
        if chosen is None:
            tuner[grid_for](*args, **flags)
            _tuned_configs[key] = _last_launch["config"] = tuner.best_config
            return 1
    if build_only:
        build(chosen)
        return 1
    _last_launch["config"] = chosen
    meta = dict(**chosen.kwargs, **flags)
    if descs is not None:
        _set_descriptor_blocks({**meta, **descs})
    jit_fn[grid_for(meta)](*args, **flags, **chosen.all_kwargs())
    return 1


def tuned_configs() -> dict:
    """Autotuning results so far: key -> chosen triton.Config."""
    return dict(_tuned_configs)


# ---------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------

def dequantize_operand(q: torch.Tensor, scale: torch.Tensor, scaling, operand: str,
                       dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Value of a quantized GEMM operand ("a" [.., M, K] or "b" [.., K, N]) in `dtype`;
    batched operands have their scales prefixed by the batch (tensorwise: one scale). A
    quantized zero stays zero under an infinite scale, as in `quantize.dequantize`."""
    scaling = parse_scaling(scaling)
    x = q.to(dtype)
    if scaling is Scaling.TENSORWISE:
        full = scale.to(dtype).reshape(())
    elif scaling is Scaling.ROWWISE:
        full = scale.to(dtype)
    else:
        block = (1, SCALE_BLOCK) if operand == "a" else (SCALE_BLOCK, SCALE_BLOCK)
        full = scale.to(dtype).repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
        full = full[..., : x.shape[-2], : x.shape[-1]]
    return torch.where(x == 0, x, x * full)


def apply_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "none":
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "silu":
        return torch.nn.functional.silu(x)
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "hardswish":
        return torch.nn.functional.hardswish(x)
    raise ValueError(f"unknown activation {activation!r}; valid: {sorted(ACTIVATIONS)}")


def reference_fp8_gemm(a, a_scale, b, b_scale, scaling="tensorwise", bias=None, residual=None,
                       activation="none", out_dtype=torch.bfloat16, compute_dtype=torch.float64,
                       out_scale=None) -> torch.Tensor:
    """Pure-PyTorch meaning of `fp8_gemm`: dequantize with the scales, matmul in
    compute_dtype, the same epilogue, cast to out_dtype (an FP8 one with `out_scale`, as
    the kernel: through fp32, saturating, inf and NaN to NaN)."""
    out = dequantize_operand(a, a_scale, scaling, "a", compute_dtype) @ dequantize_operand(
        b, b_scale, scaling, "b", compute_dtype)
    if bias is not None:
        out = out + bias.to(compute_dtype)
    out = apply_activation(out, activation)
    if residual is not None:
        out = out + residual.to(compute_dtype)
    if out_scale is not None:
        fmt = Fp8Format.E4M3 if out_dtype == torch.float8_e4m3fn else Fp8Format.E5M2
        return cast_with_scale(out.float(), out_scale.float().reshape(-1), fmt, non_finite_to_nan=True)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------
# op registration
# ---------------------------------------------------------------------------------------

# Defined through torch.library.Library rather than custom_op: custom_op wraps every call
# in a Python autograd layer, host time per call that this op does not need (docs/kernels.md).
# The op has no autograd formula; FP8 operands carry no gradient.
_LIB = torch.library.Library("loka", "FRAGMENT")
_LIB.define(
    "triton_fp8_gemm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, str scaling, Tensor? bias=None, "
    "Tensor? residual=None, str activation=\"none\", ScalarType? out_dtype=None, bool fast_accum=False, "
    "str impl=\"auto\", Tensor? out_scale=None) -> Tensor")


def _triton_fp8_gemm_impl(a, a_scale, b, b_scale, scaling, bias=None, residual=None, activation="none",
                          out_dtype=None, fast_accum=False, impl="auto", out_scale=None):
    """FP8 GEMM with fused epilogue: act(dequant(a) @ dequant(b) + bias) + residual; out_dtype
    None means bf16 (a schema default cannot name a dtype); an FP8 out_dtype takes out_scale."""
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    return fp8_gemm(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, fast_accum, impl,
                    out_scale=out_scale)


for _key in ("CPU", "CUDA"):
    _LIB.impl("triton_fp8_gemm", _triton_fp8_gemm_impl, _key)


@torch.library.register_fake("loka::triton_fp8_gemm", lib=_LIB)
def _triton_fp8_gemm_fake(a, a_scale, b, b_scale, scaling, bias=None, residual=None, activation="none",
                          out_dtype=None, fast_accum=False, impl="auto", out_scale=None):
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    plan = _check_args(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, impl, out_scale)
    return a.new_empty(plan.out_shape, dtype=out_dtype)


# ---------------------------------------------------------------------------------------
# provider
# ---------------------------------------------------------------------------------------

def _provider_available(device: torch.device) -> bool:
    return has_fp8_hardware(device) and not interpreting()


def _provider_gemm(a_q, a_scale, b_q, b_scale, scaling, bias, out_dtype, fast_accum=False):
    if a_q.dim() not in (2, 3) or b_q.dim() != a_q.dim():
        raise ValueError(f"the triton provider takes 2-D operands, or 3-D (batched) ones, got "
                         f"{tuple(a_q.shape)} @ {tuple(b_q.shape)}")
    # The op, not the launcher: lowering traces this into the graph as one node, which the
    # epilogue Mod can then extend with an activation and a residual.
    return torch.ops.loka.triton_fp8_gemm(a_q, a_scale, b_q, b_scale, Scaling(scaling).value, bias,
                                          out_dtype=out_dtype, fast_accum=fast_accum)


if "triton" not in provider_names():
    register(GemmProvider(
        name="triton",
        scalings=frozenset({Scaling.TENSORWISE, Scaling.ROWWISE, Scaling.BLOCKWISE}),
        batched=True,
        # The kernel runs batched blockwise too, but no cast makes its operands:
        # blockwise quantization takes 2-D tensors (`quantize.quantize_blockwise`).
        batched_scalings=frozenset({Scaling.TENSORWISE, Scaling.ROWWISE}),
        emulated=False,
        available=_provider_available,
        gemm=_provider_gemm,
        description="loka's Triton FP8 GEMM (TMA kernel on sm90+, pointer kernel elsewhere and for bmm), "
                    "fused epilogue",
    ))
