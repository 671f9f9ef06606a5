"""Whether this torch's Inductor returns a keepdim column sum in its shape when its mix-order
reduction fuses it with a row reduction of the same data, and what that does to deepctr-torch
AFN's LogTransformLayer under loka with and without the `keepdim_outputs` pass
(passes/keepdim_outputs.py: why the pass exists).

    python -m benchmarks.mix_order_keepdim --out DIR            # CUDA
    python -m benchmarks.mix_order_keepdim --tiny --out DIR     # CPU smoke run (no mix-order reduction on CPU)

Rows, each on fresh random inputs:
  - inductor: `backend="inductor"` on (row amax of g [B*E, N], keepdim column sum of g [B, E, N]);
  - loka: the same function under loka (every graph goes through its passes);
  - afn_loka / afn_loka_without_pass: the layer trained for 3 steps under loka (rowwise, speed check
    off, so the dgrad's row-wise cast is in the graph; fallback off, so a misshaped gradient raises),
    with the pass, and with it taken out of the pipeline.
Each row records the returned shapes (or the error), and Inductor's count of mix-order kernels.
Writes mix_order_keepdim.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tabulate import tabulate
from torch._inductor import metrics

from loka_compile import passes


def _row_max_and_column_sum(g):
    flat = g.reshape(-1, g.shape[-1])
    return flat.abs().amax(-1, keepdim=True) * 2.0, g.sum((0, 1), keepdim=True)


def _function_row(name: str, backend: str, options, sizes, device) -> dict:
    torch._dynamo.reset()
    metrics.reset()
    g = torch.randn(*sizes, device=device)
    kwargs = {"options": options} if options is not None else {"mode": "reduce-overhead"}
    try:
        compiled = torch.compile(_row_max_and_column_sum, backend=backend, **kwargs)
        for _ in range(3):
            outs = compiled(g)
        shapes = [list(o.shape) for o in outs]
        error = ""
    except Exception as exc:  # noqa: BLE001 - the row records it
        shapes, error = [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    expected = [list(o.shape) for o in _row_max_and_column_sum(g)]
    return {"row": name, "shapes": shapes, "expected": expected, "as_expected": shapes == expected,
            "mix_order_kernels": metrics.codegen_mix_order_reduction, "error": error}


def _afn_row(name: str, with_pass: bool, sizes, device) -> dict:
    from deepctr_torch.layers.interaction import LogTransformLayer

    torch._dynamo.reset()
    metrics.reset()
    batch, fields, embed, neurons = sizes
    layer = LogTransformLayer(fields, embed, neurons).to(device)
    pipeline = passes.PIPELINE
    if not with_pass:
        passes.PIPELINE = tuple(p for p in pipeline if p[0] != "keepdim_outputs")
    shapes, error = [], ""
    try:
        # fallback off: a misshaped gradient raises instead of sending the backward to its fallback
        compiled = torch.compile(layer, backend="loka", options={"recipe": "rowwise", "probe_steps": 0,
                                                                  "speed_check": False, "fallback": False,
                                                                  "mode": "reduce-overhead"})
        for _ in range(3):
            x = torch.randn(batch, fields, embed, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = compiled(x)
            (out.float() * torch.randn_like(out.float())).sum().backward()
            shapes = [list(p.grad.shape) for p in layer.parameters()]
            layer.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - the row records it
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        passes.PIPELINE = pipeline
    expected = [list(p.shape) for p in layer.parameters()]
    return {"row": name, "shapes": shapes, "expected": expected, "as_expected": shapes == expected,
            "mix_order_kernels": metrics.codegen_mix_order_reduction, "error": error}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small sizes (CPU smoke run)")
    args = parser.parse_args(argv)
    torch._inductor.config.fx_graph_cache = False  # a cache hit generates no code: the mix-order count would read 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    # Past the sizes where Inductor fuses the two reductions (torch 2.11's MixOrderReduction.can_fuse).
    g_sizes = (64, 4, 32) if args.tiny else (2048, 16, 256)
    afn_sizes = (8, 26, 16, 64) if args.tiny else (2048, 26, 16, 256)
    rows = [_function_row("inductor", "inductor", None, g_sizes, device),
            _function_row("loka", "loka", {"mode": "reduce-overhead", "fallback": False}, g_sizes, device)]
    try:
        import deepctr_torch  # noqa: F401
    except ImportError:
        rows.append({"row": "afn", "error": "deepctr-torch is not installed (the public extra)"})
    else:
        rows += [_afn_row("afn_loka", True, afn_sizes, device), _afn_row("afn_loka_without_pass", False, afn_sizes,
                                                                        device)]
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "mix_order_reduction": torch._inductor.config.triton.mix_order_reduction}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mix_order_keepdim.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    table = tabulate([[r["row"], r.get("shapes"), r.get("expected"), r.get("as_expected"),
                       r.get("mix_order_kernels"), r.get("error", "")] for r in rows],
                     headers=["row", "shapes", "expected", "as expected", "mix-order kernels", "error"],
                     tablefmt="github")
    (out / "mix_order_keepdim.md").write_text(f"{env}\n\n{table}\n")
    print(env)
    print(table)


if __name__ == "__main__":
    main()
