"""The ops loka's lowering emits: `torch.ops.loka.fp8_gemm` and `torch.ops.loka.observe_gemm`.

`fp8_gemm(a, b, bias, scaling, a_format, b_format, provider, site)` computes
`a @ b (+ bias)` for a [.., M, K] and b [.., K, N] given in high precision: it quantizes
both operands with scales along K (`gemm_operands.py`: fused Triton casts on FP8 GPUs,
the references of `quantize.py` elsewhere, bit-identical) and calls the named provider. The output has a's dtype. A site that the
Probe judged unsafe after its graph was compiled is listed with
`set_high_precision_sites`; the op then computes it in high precision.

`observe_gemm(a, b, site, scaling, a_format, b_format)` is the Probe's observer: it leaves
the graph's values alone and hands operand statistics and the FP8 error of this GEMM to
the sink installed with `set_observer_sink` (the Probe's statistics store).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import providers
from .gemm_operands import quantize_gemm_operands
from .quantize import Fp8Format, Scaling, quantize_operands

_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _parse(scaling: str, a_format: str, b_format: str):
    try:
        return Scaling(scaling), Fp8Format(a_format), Fp8Format(b_format)
    except ValueError as e:
        raise ValueError(
            f"{e}; scalings: {[s.value for s in Scaling]}, formats: {[f.value for f in Fp8Format]}") from None


def _check_operands(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor]):
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(f"fp8_gemm takes 2-D or 3-D operands of equal rank, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"fp8_gemm shape mismatch: {tuple(a.shape)} @ {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if not t.is_floating_point() or t.element_size() > 4:
            raise ValueError(f"fp8_gemm operand {name} must be bf16, fp16 or fp32, got {t.dtype}")
    if bias is not None and bias.dim() > a.dim():
        raise ValueError(f"fp8_gemm bias of shape {tuple(bias.shape)} does not broadcast to the output")


def fp8_gemm_reference(a, b, bias, scaling, a_format, b_format):
    """Pure-PyTorch meaning of fp8_gemm: reference quantization, fp32 product."""
    return providers.get("emulated").gemm(*quantize_operands(a, b, *_parse(scaling, a_format, b_format)),
                                           bias, a.dtype)


_high_precision_sites: set = set()


def set_high_precision_sites(keys) -> None:
    """Sites that fp8_gemm computes in high precision from now on (Probe verdicts)."""
    _high_precision_sites.update(keys)


@torch.library.custom_op("loka::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scaling: str,
             a_format: str, b_format: str, provider: str, site: str = "") -> torch.Tensor:
    _check_operands(a, b, bias)
    scaling_e, a_fmt, b_fmt = _parse(scaling, a_format, b_format)
    impl = providers.get(provider)
    # Vetoed by the Probe, or a symbolic K/N that came out misaligned for FP8 kernels.
    misaligned = not impl.emulated and (a.shape[-1] % 16 or b.shape[-1] % 16)
    if (site and site in _high_precision_sites) or misaligned:
        out = torch.matmul(a, b)
        return out if bias is None else out + bias
    request = providers.GemmRequest(a.device, scaling_e, a_fmt, b_fmt, a.dtype, a.dim() == 3)
    if not impl.supports(request):
        raise ValueError(f"provider {provider!r} cannot run {request}")
    a_q, a_s, b_q, b_s = quantize_gemm_operands(a, b, scaling_e, a_fmt, b_fmt)
    return impl.gemm(a_q, a_s, b_q, b_s, bias, a.dtype)


@fp8_gemm.register_fake
def _(a, b, bias, scaling, a_format, b_format, provider, site=""):
    _check_operands(a, b, bias)
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _fp8_gemm_setup(ctx, inputs, output):
    a, b, bias = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.bias_shape = None if bias is None else bias.shape


def _fp8_gemm_backward(ctx, grad):
    # Straight-through: gradients of the high-precision product. Inside a loka-compiled
    # graph the backward GEMMs are sites of their own; this serves direct calls.
    a, b = ctx.saved_tensors
    grad_a = grad @ b.transpose(-1, -2)
    grad_b = a.transpose(-1, -2) @ grad
    grad_bias = None
    if ctx.bias_shape is not None:
        grad_bias = grad
        while grad_bias.dim() > len(ctx.bias_shape):
            grad_bias = grad_bias.sum(0)
        for dim, size in enumerate(ctx.bias_shape):
            if size == 1 and grad_bias.shape[dim] != 1:
                grad_bias = grad_bias.sum(dim, keepdim=True)
    return grad_a, grad_b, grad_bias, None, None, None, None, None


fp8_gemm.register_autograd(_fp8_gemm_backward, setup_context=_fp8_gemm_setup)


# ---- Probe observer --------------------------------------------------------------------

ObserverSink = Callable[[str, dict], None]
_observer_sink: list[Optional[ObserverSink]] = [None]

# Rows of A taken for the error estimate: enough for a stable relative error, small
# enough that observing costs a fraction of the GEMM itself.
PROBE_SAMPLE_ROWS = 256


def set_observer_sink(sink: Optional[ObserverSink]) -> None:
    """Install the callable that receives (site, statistics) from observe_gemm."""
    _observer_sink[0] = sink


def gemm_statistics(a: torch.Tensor, b: torch.Tensor, scaling: str, a_format: str, b_format: str) -> dict:
    """Operand statistics and the FP8 error of a @ b on a row sample, as 0-d fp32 tensors
    (no host sync). `rel_error` is ||fp8 - ref|| / ||ref||; `mere` the mean element-wise
    relative error with a floor of 1e-3 * mean |ref| in the denominator."""
    a2 = a.detach().reshape(-1, a.shape[-2], a.shape[-1])
    b2 = b.detach().reshape(-1, b.shape[-2], b.shape[-1])
    rows = max(1, PROBE_SAMPLE_ROWS // a2.shape[0])
    a_s, b_s = a2[:, :rows].float(), b2.float()
    ref = torch.matmul(a_s.double(), b_s.double())
    got = fp8_gemm_reference(a_s, b_s, None, scaling, a_format, b_format).double()
    diff = (got - ref).abs()
    ref_abs = ref.abs()
    floor = 1e-3 * ref_abs.mean() + 1e-30
    return {
        "a_amax": a.detach().abs().amax().float(),
        "b_amax": b.detach().abs().amax().float(),
        "a_rms": a.detach().float().pow(2).mean().sqrt(),
        "b_rms": b.detach().float().pow(2).mean().sqrt(),
        "rel_error": (diff.norm() / (ref.norm() + 1e-30)).float(),
        "mere": (diff / (ref_abs + floor)).mean().float(),
    }


@torch.library.custom_op("loka::observe_gemm", mutates_args=(), tags=_TAGS)
def observe_gemm(a: torch.Tensor, b: torch.Tensor, site: str, scaling: str, a_format: str,
                 b_format: str) -> None:
    sink = _observer_sink[0]
    if sink is None:
        return
    sink(site, gemm_statistics(a, b, scaling, a_format, b_format))


@observe_gemm.register_fake
def _(a, b, site, scaling, a_format, b_format):
    return None


# An observer has no outputs: mark it effectful so dead-code elimination keeps it.
torch.fx.node.has_side_effect(torch.ops.loka.observe_gemm.default)
