"""What a training backward pays for its gradient cast, by how the gradient's scale is known.

    python -m benchmarks.dgrad_cast --out benchmarks/results

A dgrad site's A is a gradient G [M, N] that a pointwise backward produced (relu's or
silu's) and that the bias gradient and the weight gradient (bf16, as under the `default`
recipe) also read. Per shape, the whole backward of one linear, compiled by Inductor, device
time under CUDA graphs (`loka_compile.speed._time_calls_us`: median of 5 runs of 10 calls):

- bf16:    G = act_backward(dY, Z); dX = G @ W; dW = G^T @ X; db = sum(G)
- rowwise: dX in FP8 (e4m3, precise accumulation) with G cast per row: each row's amax must
           be reduced before any element is cast (what loka emits today); W's FP8 copy is
           made in the forward and not timed
- static:  G cast with a scale known before the backward runs (one value, broadcast per row
           so the GEMM is the same rowwise one): a pointwise cast with no reduction, which
           Inductor can fuse into G's producer
- delayed: static, plus amax |G| over the finite values reduced in the same graph, the next
           step's scale (delayed scaling)

Precision of each dX against dX computed in fp64 from the bf16 G: SQNR (dB), and the mean
over rows of each row's relative error (the Probe's `row_rel_error`), which shows what one
scale for all rows costs the small rows. dY's rows are
spread over 2^-4..2^4 (log-uniform), as per-sample gradients are; the static and delayed
scales come from this dY's own amax, the best case for a scale known in advance (a delayed
scale lags one step).

Writes <out>/<date>_<device>_dgrad_cast.json and .md (torch and triton versions in both).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

# (site, M rows, N gradient width = the dgrad's K, D layer input width, producer's backward)
SHAPES = [
    ("masknet mask.0 (8 fused by horizontal)", 8192, 27648, 1728, "relu"),
    ("wukong fm_mlp", 8192, 2048, 2048, "relu"),
    ("dlrm top", 8192, 1024, 1024, "relu"),
    ("hstu uvqk", 532480, 1024, 256, "silu"),
]
VARIANTS = ("bf16", "rowwise", "static", "delayed")


def _act_backward(dy: torch.Tensor, z: torch.Tensor, act: str) -> torch.Tensor:
    if act == "relu":
        return torch.ops.aten.threshold_backward(dy, z, 0)
    return torch.ops.aten.silu_backward(dy, z)


def backward_of(variant: str, act: str, scale: float):
    """The backward of act(X @ W^T + b) for `variant` (module docstring), to compile."""
    from loka_compile.kernels.quantize import Fp8Format, Scaling, amax_along, cast_with_scale, quantize_along
    from loka_compile.kernels.scaled_gemm import GemmSpec, gemm_quantized, quantize_static

    e4m3 = Fp8Format.E4M3
    spec = GemmSpec(Scaling.ROWWISE, e4m3, e4m3, "scaled_mm_rowwise", torch.bfloat16)

    def fn(dy, z, x, w, w_q, w_s, s):
        g = _act_backward(dy, z, act)
        dw, db = g.t() @ x, g.sum(0)
        if variant == "bf16":
            return g @ w, dw, db
        if variant == "rowwise":
            g_q, g_s = quantize_along(g, -1, e4m3)
        elif variant == "static":
            g_q, g_s = quantize_static(g, scale, Scaling.ROWWISE, e4m3)
        else:
            g_q = cast_with_scale(g, s, e4m3, non_finite_to_nan=True)
            g_s = s.expand(g.shape[0], 1).contiguous()
        dx = gemm_quantized(g_q, g_s, w_q, w_s, None, spec)
        return (dx, dw, db, amax_along(g, finite_only=True)) if variant == "delayed" else (dx, dw, db)

    return fn


def measure(site: str, m: int, n: int, d: int, act: str, device: torch.device) -> list[dict]:
    from loka_compile import speed
    from loka_compile.kernels.metrics import row_rel_error, sqnr_db
    from loka_compile.kernels.quantize import Fp8Format, scale_from_amax

    bf16 = torch.bfloat16
    row_spread = torch.exp2(torch.empty(m, 1, device=device).uniform_(-4, 4))
    dy = (torch.randn(m, n, device=device) * row_spread).to(bf16)
    z = torch.randn(m, n, device=device, dtype=bf16)
    x = torch.randn(m, d, device=device, dtype=bf16)
    w = (torch.randn(n, d, device=device) * n ** -0.5).to(bf16)  # [N, D]: dX = G @ W
    w_q, w_s = torch.ops.loka.quantize_operand(w, "b", "rowwise", "e4m3")
    g = _act_backward(dy, z, act)
    reference = g.double() @ w.double()
    s_amax = g.float().abs().amax()
    s = scale_from_amax(s_amax, Fp8Format.E4M3)
    args = (dy, z, x, w, w_q, w_s, s)
    rows = []
    for variant in VARIANTS:
        torch._dynamo.reset()  # each variant is a new closure of the same code: not a recompile
        compiled = torch.compile(backward_of(variant, act, float(s)), fullgraph=True)
        out = compiled(*args)
        us = speed._time_calls_us(lambda: compiled(*args), device)
        rows.append({"site": site, "m": m, "n": n, "d": d, "act": act, "variant": variant, "us": us,
                     "dx_sqnr_db": sqnr_db(reference, out[0].double()),
                     "dx_row_rel_error": row_rel_error(reference, out[0].double()),
                     "next_amax_rel_diff": None if variant != "delayed" else
                     float((out[3] - s_amax).abs() / s_amax)})
        del compiled, out
    base = rows[0]["us"]
    for r in rows:
        r["vs_bf16"] = base / r["us"]
    return rows


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dgrad_cast", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    from tabulate import tabulate

    import loka_compile  # noqa: F401  (registers the ops and providers)
    from benchmarks.kernels import environment, write_bench

    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = [r for shape in SHAPES for r in measure(*shape, device)]
    env = environment()
    table = tabulate([[r["site"], f"{r['m']}x{r['n']}x{r['d']}", r["act"], r["variant"], r["us"], r["vs_bf16"],
                       r["dx_sqnr_db"], r["dx_row_rel_error"]] for r in rows],
                     headers=["site", "M x N x D", "producer", "variant", "us", "vs bf16", "dX SQNR dB",
                              "dX row rel err"],
                     floatfmt=("", "", "", "", ".1f", ".3f", ".1f", ".4f"))
    geo = {v: statistics.geometric_mean(r["vs_bf16"] for r in rows if r["variant"] == v) for v in VARIANTS}
    text = (f"# The backward of one linear: what the gradient cast costs, by how its scale is known\n\n{env}\n\n"
            f"Device time per call, CUDA graphs, median of 5 runs of 10 calls.\n\n{table}\n\n"
            "Geometric mean vs bf16: " + ", ".join(f"{v} {geo[v]:.3f}x" for v in VARIANTS) + "\n")
    print(text)
    return write_bench(args.out, args.name, "dgrad_cast", env, rows, text)


if __name__ == "__main__":
    main()
