"""Train recommendation models with loka on several processes (DDP or FSDP2) on synthetic
data, and print the step time and the held-out NE on rank 0.

    torchrun --nproc-per-node 2 examples/distributed.py --device cpu --steps 6 --batch 32
    torchrun --nproc-per-node 4 examples/distributed.py --strategy fsdp2 --steps 500
    torchrun --nproc-per-node 4 examples/distributed.py --backend inductor   # the bf16 baseline
    torchrun --nproc-per-node 4 examples/distributed.py --fp8-comm   # gradients in FP8 where measured safe and faster
    torchrun --nproc-per-node 4 examples/distributed.py --strategy fsdp2 --fp8-all-gather   # weights gathered in FP8

A model is cut into parts (a zoo model: its embedding tables and its dense arch; a public
model: its top-level submodules). The parts with GEMMs are compiled one by one (a zoo
model's tables stay eager, as production runs them), then the model is wrapped: `ddp` puts
it under DistributedDataParallel, `fsdp2` shards every part with `fully_shard` (the
all-gathers run in FSDP2's hooks, between the compiled graphs). Every rank trains on its
own batches; the held-out batches are split over the ranks and their logits gathered.

On CUDA (NCCL) the master weights stay fp32 and the GEMMs run in bf16 (autocast; FSDP2
all-gathers the GEMM parts in bf16, the embedding tables in fp32, and reduce-scatters fp32),
where loka puts its FP8 sites. On CPU (gloo) loka emulates FP8, so only quality compares
there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script (torchrun examples/distributed.py): the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import loka_compile  # noqa: E402
from benchmarks.zoo.data import SyntheticRecsysData, quality_metrics  # noqa: E402

STRATEGIES = ("ddp", "fsdp2")
BACKENDS = ("loka", "inductor")
DEFAULT_MODELS = "wukong,torch_rechub.DCNv2"
# A probability clamped this far from 0 and 1 keeps its logit finite in fp32.
PROBABILITY_EPS = 1e-7


@dataclasses.dataclass
class Task:
    """One model with its data: `parts`, what FSDP2 shards one by one; `compiled`, the parts
    torch.compile runs; `batch(index, heldout)` -> (inputs tuple, labels [B]);
    `loss(out, labels)`; `logits(out)` -> [B] fp32 (the click head, for NE)."""

    name: str
    model: nn.Module
    parts: list[nn.Module]
    compiled: list[nn.Module]
    batch: Callable[[int, bool], tuple[tuple, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]
    logits: Callable[[object], torch.Tensor]


def zoo_task(name: str, preset: str, batch_size: int, device: torch.device, max_rows: int | None) -> Task:
    """A zoo model (benchmarks/zoo), dense embedding tables (FSDP2 shards no sparse gradient)."""
    from benchmarks.zoo.models import build_model

    model, spec = build_model(name, preset, device=device, sparse=False, max_rows=max_rows)
    streams = {False: SyntheticRecsysData(spec, seed=0), True: SyntheticRecsysData(spec, seed=1)}

    def batch(index, heldout):
        b = streams[heldout].batch(index, batch_size, device)
        return b.model_inputs(), b.labels

    # The tables run eagerly, as production runs them (TorchRec/FBGEMM, outside the compiled region).
    return Task(name, model, [model.sparse, model.dense], [model.dense], batch,
                loss=lambda out, y: F.binary_cross_entropy_with_logits(out.float().reshape(-1), y.float()),
                logits=lambda out: out.float().reshape(-1))


def public_task(name: str, preset: str, batch_size: int, device: torch.device) -> Task:
    """A public-suite model (benchmarks/public), as its library ships it; its loss is the library's."""
    from benchmarks.public.models import build, prediction

    bench = build(name, preset, device=device, seed=0)
    parts = [child for child in bench.model.children() if any(True for _ in child.parameters())]

    def batch(index, heldout):
        inputs, labels = bench.batch(index, batch_size, seed=bench.seed + 1000 if heldout else bench.seed)
        return (inputs,), labels

    def logits(out):
        p = prediction(out).float()
        p = p.reshape(p.shape[0], -1)[:, 0]  # the click head (multi-task models: the first)
        return torch.logit(p.clamp(PROBABILITY_EPS, 1 - PROBABILITY_EPS))

    return Task(name, bench.model, parts, parts, batch, loss=lambda out, y: bench.loss(out, y), logits=logits)


def make_task(name: str, preset: str, batch_size: int, device: torch.device, max_rows: int | None = None) -> Task:
    from benchmarks.zoo.models import MODEL_NAMES

    if name in MODEL_NAMES:
        return zoo_task(name, preset, batch_size, device, max_rows)
    return public_task(name, preset, batch_size, device)


