"""Triton dequantization of an FP8 matrix into a high-precision buffer, in one pass: the gathered
weight of FSDP2's FP8 all-gather (`loka_compile/weight_gather.py`), whose eager dequantization
(`quantize.dequantize(q, s).to(dtype)`, then a copy) runs five elementwise kernels with fp32
temporaries.

`dequantize_into(q [R, C], scale, out [R, C])`: `out = (q * scale)` in fp32, rounded once to
`out`'s dtype (fp32 or bf16), a quantized zero staying zero whatever its scale (the reference's
policy: an inf-scaled group's finite elements are zeros). `scale` broadcasts: [R, 1] (rowwise),
[1, C] (columnwise) or 0-d (tensorwise). Bit for bit the reference's result, NaN where it is NaN.

The FP8 bytes are decoded and bf16 is rounded (to nearest, ties to even) in integer arithmetic:
one code path for the compiled kernel and the interpreter, whose own fp8 loads and bf16 stores
differ from PyTorch's (triton 3.6: a masked fp8 load cannot take a fill value, and a bf16 store
does not round as PyTorch does). The op is called eagerly (in FSDP2's hook), never in a graph, so
it has no `torch.library` registration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize import Fp8Format, dequantize
from .triton_quant import use_triton

OUT_DTYPES = (torch.float32, torch.bfloat16)
# 4096 elements a program, 4 warps: the tensorwise cast's measured best (docs/kernels.md); this
# pass itself is not tuned yet (benchmarks/weight_gather.py's "dequantize alone" row times it).
BLOCK_R, BLOCK_C, NUM_WARPS = 16, 256, 4


@triton.jit
def _fp8_value(b, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr):
    """fp32 value of FP8 bytes (e4m3fn or e5m2), exactly: normals by moving the fields into
    fp32's, subnormals as mantissa x 2^(1 - bias - mant), then NaN and infinities."""
    b = b.to(tl.int32)
    EXP_BITS: tl.constexpr = 7 - FP8_MANT
    exponent = (b >> FP8_MANT) & ((1 << EXP_BITS) - 1)
    mantissa = b & ((1 << FP8_MANT) - 1)
    sign = (b & 0x80) << 24
    normal = (sign | ((exponent - FP8_BIAS + 127) << 23) | (mantissa << (23 - FP8_MANT))).to(tl.float32,
                                                                                             bitcast=True)
    subnormal = mantissa.to(tl.float32) * (2.0 ** (1 - FP8_BIAS - FP8_MANT))
    # the sign as a bit, not a negation: -0.0 stays -0.0 (triton 3.6's interpreter negates as 0 - x)
    subnormal = (subnormal.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal)
    if FP8_MANT == 3:  # e4m3fn: S.1111.111 is NaN; no infinities
        value = tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)
    else:  # e5m2: an all-ones exponent is +-inf (mantissa 0) or NaN
        infinity = tl.where(sign != 0, float("-inf"), float("inf"))
        value = tl.where(exponent == 31, tl.where(mantissa == 0, infinity, float("nan")), value)
    return value


@triton.jit
def _bf16_bits(x):
    """bf16 bits of fp32 x, rounded to nearest, ties to even (PyTorch's conversion); NaN 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded & 0xFFFF).to(tl.int16)


@triton.jit
def _dequantize_kernel(
    q_ptr,          # [R, C] uint8 view of the fp8 bytes, any strides
    scale_ptr,      # fp32, read at (r * stride_sr + c * stride_sc): a 0 stride broadcasts
    out_ptr,        # [R, C] fp32, or int16 view of bf16, any strides
    R, C,
    stride_qr, stride_qc, stride_sr, stride_sc, stride_or, stride_oc,
    FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < R) & (cols < C)
    q = _fp8_value(tl.load(q_ptr + rows * stride_qr + cols * stride_qc, mask=mask, other=0), FP8_MANT, FP8_BIAS)
    scale = tl.load(scale_ptr + rows * stride_sr + cols * stride_sc, mask=mask, other=1.0)
    value = tl.where(q == 0, q, q * scale)
    if OUT_BF16:
        value = _bf16_bits(value)
    tl.store(out_ptr + rows * stride_or + cols * stride_oc, value, mask=mask)


def _check(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    formats = {f.dtype for f in Fp8Format}
    if q.dtype not in formats or q.dim() != 2:
        raise ValueError(f"dequantize_into: q must be a 2-D fp8 tensor ({sorted(map(str, formats))}), "
                         f"got {q.dtype} of shape {tuple(q.shape)}")
    if scale.dtype != torch.float32 or scale.shape not in (torch.Size([]), (q.shape[0], 1), (1, q.shape[1])):
        raise ValueError(f"dequantize_into: scale must be fp32 of shape [], [{q.shape[0]}, 1] or [1, {q.shape[1]}], "
                         f"got {scale.dtype} of shape {tuple(scale.shape)}")
    if out.dtype not in OUT_DTYPES or out.shape != q.shape or out.device != q.device or scale.device != q.device:
        raise ValueError(f"dequantize_into: out must be {[str(d) for d in OUT_DTYPES]} of q's shape "
                         f"{tuple(q.shape)} on q's device ({q.device}), and scale on it too; got {out.dtype} of "
                         f"shape {tuple(out.shape)} on {out.device}, scale on {scale.device}")


def dequantize_into_triton(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` = q dequantized with `scale`, in one Triton pass (module docstring); returns `out`."""
    _check(q, scale, out)
    rows, cols = q.shape
    if q.numel():
        fmt = Fp8Format.E4M3 if q.dtype == Fp8Format.E4M3.dtype else Fp8Format.E5M2
        stride_sr, stride_sc = scale.expand(rows, cols).stride()
        target = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
        _dequantize_kernel[grid](
            q.view(torch.uint8), scale, target, rows, cols, *q.stride(), stride_sr, stride_sc, *out.stride(),
            FP8_MANT=3 if fmt is Fp8Format.E4M3 else 2, FP8_BIAS=7 if fmt is Fp8Format.E4M3 else 15,
            OUT_BF16=out.dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return out


def dequantize_into_reference(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The same through `quantize.dequantize` (fp32), then one rounding into `out`."""
    _check(q, scale, out)
    out.copy_(dequantize(q, scale))
    return out


def dequantize_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The Triton pass where loka's Triton kernels run (`triton_quant.use_triton`), else the reference."""
    if use_triton(q):
        return dequantize_into_triton(q, scale, out)
    return dequantize_into_reference(q, scale, out)
