"""Host time per compiled-graph call, loka against Inductor, once loka's probe window has closed.

A model that is host-bound (many small graphs between eager code: DIN's five graph breaks and
eager embeddings) pays every microsecond the backend spends in Python around a graph call. This
measures that time on a toy model whose graphs compute next to nothing: a chain of
`--graphs` Linear -> ReLU blocks of width `--width` with a graph break between blocks, trained
(forward, backward of the sum) on a [`--batch`, width] input, so each step calls
`--graphs` forward and `--graphs` backward graphs.

Configs, all compiled in one process and timed in alternating rounds (the order reversed every
other round, to cancel drift):
- inductor: `backend="inductor"`;
- loka_hp: loka's defaults with every site too small for FP8 (`min_gemm_dim` above the
  width), so its graphs run the same kernels as Inductor's and the difference is loka's host
  time: its compiled-graph wrapper, the backward's first-run wrapper, anything per call;
- loka: loka's defaults (FP8 emulated on CPU, real on FP8 GPUs: other kernels, so its step
  time is not host time alone);
- loka_tensorwise: loka's tensorwise recipe, whose sites carry the amax guard read between calls.

Per config: the median step time, wall and the thread's CPU time (on a shared machine the
CPU time is the steadier measure of host work), per graph call (step / (2 x graphs)), and the
difference per graph call against Inductor. Per loka config also the CPU time of loka's own
per-call Python: the config timed again with its wrappers reduced to calling the variant
(`bare_dispatch`), in the same rounds. And the host reads made during steady-state steps
(`HostReads`: `.item()`, `.tolist()`, `bool()`, `.cpu()`, `.numpy()`, synchronizations), by
the code that made them. On CUDA each of those waits for the device; on CPU they are counted
all the same, so a read that would sync on a GPU shows on a CPU machine.

    python -m benchmarks.host_overhead --out benchmarks/results/2026-11-28_cpu_host_overhead
    python -m benchmarks.host_overhead --device cuda --mode reduce-overhead --out $OUT/host_overhead
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.linear(x))


class BrokenChain(nn.Module):
    """Six blocks with a graph break after each of the first five: six forward graphs, six backward."""

    GRAPHS = 6

    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(self.GRAPHS))

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        torch._dynamo.graph_break()
        x = self.blocks[2](x)
        torch._dynamo.graph_break()
        x = self.blocks[3](x)
        torch._dynamo.graph_break()
        x = self.blocks[4](x)
        torch._dynamo.graph_break()
        return self.blocks[5](x)


# Names of the methods and functions that read a device value on the host (a sync on CUDA).
_TENSOR_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
_SYNCS = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"))


def _callers(frame, depth: int = 3) -> str:
    """"file:function < its caller < ..." for `depth` frames from `frame`."""
    names = []
    while frame is not None and len(names) < depth:
        names.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names)


class HostReads:
    """Counts host reads of tensor values and device synchronizations while active, by
    (what, the code that made it: "file:function < its caller < ..."). Patches the methods on
    `torch.Tensor` and the synchronize functions, and restores them on exit."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._saved = []

    def _wrap(self, owner, name: str):
        original = getattr(owner, name)
        counts = self.counts

        def counted(*args, **kwargs):
            counts[(name, _callers(sys._getframe(1)))] += 1
            return original(*args, **kwargs)

        torch.compiler.disable(counted, recursive=False)  # called from a compiled frame's eager code: not traced

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self) -> "HostReads":
        for name in _TENSOR_READS:
            self._wrap(torch.Tensor, name)
        for owner, name in _SYNCS:
            self._wrap(owner, name)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def total(self) -> int:
        return sum(self.counts.values())

    def by_caller(self) -> dict:
        return {f"{what} in {where}": n for (what, where), n in sorted(self.counts.items())}


def loka_options(config: str, width: int) -> dict | None:
    if config == "inductor":
        return None
    options = {"loka_hp": {"min_gemm_dim": 2 * width}, "loka": {}, "loka_tensorwise": {"recipe": "tensorwise"}}
    return options[config]


def build(config: str, width: int, mode: str, device: torch.device, seed: int):
    """(the compiled model, its eager model) of one config, seeded alike."""
    torch.manual_seed(seed)
    model = BrokenChain(width).to(device)
    options = loka_options(config, width)
    if options is None:
        compiled = torch.compile(model, backend="inductor", mode=None if mode == "default" else mode)
    else:
        compiled = torch.compile(model, backend="loka", options={**options, "mode": mode})
    return compiled, model


@contextlib.contextmanager
def bare_dispatch():
    """loka's per-call wrappers reduced to what any backend's must do: call the running variant
    (`LokaCompiledGraph`), the compiled backward (`BackwardFirstRun`). Only for timing a model
    whose variants have all run once: it skips the window, re-checks, guards and fallbacks."""
    from loka_compile.compiled_graph import LokaCompiledGraph
    from loka_compile.inductor_compile import BackwardFirstRun

    saved = LokaCompiledGraph.__call__, BackwardFirstRun.__call__
    LokaCompiledGraph.__call__ = lambda self, *args: self.variants[self.record.phase](*args)
    BackwardFirstRun.__call__ = lambda self, inputs: self.compiled(inputs)
    try:
        yield
    finally:
        LokaCompiledGraph.__call__, BackwardFirstRun.__call__ = saved


