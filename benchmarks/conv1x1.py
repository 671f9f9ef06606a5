"""xDeepFM's compressed interaction network (CIN) at LRM sizes, forward + backward: its 1x1
convolutions as written against the linears the `conv1x1` Mod makes of them.

    python -m benchmarks.conv1x1 --out benchmarks/results

The block (DeepCTR / FuxiCTR's CIN without split_half): embeddings x0 [B, F, d]; per layer
z = einsum("bhd,bmd->bhmd", x0, x_k) viewed [B, F * H_k, d], x_k+1 = relu(Conv1d(F * H_k,
H_k+1, kernel_size=1)(z)), each x_k sum-pooled over d, the pools concatenated into a linear
head. Defaults: B 8192, F 39 (Criteo's fields), d 16, widths 200, 200, 200, so the
compressions are GEMMs of M = B * d = 131072 rows, K = 1521 or 7800, N = 200. One step:
the head's output and the gradients of x0 and of every parameter (torch.autograd.grad, so
nothing accumulates), bf16 weights and inputs, device time under CUDA graphs
(`loka_compile.speed._time_calls_us`: median of 5 runs of 10 steps; wall time on CPU).

Variants (the same weights and inputs):

- inductor_conv: torch.compile (Inductor) of the block as written: aten.convolution and
  aten.convolution_backward (cuDNN on CUDA);
- inductor_linear: Inductor after the conv1x1 rewrite alone: each convolution a linear of
  the transposed z, a 2-D GEMM over z's transposed copy (what loka's graph holds, its
  GEMMs in bf16: transposed_linear declines them, wide_weight_gradient);
- inductor_w_at_x: Inductor after conv1x1 and transposed_linear, the latter run as for a
  model that does not train (under no_grad, which skips its wide_weight_gradient rule): W @
  x, a bmm over the broadcast weight whose weight gradient writes [B, N, K] per-sample
  products (25 GB per 7800-wide layer at the defaults) before summing them: what that rule
  declines;
- loka: backend="loka", default options (its probe window runs in the untimed calls);
- loka_no_conv1x1: the same with disabled_mods=["conv1x1"] (the convolutions stay
  aten.convolution: no GEMM site).

Errors: the output and all gradients (x0's and the parameters', concatenated) against an fp32
copy of the block as written on the same inputs (||x - ref|| / ||ref||). A variant that fails
(out of memory, say) becomes a row with `error` set. Loka rows also record how many of the
CIN's GEMM sites run in FP8, by role.

Writes <out>/<date>_<device>_conv1x1.json and .md (`benchmarks.kernels.write_bench`).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PAPER = dict(batch=8192, fields=39, dim=16, widths=(200, 200, 200))
TINY = dict(batch=16, fields=4, dim=16, widths=(16, 16))
VARIANTS = ("inductor_conv", "inductor_linear", "inductor_w_at_x", "loka", "loka_no_conv1x1")


class CIN(nn.Module):
    """The compressed interaction network over x0 [B, F, d] (module docstring)."""

    def __init__(self, fields: int, widths: tuple):
        super().__init__()
        inputs = (fields, *widths[:-1])
        self.layers = nn.ModuleList(nn.Conv1d(fields * h, w, kernel_size=1) for h, w in zip(inputs, widths))
        self.head = nn.Linear(sum(widths), 1)

    def forward(self, x0):
        b, _, d = x0.shape
        xk, pooled = x0, []
        for conv in self.layers:
            z = torch.einsum("bhd,bmd->bhmd", x0, xk).reshape(b, -1, d)
            xk = F.relu(conv(z))
            pooled.append(xk.sum(-1))
        return self.head(torch.cat(pooled, 1)).squeeze(-1)


def _inductor_after(*rewrites):
    """An Inductor backend that first applies `rewrites` (Dynamo-graph passes) to the graph."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        for rewrite in rewrites:
            rewrite(gm, example_inputs)
        return compile_fx(gm, example_inputs)

    return backend


def _transposed_linear_as_untrained(gm, example_inputs):
    from loka_compile.passes.mods.transposed_linear import rewrite_transposed_linears
    with torch.no_grad():
        return rewrite_transposed_linears(gm, example_inputs)


