"""Kernel benchmarks on one GPU: loka's kernels against the libraries they compete with.

    python -m benchmarks.kernels [--only gemm,...] [--out-dir DIR] [--shapes quick|lrm]

Each section is a function `section(ctx) -> list[dict]` registered in `SECTIONS`; every
row carries its section's name. Results go to `<out-dir>/<date>_<device>_kernels_<sections>.json`
(`{"env": {...}, "rows": [...]}`) and a markdown table beside it. Times are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed before each run) on fresh random
inputs; ratios compare kernels timed in the same run.

Sections:
- gemm: Triton FP8 GEMM (tensorwise, rowwise, blockwise; precise and fast accumulation)
  vs `torch._scaled_mm` with the same scaling and vs bf16 `torch.mm`; GEMM + bias + relu
  fused in the epilogue vs `_scaled_mm` followed by the same epilogue compiled by
  Inductor; the autotuner's timing of every candidate config; host launch overhead.
- site: a loka GEMM site as `torch.ops.loka.fp8_gemm` runs it (operand casts + GEMM) for
  the forward, grad-input and grad-weight layouts, against the bf16 GEMM it replaces;
  reference casts vs fused Triton casts vs the GEMM alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from loka_compile.kernels.metrics import sqnr_db

# M, K, N: the LRM shapes of ANCHORS.md, 8192^3 first (a run cut short by --max-seconds
# still has the largest shape).
LRM_SHAPES = [
    (8192, 8192, 8192),
    (2048, 256, 256), (2048, 512, 512), (2048, 1024, 1024), (2048, 2048, 2048), (2048, 4096, 4096),
    (2048, 1024, 4096), (2048, 4096, 1024),
    (8192, 256, 256), (8192, 512, 512), (8192, 1024, 1024), (8192, 2048, 2048), (8192, 4096, 4096),
    (8192, 1024, 4096), (8192, 4096, 1024),
    (32768, 256, 256), (32768, 512, 512), (32768, 1024, 1024), (32768, 2048, 2048), (32768, 4096, 4096),
    (32768, 1024, 4096), (32768, 4096, 1024),
]
QUICK_SHAPES = [(2048, 256, 256), (8192, 1024, 1024), (8192, 4096, 4096), (8192, 8192, 8192)]


@dataclasses.dataclass
class Context:
    shapes: list
    deadline: float  # time.monotonic() after which sections stop adding shapes
    warmup_ms: int = 10
    rep_ms: int = 50

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


def bench_us(fn: Callable[[], object], ctx: Context) -> float:
    import triton.testing
    return 1e3 * triton.testing.do_bench(fn, warmup=ctx.warmup_ms, rep=ctx.rep_ms, return_mode="median")


def bench_graph_us(fn: Callable[[], object], ctx: Context) -> float:
    """Median per call inside a CUDA graph: device time without host launch overhead (what
    `mode="reduce-overhead"` gives). No L2 flush: small operands stay in L2 for every kernel."""
    import triton.testing
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=ctx.rep_ms, return_mode="median")


def tflops(m: int, k: int, n: int, us: float) -> float:
    return 2.0 * m * k * n / (us * 1e-6) / 1e12


def _r(x, digits=2):
    return None if x is None else round(float(x), digits)


# ---------------------------------------------------------------------------------------
# gemm
# ---------------------------------------------------------------------------------------

def _blockwise_scaled_mm(a_q, a_s, b_q, b_s, ref):
    """`_scaled_mm` with 1x128 / 128x128 scales, trying the scale layouts cuBLASLt may want
    (as given, or outer-dimension-major). Returns (callable, layout note) or (None, error)."""
    def outer_major(s):
        return s.t().contiguous().t()

    last_error = "no layout tried"
    for note, sa, sb in (("as given", a_s, b_s), ("A scale M-major", outer_major(a_s), b_s),
                         ("both outer-major", outer_major(a_s), outer_major(b_s))):
        def call(sa=sa, sb=sb):
            return torch._scaled_mm(a_q, b_q, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (record why this library path is missing)
            last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
        db = sqnr_db(ref, out)
        if db >= 30:
            return call, note
        last_error = f"scales {note}: SQNR {db:.1f} dB (wrong layout)"
    return None, last_error


def _compiled_scaled_mm_epilogue():
    import torch._dynamo
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)

    def scaled_mm_bias_relu(a, b, sa, sb, bias, fast):
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        return torch.relu(out + bias)

    return torch.compile(scaled_mm_bias_relu, dynamic=False)


def gemm_section(ctx: Context) -> list:
    from loka_compile.kernels import triton_gemm as tg
    from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_operands

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    rows = []
    compiled_epilogue = _compiled_scaled_mm_epilogue()
    for (m, k, n) in ctx.shapes:
        if ctx.out_of_time():
            print(f"gemm: out of time before {m}x{k}x{n}", flush=True)
            break
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        bf16_us = bench_us(lambda: torch.mm(a, w.t()), ctx)
        bf16_graph_us = bench_graph_us(lambda: torch.mm(a, w.t()), ctx)
        for scaling in (Scaling.TENSORWISE, Scaling.ROWWISE, Scaling.BLOCKWISE):
            a_q, a_s, b_q, b_s = quantize_operands(a, w.t(), scaling, Fp8Format.E4M3, Fp8Format.E4M3)
            b_q = b_q.t().contiguous().t()  # W^T: column-major, as a Linear's weight gives it
            ref = tg.reference_fp8_gemm(a_q, a_s, b_q, b_s, scaling, out_dtype=torch.float32,
                                        compute_dtype=torch.float32)
            if scaling is Scaling.BLOCKWISE:
                lib_call, lib_note = _blockwise_scaled_mm(a_q, a_s, b_q, b_s, ref)
            else:
                def lib_call(fast=False):
                    return torch._scaled_mm(a_q, b_q, scale_a=a_s, scale_b=b_s, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                lib_note = ""
            for fast in ((False, True) if scaling is not Scaling.BLOCKWISE else (False,)):
                row = dict(section="gemm", kind="gemm", M=m, K=k, N=n, scaling=scaling.value,
                           accum="fast" if fast else "precise", bf16_us=_r(bf16_us), bf16_graph_us=_r(bf16_graph_us),
                           scaled_mm_note=lib_note)
                try:
                    def ours(fast=fast):
                        return torch.ops.loka.triton_fp8_gemm(a_q, a_s, b_q, b_s, scaling.value, None, None,
                                                              "none", torch.bfloat16, fast)
                    out = ours()
                    row["triton_config"] = str(tg.last_launch_config())
                    row["triton_sqnr_db"] = _r(sqnr_db(ref, out), 1)
                    row["triton_us"] = _r(bench_us(ours, ctx))
                    row["triton_graph_us"] = _r(bench_graph_us(ours, ctx))
                    # The first call of this key tuned: every candidate's median, the evidence for TMA_CONFIGS.
                    row["autotune_us"] = {str(c): _r(1e3 * t[0]) for c, t in
                                          getattr(tg._tma_kernel_tuned, "configs_timings", {}).items()}
                except Exception as e:  # noqa: BLE001
                    row["triton_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if lib_call is not None:
                    lib = (lambda: lib_call(fast)) if scaling is not Scaling.BLOCKWISE else lib_call
                    try:
                        row["scaled_mm_sqnr_db"] = _r(sqnr_db(ref, lib()), 1)
                        row["scaled_mm_us"] = _r(bench_us(lib, ctx))
                        row["scaled_mm_graph_us"] = _r(bench_graph_us(lib, ctx))
                    except Exception as e:  # noqa: BLE001
                        row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if row.get("triton_us") and row.get("scaled_mm_us"):
                    row["triton_vs_scaled_mm"] = _r(row["scaled_mm_us"] / row["triton_us"], 3)
                if row.get("triton_graph_us") and row.get("scaled_mm_graph_us"):
                    row["triton_vs_scaled_mm_graph"] = _r(row["scaled_mm_graph_us"] / row["triton_graph_us"], 3)
                    row["triton_vs_bf16_graph"] = _r(bf16_graph_us / row["triton_graph_us"], 3)
                if row.get("triton_us"):
                    row["triton_vs_bf16"] = _r(bf16_us / row["triton_us"], 3)
                    row["triton_tflops"] = _r(tflops(m, k, n, row["triton_us"]), 1)
                if row.get("scaled_mm_us"):
                    row["scaled_mm_tflops"] = _r(tflops(m, k, n, row["scaled_mm_us"]), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)

            if scaling is Scaling.ROWWISE:
                rows.extend(_pointer_and_epilogue_rows(ctx, tg, m, k, n, a_q, a_s, b_q, b_s, bias, ref,
                                                       compiled_epilogue, bf16_us))
        rows.extend(_wgrad_layout_rows(ctx, tg, m, k, n, a, w))
    rows.extend(_host_overhead_rows(tg))
    return rows


def _pointer_and_epilogue_rows(ctx, tg, m, k, n, a_q, a_s, b_q, b_s, bias, ref, compiled_epilogue, bf16_us):
    rows = []
    # The pointer kernel (sm89 / misaligned fallback) on the same operands.
    row = dict(section="gemm", kind="pointer_kernel", M=m, K=k, N=n, scaling="rowwise", accum="precise")
    try:
        def ptr():
            return tg.fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", impl="pointer")
        row["triton_sqnr_db"] = _r(sqnr_db(ref, ptr()), 1)
        row["triton_config"] = str(tg.last_launch_config())
        row["triton_us"] = _r(bench_us(ptr, ctx))
        row["triton_tflops"] = _r(tflops(m, k, n, row["triton_us"]), 1)
    except Exception as e:  # noqa: BLE001
        row["triton_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rows.append(row)
    print(json.dumps(row), flush=True)

    # GEMM + bias + relu: fused epilogue vs _scaled_mm then Inductor's pointwise kernel,
    # with the same accumulation on both sides.
    ref_epi = torch.relu(ref + bias.float())
    for fast in (False, True):
        row = dict(section="gemm", kind="epilogue_bias_relu", M=m, K=k, N=n, scaling="rowwise",
                   accum="fast" if fast else "precise", bf16_us=_r(bf16_us))
        try:
            def fused(fast=fast):
                return torch.ops.loka.triton_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", bias, None, "relu",
                                                      torch.bfloat16, fast)
            row["triton_sqnr_db"] = _r(sqnr_db(ref_epi, fused()), 1)
            row["triton_config"] = str(tg.last_launch_config())
            row["triton_us"] = _r(bench_us(fused, ctx))
            row["triton_graph_us"] = _r(bench_graph_us(fused, ctx))
        except Exception as e:  # noqa: BLE001
            row["triton_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            def unfused(fast=fast):
                return compiled_epilogue(a_q, b_q, a_s, b_s, bias, fast)
            row["scaled_mm_sqnr_db"] = _r(sqnr_db(ref_epi, unfused()), 1)
            row["scaled_mm_us"] = _r(bench_us(unfused, ctx))
            row["scaled_mm_graph_us"] = _r(bench_graph_us(unfused, ctx))
        except Exception as e:  # noqa: BLE001
            row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if row.get("triton_us") and row.get("scaled_mm_us"):
            row["triton_vs_scaled_mm"] = _r(row["scaled_mm_us"] / row["triton_us"], 3)
            row["triton_vs_bf16"] = _r(bf16_us / row["triton_us"], 3)
        if row.get("triton_graph_us") and row.get("scaled_mm_graph_us"):
            row["triton_vs_scaled_mm_graph"] = _r(row["scaled_mm_graph_us"] / row["triton_graph_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _wgrad_layout_rows(ctx, tg, m, k, n, a, w):
    """Grad-weight GEMM dW[N, K] = dY^T[N, M] @ X[M, K]: A is a transposed view (column-major),
    B row-major; no copies. Only at a few shapes (the layout costs the same everywhere)."""
    if (m, k, n) not in ((8192, 1024, 1024), (8192, 4096, 4096)):
        return []
    from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_operands
    grad_out = torch.randn(m, n, device=a.device, dtype=torch.bfloat16)
    # Scales along the GEMM's K (= the batch M here), as a wgrad recipe would quantize them.
    # e4m3 on both sides so that cuBLASLt's rowwise path can run the same product.
    g_q, g_s, x_q, x_s = quantize_operands(grad_out.t(), a, Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3)
    g_q = g_q.t().contiguous().t()  # dY^T as a view of a row-major dY
    row = dict(section="gemm", kind="wgrad_layout", M=n, K=m, N=k, scaling="rowwise", accum="precise",
               a_layout="column-major view" if g_q.stride(0) == 1 else "row-major",
               b_layout="row-major" if x_q.stride(1) == 1 else "column-major")
    ref = tg.reference_fp8_gemm(g_q, g_s, x_q, x_s, "rowwise", out_dtype=torch.float32, compute_dtype=torch.float32)
    try:
        def ours():
            return torch.ops.loka.triton_fp8_gemm(g_q, g_s, x_q, x_s, "rowwise")
        row["triton_sqnr_db"] = _r(sqnr_db(ref, ours()), 1)
        row["triton_config"] = str(tg.last_launch_config())
        row["triton_us"] = _r(bench_us(ours, ctx))
        row["triton_tflops"] = _r(tflops(n, m, k, row["triton_us"]), 1)
    except Exception as e:  # noqa: BLE001
        row["triton_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        # cuBLASLt needs A row-major and B column-major: the copies are part of its cost here.
        def lib():
            return torch._scaled_mm(g_q.contiguous(), x_q.t().contiguous().t(), scale_a=g_s, scale_b=x_s,
                                    out_dtype=torch.bfloat16)
        row["scaled_mm_note"] = "includes the two layout copies cuBLASLt needs"
        row["scaled_mm_us"] = _r(bench_us(lib, ctx))
    except Exception as e:  # noqa: BLE001
        row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if row.get("triton_us") and row.get("scaled_mm_us"):
        row["triton_vs_scaled_mm"] = _r(row["scaled_mm_us"] / row["triton_us"], 3)
    rows = [row]
    print(json.dumps(row), flush=True)
    return rows


def _host_overhead_rows(tg):
    """Host time per call when nothing waits on the GPU (what a step without CUDA graphs pays)."""
    from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_operands
    a = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    a_q, a_s, b_q, b_s = quantize_operands(a, w.t(), Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3)
    b_q = b_q.t().contiguous().t()
    calls = {
        "loka::triton_fp8_gemm op": lambda: torch.ops.loka.triton_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise"),
        "triton_gemm.fp8_gemm launcher": lambda: tg.fp8_gemm(a_q, a_s, b_q, b_s, "rowwise"),
        "torch._scaled_mm": lambda: torch._scaled_mm(a_q, b_q, scale_a=a_s, scale_b=b_s, out_dtype=torch.bfloat16),
    }
    rows = []
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        host_us = (time.perf_counter() - start) / 500 * 1e6
        torch.cuda.synchronize()
        rows.append(dict(section="gemm", kind="host_overhead", call=name, M=2048, K=256, N=256,
                         host_us_per_call=_r(host_us, 1)))
        print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("LOKA_PROFILE_HOST") == "1":
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            calls["loka::triton_fp8_gemm op"]()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return rows


EXPLORE_SHAPES = [(8192, 8192, 8192), (8192, 4096, 4096), (32768, 2048, 2048), (2048, 256, 256), (8192, 1024, 1024)]


def gemm_explore_section(ctx: Context) -> list:
    """Fixed tile configs x accumulation modes, rowwise, for choosing the defaults: every
    candidate's median time and SQNR (the evidence behind TMA_CONFIGS and PRECISE_ACCUM)."""
    from loka_compile.kernels import triton_gemm as tg
    from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_operands
    G = tg.GemmConfig
    candidates = [
        G(128, 128, 128, 8, 4, ctas_per_sm=1, flatten=True),
        G(128, 128, 128, 8, 4, ctas_per_sm=1),
        G(128, 128, 256, 8, 3, ctas_per_sm=1, flatten=True),
        G(64, 128, 128, 4, 3),   # 88 KB: two CTAs per SM, one's promotion overlaps the other's MMA
        G(128, 64, 128, 4, 3),
        G(64, 128, 128, 4, 3, ctas_per_sm=2),
        G(64, 64, 128, 4, 4),
        G(64, 64, 64, 4, 6),
        G(128, 256, 128, 8, 3, ctas_per_sm=1, epilogue_subtile=True, flatten=True),
    ]
    rows = []
    for (m, k, n) in EXPLORE_SHAPES:
        if ctx.out_of_time():
            break
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a_q, a_s, b_q, b_s = quantize_operands(a, w.t(), Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3)
        b_q = b_q.t().contiguous().t()
        ref = tg.reference_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", out_dtype=torch.float32, compute_dtype=torch.float32)
        for fast in (False, True):
            smm = lambda fast=fast: torch._scaled_mm(a_q, b_q, scale_a=a_s, scale_b=b_s, out_dtype=torch.bfloat16,
                                                     use_fast_accum=fast)
            rows.append(dict(section="gemm_explore", M=m, K=k, N=n, kernel="_scaled_mm",
                             accum_mode="fast" if fast else "cublas_precise", us=_r(bench_us(smm, ctx)),
                             graph_us=_r(bench_graph_us(smm, ctx))))
            print(json.dumps(rows[-1]), flush=True)
        for cfg in candidates:
            for mode in sorted(tg.ACCUM_MODES):
                if cfg.block_m * cfg.block_n > 128 * 128 and mode != "fast":
                    continue
                row = dict(section="gemm_explore", M=m, K=k, N=n, kernel="triton_tma", accum_mode=mode,
                           config=str(cfg))
                try:
                    def ours(cfg=cfg, mode=mode):
                        return tg.fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", impl="tma", config=cfg, accum_mode=mode)
                    row["sqnr_db"] = _r(sqnr_db(ref, ours()), 1)
                    row["us"] = _r(bench_us(ours, ctx))
                    row["graph_us"] = _r(bench_graph_us(ours, ctx))
                    row["tflops"] = _r(tflops(m, k, n, row["graph_us"]), 1)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def explore_table(rows: list) -> str:
    from tabulate import tabulate
    table = [[f'{r["M"]}x{r["K"]}x{r["N"]}', r["kernel"], r["accum_mode"], r.get("config", ""), r.get("us"),
              r.get("graph_us"), r.get("tflops"), r.get("sqnr_db"), r.get("error", "")] for r in rows]
    return "### Tile configs x accumulation modes (rowwise)\n\n" + tabulate(
        table, headers=["MxKxN", "kernel", "accum", "config", "us", "graph us", "TFLOP/s (graph)", "SQNR dB", "error"],
        tablefmt="github")


