"""Speed verdicts: does FP8 pay at this site, on this device, at this shape?

Dispatch asks `site_timing` for the time of the site's high-precision GEMM (the ATen op it
replaces) and of `torch.ops.loka.fp8_gemm` (operand casts + FP8 GEMM) on fresh random
operands of the site's shape, dtype and operand layouts, on the site's device. A site goes
FP8 only where `bf16_us / fp8_us >= config.min_fp8_speedup`.

How it times (medians of `TIMING_REPEATS` runs of `CALLS_PER_RUN` back-to-back calls):
- compiled with CUDA graphs (`reduce-overhead`, `max-autotune`): each run replays a CUDA
  graph of the calls, so host launch work is excluded, as it is in the model;
- otherwise: CUDA events around plain calls, so a call that is bound by host work (Python
  dispatch of a small GEMM) is timed as the model will pay it.
Timings are cached per (shape, layouts, dtype, device, recipe, provider, graphed) for the
life of the process.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Optional

import torch

log = logging.getLogger("loka")

TIMING_REPEATS = 5
CALLS_PER_RUN = 10
WARMUP_CALLS = 3


@dataclasses.dataclass(frozen=True)
class SiteShape:
    """What timing a site needs to know: GEMM dims, operand layouts, bias, dtype, device."""

    m: int
    k: int
    n: int
    a_major: str            # "row" or "column"
    b_major: str
    has_bias: bool
    dtype: torch.dtype
    device: torch.device


@dataclasses.dataclass(frozen=True)
class SiteTiming:
    bf16_us: float           # the high-precision ATen GEMM (bf16 for bf16 models)
    fp8_us: float            # loka's fp8_gemm: casts + FP8 GEMM
    graphed: bool

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us


_cache: dict = {}


def _operand(rows: int, cols: int, major: str, dtype, device) -> torch.Tensor:
    x = torch.randn(rows, cols, dtype=torch.float32, device=device) * cols ** -0.5
    x = x.to(dtype)
    return x if major == "row" else x.t().contiguous().t()


def _time_calls_us(fn, device: torch.device, graphed: bool) -> float:
    """Median time per call of fn, as the compiled model would pay it."""
    for _ in range(WARMUP_CALLS):
        fn()
    if device.type != "cuda":
        runs = []
        for _ in range(TIMING_REPEATS):
            start = time.perf_counter()
            for _ in range(CALLS_PER_RUN):
                fn()
            runs.append((time.perf_counter() - start) * 1e6 / CALLS_PER_RUN)
        return statistics.median(runs)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        replay = None
        if graphed:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm up on the capture stream
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(CALLS_PER_RUN):
                        fn()
            torch.cuda.current_stream().wait_stream(stream)
            replay = graph.replay
        runs = []
        for _ in range(TIMING_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if replay is not None:
                replay()
            else:
                for _ in range(CALLS_PER_RUN):
                    fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) * 1e3 / CALLS_PER_RUN)
        return statistics.median(runs)


def site_timing(shape: SiteShape, scaling: str, a_format: str, b_format: str, provider: str,
                graphed: bool) -> SiteTiming:
    """Time the site's ATen GEMM and loka's fp8_gemm (cached)."""
    key = (shape, scaling, a_format, b_format, provider, graphed)
    if key in _cache:
        return _cache[key]
    # Compile passes run under a fake-tensor mode: timing needs real tensors.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        a = _operand(shape.m, shape.k, shape.a_major, shape.dtype, shape.device)
        b = _operand(shape.k, shape.n, shape.b_major, shape.dtype, shape.device)
        bias = torch.randn(shape.n, dtype=shape.dtype, device=shape.device) if shape.has_bias else None

        def high_precision():
            return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)

        def fp8():
            return torch.ops.loka.fp8_gemm(a, b, bias, scaling, a_format, b_format, provider, "")

        timing = SiteTiming(bf16_us=_time_calls_us(high_precision, shape.device, graphed),
                            fp8_us=_time_calls_us(fp8, shape.device, graphed), graphed=graphed)
    _cache[key] = timing
    log.debug("loka speed: %s %s/%s/%s on %s: aten %.1f us, fp8 %.1f us (%.2fx)%s", shape, scaling, a_format,
              b_format, provider, timing.bf16_us, timing.fp8_us, timing.speedup, " in CUDA graphs" if graphed else "")
    return timing


def clear_cache() -> None:
    _cache.clear()


def cached_timings() -> dict:
    return dict(_cache)


def site_shape(site) -> Optional[SiteShape]:
    """The timing key of a 2-D site with concrete dims, else None (symbolic or batched)."""
    m, k, n = site.shape
    if site.batch is not None or not all(isinstance(d, int) for d in (m, k, n)):
        return None
    return SiteShape(m, k, n, site.a_major, site.b_major, site.op == "addmm", site.dtype, site.device)
