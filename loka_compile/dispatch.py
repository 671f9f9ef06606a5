"""Dispatch: for each site, FP8 or not, and on which provider, with the reason.

Rules, in order; the first that applies gives the reason:
  a linear Inductor's freezing packed for mkl/mkldnn before loka saw it
                                              -> packed_by_freezing
  dtype not bf16/fp16/fp32                    -> unsupported_dtype
  K or N not a multiple of 16 (FP8 kernels need 16-byte rows of operands): padded with
  zeros to the next multiple by the `pad` Mod; with it off, or for a batched site
                                              -> k_/n_not_multiple_of_16
  K or N symbolic on FP8 hardware (its alignment is unknown until run time)
                                              -> symbolic_k_or_n
  M, K or N below config.min_gemm_dim         -> too_small
  addmm/baddbmm with beta or alpha != 1       -> unsupported_variant
  module under config.exclude_modules         -> excluded_by_config
  role kept in high precision by the recipe   -> recipe_high_precision
  no FP8 hardware and emulation off           -> no_fp8_hardware
  no provider supports the request            -> no_provider
  every candidate provider raised when timed at the site's shape -> provider_failed
  Probe measured error above the bound        -> probe_unsafe (unless a finer scaling,
                                                 tensorwise -> rowwise -> blockwise, is
                                                 within it and has a provider: the site
                                                 goes there, each step's bound in its detail)
  graph still in its probe window             -> probing
  the site's FP8 form (casts as they will run, fused or standalone, A's with its
  calibrated static scale where the graph has one, plus the fastest provider's GEMM) not
  min_fp8_speedup faster than the high-precision GEMM, timed at the site's shape and
  layouts (`speed.py`; FP8 hardware, concrete K and N; a symbolic M at the power-of-two
  bucket of its compile-time size, in Decision.m_bucket and the detail; a bmm/baddbmm
  site as its batched GEMM, torch.bmm against the batched FP8 one, a symbolic batch at
  its bucket, in the detail)
                                              -> slower_than_bf16
  otherwise                                   -> fp8, on the fastest timed provider (the
                                                 first `select` gives when not timed)
A site of a loaded plan (`LokaConfig.plan`) that passes the rules up to no_fp8_hardware
takes the plan's measured decision (fp8, probe_unsafe, slower_than_bf16, provider_failed)
instead of the rules after it, when its K, N, dtype and padding match and its provider
can still serve it; otherwise it is decided here, with a warning. A planned fp8 that no
speed check timed (a compile with speed_check off, as `loka_compile.calibrate` runs) is
timed here when this compile checks speed, in this compile's mode. A site the output budget
keeps in high precision is not timed: its decision is amended to high precision whatever it is.
Emulation is used only where the device has no FP8 hardware: on an FP8 GPU it would be
slower than the high-precision GEMM it replaces.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Mapping, Optional

import torch

from loka_compile import probe, speed
from loka_compile.config import RECIPES, LokaConfig
from loka_compile.kernels import providers
from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.kernels.scaled_gemm import padding_for
from loka_compile.plan import MEASURED_REASONS
from loka_compile.passes import Decision, GraphKind, Phase, Reason, Site
from loka_compile.passes.context import Candidate
from loka_compile.passes.mods import aligned_gemms, benchmarked_reductions, cached_weights, cat_casts, pad

log = logging.getLogger("loka")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_ALIGNMENT = 16


def _fallback(reason: Reason, detail: str = "") -> Decision:
    return Decision(fp8=False, reason=reason, detail=detail)


def _alignment(site: Site, config: LokaConfig, hardware: bool):
    """(pad_k, pad_n), or the fallback Decision when K or N cannot be aligned."""
    _, k, n = site.shape
    if hardware and not (isinstance(k, int) and isinstance(n, int)):
        return _fallback(Reason.SYMBOLIC_K_OR_N, f"K={k}, N={n}")
    k_pad, n_pad = padding_for(k if isinstance(k, int) else 0, n if isinstance(n, int) else 0, FP8_ALIGNMENT)
    if (k_pad or n_pad) and (not pad.MOD.on(config.inactive_mods) or site.batch is not None):
        if k_pad:
            return _fallback(Reason.K_NOT_MULTIPLE_OF_16, f"K={k}")
        return _fallback(Reason.N_NOT_MULTIPLE_OF_16, f"N={n}")
    return k_pad, n_pad


def _verdict(site: Site, *tables):
    """A site's entry in verdict tables keyed by site id (plans)."""
    for table in tables:
        if table and site.id in table:
            return table[site.id]
    return None


