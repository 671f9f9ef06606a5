"""Quantization of a GEMM operand as one opaque kernel (the `loka::quantize_operand` op).

`quantize_gemm_operand` returns exactly what `scaled_gemm.quantize_operand_aten` returns
(the Triton casts match the references bit for bit), values and K-major layouts (A
row-major, B column-major), so every provider sees the same operands whichever path ran.
On a CUDA device with FP8 it casts a 2-D operand in one Triton kernel that also writes
the K-major layout; elsewhere (CPU, batched operands, layouts the kernels do not take) it
runs the PyTorch references.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .quantize import Fp8Format, Scaling

log = logging.getLogger("loka")


@functools.lru_cache(maxsize=None)
def _triton_quant():
    try:
        from . import triton_quant
    except Exception as e:  # noqa: BLE001  (a broken Triton install must not break the GEMM)
        log.warning("loka: Triton quantization kernels unavailable (%s: %s); using the PyTorch references",
                    type(e).__name__, e)
        return None
    return triton_quant


def _tensorwise(tq, x: torch.Tensor, fmt: Fp8Format, k_major_dim: int):
    # The tensorwise kernel walks memory flat: cast a transposed-contiguous x through its
    # transpose, then make the K axis contiguous if it is not already (a 1-byte copy).
    if x.is_contiguous():
        q, scale = tq.quantize_tensorwise_triton(x, fmt)
    else:
        q_t, scale = tq.quantize_tensorwise_triton(x.t(), fmt)
        q = q_t.t()
    if q.stride(k_major_dim) != 1 and q.shape[k_major_dim] > 1:
        q = q.contiguous() if k_major_dim == 1 else q.t().contiguous().t()
    return q, scale


def _fused_cast_applies_to(x: torch.Tensor) -> bool:
    if x.device.type != "cuda" or x.dim() != 2:
        return False
    tq = _triton_quant()
    return tq is not None and not tq.interpreting() and tq.use_triton(x) and tq.is_row_or_column_major(x)


def fused_cast_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `quantize_gemm_operands` takes the Triton path for these operands."""
    return _fused_cast_applies_to(a) and _fused_cast_applies_to(b)


def quantize_gemm_operand(x: torch.Tensor, operand: str, scaling: Scaling, fmt: Fp8Format,
                          use_triton: Optional[bool] = None):
    """One operand of a [.., M, K] @ b [.., K, N], cast K-major with scales along K:
    operand "a" -> (q row-major, scale [.., M, 1] | 0-d | blocks); "b" -> (q column-major,
    scale [.., 1, N] | 0-d | blocks). The values and layouts of
    `scaled_gemm.quantize_operand_aten`, which is also the path off the GPU.

    use_triton: None picks by the device and layout; True forces the Triton casts (tests
    run them under the interpreter on CPU), False the references."""
    if use_triton is None:
        use_triton = _fused_cast_applies_to(x)
    if not use_triton:
        from .scaled_gemm import quantize_operand_aten

        return quantize_operand_aten(x, operand, scaling, fmt)
    tq = _triton_quant()
    if tq is None:
        raise RuntimeError("use_triton=True but the Triton quantization kernels cannot be imported")
    major = "row" if operand == "a" else "column"
    if scaling is Scaling.ROWWISE:
        if operand == "a":
            return tq.quantize_rowwise_triton(x, fmt, out_major=major)
        return tq.quantize_columnwise_triton(x, fmt, out_major=major)
    if scaling is Scaling.TENSORWISE:
        return _tensorwise(tq, x, fmt, k_major_dim=1 if operand == "a" else 0)
    if scaling is Scaling.BLOCKWISE:
        block_rows, block_cols = (1, 128) if operand == "a" else (128, 128)
        return tq.quantize_blockwise_triton(x, block_rows, block_cols, fmt, out_major=major)
    raise ValueError(f"unknown scaling {scaling!r}; valid: {[s.value for s in Scaling]}")


def quantize_gemm_operands(a: torch.Tensor, b: torch.Tensor, scaling: Scaling,
                           a_format: Fp8Format, b_format: Fp8Format, use_triton: Optional[bool] = None):
    """(a_q, a_scale, b_q, b_scale) of a [.., M, K] @ b [.., K, N] (`quantize_gemm_operand`
    on each); use_triton None picks by `fused_cast_applies`."""
    if use_triton is None:
        use_triton = fused_cast_applies(a, b)
    return (*quantize_gemm_operand(a, "a", scaling, a_format, use_triton),
            *quantize_gemm_operand(b, "b", scaling, b_format, use_triton))
