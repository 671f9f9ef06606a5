"""loka's ops: `torch.ops.loka.fp8_gemm`, `torch.ops.loka.quantize_operand` and
`torch.ops.loka.observe_gemm`.

`fp8_gemm(a, b, bias, scaling, a_format, b_format, provider)` computes `a @ b (+ bias)`
for a [.., M, K] and b [.., K, N] given in high precision, through FP8: the eager form of
what the `lower` pass puts in a graph (`scaled_gemm.scaled_gemm`: operand casts, then the
provider's GEMM). Compiled graphs never call it; they hold the casts and the GEMM as
nodes of their own. The output has a's dtype.

`quantize_operand(x, operand, scaling, format)` is one operand's cast as a single opaque
node, K-major (`scaled_gemm.quantize_operand_aten` gives the same values and layouts as
ATen ops): loka's Triton casts on FP8 GPUs, the references elsewhere. Graphs use it only
with the `fused_casts` Mod off (the unfused baseline).

`observe_gemm(a, b, site, scaling, a_format, b_format)` is the Probe's observer: it leaves
the graph's values alone and hands operand statistics and the FP8 error of this GEMM to
the sink installed with `set_observer_sink` (the Probe's statistics store).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import providers
from .gemm_operands import quantize_gemm_operand
from .quantize import Fp8Format, Scaling, amax_along, cast_with_scale, quantize_tensorwise, scale_from_amax
from .scaled_gemm import GemmSpec, padding_for, scaled_gemm

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


def gemm_spec(a: torch.Tensor, b: torch.Tensor, scaling: str, a_format: str, b_format: str,
              provider: str) -> GemmSpec:
    """The spec of an eager FP8 GEMM, K and N padded to 16 for real FP8 kernels."""
    scaling_e, a_fmt, b_fmt = _parse(scaling, a_format, b_format)
    impl = providers.get(provider)
    request = providers.GemmRequest(a.device, scaling_e, a_fmt, b_fmt, a.dtype, a.dim() == 3)
    if not impl.supports(request):
        raise ValueError(f"provider {provider!r} cannot run {request}")
    pad_k, pad_n = (0, 0) if impl.emulated else padding_for(a.shape[-1], b.shape[-1])
    return GemmSpec(scaling_e, a_fmt, b_fmt, provider, a.dtype, pad_k, pad_n)


@torch.library.custom_op("loka::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], scaling: str,
             a_format: str, b_format: str, provider: str) -> torch.Tensor:
    _check_operands(a, b, bias)
    return scaled_gemm(a, b, bias, gemm_spec(a, b, scaling, a_format, b_format, provider))


@fp8_gemm.register_fake
def _(a, b, bias, scaling, a_format, b_format, provider):
    _check_operands(a, b, bias)
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def fp8_gemm_reference(a, b, bias, scaling, a_format, b_format):
    """Pure-PyTorch meaning of fp8_gemm: reference quantization, fp32 product."""
    return scaled_gemm(a, b, bias, GemmSpec(*_parse(scaling, a_format, b_format), "emulated", a.dtype))


def _fp8_gemm_setup(ctx, inputs, output):
    a, b, bias = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.bias_shape = None if bias is None else bias.shape


def _fp8_gemm_backward(ctx, grad):
    # Straight-through: gradients of the high-precision product (eager use only).
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
    return grad_a, grad_b, grad_bias, None, None, None, None


fp8_gemm.register_autograd(_fp8_gemm_backward, setup_context=_fp8_gemm_setup)


@torch.library.custom_op("loka::quantize_operand", mutates_args=())
def quantize_operand(x: torch.Tensor, operand: str, scaling: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
    scaling_e, fmt_e, _ = _parse(scaling, fmt, fmt)
    return quantize_gemm_operand(x, operand, scaling_e, fmt_e)


@quantize_operand.register_fake
def _(x, operand, scaling, fmt):
    from .scaled_gemm import quantize_operand_aten

    scaling_e, fmt_e, _ = _parse(scaling, fmt, fmt)
    return quantize_operand_aten(x, operand, scaling_e, fmt_e)


# ---- Probe observer --------------------------------------------------------------------

ObserverSink = Callable[[str, dict], None]
_observer_sink: list[Optional[ObserverSink]] = [None]

# Rows of A taken for the error estimate: enough for a stable relative error, small
# enough that observing costs a fraction of the GEMM itself.
PROBE_SAMPLE_ROWS = 256


def set_observer_sink(sink: Optional[ObserverSink]) -> None:
    """Install the callable that receives (site, statistics) from observe_gemm."""
    _observer_sink[0] = sink


def _sample_product(a_sample: torch.Tensor, a_whole: torch.Tensor, b: torch.Tensor, scaling: str,
                    a_format: str, b_format: str) -> torch.Tensor:
    """The FP8 product of sampled rows of A with B, each quantized as in the real GEMM: a
    tensorwise scale comes from the whole of A, so an outlier outside the sample counts."""
    if Scaling(scaling) is not Scaling.TENSORWISE:
        return fp8_gemm_reference(a_sample, b, None, scaling, a_format, b_format)
    a_fmt, b_fmt = Fp8Format(a_format), Fp8Format(b_format)
    a_scale = scale_from_amax(amax_along(a_whole, finite_only=True), a_fmt)
    a_dq = cast_with_scale(a_sample, a_scale, a_fmt, non_finite_to_nan=True).float() * a_scale
    b_q, b_scale = quantize_tensorwise(b, b_fmt)
    return torch.matmul(a_dq, b_q.float() * b_scale)


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Mean over output rows of ||got_r - ref_r|| / ||ref_r||: every sample counts alike,
    so one outlier row cannot hide the error of all the others (as one norm over the
    whole product would)."""
    row_ref = ref.norm(dim=-1)
    row_diff = (got.double() - ref).norm(dim=-1)
    return (row_diff / (row_ref + 1e-6 * row_ref.mean() + 1e-30)).mean().float()


