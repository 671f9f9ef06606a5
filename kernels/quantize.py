"""FP8 quantization: formats, scales, and the pure-PyTorch reference casts.

Scale convention (the one `torch._scaled_mm` uses): a quantized tensor `q` with scale
`s` stands for `q.float() * s`, so `s = amax / fp8_max`.

Non-finite policy, so that a bad value spoils no more of the product than it does in
high precision, and where it can, spoils it the same way (a NaN never becomes finite, an
infinity keeps its sign, so that a ReLU or a max after the GEMM treats it as high
precision does):
- rowwise, a group (a row of A, a column of B) holding a NaN: its scale is NaN and the
  whole group dequantizes to NaN. The high-precision output row (column) is NaN too.
- rowwise, a group holding an infinity and no NaN: its scale is +inf, each +-inf element
  becomes +-1 (its sign) and every finite element +-0. The GEMM applies rowwise scales
  after the reduction along K (`torch._scaled_mm`, loka's Triton GEMM), so each output
  element of that row (column) is (the infinities' signs times the other operand, summed)
  x inf: +-inf where high precision has +-inf, NaN where that sum is 0 (as inf x 0 or
  inf - inf is in high precision). The finite elements' contribution is lost, as beside
  an infinity it is. `dequantize` keeps quantized zeros zero (0 x inf would be NaN), so
  the emulation agrees. (A NaN scale there made a ReLU after the GEMM keep NaN where
  high precision's -inf becomes 0: one bad weight spoiled every row of a deeper layer.)
- tensorwise and blockwise: each scale comes from its tensor's (block's) finite values,
  and each non-finite element is cast by itself: NaN, and +-inf in e5m2, which has
  infinities. e4m3 has none, so there an infinity becomes NaN: the GEMM's output is
  non-finite exactly where high precision's is, but NaN for +-inf. (One NaN or inf
  tensorwise scale would spoil every row of the product; a blockwise GEMM applies its
  scales to partial sums along K, where an inf scale would turn a partial sum of zeros
  into NaN and drop the finite values of a 128x128 tile of B, which spans 128 output
  columns.) A tensorwise site whose amax goes far above its probe window's, or whose
  cached e4m3 weight holds an infinity, goes rowwise: the amax guard
  (`scaled_gemm.AmaxGuard`, `loka_compile/amax_guard.py`).
An all-zero group gets scale 1 (its quantized values are exact zeros).

Every quantizer here is the reference that emulation uses and that loka's Triton kernels
must match bit for bit.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false


class Fp8Format(str, enum.Enum):
    """FP8 element formats. e4m3 keeps precision, e5m2 keeps range (gradients)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Fp8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)


class Scaling(str, enum.Enum):
    """How one scale is shared: one per tensor, one per row of A / column of B, or per
    block (1x128 on activations, 128x128 on weights)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


# Floor on amax so that tiny groups do not produce a denormal scale or an infinite
# reciprocal: 2^-100 keeps amax / fp8_max a normal fp32 for e4m3 and e5m2 (>= 2^-116), so
# scales follow the data's range down to there. (1e-12 flushed gradients of a loss scaled
# by 1e-15 to zero.) The Triton casts use the same literal.
AMAX_EPS = 2.0 ** -100


def scale_from_amax(amax: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False) -> torch.Tensor:
    """fp32 dequantization scale from an fp32 amax, with the non-finite policy above: a
    NaN amax gives a NaN scale, an infinite one +inf."""
    amax = amax.float()
    scale = torch.clamp(amax, min=AMAX_EPS) / fmt.max
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    if power_of_two:
        # Round the scale up to a power of two so that scaling is exact in any format.
        # frexp, not ceil(log2): log2 of a value a few ulp above 2^e rounds to e.
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(torch.isfinite(amax), scale, amax.abs())  # abs: a NaN's sign bit cleared, as the casts expect


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                    non_finite_to_nan: bool = False, infinities: bool = False) -> torch.Tensor:
    """Saturating cast of x / scale to fmt (scale broadcasts against x), with the policy
    above: an infinite element of a group whose scale is +inf becomes its sign (+-1), the
    group's finite ones +-0, and a NaN scale makes its group NaN. With `non_finite_to_nan`
    (a scale from the finite values: tensorwise, static) each inf or NaN element becomes
    NaN instead of saturating, or with `infinities` too keeps +-inf where the format has
    infinities (e5m2)."""
    xf = x.float()
    y = torch.clamp(xf / scale, -fmt.max, fmt.max)
    if non_finite_to_nan:
        keep_inf = infinities and fmt is Fp8Format.E5M2
        y = torch.where(torch.isfinite(xf), y, xf if keep_inf else torch.full_like(y, float("nan")))
    else:
        # inf / inf is NaN: an infinity of an inf-scaled group is its sign instead.
        y = torch.where(torch.isinf(xf) & ~torch.isnan(scale), torch.sign(xf), y)
    return y.to(fmt.dtype)


def amax_along(x: torch.Tensor, dim=None, finite_only: bool = False) -> torch.Tensor:
    """fp32 max |x| along `dim` (all of x when None), keepdim; NaN if the slice holds a NaN
    (amax ignores NaN on some backends; the policy needs NaN to win), or with
    `finite_only` the max over the finite values; 0 for an empty slice. The reduction runs
    over exactly the slice, so Inductor fuses it with the cast that reads the same slice
    (and with the op that produced x)."""
    xf = x.detach().float()
    whole = dim is None
    if whole:
        xf, dim = xf.reshape(-1), 0
    magnitude = xf.abs()
    if finite_only:
        magnitude = torch.where(torch.isfinite(xf), magnitude, torch.zeros_like(magnitude))
    amax = _max_along(magnitude, dim)
    if not finite_only:
        # The NaN flag as a max of 0/1 floats compared to 0, not `any`: Inductor's Triton code
        # keeps an `any` result as int8, and triton 3.6 warns that a `where` on an int8
        # condition will be an error (compiling this with `any` warned; amax, or any alone,
        # did not).
        has_nan = _max_along(torch.isnan(xf).to(torch.float32), dim) > 0
        amax = torch.where(has_nan, torch.full_like(amax, float("nan")), amax)
    return amax.reshape(()) if whole else amax


def _max_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.amax(dim, keepdim) of a non-negative x, 0 for an empty slice."""
    size = x.shape[dim]
    if guard_or_false(size == 0):
        return torch.zeros_like(x.sum(dim=dim, keepdim=True))
    if guard_or_false(size != 0):
        return x.amax(dim=dim, keepdim=True)
    # A data-dependent size may be 0 at run time, where amax has nothing to reduce
    # (Inductor asserts the size >= 1): reduce with one zero appended instead.
    pad = [1 if d == dim % x.dim() else s for d, s in enumerate(x.shape)]
    return torch.cat([x, x.new_zeros(pad)], dim=dim).amax(dim=dim, keepdim=True)


