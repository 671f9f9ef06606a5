"""The MLP block of torch-rechub's `MLP` (Linear -> BatchNorm1d -> ReLU -> Dropout, batch norm on
by default; deepctr-torch's `DNN(use_bn=True)` and public Wukong's MLPs are the same form) in
training, forward + backward: Inductor against loka with the `linear_batchnorm` Mod off and on,
in bf16 and with FP8 sites.

    python -m benchmarks.batchnorm_mlp --out $OUT                 # CUDA: the default cases
    python -m benchmarks.batchnorm_mlp --tiny --out /tmp/bnm      # CPU smoke run
    python -m benchmarks.batchnorm_mlp --dump-code --out $OUT     # + Inductor's generated code per variant

Model: `torch_rechub.basic.layers.MLP(width, dims, output_layer=True)` as the library builds it
(`benchmarks.public.written_here.mlp_bn` plus a Linear head where torch-rechub is missing), at
batch 8192 and towers of 4096-2048-1024 (the public suite's production preset). Precisions:
`autocast` (the public suite's: an fp32 model under bf16 autocast) and `bf16` (the module cast).

Variants, each one step: y = model(x), then torch.autograd.grad(y, [x, *parameters], dy):
- inductor: torch.compile (the `--mode`);
- loka_bf16 / loka_bf16_mod: backend="loka" with no FP8 provider (`providers: ["emulated"]`,
  which does not run where FP8 hardware is, and `emulate: False` where it is not), the Mod off /
  on: Inductor plus loka's Mods;
- loka_fp8 / loka_fp8_mod: every eligible site FP8 (speed_check off, no probe window, no
  output budget), the Mod off / on.
The running statistics update in every step, as in training.

Timing: CUDA events around each step (`benchmarks.infer._time_batch`: warm-up calls, then half
a second of calls, then --steps timed), median, over a pool of --pool fresh random (x, dy) sets.
Errors: the output and every gradient against fp64 eager on the first set (rel_error; `grad_err`
is the largest over the parameters, the Linear biases ahead of a BatchNorm left out: their
gradient is zero in exact arithmetic). `--profile`: kernel time per step, its non-GEMM part and
the three largest kernels (`benchmarks.ceiling`). `--dump-code`: each variant's generated code
(`<out>/batchnorm_mlp_code/<case>_<variant>_<graph>.py`).

A public-suite model with BatchNorm MLPs (torch-rechub's MMOE, DCNv2, DSSM, ...) runs through
`benchmarks.public.run` with the `<loka config>_with_linear_batchnorm` rows (benchmarks.train).

Writes <out>/<date>_<device>_batchnorm_mlp.json and .md (`benchmarks.kernels.write_bench`).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn as nn

CASES = [  # (batch, input width, tower widths, precision)
    (8192, 1024, (4096, 2048, 1024), "autocast"),
    (8192, 1024, (4096, 2048, 1024), "bf16"),
]
TINY_CASES = [(64, 32, (48, 32), "autocast"), (64, 32, (48, 32), "fp32")]
_NO_FP8 = dict(providers=["emulated"], emulate=False, probe_steps=0)
_ALL_FP8 = dict(speed_check=False, probe_steps=0, max_output_error=None)
VARIANTS = {
    "inductor": None,
    "loka_bf16": _NO_FP8, "loka_bf16_mod": dict(_NO_FP8, enabled_mods=["linear_batchnorm"]),
    "loka_fp8": _ALL_FP8, "loka_fp8_mod": dict(_ALL_FP8, enabled_mods=["linear_batchnorm"]),
}


def build_mlp(width: int, dims: tuple) -> nn.Module:
    """torch-rechub's MLP with its output layer, or the same form written here."""
    try:
        from torch_rechub.basic.layers import MLP
    except ImportError:
        from benchmarks.public.written_here import mlp_bn
        return nn.Sequential(mlp_bn(width, dims), nn.Linear(dims[-1], 1))
    return MLP(width, output_layer=True, dims=list(dims))


def _to_precision(model: nn.Module, precision: str) -> nn.Module:
    return model.to(torch.bfloat16) if precision == "bf16" else model