def compile_parts(task: Task, backend: str, loka_options: dict | list[dict] | None = None) -> None:
    """Compile each of task.compiled in place (nn.Module.compile), before DDP or fully_shard wraps
    it; `loka_options` for every part, or a list of them, one per part (e.g. each its own plan)."""
    per_part = loka_options if isinstance(loka_options, list) else [loka_options] * len(task.compiled)
    for part, options in zip(task.compiled, per_part, strict=True):
        if backend == "loka":
            part.compile(backend="loka", options=dict(options or {}))
        else:
            part.compile()


def wrap(task: Task, strategy: str, device: torch.device, bucket_cap_mb: float = 25.0) -> nn.Module:
    """The model to call under `strategy`: DDP over the whole model (gradients all-reduced in
    buckets of `bucket_cap_mb`; Dynamo compiles one graph per bucket), or FSDP2 on each part then the root."""
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(task.model, device_ids=[device.index] if device.type == "cuda"
                                                   else None, bucket_cap_mb=bucket_cap_mb)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for part in task.parts:
        # bf16 all-gathers for the GEMM parts on CUDA; tables stay fp32, as under DDP's autocast
        fully_shard(part, mp_policy=bf16 if device.type == "cuda" and not has_tables(part) else MixedPrecisionPolicy())
    fully_shard(task.model)
    return task.model


def has_tables(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in module.modules())


def autocast(device: torch.device):
    """bf16 GEMMs on CUDA (fp32 master weights); fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StepTimer:
    """Wall time of each step: CUDA events on CUDA, perf_counter elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.times_ms: list[float] = []

    @contextlib.contextmanager
    def step(self, record: bool):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        yield
        if self.cuda:
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = 1000.0 * (time.perf_counter() - began)
        if record:
            self.times_ms.append(elapsed)


def warmup_steps(backend: str, loka_options: dict | None) -> int:
    """Untimed steps: the first (it compiles) and one more; for loka with a probe window, the
    window, the call that closes it (the FP8 variant compiles) and one more."""
    window = loka_compile.LokaConfig.from_options(dict(loka_options or {})).probe_steps if backend == "loka" else 0
    return window + 2


