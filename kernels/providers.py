"""GEMM providers: every kernel loka can call for a site, behind one registry.

A provider computes `a @ b (+ bias)` from FP8 operands already quantized with scales
along K (see `quantize.py` for the scale convention). It declares what it supports, and
`select` returns the providers that can run a given request. The high-precision path is
not a provider here: a site that does not go FP8 keeps its original ATen op.

Each `gemm` is traceable: the `lower` pass traces it (with the operand casts) into the
ATen graph, so it must not branch on symbolic sizes; it learns the scaling from its
`scaling` argument, never from scale shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from .quantize import Fp8Format, Scaling, dequantize, expand_block_scale

GemmFn = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True)
class GemmRequest:
    """What a site asks of a provider."""

    device: torch.device
    scaling: Scaling
    a_format: Fp8Format
    b_format: Fp8Format
    out_dtype: torch.dtype
    batched: bool


@dataclasses.dataclass(frozen=True)
class GemmProvider:
    """One FP8 GEMM implementation.

    `gemm(a_q, a_scale, b_q, b_scale, scaling, bias, out_dtype, fast_accum=False)` takes
    a_q [.., M, K] row-major and b_q [.., K, N] column-major (the layout the casts write)
    and returns [.., M, N] in out_dtype. `fast_accum` lets the kernel accumulate in the
    tensor cores' faster, less precise mode (where it has one). `available(device)` says whether the hardware
    and libraries are there; `supports(request)` whether this kind of call is. A batched
    request (a bmm/baddbmm site: a_q [B, M, K], b_q [B, K, N]) needs `batched`, and its
    scaling in `batched_scalings` where that is given.
    """

    name: str
    scalings: frozenset
    batched: bool
    emulated: bool
    available: Callable[[torch.device], bool]
    gemm: GemmFn
    # (a_format, b_format) pairs the kernel accepts; None means any.
    format_pairs: Optional[frozenset] = None
    # Scalings it runs on batched operands; None means all of `scalings` (when `batched`).
    batched_scalings: Optional[frozenset] = None
    description: str = ""

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"provider name must be a non-empty identifier, got {self.name!r}")
        bad = [s for s in self.scalings if not isinstance(s, Scaling)]
        if not self.scalings or bad:
            raise ValueError(f"provider {self.name}: scalings must be a non-empty set of Scaling, got {self.scalings!r}")
        if self.batched_scalings is not None and not self.batched_scalings <= self.scalings:
            raise ValueError(f"provider {self.name}: batched_scalings {self.batched_scalings!r} must be among "
                             f"its scalings")
        if not callable(self.available) or not callable(self.gemm):
            raise ValueError(f"provider {self.name}: available and gemm must be callable")

    def supports(self, request: GemmRequest) -> bool:
        if request.scaling not in self.scalings:
            return False
        if request.batched and not (self.batched and (self.batched_scalings is None
                                                       or request.scaling in self.batched_scalings)):
            return False
        if self.format_pairs is not None and (request.a_format, request.b_format) not in self.format_pairs:
            return False
        return self.available(request.device)


_REGISTRY: dict[str, GemmProvider] = {}


def register(provider: GemmProvider, *, replace: bool = False) -> GemmProvider:
    if provider.name in _REGISTRY and not replace:
        raise ValueError(f"a GEMM provider named {provider.name!r} is already registered")
    _REGISTRY[provider.name] = provider
    return provider


def get(name: str) -> GemmProvider:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown GEMM provider {name!r}; registered: {sorted(_REGISTRY)}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


def select(request: GemmRequest) -> list[GemmProvider]:
    """Providers able to run the request, real FP8 kernels before emulation."""
    found = [p for p in _REGISTRY.values() if p.supports(request)]
    return sorted(found, key=lambda p: (p.emulated, p.name))


# ---- emulation: same quantized operands, fp32 matmul --------------------------------

def _dequantize_operand(q: torch.Tensor, scale: torch.Tensor, scaling: Scaling, block: tuple) -> torch.Tensor:
    # Tensorwise and rowwise scales broadcast against the operand; blockwise ones hold one
    # value per tile.
    if scaling is Scaling.BLOCKWISE:
        return dequantize(q, expand_block_scale(scale, tuple(q.shape), block))
    return dequantize(q, scale)


def _emulated_gemm(a_q, a_scale, b_q, b_scale, scaling, bias, out_dtype, fast_accum=False):
    # fp32 accumulation whatever fast_accum says: emulation has no faster mode to mimic.
    out = torch.matmul(_dequantize_operand(a_q, a_scale, scaling, (1, 128)),
                       _dequantize_operand(b_q, b_scale, scaling, (128, 128)))
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


register(GemmProvider(
    name="emulated",
    scalings=frozenset(Scaling),
    batched=True,
    # Blockwise casts and scales are 2-D (`quantize_blockwise`, `expand_block_scale`).
    batched_scalings=frozenset({Scaling.TENSORWISE, Scaling.ROWWISE}),
    emulated=True,
    available=lambda device: True,
    gemm=_emulated_gemm,
    description="FP8 emulation: the reference quantization, then an fp32 matmul",
))


# ---- cuBLASLt through torch._scaled_mm ------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cuda_fp8_capable(index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor) >= (8, 9)


def has_fp8_hardware(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (sm89 and newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _cuda_fp8_capable(device.index if device.index is not None else torch.cuda.current_device())


def _scaled_mm_gemm(a_q, a_scale, b_q, b_scale, scaling, bias, out_dtype, fast_accum=False):
    # Operands arrive as cuBLASLt wants them: A row-major, B column-major.
    # Rowwise scaling on sm90 produces bf16 only; other outputs are cast from it.
    mm_dtype = torch.bfloat16 if scaling is Scaling.ROWWISE else out_dtype
    # A bias vector of the output's dtype goes into cuBLASLt's epilogue (one kernel fewer);
    # any other bias is added after.
    fused_bias = (bias is not None and bias.dim() == 1 and bias.dtype == mm_dtype
                  and mm_dtype in (torch.bfloat16, torch.float16))
    out = torch._scaled_mm(a_q, b_q, scale_a=a_scale, scale_b=b_scale,
                           bias=bias if fused_bias else None, out_dtype=mm_dtype, use_fast_accum=fast_accum)
    if bias is not None and not fused_bias:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


_E4M3, _E5M2 = Fp8Format.E4M3, Fp8Format.E5M2

register(GemmProvider(
    name="scaled_mm_tensorwise",
    scalings=frozenset({Scaling.TENSORWISE}),
    batched=False,
    emulated=False,
    available=has_fp8_hardware,
    gemm=_scaled_mm_gemm,
    # cuBLASLt rejects e5m2 x e5m2.
    format_pairs=frozenset({(_E4M3, _E4M3), (_E4M3, _E5M2), (_E5M2, _E4M3)}),
    description="cuBLASLt FP8 GEMM via torch._scaled_mm, one scale per tensor",
))

register(GemmProvider(
    name="scaled_mm_rowwise",
    scalings=frozenset({Scaling.ROWWISE}),
    batched=False,
    emulated=False,
    available=has_fp8_hardware,
    gemm=_scaled_mm_gemm,
    format_pairs=frozenset({(_E4M3, _E4M3)}),
    description="FP8 GEMM via torch._scaled_mm, one scale per row of A and per column of B",
))
