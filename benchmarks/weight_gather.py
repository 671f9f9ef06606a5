"""The FP8 all-gather of one sharded weight alone (`loka_compile.weight_gather`, what
`fp8_all_gather` runs in FSDP2's hooks) against FSDP2's bf16 all-gather, at LRM weight shapes:
what the gather saves, what the cast before it and the dequantization after it cost, and what
feeding the gathered FP8 weight straight to the GEMM would save (the dequantization, and the cast
the compiled graph makes of the gathered weight).

    python -m benchmarks.weight_gather --gpus 4 --out "$OUT"            # launches torchrun
    python -m benchmarks.weight_gather --gpus 2 --device cpu --shapes 256x128 --out /tmp/x   # gloo smoke

Per weight shape N x K (sharded along N over the ranks, bf16 as FSDP2's param_dtype gathers it),
the median of --repeats CUDA-event timings on rank 0 (each after --warmup untimed calls, the ranks
lined up by a barrier first), on fresh random weights (rows over 4 binades):

- bf16 all-gather: FSDP2's default (one all-gather of the bf16 shards);
- fp8 rowwise: cast the shard (one scale per row), one all-gather of the FP8 bytes and the scales
  packed as one uint8 buffer (as FSDP2 packs a group's inputs), then the dequantization to bf16:
  what `fp8_all_gather` runs; "no dequantize" stops after the gather (a GEMM fed the FP8 bytes);
- fp8 tensorwise: the shards' amax all-reduced, the cast, the all-gather, the dequantization;
- fp8 columnwise (the backward's re-gather for a rowwise dgrad): the K column amaxes all-reduced,
  the cast, the all-gather, the dequantization;
- dequantize alone (`weight_gather.dequantize_into`: one Triton pass on CUDA), the eager
  reference it replaced, and the GEMM's own rowwise cast of the gathered bf16 weight alone (what
  a direct feed would also save);
- the round trip a direct feed removes, per forward (dequantize, then the GEMM's rowwise re-cast)
  and per backward re-gather for a rowwise dgrad (dequantize the columnwise bytes, then the
  dgrad's columnwise re-cast), each checked to give back the gathered bytes and scales bit for bit
  (so a feed of the gathered FP8 weight that skips it changes nothing; docs/weight_gather_feed.md
  says why that feed is not built yet).

Each row has the bytes the all-gather moves (the whole gathered tensor), the least memory traffic
of the local forms (every input read once, every output written once), and the relative error
of the gathered weight against the bf16 one. Results: <out>/<name>.json and .md. NVLink multicast
is left off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.comm_exchange import _timed_us, add_launch_arguments, launch, run_worker, write_results
from loka_compile import comm
from loka_compile.kernels import triton_dequantize, triton_quant
from loka_compile.kernels.metrics import rel_error
from loka_compile.kernels.quantize import Fp8Format
from loka_compile.weight_gather import dequantize_into, quantize_shard

DTYPE = torch.bfloat16
FMT = Fp8Format.E4M3


def fresh_weight(rows: int, cols: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 4 - 2)
    return w.to(device=device, dtype=DTYPE)


def round_trip_bytes(rows: int, cols: int, scale_count: int) -> dict:
    """Least memory traffic (inputs read once, outputs written once) of a dequantization (the FP8
    bytes and `scale_count` fp32 scales in, the compute dtype out) and of the re-cast after it."""
    elements, scales = rows * cols, 4 * scale_count
    size = torch.empty((), dtype=DTYPE).element_size()
    dequantize_bytes = elements + scales + size * elements
    recast_bytes = size * elements + elements + scales
    return {"dequantize": dequantize_bytes, "recast": recast_bytes, "round_trip": dequantize_bytes + recast_bytes}


def measure(rows: int, cols: int, device: torch.device, repeats: int, warmup: int) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    if rows % world:
        raise ValueError(f"{rows} rows do not split evenly over {world} ranks")
    n = rows // world
    full = fresh_weight(rows, cols, 0, device)  # every rank makes the same weight
    shard = full[rank * n:(rank + 1) * n].contiguous()
    out = torch.empty(rows, cols, dtype=DTYPE, device=device)

    def bf16_gather():
        comm._all_gather(out.view(-1), shard.view(-1), None)
        return out

    def fp8_rowwise(dequantize=True):
        def run():
            q, scale = quantize_shard(shard, "rowwise", FMT)
            packed = torch.cat([q.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)])
            flat = torch.empty(world * packed.numel(), dtype=torch.uint8, device=device)
            comm._all_gather(flat, packed, None)
            gathered = flat.view(world, -1)
            if not dequantize:
                return None
            q_all = gathered[:, :n * cols].reshape(rows, cols).view(FMT.dtype)
            scales = gathered[:, n * cols:].contiguous().view(torch.float32).reshape(rows, 1)
            return dequantize_into(q_all, scales, DTYPE, out)
        return run

    def fp8_scaled_in_metadata(scaling):
        def run():
            q, scale = quantize_shard(shard, scaling, FMT)
            gathered = torch.empty(rows * cols, dtype=torch.uint8, device=device)
            comm._all_gather(gathered, q.view(torch.uint8).reshape(-1), None)
            return dequantize_into(gathered.view(FMT.dtype).view(rows, cols), scale, DTYPE, out)
        return run

    q_full, scale_full = quantize_shard(full, "rowwise", FMT)
    q_cols, scale_cols = quantize_shard(full, "columnwise", FMT)  # every rank holds all of `full`
    gathered_cols = torch.empty_like(out)
    forward_traffic, backward_traffic = round_trip_bytes(rows, cols, rows), round_trip_bytes(rows, cols, cols)

    def forward_round_trip():
        return triton_quant.quantize_rowwise(dequantize_into(q_full, scale_full, DTYPE, out), FMT.value)

    def backward_round_trip():
        return triton_quant.quantize_columnwise(dequantize_into(q_cols, scale_cols, DTYPE, gathered_cols), FMT.value)

    forward_trip = "today's round trip per forward: dequantize, the GEMM's rowwise re-cast"
    backward_trip = "today's round trip per backward (rowwise dgrad): dequantize, the dgrad's columnwise re-cast"
    round_trips = {forward_trip: (q_full, scale_full), backward_trip: (q_cols, scale_cols)}  # what they give back
    cases = {
        "bf16 all-gather": (bf16_gather, 2 * rows * cols),
        "fp8 rowwise: cast, all-gather, dequantize": (fp8_rowwise(), rows * cols + 4 * rows),
        "fp8 rowwise: cast, all-gather (no dequantize)": (fp8_rowwise(dequantize=False), rows * cols + 4 * rows),
        "fp8 tensorwise: amax all-reduce, cast, all-gather, dequantize": (fp8_scaled_in_metadata("tensorwise"),
                                                                          rows * cols),
        "fp8 columnwise (a rowwise dgrad's): column amax all-reduce, cast, all-gather, dequantize": (
            fp8_scaled_in_metadata("columnwise"), rows * cols),
        "dequantize alone": (lambda: dequantize_into(q_full, scale_full, DTYPE, out), 0),
        "dequantize alone, eager reference (five elementwise kernels, fp32 temporaries)": (
            lambda: triton_dequantize.dequantize_into_reference(q_full, scale_full, out), 0),
        "the GEMM's rowwise cast of the gathered weight alone": (
            lambda: triton_quant.quantize_rowwise(full, FMT.value), 0),
        forward_trip: (forward_round_trip, 0),
        backward_trip: (backward_round_trip, 0),
    }
    memory = {"dequantize alone": forward_traffic["dequantize"],
              "dequantize alone, eager reference (five elementwise kernels, fp32 temporaries)": (
                  forward_traffic["dequantize"]),
              "the GEMM's rowwise cast of the gathered weight alone": forward_traffic["recast"],
              forward_trip: forward_traffic["round_trip"], backward_trip: backward_traffic["round_trip"]}
    results = []
    for form, (run, gathered_bytes) in cases.items():
        value = run()
        error = rel_error(full, value) if form != "bf16 all-gather" and value is out else None
        if form == "bf16 all-gather":
            assert torch.equal(value, full)
        row = {"shape": f"{rows}x{cols}", "form": form, "us": _timed_us(run, device, repeats, warmup),
               "gathered_bytes": gathered_bytes, "memory_bytes": memory.get(form), "rel_error": error}
        if form in round_trips:
            (recast_q, recast_scale), (q, scale) = value, round_trips[form]
            row["bit_identical"] = bool(torch.equal(recast_scale, scale) and torch.equal(
                recast_q.view(torch.uint8), q.view(torch.uint8)))
        results.append(row)
    return results


def worker(args) -> None:
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    run_worker(args, lambda device: [row for n, k in shapes
                                     for row in measure(n, k, device, args.repeats, args.warmup)])


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"# FP8 weight all-gather vs bf16: {env['world_size']} ranks, {env['device']}", "",
             "| weight N x K | form | us (median) | vs bf16 all-gather | gathered MB | memory MB (least) "
             "| rel. error | gives back the gathered bytes and scales |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bf16 = next(x["us"] for x in rows if x["shape"] == r["shape"] and x["form"] == "bf16 all-gather")
        error = "" if r["rel_error"] is None else f"{r['rel_error']:.2e}"
        memory = "" if r.get("memory_bytes") is None else f"{r['memory_bytes'] / 1e6:.2f}"
        same = {True: "yes", False: "NO", None: ""}[r.get("bit_identical")]
        lines.append(f"| {r['shape']} | {r['form']} | {r['us']:.1f} | {bf16 / r['us']:.2f}x | "
                     f"{r['gathered_bytes'] / 1e6:.2f} | {memory} | {error} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4, help="ranks (one GPU each on CUDA)")
    parser.add_argument("--shapes", default="1024x512,2048x2048,4096x4096,8192x4096",
                        help="weights N x K, comma-separated; N a multiple of the ranks")
    add_launch_arguments(parser, "weight_gather", repeats=30)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    out, stem, rows, device = launch("benchmarks.weight_gather", args, "weight_gather", [f"--shapes={args.shapes}"])
    env = {"world_size": args.gpus, "device": device, "torch": torch.__version__, "dtype": "bfloat16",
           "format": FMT.value, "nccl_nvls_enable": "0", "repeats": args.repeats}
    return write_results(out, stem, env, rows, markdown)


if __name__ == "__main__":
    main()