def train(task: Task, forward: nn.Module, device: torch.device, steps: int, lr: float, warmup: int,
          on_step: Callable[[int], None] | None = None,
          first_steps: contextlib.AbstractContextManager | None = None) -> dict:
    """`steps` Adam steps on this rank's batches (index step * world + rank), each followed by
    `on_step(step)` (timed with it); the median step time after `warmup` steps, the first and
    last loss, and the wall seconds of the `warmup` steps (the compiles and the probe window),
    which run inside `first_steps` (e.g. a profiler) where given."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.Adam(task.model.parameters(), lr=lr)
    timer = StepTimer(device)
    losses = []
    first_steps_s = None
    began = time.perf_counter()
    with contextlib.ExitStack() as warming:
        warming.enter_context(first_steps or contextlib.nullcontext())
        for step in range(steps):
            if step == warmup:
                warming.close()
                first_steps_s = time.perf_counter() - began
            inputs, labels = task.batch(step * world + rank, False)
            with timer.step(record=step >= warmup):
                optimizer.zero_grad(set_to_none=True)
                with autocast(device):
                    out = forward(*inputs)
                loss = task.loss(out, labels)
                loss.backward()
                optimizer.step()
                if on_step is not None:
                    on_step(step)
            if step in (0, steps - 1):
                losses.append(loss.item())
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{task.name}: loss {loss.item()} at step {step} on rank {rank}")
    if first_steps_s is None:
        first_steps_s = time.perf_counter() - began
    return {"step_ms": statistics.median(timer.times_ms) if timer.times_ms else None,
            "timed_steps": len(timer.times_ms), "loss_first": losses[0], "loss_last": losses[-1],
            "first_steps_s": round(first_steps_s, 2)}


@torch.no_grad()
def evaluate(task: Task, forward: nn.Module, device: torch.device, batches: int, window: int) -> dict:
    """Held-out quality over `batches` batches split across the ranks, gathered on every rank.
    `window` untimed training batches run first, so loka's inference graph has closed its
    probe window and the held-out batches run what inference runs from then on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    task.model.eval()
    logits, labels = [], []
    with autocast(device):
        for index in range(window):
            forward(*task.batch(index * world + rank, False)[0])
        for index in range(rank, batches * world, world):
            inputs, y = task.batch(index, True)
            logits.append(task.logits(forward(*inputs)))
            labels.append(y.reshape(y.shape[0], -1)[:, 0].float())
    task.model.train()
    mine = torch.stack([torch.cat(logits), torch.cat(labels)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    joined = torch.cat(gathered, dim=1)
    return quality_metrics(joined[0], joined[1])


def fp8_sites(task: Task, backend: str) -> dict:
    """How many GEMM sites of the compiled parts loka runs in FP8, of all it found."""
    if backend != "loka":
        return {}
    reports = [loka_compile.report(part) for part in task.compiled]
    sites = [s for report in reports for s in report.sites]
    return {"fp8_sites": sum(s.fp8 for s in sites), "sites": len(sites),
            "loka_graphs": sum(len(report.graphs) for report in reports)}


def run(name: str, args, device: torch.device) -> dict:
    """One model under args.strategy and args.backend: its row (rank 0's view; step time and NE)."""
    torch._dynamo.reset()
    loka_compile.reset()
    task = make_task(name, args.preset, args.batch, device, args.max_rows)
    options = {"probe_steps": args.probe_steps}
    compile_parts(task, args.backend, options)
    forward = wrap(task, args.strategy, device)
    warmup = warmup_steps(args.backend, options)
    gradient_comm = None
    if args.fp8_comm:
        gradient_comm = loka_compile.fp8_gradient_comm(forward)
        warmup = max(warmup, gradient_comm.options.window_steps + 3)  # a warm-up call (two: DDP rebuilds buckets)
    weight_gather = loka_compile.fp8_all_gather(forward) if args.fp8_all_gather else None
    row = {"model": name, "strategy": args.strategy, "backend": args.backend, "world_size": dist.get_world_size(),
           "batch_per_rank": args.batch, "steps": args.steps}
    row.update(train(task, forward, device, args.steps, args.lr, warmup))
    row.update(evaluate(task, forward, device, args.eval_batches, options["probe_steps"] + 1))
    row.update(fp8_sites(task, args.backend))
    if gradient_comm is not None:
        row["gradient_comm"] = str(gradient_comm)
    if weight_gather is not None:
        row["weight_gather"] = str(weight_gather)
        row["all_gather_bytes_per_forward"] = weight_gather.bytes_per_forward()
    return row


def init_process_group(device_kind: str) -> torch.device:
    """NCCL with one GPU per local rank on CUDA, gloo on CPU (torchrun's environment)."""
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
        return device
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="comma list: zoo names (benchmarks/zoo) and public-suite names (benchmarks/public)")
    parser.add_argument("--strategy", default="ddp", choices=STRATEGIES)
    parser.add_argument("--backend", default="loka", choices=BACKENDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--preset", default="tiny", help="the zoo's and the public suite's size preset")
    parser.add_argument("--max-rows", type=int, default=None, help="cap on each zoo embedding table's rows")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    parser.add_argument("--fp8-comm", action="store_true",
                        help="FP8 gradient communication (loka_compile.fp8_gradient_comm), decided per bucket")
    parser.add_argument("--fp8-all-gather", action="store_true",
                        help="FSDP2 only: the weights the plan runs in FP8 all-gathered in FP8 "
                             "(loka_compile.fp8_all_gather)")
    parser.add_argument("--probe-steps", type=int, default=loka_compile.LokaConfig().probe_steps,
                        help="loka's probe window (calls in high precision before the plan)")
    args = parser.parse_args(argv)
    if args.fp8_all_gather and (args.strategy != "fsdp2" or args.backend != "loka"):
        parser.error("--fp8-all-gather needs --strategy fsdp2 and --backend loka "
                     "(it gathers in FP8 what loka's plan runs in FP8)")
    return args


def run_models(args, device: torch.device) -> list[dict]:
    """Every model of args.models in turn (in an initialized process group); rank 0 prints each row."""
    rows = []
    for name in args.models.split(","):
        row = run(name.strip(), args, device)
        rows.append(row)
        if dist.get_rank() == 0:
            step = (f"n/a (all {args.steps} steps warm up: compiles, probe window)" if row["step_ms"] is None
                    else f"{row['step_ms']:.2f} ms")
            fp8 = f", FP8 sites {row['fp8_sites']}/{row['sites']}" if "sites" in row else ""
            print(f"{name} [{args.strategy}, {args.backend}, {row['world_size']} ranks x batch {args.batch}]: "
                  f"step {step} (median of {row['timed_steps']}), held-out NE {row['ne']:.4f}, "
                  f"AUC {row['auc']:.4f}, loss {row['loss_first']:.4f} -> {row['loss_last']:.4f}{fp8}", flush=True)
            if "gradient_comm" in row:
                print(row["gradient_comm"], flush=True)
            if "weight_gather" in row:
                print(row["weight_gather"], flush=True)
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = init_process_group(args.device)
    try:
        return run_models(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
