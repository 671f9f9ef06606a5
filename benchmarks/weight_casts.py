"""What a training step pays to cast its weights to FP8, per weight of the zoo's paper presets.

    python -m benchmarks.weight_casts --out benchmarks/results

A linear's weight W [N, K] (bf16) is read in FP8 by its forward GEMM (scales per row n,
the amax along K) and by its dgrad (scales per column k, the amax along N). Per distinct
weight shape of the zoo's 2-D linears, device time under CUDA graphs
(`loka_compile.speed._time_calls_us`: median of 5 runs of 10 back-to-back calls):

- separate: each GEMM's own cast, compiled by Inductor as loka emits it without the
            weight_both_layouts Mod (`scaled_gemm.quantize_operand_aten`): the forward's in
            the forward graph, the dgrad's in the backward graph; two compiled calls
- dual:     `loka.quantize_dual_axis`, what the Mod runs once in the forward (both amaxes
            in one read, both layouts written in the next)

and the sum over each model's weights (times its count), to set against the step time.
Whether both make the same FP8 values is counted here (codes and scales that differ). Writes <out>/<date>_<device>_weight_casts.json
and .md (torch and triton versions in both).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

MODELS = ("wukong", "masknet", "dlrm_dcnv2", "hstu")


def weight_shapes(name: str) -> Counter:
    """Shapes [N, K] of the paper preset's nn.Linear weights, with their counts (built on
    the meta device: no memory)."""
    from benchmarks.zoo.models import build_model

    model, _ = build_model(name, "paper", device="meta")
    return Counter(tuple(m.weight.shape) for m in model.dense.modules() if isinstance(m, torch.nn.Linear))


def measure(shape: tuple, device: torch.device) -> dict:
    from loka_compile.kernels import triton_quant
    from loka_compile.kernels.quantize import Fp8Format, Scaling
    from loka_compile.kernels.scaled_gemm import quantize_operand_aten
    from loka_compile.speed import _time_calls_us

    e4m3 = Fp8Format.E4M3
    w = torch.randn(shape, device=device, dtype=torch.bfloat16)
    forward_cast = torch.compile(lambda t: quantize_operand_aten(t.t(), "b", Scaling.ROWWISE, e4m3))
    dgrad_cast = torch.compile(lambda t: quantize_operand_aten(t, "b", Scaling.ROWWISE, e4m3))
    (q_fwd, s_fwd), (q_dgrad, s_dgrad) = forward_cast(w), dgrad_cast(w)
    q_row, s_row, q_col, s_col = triton_quant.quantize_dual_axis_triton(w, "e4m3")
    differ = dict(forward_codes_differ=int((q_row.t().view(torch.uint8) != q_fwd.view(torch.uint8)).sum()),
                  dgrad_codes_differ=int((q_col.view(torch.uint8) != q_dgrad.view(torch.uint8)).sum()),
                  scales_differ=int((s_row.t() != s_fwd).sum() + (s_col != s_dgrad).sum()))
    fwd_us = _time_calls_us(lambda: forward_cast(w), device)
    dgrad_us = _time_calls_us(lambda: dgrad_cast(w), device)
    dual_us = _time_calls_us(lambda: triton_quant.quantize_dual_axis_triton(w, "e4m3"), device)
    return dict(N=shape[0], K=shape[1], forward_cast_us=round(fwd_us, 2), dgrad_cast_us=round(dgrad_us, 2),
                separate_us=round(fwd_us + dgrad_us, 2), dual_us=round(dual_us, 2),
                dual_vs_separate=round((fwd_us + dgrad_us) / dual_us, 2), **differ)


def table(rows: list, totals: list) -> str:
    from tabulate import tabulate

    per_shape = tabulate([[f"{r['N']}x{r['K']}", r["forward_cast_us"], r["dgrad_cast_us"], r["separate_us"],
                           r["dual_us"], r["dual_vs_separate"], r["forward_codes_differ"], r["dgrad_codes_differ"],
                           r["scales_differ"]] for r in rows],
                         headers=["W [N x K]", "forward cast us", "dgrad cast us", "separate us", "dual us",
                                  "separate / dual (x)", "fwd codes differ", "dgrad codes differ", "scales differ"],
                         tablefmt="github")
    per_model = tabulate([[t["model"], t["weights"], t["separate_us"], t["dual_us"], t["saved_us"]] for t in totals],
                         headers=["model", "2-D linear weights", "separate us", "dual us", "saved us per step"],
                         tablefmt="github")
    return f"{per_shape}\n\n{per_model}\n"


def main(argv=None) -> int:
    from benchmarks.kernels import environment, write_bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for the JSON and .md (none: print only)")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    shapes = {name: weight_shapes(name) for name in args.models.split(",")}
    rows = {shape: measure(shape, device) for shape in sorted({s for c in shapes.values() for s in c})}
    totals = []
    for name, counts in shapes.items():
        separate = sum(rows[s]["separate_us"] * n for s, n in counts.items())
        dual = sum(rows[s]["dual_us"] * n for s, n in counts.items())
        totals.append(dict(model=name, weights=sum(counts.values()), separate_us=round(separate, 1),
                           dual_us=round(dual, 1), saved_us=round(separate - dual, 1)))
    env = environment()
    text = (f"# Weight casts per training step: each GEMM's own against one dual-axis cast\n\n{env['device']}, "
            f"torch {env['torch']}, triton {env['triton']}, {env['date']}. Device time under CUDA graphs, "
            f"medians.\n\n" + table(list(rows.values()), totals))
    print(text)
    if args.out:
        write_bench(args.out, None, "weight_casts", env, {"shapes": list(rows.values()), "models": totals}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
