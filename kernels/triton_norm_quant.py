"""Fused normalization + FP8 quantization (LayerNorm, RMSNorm, BlockNorm) in Triton.

One read of x [M, N] gives, per row, the normalized output in x's dtype and/or its
rowwise FP8 quantization (scales [M, 1]): the norm's producer-side cast of an FP8 GEMM
input. The FP8 output is the reference rowwise cast (`quantize.quantize_along(y, -1)`)
of the high-precision output y, bit for bit: the kernel rounds y to x's dtype first, so
the FP8-only and the bf16 + FP8 variants give the same bytes, and both equal the unfused
graph "norm, then cast".

BlockNorm (a LoKA Mod) is an RMSNorm over fixed 256-wide groups of the feature dimension,
without parameters; the feature dimension must be a multiple of 256.

Forward ops return the statistics the backward needs (mean and rstd as fp32 [..., 1],
like `aten.native_layer_norm`; BlockNorm's rstd is [..., N / 256]). The backward kernels
are ops too, so a graph pass can use them in place of ATen's norm backward.

Rows must be contiguous and at most MAX_NORM_WIDTH wide (a row is held in registers).
On devices where the Triton kernels cannot run (see `triton_quant.use_triton`), the ops
run the pure-PyTorch references below.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .quantize import Fp8Format, quantize_along
from .triton_quant import (
    _amax,
    _cast_to_fp8_bytes,
    _scale_from_amax,
    check_input,
    format_args,
    interpreting,
    parse_format,
    sm_count,
    use_triton,
)

BLOCK_NORM_GROUP = 256
# A row lives in registers: 16384 fp32 values over 8 warps is 64 per thread.
MAX_NORM_WIDTH = 16384

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _round_to_output(y, Y_DTYPE: tl.constexpr, SOFTWARE_BF16: tl.constexpr):
    """fp32 -> output dtype, round to nearest even. Under TRITON_INTERPRET the bf16 cast
    is done on the bits (the interpreter's own truncates, triton 3.6)."""
    if SOFTWARE_BF16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    return y.to(Y_DTYPE)


@triton.jit
def _norm_fwd_kernel(
    x_ptr,          # [M, N], rows contiguous
    w_ptr, b_ptr,   # [N] or dummies
    y_ptr,          # [M, N] in x's dtype (written if WRITE_Y)
    q_ptr,          # [M, N] uint8 view of fp8 (written if WRITE_Q)
    scale_ptr,      # [M] fp32 (if WRITE_Q)
    mean_ptr,       # [M] fp32 (LayerNorm)
    rstd_ptr,       # [M] fp32
    M, N, stride_x, stride_y, stride_q, eps,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    Y_DTYPE: tl.constexpr, SOFTWARE_BF16: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_lp = _round_to_output(y, Y_DTYPE, SOFTWARE_BF16)
    if WRITE_Y:
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y_lp, mask=mask)
    if WRITE_Q:
        yq = tl.where(mask, y_lp.to(tl.float32), 0.0)
        scale = _scale_from_amax(_amax(yq, 1), FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        q = _cast_to_fp8_bytes(yq, scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, x_ptr,  # [M, N], rows contiguous
    w_ptr,          # [N] or dummy
    mean_ptr, rstd_ptr,   # [M] fp32
    dx_ptr,         # [M, N] in x's dtype
    dw_part_ptr, db_part_ptr,   # [P, N] fp32 partial sums, one row per program
    M, N, stride_dy, stride_x, stride_dx,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx row by row; dw and db summed over this program's row tiles (grid-stride)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        db_acc += tl.sum(dy, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=col_mask)
    tl.store(db_part_ptr + pid * N + cols, db_acc, mask=col_mask)


@triton.jit
def _block_norm_fwd_kernel(
    x_ptr,          # [M, N], rows contiguous, N % GROUP == 0
    y_ptr,          # [M, N] in x's dtype
    q_ptr,          # [M, N] uint8 view of fp8 (if WRITE_Q)
    scale_ptr,      # [M] fp32 (if WRITE_Q)
    rstd_ptr,       # [M, N / GROUP] fp32
    M, N, stride_x, stride_y, stride_q, eps,
    FP8_MAX, INV_FP8_MAX,
    OUT_DTYPE: tl.constexpr, RECIPROCAL: tl.constexpr, POW2: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr, FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr,
    Y_DTYPE: tl.constexpr, SOFTWARE_BF16: tl.constexpr,
    WRITE_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    N_GROUPS: tl.constexpr = BLOCK_N // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_M, N_GROUPS, GROUP))
    rstd = tl.math.rsqrt(tl.sum(x3 * x3, axis=2) / GROUP + eps)        # [BLOCK_M, N_GROUPS]
    y = tl.reshape(x3 * rstd[:, :, None], (BLOCK_M, BLOCK_N))
    y_lp = _round_to_output(y, Y_DTYPE, SOFTWARE_BF16)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y_lp, mask=mask)
    groups = tl.arange(0, N_GROUPS)
    n_groups = N // GROUP
    tl.store(rstd_ptr + rows[:, None] * n_groups + groups[None, :], rstd,
             mask=row_mask[:, None] & (groups[None, :] < n_groups))
    if WRITE_Q:
        yq = tl.where(mask, y_lp.to(tl.float32), 0.0)
        scale = _scale_from_amax(_amax(yq, 1), FP8_MAX, INV_FP8_MAX, RECIPROCAL, POW2)
        q = _cast_to_fp8_bytes(yq, scale[:, None], FP8_MAX, OUT_DTYPE, SOFTWARE_CAST, FP8_MANT, FP8_BIAS)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _block_norm_bwd_kernel(
    dy_ptr, x_ptr,  # [M, N], rows contiguous
    rstd_ptr,       # [M, N / GROUP] fp32
    dx_ptr,         # [M, N] in x's dtype
    M, N, stride_dy, stride_x, stride_dx,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    N_GROUPS: tl.constexpr = BLOCK_N // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    groups = tl.arange(0, N_GROUPS)
    n_groups = N // GROUP
    rstd = tl.load(rstd_ptr + rows[:, None] * n_groups + groups[None, :],
                   mask=row_mask[:, None] & (groups[None, :] < n_groups), other=0.0)
    xhat = tl.reshape(x, (BLOCK_M, N_GROUPS, GROUP)) * rstd[:, :, None]
    dy3 = tl.reshape(dy, (BLOCK_M, N_GROUPS, GROUP))
    c = tl.sum(xhat * dy3, axis=2) / GROUP
    dx = tl.reshape((dy3 - xhat * c[:, :, None]) * rstd[:, :, None], (BLOCK_M, BLOCK_N))
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------

def _software_bf16(x: torch.Tensor) -> bool:
    return interpreting() and x.dtype == torch.bfloat16


def _rows_of(x: torch.Tensor, what: str) -> torch.Tensor:
    """x [..., N] contiguous -> [M, N] view."""
    check_input(x, what, dims=None)
    if x.dim() < 1:
        raise ValueError(f"{what}: x must have a feature dimension, got a 0-d tensor")
    if not x.is_contiguous():
        raise ValueError(f"{what}: x must be contiguous, got strides {x.stride()} for shape "
                         f"{tuple(x.shape)}; call .contiguous() first")
    n = x.shape[-1]
    if n > MAX_NORM_WIDTH:
        raise ValueError(f"{what}: feature dimension {n} exceeds MAX_NORM_WIDTH={MAX_NORM_WIDTH}")
    return x.view(-1, n)


def _check_param(p: Optional[torch.Tensor], n: int, x: torch.Tensor, what: str, name: str) -> None:
    if p is None:
        return
    if p.shape != (n,):
        raise ValueError(f"{what}: {name} must have shape ({n},), got {tuple(p.shape)}")
    if p.device != x.device:
        raise ValueError(f"{what}: {name} is on {p.device}, x on {x.device}")
    if not p.is_contiguous() or p.dtype not in _TL_DTYPES:
        raise ValueError(f"{what}: {name} must be contiguous float32/bfloat16/float16, got {p.dtype}")


def _block_norm_groups(n: int, what: str) -> int:
    if n % BLOCK_NORM_GROUP:
        raise ValueError(f"{what}: the feature dimension must be a multiple of {BLOCK_NORM_GROUP} "
                         f"(BlockNorm normalizes fixed {BLOCK_NORM_GROUP}-wide groups), got {n}")
    return n // BLOCK_NORM_GROUP


def norm_config(n: int) -> dict:
    """Tile for the row kernels. H100, LayerNorm+quant at 32768x2048 bf16 (2026-11-22,
    benchmarks/kernels_quant.py sweep): one row per program with 4 warps was best or
    within 1% of best in both variants (bf16 + FP8 135 us vs 142-216 us for 1x8, 2x8,
    4x8, 8x16 warps; FP8 only 120 us vs 119-135 us). So about 2048 elements per program,
    4 warps up to 4096-wide rows."""
    block_n = triton.next_power_of_2(n)
    return dict(BLOCK_M=max(1, min(16, 2048 // block_n)), BLOCK_N=block_n,
                num_warps=4 if block_n <= 4096 else 8)


def norm_quant_forward(x, weight, bias, eps, fmt, power_of_two, *, rms: bool, write_y: bool,
                       write_q: bool, config: Optional[dict] = None):
    """Launches the fused norm kernel. Returns (y or None, q or None, scale or None, mean or
    None, rstd), statistics as fp32 [..., 1]."""
    what = "rms_norm_quant" if rms else "layer_norm_quant"
    x2 = _rows_of(x, what)
    m, n = x2.shape
    _check_param(weight, n, x, what, "weight")
    _check_param(bias, n, x, what, "bias")
    fmt = parse_format(fmt)
    stat_shape = tuple(x.shape[:-1]) + (1,)
    y = torch.empty_like(x) if write_y else None
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device) if write_q else None
    scale = torch.empty(stat_shape, dtype=torch.float32, device=x.device) if write_q else None
    mean = None if rms else torch.empty(stat_shape, dtype=torch.float32, device=x.device)
    rstd = torch.empty(stat_shape, dtype=torch.float32, device=x.device)
    if m and n:
        cfg = dict(config or norm_config(n))
        warps = cfg.pop("num_warps")
        dummy = rstd
        _norm_fwd_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, weight if weight is not None else dummy, bias if bias is not None else dummy,
            y if write_y else dummy, q.view(torch.uint8) if write_q else dummy,
            scale if write_q else dummy, mean if mean is not None else dummy, rstd,
            m, n, x2.stride(0), n, n, eps,
            POW2=power_of_two, Y_DTYPE=_TL_DTYPES[x.dtype], SOFTWARE_BF16=_software_bf16(x), IS_RMS=rms,
            HAS_W=weight is not None, HAS_B=bias is not None, WRITE_Y=write_y, WRITE_Q=write_q,
            num_warps=warps, **cfg, **format_args(fmt, x.device))
    elif write_q:
        scale.fill_(1.0)
    return y, q, scale, mean, rstd


def norm_backward(dy, x, weight, mean, rstd, *, rms: bool):
    """(dx, dw, db) of LayerNorm (rms=False) or RMSNorm; dw and db in weight's dtype (x's
    when there is no weight), db all zeros for RMSNorm."""
    what = "rms_norm_backward" if rms else "layer_norm_backward"
    x2 = _rows_of(x, what)
    m, n = x2.shape
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"{what}: dy must be contiguous with x's shape {tuple(x.shape)}, got "
                         f"{tuple(dy.shape)} strides {dy.stride()}")
    _check_param(weight, n, x, what, "weight")
    dy2 = dy.view(-1, n)
    dx = torch.empty_like(x)
    p_dtype = weight.dtype if weight is not None else x.dtype
    if not (m and n):
        z = torch.zeros(n, dtype=p_dtype, device=x.device)
        return dx, z, z.clone()
    cfg = dict(norm_config(n))
    warps = cfg.pop("num_warps")
    programs = min(triton.cdiv(m, cfg["BLOCK_M"]), 4 * sm_count(x.device))
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _norm_bwd_kernel[(programs,)](
        dy2, x2, weight if weight is not None else rstd, mean if mean is not None else rstd, rstd,
        dx.view(-1, n), dw_part, db_part, m, n, dy2.stride(0), x2.stride(0), n,
        IS_RMS=rms, HAS_W=weight is not None, num_warps=warps, **cfg)
    return dx, dw_part.sum(0).to(p_dtype), db_part.sum(0).to(p_dtype)


def block_norm_forward(x, eps, fmt, power_of_two, *, write_q: bool, config: Optional[dict] = None):
    """(y, q or None, scale or None, rstd [..., N/256])."""
    what = "block_norm_quant" if write_q else "block_norm"
    x2 = _rows_of(x, what)
    m, n = x2.shape
    groups = _block_norm_groups(n, what)
    fmt = parse_format(fmt)
    y = torch.empty_like(x)
    q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device) if write_q else None
    scale = torch.empty(tuple(x.shape[:-1]) + (1,), dtype=torch.float32, device=x.device) if write_q else None
    rstd = torch.empty(tuple(x.shape[:-1]) + (groups,), dtype=torch.float32, device=x.device)
    if m:
        cfg = dict(config or norm_config(n))
        warps = cfg.pop("num_warps")
        _block_norm_fwd_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            x2, y, q.view(torch.uint8) if write_q else rstd, scale if write_q else rstd, rstd,
            m, n, x2.stride(0), n, n, eps, POW2=power_of_two, WRITE_Q=write_q,
            Y_DTYPE=_TL_DTYPES[x.dtype], SOFTWARE_BF16=_software_bf16(x),
            GROUP=BLOCK_NORM_GROUP, num_warps=warps, **cfg, **format_args(fmt, x.device))
    return y, q, scale, rstd


def block_norm_backward_launch(dy, x, rstd):
    x2 = _rows_of(x, "block_norm_backward")
    m, n = x2.shape
    groups = _block_norm_groups(n, "block_norm_backward")
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"block_norm_backward: dy must be contiguous with x's shape {tuple(x.shape)}")
    if rstd.shape != tuple(x.shape[:-1]) + (groups,) or not rstd.is_contiguous():
        raise ValueError(f"block_norm_backward: rstd must be contiguous of shape "
                         f"{tuple(x.shape[:-1]) + (groups,)}, got {tuple(rstd.shape)}")
    dx = torch.empty_like(x)
    if m:
        cfg = dict(norm_config(n))
        warps = cfg.pop("num_warps")
        _block_norm_bwd_kernel[(triton.cdiv(m, cfg["BLOCK_M"]),)](
            dy.view(-1, n), x2, rstd, dx.view(-1, n), m, n, n, n, n,
            GROUP=BLOCK_NORM_GROUP, num_warps=warps, **cfg)
    return dx