def _from_plan(site: Site, entry, source: str, config: LokaConfig, hardware: bool, padding: tuple):
    """A loaded plan's decision for the site, or None (then decided here) where it no
    longer holds: a reason that follows from the model and config, another K/N or
    dtype, other padding, or a provider that cannot serve the site now."""
    reason = Reason(entry.reason)
    if reason not in MEASURED_REASONS:
        return None
    if entry.fp8 and entry.fp8_us is None and hardware and config.speed_check:
        return None  # FP8 without a speed measurement: the speed check runs here, in this compile's mode
    dtype = str(site.dtype).replace("torch.", "")
    # K and N where both are concrete (symbol names differ between compiles)
    differs = any(isinstance(a, int) and isinstance(b, int) and a != b
                  for a, b in zip(entry.shape[1:], site.shape[1:]))
    if entry.dtype != dtype or differs:
        log.warning("loka plan %s: site %s was planned at K x N %s %s, it is %s %s here; decided here",
                    source, site.id, "x".join(map(str, entry.shape[1:])), entry.dtype,
                    "x".join(map(str, site.shape[1:])), dtype)
        return None
    if not entry.fp8:
        return entry.decision(source)
    request = providers.GemmRequest(site.device, Scaling(entry.scaling), Fp8Format(entry.a_format),
                                    Fp8Format(entry.b_format), site.dtype, site.batch is not None)
    runnable = [p.name for p in providers.select(request)
                if (not config.providers or p.name in config.providers) and p.emulated != hardware]
    if entry.provider not in runnable or (entry.pad_k, entry.pad_n) != tuple(padding):
        log.warning("loka plan %s: site %s cannot run as planned (provider %s, padding %s; here %s, %s); "
                    "decided here", source, site.id, entry.provider, (entry.pad_k, entry.pad_n), runnable, padding)
        return None
    return entry.decision(source)


