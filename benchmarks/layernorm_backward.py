"""LayerNorm forward + backward over short rows (x [B, n, d], normalized over d, with weight
and bias): eager, Inductor, and the `layernorm_backward` Mod's Triton backward.

    python -m benchmarks.layernorm_backward --out $OUT                 # CUDA, default cases
    python -m benchmarks.layernorm_backward --tiny --out /tmp/lnb      # CPU smoke run
    python -m benchmarks.layernorm_backward --sweep --out $OUT         # + stage-1 launch sweep

Default cases: public Wukong's [8192, 64, 128] in bf16 (weights and activations) and under
bf16 autocast (fp32 weights; autocast runs LayerNorm in fp32), then rows 16k..1M at d 128 and
d 64..512 at 524k rows in bf16 (the Mod declines below MIN_ROWS = 16384 rows; bwd_loka runs at
any size). Each case compiles three graphs (inductor, loka_mod, bwd_inductor). `--pattern
wukong` normalizes cat(x[:, :k] * s, x[:, k:]) + x instead of x, the form public Wukong
writes (its forward fuses into the producer under Inductor).

Variants, each one step: y = norm(x), then torch.autograd.grad(y, [x, weight, bias], dy):
- eager: F.layer_norm (ATen's CUDA kernels);
- inductor: torch.compile default; inductor_max_autotune: mode max-autotune-no-cudagraphs
  (with --max-autotune);
- loka_off / loka_mod: backend="loka" (probe_steps 0) with the Mod off / on (enabled_mods);
  the block has no GEMM, so loka_off compiles what inductor does (named on request);
- mod_eager: the Mod's `layer_norm` uncompiled (ATen forward, Triton backward).
Backward alone, from saved statistics (the column reduction's share):
- bwd_aten: aten.native_layer_norm_backward; bwd_inductor: the same compiled by Inductor
  (its generated kernels); bwd_loka: torch.ops.loka.layer_norm_backward (the two kernels).
`bwd_gbs`: the bytes the backward must move (read x and dy, write dx) per second.

Timing: CUDA events around each step, median over --steps steps after --warmup, inputs
drawn fresh (a pool of --pool random sets, used in turn). On CPU: wall time. Errors: dx,
dweight, dbias of each variant against fp64 autograd on the first input set (rel_error);
mod_rewrites: how many LayerNorms the Mod rewrote in the loka rows. `--profile`: each
variant's three largest kernels in one step (`benchmarks.ceiling.profile_kernels`).

Writes <out>/<date>_<device>_layernorm_backward.json and .md (`benchmarks.kernels.write_bench`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn

CASES = [  # (B, n, d, precision)
    (8192, 64, 128, "bf16"), (8192, 64, 128, "autocast"),
    (256, 64, 128, "bf16"), (1024, 64, 128, "bf16"), (16384, 64, 128, "bf16"),
    (8192, 64, 64, "bf16"), (8192, 64, 256, "bf16"), (8192, 64, 512, "bf16"),
]
TINY_CASES = [(4, 8, 32, "bf16"), (4, 8, 32, "autocast"), (3, 5, 96, "fp32")]
VARIANTS = ("eager", "inductor", "inductor_max_autotune", "loka_off", "loka_mod", "mod_eager",
            "bwd_aten", "bwd_inductor", "bwd_loka")
# loka_off compiles what inductor does (the block has no GEMM): named on request, as max-autotune.
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in ("inductor_max_autotune", "loka_off"))
EPS = 1e-5
# Stage-1 launch parameters the sweep tries at the first case (kernels/layer_norm_backward.py).
SWEEP = dict(tile_elements=(1024, 2048, 4096, 8192), num_warps=(4, 8), programs_per_sm=(1, 2, 4, 8))


class Norm(nn.Module):
    """LayerNorm over d of x, or of public Wukong's cat + residual (`pattern="wukong"`)."""

    def __init__(self, d: int, pattern: str):
        super().__init__()
        self.pattern, self.k = pattern, 8
        self.norm = nn.LayerNorm(d)
        self.scale = nn.Parameter(torch.ones(d)) if pattern == "wukong" else None
        with torch.no_grad():
            self.norm.weight.add_(0.3 * torch.randn(d))
            self.norm.bias.add_(0.1 * torch.randn(d))

    def forward(self, x):
        if self.pattern == "wukong":
            x = torch.cat([x[:, :self.k] * self.scale, x[:, self.k:]], 1) + x
        return self.norm(x)


