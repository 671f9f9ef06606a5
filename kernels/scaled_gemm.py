"""An FP8 site as graph nodes: each operand's cast, then the provider's GEMM on the
quantized operands. The `lower` pass traces `scaled_gemm` into the ATen graph in place of
the site's `mm`/`addmm`/`bmm`/`baddbmm`, so:

- with `fused_casts`, each cast is ordinary ATen ops (amax, scale, divide, clamp,
  convert): Inductor fuses them into the kernel of whatever produced the operand (a
  LayerNorm, an activation, a residual add), forward and backward alike;
- without it, each cast is one opaque `loka::quantize_operand` node (loka's Triton casts on
  FP8 GPUs), the unfused baseline the ablation measures;
- the GEMM is the provider's node: `aten._scaled_mm` (Inductor autotunes it against its
  own Triton templates, which take pointwise epilogues), `loka::triton_fp8_gemm` (whose
  epilogue carries bias, activation and residual), or the emulation's dequantize + fp32
  matmul.

Layouts: A is cast to row-major [.., M, K] and B to column-major [.., K, N] (B's transpose
is cast row by row), the layouts FP8 tensor cores read, so no transposed copy follows.
Batched operands (bmm, baddbmm: [B, M, K], [B, K, N]): a tensorwise cast keeps one scale
for the whole batch (0-d), a rowwise one a scale per row of each A and per column of each
B ([B, M, 1], [B, 1, N]), B column-major per matrix; blockwise casts take 2-D operands
only, so no provider serves a batched blockwise site (`GemmProvider.batched_scalings`).
Static activation scales (a calibrated plan, inference): A is cast with a constant
(`quantize_static`), no amax reduction.
Amax guard (tensorwise sites of a graph with a probe window, `AmaxGuard`): after an
operand's cast, `loka::amax_guard` hands its amax to the backend, which moves a site whose
amax jumped far above its window's, or whose cached e4m3 weight holds an inf or NaN, to
rowwise (`loka_compile/amax_guard.py`).
Padding: K and N padded with zeros up to a multiple of 16 (`pad_k`, `pad_n`); zeros add
nothing to the product and the padded output columns are sliced off.

Everything here is traceable with symbolic sizes: no branch reads a tensor's size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from . import providers
from .quantize import (Fp8Format, Scaling, amax_along, cast_with_scale, quantize_along, quantize_blockwise,
                       quantize_tensorwise, row_scale_of_pieces)


def amax_jump(fmt: Fp8Format) -> float:
    """How far above its probe window's largest amax a tensorwise operand's amax may go.
    Beyond fmt.max / smallest normal (e4m3: 448 / 2^-6 = 2^14.8; e5m2: 57344 / 2^-14 =
    2^29.8) every value the window saw, its largest included, scales below the format's
    normal range: typical values keep a bit or two, or flush to zero (2048 x 256 Gaussian
    A with one outlier row, e4m3: the other rows' error 0.03 at 2^12, 0.10 at 2^14, 0.17
    at 2^14.8, 0.99 at 2^18)."""
    return fmt.max / torch.finfo(fmt.dtype).smallest_normal


@dataclasses.dataclass(frozen=True)
class AmaxGuard:
    """A tensorwise site's run-time check: each operand's amax against `amax_jump` times
    its probe window's largest (None: unchecked), and, for an e4m3 operand cast eagerly
    (a cached weight), any inf or NaN (e4m3 has no inf, so a tensorwise cast writes NaN
    where high precision has +-inf). `key` names the site to the backend
    ("<graph token>/<site id>")."""

    key: str
    a_limit: Optional[float] = None
    b_limit: Optional[float] = None

    @classmethod
    def of_window(cls, key: str, a_amax: Optional[float], b_amax: Optional[float], a_format: Fp8Format,
                  b_format: Fp8Format) -> Optional["AmaxGuard"]:
        def limit(amax, fmt):
            return amax * amax_jump(fmt) if amax is not None and 0 < amax < float("inf") else None
        guard = cls(key, limit(a_amax, a_format), limit(b_amax, b_format))
        return guard if guard.a_limit is not None or guard.b_limit is not None else None


def guard_amax(x: torch.Tensor, scale: torch.Tensor, operand: str, fmt: Fp8Format, guard: AmaxGuard) -> None:
    """Hand a tensorwise cast's amax to the guard (`loka::amax_guard`): in a graph the
    finite amax its scale came from, so the guard adds no pass over x; cast eagerly (a
    cached weight's refresh), for e4m3 the amax of every value, inf or NaN where there is
    one. The graph's guards are merged into one op (`passes/amax_guard.py`): one op per
    operand, with a non-finite reduction of its own, cost more than the GEMMs saved
    (docs/guide.md, the amax guard)."""
    limit = guard.a_limit if operand == "a" else guard.b_limit
    if limit is None:
        return
    eager = not isinstance(x, torch._subclasses.FakeTensor)
    amax = amax_along(x) if eager and fmt is Fp8Format.E4M3 else scale.reshape(()) * fmt.max
    torch.ops.loka.amax_guard(amax, guard.key, operand, limit)


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """How one FP8 site runs."""

    scaling: Scaling
    a_format: Fp8Format
    b_format: Fp8Format
    provider: str
    out_dtype: torch.dtype
    pad_k: int = 0
    pad_n: int = 0
    fused_casts: bool = True
    fast_accum: bool = False
    a_static_scale: Optional[float] = None  # calibrated A scale (inference): no amax, A / s clamped
    amax_guard: Optional[AmaxGuard] = None  # tensorwise: the run-time amax check (`AmaxGuard`)


def quantize_k_major(x: torch.Tensor, scaling: Scaling, fmt: Fp8Format, block_rows: int = 1):
    """x [.., R, K] -> (q [.., R, K] contiguous, scale) with scales along K: 0-d
    (tensorwise), [.., R, 1] (rowwise) or one per [block_rows, 128] tile (blockwise)."""
    if scaling is Scaling.TENSORWISE:
        q, scale = quantize_tensorwise(x, fmt)
    elif scaling is Scaling.ROWWISE:
        q, scale = quantize_along(x, -1, fmt)
    else:
        q, scale = quantize_blockwise(x, block_rows, 128, fmt)
    return q.contiguous(), scale


def quantize_operand_aten(x: torch.Tensor, operand: str, scaling: Scaling, fmt: Fp8Format):
    """The cast of one GEMM operand, K-major, as ATen ops. A [.., M, K] -> (q row-major,
    scale [.., M, 1]); B [.., K, N] -> (q column-major [.., K, N], scale [.., 1, N])."""
    if operand == "a":
        return quantize_k_major(x, scaling, fmt)
    q_t, scale_t = quantize_k_major(x.transpose(-1, -2), scaling, fmt, block_rows=128)
    return q_t.transpose(-1, -2), scale_t.transpose(-1, -2) if scale_t.dim() else scale_t


def quantize_static(x: torch.Tensor, scale: float, scaling: Scaling, fmt: Fp8Format):
    """A [.., M, K] cast with a calibrated constant scale: clamp(A / scale) -> fmt, one
    pointwise op (no reduction), so Inductor fuses it into A's producer. Values beyond
    the calibrated range saturate at +-fmt.max; inf and NaN become NaN. The scale is 0-d
    (tensorwise) or the constant broadcast to [.., M, 1] (rowwise), so the GEMM is the
    recipe's own. Blockwise sites are not given static scales."""
    if scaling is Scaling.BLOCKWISE:
        raise ValueError("static activation scales serve tensorwise and rowwise sites, not blockwise")
    q = cast_with_scale(x, scale, fmt, non_finite_to_nan=True).contiguous()
    return q, static_scale_of(q, scale, scaling)


def static_scale_of(q: torch.Tensor, scale: float, scaling: Scaling) -> torch.Tensor:
    """The GEMM's scale operand for an A [.., M, K] cast with the constant `scale`: 0-d
    (tensorwise) or broadcast to [.., M, 1] (rowwise)."""
    if scaling is Scaling.TENSORWISE:
        return torch.full((), scale, dtype=torch.float32, device=q.device)
    return torch.full_like(q[..., :1], scale, dtype=torch.float32)


def gemm_to_next_operand(a_q, a_s, b_q, b_s, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                         activation: str, spec: GemmSpec, out_format: Fp8Format,
                         out_scale: torch.Tensor) -> torch.Tensor:
    """act(A @ B + bias) + residual written as the next GEMM's FP8 A, cast in the GEMM's
    epilogue with that GEMM's calibrated constant scale (`loka::triton_fp8_gemm`):
    the `gemm_epilogue` Mod's node. 2-D operands, K and N unpadded; the residual is any
    shape of [M, N]'s elements with N last, and is read as [M, N]. `out_scale`: fp32, one
    element or one per column (a graph constant in the Mod's graphs)."""
    if spec.pad_k or spec.pad_n:
        raise ValueError("a GEMM that writes the next one's operand takes unpadded operands")
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1])
    return torch.ops.loka.triton_fp8_gemm(
        a_q, a_s, b_q, b_s, spec.scaling.value, bias, residual, activation, out_dtype=out_format.dtype,
        fast_accum=spec.fast_accum, out_scale=out_scale)