def decide(site: Site, config: LokaConfig, phase: Phase, unsafe_sites: Optional[Mapping[str, float]] = None,
           upgraded_sites: Optional[Mapping[str, tuple]] = None, plan=None, a_static: bool = False,
           untimed: str = "") -> Decision:
    """`plan`: the compiled model's Plan; its verdicts (by site id) apply, and when it
    was loaded from a file a site it holds takes its decision, re-checked. `a_static`:
    the graph casts the site's A with a calibrated static scale (`PassContext.static_a_scale`;
    tensorwise and rowwise only), so the speed check times that cast. `untimed`: why the
    site stays in high precision whatever its speed (the output budget keeps it; the caller
    amends the decision): an FP8 decision is then neither timed nor tried on a provider."""
    m, k, n = site.shape
    if site.op == "packed_linear":
        return _fallback(Reason.PACKED_BY_FREEZING, "Inductor's freezing packed the weight for a CPU library "
                         "before loka's pass; compile without freezing to run this linear in FP8")
    if site.dtype not in SUPPORTED_DTYPES:
        return _fallback(Reason.UNSUPPORTED_DTYPE, str(site.dtype))
    hardware = providers.has_fp8_hardware(site.device)
    padding = _alignment(site, config, hardware)
    if isinstance(padding, Decision):
        return padding
    pad_k, pad_n = padding
    dims = [d for d in (m, k, n) if isinstance(d, int)]
    if dims and min(dims) < config.min_gemm_dim:
        return _fallback(Reason.TOO_SMALL, f"min dim {min(dims)} < {config.min_gemm_dim}")
    if not site.unit_scalars:
        return _fallback(Reason.UNSUPPORTED_VARIANT, f"{site.op} with beta/alpha != 1")
    if any(site.module == p or site.module.startswith(p + ".") for p in config.exclude_modules):
        return _fallback(Reason.EXCLUDED_BY_CONFIG, site.module)
    recipe = config.recipe_spec
    if site.role in recipe.high_precision_roles:
        return _fallback(Reason.RECIPE_HIGH_PRECISION, f"{recipe.name} keeps {site.role.value}")
    upgraded = _verdict(site, upgraded_sites, plan and plan.upgraded)
    upgrade = upgrade_steps(upgraded)

    if not hardware and not config.emulate:
        return _fallback(Reason.NO_FP8_HARDWARE, f"{site.device} has no FP8 and emulate=False")
    entry = plan.sites.get(site.id) if plan is not None and plan.source else None
    if entry is not None:
        planned = _from_plan(site, entry, plan.source, config, hardware, padding)
        if planned is not None:
            return planned
    runnable = functools.partial(_runnable, site, config, hardware)

    upgrade_note = ""
    if upgrade is not None:  # unsafe in its own scaling: the first finer one within the bound that runs here
        measured = f"the Probe measured {probe.describe_steps(upgrade, config.max_probe_error, config.probe_metric)}"
        if len(upgraded) > 2:  # moved at run time (amax_guard.py): why, then the window's finer bounds
            measured = f"{upgraded[2]}; the Probe measured " + probe.describe_steps(
                upgrade[1:], config.max_probe_error, config.probe_metric)
        for scaling, bound in upgrade[1:]:
            if not bound <= config.max_probe_error or scaling not in _UPGRADE_RECIPES:
                continue
            a_format, b_format, request, candidates = runnable(_UPGRADE_RECIPES[scaling])
            if candidates:
                recipe, upgrade_note = _UPGRADE_RECIPES[scaling], f"{scaling}: {measured}"
                break
        else:
            a_format, b_format, request, candidates = runnable(recipe)
            return Decision(fp8=False, reason=Reason.PROBE_UNSAFE, provider=candidates[0] if candidates else "aten",
                            scaling=recipe.scaling.value, a_format=a_format.value, b_format=b_format.value,
                            detail=f"{measured}; no finer scaling within the bound has a provider here")
    else:
        a_format, b_format, request, candidates = runnable(recipe)
    if not candidates:
        return _fallback(Reason.NO_PROVIDER, f"none for {request.scaling.value} {a_format.value}x{b_format.value}"
                         f"{' batched' if request.batched else ''} on {site.device.type}")
    notes = ", ".join(f"{dim} padded {size}->{size + pad}" for dim, size, pad in (("K", k, pad_k), ("N", n, pad_n))
                       if pad)
    notes = "; ".join(filter(None, (notes, upgrade_note)))
    chosen = dict(provider=candidates[0], scaling=recipe.scaling.value, a_format=a_format.value,
                  b_format=b_format.value, pad_k=pad_k, pad_n=pad_n, fast_accum=site.role in recipe.fast_accum_roles)
    unsafe = _verdict(site, unsafe_sites, plan and plan.unsafe)
    if unsafe is not None:
        return Decision(fp8=False, reason=Reason.PROBE_UNSAFE,
                        detail=f"{probe.LABELS[config.probe_metric]} {unsafe:.3g} > {config.max_probe_error:g}",
                        **chosen)
    if phase is Phase.PROBE:
        return Decision(fp8=False, reason=Reason.PROBING, detail=notes, **chosen)
    if untimed:
        return Decision(fp8=True, reason=Reason.FP8, detail="; ".join(filter(None, (notes, f"not timed: {untimed}"))),
                        **chosen)
    b_cached = site.kind is GraphKind.INFERENCE and site.b_is_weight and cached_weights.MOD.on(config.inactive_mods)
    a_static = a_static and chosen["scaling"] != Scaling.BLOCKWISE.value
    shape = speed.site_shape(site, chosen["scaling"], pad_k, pad_n, b_cached,
                             benchmarked_reductions.MOD.on(config.inactive_mods), a_static,
                             cat_casts.MOD.on(config.inactive_mods), _high_precision_padding(site, config)) \
        if hardware else None
    if shape is not None and not config.speed_check:
        try:
            chosen["provider"] = speed.first_runnable_provider(shape, chosen["scaling"], chosen["a_format"],
                                                               chosen["b_format"], tuple(candidates),
                                                               chosen["fast_accum"])
        except speed.NoProviderRuns as error:
            return _fallback(Reason.PROVIDER_FAILED, str(error))
    if shape is None or not config.speed_check:
        return Decision(fp8=True, reason=Reason.FP8, detail=notes, **chosen)
    try:
        timing = speed.site_timing(shape, chosen["scaling"], chosen["a_format"], chosen["b_format"],
                                   tuple(candidates),
                                   fast_accum=chosen["fast_accum"])
    except speed.NoProviderRuns as error:
        return _fallback(Reason.PROVIDER_FAILED, str(error))
    except Exception as error:  # noqa: BLE001  (a failed timing must not cost the graph its FP8)
        log.warning("loka: could not time site %s (%s: %s); it goes FP8 unchecked", site.name,
                    type(error).__name__, error)
        return Decision(fp8=True, reason=Reason.FP8, detail=f"speed not measured: {type(error).__name__}", **chosen)
    chosen["provider"] = timing.provider
    fp8 = timing.speedup >= config.min_fp8_speedup
    measured = dict(bf16_us=round(timing.bf16_us, 2), fp8_us=round(timing.fp8_us, 2),
                    candidates=_candidates(timing, fp8))
    bucket = ""
    if not isinstance(m, int):
        measured["m_bucket"] = shape.m
        bucket = f"M={m} timed at {shape.m}, the power of two at or above its compile-time size {speed.m_hint(site)}"
    if site.batch is not None and not isinstance(site.batch, int):
        bucket = "; ".join(filter(None, (bucket, f"batch={site.batch} timed at {shape.batch}, the power of two at "
                                                 f"or above its compile-time size {speed.batch_hint(site)}")))
    others = ", ".join(f"{name} GEMM {us:.1f} us" for name, us in timing.gemm_us.items())
    casts = f"casts {timing.cast_us:.1f} us{', A with its static scale' if shape.a_static else ''}"
    timings = f"fp8 {timing.fp8_us:.1f} us ({others}; {casts}) vs {timing.bf16_us:.1f} us"
    cannot = "; ".join(f"{name} cannot run here ({why})" for name, why in timing.failed.items())
    detail = "; ".join(filter(None, (notes, bucket, timings, cannot)))
    if not fp8:
        return Decision(fp8=False, reason=Reason.SLOWER_THAN_BF16, **chosen, **measured,
                        detail=f"{detail} ({timing.speedup:.2f}x < {config.min_fp8_speedup})")
    return Decision(fp8=True, reason=Reason.FP8, detail=detail, **chosen, **measured)


