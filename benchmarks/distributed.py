"""Data-parallel training on 1, 2 and 4 GPUs of one host: DDP and FSDP2 in bf16, torchao
float8 under FSDP2 with its FP8 all-gather, and loka under both, without and with FP8 gradient
communication (`loka_compile.fp8_gradient_comm`: each gradient bucket measured for
--comm-window steps, then FP8 where its error is within budget and it is faster), and loka under
FSDP2 with the FP8 all-gather of the weights its plan runs in FP8 (`loka_compile.fp8_all_gather`).

    python -m benchmarks.distributed --out "$OUT"                       # defaults below, 1/2/4 GPUs
    python -m benchmarks.distributed --gpus 1,2 --steps 100 --out /tmp/d   # a shorter run
    python -m benchmarks.distributed --device cpu --gpus 2 --preset tiny --steps 4 --batch 32  # CPU smoke
    python -m benchmarks.distributed --merge a.json b.json --out DIR   # one table from several calls
    python -m benchmarks.distributed --gpus 4 --fp8-all-gather --out "$OUT"   # FSDP2 bf16, loka, loka + FP8 all-gather
    python -m benchmarks.distributed --gpus 1,2,4 --configs ddp_bf16,ddp_loka --reuse-plan --profile
        # the 2- and 4-GPU ddp_loka rows run the plan of the 1-GPU row; cProfile phases of the first steps

The launcher starts one `torchrun` per world size (NCCL_NVLS_ENABLE=0: NVLink multicast off);
its ranks run every config in turn in one process group (examples/distributed.py's model
parts, wrapping, training and held-out evaluation) and rank 0 writes the rows. Per config:

- step time: the median of CUDA-event timings of every step after the warm-up (the compiles
  and loka's probe window), on rank 0, each step on a fresh batch (index step * world + rank);
- scaling efficiency: weak scaling (the batch per rank is fixed), step time on 1 GPU / step
  time on N;
- bytes communicated per step, counted as the collectives are called: DDP's all-reduce
  buckets through a comm hook (with FP8 gradient communication, by loka's own hook: its
  window's high-precision and FP8 collectives both, then what each bucket's decision sends; the
  FP8 plan's bytes per step, window excluded, are `fp8_comm_wire_bytes_per_step`), FSDP2's
  all-gather and reduce-scatter through its custom collective hooks (`set_custom_all_gather` /
  `set_custom_reduce_scatter`; analytic from the parameter shards where the installed torch
  lacks them, and the row says so). `*_payload`
  is each collective's full tensor (all-gather output, reduce-scatter input, all-reduce
  buffer, all-to-all send buffer); `wire_bytes_per_rank` what each rank sends: (N-1)/N of the
  all-gather, reduce-scatter and all-to-all payloads, 2(N-1)/N of the all-reduce's (a ring);
- held-out NE after all steps, and its change against DDP bf16 at the same world size.

Results: <out>/<stem>.json, .md (table) and .png (plot, with matplotlib). The launcher stops
starting world sizes when --total-seconds is spent; a world that did not run gets error rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.train import _error_text, _fp8_linear_filter, _torchao_import, device_tag
from examples import distributed as example


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    strategy: str
    backend: str
    torchao_float8: bool = False
    fp8_comm: bool = False  # loka_compile.fp8_gradient_comm on the wrapped model
    fp8_all_gather: bool = False  # loka_compile.fp8_all_gather on the sharded model


CONFIGS = {c.name: c for c in (
    Config("ddp_bf16", "ddp", "inductor"),
    Config("fsdp2_bf16", "fsdp2", "inductor"),
    Config("fsdp2_torchao_float8", "fsdp2", "inductor", torchao_float8=True),
    Config("ddp_loka", "ddp", "loka"),
    Config("fsdp2_loka", "fsdp2", "loka"),
    Config("ddp_loka_fp8_comm", "ddp", "loka", fp8_comm=True),
    Config("fsdp2_loka_fp8_comm", "fsdp2", "loka", fp8_comm=True),
    Config("ddp_bf16_fp8_comm", "ddp", "inductor", fp8_comm=True),  # FP8 gradients alone, bf16 GEMMs
    Config("fsdp2_loka_fp8_all_gather", "fsdp2", "loka", fp8_all_gather=True),
)}
# --fp8-all-gather: what the FP8 weight all-gather is read against
FP8_ALL_GATHER_CONFIGS = ("fsdp2_bf16", "fsdp2_loka", "fsdp2_loka_fp8_all_gather")
# The bf16 row each config's speed is read against (same strategy, same world size).
BASELINE = {"ddp": "ddp_bf16", "fsdp2": "fsdp2_bf16"}
NE_REFERENCE = "ddp_bf16"


# ------------------------------------------------------------------ counting bytes


class CommBytes:
    """Bytes of every collective of a step, summed over the steps since `reset`."""

    def __init__(self, world: int):
        self.world = world
        self.all_gather = self.reduce_scatter = self.all_reduce = self.all_to_all = 0
        self.method = "counted"

    def wire_per_rank(self) -> float:
        n = self.world
        return (n - 1) / n * (self.all_gather + self.reduce_scatter + self.all_to_all) + \
            2 * (n - 1) / n * self.all_reduce

    def add_sent(self, sent: dict) -> None:
        """Add a GradientComm's payload bytes (`GradientComm.sent`)."""
        for name, value in sent.items():
            setattr(self, name, getattr(self, name) + value)

    def per_step(self, steps: int) -> dict:
        return {"all_gather_payload": self.all_gather / steps, "reduce_scatter_payload": self.reduce_scatter / steps,
                "all_reduce_payload": self.all_reduce / steps, "all_to_all_payload": self.all_to_all / steps,
                "wire_bytes_per_rank": self.wire_per_rank() / steps, "bytes_method": self.method}


