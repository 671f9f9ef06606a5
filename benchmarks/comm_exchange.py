"""The FP8 gradient exchange alone (`loka_compile.comm.fp8_all_reduce`, `fp8_reduce_scatter`)
against NCCL's all-reduce and reduce-scatter in fp32 and bf16, at gradient-bucket sizes: the
time `fp8_gradient_comm`'s window weighs, and the error it bounds.

    python -m benchmarks.comm_exchange --gpus 2 --out "$OUT"            # launches torchrun
    python -m benchmarks.comm_exchange --gpus 2 --device cpu --sizes 1,4 --out /tmp/x   # gloo smoke

Per size (MB of fp32 gradients) and collective: the median of --repeats CUDA-event timings on
rank 0 (each after --warmup untimed calls; the ranks lined up by a barrier first), the bytes one
rank sends, and the relative error of the result against the fp64 reduction, on fresh random
gradients (each rank its own, at a rank-dependent scale). fp32 runs in place, divided first (DDP's
default hook); bf16 includes the cast from fp32 (DDP's bf16 compression hook). Results: <out>/<name>.json and .md.
NVLink multicast is left off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loka_compile import comm
from loka_compile.kernels.metrics import rel_error

BLOCK = 128


def _timed_us(fn, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def measure(size_mb: float, device: torch.device, repeats: int, warmup: int) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = int(size_mb * 1e6 / 4) // (world * BLOCK) * (world * BLOCK)
    grads = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 2.0 ** rank).to(device)
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)
    mean = torch.stack(everyone).double().mean(0)
    mine = mean.view(world, -1)[rank]
    shard = numel // world

    # fp32: in place on a working copy, divided first, as DDP's default hook does; bf16: the cast
    # from the fp32 gradients included, as DDP's bf16 compression hook does.
    work = grads.clone()

    def all_reduce(dtype):
        def run():
            x = work if dtype == torch.float32 else grads.to(dtype)
            x.div_(world)
            dist.all_reduce(x)
            return x
        return run

    def reduce_scatter(dtype):
        def run():
            out = torch.empty(shard, dtype=dtype, device=device)
            comm._reduce_scatter(out, grads if dtype == torch.float32 else grads.to(dtype), dist.ReduceOp.SUM, None)
            return out.div_(world)
        return run

    cases = {("all_reduce", "fp32"): all_reduce(torch.float32), ("all_reduce", "bf16"): all_reduce(torch.bfloat16),
             ("all_reduce", "fp8 exchange, e4m3 gather"): lambda: comm.fp8_all_reduce(grads, None, BLOCK, "e4m3"),
             ("all_reduce", "fp8 exchange, bf16 gather"): lambda: comm.fp8_all_reduce(grads, None, BLOCK, "bf16"),
             ("reduce_scatter", "fp32"): reduce_scatter(torch.float32),
             ("reduce_scatter", "bf16"): reduce_scatter(torch.bfloat16),
             ("reduce_scatter", "fp8 exchange"): lambda: comm.fp8_reduce_scatter(
                 torch.empty(shard, device=device), grads, None, BLOCK, average=True)}
    rows = []
    for (collective, form), run in cases.items():
        reference = mean if collective == "all_reduce" else mine
        work.copy_(grads)
        error = rel_error(reference, run())
        us = _timed_us(run, device, repeats, warmup)
        gather = "bf16" if "bf16 gather" in form else "e4m3"
        hp32, fp8 = comm.wire_bytes(collective, numel, 4, world, BLOCK, gather)
        sent = {"fp32": hp32, "bf16": hp32 // 2}.get(form, fp8)
        rows.append({"size_mb": size_mb, "elements": numel, "collective": collective, "form": form, "us": us,
                     "wire_bytes_per_rank": sent, "rel_error": error})
    return rows


def run_worker(args, measure_all) -> None:
    """One rank of a `launch`ed benchmark: join the process group, `measure_all(device)` (the
    rows), rank 0 writes them to `args.rows_file`."""
    from examples.distributed import init_process_group

    device = init_process_group(args.device)
    try:
        rows = measure_all(device)
        if dist.get_rank() == 0:
            Path(args.rows_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def worker(args) -> None:
    run_worker(args, lambda device: [row for size in args.sizes.split(",")
                                     for row in measure(float(size), device, args.repeats, args.warmup)])


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"# FP8 gradient exchange vs NCCL collectives: {env['world_size']} ranks, {env['device']}", "",
             "| MB (fp32) | collective | form | us (median) | vs fp32 | wire MB/rank | rel. error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        fp32 = next(x["us"] for x in rows if x["size_mb"] == r["size_mb"] and x["collective"] == r["collective"]
                    and x["form"] == "fp32")
        lines.append(f"| {r['size_mb']:g} | {r['collective']} | {r['form']} | {r['us']:.1f} | {fp32 / r['us']:.2f}x | "
                     f"{r['wire_bytes_per_rank'] / 1e6:.2f} | {r['rel_error']:.2e} |")
    return "\n".join(lines) + "\n"


def add_launch_arguments(parser: argparse.ArgumentParser, what: str, repeats: int) -> None:
    """The options every launcher of a per-rank benchmark takes (`launch`)."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--name", default=None, help=f"file stem instead of <date>_{what}_<N>ranks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)


def launch(module: str, args: argparse.Namespace, what: str, worker_arguments: list) -> tuple:
    """Run `module --worker` on `args.gpus` ranks (torchrun, NVLink multicast off); return the
    output folder, the file stem, the rows rank 0 wrote and the device's name."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{time.strftime('%Y-%m-%d')}_{what}_{args.gpus}ranks"
    rows_file = out / f"{stem}.rows.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               "-m", module, "--worker", "--rows-file", str(rows_file), *worker_arguments,
               f"--repeats={args.repeats}", f"--warmup={args.warmup}", f"--device={args.device}"]
    subprocess.run(command, env=dict(os.environ, NCCL_NVLS_ENABLE="0"), check=True)
    rows = json.loads(rows_file.read_text())
    rows_file.unlink()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else "CPU"
    return out, stem, rows, device


def write_results(out: Path, stem: str, env: dict, rows: list, markdown) -> Path:
    """The run's JSON and markdown table under `out`; the table is printed too."""
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    table = markdown(env, rows)
    (out / f"{stem}.md").write_text(table)
    print(table)
    return out / f"{stem}.json"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="ranks (one GPU each on CUDA)")
    parser.add_argument("--sizes", default="1,4,25,100", help="gradient MB (fp32) per call; 25: DDP's bucket")
    add_launch_arguments(parser, "comm_exchange", repeats=20)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    out, stem, rows, device = launch("benchmarks.comm_exchange", args, "comm_exchange", [f"--sizes={args.sizes}"])
    env = {"world_size": args.gpus, "device": device, "torch": torch.__version__, "block": BLOCK,
           "nccl_nvls_enable": "0", "repeats": args.repeats}
    return write_results(out, stem, env, rows, markdown)


if __name__ == "__main__":
    main()