def compile_variant(block: nn.Module, variant: str):
    """`block` compiled as `variant`, and how many untimed calls it needs first."""
    from loka_compile import LokaConfig
    from loka_compile.passes.mods.conv1x1 import rewrite_conv1x1

    if variant == "inductor_conv":
        return torch.compile(block), 0
    if variant == "inductor_linear":
        return torch.compile(block, backend=_inductor_after(rewrite_conv1x1)), 0
    if variant == "inductor_w_at_x":
        return torch.compile(block, backend=_inductor_after(rewrite_conv1x1, _transposed_linear_as_untrained)), 0
    options = {"disabled_mods": ["conv1x1"]} if variant == "loka_no_conv1x1" else {}
    # the probe window's calls, the call that closes it and one more (benchmarks.train)
    untimed = LokaConfig.from_options(options).probe_steps + 2
    return torch.compile(block, backend="loka", options=options), untimed


def _cin_sites(compiled) -> dict:
    """role -> "FP8 sites/sites" of the CIN's GEMMs in loka's report."""
    import loka_compile
    sites = [s for s in loka_compile.report(compiled).sites if s.module.startswith("layers.")]
    return {role: f"{sum(s.fp8 for s in sites if s.role == role)}/{sum(s.role == role for s in sites)}"
            for role in ("fwd", "dgrad", "wgrad")}


def measure(variant: str, sizes: dict, device: torch.device, seed: int = 0) -> dict:
    import loka_compile
    from loka_compile import speed
    from loka_compile.kernels.metrics import rel_error

    torch.manual_seed(seed)
    master = CIN(sizes["fields"], tuple(sizes["widths"])).to(device)
    x0 = torch.randn(sizes["batch"], sizes["fields"], sizes["dim"], device=device)
    g = torch.randn(sizes["batch"], device=device)
    reference = copy.deepcopy(master)
    x_ref = x0.clone().requires_grad_(True)
    ref_out = reference(x_ref)
    ref_grads = torch.autograd.grad(ref_out, [x_ref, *reference.parameters()], g)

    row = {"variant": variant, **{k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()},
           "ms": None, "out_err_vs_fp32": None, "grad_err_vs_fp32": None, "cin_fp8_sites": None, "error": None}
    torch._dynamo.reset()
    loka_compile.reset()
    block = copy.deepcopy(master).to(torch.bfloat16)
    x = x0.to(torch.bfloat16).requires_grad_(True)
    g16 = g.to(torch.bfloat16)
    params = list(block.parameters())
    try:
        compiled, untimed = compile_variant(block, variant)

        def step():
            out = compiled(x)
            return out, torch.autograd.grad(out, [x, *params], g16)

        for _ in range(untimed):
            step()
        out, grads = step()
        row["out_err_vs_fp32"] = rel_error(ref_out.detach(), out.float())
        row["grad_err_vs_fp32"] = rel_error(torch.cat([t.flatten() for t in ref_grads]),
                                            torch.cat([t.float().flatten() for t in grads]))
        if variant.startswith("loka"):
            row["cin_fp8_sites"] = _cin_sites(compiled)
        del out, grads
        row["ms"] = speed._time_calls_us(step, device) / 1e3
    except Exception as error:  # noqa: BLE001 - a failing variant is a row
        row["error"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        torch._dynamo.reset()
        loka_compile.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv1x1", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    args = p.parse_args(argv)
    from tabulate import tabulate

    import loka_compile  # noqa: F401  (registers the backend's ops and providers)
    from benchmarks.kernels import environment, write_bench

    sizes = dict(TINY if args.tiny else PAPER)
    if args.batch:
        sizes["batch"] = args.batch
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(v, sizes, device) for v in variants]
    base = next((r["ms"] for r in rows if r["variant"] == "inductor_conv"), None)
    for r in rows:
        r["vs_inductor_conv"] = base / r["ms"] if base and r["ms"] else None
    env = environment()
    table = tabulate([[r["variant"], r["ms"], r["vs_inductor_conv"], r["out_err_vs_fp32"], r["grad_err_vs_fp32"],
                       " ".join(f"{k} {v}" for k, v in (r["cin_fp8_sites"] or {}).items()), r["error"] or ""]
                      for r in rows],
                     headers=["variant", "ms / step", "vs inductor_conv", "out err vs fp32", "grad err vs fp32",
                              "CIN FP8 sites", "error"],
                     floatfmt=("", ".3f", ".3f", ".2e", ".2e", "", ""), tablefmt="github")
    text = (f"# conv1x1: xDeepFM's CIN, forward + backward, convolutions vs linears\n\n{env}\n\n"
            f"Batch {sizes['batch']}, {sizes['fields']} fields, d {sizes['dim']}, widths {list(sizes['widths'])}; "
            f"bf16. {'Device time under CUDA graphs' if device.type == 'cuda' else 'Wall time'} per step, "
            f"median of 5 runs of 10 steps.\n\n{table}\n")
    print(text)
    return write_bench(args.out, args.name, "conv1x1", env, rows, text)


if __name__ == "__main__":
    main()