# ---------------------------------------------------------------------------------------
# pure-PyTorch references (fp32 math, outputs in x's dtype; tests also run them in fp64)
# ---------------------------------------------------------------------------------------

def layer_norm_reference(x, weight, bias, eps):
    """(y, mean, rstd) with statistics as fp32 [..., 1]."""
    xf = x.float() if x.dtype != torch.float64 else x
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
    y = F.layer_norm(xf, (x.shape[-1],), None if weight is None else weight.to(xf.dtype),
                     None if bias is None else bias.to(xf.dtype), eps)
    return y.to(x.dtype), mean.float(), rstd.float()


def rms_norm_reference(x, weight, eps):
    """(y, rstd) with rstd fp32 [..., 1]."""
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype), rstd.float()


def block_norm_reference(x, eps):
    """(y, rstd [..., N/256])."""
    groups = _block_norm_groups(x.shape[-1], "block_norm")
    xf = x.float() if x.dtype != torch.float64 else x
    xg = xf.unflatten(-1, (groups, BLOCK_NORM_GROUP))
    rstd = torch.rsqrt(xg.pow(2).mean(-1) + eps)
    y = (xg * rstd.unsqueeze(-1)).flatten(-2)
    return y.to(x.dtype), rstd.float()


def quantize_rows_reference(y, fmt, power_of_two=False):
    """Rowwise reference cast of a norm output [..., N]: (q, scale [..., 1])."""
    return quantize_along(y, -1, parse_format(fmt), power_of_two)