def _runnable(site: Site, config: LokaConfig, hardware: bool, recipe) -> tuple:
    """(A's format, B's format, the request, the providers that run it here) of a site in `recipe`."""
    a_format, b_format = recipe.formats(site.a_is_grad, site.b_is_grad)
    request = providers.GemmRequest(site.device, recipe.scaling, a_format, b_format, site.dtype,
                                    site.batch is not None)
    return a_format, b_format, request, [p.name for p in providers.select(request)
                                         if (not config.providers or p.name in config.providers)
                                         and p.emulated != hardware]


def upgrade_runs(site: Site, config: LokaConfig, scaling: str) -> bool:
    """Whether an upgrade of the site to a finer `scaling` has a provider here."""
    if scaling not in _UPGRADE_RECIPES:
        return False
    hardware = providers.has_fp8_hardware(site.device)
    if not hardware and not config.emulate:
        return False
    return bool(_runnable(site, config, hardware, _UPGRADE_RECIPES[scaling])[3])


def _candidates(timing: speed.SiteTiming, fp8: bool) -> tuple:
    """Each timed provider: its GEMM time, whether the site runs on it, and why it lost."""
    best = timing.gemm_us[timing.provider]
    timed = []
    for name, us in timing.gemm_us.items():
        chosen = fp8 and name == timing.provider
        lost = "" if chosen else (f"slower GEMM ({us:.1f} us vs {best:.1f} us)" if us > best
                                  else "the site stays in high precision")
        timed.append(Candidate(name, us, chosen, lost))
    timed += [Candidate(name, None, False, f"cannot run here ({why})") for name, why in timing.failed.items()]
    return tuple(timed)


# Where an upgrade goes: e4m3 operands, the rowwise recipe's roles (blockwise: 1x128 tiles of
# A, 128x128 of B).
_UPGRADE_RECIPES = {"rowwise": RECIPES["rowwise"],
                    "blockwise": dataclasses.replace(RECIPES["rowwise"], name="blockwise", scaling=Scaling.BLOCKWISE,
                                                     description="one scale per 1x128 tile of A, 128x128 of B")}
# ... and each scaling with its gradient operands in e5m2 (`probe.CHAIN_ORDER`).
_UPGRADE_RECIPES.update({
    scaling + probe.E5M2_GRADIENTS: dataclasses.replace(
        RECIPES["rowwise"], name=scaling + probe.E5M2_GRADIENTS, scaling=Scaling(scaling),
        grad_format=Fp8Format.E5M2, description=f"{scaling}, gradient operands in e5m2")
    for scaling in probe.SCALING_CHAIN})


def upgrade_steps(entry) -> Optional[list]:
    """An upgraded verdict as [[scaling, bound], ...] (the site's own first), from
    (target, steps) or (target, steps, why) (the amax guard's, `amax_guard.py`), or from
    (tensorwise bound, rowwise bound) as plans and the backend give it today; None when
    there is none."""
    if entry is None:
        return None
    if isinstance(entry[0], str):
        return [[str(s), float(b)] for s, b in entry[1]]
    return [["tensorwise", float(entry[0])], ["rowwise", float(entry[1])]]


def _high_precision_padding(site: Site, config: LokaConfig) -> tuple:
    """The zeros the aligned_gemms Mod adds to the site's M, K and N if it stays high precision:
    the speed check times that form against FP8."""
    if not (aligned_gemms.MOD.on(config.inactive_mods) and aligned_gemms.pads_on(site.device)):
        return (0, 0, 0)
    return aligned_gemms.alignment_padding(site.node)[0]