def _step(variant: str, model: nn.Module, precision: str, mode: str, device: torch.device):
    """A step (x, dy) -> (y, grads of x and the parameters)."""
    options = VARIANTS[variant]
    if options is None:
        forward = torch.compile(model, mode=mode)
    else:
        forward = torch.compile(model, backend="loka", options=dict(options, mode=mode))
    params = list(model.parameters())

    def step(x, dy):
        x = x.detach().requires_grad_()
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "autocast"):
            y = forward(x)
        return (y, *torch.autograd.grad(y, [x, *params], dy.to(y.dtype)))

    step.compiled = forward
    return step


def _errors(model: nn.Module, outputs, x, dy) -> dict:
    """The output's and the gradients' errors against fp64 eager on the same inputs."""
    from loka_compile.kernels.metrics import rel_error

    reference = copy.deepcopy(model).double().train()
    xr = x.detach().double().requires_grad_()
    y = reference(xr)
    expected = (y, *torch.autograd.grad(y, [xr, *reference.parameters()], dy.double()))
    names = ["x"] + [name for name, _ in reference.named_parameters()]
    # Linear biases read only by a BatchNorm: their exact gradient is zero
    ahead_of_norm = {f"{name}.bias" for name, module in reference.named_modules() if isinstance(module, nn.Linear)
                     and _feeds_batch_norm(reference, name)}
    grads = [rel_error(ref, mine) for name, ref, mine in zip(names, expected[1:], outputs[1:])
             if name not in ahead_of_norm and name != "x"]
    return dict(out_err=rel_error(expected[0], outputs[0]), dx_err=rel_error(expected[1], outputs[1]),
                grad_err=max(grads))


def _feeds_batch_norm(model: nn.Module, linear_name: str) -> bool:
    parent, _, index = linear_name.rpartition(".")
    container = model.get_submodule(parent) if parent else model
    if not isinstance(container, nn.Sequential) or not index.isdigit() or int(index) + 1 >= len(container):
        return False
    return isinstance(container[int(index) + 1], nn.BatchNorm1d)