def _params(model):
    return [model.norm.weight, model.norm.bias]


def _compiled_step(variant: str, model: nn.Module, precision: str, device: torch.device):
    """A step function (x, dy) -> (dx, dweight, dbias) for a forward + backward variant."""
    from loka_compile.kernels.layer_norm_backward import layer_norm

    if variant == "eager":
        forward = model
    elif variant == "mod_eager":
        norm = model.norm
        forward = lambda x: layer_norm(x, norm.weight, norm.bias, norm.eps)  # noqa: E731
    elif variant.startswith("inductor"):
        mode = "max-autotune-no-cudagraphs" if variant == "inductor_max_autotune" else "default"
        forward = torch.compile(model, mode=mode)
    else:
        options = dict(probe_steps=0, enabled_mods=["layernorm_backward"] if variant == "loka_mod" else [])
        forward = torch.compile(model, backend="loka", options=options)
    params = _params(model)

    def step(x, dy):
        x = x.detach().requires_grad_()
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "autocast"):
            y = forward(x)
        return torch.autograd.grad(y, [x, *params], dy.to(y.dtype))

    step.loka = variant.startswith("loka")
    step.compiled = forward
    return step


def _backward_step(variant: str, model: nn.Module, device: torch.device):
    """A step function (x, dy) -> (dx, dweight, dbias) from saved statistics."""
    weight, bias = model.norm.weight.detach(), model.norm.bias.detach()
    d = weight.shape[0]

    def aten(dy, x, mean, rstd):
        return torch.ops.aten.native_layer_norm_backward(dy, x, [d], mean, rstd, weight, bias, [True, True, True])

    backward = {"bwd_aten": aten, "bwd_inductor": torch.compile(aten),
                "bwd_loka": lambda dy, x, mean, rstd: torch.ops.loka.layer_norm_backward(dy, x, weight, mean, rstd)
                }[variant]
    cache = {}

    def step(x, dy):
        key = (x.data_ptr(), dy.data_ptr())
        if key not in cache:   # per input set, untimed: the forward's statistics; under autocast
            # (fp32 weights) x and dy in fp32, as autocast's fp32 LayerNorm saves and receives them
            x_in, dy_in = x.to(weight.dtype), dy.to(weight.dtype)
            cache[key] = (dy_in, x_in, *torch.ops.aten.native_layer_norm(x_in, [d], weight, bias, EPS)[1:])
        return backward(*cache[key])

    step.loka = False
    return step