def gemm_norm_to_next_operand(a_q, a_s, b_q, b_s, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                              activation: str, norm: str, norm_weight: Optional[torch.Tensor],
                              norm_bias: Optional[torch.Tensor], eps: float, post_activation: str, spec: GemmSpec,
                              out_format: Fp8Format, out_scale: torch.Tensor, write_pre: bool):
    """post_act(norm(act(A @ B + bias) + residual)) written as the next GEMM's FP8 A by
    one kernel (`loka::triton_fp8_gemm_norm`): the `gemm_norm` Mod's node. Returns that
    operand, and with `write_pre` also the pre-norm value in the site's dtype, shaped as
    the residual (or [M, N] without one)."""
    if spec.pad_k or spec.pad_n:
        raise ValueError("a GEMM that writes the next one's operand takes unpadded operands")
    shape = None if residual is None else residual.shape
    if residual is not None:
        residual = residual.reshape(-1, residual.shape[-1])
    q, pre = torch.ops.loka.triton_fp8_gemm_norm(
        a_q, a_s, b_q, b_s, spec.scaling.value, bias, residual, activation, norm, norm_weight, norm_bias, eps,
        post_activation, out_format.dtype, out_scale, write_pre, spec.out_dtype, spec.fast_accum)
    if not write_pre:
        return q
    return q, pre if shape is None else pre.view(shape)


