"""Inductor code generations and CPU seconds of the step that closes loka's probe window, in a
CUDA-graph mode with the graph speed check timing the FP8 variant against high precision.

A small MLP (Linear -> LayerNorm -> ReLU blocks) trains a few steps under loka in
`reduce-overhead` mode with `graph_speed_check="always"`; the step after the probe window
compiles the FP8 variant and runs the check. Counted: Inductor scheduler constructions (one per
forward or backward graph Inductor generates code for), per step, and each step's CPU seconds
(this process and its finished children: Inductor's compile workers). bf16 on CUDA, fp32 on CPU.

    python -m benchmarks.window_close_compiles                # CPU: the captured timing stood in for
    python -m benchmarks.window_close_compiles --out $OUT     # GPU: the real check
    python -m benchmarks.window_close_compiles --keep hp      # CPU: high precision made to win

On CPU the check would not time (FP8 is emulated), and a CPU has no CUDA graphs: the check's
CUDA-graph path is forced (`graph_speed.captures`), and the verdict made by `--keep` (the steps
still run for real). Run each configuration in a fresh process with an empty
TORCHINDUCTOR_CACHE_DIR and LOKA_CACHE_DIR for a cold start.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import time
from pathlib import Path

import torch
import torch.nn as nn


class Blocks(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--probe-steps", type=int, default=2)
    parser.add_argument("--keep", choices=("fp8", "hp"), default="fp8",
                        help="off CUDA: the verdict the stood-in timing gives (on CUDA the check times for real)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from torch._inductor import scheduler

    from loka_compile import graph_speed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
        graph_speed.captures = lambda mode, dev: True
        fp8_ms, hp_ms = (1.0, 2.0) if args.keep == "fp8" else (2.0, 1.0)

        def time_steps(steps, dev, captured):
            for step in steps.values():
                step()
            return {"fp8": [fp8_ms] * graph_speed.ROUNDS, "hp": [hp_ms] * graph_speed.ROUNDS}

        graph_speed.time_steps = time_steps

    codegens = collections.Counter()  # step -> scheduler constructions
    current = 0
    real_init = scheduler.Scheduler.__init__

    def counting_init(self, *a, **k):
        codegens[current] += 1
        return real_init(self, *a, **k)

    scheduler.Scheduler.__init__ = counting_init

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Blocks(args.width, args.depth).to(device, dtype)
    options = {"mode": "reduce-overhead", "probe_steps": args.probe_steps, "graph_speed_check": "always",
               "max_output_error": None}
    compiled = torch.compile(model, backend="loka", options=options)
    rows = []
    for step in range(args.steps):
        current = step + 1
        x = torch.randn(args.batch, args.width, device=device, dtype=dtype)
        start_cpu, start_wall = cpu_seconds(), time.perf_counter()
        compiled(x).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"step": current, "cpu_s": round(cpu_seconds() - start_cpu, 3),
                     "wall_s": round(time.perf_counter() - start_wall, 3), "codegens": codegens[current]})

    import loka_compile

    (graph,) = loka_compile.report(compiled).graphs
    result = {"device": str(device), "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
              "steps": rows, "codegens": sum(codegens.values()),
              "kept": graph.graph_speed.kept if graph.graph_speed else None}
    lines = ["| step | CPU s | wall s | Inductor codegens |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['cpu_s']} | {r['wall_s']} | {r['codegens']} |" for r in rows]
    lines.append(f"\n{result['codegens']} codegens in all; the graph speed check kept {result['kept']}")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"window_close_compiles_{device.type}_{args.keep}"
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
