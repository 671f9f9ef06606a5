"""FP8 GEMM whose epilogue normalizes each output row: the `gemm_norm` Mod's kernel.

    S[M, N]   = act(dequant(A) @ dequant(B) + bias) + residual     (as `triton_gemm`)
    Y[M, N]   = post_act(norm(S) * norm_weight + norm_bias)
    norm(S)   = (S - mean) * rstd        "layer" (LayerNorm; var with no correction)
              = S * rstd                 "rms"   (RMSNorm; rstd = 1 / sqrt(mean(S^2) + eps))

Y is written in out_dtype: the next GEMM's FP8 operand (cast with its calibrated
`out_scale`, as `triton_gemm`'s FP8 output) or a high-precision dtype. With `write_pre`, S
is written too, in `pre_dtype`: the pre-norm sum that a residual stream reads again
(HSTU's `x = out(...) + x`, normalized by the next block and added to its output).

One program holds whole rows: BLOCK_N is N's next power of two, so the row statistics are
reductions inside the tile, in fp32, and S never goes to memory unless asked for. That
bounds N by MAX_N: a 128-row tile of 256 fp32 columns is already 128 accumulator
registers per thread at 8 warps. Wider rows would need split statistics (per-tile
partial sums and a second pass); the Mod declines them.

A and B: 2-D FP8 operands, tensorwise or rowwise scaled (the scalings of the static A
scales that feed this Mod), each row- or column-major; K any size (masked). Pointer loads,
no TMA variant built: with fast accumulation the kernel beats `_scaled_mm` + Inductor's norm
kernel at every chain measured; with precise accumulation it trails at some shapes, where the
speed check leaves the chain unfused (docs/mods/gemm_norm.md).

On CPU without the interpreter the op computes `reference_fp8_gemm_norm`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from .quantize import Fp8Format, Scaling, cast_with_scale
from .triton_gemm import (ACCUM_MODES, ACTIVATIONS, FP8_DTYPES, OUT_DTYPES, PRECISE_ACCUM, SCALE_BLOCK,
                          _activation, _capability, _check_args, _device_index, _epilogue_values,
                          _output_values, _pointer_main_loop, _tensorwise_scale, apply_activation, interpreting,
                          m_bucket, reference_fp8_gemm)

NORMS = {"layer": 1, "rms": 2}
MAX_N = 256
_PRE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gemm_norm_kernel(
    a_ptr, b_ptr,              # A [M, K], B [K, N] fp8, any strides with a unit one
    out_ptr,                   # Y [M, N] out dtype
    pre_ptr,                   # S [M, N] pre dtype, written when WRITE_PRE
    a_scale_ptr, b_scale_ptr,  # fp32: one element each (tensorwise), or [M, 1] and [1, N] (rowwise)
    bias_ptr,                  # [N] or unused
    residual_ptr,              # [M, N] or unused
    norm_weight_ptr, norm_bias_ptr,  # [N] each, or unused
    out_scale_ptr,             # fp32, one element or [N]; read only for an FP8 output
    M, N, K, eps,
    M_BUCKET,                  # autotune key only
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_pm,
    stride_asm, stride_bsn, stride_bias, stride_rm, stride_rn, stride_nw, stride_nb, stride_os,
    SCALING: tl.constexpr, ACCUM: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    NORM: tl.constexpr, HAS_NORM_WEIGHT: tl.constexpr, HAS_NORM_BIAS: tl.constexpr,
    POST_ACTIVATION: tl.constexpr, WRITE_PRE: tl.constexpr,
    OUT_FP8: tl.constexpr, OUT_FP8_MAX: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Columns past N hold wrapped values: the statistics mask them, the stores both edges.
    acc = _pointer_main_loop(a_ptr, b_ptr, offs_m, offs_n, 0, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             a_scale_ptr, b_scale_ptr, stride_asm, 0, 0, stride_bsn,
                             SCALING, ACCUM, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK)
    s = _epilogue_values(acc, offs_m, offs_n, M, N, a_scale_ptr, b_scale_ptr, stride_asm, stride_bsn,
                         bias_ptr, 0, stride_bias, residual_ptr, stride_rm, stride_rn,
                         SCALING, HAS_BIAS, False, HAS_RESIDUAL, ACTIVATION)
    rows = offs_m.to(tl.int64)[:, None]
    cols = offs_n.to(tl.int64)[None, :]
    inside = mask_m[:, None] & mask_n[None, :]
    if WRITE_PRE:
        tl.store(pre_ptr + rows * stride_pm + cols, s.to(pre_ptr.dtype.element_ty), mask=inside)
    s = tl.where(mask_n[None, :], s, 0.0)
    if NORM == 1:
        mean = tl.sum(s, axis=1) / N
        centered = tl.where(mask_n[None, :], s - mean[:, None], 0.0)
        var = tl.sum(centered * centered, axis=1) / N
        y = centered * tl.rsqrt(var + eps)[:, None]
    else:
        mean_square = tl.sum(s * s, axis=1) / N
        y = s * tl.rsqrt(mean_square + eps)[:, None]
    if HAS_NORM_WEIGHT:
        y = y * tl.load(norm_weight_ptr + offs_n * stride_nw, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if HAS_NORM_BIAS:
        y = y + tl.load(norm_bias_ptr + offs_n * stride_nb, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = _activation(y, POST_ACTIVATION)
    values = _output_values(y, offs_n, N, out_scale_ptr, stride_os, out_ptr.dtype.element_ty, OUT_FP8,
                            OUT_FP8_MAX, SOFTWARE_CAST)
    tl.store(out_ptr + rows * stride_om + cols, values, mask=inside)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int

    def triton_config(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.block_m, "BLOCK_K": self.block_k}, num_warps=self.num_warps,
                             num_stages=self.num_stages)


# Autotuning candidates, not tuned one by one (the Mod's speed check times the tuner's pick
# against the unfused GEMM + norm at each shape, so a poor pick costs the fusion, never a
# slowdown; docs/mods/gemm_norm.md has the picks' results). Row tiles of 32-128
# rows: a BLOCK_N of 256 with 128 rows holds 128 fp32 accumulator values per thread at 8 warps.
NORM_CONFIGS = [
    NormConfig(32, 128, num_warps=4, num_stages=3),
    NormConfig(64, 128, num_warps=4, num_stages=3),
    NormConfig(64, 128, num_warps=8, num_stages=3),
    NormConfig(128, 128, num_warps=8, num_stages=3),
    NormConfig(64, 64, num_warps=4, num_stages=4),
]
INTERPRETER_CONFIG = NormConfig(16, 32, num_warps=4, num_stages=1)
_AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "SCALING", "ACCUM", "HAS_RESIDUAL", "WRITE_PRE", "OUT_FP8"]


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    # A per-step accumulator beside the running one (precise accumulation) doubles the
    # tile's registers: keep the pair within 128 fp32 registers per thread.
    pair = 2 if args["ACCUM"] != ACCUM_MODES["fast"] else 1
    kept = [c for c in configs if pair * c.kwargs["BLOCK_M"] * args["BLOCK_N"] <= 128 * 32 * c.num_warps]
    return kept or configs[:1]


_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_fp8_gemm_norm_kernel)
_kernel_tuned = triton.autotune(configs=[c.triton_config() for c in NORM_CONFIGS], key=_AUTOTUNE_KEY,
                                prune_configs_by={"early_config_prune": _prune})(_kernel)


def _check_norm_args(n: int, norm: str, norm_weight, norm_bias, eps: float, post_activation: str,
                     pre_dtype, device) -> None:
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; valid: {sorted(NORMS)}")
    if n > MAX_N:
        raise ValueError(f"rows of {n} do not fit one tile: the GEMM->norm kernel takes N <= {MAX_N}")
    if post_activation not in ACTIVATIONS:
        raise ValueError(f"unknown post_activation {post_activation!r}; valid: {sorted(ACTIVATIONS)}")
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if norm == "rms" and norm_bias is not None:
        raise ValueError("an RMS norm takes no bias")
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is not None and (tuple(t.shape) != (n,) or t.device != device or t.dtype not in _PRE_DTYPES):
            raise ValueError(f"{name} must be [{n}] on {device} in one of {_PRE_DTYPES}, got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}")
    if pre_dtype not in _PRE_DTYPES:
        raise ValueError(f"pre_dtype must be one of {_PRE_DTYPES}, got {pre_dtype}")


def _norm_plan(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight, norm_bias, eps,
               post_activation, out_dtype, out_scale, pre_dtype):
    plan = _check_args(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype, "auto", out_scale)
    if plan.batch is not None:
        raise ValueError(f"the GEMM->norm kernel takes 2-D operands, got A {tuple(a.shape)} @ B {tuple(b.shape)}")
    if plan.scaling is Scaling.BLOCKWISE:
        raise ValueError("the GEMM->norm kernel takes tensorwise or rowwise operands, not blockwise")
    if bias is not None and bias.numel() != plan.n:
        raise ValueError(f"the GEMM->norm kernel takes a bias of [{plan.n}], got {tuple(bias.shape)}")
    _check_norm_args(plan.n, norm, norm_weight, norm_bias, eps, post_activation, pre_dtype, a.device)
    return plan


def fp8_gemm_norm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, scaling,
                  bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                  activation: str = "none", norm: str = "layer", norm_weight: Optional[torch.Tensor] = None,
                  norm_bias: Optional[torch.Tensor] = None, eps: float = 1e-5, post_activation: str = "none",
                  out_dtype: torch.dtype = torch.bfloat16, out_scale: Optional[torch.Tensor] = None,
                  write_pre: bool = False, pre_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False,
                  config: Optional[NormConfig] = None) -> tuple:
    """(Y, S) of the module docstring: Y [M, N] in out_dtype (FP8 with `out_scale`), S [M, N]
    in pre_dtype when `write_pre`, else None."""
    plan = _norm_plan(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight, norm_bias,
                      eps, post_activation, out_dtype, out_scale, pre_dtype)
    interpret = interpreting()
    if not interpret and a.device.type != "cuda":
        return reference_fp8_gemm_norm(a, a_scale, b, b_scale, plan.scaling, bias, residual, activation, norm,
                                       norm_weight, norm_bias, eps, post_activation, out_dtype, out_scale,
                                       write_pre, pre_dtype)
    if a.device.type == "cuda" and not interpret and _capability(_device_index(a.device)) < (8, 9):
        raise ValueError(f"FP8 GEMM needs sm89+, {a.device} is not")
    m, n, k = plan.m, plan.n, plan.k
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    pre = torch.empty((m, n), dtype=pre_dtype, device=a.device) if write_pre else None
    if m == 0 or n == 0:
        return out, pre
    if plan.scaling is Scaling.TENSORWISE:
        a_scale, b_scale = _tensorwise_scale(a_scale), _tensorwise_scale(b_scale)
        stride_asm = stride_bsn = 0
    else:
        stride_asm, stride_bsn = a_scale.stride(0), b_scale.stride(1)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    bias = bias.reshape(-1) if bias is not None else None
    unused = out  # pointer arguments whose flag is off: never read
    flags = dict(
        SCALING=0 if plan.scaling is Scaling.TENSORWISE else 1,
        ACCUM=ACCUM_MODES["fast" if fast_accum else PRECISE_ACCUM],
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, ACTIVATION=plan.activation,
        NORM=NORMS[norm], HAS_NORM_WEIGHT=norm_weight is not None, HAS_NORM_BIAS=norm_bias is not None,
        POST_ACTIVATION=ACTIVATIONS[post_activation], WRITE_PRE=write_pre,
        OUT_FP8=FP8_DTYPES.index(out_dtype) + 1 if out_scale is not None else 0,
        OUT_FP8_MAX=float(torch.finfo(out_dtype).max) if out_scale is not None else 0.0,
        SOFTWARE_CAST=interpret, SCALE_BLOCK=SCALE_BLOCK, BLOCK_N=max(16, triton.next_power_of_2(n)),
    )
    args = (a, b, out, pre if pre is not None else unused, a_scale, b_scale,
            bias if bias is not None else unused, residual if residual is not None else unused,
            norm_weight if norm_weight is not None else unused, norm_bias if norm_bias is not None else unused,
            out_scale.reshape(-1) if out_scale is not None else a_scale,
            m, n, k, float(eps), m_bucket(m),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), n,
            stride_asm, stride_bsn, bias.stride(0) if bias is not None else 0,
            *(residual.stride() if residual is not None else (0, 0)),
            norm_weight.stride(0) if norm_weight is not None else 0,
            norm_bias.stride(0) if norm_bias is not None else 0,
            1 if out_scale is not None and out_scale.numel() > 1 else 0)
    if config is None and interpret:
        config = INTERPRETER_CONFIG
    if config is None:
        _kernel_tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)](*args, **flags)
    else:
        chosen = config.triton_config()
        _kernel[(triton.cdiv(m, config.block_m),)](*args, **flags, **chosen.all_kwargs())
    return out, pre


def reference_fp8_gemm_norm(a, a_scale, b, b_scale, scaling="tensorwise", bias=None, residual=None,
                            activation="none", norm="layer", norm_weight=None, norm_bias=None, eps=1e-5,
                            post_activation="none", out_dtype=torch.bfloat16, out_scale=None, write_pre=False,
                            pre_dtype=torch.bfloat16, compute_dtype=torch.float64) -> tuple:
    """Pure-PyTorch meaning of `fp8_gemm_norm`, in compute_dtype, cast as the kernel casts."""
    s = reference_fp8_gemm(a, a_scale, b, b_scale, scaling, bias, residual, activation, out_dtype=compute_dtype,
                           compute_dtype=compute_dtype)
    if norm == "layer":
        y = (s - s.mean(-1, keepdim=True)) * torch.rsqrt(s.var(-1, correction=0, keepdim=True) + eps)
    else:
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    if norm_weight is not None:
        y = y * norm_weight.to(compute_dtype)
    if norm_bias is not None:
        y = y + norm_bias.to(compute_dtype)
    y = apply_activation(y, post_activation)
    if out_scale is not None:
        fmt = Fp8Format.E4M3 if out_dtype == torch.float8_e4m3fn else Fp8Format.E5M2
        out = cast_with_scale(y.float(), out_scale.float().reshape(-1), fmt, non_finite_to_nan=True)
    else:
        out = y.to(out_dtype)
    return out, (s.to(pre_dtype) if write_pre else None)


# ---------------------------------------------------------------------------------------
# op registration
# ---------------------------------------------------------------------------------------

_LIB = torch.library.Library("loka", "FRAGMENT")
_LIB.define(
    "triton_fp8_gemm_norm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, str scaling, Tensor? bias, "
    "Tensor? residual, str activation, str norm, Tensor? norm_weight, Tensor? norm_bias, float eps, "
    "str post_activation, ScalarType out_dtype, Tensor? out_scale, bool write_pre, ScalarType pre_dtype, "
    "bool fast_accum=False) -> (Tensor, Tensor)")


def _op_impl(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight, norm_bias, eps,
             post_activation, out_dtype, out_scale, write_pre, pre_dtype, fast_accum=False):
    """(Y, S); S is an empty [0] tensor unless write_pre (an op returns tensors, not None)."""
    out, pre = fp8_gemm_norm(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight,
                             norm_bias, eps, post_activation, out_dtype, out_scale, write_pre, pre_dtype, fast_accum)
    return out, pre if pre is not None else a.new_empty((0,), dtype=pre_dtype)


for _key in ("CPU", "CUDA"):
    _LIB.impl("triton_fp8_gemm_norm", _op_impl, _key)


@torch.library.register_fake("loka::triton_fp8_gemm_norm", lib=_LIB)
def _op_fake(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight, norm_bias, eps,
             post_activation, out_dtype, out_scale, write_pre, pre_dtype, fast_accum=False):
    plan = _norm_plan(a, a_scale, b, b_scale, scaling, bias, residual, activation, norm, norm_weight, norm_bias,
                      eps, post_activation, out_dtype, out_scale, pre_dtype)
    pre_shape = (plan.m, plan.n) if write_pre else (0,)
    return a.new_empty((plan.m, plan.n), dtype=out_dtype), a.new_empty(pre_shape, dtype=pre_dtype)


__all__ = ["MAX_N", "NORMS", "OUT_DTYPES", "fp8_gemm_norm", "reference_fp8_gemm_norm"]
