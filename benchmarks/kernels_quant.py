"""Bandwidth of loka's FP8 quantization kernels on the GPU (the LayerNorm backward has its own,
`benchmarks/layernorm_backward.py`).

Rows are dicts. GB/s counts the fewest bytes each op must move (every input read once,
every output written once, scales included); `% copy` divides by the device-to-device
copy bandwidth measured in the same run (bytes read + written). Kernels that must read x
twice (tensorwise: the amax precedes the cast; dual-axis: a column scale spans all rows)
also report the bytes they actually move. Medians of triton.testing.do_bench.

    python -m benchmarks.kernels_quant          # writes benchmarks/results/<date>_<gpu>_kernels_quant.{json,md}
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib

import torch
import triton
from tabulate import tabulate

from loka_compile.kernels import triton_quant as tq
from loka_compile.kernels.quantize import Fp8Format, quantize_along, quantize_blockwise, quantize_tensorwise

QUANT_SHAPE = (32768, 4096)
E4M3 = Fp8Format.E4M3


def _bench(fn) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def _row(name, ms, min_bytes, copy_gbs, actual_bytes=None, **extra):
    gbs = min_bytes / ms / 1e6
    row = dict(op=name, us=round(ms * 1e3, 1), gbs=round(gbs, 1), pct_copy=round(100 * gbs / copy_gbs, 1))
    if actual_bytes is not None:
        actual = actual_bytes / ms / 1e6
        row.update(actual_gbs=round(actual, 1), actual_pct_copy=round(100 * actual / copy_gbs, 1))
    row.update(extra)
    return row


def quant_rows(copy_gbs: float, shape=QUANT_SHAPE) -> list[dict]:
    m, k = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = m * k
    rows = []

    def add(name, fn, ref_fn, min_bytes, actual=None, **extra):
        ms = _bench(fn)
        ref_ms = _bench(ref_fn) if ref_fn is not None else None
        rows.append(_row(name, ms, min_bytes, copy_gbs, actual, shape=f"{m}x{k}",
                         inductor_ref_us=None if ref_ms is None else round(ref_ms * 1e3, 1),
                         speedup_vs_inductor_ref=None if ref_ms is None else round(ref_ms / ms, 2), **extra))

    ref_row = torch.compile(lambda t: quantize_along(t, -1, E4M3))
    ref_col = torch.compile(lambda t: quantize_along(t, -2, E4M3))
    ref_tensor = torch.compile(lambda t: quantize_tensorwise(t, E4M3))
    ref_block = torch.compile(lambda t: quantize_blockwise(t, 1, 128, E4M3))
    ref_wblock = torch.compile(lambda t: quantize_blockwise(t, 128, 128, E4M3))
    ref_dual = torch.compile(lambda t: (quantize_along(t, -1, E4M3), quantize_along(t, -2, E4M3)))

    add("rowwise", lambda: tq.quantize_rowwise_triton(x, "e4m3"), lambda: ref_row(x), n * 3 + m * 4)
    for cfg in ([dict(BLOCK_R=r, BLOCK_C=4096, SINGLE_PASS=True, num_warps=w) for r, w in
                 ((1, 4), (1, 8), (2, 8), (4, 8), (4, 16))]):
        add("rowwise sweep", lambda cfg=cfg: tq.quantize_rowwise_triton(x, "e4m3", config=cfg), None,
            n * 3 + m * 4, config=str(cfg))
    xt = x.t()  # a column-major [K, N] B operand
    add("columnwise (col-major B)", lambda: tq.quantize_columnwise_triton(xt, "e4m3"), lambda: ref_col(xt),
        n * 3 + m * 4)
    add("columnwise (row-major B)", lambda: tq.quantize_columnwise_triton(x, "e4m3"), lambda: ref_col(x),
        n * 3 + k * 4, actual=n * 5)
    add("tensorwise", lambda: tq.quantize_tensorwise_triton(x, "e4m3"), lambda: ref_tensor(x), n * 3, actual=n * 5)
    add("blockwise 1x128", lambda: tq.quantize_blockwise_triton(x, 1, 128, "e4m3"), lambda: ref_block(x),
        n * 3 + n // 128 * 4)
    for tile_rows in (16, 64):
        add("blockwise 1x128 sweep", lambda t=tile_rows: tq.quantize_blockwise_triton(x, 1, 128, "e4m3", tile_rows=t),
            None, n * 3 + n // 128 * 4, config=f"tile_rows={tile_rows}")
    add("blockwise 128x128", lambda: tq.quantize_blockwise_triton(x, 128, 128, "e4m3"), lambda: ref_wblock(x),
        n * 3 + n // 16384 * 4)
    add("dual-axis", lambda: tq.quantize_dual_axis_triton(x, "e4m3"), lambda: ref_dual(x),
        n * 4 + (m + k) * 4, actual=n * 6)
    for cast in (dict(BLOCK_M=64, BLOCK_K=128, num_warps=8), dict(BLOCK_M=128, BLOCK_K=64, num_warps=8),
                 dict(BLOCK_M=32, BLOCK_K=128, num_warps=4)):
        add("dual-axis sweep", lambda c=cast: tq.quantize_dual_axis_triton(x, "e4m3", cast_config=c), None,
            n * 4 + (m + k) * 4, actual=n * 6, config=str(cast))
    return rows


def env() -> dict:
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat())


def main() -> dict:
    copy_gbs = copy_bandwidth_gbs()
    rows = [dict(op="device-to-device copy (1 GiB)", gbs=round(copy_gbs, 1), pct_copy=100.0)]
    rows += quant_rows(copy_gbs)
    result = {"env": env(), "rows": rows}
    gpu = "H100" if "H100" in result["env"]["device"] else result["env"]["device"].replace(" ", "_")
    stem = f"{result['env']['date']}_{gpu}_kernels_quant"
    table = tabulate(rows, headers="keys", tablefmt="github")
    for folder in filter(None, [pathlib.Path(__file__).parent / "results", os.environ.get("OUT")]):
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (folder / f"{stem}.md").write_text(f"{result['env']}\n\n{table}\n")
    short = [{k: r.get(k) for k in ("op", "us", "gbs", "pct_copy", "actual_pct_copy", "speedup_vs_inductor_ref",
                                     "config")} for r in rows]
    print(tabulate(short, headers="keys", tablefmt="github"))
    return result


if __name__ == "__main__":
    main()
