"""Speed verdicts: does FP8 pay at this site, on this device, at this shape, and with
which provider?

Dispatch asks `site_timing` for the time of the site's high-precision GEMM (the ATen op it
replaces, padded where the `aligned_gemms` Mod would pad it in high precision) and of the form the site will have in the graph once lowered, for each
candidate provider, on fresh random operands of the site's shape, dtype and layouts:

    fp8_us = provider GEMM on K-major FP8 operands (bias in its epilogue, padding included)
           + each operand's cast: a standalone cast (a weight, a graph input, a GEMM
             output) costs what loka's one-kernel cast (`loka::quantize_operand`) takes;
             a cast Inductor fuses into its producer (a norm, an activation, an add)
             costs what it adds to that kernel. Rows of K <= 1024 fit one persistent
             reduction (Inductor's `should_use_persistent_reduction` threshold for inner
             reductions): the row is read once for the value, its amax and the cast, so
             the cast adds only its FP8 byte per element, 1 / (input bytes + 1) of the
             standalone time (rows up to 4096 with the `benchmarked_reductions` Mod,
             under which Inductor also tries longer rows persistent). Longer rows take a looped
             reduction that re-reads the row
             for the cast after the amax pass: the standalone cast's bytes, so its time
             (docs/guide.md, "The speed check and its database", has the measurement).
             A weight whose
             FP8 copy is cached (inference, the `cached_weights` Mod), or an activation
             whose FP8 copy the forward saved (the `saved_fp8` Mod), costs nothing here.
             An A with a calibrated static scale (an inference site of a plan from
             `loka_compile.calibrate`) is cast clamp(A / s) -> fp8, pointwise with no
             reduction (`scaled_gemm.quantize_static`): fused into its producer it adds
             its FP8 byte per element at any row length; standalone it is one
             pointwise kernel that reads A and writes its FP8 copy K-major.

How it times (medians of `TIMING_REPEATS` runs of `CALLS_PER_RUN` back-to-back calls): on
CUDA each run replays a CUDA graph of the calls, so the timing is the device work, in every
compile mode. Without CUDA graphs a training or inference step of an LRM keeps the GPU busy
while the host launches ahead, so host work is hidden, and in the compiled graph a fused
cast adds no launch at all; timing eager calls charged the dispatcher's host work instead,
enough to keep every site of a model in bf16. A step that is host bound without CUDA graphs
is not modelled: there each FP8 site's extra launches (a standalone weight cast) cost host
time the timing leaves out; such models want `reduce-overhead`. On CPU: wall time. The
measurements behind both are in docs/guide.md ("The speed check and its database").
Timings are cached per (shape, layouts, casts, a static A, dtype, device, recipe, providers)
for the life of the process, and kept across processes in the performance database
(`perfdb.py`), keyed also by the GPU and the torch and triton versions; so are the
`gemm_epilogue` Mod's link timings (`epilogue_timing`).

A symbolic M (a graph compiled with `dynamic=True`, or Dynamo's automatic dynamic
recompile, whose batch dim is a symbol such as "s0" or "8*s0") is timed at the bucket of
its size hint: the size of the example inputs the graph was compiled for, rounded up to a
power of two (`m_bucket`). Powers of two land exactly on the batch sizes LRMs train and
serve at (512, 2048, 8192, ...), are never more than 2x from the size seen, and keep a
handful of database entries per K x N however many batch sizes recompile; a concrete M of
the bucket's size shares its timing, which is the same measurement. The site keeps that
decision at every M the graph later runs at: loka adds no guard on M, so Dynamo does not
recompile for another batch size, and a batch far from the bucket runs the verdict taken
at the bucket. Where the verdict flips across the batch sizes a model runs at, compile it
with static shapes (`dynamic=False`): each batch size gets its own graph and timing. K or
N symbolic, or an M without a size hint (a data-dependent size), are not timed.

A batched site (bmm, baddbmm: [B, M, K] @ [B, K, N]) is timed as its batched GEMM:
`torch.bmm` (`baddbmm` with a bias) against the provider's batched FP8 GEMM, on operands
of the site's layouts per matrix. Its casts are charged as a 2-D site's, on the same
elements: A's as the cast of a [B*M, K] operand, B's as that of a [K, B*N] one (the
per-row and per-column scales and the one tensorwise amax are the same reductions), fused
or standalone by the same rule. A symbolic batch (a bmm over the model's batch) is timed
at the bucket of its size hint, as a symbolic M is; a batch without a hint is not timed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from typing import Optional

import torch

from loka_compile.kernels import providers as provider_registry
from loka_compile.ranks import decide_once
from loka_compile.passes.mods.benchmarked_reductions import PERSISTENT_ROW_MAX, persistent_row_max
from loka_compile.passes.mods.cat_casts import per_piece_row_max
from loka_compile.passes.mods.gemm_epilogue import MOD as GEMM_EPILOGUE
from loka_compile.passes.shapes import size_hint

log = logging.getLogger("loka")

TIMING_REPEATS = 5
CALLS_PER_RUN = 10
WARMUP_CALLS = 3
# Part of each persisted timing's key: bump when how a site is timed or charged changes,
# or SiteTiming's fields do, so that timings of the old method are not reused.
TIMING_METHOD = 2


@dataclasses.dataclass(frozen=True)
class SiteShape:
    """What timing a site needs to know: GEMM dims, operand layouts, how each operand is
    cast (fused into its producer or standalone), padding, bias, dtype, device."""

    m: int
    k: int
    n: int
    a_major: str            # "row" or "column"
    b_major: str
    has_bias: bool
    dtype: torch.dtype
    device: torch.device
    a_fused: bool = False
    b_fused: bool = False
    b_cached: bool = False  # B is a weight whose FP8 copy is cached, or saved by the forward: no cast here
    a_saved: bool = False   # A's FP8 copy was saved by the forward (the saved_fp8 Mod): no cast here
    a_static: bool = False  # A has a calibrated static scale: a pointwise cast, no amax
    pad_k: int = 0
    pad_n: int = 0
    persistent_row_max: int = 1024  # longest row a fused cast reduces in one pass
    batch: Optional[int] = None     # B of a batched site ([B, M, K] @ [B, K, N]); None for 2-D
    # Zeros the aligned_gemms Mod adds to M, K and N where the site stays high precision (2-D sites):
    # the high-precision time is the padded GEMM's, as it would run
    hp_padding: tuple = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class SiteTiming:
    bf16_us: float            # the high-precision ATen GEMM (bf16 for bf16 models)
    fp8_us: float             # the fastest provider's FP8 form, casts included
    provider: str             # that provider
    gemm_us: dict             # provider -> its FP8 GEMM alone
    cast_us: float            # the two operand casts as charged (fused or standalone)
    # (fastest, slowest) of the TIMING_REPEATS runs; the FP8 one is the chosen provider's
    # GEMM runs plus cast_us. None when not measured.
    bf16_range_us: Optional[tuple] = None
    fp8_range_us: Optional[tuple] = None
    # provider -> why its GEMM raised at this shape (it is never chosen for it)
    failed: dict = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us


_cache: dict = {}


def _operand(rows: int, cols: int, major: str, dtype, device) -> torch.Tensor:
    x = torch.randn(rows, cols, dtype=torch.float32, device=device) * cols ** -0.5
    x = x.to(dtype)
    return x if major == "row" else x.t().contiguous().t()


def _site_operands(shape: SiteShape):
    """(A, B, bias) on fresh random values, and A and B zero-padded as the site's casts pad
    them. A batched site's A and B come as their 2-D stacks, A [B*M, K] and B [K, B*N]
    in the site's layouts: what the casts are timed on (module docstring); `_batched`
    views them, and their FP8 casts, as the [B, M, K] and [B, K, N] operands of the GEMM.
    (Batched sites are never padded: Dispatch pads 2-D sites only.)"""
    batch = shape.batch or 1
    a = _operand(shape.m * batch, shape.k, shape.a_major, shape.dtype, shape.device)
    b = _operand(shape.k, shape.n * batch, shape.b_major, shape.dtype, shape.device)
    bias = torch.randn(shape.n, dtype=shape.dtype, device=shape.device) if shape.has_bias else None
    a_p = torch.nn.functional.pad(a, (0, shape.pad_k))
    b_p = torch.nn.functional.pad(b, (0, shape.pad_n, 0, shape.pad_k))
    return a, b, bias, a_p, b_p


def _padded_high_precision(a: torch.Tensor, b: torch.Tensor, bias, padding: tuple):
    """A, B and the bias of a 2-D site zero-padded by (M, K, N) `padding` as the aligned_gemms
    Mod pads a high-precision GEMM; the padded copies are row-major, as Inductor writes them."""
    pad_m, pad_k, pad_n = padding
    if not any(padding):
        return a, b, bias
    pad = torch.nn.functional.pad
    return (pad(a, (0, pad_k, 0, pad_m)), pad(b, (0, pad_n, 0, pad_k)),
            None if bias is None else pad(bias, (0, pad_n)))


def _batched(t: torch.Tensor, operand: str, batch: Optional[int]) -> torch.Tensor:
    """A stack of `_site_operands` (or its FP8 cast, or the cast's scale) as the batched
    GEMM's operand, a view: A [B*M, K] -> [B, M, K], B [K, B*N] -> [B, K, N], each matrix
    in the stack's layout. 2-D sites and 0-d (tensorwise) scales pass through."""
    if batch is None or t.dim() < 2:
        return t
    if operand == "a":
        return t.view(batch, t.shape[0] // batch, t.shape[1])
    return t.view(t.shape[0], batch, t.shape[1] // batch).permute(1, 0, 2)


def _time_calls_us(fn, device: torch.device) -> float:
    """Median time per call of fn: device time on CUDA (module docstring), wall time on CPU."""
    return statistics.median(_time_runs_us(fn, device))


@functools.lru_cache(maxsize=None)
def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """One capture stream per device for every timing (the graph speed check's too): cuBLAS
    keeps a workspace per stream for the life of the process, so a new stream per timed GEMM
    would leave one workspace allocated per timing."""
    return torch.cuda.Stream(device)


def _time_runs_us(fn, device: torch.device) -> list:
    """Time per call of fn in each of TIMING_REPEATS runs (`_time_calls_us`)."""
    for _ in range(WARMUP_CALLS):
        fn()
    if device.type != "cuda":
        runs = []
        for _ in range(TIMING_REPEATS):
            start = time.perf_counter()
            for _ in range(CALLS_PER_RUN):
                fn()
            runs.append((time.perf_counter() - start) * 1e6 / CALLS_PER_RUN)
        return runs
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm up on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(CALLS_PER_RUN):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        runs = []
        for _ in range(TIMING_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / CALLS_PER_RUN)
        return runs


def _fused_fraction(dtype: torch.dtype, row: int, persistent_row_max: int = PERSISTENT_ROW_MAX,
                    static: bool = False) -> float:
    """Share of a standalone cast's time that a cast fused into its producer still costs
    (module docstring): its FP8 byte out of the bytes a standalone cast moves when the row
    fits a persistent reduction or the cast has no reduction (`static`: a calibrated
    scale), else all of it."""
    return 1.0 / (torch.finfo(dtype).bits // 8 + 1) if static or row <= persistent_row_max else 1.0


def _static_cast(x: torch.Tensor, scaling: str, fmt: str):
    """A's static cast, for timing: (the FP8 operand and scale that `quantize_static`, the
    lowering's cast, gives the GEMM; a call that runs the cast as the compiled graph does).
    Inductor compiles `quantize_static` to one pointwise kernel that reads A and writes its
    FP8 copy K-major (the divide and clamp move no bytes); eager, each of its ops would be
    a kernel of its own, so the timed call is that one pass: a converting copy into a
    K-major FP8 tensor, the pass's bytes at full bandwidth (docs/guide.md, "The speed check
    and its database", compares it with Inductor's kernel)."""
    from loka_compile.kernels.quantize import Fp8Format, Scaling, scale_from_amax
    from loka_compile.kernels.scaled_gemm import quantize_static

    fp8 = Fp8Format(fmt)
    scale = float(scale_from_amax(x.abs().amax().float(), fp8))
    out = torch.empty(x.shape, dtype=fp8.dtype, device=x.device)
    return quantize_static(x, scale, Scaling(scaling), fp8), lambda: out.copy_(x)


def site_timing(shape: SiteShape, scaling: str, a_format: str, b_format: str, providers: tuple,
                fast_accum: bool = False) -> SiteTiming:
    """Time the site's ATen GEMM and its FP8 form on each provider: from the process's
    cache, else from the performance database, else measured and stored in both."""
    key = (shape, scaling, a_format, b_format, providers, fast_accum)
    if key in _cache:
        return _cache[key]
    # Imported here: the package's import would otherwise load perfdb before
    # `python -m loka_compile.perfdb` runs it.
    from loka_compile import perfdb

    db_key = perfdb.site_key(shape, scaling, a_format, b_format, providers, fast_accum,
                             method=TIMING_METHOD)
    # Timings differ per rank: rank 0's decide for all (`ranks.py`).
    timing, stored = decide_once(lambda: _stored_or_measured(db_key, SiteTiming, lambda: _measure_site(
        shape, scaling, a_format, b_format, providers, fast_accum)))
    _cache[key] = timing
    log.debug("loka speed: %s %s/%s/%s: aten %.1f us, fp8 %.1f us on %s (%.2fx; GEMMs %s, casts %.1f us)%s",
              shape, scaling, a_format, b_format, timing.bf16_us, timing.fp8_us, timing.provider, timing.speedup,
              timing.gemm_us, timing.cast_us,
              " (from the performance database)" if stored else "")
    return timing


def _stored_or_measured(db_key: dict, record_type, measure) -> tuple:
    """(timing, whether it came from the performance database): the stored value where it
    reads as a `record_type`, else `measure()`'s, stored."""
    from loka_compile import perfdb

    db = perfdb.default_db()
    value = db.get(db_key)
    if value is not None:
        ranges = {name: tuple(value[name]) for name in ("bf16_range_us", "fp8_range_us") if value.get(name)}
        try:
            return record_type(**{**value, **ranges}), True  # JSON keeps the ranges as lists
        except TypeError as error:
            log.debug("loka speed: stored timing %s unusable (%s); timing again", value, error)
    timing = measure()
    db.put(db_key, dataclasses.asdict(timing))
    return timing, False


def _measure_site(shape: SiteShape, scaling: str, a_format: str, b_format: str, providers: tuple,
                  fast_accum: bool) -> SiteTiming:
    """Time the site on fresh operands (module docstring)."""
    # Compile passes run under a fake-tensor mode: timing needs real tensors.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import GemmSpec, gemm_quantized

    device, batch = shape.device, shape.batch
    with unset_fake_temporarily(), torch.no_grad():
        a, b, bias, a_p, b_p = _site_operands(shape)
        a, b = _batched(a, "a", batch), _batched(b, "b", batch)
        mm, addmm = (torch.mm, torch.addmm) if batch is None else (torch.bmm, torch.baddbmm)

        hp_a, hp_b, hp_bias = _padded_high_precision(a, b, bias, shape.hp_padding if batch is None else (0, 0, 0))

        def high_precision():
            return mm(hp_a, hp_b) if bias is None else addmm(hp_bias, hp_a, hp_b)

        bf16_runs = _time_runs_us(high_precision, device)
        cast_us = 0.0
        quantized = {}
        for operand, x, fmt, fused in (("a", a_p, a_format, shape.a_fused), ("b", b_p, b_format, shape.b_fused)):
            static = operand == "a" and shape.a_static
            if static:
                quantized[operand], cast = _static_cast(x, scaling, fmt)
            else:
                quantized[operand] = torch.ops.loka.quantize_operand(x, operand, scaling, fmt)
                cast = functools.partial(torch.ops.loka.quantize_operand, x, operand, scaling, fmt)
            if (operand == "b" and shape.b_cached) or (operand == "a" and shape.a_saved):
                continue
            standalone = _time_calls_us(cast, device)
            cast_us += standalone * (_fused_fraction(shape.dtype, shape.k + shape.pad_k, shape.persistent_row_max,
                                                     static) if fused else 1.0)
        (a_q, a_s), (b_q, b_s) = ((_batched(q, operand, batch), _batched(s, operand, batch))
                                  for operand, (q, s) in quantized.items())
        gemm_runs, failed = {}, {}
        for name in providers:
            spec = GemmSpec(Scaling(scaling), Fp8Format(a_format), Fp8Format(b_format), name, shape.dtype,
                            shape.pad_k, shape.pad_n, fast_accum=fast_accum)
            try:
                gemm_runs[name] = _time_runs_us(lambda spec=spec: gemm_quantized(a_q, a_s, b_q, b_s, bias, spec),
                                                device)
            except RuntimeError as error:  # e.g. cuBLASLt has no algorithm for this shape
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                log.warning("loka speed: provider %s cannot run %s (%s); not chosen there", name, shape, failed[name])
    if not gemm_runs:
        raise NoProviderRuns(failed)
    gemm_us = {name: statistics.median(runs) for name, runs in gemm_runs.items()}
    best = min(gemm_us, key=gemm_us.get)
    return SiteTiming(bf16_us=statistics.median(bf16_runs), fp8_us=gemm_us[best] + cast_us, provider=best,
                      gemm_us=gemm_us, cast_us=cast_us,
                      bf16_range_us=(min(bf16_runs), max(bf16_runs)),
                      fp8_range_us=(min(gemm_runs[best]) + cast_us, max(gemm_runs[best]) + cast_us),
                      failed=failed)


@dataclasses.dataclass(frozen=True)
class EpilogueTiming:
    """A GEMM that feeds the next FP8 GEMM's A (the `gemm_epilogue` Mod): its time with
    the activation, residual and the next cast in loka's Triton epilogue, against the
    site's chosen provider GEMM followed by the one pointwise kernel Inductor makes of
    the activation, residual and static cast."""

    fused_us: float
    unfused_us: float
    pointwise_us: float   # the unfused form's pointwise (or norm) kernel, part of unfused_us

    @property
    def pays(self) -> bool:
        return self.fused_us < self.unfused_us


_epilogue_cache: dict = {}


def epilogue_timing(shape: SiteShape, scaling: str, a_format: str, b_format: str, provider: str,
                    fast_accum: bool, activation: str, residual: bool, out_format: str,
                    norm: Optional[str] = None, write_pre: bool = False) -> EpilogueTiming:
    """Both forms' times: from the process's cache, else from the performance database,
    else measured (`_measure_epilogue`) and stored in both. `norm` ("layer", "rms"): the
    gemm_norm Mod's chain, whose fused kernel also normalizes the rows (and with
    `write_pre` writes the pre-norm value)."""
    key = (shape, scaling, a_format, b_format, provider, fast_accum, activation, residual, out_format, norm,
           write_pre)
    if key in _epilogue_cache:
        return _epilogue_cache[key]
    from loka_compile import perfdb

    db_key = perfdb.epilogue_key(shape, *key[1:], method=TIMING_METHOD)
    timing, stored = decide_once(lambda: _stored_or_measured(db_key, EpilogueTiming,
                                                             lambda: _measure_epilogue(shape, *key[1:])))
    _epilogue_cache[key] = timing
    log.debug("loka speed: %s GEMM into the next FP8 operand (%s%s%s): fused %.1f us, %s + pointwise %.1f us%s",
              shape, activation, " + residual" if residual else "", f" + {norm} norm" if norm else "",
              timing.fused_us, provider, timing.unfused_us,
              " (from the performance database)" if stored else "")
    return timing


def _measure_epilogue(shape: SiteShape, scaling: str, a_format: str, b_format: str, provider: str,
                      fast_accum: bool, activation: str, residual: bool, out_format: str,
                      norm: Optional[str] = None, write_pre: bool = False) -> EpilogueTiming:
    """Time both forms on fresh operands of the producing site's shape. The unfused pointwise
    kernel is timed as the converting copy of the GEMM's output into an FP8 buffer, the
    bytes it moves at full bandwidth (`_static_cast`: Inductor's compiled static cast took
    up to 1.6x that, so the charge is the low end), scaled with a residual by the bytes it
    adds (it also reads the residual: 2 + 2 + 1 bytes per element instead of 2 + 1 in
    bf16, 5/3), and with `write_pre` by the pre-norm value it writes (2 more). A norm
    (gemm_norm) is charged the same way: Inductor's norm kernel is one pass over rows that
    fit its registers, bound by the same bytes. Both forms read the operands already in
    FP8: their casts are the same either way. The GEMM is timed here in the form the
    unfused link runs (bf16 output, its bias), not read from the site's own timing, whose
    form may differ (padding, casts)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import (GemmSpec, gemm_norm_to_next_operand, gemm_quantized,
                                                  gemm_to_next_operand)

    device = shape.device
    with unset_fake_temporarily(), torch.no_grad():
        _, _, bias, a, b = _site_operands(shape)
        a_q, a_s = torch.ops.loka.quantize_operand(a, "a", scaling, a_format)
        b_q, b_s = torch.ops.loka.quantize_operand(b, "b", scaling, b_format)
        spec = GemmSpec(Scaling(scaling), Fp8Format(a_format), Fp8Format(b_format), provider, shape.dtype,
                        fast_accum=fast_accum)
        out = gemm_quantized(a_q, a_s, b_q, b_s, bias, spec)
        res = torch.randn_like(out) if residual else None
        out_scale = out.abs().amax().float().reshape(1) / Fp8Format(out_format).max  # a constant in the graph
        triton_spec = dataclasses.replace(spec, provider="triton")
        if norm is None:
            fused = functools.partial(gemm_to_next_operand, a_q, a_s, b_q, b_s, bias, res, activation, triton_spec,
                                      Fp8Format(out_format), out_scale)
        else:
            width = out.shape[-1]
            weight = torch.randn(width, dtype=shape.dtype, device=device)
            norm_bias = torch.randn(width, dtype=shape.dtype, device=device) if norm == "layer" else None
            out_scale = torch.full((1,), 4.0 / Fp8Format(out_format).max, device=device)  # normalized rows: |y| ~ 4
            fused = functools.partial(gemm_norm_to_next_operand, a_q, a_s, b_q, b_s, bias, res, activation, norm,
                                      weight, norm_bias, 1e-5, "none", triton_spec, Fp8Format(out_format),
                                      out_scale, write_pre)
        fused_us = _time_calls_us(fused, device)
        gemm_us = _time_calls_us(lambda: gemm_quantized(a_q, a_s, b_q, b_s, bias, spec), device)
        out_q = torch.empty(out.shape, dtype=Fp8Format(out_format).dtype, device=device)
        size = out.element_size()
        moved = size * (1 + residual + write_pre) + 1  # bytes per element: C and R read, S and the operand written
        pointwise_us = _time_calls_us(lambda: out_q.copy_(out), device) * moved / (size + 1)
    return EpilogueTiming(fused_us=fused_us, unfused_us=gemm_us + pointwise_us, pointwise_us=pointwise_us)


class NoProviderRuns(RuntimeError):
    """Every candidate provider raised at the site's shape."""

    def __init__(self, failed: dict):
        super().__init__("; ".join(f"{name}: {why}" for name, why in failed.items()))
        self.failed = failed

    def __reduce__(self):  # pickled whole: rank 0's verdict reaches every rank as itself (`ranks.py`)
        return NoProviderRuns, (self.failed,)


_runnable: dict = {}


def first_runnable_provider(shape: SiteShape, scaling: str, a_format: str, b_format: str, providers: tuple,
                            fast_accum: bool = False) -> str:
    """The first of `providers`, in order, whose GEMM runs at the site's shape, each tried
    once on random operands until one runs (cached per process): an FP8 site that is not
    timed (speed_check off) must still not get a kernel that raises at its shape, as
    cuBLASLt's rowwise GEMM does at some. Later providers are not tried: only the first
    that runs is chosen, and a trial of an autotuned kernel (loka's Triton GEMM) compiles
    every one of its configurations. Raises NoProviderRuns when none runs. Rank 0's trial
    decides for all ranks."""
    key = (shape, scaling, a_format, b_format, providers, fast_accum)
    if key not in _runnable:
        _runnable[key] = decide_once(lambda: _try_providers(shape, scaling, a_format, b_format, providers, fast_accum))
    runs, failed = _runnable[key]
    if runs is None:
        raise NoProviderRuns(failed)
    return runs


def _try_providers(shape: SiteShape, scaling: str, a_format: str, b_format: str, providers: tuple,
                   fast_accum: bool) -> tuple:
    """(the first provider whose GEMM ran at the site's shape, or None; name -> why each
    provider tried before it failed)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import GemmSpec, gemm_quantized

    failed = {}
    with unset_fake_temporarily(), torch.no_grad():
        _, _, bias, a, b = _site_operands(shape)
        a_q, a_s = (_batched(t, "a", shape.batch) for t in torch.ops.loka.quantize_operand(a, "a", scaling,
                                                                                              a_format))
        b_q, b_s = (_batched(t, "b", shape.batch) for t in torch.ops.loka.quantize_operand(b, "b", scaling,
                                                                                              b_format))
        for name in providers:
            spec = GemmSpec(Scaling(scaling), Fp8Format(a_format), Fp8Format(b_format), name, shape.dtype,
                            shape.pad_k, shape.pad_n, fast_accum=fast_accum)
            try:
                gemm_quantized(a_q, a_s, b_q, b_s, bias, spec)
                if shape.device.type == "cuda":
                    torch.cuda.synchronize(shape.device)
            except RuntimeError as error:
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                log.warning("loka: provider %s cannot run %s (%s); not chosen there", name, shape, failed[name])
                continue
            return name, failed
    return None, failed


def clear_cache() -> None:
    """Forget this process's timings (the performance database keeps its entries)."""
    _cache.clear()
    _runnable.clear()
    _epilogue_cache.clear()


def m_hint(site) -> Optional[int]:
    """M of a site at the sizes its graph was compiled for: M itself when concrete, else
    the size hint of the symbolic M (the example inputs' size), None when it has none."""
    if isinstance(site.shape[0], int):
        return site.shape[0]
    out = site.node.meta.get("val")
    if out is None:
        return None
    # [M, N], a packed linear's [..., N], or a batched site's [B, M, N] (M per matrix)
    rows = [size_hint(d) for d in (out.shape[-2:-1] if site.batch is not None else out.shape[:-1])]
    return None if None in rows else math.prod(rows)


def batch_hint(site) -> Optional[int]:
    """The batch of a batched site at the sizes its graph was compiled for, as `m_hint`."""
    if isinstance(site.batch, int):
        return site.batch
    out = site.node.meta.get("val")
    return None if out is None else size_hint(out.shape[0])


def m_bucket(m: int) -> int:
    """The M a symbolic-M site is timed at: the next power of two at or above m (module
    docstring)."""
    return 1 << max(m - 1, 0).bit_length()


def site_shape(site, scaling: str, pad_k: int = 0, pad_n: int = 0, b_cached: bool = False,
               benchmarked_reductions: bool = False, a_static: bool = False,
               cat_casts: bool = False, hp_padding: tuple = (0, 0, 0)) -> Optional[SiteShape]:
    """The timing key of a site with concrete K and N: at its M (and a batched site's
    batch) when concrete, at the bucket of its size hint when symbolic (module docstring);
    else None (symbolic K or N, or an M or batch without a hint). `a_static`: A is cast
    with a calibrated static scale; `cat_casts`: the Mod of that name is on (a long row
    of A concatenated from fused pieces is cast per piece: a fused cast, charged as a
    looped one since the row is over the persistent length); `hp_padding`: the zeros the
    aligned_gemms Mod adds to M, K, N if the site stays high precision."""
    from loka_compile.passes.find_sites import PRECAST, SAVED_IN_FP8, operand_casts

    _, k, n = site.shape
    if not (isinstance(k, int) and isinstance(n, int)):
        return None
    m = m_hint(site)
    batch = None if site.batch is None else batch_hint(site)
    if m is None or (site.batch is not None and batch is None):
        return None
    if not isinstance(site.shape[0], int):
        m = m_bucket(m)
    if batch is not None and not isinstance(site.batch, int):
        batch = m_bucket(batch)
    casts = operand_casts(site, scaling, a_static=a_static,
                          row_max=per_piece_row_max(benchmarked_reductions, cat_casts, pad_k))
    return SiteShape(m, k, n, site.a_major, site.b_major, site.op in ("addmm", "baddbmm"), site.dtype, site.device,
                     a_fused=casts["a"].startswith("fused"), b_fused=casts["b"].startswith("fused"),
                     b_cached=b_cached or casts["b"] in PRECAST, a_saved=casts["a"] == SAVED_IN_FP8,
                     a_static=a_static, pad_k=pad_k, pad_n=pad_n,
                     persistent_row_max=persistent_row_max(benchmarked_reductions), batch=batch,
                     hp_padding=tuple(hp_padding) if batch is None else (0, 0, 0))


def chain_timing(chain, ctx):
    """`epilogue_timing` of a gemm_epilogue chain's producer (`PassContext.time_chain`) on an
    FP8 GPU; None elsewhere, or where its shape has no concrete size to time at (the chain is
    then fused)."""
    site = chain.producer
    decision = ctx.decisions[site.id]
    if not provider_registry.has_fp8_hardware(site.device):
        return None
    shape = site_shape(site, decision.scaling)
    if shape is None:
        log.info("loka: %s: %s fused untimed (no concrete size to time at)", site.name, GEMM_EPILOGUE)
        return None
    norm = chain.norm
    return epilogue_timing(shape, decision.scaling, decision.a_format, decision.b_format, decision.provider,
                           decision.fast_accum, chain.activation, chain.residual is not None, chain.out_format.value,
                           norm=None if norm is None else norm.kind, write_pre=norm is not None and norm.write_pre)
