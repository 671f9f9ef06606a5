"""The `gemm_epilogue` Mod at LRM shapes: a GEMM whose output, through an activation, is
the next GEMM's A with a calibrated static scale.

    python -m benchmarks.gemm_epilogue --out benchmarks/results

Per shape (M x K x N of the producing GEMM; rowwise e4m3 operands, bias, relu) and
accumulation (precise, and fast as calibrated plans choose it), device
time under CUDA graphs (`loka_compile.speed._time_calls_us`: median of 5 runs of 10 calls)
on fresh random operands:

- bf16: Inductor-compiled addmm + relu (the high-precision site);
- unfused: the provider GEMM (`_scaled_mm` rowwise, bf16 out) then Inductor's compiled
  relu + static cast (`scaled_gemm.quantize_static`), one pointwise kernel: what loka runs
  with the Mod off;
- fused: loka's Triton GEMM writing relu(out) in FP8 with the static scale (the Mod);
- model: what the speed check charges for the unfused form (`speed.epilogue_timing`:
  the GEMM plus a converting copy of its output), to check that its verdict follows the
  measured one.

Writes <out>/<date>_<device>_gemm_epilogue.json and .md (`benchmarks.kernels.write_bench`; torch and
triton versions in both).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from tabulate import tabulate

SHAPES = [  # (M, K, N): MLP layers of the zoo's paper presets at serving batches
    (8192, 512, 512), (8192, 1024, 1024), (8192, 2048, 1024), (8192, 8192, 1024), (8192, 1024, 3456),
    (65536, 512, 256), (65536, 1024, 1024), (65536, 8192, 1024),
]


def measure(m: int, k: int, n: int, device: torch.device, fast_accum: bool) -> dict:
    from loka_compile import speed
    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import GemmSpec, gemm_quantized, gemm_to_next_operand, quantize_static

    e4m3 = Fp8Format.E4M3
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    a_q, a_s = torch.ops.loka.quantize_operand(a, "a", "rowwise", "e4m3")
    b_q, b_s = torch.ops.loka.quantize_operand(w.t(), "b", "rowwise", "e4m3")
    spec = GemmSpec(Scaling.ROWWISE, e4m3, e4m3, "scaled_mm_rowwise", torch.bfloat16, fast_accum=fast_accum)
    out = gemm_quantized(a_q, a_s, b_q, b_s, bias, spec)
    scale = float(torch.relu(out).abs().amax().float()) / e4m3.max

    bf16 = torch.compile(lambda x: torch.relu(torch.addmm(bias, x, w.t())))
    pointwise = torch.compile(lambda c: quantize_static(torch.relu(c), scale, Scaling.ROWWISE, e4m3)[0])
    fused_spec = GemmSpec(Scaling.ROWWISE, e4m3, e4m3, "triton", torch.bfloat16, fast_accum=fast_accum)
    # agreement of the two forms' FP8 operands (codes differ only at rounding boundaries)
    scale_constant = torch.full((1,), scale, device=device)  # the Mod's graph constant
    fused_q = gemm_to_next_operand(a_q, a_s, b_q, b_s, bias, None, "relu", fused_spec, e4m3, scale_constant)
    unfused_q = pointwise(out)
    differ = float((fused_q.float() != unfused_q.float()).float().mean())

    row = {"m": m, "k": k, "n": n, "fast_accum": fast_accum, "fp8_codes_differ": differ}
    row["bf16_us"] = speed._time_calls_us(lambda: bf16(a), device)
    row["gemm_us"] = speed._time_calls_us(lambda: gemm_quantized(a_q, a_s, b_q, b_s, bias, spec), device)
    row["pointwise_us"] = speed._time_calls_us(lambda: pointwise(out), device)
    row["unfused_us"] = row["gemm_us"] + row["pointwise_us"]
    row["fused_us"] = speed._time_calls_us(
        lambda: gemm_to_next_operand(a_q, a_s, b_q, b_s, bias, None, "relu", fused_spec, e4m3, scale_constant),
        device)
    shape = speed.SiteShape(m, k, n, "row", "column", True, torch.bfloat16, device)
    model = speed.epilogue_timing(shape, "rowwise", "e4m3", "e4m3", "scaled_mm_rowwise", fast_accum, "relu", False,
                                  "e4m3")
    row.update(model_fused_us=model.fused_us, model_unfused_us=model.unfused_us, model_pays=model.pays,
               measured_pays=row["fused_us"] < row["unfused_us"],
               fused_vs_unfused=row["unfused_us"] / row["fused_us"], fused_vs_bf16=row["bf16_us"] / row["fused_us"])
    return row


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gemm_epilogue", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    import loka_compile  # noqa: F401  (registers the ops and providers)
    from benchmarks.kernels import environment, write_bench

    device = torch.device("cuda")
    rows = [measure(*shape, device, fast_accum) for fast_accum in (False, True) for shape in SHAPES]
    env = environment()
    table = tabulate([[f"{r['m']}x{r['k']}x{r['n']}", "fast" if r["fast_accum"] else "precise", r["bf16_us"],
                       r["gemm_us"], r["pointwise_us"], r["unfused_us"], r["fused_us"], r["fused_vs_unfused"],
                       r["fused_vs_bf16"], r["model_unfused_us"],
                       "yes" if r["model_pays"] else "no", "yes" if r["measured_pays"] else "no",
                       f"{100 * r['fp8_codes_differ']:.2f}%"] for r in rows],
                     headers=["M x K x N", "accumulation", "bf16 us", "_scaled_mm us", "relu+cast us", "unfused us",
                              "fused us", "fused speedup", "vs bf16", "model unfused us", "model: fuse", "measured: fuse",
                              "codes differ"], floatfmt=".2f")
    geo = {mode: statistics.geometric_mean(r["fused_vs_unfused"] for r in rows if r["fast_accum"] == (mode == "fast"))
           for mode in ("precise", "fast")}
    text = (f"# gemm_epilogue: GEMM + bias + relu + the next GEMM's static FP8 cast\n\n{env}\n\n"
            f"Device time per call, CUDA graphs, median of 5 runs of 10 calls.\n\n{table}\n\n"
            f"Geometric mean fused / unfused speedup: precise {geo['precise']:.3f}x, fast {geo['fast']:.3f}x\n")
    print(text)
    return write_bench(args.out, args.name, "gemm_epilogue", env, rows, text)


if __name__ == "__main__":
    main()