def measure_case(case, variants, args, device: torch.device) -> list:
    import loka_compile
    from benchmarks.infer import _time_batch

    batch, width, dims, precision = case
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    master = build_mlp(width, dims).to(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    pool = [(torch.randn(batch, width, device=device, dtype=dtype), torch.randn(batch, 1, device=device, dtype=dtype))
            for _ in range(args.pool)]
    label = f"{batch}x{width}->{'-'.join(map(str, dims))}"
    rows = []
    for variant in variants:
        row = dict(case=label, batch=batch, width=width, dims=list(dims), precision=precision, variant=variant,
                   mode=args.mode, ms=None, error=None)
        torch._dynamo.reset()
        loka_compile.reset()
        model = _to_precision(copy.deepcopy(master), precision).train()
        codes = []
        try:
            if args.dump_code:
                from torch._inductor.graph import GraphLowering
                GraphLowering.save_output_code = staticmethod(codes.append)
            step = _step(variant, model, precision, args.mode, device)
            first = step(*pool[0])
            row.update(_errors(master, first, *pool[0]))
            if variant != "inductor":
                from benchmarks.public.run import fp8_summary
                row["mod_rewrites"] = loka_compile.report(step.compiled).mods.get("linear_batchnorm", 0)
                row.update(fp8_summary(step.compiled))
            del first
            cudagraphs = cuda and args.mode == "reduce-overhead"
            _, timing = _time_batch(step, pool, args.warmup, args.steps, cuda, cudagraphs)
            row["ms"] = timing.median_ms
            if args.profile:
                from benchmarks.ceiling import profile_kernels, summarize_kernels

                def profiled():
                    if cudagraphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    step(*pool[0])
                summary = summarize_kernels(*profile_kernels(profiled, cuda), top=3)
                row.update(kernel_ms=summary["total_ms"], non_gemm_ms=summary["total_ms"] - summary["gemm_ms"],
                           kernels=summary["kernels"], top_kernels=summary["top_kernels"])
        except Exception as error:  # noqa: BLE001 - a failing variant is a row
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        finally:
            if args.dump_code:
                from torch._inductor.graph import GraphLowering
                GraphLowering.save_output_code = None
                folder = Path(args.out) / "batchnorm_mlp_code"
                folder.mkdir(parents=True, exist_ok=True)
                for i, code in enumerate(codes):
                    (folder / f"{label.replace('>', '')}_{precision}_{variant}_{i}.py").write_text(code)
            torch._dynamo.reset()
            loka_compile.reset()
        rows.append(row)
        print(_line(row), flush=True)
    for base in ("inductor", "loka_bf16", "loka_fp8"):
        ref = next((r["ms"] for r in rows if r["variant"] == base), None)
        for r in rows:
            if r["ms"] and ref and (base == "inductor" or r["variant"].startswith(base)):
                r[f"vs_{base}"] = ref / r["ms"]
    return rows


def _line(row) -> str:
    ms = f"{row['ms']:.3f} ms" if row["ms"] else "-"
    return f"{row['case']} {row['precision']} {row['variant']}: {ms} {row.get('error') or ''}"


def _parse_cases(text: str, precisions: str) -> list:
    """'8192x1024x4096-2048-1024,...' (batch x input width x towers) times each precision."""
    cases = []
    for spec in filter(None, text.split(",")):
        batch, width, dims = spec.split("x")
        cases += [(int(batch), int(width), tuple(int(d) for d in dims.split("-")), p)
                  for p in precisions.split(",") if p]
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.batchnorm_mlp", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default=None, help="comma-separated BxKxN1-N2-..., e.g. 8192x1024x4096-2048-1024")
    p.add_argument("--precisions", default="autocast", help="with --shapes: of autocast, bf16, fp32")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA, default on CPU)")
    p.add_argument("--profile", action="store_true", help="kernel time per step and the three largest kernels")
    p.add_argument("--dump-code", action="store_true", help="write each variant's Inductor code under --out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool", type=int, default=3, help="random input sets, used in turn")
    args = p.parse_args(argv)
    from tabulate import tabulate

    import loka_compile  # noqa: F401  (registers the backend)
    from benchmarks.kernels import environment, write_bench

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.mode = args.mode or ("reduce-overhead" if device.type == "cuda" else "default")
    cases = _parse_cases(args.shapes, args.precisions) if args.shapes else (TINY_CASES if args.tiny else CASES)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
    rows = [r for case in cases for r in measure_case(case, variants, args, device)]
    env = environment()
    table = tabulate([[r["case"], r["precision"], r["variant"], r["ms"], r.get("vs_inductor"),
                       r.get("vs_loka_bf16", r.get("vs_loka_fp8")),
                       r.get("non_gemm_ms"), r.get("out_err"), r.get("dx_err"), r.get("grad_err"),
                       r.get("fp8_flop_share"), r.get("mod_rewrites"), r["error"] or ""] for r in rows],
                     headers=["case", "precision", "variant", "ms", "vs inductor (x)", "vs Mod off (x)",
                              "non-GEMM ms", "out err", "dx err", "grad err", "FP8 FLOPs", "Mod rewrites",
                              "error"],
                     floatfmt=("", "", "", ".3f", ".3f", ".3f", ".3f", ".1e", ".1e", ".1e", ".2f", "", ""),
                     tablefmt="github")
    timing = "CUDA-event medians" if device.type == "cuda" else "wall-time medians"
    text = (f"# BatchNorm MLPs in training: Inductor, loka with linear_batchnorm off and on\n\n{env}\n\n"
            f"Mode {args.mode}; {timing} of {args.steps} steps (forward + backward) over {args.pool} random input "
            f"sets. `vs Mod off`: the same loka precision with the Mod off / this row. Errors against fp64 eager.\n\n"
            f"{table}\n")
    profiled = [r for r in rows if r.get("top_kernels")]
    if profiled:
        text += "\n## Largest kernels per step (--profile)\n\n" + tabulate(
            [[f"{r['case']} {r['precision']}", r["variant"], k["name"][:90], k["ms"], k["calls"]]
             for r in profiled for k in r["top_kernels"]],
            headers=["case", "variant", "kernel", "ms", "calls"], floatfmt=("", "", "", ".4f", ""),
            tablefmt="github") + "\n"
    print(text)
    return write_bench(args.out, args.name, "batchnorm_mlp", env, rows, text)


if __name__ == "__main__":
    main()
