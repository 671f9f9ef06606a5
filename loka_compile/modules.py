"""The LRM architecture Mods as eager nn.Module changes, for users who want them in their
model itself rather than applied by the backend (`LokaConfig.arch_mods`).

    model = MyModel()
    loka_compile.apply_arch_mods(model, ("blocknorm", "no_bias", "hardswish"))
    optimizer = torch.optim.AdamW(model.parameters())     # after: no_bias drops parameters

Hard-swish is torch's `nn.Hardswish`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from loka_compile.kernels.block_norm import DEFAULT_BLOCK, block_norm
from loka_compile.passes.mods import ARCH_MODS, blocknorm, hardswish, no_bias


class BlockNorm(nn.Module):
    """RMSNorm over fixed-size blocks of the last dimension, then an elementwise affine
    (see `loka_compile.kernels.block_norm` for the block-size rule when `block` does not
    divide `normalized_shape`). A drop-in for `nn.LayerNorm` over the last dimension."""

    def __init__(self, normalized_shape, block: int = DEFAULT_BLOCK, eps: float = 1e-6,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"BlockNorm normalizes the last dimension only; normalized_shape must be "
                             f"an int or a 1-tuple, got {normalized_shape!r}")
        self.normalized_shape = shape
        self.block, self.eps, self.elementwise_affine = block, eps, elementwise_affine
        factory = {"device": device, "dtype": dtype}
        self.register_parameter("weight", nn.Parameter(torch.ones(shape, **factory)) if elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(torch.zeros(shape, **factory))
                                if elementwise_affine and bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_norm(x, self.block, self.eps, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, block={self.block}, eps={self.eps}, " \
               f"elementwise_affine={self.elementwise_affine}"


def apply_arch_mods(module: nn.Module, mods, *, heads: Optional[Iterable[str]] = None) -> dict[str, int]:
    """Swap submodules of `module` in place for each Mod named in `mods` (names in
    ARCH_MODS); return the number of submodules changed per named Mod.

    blocknorm: each nn.LayerNorm over the last dimension becomes a BlockNorm with the same
        eps that holds the LayerNorm's weight and bias Parameters (the same objects).
    hardswish: each nn.SiLU becomes nn.Hardswish. Functional `F.silu` calls inside a
        forward are out of reach here (the backend's graph Mod rewrites those).
    no_bias: each nn.Linear except the heads loses its bias (set to None; build the
        optimizer afterwards). `heads` names the head linears (as in named_modules());
        by default the head is the last nn.Linear in registration order, which is forward
        order in most models. Pass `heads` for several task heads.

    The root module itself is never replaced.
    """
    unknown = [m for m in mods if m not in ARCH_MODS]
    if unknown:
        raise ValueError(f"unknown arch_mods {unknown}; valid arch_mods: {list(ARCH_MODS)}")
    if not mods:
        return {}
    counts = {mod: 0 for mod in mods}
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    head_names = set(heads) if heads is not None else set(linears[-1:])
    missing = head_names - set(linears)
    if missing:
        raise ValueError(f"heads {sorted(missing)} are not nn.Linear submodules; linears: {linears}")
    replaced: dict[int, nn.Module] = {}
    for name, child in list(module.named_modules()):
        if no_bias.MOD.name in counts and isinstance(child, nn.Linear) and name not in head_names \
                and child.bias is not None:
            child.register_parameter("bias", None)
            counts[no_bias.MOD.name] += 1
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) not in replaced:
                new, mod = _swap(child, counts)
                if new is None:
                    continue
                replaced[id(child)] = new
                counts[mod] += 1
            setattr(parent, child_name, replaced[id(child)])
    return counts


def _swap(child: nn.Module, counts: dict):
    """(replacement, Mod name), or (None, None) when no named Mod applies to `child`."""
    if blocknorm.MOD.name in counts and type(child) is nn.LayerNorm and len(child.normalized_shape) == 1:
        norm = BlockNorm(child.normalized_shape, eps=child.eps, elementwise_affine=False)
        norm.elementwise_affine = child.elementwise_affine
        norm.weight, norm.bias = child.weight, child.bias
        return norm, blocknorm.MOD.name
    if hardswish.MOD.name in counts and type(child) is nn.SiLU:
        return nn.Hardswish(inplace=child.inplace), hardswish.MOD.name
    return None, None