def train_step(compiled, x: torch.Tensor, cudagraphs: bool) -> None:
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    compiled(x).sum().backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(configs: list, args) -> dict:
    device = torch.device(args.device)
    cudagraphs = device.type == "cuda" and args.mode == "reduce-overhead"
    x = torch.randn(args.batch, args.width, device=device)
    models = {}
    for name in configs:
        compiled, _ = build(name, args.width, args.mode, device, args.seed)
        start = time.perf_counter()
        for _ in range(args.warmup):  # the probe window, the FP8 compile, CUDA-graph recording
            train_step(compiled, x, cudagraphs)
        _sync(device)
        models[name] = compiled
        print(f"{name}: compiled and warmed up in {time.perf_counter() - start:.1f} s", flush=True)
    reads = {}
    for name, compiled in models.items():
        with HostReads() as counter:
            for _ in range(args.read_steps):
                train_step(compiled, x, cudagraphs)
        reads[name] = {"per_step": counter.total() / args.read_steps, "by_caller": counter.by_caller()}
    # Each loka config is timed twice: as it runs, and with its wrappers reduced to the dispatch
    # they must do (`bare_dispatch`); the difference is loka's own Python per call.
    entries = [(name, False) for name in configs] + [(name, True) for name in configs if name != "inductor"]
    wall = {entry: [] for entry in entries}
    cpu = {entry: [] for entry in entries}
    for round_ in range(args.rounds):
        for entry in (entries if round_ % 2 == 0 else entries[::-1]):
            name, bare = entry
            compiled = models[name]
            _sync(device)
            with bare_dispatch() if bare else contextlib.nullcontext():
                start, start_cpu = time.perf_counter(), time.thread_time()
                for _ in range(args.steps):
                    train_step(compiled, x, cudagraphs)
                _sync(device)
                end, end_cpu = time.perf_counter(), time.thread_time()
            wall[entry].append((end - start) / args.steps * 1e6)
            cpu[entry].append((end_cpu - start_cpu) / args.steps * 1e6)
    calls = 2 * BrokenChain.GRAPHS
    median = statistics.median
    base = (median(wall[("inductor", False)]), median(cpu[("inductor", False)])) if "inductor" in configs else None
    rows = []
    for name in configs:
        step_us, step_cpu_us = median(wall[(name, False)]), median(cpu[(name, False)])
        row = {"config": name, "loka_options": loka_options(name, args.width),
               "step_us": step_us, "step_cpu_us": step_cpu_us, "us_per_graph_call": step_us / calls,
               "cpu_us_per_graph_call": step_cpu_us / calls,
               "extra_us_per_graph_call_vs_inductor": None if base is None else (step_us - base[0]) / calls,
               "extra_cpu_us_per_graph_call_vs_inductor": None if base is None else (step_cpu_us - base[1]) / calls,
               "loka_wrapper_cpu_us_per_graph_call": None,
               "host_reads_per_step": reads[name]["per_step"], "host_reads": reads[name]["by_caller"]}
        if name != "inductor":
            row["loka_wrapper_cpu_us_per_graph_call"] = (step_cpu_us - median(cpu[(name, True)])) / calls
        rows.append(row)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "mode": args.mode, "width": args.width, "batch": args.batch,
            "graph_calls_per_step": calls, "steps_per_round": args.steps, "rounds": args.rounds,
            "threads": torch.get_num_threads(), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Host time per graph call: BrokenChain ({BrokenChain.GRAPHS} forward + {BrokenChain.GRAPHS} backward "
             f"graphs per step), width {result['width']}, batch {result['batch']}, {result['device']}, torch "
             f"{result['torch']}, mode {result['mode']}, {result['threads']} thread(s); medians of {result['rounds']} "
             f"rounds of {result['steps_per_round']} steps", "",
             "| config | step us (wall) | step us (thread CPU) | us per graph call (wall / CPU) | "
             "extra us per graph call vs Inductor (wall / CPU) | loka wrappers, CPU us per graph call | "
             "host reads per step |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        extra, extra_cpu = row["extra_us_per_graph_call_vs_inductor"], row["extra_cpu_us_per_graph_call_vs_inductor"]
        wrappers = row["loka_wrapper_cpu_us_per_graph_call"]
        lines.append(f"| {row['config']} | {row['step_us']:.1f} | {row['step_cpu_us']:.1f} | "
                     f"{row['us_per_graph_call']:.2f} / {row['cpu_us_per_graph_call']:.2f} | "
                     f"{'' if extra is None else f'{extra:+.2f} / {extra_cpu:+.2f}'} | "
                     f"{'' if wrappers is None else f'{wrappers:+.2f}'} | {row['host_reads_per_step']:g} |")
    reads = [(row["config"], what, n) for row in result["rows"] for what, n in row["host_reads"].items()]
    if reads:
        lines += ["", "Host reads in steady-state steps, by caller:", ""]
        lines += [f"- {config}: {what}: {n}" for config, what, n in reads]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="inductor,loka_hp,loka,loka_tensorwise")
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="default", help="torch.compile mode (reduce-overhead: CUDA graphs on CUDA)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (loka's window closes at step 3)")
    p.add_argument("--steps", type=int, default=300, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--read-steps", type=int, default=20, help="steady-state steps whose host reads are counted")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (tiny tensors: 1 is fastest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure([c for c in args.configs.split(",") if c], args)
    table = markdown(result)
    print(table)
    if args.out:
        stem = Path(args.out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