def _norm_backward_reference(dy, x, weight, bias, forward):
    """Autograd of a reference forward in fp32: (dx, dw or None, db or None)."""
    with torch.enable_grad():
        xr = x.detach().float().requires_grad_()
        params = [p.detach().float().requires_grad_() if p is not None else None for p in (weight, bias)]
        y = forward(xr, *params)
        leaves = [t for t in [xr] + params if t is not None]
        grads = list(torch.autograd.grad(y, leaves, dy.float()))
    dx = grads.pop(0).to(x.dtype)
    out = [dx]
    for p in params:
        out.append(grads.pop(0) if p is not None else None)
    return tuple(out)


def layer_norm_backward_reference(dy, x, weight, bias, eps):
    return _norm_backward_reference(dy, x, weight, bias,
                                    lambda xr, w, b: F.layer_norm(xr, (x.shape[-1],), w, b, eps))


def rms_norm_backward_reference(dy, x, weight, eps):
    def fwd(xr, w, _):
        y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps)
        return y * w if w is not None else y
    return _norm_backward_reference(dy, x, weight, None, fwd)[:2]


def block_norm_backward_reference(dy, x, eps):
    def fwd(xr, *_):
        g = xr.unflatten(-1, (-1, BLOCK_NORM_GROUP))
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return _norm_backward_reference(dy, x, None, None, fwd)[0]


