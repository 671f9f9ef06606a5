"""BlockNorm in pure PyTorch: RMSNorm over fixed-size blocks of the last dimension.

x [..., D] is viewed as [..., D / b, b]; each block of b features is divided by its own
RMS, sqrt(mean(block^2) + eps); then the optional elementwise affine of the full last
dimension (y * weight + bias). A block is small enough to be normalized inside one GEMM
epilogue tile, which LayerNorm over a wide row is not (a LoKA architecture Mod).

Block size b: `block` (256 by default) when it divides D. Otherwise the largest divisor
of D that is at most `block` and a multiple of 16, if there is one (D = 384, block = 256:
b = 192); else b = D, a plain RMSNorm over the row (D = 100).

Computes in fp32 (fp64 for fp64 inputs) and returns x's dtype. A plain function, so a
Dynamo-level graph can call it: AOTAutograd traces through it into ATen ops, which gives
its backward and lets Inductor fuse it. Knows nothing of FX.
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_BLOCK = 256


def block_size(dim: int, block: int = DEFAULT_BLOCK) -> int:
    """The block width BlockNorm uses for a last dimension of `dim` (rule above)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if dim % block == 0:
        return block
    for width in range(min(block, dim) // 16 * 16, 0, -16):
        if dim % width == 0:
            return width
    return dim


def block_norm(x: torch.Tensor, block: int = DEFAULT_BLOCK, eps: float = 1e-6,
               weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    dim = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != (dim,):
            raise ValueError(f"block_norm: {name} must have shape ({dim},), got {tuple(param.shape)}")
    width = block_size(dim, block)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    blocks = x.to(compute_dtype).unflatten(-1, (dim // width, width))
    y = (blocks * torch.rsqrt(blocks.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    if weight is not None:
        y = y * weight.to(compute_dtype)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(x.dtype)
