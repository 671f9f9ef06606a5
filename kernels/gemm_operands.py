"""Quantization of a GEMM's two operands, fast where the hardware allows.

`quantize_gemm_operands` returns exactly what `quantize.quantize_operands` returns (the
Triton casts match the references bit for bit), so every provider sees the same values
whichever path ran. On a CUDA device with FP8 it casts each 2-D operand in one Triton
kernel and writes it K-major (A row-major, B column-major), the layout FP8 tensor cores
read, so no transposed copy follows the cast. Elsewhere (CPU, batched operands, layouts
the kernels do not take) it runs the PyTorch references.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .quantize import Fp8Format, Scaling, quantize_operands

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


def fused_cast_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `quantize_gemm_operands` takes the Triton path for these operands."""
    if a.device.type != "cuda" or a.dim() != 2 or b.dim() != 2:
        return False
    tq = _triton_quant()
    return (tq is not None and not tq.interpreting() and tq.use_triton(a)
            and tq.is_row_or_column_major(a) and tq.is_row_or_column_major(b))


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


def quantize_gemm_operands(a: torch.Tensor, b: torch.Tensor, scaling: Scaling,
                           a_format: Fp8Format, b_format: Fp8Format, use_triton: Optional[bool] = None):
    """(a_q, a_scale, b_q, b_scale) of a [.., M, K] @ b [.., K, N], scales along K.

    use_triton: None picks by `fused_cast_applies`; True forces the Triton casts (tests run
    them under the interpreter on CPU), False the references."""
    if use_triton is None:
        use_triton = fused_cast_applies(a, b)
    if not use_triton:
        return quantize_operands(a, b, scaling, a_format, b_format)
    tq = _triton_quant()
    if tq is None:
        raise RuntimeError("use_triton=True but the Triton quantization kernels cannot be imported")
    if scaling is Scaling.ROWWISE:
        a_q, a_s = tq.quantize_rowwise_triton(a, a_format, out_major="row")
        b_q, b_s = tq.quantize_columnwise_triton(b, b_format, out_major="column")
    elif scaling is Scaling.TENSORWISE:
        a_q, a_s = _tensorwise(tq, a, a_format, k_major_dim=1)
        b_q, b_s = _tensorwise(tq, b, b_format, k_major_dim=0)
    elif scaling is Scaling.BLOCKWISE:
        a_q, a_s = tq.quantize_blockwise_triton(a, 1, 128, a_format, out_major="row")
        b_q, b_s = tq.quantize_blockwise_triton(b, 128, 128, b_format, out_major="column")
    else:
        raise ValueError(f"unknown scaling {scaling!r}; valid: {[s.value for s in Scaling]}")
    return a_q, a_s, b_q, b_s
