"""The `gemm_epilogue` Mod at LRM shapes: a GEMM whose output, through an activation, is
the next GEMM's A with a calibrated static scale; with `--norm`, the `gemm_norm` Mod's
chains (a residual add and a LayerNorm/RMSNorm between the two).

    python -m benchmarks.gemm_epilogue --out benchmarks/results [--norm]

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

With `--norm`, per chain (NORM_CHAINS: HSTU's output projection + residual + LayerNorm,
its pre-norm sum read again; tower layers Linear -> LayerNorm/RMSNorm -> relu): the same
rows, the pointwise kernel being Inductor's compiled residual add + norm (+ activation) +
static cast (and the pre-norm sum's write), the fused kernel `loka::triton_fp8_gemm_norm`.

Writes <out>/<date>_<device>_gemm_epilogue.json and .md (_gemm_norm with `--norm`) (`benchmarks.kernels.write_bench`; torch and
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


# (M, K, N, residual, norm, activation after it, pre-norm sum read again)
NORM_CHAINS = [
    (532480, 256, 256, True, "layer", "none", True),    # HSTU paper: out-proj + x -> LN, batch 8192 x 65
    (65536, 256, 256, True, "layer", "none", True),
    (8192, 512, 256, False, "layer", "relu", False),    # tower layers
    (65536, 1024, 256, False, "layer", "relu", False),
    (65536, 512, 128, False, "rms", "none", False),
]


def measure_norm(m: int, k: int, n: int, residual: bool, norm: str, post: str, write_pre: bool,
                 device: torch.device, fast_accum: bool) -> dict:
    import torch.nn.functional as F

    from loka_compile import speed
    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import GemmSpec, gemm_norm_to_next_operand, gemm_quantized, quantize_static
    from loka_compile.kernels.triton_gemm import apply_activation

    e4m3 = Fp8Format.E4M3
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    res = torch.randn(m, n, device=device, dtype=torch.bfloat16) if residual else None
    ln_w = torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5
    ln_b = torch.randn(n, device=device, dtype=torch.bfloat16) if norm == "layer" else None
    a_q, a_s = torch.ops.loka.quantize_operand(a, "a", "rowwise", "e4m3")
    b_q, b_s = torch.ops.loka.quantize_operand(w.t(), "b", "rowwise", "e4m3")
    spec = GemmSpec(Scaling.ROWWISE, e4m3, e4m3, "scaled_mm_rowwise", torch.bfloat16, fast_accum=fast_accum)
    out = gemm_quantized(a_q, a_s, b_q, b_s, bias, spec)

    def tail(c):
        s = c + res if residual else c
        y = F.layer_norm(s, (n,), ln_w, ln_b) if norm == "layer" else F.rms_norm(s, (n,), ln_w, 1e-5)
        return s, apply_activation(y, post)

    scale = float(tail(out)[1].abs().amax().float()) / e4m3.max
    eps = 1e-5

    def unfused_tail(c):
        s, y = tail(c)
        q = quantize_static(y, scale, Scaling.ROWWISE, e4m3)[0]
        return (q, s) if write_pre else q

    bf16 = torch.compile(lambda x: tail(torch.addmm(bias, x, w.t())))
    pointwise = torch.compile(unfused_tail)
    fused_spec = GemmSpec(Scaling.ROWWISE, e4m3, e4m3, "triton", torch.bfloat16, fast_accum=fast_accum)
    scale_constant = torch.full((1,), scale, device=device)

    def fused():
        return gemm_norm_to_next_operand(a_q, a_s, b_q, b_s, bias, res, "none", norm, ln_w, ln_b, eps, post,
                                         fused_spec, e4m3, scale_constant, write_pre)

    fused_q, unfused_q = fused(), pointwise(out)
    if write_pre:
        fused_q, unfused_q = fused_q[0], unfused_q[0]
    differ = float((fused_q.float() != unfused_q.float()).float().mean())
    row = {"m": m, "k": k, "n": n, "residual": residual, "norm": norm, "post": post, "write_pre": write_pre,
           "fast_accum": fast_accum, "fp8_codes_differ": differ}
    row["bf16_us"] = speed._time_calls_us(lambda: bf16(a), device)
    row["gemm_us"] = speed._time_calls_us(lambda: gemm_quantized(a_q, a_s, b_q, b_s, bias, spec), device)
    row["pointwise_us"] = speed._time_calls_us(lambda: pointwise(out), device)
    row["unfused_us"] = row["gemm_us"] + row["pointwise_us"]
    row["fused_us"] = speed._time_calls_us(fused, device)
    shape = speed.SiteShape(m, k, n, "row", "column", True, torch.bfloat16, device)
    model = speed.epilogue_timing(shape, "rowwise", "e4m3", "e4m3", "scaled_mm_rowwise", fast_accum, "none",
                                  residual, "e4m3", norm=norm, write_pre=write_pre)
    row.update(model_fused_us=model.fused_us, model_unfused_us=model.unfused_us, model_pays=model.pays,
               measured_pays=row["fused_us"] < row["unfused_us"],
               fused_vs_unfused=row["unfused_us"] / row["fused_us"], fused_vs_bf16=row["bf16_us"] / row["fused_us"])
    return row


def _chain_name(r: dict) -> str:
    if "norm" not in r:
        return "relu"
    parts = (["+ residual"] if r["residual"] else []) + [f"{r['norm']} norm"] + (
        [r["post"]] if r["post"] != "none" else []) + (["(pre written)"] if r["write_pre"] else [])
    return " ".join(parts)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gemm_epilogue", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    p.add_argument("--norm", action="store_true", help="time the gemm_norm Mod's chains (NORM_CHAINS)")
    args = p.parse_args(argv)
    import loka_compile  # noqa: F401  (registers the ops and providers)
    from benchmarks.kernels import environment, write_bench

    device = torch.device("cuda")
    if args.norm:
        rows = [measure_norm(*chain, device, fast_accum) for fast_accum in (False, True) for chain in NORM_CHAINS]
    else:
        rows = [measure(*shape, device, fast_accum) for fast_accum in (False, True) for shape in SHAPES]
    env = environment()
    table = tabulate([[f"{r['m']}x{r['k']}x{r['n']}", _chain_name(r), "fast" if r["fast_accum"] else "precise",
                       r["bf16_us"],
                       r["gemm_us"], r["pointwise_us"], r["unfused_us"], r["fused_us"], r["fused_vs_unfused"],
                       r["fused_vs_bf16"], r["model_unfused_us"],
                       "yes" if r["model_pays"] else "no", "yes" if r["measured_pays"] else "no",
                       f"{100 * r['fp8_codes_differ']:.2f}%"] for r in rows],
                     headers=["M x K x N", "epilogue", "accumulation", "bf16 us", "_scaled_mm us", "pointwise us",
                              "unfused us",
                              "fused us", "fused speedup", "vs bf16", "model unfused us", "model: fuse", "measured: fuse",
                              "codes differ"], floatfmt=".2f")
    geo = {mode: statistics.geometric_mean(r["fused_vs_unfused"] for r in rows if r["fast_accum"] == (mode == "fast"))
           for mode in ("precise", "fast")}
    kind = "gemm_norm" if args.norm else "gemm_epilogue"
    what = "GEMM + bias (+ residual) + norm" if args.norm else "GEMM + bias + relu"
    text = (f"# {kind}: {what} + the next GEMM's static FP8 cast\n\n{env}\n\n"
            f"Device time per call, CUDA graphs, median of 5 runs of 10 calls.\n\n{table}\n\n"
            f"Geometric mean fused / unfused speedup: precise {geo['precise']:.3f}x, fast {geo['fast']:.3f}x\n")
    print(text)
    return write_bench(args.out, args.name, kind, env, rows, text)


if __name__ == "__main__":
    main()
