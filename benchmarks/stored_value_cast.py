"""What reading the stored value costs a fused cast: a bf16 LayerNorm -> ReLU whose output is
cast rowwise to e4m3 in the same Inductor kernel, with the cast reading the operand as stored
(`quantize.as_stored`: bf16 rounding by integer arithmetic, what loka's fused casts do) against
the cast reading Inductor's unrounded fp32 (what they did before), and the LayerNorm -> ReLU alone.

    python -m benchmarks.stored_value_cast --out DIR            # CUDA
    python -m benchmarks.stored_value_cast --tiny --out DIR     # CPU smoke run

Times are medians of `triton.testing.do_bench` (CUDA events) on fresh random inputs per shape,
every variant timed in the same run; each row also says whether the variant's FP8 bytes and scale
equal those of the stored bf16 value cast eagerly. Writes stored_value_cast.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from loka_compile.kernels.quantize import Fp8Format, as_stored, quantize_along

SHAPES = [(8192, 1024), (65536, 256), (65536, 1024), (16384, 4096)]
TINY_SHAPES = [(256, 64)]


def _norm_relu(x, weight, bias):
    return torch.relu(F.layer_norm(x, x.shape[-1:], weight, bias))


def _cast_stored(x, weight, bias):
    y = _norm_relu(x, weight, bias)
    return (y, *quantize_along(as_stored(y), -1, Fp8Format.E4M3))


def _cast_unrounded(x, weight, bias):
    y = _norm_relu(x, weight, bias)
    return (y, *quantize_along(y.float(), -1, Fp8Format.E4M3))


VARIANTS = {"norm_relu": _norm_relu, "cast_stored": _cast_stored, "cast_unrounded": _cast_unrounded}


def _median_ms(fn, args, device) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(lambda: fn(*args), return_mode="median"))
    import time
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    rows = []
    for rows_n, width in TINY_SHAPES if args.tiny else SHAPES:
        x = torch.randn(rows_n, width, device=device, dtype=torch.bfloat16)
        weight = torch.randn(width, device=device, dtype=torch.bfloat16)
        bias = torch.randn(width, device=device, dtype=torch.bfloat16)
        stored_q, stored_scale = quantize_along(_norm_relu(x, weight, bias), -1, Fp8Format.E4M3)
        row = {"rows": rows_n, "width": width}
        for name, fn in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="inductor", fullgraph=True)
            out = compiled(x, weight, bias)
            row[f"{name}_ms"] = round(_median_ms(compiled, (x, weight, bias), device), 4)
            if name != "norm_relu":
                row[f"{name}_bits_as_stored"] = bool(torch.equal(out[2], stored_scale) and torch.equal(
                    out[1].view(torch.uint8), stored_q.view(torch.uint8)))
        row["stored_over_unrounded"] = round(row["cast_stored_ms"] / row["cast_unrounded_ms"], 3)
        rows.append(row)
        print(row, flush=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stored_value_cast.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    table = tabulate([list(r.values()) for r in rows], headers=list(rows[0]), tablefmt="github")
    (out / "stored_value_cast.md").write_text(f"{env}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
