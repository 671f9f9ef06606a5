"""Dispatch: for each site, FP8 or not, and on which provider, with the reason.

Rules, in order; the first that applies gives the reason:
  dtype not bf16/fp16/fp32                    -> unsupported_dtype
  K or N not a multiple of 16 (FP8 kernels need 16-byte rows of operands)
                                              -> k_/n_not_multiple_of_16
    (a symbolic K or N, such as the batch in a wgrad under dynamic shapes, is checked
    by the op at run time: a misaligned call runs in high precision)
  M, K or N below config.min_gemm_dim         -> too_small
  addmm/baddbmm with beta or alpha != 1       -> unsupported_variant
  module under config.exclude_modules         -> excluded_by_config
  role kept in high precision by the recipe   -> recipe_high_precision
  no FP8 hardware and emulation off           -> no_fp8_hardware
  no provider supports the request            -> no_provider
  Probe measured error above the bound        -> probe_unsafe
  graph still in its probe window             -> probing
  FP8 (casts included) not min_fp8_speedup faster than the high-precision GEMM, timed
  at the site's shape and layouts (`speed.py`; FP8 hardware, concrete dims)
                                              -> slower_than_bf16
  otherwise                                   -> fp8, on the first provider `select` gives
Emulation is used only where the device has no FP8 hardware: on an FP8 GPU it would be
slower than the high-precision GEMM it replaces.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch._inductor import list_mode_options

from loka_compile import speed
from loka_compile.config import LokaConfig
from loka_compile.kernels import providers
from loka_compile.passes import Decision, Reason, Site

log = logging.getLogger("loka")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_ALIGNMENT = 16


def _fallback(reason: Reason, detail: str = "") -> Decision:
    return Decision(fp8=False, reason=reason, detail=detail)


def decide(site: Site, config: LokaConfig, phase: str, unsafe_sites: Mapping[str, float]) -> Decision:
    m, k, n = site.shape
    if site.dtype not in SUPPORTED_DTYPES:
        return _fallback(Reason.UNSUPPORTED_DTYPE, str(site.dtype))
    if isinstance(k, int) and k % FP8_ALIGNMENT:
        return _fallback(Reason.K_NOT_MULTIPLE_OF_16, f"K={k}")
    if isinstance(n, int) and n % FP8_ALIGNMENT:
        return _fallback(Reason.N_NOT_MULTIPLE_OF_16, f"N={n}")
    dims = [d for d in (m, k, n) if isinstance(d, int)]
    if min(dims) < config.min_gemm_dim:
        return _fallback(Reason.TOO_SMALL, f"min dim {min(dims)} < {config.min_gemm_dim}")
    if not site.unit_scalars:
        return _fallback(Reason.UNSUPPORTED_VARIANT, f"{site.op} with beta/alpha != 1")
    if any(site.module == p or site.module.startswith(p + ".") for p in config.exclude_modules):
        return _fallback(Reason.EXCLUDED_BY_CONFIG, site.module)
    recipe = config.recipe_spec
    if site.role in recipe.high_precision_roles:
        return _fallback(Reason.RECIPE_HIGH_PRECISION, f"{recipe.name} keeps {site.role.value}")

    hardware = providers.has_fp8_hardware(site.device)
    if not hardware and not config.emulate:
        return _fallback(Reason.NO_FP8_HARDWARE, f"{site.device} has no FP8 and emulate=False")
    a_format, b_format = recipe.formats(site.a_is_grad, site.b_is_grad)
    request = providers.GemmRequest(site.device, recipe.scaling, a_format, b_format, site.dtype,
                                    site.batch is not None)
    candidates = [p for p in providers.select(request)
                  if (not config.providers or p.name in config.providers) and p.emulated != hardware]
    if not candidates:
        return _fallback(Reason.NO_PROVIDER, f"none for {request.scaling.value} {a_format.value}x{b_format.value}"
                         f"{' batched' if request.batched else ''} on {site.device.type}")
    chosen = dict(provider=candidates[0].name, scaling=recipe.scaling.value,
                  a_format=a_format.value, b_format=b_format.value)
    if site.key in unsafe_sites:
        return Decision(fp8=False, reason=Reason.PROBE_UNSAFE,
                        detail=f"rel. error {unsafe_sites[site.key]:.3g} > {config.max_probe_error}", **chosen)
    if phase == "probe":
        return Decision(fp8=False, reason=Reason.PROBING, **chosen)
    shape = speed.site_shape(site) if hardware and config.speed_check else None
    if shape is None:
        return Decision(fp8=True, reason=Reason.FP8, **chosen)
    try:
        timing = speed.site_timing(shape, chosen["scaling"], chosen["a_format"], chosen["b_format"],
                                   chosen["provider"], graphed=uses_cuda_graphs(config.mode))
    except Exception as error:  # noqa: BLE001  (a failed timing must not cost the graph its FP8)
        log.warning("loka: could not time site %s (%s: %s); it goes FP8 unchecked", site.name,
                    type(error).__name__, error)
        return Decision(fp8=True, reason=Reason.FP8, detail=f"speed not measured: {type(error).__name__}", **chosen)
    measured = dict(bf16_us=round(timing.bf16_us, 2), fp8_us=round(timing.fp8_us, 2))
    if timing.speedup < config.min_fp8_speedup:
        return Decision(fp8=False, reason=Reason.SLOWER_THAN_BF16, **chosen, **measured,
                        detail=f"fp8 {timing.fp8_us:.1f} us vs {timing.bf16_us:.1f} us "
                               f"({timing.speedup:.2f}x < {config.min_fp8_speedup})")
    return Decision(fp8=True, reason=Reason.FP8, **chosen, **measured)


def uses_cuda_graphs(mode: str) -> bool:
    return bool(list_mode_options(mode).get("triton.cudagraphs", False))