def gemm_statistics(a: torch.Tensor, b: torch.Tensor, scaling: str, a_format: str, b_format: str) -> dict:
    """Operand statistics and the FP8 error of a @ b on a row sample, as 0-d fp32 tensors
    (no host sync). `rel_error` is the mean over rows of ||fp8 - ref|| / ||ref||; `mere` the mean element-wise
    relative error with a floor of 1e-3 * mean |ref| in the denominator. A tensorwise site
    also gets `rel_error_rowwise`, its error under rowwise e4m3 scaling, the finer recipe
    the Probe may upgrade it to."""
    a2 = a.detach().reshape(-1, a.shape[-2], a.shape[-1])
    b2 = b.detach().reshape(-1, b.shape[-2], b.shape[-1])
    rows = max(1, PROBE_SAMPLE_ROWS // a2.shape[0])
    a_s, b_s = a2[:, :rows].float(), b2.float()
    ref = torch.matmul(a_s.double(), b_s.double())
    got = _sample_product(a_s, a2, b_s, scaling, a_format, b_format).double()
    diff = (got - ref).abs()
    ref_abs = ref.abs()
    floor = 1e-3 * ref_abs.mean() + 1e-30
    stats = {
        "a_amax": a.detach().abs().amax().float(),
        "b_amax": b.detach().abs().amax().float(),
        "a_rms": a.detach().float().pow(2).mean().sqrt(),
        "b_rms": b.detach().float().pow(2).mean().sqrt(),
        "rel_error": _relative_error(got, ref),
        "mere": (diff / (ref_abs + floor)).mean().float(),
    }
    if Scaling(scaling) is Scaling.TENSORWISE:
        rowwise = fp8_gemm_reference(a_s, b_s, None, Scaling.ROWWISE.value, Fp8Format.E4M3.value,
                                     Fp8Format.E4M3.value)
        stats["rel_error_rowwise"] = _relative_error(rowwise, ref)
    return stats


@torch.library.custom_op("loka::observe_gemm", mutates_args=(), tags=_TAGS)
def observe_gemm(a: torch.Tensor, b: torch.Tensor, site: str, scaling: str, a_format: str,
                 b_format: str) -> None:
    sink = _observer_sink[0]
    if sink is None or a.numel() == 0 or b.numel() == 0:
        return  # an empty product has no error to observe
    sink(site, gemm_statistics(a, b, scaling, a_format, b_format))


@observe_gemm.register_fake
def _(a, b, site, scaling, a_format, b_format):
    return None


# An observer has no outputs: mark it effectful so dead-code elimination keeps it.
torch.fx.node.has_side_effect(torch.ops.loka.observe_gemm.default)
