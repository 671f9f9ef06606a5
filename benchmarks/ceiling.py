"""The FP8 ceiling of a training step: how much of it is GEMM time, and what FP8 GEMMs alone
could give.

One warm training step (forward + backward, no optimizer step) is profiled with
`torch.profiler`; each kernel's time is classified GEMM or not by its name
(`is_gemm_kernel`), and the GEMM share g of the step's summed kernel time gives the
ceiling (`fp8_ceiling`): the step's speedup if every GEMM ran s times faster and the FP8
casts cost nothing (Amdahl's law),

    ceiling(g, s) = 1 / ((1 - g) + g / s),

reported at s = 1.6 (the FP8 GEMM-only speedup cuBLASLt reaches at LRM sizes on an H100,
ANCHORS.md) and s = 2 (the datasheet ratio of FP8 to bf16 peak FLOP/s).

On CUDA the times are device kernel times (CUPTI, including memcpy/memset); kernels that
overlap on several streams are summed, so the total can exceed the step's wall time. On
CPU there are no device kernels: the times are each profiled op's self CPU time (the
profiler's own step annotation excluded), a host-side stand-in to be read as such.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import torch

__all__ = ["GEMM_SPEEDUPS", "fp8_ceiling", "is_gemm_kernel", "profile_kernels", "summarize_kernels"]

# (report key, GEMM speedup): 1.6x is what FP8 GEMMs reach over bf16 at LRM sizes on an
# H100 (ANCHORS.md, GEMM table: 1.44-1.69x from 8192 x 1024 x 4096 up); 2x is the
# datasheet peak ratio (1979 / 989 dense TFLOP/s).
GEMM_SPEEDUPS = (("ceiling_1p6x", 1.6), ("ceiling_2x", 2.0))

# Substrings (lower case) of library GEMM kernel names:
#   "gemm"/"gemv": cuBLAS (ampere_bf16_s16816gemm_..., sm90_xmma_gemm_..., gemv2T_kernel_val),
#                  CUTLASS (..._s161616gemm_...), loka's Triton _fp8_gemm_*_kernel
#   "xmma":        cuBLAS sm80/sm90 xmma kernels
#   "cublas":      cuBLAS helpers, e.g. cublasLt::splitKreduce_kernel (the split-K reduction
#                  belongs to its GEMM)
#   "cutlass":     CUTLASS kernels (cutlass::Kernel2<...>, cutlass::device_kernel<...gemm...>)
#   "nvjet":       cuBLAS 12.9+ JIT GEMM kernels (nvjet_tst_128x256_...)
#   "matmul":      Triton matmul kernels outside Inductor (matmul_kernel, ...)
_GEMM_MARKERS = ("gemm", "gemv", "xmma", "cublas", "cutlass", "nvjet", "matmul")
# Inductor names a kernel after the ATen ops it came from. Template kernels (triton_tem_)
# are its GEMM templates (mm, addmm, bmm, _scaled_mm) unless they are flex attention or
# convolution. Pointwise/reduction kernels (triton_poi_/triton_red_/triton_per_) are never
# GEMMs even when named after one: `triton_poi_fused_addmm_relu_0` is the bias add + ReLU
# left over when Inductor calls cuBLAS for an addmm's product.
_TEMPLATE_NOT_GEMM = ("flex", "conv")
# ATen ops (the CPU profile's names) that are GEMMs.
_ATEN_GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm",
                         "_int_mm", "_grouped_mm", "_scaled_grouped_mm", "mkldnn_linear"})
_ATEN_NAME = re.compile(r"^(?:aten|mkldnn)::([a-z0-9_]+)")


def is_gemm_kernel(name: str) -> bool:
    """Whether a profiled kernel (or, on CPU, ATen op) named `name` is a GEMM: cuBLAS,
    cuBLASLt, CUTLASS, nvjet and other library GEMM kernels, Inductor's Triton mm
    templates (`triton_tem_fused_mm_0`, `triton_tem_fused_addmm_relu_1`), and the ATen GEMM
    ops (`aten::mm`, `aten::addmm`, `aten::bmm`, ...). Not a GEMM: Inductor's pointwise and
    reduction kernels, even those named after a GEMM they were fused around
    (`triton_poi_fused_addmm_relu_0`)."""
    low = name.lower()
    m = _ATEN_NAME.match(low)
    if m:
        return m.group(1) in _ATEN_GEMMS
    if low.startswith("triton_tem_"):
        return not any(x in low for x in _TEMPLATE_NOT_GEMM)
    if low.startswith(("triton_poi_", "triton_red_", "triton_per_")):
        return False
    return any(x in low for x in _GEMM_MARKERS)


def fp8_ceiling(gemm_share: float, gemm_speedup: float = 1.6) -> float:
    """Speedup of a step whose GEMMs (a fraction `gemm_share` of its time) run
    `gemm_speedup` times faster while everything else, FP8 casts included, costs what it
    did (casts free):

        ceiling = 1 / ((1 - gemm_share) + gemm_share / gemm_speedup)
    """
    if not 0.0 <= gemm_share <= 1.0:
        raise ValueError(f"gemm_share must be in [0, 1], got {gemm_share}")
    if not gemm_speedup > 0:
        raise ValueError(f"gemm_speedup must be positive, got {gemm_speedup}")
    return 1.0 / ((1.0 - gemm_share) + gemm_share / gemm_speedup)


def summarize_kernels(times: Iterable[tuple[str, float]], source: str, top: int = 10,
                      name_chars: int = 200) -> dict:
    """Aggregate (kernel name, microseconds) pairs by name into the ceiling record: total
    and GEMM milliseconds, GEMM share, the ceilings of GEMM_SPEEDUPS, the largest non-GEMM
    kernel and the `top` kernels by time (each with its GEMM verdict, so a reader can check
    the classification). Names are cut to `name_chars` characters."""
    agg: dict[str, list[float]] = {}
    for name, us in times:
        entry = agg.setdefault(name, [0.0, 0])
        entry[0] += float(us)
        entry[1] += 1
    total_us = sum(us for us, _ in agg.values())
    if not agg or total_us <= 0:
        raise ValueError("no kernel time to summarize")
    cut = lambda n: n if len(n) <= name_chars else n[: name_chars - 3] + "..."
    gemm = {n: is_gemm_kernel(n) for n in agg}
    gemm_us = sum(agg[n][0] for n in agg if gemm[n])
    share = gemm_us / total_us
    ranked = sorted(agg, key=lambda n: -agg[n][0])
    non_gemm = next((n for n in ranked if not gemm[n]), None)
    out = {
        "source": source,
        "total_ms": total_us / 1e3,
        "gemm_ms": gemm_us / 1e3,
        "gemm_share": share,
        **{key: fp8_ceiling(share, s) for key, s in GEMM_SPEEDUPS},
        "largest_non_gemm": None if non_gemm is None else {
            "name": cut(non_gemm), "ms": agg[non_gemm][0] / 1e3, "share": agg[non_gemm][0] / total_us,
            "calls": agg[non_gemm][1]},
        "kernels": len(agg),
        "top_kernels": [{"name": cut(n), "ms": agg[n][0] / 1e3, "share": agg[n][0] / total_us,
                         "calls": agg[n][1], "gemm": gemm[n]} for n in ranked[:top]],
    }
    return out


CUDA_SOURCE = "cuda kernel time (torch.profiler/CUPTI)"
CPU_SOURCE = "CPU op self time (torch.profiler; no device kernels, host-side stand-in)"


def profile_kernels(step: Callable[[], None], cuda: bool) -> tuple[list[tuple[str, float]], str]:
    """Run `step` twice under torch.profiler (the first call is the profiler's warm-up and
    is discarded) and return the second call's (name, microseconds) per device kernel on
    CUDA, or per CPU op (self time) otherwise, and a description of that time source."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    traces: list = []
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1), acc_events=True,
                 on_trace_ready=lambda p: traces.append(p.events())) as prof:
        for _ in range(2):
            step()
            if cuda:
                torch.cuda.synchronize()
            prof.step()
    if not traces:
        raise RuntimeError("the profiler delivered no trace")
    events = traces[-1]
    if cuda:
        times = [(e.name, e.time_range.elapsed_us()) for e in events
                 if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
        if not times:
            raise RuntimeError("the profiler recorded no CUDA kernels (CUPTI unavailable?)")
        return times, CUDA_SOURCE
    times = [(e.name, e.self_cpu_time_total) for e in events
             if e.device_type == DeviceType.CPU and not e.is_async and not e.name.startswith("ProfilerStep")]
    return times, CPU_SOURCE