def count_ddp(ddp, counter: CommBytes) -> None:
    """A comm hook: DDP's own all-reduce of each gradient bucket, its buffer's bytes counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        buffer = bucket.buffer()
        counter.all_reduce += buffer.numel() * buffer.element_size()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)


def count_fsdp2(modules, counter: CommBytes) -> None:
    """FSDP2's default all-gather and reduce-scatter, their tensors' bytes counted; where this
    torch has no custom-collective hooks, the bytes from the parameter shards instead."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    hooks = all(hasattr(m, "set_custom_all_gather") and hasattr(m, "set_custom_reduce_scatter") for m in modules)
    if not (hooks and hasattr(collectives, "DefaultAllGather") and hasattr(collectives, "DefaultReduceScatter")):
        counter.method = "analytic (no custom-collective hooks in this torch)"
        return

    class CountedAllGather(collectives.DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counter.all_gather += output_tensor.numel() * output_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountedReduceScatter(collectives.DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counter.reduce_scatter += input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    for module in modules:
        module.set_custom_all_gather(CountedAllGather())
        module.set_custom_reduce_scatter(CountedReduceScatter())


def analytic_fsdp2_bytes(task, counter: CommBytes, steps: int, all_gather_bytes_per_element) -> None:
    """FSDP2's traffic from the parameters: each part all-gathered in forward and again in
    backward (the root once: it is not resharded after forward), its gradients reduce-scattered
    in fp32 (the mixed-precision policy's reduce dtype). `all_gather_bytes_per_element(part, p)`."""
    root_params = {id(p) for p in task.model.parameters(recurse=False)}
    for part in task.parts:
        for p in part.parameters():
            times = 1 if id(p) in root_params else 2
            counter.all_gather += steps * times * p.numel() * all_gather_bytes_per_element(part, p)
            counter.reduce_scatter += steps * p.numel() * 4


# ------------------------------------------------------------------ where the first steps go


def first_steps_phases():
    """What `--profile` reports of each config's first steps (compiles and windows): the
    single-process compile phases of `benchmarks.public.first_steps`, and the distributed ones."""
    from benchmarks.public.first_steps import PHASES

    return PHASES + (
        ("DDP graph splitting (DDPOptimizer, all buckets)", "torch/_dynamo/backends/distributed.py", "compile_fn"),
        ("DDPOptimizer: one bucket's compile", "torch/_dynamo/backends/distributed.py", "compile_submod"),
        ("loka: decisions taken once for all ranks (ranks.decide_once)", "loka_compile/ranks.py",
         "_decide_on_ranks"),
        ("collectives: broadcast_object_list", "torch/distributed/distributed_c10d.py", "broadcast_object_list"),
        ("collectives: all_gather_object", "torch/distributed/distributed_c10d.py", "all_gather_object"),
    )


COMPILE_COUNTERS = (("stats", "unique_graphs"), ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                    ("inductor", "fxgraph_cache_bypass"))


@contextlib.contextmanager
def first_steps_measured(row: dict, profile: bool):
    """Around the first steps (the compiles and windows): the Dynamo graphs and Inductor's FX
    graph cache hits, misses and bypasses they made, into `row`; with `profile`, cProfile's
    seconds and calls of each phase too (row["first_steps_phases"], this rank's)."""
    import cProfile
    import pstats

    from torch._dynamo.utils import counters

    from benchmarks.public.first_steps import phase_times

    before = {key: counters[key[0]][key[1]] for key in COMPILE_COUNTERS}
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        yield
    finally:
        if profiler is not None:
            profiler.disable()
            row["first_steps_phases"] = [p for p in phase_times(pstats.Stats(profiler), first_steps_phases())
                                         if p["calls"]]
        row.update({name: counters[group][name] - before[(group, name)] for group, name in COMPILE_COUNTERS})


# ------------------------------------------------------------------ one config on every rank


def torchao_float8(task) -> None:
    """torchao's float8 training on the dense arch's Linears (tensorwise), with its FP8 all-gather."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    for part in task.compiled:
        convert_to_float8_training(part, config=config, module_filter_fn=_fp8_linear_filter)


def torchao_scales(model):
    """After each optimizer step: every FP8 weight's scale from one all-reduce of their amaxes, as
    torchao's FSDP2 float8 recipe does (its all-gather casts with them)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda step: precompute_float8_dynamic_scale_for_fsdp(model)


def comm_options(args) -> dict:
    """fp8_gradient_comm's options from the command line."""
    return {"window_steps": args.comm_window, "max_error": args.comm_max_error, "gather": args.comm_gather,
            "speed_check": not args.comm_no_speed_check}


def fp8_comm_row(gradient_comm) -> dict:
    """What FP8 gradient communication decided: buckets in FP8 of all, the plan's bytes per step
    (window excluded) against high precision, and each bucket's decision."""
    plan = gradient_comm.wire_bytes_per_step()
    decisions = gradient_comm.decisions.values()
    return {"fp8_comm_buckets": f"{sum(d.fp8 for d in decisions)}/{len(gradient_comm.decisions)}",
            "fp8_comm_wire_bytes_per_step": plan["fp8_plan"],
            "fp8_comm_high_precision_wire_bytes_per_step": plan["high_precision"],
            "fp8_comm_decisions": [{"bucket": d.key, "elements": d.numel, "fp8": d.fp8, "reason": d.reason.value,
                                    "error_bound": d.error_bound, "high_precision_us": d.high_precision_us,
                                    "fp8_us": d.fp8_us, "detail": d.detail} for d in decisions]}


def fp8_all_gather_row(weight_gather) -> dict:
    """What the FP8 weight all-gather decided and moves: bytes of one forward's all-gathers."""
    per_forward = weight_gather.bytes_per_forward()
    params = weight_gather.params.values()
    return {"fp8_all_gather_params": f"{sum(p.fp8 for p in params)}/{len(params)}",
            "all_gather_bytes_per_forward": per_forward["plan"],
            "all_gather_high_precision_bytes_per_forward": per_forward["high_precision"],
            "all_gather_bf16_bytes_per_forward": per_forward["bf16"],
            "fp8_all_gather": [{"param": p.name, "fp8": p.fp8, "reason": p.reason.value, "scaling": p.scaling,
                                "bytes": p.bytes_per_gather(), "high_precision_bytes": p.bytes_per_gather(fp8=False),
                                "fp8_gathers": p.fp8_gathers, "high_precision_gathers": p.high_precision_gathers}
                               for p in params]}


def gathered_bytes(config: Config, device: torch.device, part, param) -> int:
    """Bytes per element FSDP2 all-gathers (the wrapping in examples/distributed.py): tables in
    their own dtype, GEMM parts in bf16 on CUDA, torchao's float8 Linear weights in FP8."""
    if example.has_tables(part) or device.type != "cuda":
        return param.element_size()
    return 1 if config.torchao_float8 and param.dim() == 2 else 2


def run_config(config: Config, args, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    row = {"config": config.name, "strategy": config.strategy, "backend": config.backend, "world_size": world,
           "model": args.model, "preset": args.preset, "batch_per_rank": args.batch, "steps": args.steps}
    start = time.perf_counter()
    task = forward = None
    try:
        if config.torchao_float8:
            version, why = _torchao_import()
            if version is None:
                raise ModuleNotFoundError(f"torchao is not importable ({why})")
            row["torchao"] = version
        torch._dynamo.reset()
        import loka_compile
        loka_compile.reset()
        task = example.make_task(args.model, args.preset, args.batch, device, args.max_rows)
        row["dense_params"] = sum(p.numel() for part in task.compiled for p in part.parameters())
        row["all_params"] = sum(p.numel() for p in task.model.parameters())
        if config.torchao_float8:
            torchao_float8(task)
        options = {"probe_steps": args.probe_steps}
        plans = plan_files(args.load_plans or args.save_plans, config, task) if plans_apply(config) else []
        if args.load_plans and plans and all(path.exists() for path in plans):  # else: its own window
            options = [dict(options, plan=str(path)) for path in plans]
            row["plan_from_world"] = json.loads(Path(args.load_plans, "world.json").read_text())["world_size"]
            row["plan"] = str(args.load_plans)
        example.compile_parts(task, config.backend, options)
        forward = example.wrap(task, config.strategy, device, bucket_cap_mb=args.bucket_cap_mb)
        counter = CommBytes(world)
        if config.strategy == "ddp":
            if not config.fp8_comm:  # DDP takes one comm hook: loka's counts its own bytes
                count_ddp(forward, counter)
        else:
            count_fsdp2([*task.parts, task.model], counter)  # loka's reduce-scatter replaces the counted one
        gradient_comm = loka_compile.fp8_gradient_comm(forward, **comm_options(args)) if config.fp8_comm else None
        weight_gather = loka_compile.fp8_all_gather(forward) if config.fp8_all_gather else None
        on_step = torchao_scales(task.model) if config.torchao_float8 else None
        warmup = max(args.warmup, example.warmup_steps(config.backend, {"probe_steps": args.probe_steps}))
        if gradient_comm is not None:  # its window, after a warm-up call (and DDP's rebuilt buckets' one)
            warmup = max(warmup, args.comm_window + 3)
        warmup = min(warmup, args.steps - 1)
        row.update(example.train(task, forward, device, args.steps, args.lr, warmup, on_step=on_step,
                                 first_steps=first_steps_measured(row, args.profile)))
        if counter.method != "counted":
            analytic_fsdp2_bytes(task, counter, args.steps, lambda part, p: gathered_bytes(config, device, part, p))
        if gradient_comm is not None:
            counter.add_sent(gradient_comm.sent)
            row.update(fp8_comm_row(gradient_comm))
        row.update(counter.per_step(args.steps))
        if weight_gather is not None:
            row.update(fp8_all_gather_row(weight_gather))
        row.update(example.evaluate(task, forward, device, args.eval_batches, args.probe_steps + 1))
        if args.save_plans and plans and rank == 0:  # after evaluation: the held-out graphs' sites are in it too
            try:
                save_plans(task, plans, world)
            except Exception as error:  # noqa: BLE001 - rank 0 alone: its row says so, the ranks go on together
                row["plan_saved"] = f"no: {_error_text(error)}"
        row.update(example.fp8_sites(task, config.backend))
    except Exception as error:  # noqa: BLE001 - a failing config is a row with its error
        row["error"] = _error_text(error)
    finally:
        row["wall_s"] = round(time.perf_counter() - start, 1)
        del task, forward
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # A config that failed on some rank only must not leave the others waiting in the next one.
    failed = [None] * world
    dist.all_gather_object(failed, row.get("error"))
    if row.get("error") is None and any(failed):
        row["error"] = f"failed on another rank: {next(e for e in failed if e)}"
    if rank == 0:
        print(f"[{world} ranks] {config.name}: " + (row["error"] if "error" in row else
              f"{row['step_ms']:.2f} ms/step, NE {row['ne']:.4f}, wire {row['wire_bytes_per_rank'] / 1e6:.1f} MB/rank"),
              flush=True)
    return row


def plans_apply(config: Config) -> bool:
    """Whether --save-plans / --load-plans act on `config`: loka under DDP. Under FSDP2 on CUDA the
    compiled graphs read the bf16 all-gathered parameters while the module's own are fp32, and a
    saved plan's fingerprint is the module's, so loading it would refuse every graph."""
    return config.backend == "loka" and config.strategy == "ddp"


def plan_files(directory: str, config: Config, task) -> list[Path]:
    """Where each compiled part's plan of `config` is kept under `directory`."""
    return [Path(directory, f"{config.name}.part{i}.json") for i in range(len(task.compiled))]


def save_plans(task, paths: list[Path], world: int) -> None:
    """Each compiled part's plan after training and evaluation (the windows of its training and
    held-out graphs closed), and the world size that decided them."""
    import loka_compile

    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for part, path in zip(task.compiled, paths):
        loka_compile.save_plan(part, path)
    Path(paths[0].parent, "world.json").write_text(json.dumps({"world_size": world}))


def worker(args) -> None:
    device = example.init_process_group(args.device)
    try:
        deadline = time.monotonic() + args.worker_seconds
        rows = []
        for name in args.configs.split(","):
            if time.monotonic() > deadline:
                rows.append({"config": name, "world_size": dist.get_world_size(), "model": args.model,
                             "error": "skipped: the time budget was spent"})
                continue
            rows.append(run_config(CONFIGS[name], args, device))
            if dist.get_rank() == 0:
                Path(args.rows_file).write_text(json.dumps(rows, indent=1, default=str))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ launcher and results


DERIVED = ("speedup_vs_bf16", "scaling_efficiency", "throughput_vs_1gpu", "ne_rel_change_vs_ddp_bf16")


def fill_derived(rows: list[dict]) -> None:
    """Speedup against the same strategy's bf16 row, scaling efficiency against 1 GPU, NE change
    against DDP bf16 at the same world size."""
    for r in rows:
        for key in DERIVED:
            r.pop(key, None)
    def find(config, world):
        return next((r for r in rows if r["config"] == config and r["world_size"] == world and "error" not in r), None)

    for r in rows:
        if "error" in r:
            continue
        base = find(BASELINE[r["strategy"]], r["world_size"])
        if base is not None:
            r["speedup_vs_bf16"] = base["step_ms"] / r["step_ms"]
        one = find(r["config"], 1)
        if one is not None:
            r["scaling_efficiency"] = one["step_ms"] / r["step_ms"]
            r["throughput_vs_1gpu"] = r["world_size"] * one["step_ms"] / r["step_ms"]
        ref = find(NE_REFERENCE, r["world_size"])
        if ref is not None:
            r["ne_rel_change_vs_ddp_bf16"] = r["ne"] / ref["ne"] - 1.0


def markdown(env: dict, rows: list[dict]) -> str:
    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    lines = [f"# Distributed training: {env['model']} ({env['preset']}), batch {env['batch_per_rank']} per rank, "
             f"{env['steps']} steps, {env['device']}", "",
             "| GPUs | config | ms/step | speedup vs bf16 | scaling eff. | all-gather MB | reduce-scatter MB | "
             "all-reduce MB | all-to-all MB | wire MB/rank | FP8 grad buckets (plan MB/step) | "
             "FP8 all-gather params (MB/forward vs high precision) | held-out NE | NE vs DDP bf16 | FP8 sites | "
             "first steps s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["config"])):
        if "error" in r:
            lines.append(f"| {r['world_size']} | {r['config']} | error: {r['error']} |" + " |" * 13)
            continue
        mb = lambda key: fmt(r.get(key, 0) / 1e6, ".1f")  # noqa: E731
        planned = f" (plan of the {r['plan_from_world']}-GPU row)" if r.get("plan_from_world") else ""
        lines.append(
            f"| {r['world_size']} | {r['config']}{planned} | {fmt(r['step_ms'], '.2f')} | "
            f"{fmt(r.get('speedup_vs_bf16'), '.2f')} | "
            f"{fmt(r.get('scaling_efficiency'), '.2f')} | {mb('all_gather_payload')} | {mb('reduce_scatter_payload')} | "
            f"{mb('all_reduce_payload')} | {mb('all_to_all_payload')} | {mb('wire_bytes_per_rank')} | "
            f"{fp8_comm_cell(r)} | {fp8_all_gather_cell(r)} | {fmt(r['ne'], '.4f')} | "
            f"{fmt(100 * r['ne_rel_change_vs_ddp_bf16'], '+.2f') + '%' if 'ne_rel_change_vs_ddp_bf16' in r else ''} | "
            f"{r.get('fp8_sites', '')}{'/' + str(r['sites']) if 'sites' in r else ''} | "
            f"{fmt(r.get('first_steps_s'), '.1f')} |")
    methods = sorted({r["bytes_method"] for r in rows if "bytes_method" in r})
    clock = "CUDA-event timings" if env["device"] != "CPU" else "perf_counter timings"
    lines += ["", f"Bytes: {'; '.join(methods)}. Step time: median of {clock} on rank 0 after the warm-up. "
              "Scaling efficiency: step time on 1 GPU / on N (weak scaling). First steps: wall seconds of the "
              "untimed steps on rank 0 (compiles, probe windows)."]
    if any(r.get("plan_from_world") for r in rows):
        lines.append("A row marked with a plan ran the loka plan its config decided at the world size named (same "
                     "model, shapes and batch per rank): no probe window, speed check or output budget of its own.")
    return "\n".join(lines) + "\n"


def fp8_all_gather_cell(row: dict) -> str:
    """"8/40 (1.2 vs 2.2)": parameters gathered in FP8, and one forward's all-gather MB against the
    same all-gathers in high precision (FSDP2's param_dtype: bf16 for the GEMM parts on CUDA)."""
    if "fp8_all_gather_params" not in row:
        return ""
    return (f"{row['fp8_all_gather_params']} ({row['all_gather_bytes_per_forward'] / 1e6:.2f} vs "
            f"{row['all_gather_high_precision_bytes_per_forward'] / 1e6:.2f})")


def fp8_comm_cell(row: dict) -> str:
    """"2/3 (12.1 vs 46.2)": buckets in FP8, and the plan's MB per step against high precision."""
    if "fp8_comm_buckets" not in row:
        return ""
    return (f"{row['fp8_comm_buckets']} ({row['fp8_comm_wire_bytes_per_step'] / 1e6:.1f} vs "
            f"{row['fp8_comm_high_precision_wire_bytes_per_step'] / 1e6:.1f})")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for config in dict.fromkeys(r["config"] for r in good):
        mine = sorted((r for r in good if r["config"] == config), key=lambda r: r["world_size"])
        worlds = [r["world_size"] for r in mine]
        axes[0].plot(worlds, [r["step_ms"] for r in mine], marker="o", label=config)
        axes[1].plot(worlds, [r.get("scaling_efficiency", float("nan")) for r in mine], marker="o", label=config)
        axes[2].plot(worlds, [r["wire_bytes_per_rank"] / 1e6 for r in mine], marker="o", label=config)
    for ax, title in zip(axes, ("ms per step (median)", "scaling efficiency (1 GPU / N)", "MB sent per rank per step")):
        ax.set_title(title)
        ax.set_xlabel("GPUs")
        ax.set_xticks(sorted({r["world_size"] for r in good}) or [1])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    tag = device_tag(device) if device.type == "cuda" and torch.cuda.is_available() else device.type.upper()
    stem = args.name or f"{time.strftime('%Y-%m-%d')}_{tag}_distributed"
    env = {"model": args.model, "preset": args.preset, "max_rows": args.max_rows, "batch_per_rank": args.batch,
           "steps": args.steps, "device": tag, "torch": torch.__version__, "nccl_nvls_enable": "0",
           "gpus_available": torch.cuda.device_count() if device.type == "cuda" else 0, "configs": args.configs,
           "bucket_cap_mb": args.bucket_cap_mb, "reuse_plan": args.reuse_plan}
    deadline = time.monotonic() + args.total_seconds
    rows = []
    plans = out / f"{stem}.plans"  # --reuse-plan: the first world's loka plans, for the later worlds
    if args.reuse_plan:
        shutil.rmtree(plans, ignore_errors=True)
    for index, world in enumerate(int(w) for w in args.gpus.split(",")):
        if device.type == "cuda" and world > torch.cuda.device_count():
            rows += [{"config": c, "world_size": world, "model": args.model,
                      "error": f"needs {world} GPUs, found {torch.cuda.device_count()}"} for c in args.configs.split(",")]
            continue
        left = deadline - time.monotonic()
        if left < 30:
            rows += [{"config": c, "world_size": world, "model": args.model,
                      "error": "skipped: --total-seconds spent"} for c in args.configs.split(",")]
            continue
        rows_file = out / f"{stem}.rows{world}.json"
        rows_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   "-m", "benchmarks.distributed", "--worker", "--rows-file", str(rows_file),
                   "--worker-seconds", str(max(0.0, left - 30)), *args.passthrough]
        if args.reuse_plan:
            command += ["--save-plans" if index == 0 else "--load-plans", str(plans)]
        else:
            command += [f"--{flag}-plans={getattr(args, flag + '_plans')}" for flag in ("save", "load")
                        if getattr(args, flag + "_plans")]
        print(f"== {world} rank(s): {' '.join(command)}", flush=True)
        environ = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        try:
            subprocess.run(command, env=environ, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            print(f"== {world} rank(s): killed at the time budget", flush=True)
        got = json.loads(rows_file.read_text()) if rows_file.exists() else []
        done = {r["config"] for r in got}
        rows += got + [{"config": c, "world_size": world, "model": args.model,
                        "error": "did not finish (the ranks failed or ran out of time)"}
                       for c in args.configs.split(",") if c not in done]
        rows_file.unlink(missing_ok=True)
    return write_results(out / f"{stem}.json", env, rows)


def write_results(path: Path, env: dict, rows: list[dict]) -> Path:
    """The JSON, the markdown table and the plot of `rows`, derived columns filled."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fill_derived(rows)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))
    table = markdown(env, rows)
    path.with_suffix(".md").write_text(table)
    print(table, flush=True)
    try:
        plot(rows, path.with_suffix(".png"))
    except Exception as error:  # noqa: BLE001 - a missing matplotlib must not lose the results
        print(f"plot failed: {_error_text(error)}", flush=True)
    return path


def merge(files: list[str], out: Path, name: str | None) -> Path:
    """Rows of several runs (e.g. one call per world size) as one result; a later file's row
    replaces an earlier one of the same config and world size."""
    rows, env = {}, {}
    for file in files:
        data = json.loads(Path(file).read_text())
        env = data["env"]
        rows.update({(r["config"], r["world_size"]): r for r in data["rows"]})
    stem = name or f"{time.strftime('%Y-%m-%d')}_{env['device']}_distributed"
    return write_results(Path(out) / f"{stem}.json", env, list(rows.values()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2,4", help="world sizes, one torchrun each")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--model", default="wukong", help="a zoo model (benchmarks/zoo) or a public-suite name")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--max-rows", type=int, default=10_000,
                        help="cap on each zoo table's rows: data-parallel tables are all-reduced or gathered whole")
    parser.add_argument("--batch", type=int, default=2048, help="per rank")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at least (loka: its window too)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    parser.add_argument("--probe-steps", type=int, default=2)
    parser.add_argument("--fp8-all-gather", action="store_true",
                        help=f"run the configs {', '.join(FP8_ALL_GATHER_CONFIGS)} (the FP8 weight all-gather and "
                             "what it is read against)")
    parser.add_argument("--comm-window", type=int, default=4, help="FP8 gradient communication: measured steps")
    parser.add_argument("--comm-max-error", type=float, default=0.1, help="its budget on a bucket's relative error")
    parser.add_argument("--comm-gather", default="e4m3", choices=("e4m3", "bf16"), help="its all-gather's format")
    parser.add_argument("--comm-no-speed-check", action="store_true", help="FP8 where within budget, faster or not")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's gradient bucket size (its default): Dynamo splits a compiled graph per bucket")
    parser.add_argument("--reuse-plan", action="store_true",
                        help="DDP loka rows past the first world size run the plan their config decided at the first "
                             "(same model, shapes and batch per rank): no probe window, speed check or output budget")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile each config's first steps on every rank: seconds per compile phase in the row")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--total-seconds", type=float, default=510.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--name", default=None, help="file stem instead of <date>_<device>_distributed")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge these results into one; run nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)
    parser.add_argument("--worker-seconds", type=float, default=1e9, help=argparse.SUPPRESS)
    parser.add_argument("--save-plans", default=None, metavar="DIR",
                        help="save each loka config's plans here (rank 0, after its held-out evaluation)")
    parser.add_argument("--load-plans", default=None, metavar="DIR",
                        help="loka configs run the plans --save-plans left in DIR (an earlier run, same model, "
                             "shapes and batch per rank): no probe window, speed check or output budget")
    args = parser.parse_args(argv)
    if args.fp8_all_gather:
        args.configs = ",".join(FP8_ALL_GATHER_CONFIGS)
    if args.reuse_plan and (args.save_plans or args.load_plans):
        parser.error("--reuse-plan chooses the plans' directory itself: leave out --save-plans and --load-plans")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; valid: {', '.join(CONFIGS)}")
    # What every worker is started with: this run's settings, launcher-only flags left out.
    args.passthrough = [f"--configs={args.configs}", f"--model={args.model}", f"--preset={args.preset}",
                        f"--max-rows={args.max_rows}", f"--batch={args.batch}", f"--steps={args.steps}",
                        f"--warmup={args.warmup}", f"--lr={args.lr}", f"--eval-batches={args.eval_batches}",
                        f"--probe-steps={args.probe_steps}", f"--device={args.device}",
                        f"--comm-window={args.comm_window}", f"--comm-max-error={args.comm_max_error}",
                        f"--comm-gather={args.comm_gather}", f"--bucket-cap-mb={args.bucket_cap_mb}",
                        *(["--profile"] if args.profile else []),
                        *(["--comm-no-speed-check"] if args.comm_no_speed_check else [])]
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    if args.merge:
        return merge(args.merge, Path(args.out), args.name)
    return launch(args)


if __name__ == "__main__":
    main()