def quantize_tensorwise(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool = False):
    """One scale for the whole tensor, from its finite values; non-finite elements become
    NaN (policy above). The amax stays on the device (no host sync). Returns (q, scale)
    with scale a 0-d fp32 tensor."""
    scale = scale_from_amax(amax_along(x, finite_only=True), fmt, power_of_two)
    return cast_with_scale(x, scale, fmt, non_finite_to_nan=True, infinities=True), scale


def quantize_along(x: torch.Tensor, dim: int, fmt: Fp8Format, power_of_two: bool = False):
    """One scale per slice reduced along `dim` (the GEMM's K axis for that operand).

    For A [M, K] use dim=-1 (one scale per row, shape [M, 1]); for B [K, N] use dim=-2
    (one scale per column, shape [1, N]). Returns (q, scale) with keepdim scales."""
    scale = scale_from_amax(amax_along(x, dim), fmt, power_of_two)
    return cast_with_scale(x, scale, fmt), scale


def row_scale_of_pieces(pieces: list, fmt: Fp8Format, power_of_two: bool = False) -> torch.Tensor:
    """The [.., R, 1] rowwise scale of cat(pieces, -1) from each piece's row amax (a NaN
    anywhere in a row wins, as in `amax_along`: torch.maximum propagates it)."""
    amax = amax_along(pieces[0], -1)
    for piece in pieces[1:]:
        amax = torch.maximum(amax, amax_along(piece, -1))
    return scale_from_amax(amax, fmt, power_of_two)


def quantize_blockwise(x: torch.Tensor, block_rows: int, block_cols: int, fmt: Fp8Format,
                       power_of_two: bool = False):
    """One scale per [block_rows, block_cols] tile of a 2-D tensor (ragged edge tiles
    allowed), from the tile's finite values (policy above). Returns (q, scale) with scale
    of shape [ceil(R/br), ceil(C/bc)]."""
    if x.dim() != 2:
        raise ValueError(f"blockwise quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    n_rb, n_cb = -(-rows // block_rows), -(-cols // block_cols)
    xf = x.detach().float()
    padded = F.pad(xf, (0, n_cb * block_cols - cols, 0, n_rb * block_rows - rows))
    tiles = padded.view(n_rb, block_rows, n_cb, block_cols)
    amax = torch.where(torch.isfinite(tiles), tiles.abs(), torch.zeros_like(tiles)).amax(dim=(1, 3))
    scale = scale_from_amax(amax, fmt, power_of_two)
    full_scale = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]
    return cast_with_scale(x, full_scale, fmt, non_finite_to_nan=True, infinities=True), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 value of a quantized tensor with a broadcastable scale. A quantized zero stays
    zero whatever its scale: the finite elements of an inf-scaled group (policy above) are
    zeros, as in a scaled GEMM, which applies the scales after the reduction."""
    qf = q.float()
    return torch.where(qf == 0, qf, qf * scale)


def quantize_operands(a: torch.Tensor, b: torch.Tensor, scaling: Scaling,
                      a_format: Fp8Format, b_format: Fp8Format, power_of_two: bool = False):
    """Quantize the two operands of a @ b ([..., M, K] @ [..., K, N]) with scales along K.

    Returns (a_q, a_scale, b_q, b_scale). Tensorwise scales are 0-d; rowwise scales are
    [..., M, 1] and [..., 1, N]; blockwise uses 1x128 tiles on A and 128x128 tiles on B
    (2-D operands only)."""
    if scaling is Scaling.TENSORWISE:
        a_q, a_s = quantize_tensorwise(a, a_format, power_of_two)
        b_q, b_s = quantize_tensorwise(b, b_format, power_of_two)
    elif scaling is Scaling.ROWWISE:
        a_q, a_s = quantize_along(a, -1, a_format, power_of_two)
        b_q, b_s = quantize_along(b, -2, b_format, power_of_two)
    elif scaling is Scaling.BLOCKWISE:
        a_q, a_s = quantize_blockwise(a, 1, 128, a_format, power_of_two)
        b_q, b_s = quantize_blockwise(b, 128, 128, b_format, power_of_two)
    else:
        raise ValueError(f"unknown scaling {scaling!r}; valid: {[s.value for s in Scaling]}")
    return a_q, a_s, b_q, b_s


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Per-element scale of a blockwise-quantized 2-D tensor."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
