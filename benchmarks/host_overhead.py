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

Per config: the median step's wall time, and the thread's CPU time of the forward graph calls
and of the backward, per graph call (on a shared machine CPU time is the steadier measure of
host work; on CUDA without CUDA graphs the backward's includes launching its kernels), and
their difference against Inductor's. Per loka config also the CPU time of loka's own Python
around a forward and a backward graph call, timed alone on the model's graph objects
(`wrapper_costs`: the variant a no-op), which no noise of the machine hides. And the host
reads made during steady-state steps (`HostReads`: `.item()`, `.tolist()`, `bool()`, `.cpu()`,
`.numpy()`, synchronizations), by the code that made them. On CUDA each of those waits for the
device; on CPU they are counted all the same, so a read that would sync on a GPU shows on a
CPU machine.

    python -m benchmarks.host_overhead --out benchmarks/results/2026-11-28_cpu_host_overhead
    python -m benchmarks.host_overhead --device cuda --mode reduce-overhead --out $OUT/host_overhead
"""

from __future__ import annotations

import argparse
import collections
import gc
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


def _noop(*args):
    return None


def _per_call_us(fn, args: tuple, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn(*args)
    return (time.thread_time() - start) / calls * 1e6


def wrapper_costs(compiled, calls: int) -> dict:
    """loka's own Python around each graph call of `compiled`, timed alone in CPU us per call:
    every forward graph (`LokaCompiledGraph`) with its running variant replaced by a no-op that
    AOTAutograd's `disable` wraps, as it wraps a compiled graph, called through `disable` as
    Dynamo calls it; every compiled backward's first-run wrapper (`BackwardFirstRun`) around a
    no-op, called through `disable` as AOTAutograd calls it. Each less the same no-op called
    through one `disable` (what Inductor's call costs besides the graph). Restores what it
    replaced."""
    from loka_compile.compiled_graph import LokaCompiledGraph
    from loka_compile.inductor_compile import BackwardFirstRun
    from loka_compile.state import state_of

    records = {id(record) for record in state_of(compiled).records}
    baseline = _per_call_us(torch._dynamo.disable(_noop), (), calls)
    forward, backward = [], []
    for graph in [o for o in gc.get_objects() if type(o) is LokaCompiledGraph and id(o.record) in records]:
        saved, variants, first_runs = dict(graph.__dict__), dict(graph.variants), set(graph._first_runs)
        variant = torch._dynamo.disable(_noop)
        graph.variants[graph.record.phase] = variant
        graph._first_runs.add(id(variant))
        if "_steady" in saved:
            graph._steady = None
        try:
            called = torch._dynamo.disable(graph)
            called()  # the first call may settle (`LokaCompiledGraph._settle`)
            forward.append(_per_call_us(called, (), calls) - baseline)
        finally:
            graph.__dict__.clear()
            graph.__dict__.update(saved)
            graph.variants, graph._first_runs = variants, first_runs
    for wrapper in [o for o in gc.get_objects() if type(o) is BackwardFirstRun and id(o._record) in records]:
        kept = wrapper.compiled
        wrapper.compiled = _noop
        try:
            backward.append(_per_call_us(torch._dynamo.disable(wrapper), ([],), calls) - baseline)
        finally:
            wrapper.compiled = kept
    mean = statistics.fmean
    return {"forward_us": mean(forward) if forward else None, "backward_us": mean(backward) if backward else None,
            "forward_graphs": len(forward), "backward_graphs": len(backward), "disable_us": baseline}


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
    wall = {name: [] for name in configs}
    forward_cpu = {name: [] for name in configs}
    backward_cpu = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name in (configs if round_ % 2 == 0 else configs[::-1]):
            compiled = models[name]
            forward = backward = 0.0
            _sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                began = time.thread_time()
                out = compiled(x)
                between = time.thread_time()
                out.sum().backward()
                forward, backward = forward + between - began, backward + time.thread_time() - between
            _sync(device)
            wall[name].append((time.perf_counter() - start) / args.steps * 1e6)
            forward_cpu[name].append(forward / args.steps / BrokenChain.GRAPHS * 1e6)
            backward_cpu[name].append(backward / args.steps / BrokenChain.GRAPHS * 1e6)
    median = statistics.median
    rows = []
    for name in configs:
        row = {"config": name, "loka_options": loka_options(name, args.width), "step_us": median(wall[name]),
               "forward_cpu_us_per_graph": median(forward_cpu[name]),
               "backward_cpu_us_per_graph": median(backward_cpu[name]),
               "extra_forward_cpu_us_vs_inductor": None, "extra_backward_cpu_us_vs_inductor": None,
               "loka_wrappers": None if name == "inductor" else wrapper_costs(models[name], args.wrapper_calls),
               "host_reads_per_step": reads[name]["per_step"], "host_reads": reads[name]["by_caller"]}
        if "inductor" in configs:
            row["extra_forward_cpu_us_vs_inductor"] = row["forward_cpu_us_per_graph"] - median(forward_cpu["inductor"])
            row["extra_backward_cpu_us_vs_inductor"] = \
                row["backward_cpu_us_per_graph"] - median(backward_cpu["inductor"])
        rows.append(row)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "mode": args.mode, "width": args.width, "batch": args.batch,
            "graphs": BrokenChain.GRAPHS, "steps_per_round": args.steps, "rounds": args.rounds,
            "threads": torch.get_num_threads(), "rows": rows}


def _wrapper_cell(costs) -> str:
    if costs is None:
        return ""
    return " / ".join("" if costs[key] is None else f"{costs[key]:+.2f}" for key in ("forward_us", "backward_us"))


def markdown(result: dict) -> str:
    lines = [f"Host time per graph call: BrokenChain ({result['graphs']} forward + {result['graphs']} backward graphs "
             f"per step), width {result['width']}, batch {result['batch']}, {result['device']}, torch "
             f"{result['torch']}, mode {result['mode']}, {result['threads']} thread(s); medians of {result['rounds']} "
             f"rounds of {result['steps_per_round']} steps. CPU: the thread's CPU time. A backward call's time "
             "includes the autograd engine's share of the step's backward.", "",
             "| config | step us (wall) | CPU us per forward / backward graph call | extra CPU us per forward / "
             "backward call vs Inductor | loka's wrappers alone, CPU us per forward / backward call | "
             "host reads per step |",
             "|---|---|---|---|---|---|"]
    if result.get("note"):
        lines[1:1] = ["", result["note"]]
    for row in result["rows"]:
        extra = row["extra_forward_cpu_us_vs_inductor"], row["extra_backward_cpu_us_vs_inductor"]
        lines.append(f"| {row['config']} | {row['step_us']:.1f} | {row['forward_cpu_us_per_graph']:.2f} / "
                     f"{row['backward_cpu_us_per_graph']:.2f} | "
                     f"{'' if extra[0] is None else f'{extra[0]:+.2f} / {extra[1]:+.2f}'} | "
                     f"{_wrapper_cell(row['loka_wrappers'])} | {row['host_reads_per_step']:g} |")
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
    p.add_argument("--wrapper-calls", type=int, default=20000, help="calls per graph timing loka's wrappers alone")
    p.add_argument("--read-steps", type=int, default=20, help="steady-state steps whose host reads are counted")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (tiny tensors: 1 is fastest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    p.add_argument("--note", default="", help="a line for the results (which code was measured)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure([c for c in args.configs.split(",") if c], args)
    result["note"] = args.note
    table = markdown(result)
    print(table)
    if args.out:
        stem = Path(args.out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
