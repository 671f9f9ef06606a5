"""FP8 GEMM variants at LRM shapes, GEMM alone on pre-quantized operands: which kernel and
accumulation loka should put in a site's GEMM node.

    python -m benchmarks.gemm_variants --out benchmarks/results

For each shape (M x K x N; A row-major, B column-major, bf16 output): the bf16 `mm`, and
`torch._scaled_mm` with rowwise and tensorwise scales, each with precise and fast
accumulation, and loka's Triton GEMM (rowwise). Medians of CUDA-graph replays
(`loka_compile.speed`), fresh random operands per shape; speedups against the bf16 GEMM of
the same run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

import torch
from tabulate import tabulate

from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.kernels.scaled_gemm import quantize_operand_aten
from loka_compile.speed import _time_calls_us

# MaskNet (paper preset) mask / hidden / top GEMMs, Wukong's FMB MLP, and square sizes.
SHAPES = [(8192, 1728, 3456), (8192, 3456, 1728), (8192, 1728, 1024), (8192, 8192, 1024),
          (8192, 1024, 2048), (8192, 2048, 2048), (8192, 4096, 4096), (32768, 1024, 1024)]


def variants(m: int, k: int, n: int, device) -> dict:
    a = torch.randn(m, k, device=device).to(torch.bfloat16)
    w = torch.randn(n, k, device=device).to(torch.bfloat16)
    b = w.t()
    out = {"bf16": _time_calls_us(lambda: torch.mm(a, b), device)}
    for scaling in (Scaling.ROWWISE, Scaling.TENSORWISE):
        a_q, a_s = quantize_operand_aten(a, "a", scaling, Fp8Format.E4M3)
        b_q, b_s = quantize_operand_aten(b, "b", scaling, Fp8Format.E4M3)
        for fast in (False, True):
            def run(a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s, fast=fast):
                return torch._scaled_mm(a_q, b_q, a_s, b_s, out_dtype=torch.bfloat16, use_fast_accum=fast)
            out[f"scaled_mm_{scaling.value}{'_fast' if fast else ''}"] = _time_calls_us(run, device)
        if scaling is Scaling.ROWWISE:
            out["triton_rowwise"] = _time_calls_us(
                lambda: torch.ops.loka.triton_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise"), device)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for m, k, n in SHAPES:
        times = variants(m, k, n, device)
        rows.append({"m": m, "k": k, "n": n, "us": times,
                     "speedup": {name: times["bf16"] / us for name, us in times.items()}})
    tag = torch.cuda.get_device_name().split()[1] if " " in torch.cuda.get_device_name() else "gpu"
    path = Path(args.out) / f"{_dt.date.today().isoformat()}_{tag}_gemm_variants.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "timing": "median of CUDA-graph replays"}
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    names = list(rows[0]["us"])
    table = [[f"{r['m']}x{r['k']}x{r['n']}", f"{r['us']['bf16']:.1f}"]
             + [f"{r['speedup'][name]:.2f}x" for name in names[1:]] for r in rows]
    print(tabulate(table, headers=["M x K x N", "bf16 us", *names[1:]], tablefmt="github"))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