def _time_ms(step, pool, warmup: int, steps: int, device: torch.device) -> float:
    for i in range(warmup):
        step(*pool[i % len(pool)])
    times = []
    for i in range(steps):
        x, dy = pool[i % len(pool)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(x, dy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            step(x, dy)
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _reference(model: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(dx, dweight, dbias) by fp64 autograd of the block on the same inputs."""
    reference = _to_precision(copy.deepcopy(model), "fp64")
    xr = x.detach().double().requires_grad_()
    y = reference(xr)
    return torch.autograd.grad(y, [xr, *_params(reference)], dy.double())


def _to_precision(model: nn.Module, precision: str) -> nn.Module:
    dtype = {"bf16": torch.bfloat16, "fp64": torch.float64}.get(precision, torch.float32)
    return model.to(dtype)


def _x_dtype(precision: str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else torch.bfloat16


def measure_case(case, variants, args, device: torch.device) -> list:
    import loka_compile
    from loka_compile.kernels.metrics import rel_error

    b, n, d, precision = case
    torch.manual_seed(0)
    master = Norm(d, args.pattern).to(device)
    pool = [(torch.randn(b, n, d, device=device, dtype=_x_dtype(precision)),
             torch.randn(b, n, d, device=device, dtype=_x_dtype(precision))) for _ in range(args.pool)]
    reference = _reference(master, *pool[0])
    rows = []
    for variant in variants:
        if args.pattern != "plain" and (variant.startswith("bwd_") or variant == "mod_eager"):
            continue   # they time a bare LayerNorm
        row = dict(variant=variant, B=b, n=n, d=d, rows=b * n, precision=precision, pattern=args.pattern, ms=None,
                   dx_err=None, dweight_err=None, dbias_err=None, mod_rewrites=None, error=None)
        torch._dynamo.reset()
        loka_compile.reset()
        model = _to_precision(copy.deepcopy(master), precision)
        try:
            if variant.startswith("bwd_"):
                step = _backward_step(variant, model, device)
            else:
                step = _compiled_step(variant, model, precision, device)
            grads = step(*pool[0])
            for name, mine, ref in zip(("dx_err", "dweight_err", "dbias_err"), grads, reference):
                row[name] = rel_error(ref, mine)
            if step.loka:
                row["mod_rewrites"] = loka_compile.report(step.compiled).mods["layernorm_backward"]
            del grads
            row["ms"] = _time_ms(step, pool, args.warmup, args.steps, device)
            if args.profile:
                from benchmarks.ceiling import profile_kernels, summarize_kernels

                times, source = profile_kernels(lambda: step(*pool[0]), device.type == "cuda")
                row["top_kernels"] = summarize_kernels(times, source, top=3)["top_kernels"]
            if variant.startswith("bwd_"):
                nbytes = 3 * x_bytes(pool[0][0])
                row["bwd_gbs"] = nbytes / (row["ms"] * 1e-3) / 1e9
        except Exception as error:  # noqa: BLE001 - a failing variant is a row
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        finally:
            torch._dynamo.reset()
            loka_compile.reset()
        rows.append(row)
        print(_line(row), flush=True)
    base = {r["variant"]: r["ms"] for r in rows}
    for r in rows:
        baseline = base.get("bwd_inductor") if r["variant"].startswith("bwd_") else base.get("inductor")
        r["vs_inductor"] = baseline / r["ms"] if baseline and r["ms"] else None
    return rows


def x_bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def sweep(case, args, device: torch.device) -> list:
    """bwd_loka at the first case over stage 1's launch parameters, each checked against the
    op's fp32 reference (`layer_norm_backward_reference`) on the first input set."""
    from loka_compile.kernels import layer_norm_backward as lnb
    from loka_compile.kernels.metrics import rel_error

    b, n, d, precision = case
    torch.manual_seed(0)
    dtype = _x_dtype(precision)
    weight = torch.randn(d, device=device, dtype=torch.float32 if precision == "autocast" else dtype)
    pool = [(torch.randn(b, n, d, device=device, dtype=dtype), torch.randn(b, n, d, device=device, dtype=dtype))
            for _ in range(args.pool)]
    stats = {x.data_ptr(): torch.ops.aten.native_layer_norm(x.float(), [d], weight.float(), None, EPS)[1:]
             for x, _ in pool}
    x0, dy0 = pool[0]
    expected = lnb.layer_norm_backward_reference(dy0, x0, weight, *stats[x0.data_ptr()])
    rows = []
    for tile in SWEEP["tile_elements"]:
        for warps in SWEEP["num_warps"]:
            for per_sm in SWEEP["programs_per_sm"]:
                block_n = lnb.backward_config(d)["BLOCK_N"]
                config = dict(BLOCK_M=max(1, tile // block_n), BLOCK_N=block_n, num_warps=warps,
                              programs_per_sm=per_sm)
                row = dict(kind="sweep", B=b, n=n, d=d, precision=precision, config=str(config), ms=None, error=None)
                try:
                    def step(x, dy, config=config):
                        return lnb.layer_norm_backward_triton(dy, x, weight, *stats[x.data_ptr()], config=config)
                    grads = step(x0, dy0)
                    row["max_err_vs_reference"] = max(rel_error(e, g) for e, g in zip(expected, grads))
                    row["ms"] = _time_ms(step, pool, args.warmup, args.steps, device)
                    row["bwd_gbs"] = 3 * x_bytes(pool[0][0]) / (row["ms"] * 1e-3) / 1e9
                except Exception as error:  # noqa: BLE001
                    row["error"] = f"{type(error).__name__}: {error}"[:300]
                rows.append(row)
                print(f"sweep {config}: {row['ms']} ms {row['error'] or ''}", flush=True)
    return rows


def _line(r) -> str:
    ms = f"{r['ms']:.4f} ms" if r["ms"] is not None else "-"
    return (f"[{r['B']}x{r['n']}x{r['d']} {r['precision']}] {r['variant']:22s} {ms}  dx {r['dx_err']}  "
            f"dw {r['dweight_err']}  db {r['dbias_err']}  {r['error'] or ''}")


def _parse_cases(text: str, precisions: str) -> list:
    cases = []
    for shape in text.split(","):
        b, n, d = (int(v) for v in shape.lower().split("x"))
        cases += [(b, n, d, p) for p in precisions.split(",")]
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.layernorm_backward", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma-separated BxNxD, e.g. 8192x64x128 (default: CASES)")
    p.add_argument("--precisions", default="bf16", help="with --shapes: of bf16, autocast, fp32")
    p.add_argument("--pattern", default="plain", choices=("plain", "wukong"))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--max-autotune", action="store_true", help="add the inductor_max_autotune variant")
    p.add_argument("--sweep", action="store_true", help="sweep stage 1's launch parameters at the first case")
    p.add_argument("--profile", action="store_true", help="record each variant's three largest kernels")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool", type=int, default=3, help="random input sets, used in turn")
    args = p.parse_args(argv)
    from tabulate import tabulate

    import loka_compile  # noqa: F401  (registers the backend and loka's ops)
    from benchmarks.kernels import environment, write_bench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = _parse_cases(args.shapes, args.precisions) if args.shapes else (TINY_CASES if args.tiny else CASES)
    variants = [v for v in args.variants.split(",") if v]
    if args.max_autotune and "inductor_max_autotune" not in variants:
        variants.insert(variants.index("inductor") + 1 if "inductor" in variants else 0, "inductor_max_autotune")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
    rows = [r for case in cases for r in measure_case(case, variants, args, device)]
    sweep_rows = sweep(cases[0], args, device) if args.sweep else []
    env = environment()
    table = tabulate([[f"{r['B']}x{r['n']}x{r['d']}", r["rows"], r["precision"], r["variant"], r["ms"],
                       r["vs_inductor"], r.get("bwd_gbs"), r["dx_err"], r["dweight_err"], r["dbias_err"],
                       r["mod_rewrites"], r["error"] or ""] for r in rows],
                     headers=["shape", "rows", "precision", "variant", "ms", "vs inductor (x)", "bwd GB/s",
                              "dx err", "dw err", "db err", "Mod rewrites", "error"],
                     floatfmt=("", "", "", "", ".4f", ".2f", ".0f", ".1e", ".1e", ".1e", "", ""), tablefmt="github")
    timing = "CUDA-event medians" if device.type == "cuda" else "wall-time medians"
    text = (f"# LayerNorm forward + backward over short rows: eager, Inductor, the layernorm_backward Mod\n\n"
            f"{env}\n\nPattern {args.pattern}; {timing} of {args.steps} steps over {args.pool} random input sets. "
            f"`vs inductor`: Inductor's time / this one (bwd_* rows: against bwd_inductor). Errors against fp64 "
            f"autograd.\n\n{table}\n")
    profiled = [r for r in rows if r.get("top_kernels")]
    if profiled:
        text += "\n## Largest kernels per step (--profile)\n\n" + tabulate(
            [[f"{r['B']}x{r['n']}x{r['d']} {r['precision']}", r["variant"], k["name"][:90], k["ms"], k["calls"]]
             for r in profiled for k in r["top_kernels"]],
            headers=["case", "variant", "kernel", "ms", "calls"], floatfmt=("", "", "", ".4f", ""),
            tablefmt="github") + "\n"
    if sweep_rows:
        best = min((r for r in sweep_rows if r["ms"]), key=lambda r: r["ms"], default=None)
        text += "\n## Stage-1 launch sweep (bwd_loka)\n\n" + tabulate(
            [[r["config"], r["ms"], r.get("bwd_gbs"), r.get("max_err_vs_reference"), r["error"] or ""]
             for r in sweep_rows],
            headers=["config", "ms", "GB/s", "err vs fp32 reference", "error"], floatfmt=("", ".4f", ".0f", ".1e", ""),
            tablefmt="github")
        text += f"\n\nBest: {best['config'] if best else None}\n"
    print(text)
    return write_bench(args.out, args.name, "layernorm_backward", env, rows + sweep_rows, text)


if __name__ == "__main__":
    main()