# ---- a loka site as fp8_gemm runs it: casts + GEMM ---------------------------------------

# The three roles' operand layouts for a Linear y = x W^T + b with x [M, K], W [N, K]:
# forward x @ W^T; grad-input dY [M, N] @ W; grad-weight dY^T [N, M] @ x (A column-major).
SITE_ROLES = ("forward", "grad_input", "grad_weight")


def _site_operands(role, m, k, n):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    if role == "forward":
        return x, w.t(), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return (dy, w, None) if role == "grad_input" else (dy.t(), x, None)


def site_section(ctx: Context) -> list:
    """`torch.ops.loka.fp8_gemm` (rowwise e4m3, `scaled_mm_rowwise`) against the bf16 GEMM it
    replaces, per role: with the PyTorch reference casts (loka before the fused casts) and
    with the fused Triton casts, plus `_scaled_mm` on operands cast beforehand (the bound a
    cast fused into the producer approaches). Plain timings include each call's host work,
    as a step without CUDA graphs pays it; graph timings do not."""
    from loka_compile.kernels import providers
    from loka_compile.kernels.gemm_operands import quantize_gemm_operands
    from loka_compile.kernels.quantize import Fp8Format, Scaling
    e4m3, rowwise, provider = Fp8Format.E4M3, Scaling.ROWWISE, providers.get("scaled_mm_rowwise")
    rows = []
    for (m, k, n) in ctx.shapes:
        if ctx.out_of_time():
            break
        for role in SITE_ROLES:
            # GEMM dims as the op sees them: forward M x K x N; grad-input M x N x K;
            # grad-weight N x M x K.
            a, b, bias = _site_operands(role, m, k, n)
            ref = (a.double() @ b.double()) + (0 if bias is None else bias.double())
            casts = {
                "reference_casts": lambda a=a, b=b: quantize_gemm_operands(a, b, rowwise, e4m3, e4m3, use_triton=False),
                "fused_casts": lambda a=a, b=b: quantize_gemm_operands(a, b, rowwise, e4m3, e4m3),
            }
            pre = casts["fused_casts"]()
            calls = {
                "bf16": (lambda a=a, b=b, bias=bias: torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)),
                "reference_casts": lambda a=a, b=b, bias=bias: provider.gemm(*casts["reference_casts"](a, b), bias,
                                                                             torch.bfloat16),
                "fused_casts": lambda a=a, b=b, bias=bias: torch.ops.loka.fp8_gemm(
                    a, b, bias, "rowwise", "e4m3", "e4m3", "scaled_mm_rowwise", ""),
                "gemm_only": lambda pre=pre, bias=bias: provider.gemm(*pre, bias, torch.bfloat16),
            }
            row = dict(section="site", role=role, M=a.shape[0], K=a.shape[1], N=b.shape[1], linear=[m, k, n])
            try:
                for name, fn in calls.items():
                    row[f"{name}_us"] = _r(bench_us(fn, ctx), 1)
                    row[f"{name}_graph_us"] = _r(bench_graph_us(fn, ctx), 1)
                    if name != "bf16":
                        row[f"{name}_sqnr_db"] = _r(sqnr_db(ref, fn().double()), 1)
                for name in ("reference_casts", "fused_casts", "gemm_only"):
                    row[f"{name}_vs_bf16"] = _r(row["bf16_us"] / row[f"{name}_us"], 3)
                    row[f"{name}_vs_bf16_graph"] = _r(row["bf16_graph_us"] / row[f"{name}_graph_us"], 3)
            except Exception as e:  # noqa: BLE001  (a failing shape is a result, not an abort)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def site_table(rows: list) -> str:
    from tabulate import tabulate
    table = [[r["role"], r["M"], r["K"], r["N"], r.get("bf16_graph_us"), r.get("reference_casts_graph_us"),
              r.get("fused_casts_graph_us"), r.get("gemm_only_graph_us"), r.get("reference_casts_vs_bf16_graph"),
              r.get("fused_casts_vs_bf16_graph"), r.get("gemm_only_vs_bf16_graph"), r.get("fused_casts_vs_bf16"),
              r.get("fused_casts_sqnr_db"), r.get("error", "")] for r in rows]
    return ("### loka site (rowwise e4m3 on `scaled_mm_rowwise`): casts + GEMM vs the bf16 GEMM, CUDA-graph medians\n\n"
            + tabulate(table, headers=["role", "M", "K", "N", "bf16 us", "reference casts us", "fused casts us",
                                       "GEMM only us", "ref. casts vs bf16 (x)", "fused casts vs bf16 (x)",
                                       "GEMM only vs bf16 (x)", "fused vs bf16, no graph (x)", "SQNR dB", "note"],
                       tablefmt="github"))


