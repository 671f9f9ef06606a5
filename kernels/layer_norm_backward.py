"""LayerNorm backward over short rows in Triton: dx, and the weight and bias gradients as a
two-stage column reduction.

For y = (x - mean) * rstd * w + b over the last dim N of x [..., N] (M rows), from the
forward's saved mean and rstd:

    xhat = (x - mean) * rstd,  g = dy * w
    dx   = rstd * (g - xhat * mean_N(g * xhat) - mean_N(g))
    dw   = sum_M(dy * xhat),   db = sum_M(dy)

Stage 1 (`_rows_kernel`): a fixed number of programs (a few per SM) step through the tiles
of BLOCK_M rows; each writes dx for its rows and accumulates dy * xhat and dy in fp32
registers, one partial per program and column: [P, N] fp32 partials, P << M. Stage 2
(`_columns_kernel`): one program per block of columns sums the P partials and writes dw
and db in the weight's dtype. dw and db thus cost one extra [P, N] round trip, not a
reduction over M rows in a layout that reads x and dy again column by column.

dy, x, the weight and the statistics may have different float dtypes (under autocast the
forward runs in fp32 while x may be bf16; the statistics are fp32 on CUDA and x's dtype on
CPU): each is read in its own dtype and computed in fp32; dx has x's dtype. Rows must be
dense in the last dim; other layouts are copied first.

Non-finite values propagate as in the math above: a NaN or inf in a row of x makes that
row's dx NaN and every column of dw NaN; a NaN in dy at (r, c) makes dx's row r and dw[c],
db[c] NaN. Padding lanes load zeros and are masked out of every sum, so they never hide
or add a NaN.

`torch.ops.loka.layer_norm_backward(dy, x, weight, mean, rstd)` runs the kernels where
Triton runs (CUDA; CPU under TRITON_INTERPRET=1) and `layer_norm_backward_reference`
elsewhere. `layer_norm(x, weight, bias, eps)` is LayerNorm over the last dim whose forward
is ATen's `native_layer_norm` (AOTAutograd traces it, so Inductor compiles and fuses it)
and whose backward is that op: what the `layernorm_backward` Mod puts in a Dynamo graph.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_quant import sm_count, triton_runs_on

# A row is held in registers by one program; wider rows are not "short".
MAX_WIDTH = 4096
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the reference only
# Stage 1 tile: about this many elements per program and iteration (BLOCK_M rows of the
# padded width). Defaults until a GPU sweep sets them: benchmarks/layernorm_backward.py
# sweeps TILE_ELEMENTS, num_warps and PROGRAMS_PER_SM (docs/mods/layernorm_backward.md).
TILE_ELEMENTS = 4096
NUM_WARPS = 8
# Programs per SM in stage 1: enough resident warps to keep loads in flight, few enough
# that the [P, N] partials stay small.
PROGRAMS_PER_SM = 4
# Stage 2: partial rows summed per iteration, and columns per program.
_REDUCE_ROWS = 64
_REDUCE_COLS = 64


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------

@triton.jit
def _rows_kernel(
    dy_ptr,                     # [M, N], rows dense in N, stride_dy between rows
    x_ptr,                      # [M, N], stride_x between rows
    w_ptr,                      # [N]
    mean_ptr, rstd_ptr,         # [M]
    dx_ptr,                     # [M, N] in x's dtype, stride_dx between rows
    dw_part_ptr, db_part_ptr,   # [P, N] fp32, one row per program
    M, N, stride_dy, stride_x, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # Per-lane accumulators, summed over rows once at the end (no cross-warp sum per tile).
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # offsets below exceed int32
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(xhat * g, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(dw_part_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(db_part_ptr + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _columns_kernel(
    dw_part_ptr, db_part_ptr,   # [P, N] fp32
    dw_ptr, db_ptr,             # [N] in the weight's dtype
    P, N,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw_acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < P)[:, None] & col_mask[None, :]
        offsets = parts[:, None] * N + cols[None, :]
        dw_acc += tl.load(dw_part_ptr + offsets, mask=mask, other=0.0)
        db_acc += tl.load(db_part_ptr + offsets, mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(dw_acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    tl.store(db_ptr + cols, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


# ---------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------

def backward_config(n: int) -> dict:
    """Stage 1's launch parameters for rows of width n."""
    block_n = triton.next_power_of_2(max(n, 1))
    return dict(BLOCK_M=max(1, TILE_ELEMENTS // block_n), BLOCK_N=block_n, num_warps=NUM_WARPS,
                programs_per_sm=PROGRAMS_PER_SM)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [..., n] as [M, n] with unit column stride: a view where the layout allows, else a copy."""
    if t.dim() >= 1 and t.stride(-1) == 1:
        try:
            return t.view(-1, n)
        except RuntimeError:  # rows not evenly strided: copy below
            pass
    return t.contiguous().view(-1, n)


def check_arguments(dy, x, weight, mean, rstd) -> None:
    """ValueError naming what is wrong with the arguments of `layer_norm_backward`."""
    what = "layer_norm_backward"
    for name, t in (("dy", dy), ("x", x), ("weight", weight), ("mean", mean), ("rstd", rstd)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{what}: {name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{what}: {name} is on {t.device}, x on {x.device}")
    if x.dim() < 1:
        raise ValueError(f"{what}: x must have a feature dimension, got a 0-d tensor")
    n = x.shape[-1]
    if n > MAX_WIDTH:
        raise ValueError(f"{what}: rows of {n} exceed MAX_WIDTH={MAX_WIDTH} (a row is held in registers)")
    if dy.shape != x.shape:
        raise ValueError(f"{what}: dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if weight.shape != (n,):
        raise ValueError(f"{what}: weight must have shape ({n},), got {tuple(weight.shape)}")
    rows = x.numel() // n if n else 0
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.numel() != rows:
            raise ValueError(f"{what}: {name} must hold one value per row ({rows}), got shape {tuple(t.shape)}")


def layer_norm_backward_triton(dy, x, weight, mean, rstd, config: Optional[dict] = None):
    """(dx, dw, db) by the two Triton kernels; `config` overrides `backward_config(N)`."""
    check_arguments(dy, x, weight, mean, rstd)
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
    db = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
    m = x.numel() // n if n else 0
    if m == 0 or n == 0:
        return dx, dw.zero_(), db.zero_()
    cfg = dict(config or backward_config(n))
    warps, per_sm = cfg.pop("num_warps"), cfg.pop("programs_per_sm")
    x2, dy2, dx2 = _rows(x, n), _rows(dy, n), dx.view(-1, n)
    programs = min(triton.cdiv(m, cfg["BLOCK_M"]), per_sm * sm_count(x.device))
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    # Triton launches on the current device: make it x's.
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _rows_kernel[(programs,)](
            dy2, x2, weight.contiguous(), mean.reshape(-1), rstd.reshape(-1), dx2, dw_part, db_part,
            m, n, dy2.stride(0), x2.stride(0), dx2.stride(0), num_warps=warps, **cfg)
        _columns_kernel[(triton.cdiv(n, _REDUCE_COLS),)](
            dw_part, db_part, dw, db, programs, n, BLOCK_P=_REDUCE_ROWS, BLOCK_N=_REDUCE_COLS, num_warps=4)
    return dx, dw, db


# ---------------------------------------------------------------------------------------
# pure-PyTorch reference (what the op runs where Triton does not)
# ---------------------------------------------------------------------------------------

def layer_norm_backward_reference(dy, x, weight, mean, rstd):
    """(dx, dw, db) from the saved statistics, computed in fp32 (fp64 for fp64 inputs)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.shape[-1]
    rows = x.reshape(-1, n).to(compute)
    mean_r, rstd_r = mean.reshape(-1, 1).to(compute), rstd.reshape(-1, 1).to(compute)
    dy_r = dy.reshape(-1, n).to(compute)
    xhat = (rows - mean_r) * rstd_r
    g = dy_r * weight.to(compute)
    dx = rstd_r * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    return (dx.to(x.dtype).view(x.shape), (dy_r * xhat).sum(0).to(weight.dtype),
            dy_r.sum(0).to(weight.dtype))


# ---------------------------------------------------------------------------------------
# op and autograd
# ---------------------------------------------------------------------------------------

@torch.library.custom_op("loka::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of LayerNorm over the last dim from the saved mean and rstd
    (one per row); dx contiguous in x's dtype, dweight and dbias in the weight's."""
    if triton_runs_on(x) and torch.float64 not in (dy.dtype, x.dtype, weight.dtype, mean.dtype, rstd.dtype):
        return layer_norm_backward_triton(dy, x, weight, mean, rstd)
    check_arguments(dy, x, weight, mean, rstd)
    return layer_norm_backward_reference(dy, x, weight, mean, rstd)


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    check_arguments(dy, x, weight, mean, rstd)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


class _LayerNorm(torch.autograd.Function):
    """ATen's forward, loka's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = torch.ops.loka.layer_norm_backward(dy, x, weight, mean, rstd)
        wants_x, wants_w, wants_b = ctx.needs_input_grad[:3]
        return (dx if wants_x else None, dw if wants_w else None,
                db if ctx.has_bias and wants_b else None, None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm(x, (x.shape[-1],), weight, bias, eps), same values and dtypes (autocast
    included), its backward `torch.ops.loka.layer_norm_backward`."""
    return _LayerNorm.apply(x, weight, bias, eps)