def _pad(x: torch.Tensor, last: int, second_last: int) -> torch.Tensor:
    return F.pad(x, (0, last, 0, second_last)) if last or second_last else x


def cast_operand(x: torch.Tensor, operand: str, spec: GemmSpec):
    """Operand "a" [.., M, K] or "b" [.., K, N] padded and cast as `spec` says, K-major:
    ATen ops with `fused_casts`, else one opaque `loka::quantize_operand` node; a
    tensorwise cast with `spec.amax_guard` also hands its amax to the guard. One matrix
    broadcast over a batch (stride 0: W @ x of the transposed_linear Mod) is cast once and
    its FP8 copy and scales broadcast the same way."""
    if x.dim() == 3 and _broadcast_batch(x):
        q, scale = cast_operand(x[0], operand, spec)
        return q.expand(x.shape[0], *q.shape), (scale if scale.dim() == 0 else scale.expand(x.shape[0], *scale.shape))
    if operand == "a":
        x, fmt = _pad(x, spec.pad_k, 0), spec.a_format
        if spec.a_static_scale is not None:
            return quantize_static(x, spec.a_static_scale, spec.scaling, fmt)
    else:
        x, fmt = _pad(x, spec.pad_n, spec.pad_k), spec.b_format
    if spec.fused_casts:
        q, scale = quantize_operand_aten(x, operand, spec.scaling, fmt)
    else:
        q, scale = torch.ops.loka.quantize_operand(x, operand, spec.scaling.value, fmt.value)
    if spec.amax_guard is not None and spec.scaling is Scaling.TENSORWISE:
        guard_amax(x, scale, operand, fmt, spec.amax_guard)
    return q, scale