SECTIONS: dict[str, Callable[[Context], list]] = {
    "gemm": gemm_section,
    "gemm_explore": gemm_explore_section,
    "site": site_section,
}


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------

def device_tag(name: str) -> str:
    found = re.search(r"(GB200|B200|H200|H100|H20|A100|L40S|L4|MI300X|MI350X)", name)
    return found.group(1) if found else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def environment() -> dict:
    import triton
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(device=name, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(),
                capability=".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else None)


def gemm_table(rows: list) -> str:
    from tabulate import tabulate
    parts = []
    main = [r for r in rows if r.get("kind") == "gemm"]
    for accum in ("precise", "fast"):
        table = [[r["M"], r["K"], r["N"], r["scaling"], r.get("bf16_us"), r.get("scaled_mm_us"), r.get("triton_us"),
                  r.get("triton_vs_scaled_mm"), r.get("triton_vs_bf16"), r.get("scaled_mm_graph_us"),
                  r.get("triton_graph_us"), r.get("triton_vs_scaled_mm_graph"), r.get("triton_vs_bf16_graph"),
                  r.get("scaled_mm_tflops"),
                  r.get("triton_tflops"), r.get("triton_sqnr_db"), r.get("scaled_mm_sqnr_db"),
                  r.get("triton_error") or r.get("scaled_mm_error") or r.get("scaled_mm_note") or ""]
                 for r in main if r["accum"] == accum]
        if table:
            parts.append(f"### FP8 GEMM, {accum} accumulation (W^T column-major, bf16 out)\n\n" + tabulate(
                table, headers=["M", "K", "N", "scaling", "bf16 us", "_scaled_mm us", "triton us",
                                "triton vs _scaled_mm (x)", "triton vs bf16 (x)", "graph: _scaled_mm us",
                                "graph: triton us", "graph: triton vs _scaled_mm (x)", "graph: triton vs bf16 (x)",
                                "_scaled_mm TFLOP/s",
                                "triton TFLOP/s", "triton SQNR dB", "_scaled_mm SQNR dB", "note"],
                tablefmt="github"))
    epi = [[r["M"], r["K"], r["N"], r["accum"], r.get("scaled_mm_us"), r.get("triton_us"), r.get("triton_vs_scaled_mm"),
            r.get("scaled_mm_graph_us"), r.get("triton_graph_us"), r.get("triton_vs_scaled_mm_graph"),
            r.get("triton_vs_bf16"), r.get("triton_sqnr_db"), r.get("triton_error") or r.get("scaled_mm_error") or ""]
           for r in rows if r.get("kind") == "epilogue_bias_relu"]
    if epi:
        parts.append("### GEMM + bias + relu, rowwise: fused epilogue vs `_scaled_mm` + Inductor epilogue\n\n" + tabulate(
            epi, headers=["M", "K", "N", "accumulation", "_scaled_mm + Inductor us", "triton fused us", "triton vs that (x)",
                          "graph: _scaled_mm + Inductor us", "graph: triton fused us", "graph: triton vs that (x)",
                          "triton vs bf16 mm alone (x)", "triton SQNR dB", "note"], tablefmt="github"))
    ptr = [[r["M"], r["K"], r["N"], r.get("triton_us"), r.get("triton_tflops"), r.get("triton_config"),
            r.get("triton_error", "")] for r in rows if r.get("kind") == "pointer_kernel"]
    if ptr:
        parts.append("### Pointer-load kernel (sm89 / misaligned fallback), rowwise\n\n" + tabulate(
            ptr, headers=["M", "K", "N", "us", "TFLOP/s", "config", "note"], tablefmt="github"))
    wg = [[r["M"], r["K"], r["N"], r.get("a_layout"), r.get("triton_us"), r.get("scaled_mm_us"),
           r.get("triton_vs_scaled_mm"), r.get("triton_sqnr_db"), r.get("triton_error", "")]
          for r in rows if r.get("kind") == "wgrad_layout"]
    if wg:
        parts.append("### Grad-weight layout (A = dY^T view, B row-major), rowwise; _scaled_mm includes its copies\n\n"
                     + tabulate(wg, headers=["M", "K", "N", "A layout", "triton us", "_scaled_mm+copies us",
                                             "ratio (x)", "SQNR dB", "note"], tablefmt="github"))
    host = [[r["call"], r["host_us_per_call"]] for r in rows if r.get("kind") == "host_overhead"]
    if host:
        parts.append("### Host time per call (2048x256x256, GPU not waited on)\n\n" + tabulate(
            host, headers=["call", "us"], tablefmt="github"))
    return "\n\n".join(parts)


def gemm_summary(rows: list) -> str:
    """One narrow line per shape and scaling: the ratios that the targets are about."""
    from tabulate import tabulate
    by_key = {}
    for r in rows:
        if r.get("kind") in ("gemm", "epilogue_bias_relu"):
            key = (r["M"], r["K"], r["N"], r["scaling"])
            name = ("epilogue_" if r["kind"] == "epilogue_bias_relu" else "") + r["accum"]
            by_key.setdefault(key, {})[name] = r
    table = []
    for (m, k, n, scaling), d in by_key.items():
        p, f, e = d.get("precise", {}), d.get("fast", {}), d.get("epilogue_precise", {})
        ef = d.get("epilogue_fast", {})
        table.append([f"{m}x{k}x{n}", scaling[:4], p.get("triton_us"), p.get("scaled_mm_us"), p.get("triton_vs_scaled_mm"),
                      p.get("triton_vs_scaled_mm_graph"), f.get("triton_vs_scaled_mm"), f.get("triton_vs_scaled_mm_graph"),
                      p.get("triton_vs_bf16"), e.get("triton_vs_scaled_mm"), e.get("triton_vs_scaled_mm_graph"),
                      ef.get("triton_vs_scaled_mm_graph"),
                      p.get("triton_sqnr_db"), "E" if any("triton_error" in x for x in (p, f, e, ef)) else ""])
    return tabulate(table, headers=["MxKxN", "scal", "tri us", "smm us", "vs smm", "graph", "fast vs smm", "graph",
                                    "vs bf16", "epi vs smm+ind", "graph", "fast epi graph", "dB", "err"],
                    tablefmt="plain")


TABLES = {"gemm": gemm_table, "gemm_explore": explore_table, "site": site_table}
SUMMARIES = {"gemm": gemm_summary}


def write_bench(out_dir, name: Optional[str], kind: str, env: dict, rows: list, text: str) -> Path:
    """A benchmark's <out_dir>/<stem>.json (env and rows) and .md (text), stem `name` or
    <date>_<device>_<kind>; returns the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = name or f"{env['date']}_{device_tag(env['device'])}_{kind}"
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(text)
    return out / f"{stem}.json"


def write_results(out_dir: str, sections: list, env: dict, rows: list) -> str:
    os.makedirs(out_dir, exist_ok=True)
    stem = f"{env['date']}_{device_tag(env['device'])}_kernels_{'_'.join(sections)}"
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    tables = [TABLES[s]([r for r in rows if r.get("section") == s]) for s in sections if s in TABLES]
    header = (f"# Kernel benchmarks: {', '.join(sections)}\n\n{env['device']}, torch {env['torch']}, "
              f"triton {env['triton']}, {env['date']}. Medians of triton.testing.do_bench; ratios > 1 mean "
              f"loka's kernel is faster.\n\n")
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(header + "\n\n".join(tables) + "\n")
    return os.path.join(out_dir, stem)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    parser.add_argument("--shapes", default="lrm", choices=["lrm", "quick"])
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--max-seconds", type=float, default=1e9,
                        help="stop adding shapes after this long; results so far are written")
    args = parser.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; valid: {list(SECTIONS)}")
    if not torch.cuda.is_available():
        print("kernel benchmarks need a CUDA GPU", file=sys.stderr)
        return 1
    ctx = Context(shapes=LRM_SHAPES if args.shapes == "lrm" else QUICK_SHAPES,
                  deadline=time.monotonic() + args.max_seconds)
    env = environment()
    rows = []
    for name in sections:
        rows.extend(SECTIONS[name](ctx))
        write_results(args.out_dir, sections, env, rows)
    stem = write_results(args.out_dir, sections, env, rows)
    print(f"wrote {stem}.json and .md")
    for name in sections:
        if name in SUMMARIES:
            print(SUMMARIES[name]([r for r in rows if r.get("section") == name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