# ---------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------

def _stat(x, width=1):
    return x.new_empty(tuple(x.shape[:-1]) + (width,), dtype=torch.float32)


def _fp8_like(x, fmt):
    return x.new_empty(x.shape, dtype=parse_format(fmt).dtype)


def _fake_checks(x, what):
    check_input(x, what, dims=None)
    if x.dim() < 1:
        raise ValueError(f"{what}: x must have a feature dimension")


# LayerNorm ------------------------------------------------------------------------------

def _layer_norm_quant_eager(x, weight, bias, eps, fmt, power_of_two, write_y):
    if use_triton(x):
        return norm_quant_forward(x, weight, bias, eps, fmt, power_of_two, rms=False, write_y=write_y, write_q=True)
    x2 = _rows_of(x, "layer_norm_quant")
    _check_param(weight, x2.shape[1], x, "layer_norm_quant", "weight")
    _check_param(bias, x2.shape[1], x, "layer_norm_quant", "bias")
    y, mean, rstd = layer_norm_reference(x, weight, bias, eps)
    q, scale = quantize_rows_reference(y, fmt, power_of_two)
    return y, q, scale, mean, rstd


@torch.library.custom_op("loka::layer_norm_quant", mutates_args=())
def layer_norm_quant(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                     eps: float, fmt: str, power_of_two: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim, writing y (x's dtype) and its rowwise FP8 cast:
    (y, q, scale [..., 1], mean [..., 1], rstd [..., 1])."""
    y, q, scale, mean, rstd = _layer_norm_quant_eager(x, weight, bias, eps, fmt, power_of_two, True)
    return y, q, scale, mean, rstd


@layer_norm_quant.register_fake
def _(x, weight, bias, eps, fmt, power_of_two=False):
    _fake_checks(x, "layer_norm_quant")
    return torch.empty_like(x), _fp8_like(x, fmt), _stat(x), _stat(x), _stat(x)


@torch.library.custom_op("loka::layer_norm_quant_only", mutates_args=())
def layer_norm_quant_only(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                          eps: float, fmt: str, power_of_two: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm writing only the FP8 output: (q, scale, mean, rstd); no autograd (its
    backward is `layer_norm_backward` from mean and rstd)."""
    _, q, scale, mean, rstd = _layer_norm_quant_eager(x, weight, bias, eps, fmt, power_of_two, False)
    return q, scale, mean, rstd


@layer_norm_quant_only.register_fake
def _(x, weight, bias, eps, fmt, power_of_two=False):
    _fake_checks(x, "layer_norm_quant_only")
    return _fp8_like(x, fmt), _stat(x), _stat(x), _stat(x)


@torch.library.custom_op("loka::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                        mean: torch.Tensor, rstd: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of LayerNorm from the saved mean and rstd."""
    if use_triton(x):
        return norm_backward(dy, x, weight, mean, rstd, rms=False)
    xhat = (x.float() - mean) * rstd
    g = dy.float() * (weight.float() if weight is not None else 1.0)
    n = x.shape[-1]
    dx = rstd * (g - (xhat * g).sum(-1, keepdim=True) * xhat / n - g.sum(-1, keepdim=True) / n)
    p_dtype = weight.dtype if weight is not None else x.dtype
    dims = tuple(range(x.dim() - 1))
    return dx.to(x.dtype), (dy.float() * xhat).sum(dims).to(p_dtype), dy.float().sum(dims).to(p_dtype)


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    p_dtype = weight.dtype if weight is not None else x.dtype
    n = x.shape[-1]
    return torch.empty_like(x), x.new_empty((n,), dtype=p_dtype), x.new_empty((n,), dtype=p_dtype)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, *_ = inputs
    _, q, scale, mean, rstd = output
    ctx.mark_non_differentiable(q, scale, mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None


def _ln_backward(ctx, dy, *_):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.loka.layer_norm_backward(dy.contiguous(), x, weight, mean, rstd)
    return dx, dw if weight is not None else None, db if ctx.has_bias else None, None, None, None


layer_norm_quant.register_autograd(_ln_backward, setup_context=_ln_setup)


# RMSNorm --------------------------------------------------------------------------------

def _rms_norm_quant_eager(x, weight, eps, fmt, power_of_two, write_y):
    if use_triton(x):
        y, q, scale, _, rstd = norm_quant_forward(x, weight, None, eps, fmt, power_of_two,
                                                  rms=True, write_y=write_y, write_q=True)
        return y, q, scale, rstd
    x2 = _rows_of(x, "rms_norm_quant")
    _check_param(weight, x2.shape[1], x, "rms_norm_quant", "weight")
    y, rstd = rms_norm_reference(x, weight, eps)
    q, scale = quantize_rows_reference(y, fmt, power_of_two)
    return y, q, scale, rstd


@torch.library.custom_op("loka::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, fmt: str,
                   power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, writing y and its rowwise FP8 cast: (y, q, scale, rstd)."""
    y, q, scale, rstd = _rms_norm_quant_eager(x, weight, eps, fmt, power_of_two, True)
    return y, q, scale, rstd


@rms_norm_quant.register_fake
def _(x, weight, eps, fmt, power_of_two=False):
    _fake_checks(x, "rms_norm_quant")
    return torch.empty_like(x), _fp8_like(x, fmt), _stat(x), _stat(x)


@torch.library.custom_op("loka::rms_norm_quant_only", mutates_args=())
def rms_norm_quant_only(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, fmt: str,
                        power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm writing only the FP8 output: (q, scale, rstd); no autograd."""
    _, q, scale, rstd = _rms_norm_quant_eager(x, weight, eps, fmt, power_of_two, False)
    return q, scale, rstd


@rms_norm_quant_only.register_fake
def _(x, weight, eps, fmt, power_of_two=False):
    _fake_checks(x, "rms_norm_quant_only")
    return _fp8_like(x, fmt), _stat(x), _stat(x)


@torch.library.custom_op("loka::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of RMSNorm from the saved rstd."""
    if use_triton(x):
        dx, dw, _ = norm_backward(dy, x, weight, None, rstd, rms=True)
        return dx, dw
    xhat = x.float() * rstd
    g = dy.float() * (weight.float() if weight is not None else 1.0)
    dx = rstd * (g - (xhat * g).mean(-1, keepdim=True) * xhat)
    p_dtype = weight.dtype if weight is not None else x.dtype
    return dx.to(x.dtype), (dy.float() * xhat).sum(tuple(range(x.dim() - 1))).to(p_dtype)


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    p_dtype = weight.dtype if weight is not None else x.dtype
    return torch.empty_like(x), x.new_empty((x.shape[-1],), dtype=p_dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, *_ = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(x, weight, output[-1])


def _rms_backward(ctx, dy, *_):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.loka.rms_norm_backward(dy.contiguous(), x, weight, rstd)
    return dx, dw if weight is not None else None, None, None, None


rms_norm_quant.register_autograd(_rms_backward, setup_context=_rms_setup)


# BlockNorm ------------------------------------------------------------------------------

def _block_norm_eager(x, eps, fmt, power_of_two, write_q):
    if use_triton(x):
        return block_norm_forward(x, eps, fmt, power_of_two, write_q=write_q)
    _rows_of(x, "block_norm")
    y, rstd = block_norm_reference(x, eps)
    if not write_q:
        return y, None, None, rstd
    q, scale = quantize_rows_reference(y, fmt, power_of_two)
    return y, q, scale, rstd


@torch.library.custom_op("loka::block_norm", mutates_args=())
def block_norm(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameter-free RMSNorm over 256-wide groups of the last dim: (y, rstd [..., N/256])."""
    y, _, _, rstd = _block_norm_eager(x, eps, Fp8Format.E4M3, False, False)
    return y, rstd


@block_norm.register_fake
def _(x, eps):
    _fake_checks(x, "block_norm")
    return torch.empty_like(x), _stat(x, _block_norm_groups(x.shape[-1], "block_norm"))


@torch.library.custom_op("loka::block_norm_quant", mutates_args=())
def block_norm_quant(x: torch.Tensor, eps: float, fmt: str, power_of_two: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BlockNorm writing y and its rowwise FP8 cast: (y, q, scale [..., 1], rstd [..., N/256])."""
    y, q, scale, rstd = _block_norm_eager(x, eps, fmt, power_of_two, True)
    return y, q, scale, rstd


@block_norm_quant.register_fake
def _(x, eps, fmt, power_of_two=False):
    _fake_checks(x, "block_norm_quant")
    groups = _block_norm_groups(x.shape[-1], "block_norm_quant")
    return torch.empty_like(x), _fp8_like(x, fmt), _stat(x), _stat(x, groups)


@torch.library.custom_op("loka::block_norm_backward", mutates_args=())
def block_norm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx of BlockNorm from the saved per-group rstd."""
    if use_triton(x):
        return block_norm_backward_launch(dy, x, rstd)
    groups = _block_norm_groups(x.shape[-1], "block_norm_backward")
    xhat = x.float().unflatten(-1, (groups, BLOCK_NORM_GROUP)) * rstd.unsqueeze(-1)
    g = dy.float().unflatten(-1, (groups, BLOCK_NORM_GROUP))
    dx = rstd.unsqueeze(-1) * (g - (xhat * g).mean(-1, keepdim=True) * xhat)
    return dx.flatten(-2).to(x.dtype)


@block_norm_backward.register_fake
def _(dy, x, rstd):
    return torch.empty_like(x)


def _bn_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(inputs[0], output[-1])


def _bn_backward(ctx, dy, *_):
    x, rstd = ctx.saved_tensors
    return torch.ops.loka.block_norm_backward(dy.contiguous(), x, rstd), *([None] * (ctx.n_args - 1))


def _bn_setup_plain(ctx, inputs, output):
    _bn_setup(ctx, inputs, output)
    ctx.n_args = 2


def _bn_setup_quant(ctx, inputs, output):
    _bn_setup(ctx, inputs, output)
    ctx.n_args = 4


block_norm.register_autograd(_bn_backward, setup_context=_bn_setup_plain)
block_norm_quant.register_autograd(_bn_backward, setup_context=_bn_setup_quant)