def cast_to_save(x: torch.Tensor, operand: str, spec: GemmSpec):
    """x's cast as `cast_operand` makes it, and its dequantized copy (`loka::dequantize_saved`):
    (dequantized, q, scale). The saved_fp8 Mod computes the cast in the forward and hands
    the backward GEMM the dequantized copy, which `lower` replaces by q and scale."""
    q, scale = cast_operand(x, operand, spec)
    return torch.ops.loka.dequantize_saved(q, scale, x.dtype), q, scale


def cast_a_pieces(pieces: list, spec: GemmSpec, dtype: torch.dtype, flatten: bool):
    """Operand A given as the pieces it concatenates along K (the `cat_casts` Mod), cast
    rowwise per piece: each piece's row amax, their max as the row's scale, each part cast
    with it. The same values as quantize_along(cat(pieces, -1), -1); each amax reduces only
    its piece's row, so Inductor computes it in the kernel that produced the piece. Each
    piece is converted to A's `dtype` and, with `flatten`, viewed [rows, K_i] as A's 2-D
    view of the concatenation is."""
    if spec.scaling is not Scaling.ROWWISE or spec.pad_k or spec.a_static_scale is not None or not spec.fused_casts:
        raise ValueError("a per-piece cast of A is rowwise, fused, unpadded and dynamic")
    pieces = [(p.reshape(-1, p.shape[-1]) if flatten else p).to(dtype) for p in pieces]
    scale = row_scale_of_pieces(pieces, spec.a_format)
    # More parts than Inductor concatenates pointwise (`max_pointwise_cat_inputs`): it then
    # computes each part's cast into its slice of the output (a ConcatKernel). A pointwise
    # cat evaluates every part's cast for each output element, masked (docs/mods/cat_casts.md:
    # what that one kernel cost).
    chunks = -(-(_pointwise_cat_limit() + 1) // len(pieces))
    parts = [part for p in pieces for part in (p.chunk(chunks, -1) if chunks > 1 else (p,))]
    return torch.cat([cast_with_scale(part, scale, spec.a_format) for part in parts], -1), scale


def _pointwise_cat_limit() -> int:
    """Most inputs Inductor may concatenate pointwise (torch 2.11 has only the first limit)."""
    from torch._inductor import config as inductor_config
    return max(getattr(inductor_config, "max_pointwise_cat_inputs", 8),
               getattr(inductor_config, "max_complex_pointwise_cat_inputs", 0))


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], spec: GemmSpec) -> torch.Tensor:
    """a [.., M, K] @ b [.., K, N] (+ bias) through FP8, in spec.out_dtype."""
    return gemm_quantized(*cast_operand(a, "a", spec), *cast_operand(b, "b", spec), bias, spec)


def gemm_quantized(a_q, a_s, b_q, b_s, bias: Optional[torch.Tensor], spec: GemmSpec) -> torch.Tensor:
    """The provider's GEMM on K-major quantized operands (N possibly padded), the padded
    columns sliced off, plus the bias: in the provider's epilogue when nothing is sliced."""
    gemm = providers.get(spec.provider).gemm
    if spec.pad_n:
        out = gemm(a_q, a_s, b_q, b_s, spec.scaling, None, spec.out_dtype, spec.fast_accum)
        out = out[..., : b_q.shape[-1] - spec.pad_n]
        return out if bias is None else out + bias
    return gemm(a_q, a_s, b_q, b_s, spec.scaling, bias, spec.out_dtype, spec.fast_accum)


def padding_for(k: int, n: int, alignment: int = 16) -> tuple[int, int]:
    """(pad_k, pad_n) that make K and N multiples of `alignment`."""
    return (-k) % alignment, (-n) % alignment


def _broadcast_batch(x: torch.Tensor) -> bool:
    """Whether x's batch dim repeats one matrix (stride 0, more than one of it)."""
    stride, size = x.stride(0), x.shape[0]
    return isinstance(stride, int) and stride == 0 and not (isinstance(size, int) and size == 1)
