"""Inference benchmark over the LRM zoo: latency, throughput, output error and held-out quality per batch size.

    python -m benchmarks.infer --models dlrm_dcnv2 --preset tiny --configs inductor_bf16,loka --batches 1,32
    python -m benchmarks.infer --preset paper --train-steps 200 --eval-batches 8   # quality after training

For every model, every configuration starts from a deep copy of the same fp32 master
model, cast to bf16 (the embedding tables stay fp32), in `.eval()`, and every call below runs
under `torch.no_grad()`, so Dynamo traces inference graphs (loka's `cached_weights` Mod
applies to those only). In one process:

- training (`--train-steps N`, default 0 = random initial weights): before the pools are
  made and before any configuration, the master is trained N steps on the training stream
  (`SyntheticRecsysData`, seed 1000 + --seed, as in benchmarks.train) as
  benchmarks.train's `eager_bf16` row trains its first N steps: a copy with the dense arch in bf16 (weights,
  gradients and Adam state bf16; the tables fp32), its BCE loss, Adam, lr warmup and lr
  defaults, at its batch size for the preset (256 tiny, 8192 paper; `--train-batch`). So
  the weights are "trained in bf16", and the fp32 master then holds them (bf16 -> fp32 is
  exact), for every config and for the fp32 reference. Eager, not compiled: no compile
  cost, and on an H100 benchmarks.train's eager_bf16 paper steps at batch 8192 took
  12-78 ms (2026-11-22_H100_train), so 200 steps take 2.5-16 s plus data generation.
  `training` in each row records steps, batch, lr and the first / last training loss;

- latency: for each batch size of `--batches`, `--warmup` untimed calls (the first compiles
  that size; under CUDA graphs the next ones record; a loka row's probe window, probe_steps
  calls, then the call that compiles its FP8 variant, runs here too, so loka rows need
  --warmup >= probe_steps + 2, 4 with the defaults, or the row is an error; calibrated rows
  load a plan and have no window), on GPU calls for WARMUP_SECONDS more (the clocks
  settle after a compile), then `--iters` timed calls, one CUDA
  event pair around each call on GPU (time.perf_counter on CPU, where calls are
  synchronous); the row keeps the median and the p10 / p90 of the per-call times
  (`median_ms`, `p10_ms`, `p90_ms`), the throughput `rows_per_s` = batch / median, the
  GEMM TFLOP/s at the median, and `first_call_s`, the wall time of the first call (the
  compile of that size);
- inputs: `--pool` (default 4) distinct synthetic batches per batch size
  (`benchmarks.zoo.SyntheticRecsysData`, held-out stream), made once per model before any
  configuration runs and cycled through call after call, so no call sees the same input
  as the one before and no data is generated while timing;
- speedup: Inductor bf16 median / this config's median at the same batch size in the same
  run, against Inductor in the same mode (`inductor_bf16_ro` for reduce-overhead rows,
  `inductor_bf16` for default-mode and eager rows; `speedup_ref` names it);
- error: after timing, at the largest batch size that ran up to ERROR_BATCH_MAX (8192;
  `error_batch`), the output of the config on the first pool batch against the fp32
  master (the initial or the trained weights) on the same input, ||out - ref|| / ||ref||
  (`out_relerr`; TF32 off for the reference);
- quality: then, at that batch size (`eval_batch`), the config's compiled callable on
  `--eval-batches` (default 8) held-out batches (made one at a time, lookups by the master
  under --compile-scope dense; under CUDA graphs each output cloned before the next
  replay): `logloss`, `ne`, `auc` (benchmarks.zoo.quality_metrics, as benchmarks.train),
  and `logloss_rel_bf16`, `ne_rel_bf16`, `auc_rel_bf16` = this / the speedup_ref row's - 1
  (same eval_batch, else none). `within_quality_target`: |ne_rel_bf16| and
  |auc_rel_bf16| both <= 0.05% (issue 11's target, meant after --train-steps 200);
- loka rows also record `loka_report`: the first line of `str(loka_compile.report(...))`,
  `report.mods` (what each Mod did), `static_scale_sites` (sites whose A was cast with a
  calibrated constant scale) and `report.cached_weight_bytes` (FP8 weight copies, and the
  bf16 bytes they stand for). Each batch size is its own graph (see shapes below), so the
  counts cover the graphs of every batch size that ran;
- loka_calibrated rows also record `calibration`: before compiling, loka_compile.calibrate
  runs the row's bf16 copy on `--calibration-batches` (default 4) training-stream batches
  at the largest batch size with `--calibration-policy` (amax) and the row's loka options;
  its plan (a temporary file: static scales and the Probe's verdicts, no speed decisions)
  is passed as options={"plan": path, "mode": ...}, so the row's compile runs the speed
  check in its own mode with each site's static scale. `site_errors` holds each
  static-scale site's calibrated error (the plan's `a_scales[site]["error"]`, loka's
  probe_metric of the constant-scale GEMM on sampled rows), `unsafe` the sites left bf16
  over max_probe_error, `seconds` the calibration time (not in any timing).

Shapes: by default Dynamo's automatic dynamic shapes are off, so each batch size compiles
its own static graph (and, under reduce-overhead, records its own CUDA graph), as a server
with fixed batch buckets would; `--dynamic-shapes` lets Dynamo generalize instead.

CPU: timings there check the harness, not loka; tiny presets default to one torch thread
(`--cpu-threads`), since two OpenMP threads on a shared two-core box made whole runs of
tiny calls about 100x slower, at random.

Scope: by default (`--compile-scope dense`) only the dense arch is compiled and timed; the
EmbeddingBag lookups run eagerly in fp32 once per pool batch, before any config, and their
outputs are the timed calls' inputs (in production they are TorchRec/FBGEMM's, and they
cost every config the same). `--compile-scope model` compiles and times the whole model,
lookups included.

Configurations (`--configs`; `all` = every named one):
- inductor_bf16_ro: torch.compile(mode="reduce-overhead") (CUDA graphs);
- inductor_bf16_mk_ro: that with the multi-kernel reductions of loka's
  benchmarked_reductions Mod: what that Mod gives bf16 alone (speedups stay against
  inductor_bf16_ro);
- loka_ro: backend "loka" in reduce-overhead mode, its defaults (Dispatch speed check on);
- loka_calibrated_ro: loka_ro with a calibrated plan (above): static activation scales, no
  amax reduction at run time;
- loka_all_fp8_ro: loka with {"speed_check": False, "probe_steps": 0}, every eligible site
  FP8 (no probe window: its verdicts and output budget would keep sites in bf16);
- loka_ro_no_cached_weights: loka_all_fp8_ro with {"disabled_mods": ["cached_weights"]}:
  the weights cast to FP8 on every call instead of once;
- torchao_rowwise_ro, torchao_tensorwise_ro: torchao post-training quantization,
  `quantize_(dense, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))`
  (`PerTensor()`) on the Linears whose both dims are multiples of 16, then
  torch.compile(mode="reduce-overhead"); CUDA only (error rows elsewhere). Inductor's
  config is restored before every config, since quantize_ may change it;
- the same without CUDA graphs (default mode): inductor_bf16, inductor_bf16_mk, loka,
  loka_calibrated, loka_all_fp8, loka_no_cached_weights, torchao_rowwise,
  torchao_tensorwise; and eager_bf16.
Off CUDA a `_ro` name runs as its default-mode twin (CUDA graphs need CUDA). Loka rows
take --loka-options under their own options; the JSON records both (`loka_options`).

Each configuration runs inside try/except: a failure (a crash, an unavailable backend, an
option the installed loka does not know, a time budget) becomes a row with `error` set,
never an abort; batch sizes measured before a budget ran out stay in the row. Results go
to `<out>/<date>_<device>_infer.json` (merged with rows of other models or configs
already there), rewritten after every row, and a table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.train import CONFIGS as TRAIN_CONFIGS
from benchmarks.train import (_ALL_FP8, BudgetExceeded, Config, Runner, _error_text, _fmt, _fp8_linear_filter,
                              _make_optimizer, _relerr, _torchao_import, compile_unit, device_tag, environment,
                              log, loka_options_for, loka_untimed_calls, release_config, train_step, write_json)
from benchmarks.train import parse_args as train_parse_args
from benchmarks.train import lookup_config as lookup_train_config
from benchmarks.train import resolve_config as resolve_train_config
from benchmarks.train import prepare as prepare_for_training
from benchmarks.zoo import (MODEL_NAMES, SyntheticRecsysData, build_model, count_parameters, quality_metrics,
                            to_dense_dtype)

# ------------------------------------------------------------------ configurations

_NO_CACHED_WEIGHTS = _ALL_FP8 + (("disabled_mods", ("cached_weights",)),)


# (default-mode name, reduce-overhead name, kind, Config fields): each a pair of rows.
_TWINS = [
    ("inductor_bf16", "inductor_bf16_ro", "inductor", {}),
    ("inductor_bf16_mk", "inductor_bf16_mk_ro", "inductor", {"benchmarked_reductions": True}),
    ("loka", "loka_ro", "loka", {}),
    ("loka_calibrated", "loka_calibrated_ro", "loka", {}),
    ("loka_all_fp8", "loka_all_fp8_ro", "loka", {"options": _ALL_FP8}),
    ("loka_no_cached_weights", "loka_ro_no_cached_weights", "loka",
     {"options": _NO_CACHED_WEIGHTS, "ablated": "cached_weights"}),
    ("torchao_rowwise", "torchao_rowwise_ro", "torchao", {"recipe": "rowwise"}),
    ("torchao_tensorwise", "torchao_tensorwise_ro", "torchao", {"recipe": "tensorwise"}),
]
CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("eager_bf16", "eager", "eager"),
    *(c for name, ro, kind, kw in _TWINS
      for c in (Config(name, kind, "default", **kw), Config(ro, kind, "reduce-overhead", **kw))),
]}
# Loka rows compiled with a plan from loka_compile.calibrate: static activation scales.
CALIBRATED = frozenset({"loka_calibrated", "loka_calibrated_ro"})
# The default-mode twin of each reduce-overhead config: what a `_ro` name runs off CUDA.
NO_CUDA_GRAPHS = {ro: name for name, ro, _, _ in _TWINS}
DEFAULT_CONFIGS = ("inductor_bf16_ro", "loka_ro", "loka_calibrated_ro", "loka_all_fp8_ro",
                   "loka_ro_no_cached_weights", "torchao_rowwise_ro", "torchao_tensorwise_ro")
# Speedups are against Inductor bf16 in the same mode.
SPEEDUP_REF = {"reduce-overhead": "inductor_bf16_ro", "default": "inductor_bf16", "eager": "inductor_bf16"}
DEFAULT_BATCHES = {"cuda": "1,64,512,4096,8192", "tiny": "1,64"}
WARMUP_SECONDS = 0.5
# Output error and quality are measured at no larger a batch: HSTU's fp32 reference at 65536
# rows allocates 16 GB tensors (H100: out of memory), and 8 batches of 8192 are 64k rows.
ERROR_BATCH_MAX = 8192
# Issue 11's quality target: held-out NE and AUC within 0.05% relative of Inductor bf16's.
QUALITY_TOLERANCE = 5e-4
# The training rows whose recipe --train-steps follows: dense arch and its Adam state in bf16.
TRAINING_CONFIG = "eager_bf16"


def config_for_device(name: str, cuda: bool) -> str:
    """`name`, or off CUDA its default-mode twin when it is a reduce-overhead config."""
    return name if cuda else NO_CUDA_GRAPHS.get(name, name)


def resolve_config(name: str) -> Config:
    """One of CONFIGS, or an ablation row `<loka config>_no_<mod>` (as in benchmarks.train)."""
    return resolve_train_config(name, CONFIGS)


def calibrated(name: str, cfg: Config) -> bool:
    """A loka_calibrated row, or an ablation row of one (`loka_calibrated_ro_no_<mod>`)."""
    suffix = f"_no_{cfg.ablated}" if cfg.ablated is not None else ""
    return name in CALIBRATED or (bool(suffix) and name.endswith(suffix) and name[: -len(suffix)] in CALIBRATED)


def _quantize_torchao(dense: nn.Module, recipe: str) -> None:
    """torchao float8 post-training quantization (dynamic activations, float8 weights) of the
    Linears of `dense` whose both GEMM dims are multiples of 16."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    try:
        from torchao.quantization import PerRow, PerTensor
    except ImportError:
        from torchao.quantization.granularity import PerRow, PerTensor
    granularity = {"rowwise": PerRow, "tensorwise": PerTensor}[recipe]()
    quantize_(dense, Float8DynamicActivationFloat8WeightConfig(granularity=granularity),
              filter_fn=_fp8_linear_filter)


def prepare_unit(master: nn.Module, cfg: Config, scope: str, device: torch.device) -> nn.Module:
    """A deep copy of the fp32 master (its dense arch only under --compile-scope dense) cast
    to cfg.dtype, in eval mode, quantized for torchao rows; compile_unit compiles it."""
    if cfg.kind == "torchao":
        if device.type != "cuda":
            raise RuntimeError(f"torchao float8 inference needs a CUDA device with FP8 support, not {device.type}")
        version, why = _torchao_import()
        if version is None:
            raise ModuleNotFoundError(f"torchao is not importable ({why})")
    if scope == "dense":
        unit = copy.deepcopy(master.dense).to(cfg.dtype)
        dense = unit
    else:
        unit = to_dense_dtype(copy.deepcopy(master), cfg.dtype)
        dense = unit.dense
    unit.eval()
    if cfg.kind == "torchao":
        _quantize_torchao(dense, cfg.recipe)
    return unit


def calibrate_plan(setup: "ModelSetup", unit: nn.Module, cfg: Config, path: str) -> dict:
    """loka_compile.calibrate on `unit` (the config's bf16 copy) with --calibration-batches
    training-stream batches at the largest batch size, the row's loka options and
    --calibration-policy; the plan is saved to `path`. Calibration runs no speed check, so
    the row's compile decides speed in its mode. Returns the row's `calibration` record,
    with each static-scale site's error."""
    import loka_compile
    args = setup.args
    size = max(setup.pools)
    with torch.no_grad():
        batches = [setup.inputs(setup.train_data.batch(i, size, setup.device))
                   for i in range(args.calibration_batches)]
    t0 = time.perf_counter()
    plan = loka_compile.calibrate(unit, batches, policy=args.calibration_policy,
                                  options=loka_options_for(cfg, args.loka_options))
    seconds = time.perf_counter() - t0
    plan.save(path)
    del batches
    # The calibration's compiled code and probe statistics are not the row's.
    torch._dynamo.reset()
    loka_compile.reset()
    errors = {sid: entry["error"] for sid, entry in plan.a_scales.items()}
    return {"policy": args.calibration_policy, "batch": size, "batches": args.calibration_batches,
            "seconds": round(seconds, 2), "site_errors": errors,
            "max_error": max(errors.values(), default=None), "unsafe": dict(plan.unsafe)}


# ------------------------------------------------------------------ per-model setup


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float


def summarize_ms(ms: list[float]) -> Timing:
    """Median, p10 and p90 (linear interpolation between the per-call times), min."""
    if len(ms) >= 2:
        deciles = statistics.quantiles(ms, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ms[0]
    return Timing(statistics.median(ms), p10, p90, min(ms))


class ModelSetup:
    """The fp32 master model (trained first with --train-steps), each batch size's pool of
    inputs and the fp32 references shared by every config of one model."""

    def __init__(self, name: str, args, device: torch.device, batches: list[int]):
        self.name, self.args, self.device = name, args, device
        self.master, self.spec = build_model(name, args.preset, seed=args.seed, device=device)
        # The streams of benchmarks.train: same seeds, so the same batches.
        self.train_data = SyntheticRecsysData(self.spec, seed=1000 + args.seed)
        self.heldout_data = SyntheticRecsysData(self.spec, seed=2000 + args.seed)
        # Before the pools: under --compile-scope dense they hold the trained tables' lookups.
        self.training = train_master(self.master, self.train_data, args, device) if args.train_steps else None
        self.master.eval()
        self.unit = self.master.dense if args.compile_scope == "dense" else self.master
        self.pools: dict[int, list[tuple]] = {}
        with torch.no_grad():
            for b in batches:
                pool = [self.inputs(self.heldout_data.batch(i, b, device)) for i in range(args.pool)]
                _check_pool(name, b, pool)
                self.pools[b] = pool
        self._refs: dict[int, torch.Tensor] = {}
        self.params = count_parameters(self.master)
        self.gflops_per_sample = self._count_flops(self.heldout_data)

    def inputs(self, batch) -> tuple:
        """What the compiled unit takes for `batch`: the master's fp32 lookups and the dense
        features under --compile-scope dense, the raw model inputs under `model`."""
        if self.args.compile_scope == "dense":
            return self.master.sparse(*batch.model_inputs())
        return batch.model_inputs()

    def reference(self, batch: int) -> torch.Tensor:
        """fp32 output of the master on the first pool batch of this size."""
        if batch not in self._refs:
            with torch.no_grad():
                self._refs[batch] = self.unit(*self.pools[batch][0]).detach().double()
        return self._refs[batch]

    def _count_flops(self, data: SyntheticRecsysData) -> float:
        """GEMM FLOPs of one fp32 forward, per sample."""
        from torch.utils.flop_counter import FlopCounterMode
        b = 16
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            self.master(*data.batch(10**9, b, self.device).model_inputs())
        return counter.get_total_flops() / b / 1e9


def train_master(master: nn.Module, data: SyntheticRecsysData, args, device: torch.device) -> dict:
    """Train `master` --train-steps steps on the training stream the way benchmarks.train's
    eager_bf16 row trains: a copy with its dense arch (and so its Adam state) in bf16, the
    tables fp32, train.py's loss, optimizer, lr warmup and defaults for the preset (batch,
    lr; --train-batch over its batch). Eager: no compile. The trained weights are then loaded
    into the fp32 master (bf16 -> fp32 is exact). Returns the row's `training` record."""
    targs = train_parse_args(["--preset", args.preset])
    if args.train_batch:
        targs.batch = args.train_batch
    model = copy.deepcopy(master)
    runner = Runner(model, "dense", prepare_for_training(model, TRAIN_CONFIGS[TRAINING_CONFIG], "dense"),
                    cudagraphs=False)
    opt, sched = _make_optimizer(model, targs, device)
    t0 = time.perf_counter()
    losses = [train_step(runner, opt, sched, data.batch(i, targs.batch, device)).detach()
              for i in range(args.train_steps)]
    losses = torch.stack(losses).float().tolist()  # one host sync, after the last step
    seconds = time.perf_counter() - t0
    if not all(math.isfinite(v) for v in losses):
        bad = next(i for i, v in enumerate(losses) if not math.isfinite(v))
        raise FloatingPointError(f"training loss is {losses[bad]} at step {bad}")
    master.load_state_dict(model.state_dict())  # copies cast into the master's fp32 tensors
    del model, runner, opt, sched
    log(f"  trained {args.train_steps} steps at batch {targs.batch} ({TRAINING_CONFIG}) in {seconds:.1f}s: "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return {"steps": args.train_steps, "batch": targs.batch, "config": TRAINING_CONFIG, "lr": targs.lr,
            "sparse_lr": targs.sparse_lr, "lr_warmup": targs.lr_warmup, "seconds": round(seconds, 2),
            "first_loss": losses[0], "last_loss": losses[-1]}


def held_out_quality(setup: ModelSetup, fn, batch: int, cudagraphs: bool) -> dict:
    """Logloss / NE / AUC of `fn`'s logits on --eval-batches held-out batches of size
    `batch`, made one at a time (no eval set held in memory between configs)."""
    logits, labels = [], []
    with torch.no_grad():
        for i in range(setup.args.eval_batches):
            data = setup.heldout_data.batch(i, batch, setup.device)
            inputs = setup.inputs(data)
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            # A clone: the next CUDA-graph replay overwrites the output.
            logits.append(fn(*inputs).detach().float().clone())
            labels.append(data.labels)
    m = quality_metrics(torch.cat(logits), torch.cat(labels))
    return {"eval_batch": batch, "eval_rows": batch * setup.args.eval_batches,
            "logloss": m["logloss"], "ne": m["ne"], "auc": m["auc"]}


def _check_pool(name: str, batch: int, pool: list[tuple]) -> None:
    """Every pool batch's float inputs are not all zero, and the first two differ."""
    floats = [[t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()] for inputs in pool]
    for ts in floats:
        if not ts or all(not t.any() for t in ts):
            raise ValueError(f"{name}: an all-zero input at batch {batch}")
    if len(floats) >= 2 and all(torch.equal(a, b) for a, b in zip(floats[0], floats[1])):
        raise ValueError(f"{name}: pool batches at batch {batch} are not distinct")


# ------------------------------------------------------------------ one config


def _base_row(model: str, cfg_name: str, args, batches: list[int]) -> dict:
    cfg = lookup_train_config(cfg_name, CONFIGS)
    return {
        "model": model, "preset": args.preset, "config": cfg_name, "mode": cfg.mode if cfg else None,
        "compile_scope": args.compile_scope, "dynamic_shapes": args.dynamic_shapes,
        "loka_options": loka_options_for(cfg, args.loka_options) if cfg and cfg.kind == "loka" else None,
        "disabled_mods": [cfg.ablated] if cfg and cfg.ablated else None,
        "batch_sizes": list(batches), "warmup": args.warmup, "iters": args.iters, "pool": args.pool,
        "per_batch": [], "speedup_ref": SPEEDUP_REF.get(cfg.mode) if cfg else None,
        "error_batch": None, "out_relerr": None, "loka_report": None, "training": None,
        "eval_batch": None, "eval_rows": None, "logloss": None, "ne": None, "auc": None,
        "logloss_rel_bf16": None, "ne_rel_bf16": None, "auc_rel_bf16": None, "within_quality_target": None,
        "calibration": None,
        "dense_params": None, "sparse_params": None, "gflops_per_sample": None, "wall_s": None, "error": None,
    }


def _time_batch(fn, pool: list[tuple], warmup: int, iters: int, cuda: bool, cudagraphs: bool) -> tuple[float, Timing]:
    """(first call's wall seconds, timing of `iters` calls after `warmup` calls), cycling
    through `pool`."""
    def call(i):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*pool[i % len(pool)])

    t0 = time.perf_counter()
    call(0)
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for i in range(1, warmup):
        call(i)
    # Then WARMUP_SECONDS more of calls on GPU: with 5 warm-up calls after a compile, MaskNet
    # bf16 at batch 1 timed slower than at 64 (H100 medians 0.36 vs 0.26 ms, p90 0.40).
    settled = time.perf_counter() + WARMUP_SECONDS
    while cuda and time.perf_counter() < settled:
        call(warmup)
        warmup += 1
        if warmup % 16 == 0:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            call(warmup + i)
            end.record()
        torch.cuda.synchronize()
        ms = [start.elapsed_time(end) for start, end in events]
    else:
        ms = []
        for i in range(iters):
            t = time.perf_counter()
            call(warmup + i)
            ms.append((time.perf_counter() - t) * 1e3)
    return first_s, summarize_ms(ms)


def loka_report_summary(compiled) -> dict:
    """First line of str(report), report.mods, the number of sites that cast A with a
    calibrated static scale, and report.cached_weight_bytes (if this loka has it) of the
    graphs loka compiled for `compiled`."""
    import loka_compile
    report = loka_compile.report(compiled)
    out = {"summary": str(report).splitlines()[0], "mods": dict(report.mods),
           "static_scale_sites": sum(s.casts.get("a", "").startswith("static scale") for s in report.sites)}
    if hasattr(report, "cached_weight_bytes"):
        fp8_bytes, bf16_bytes = report.cached_weight_bytes
        out["cached_weight_bytes"] = {"fp8": fp8_bytes, "bf16": bf16_bytes}
    return out


def _restore_inductor_config(snapshot) -> None:
    if snapshot is not None:
        torch._inductor.config.load_config(snapshot)


def run_config(setup: ModelSetup, cfg_name: str, args, deadline: float | None, inductor_config=None) -> dict:
    row = _base_row(setup.name, cfg_name, args, list(setup.pools))
    row.update(dense_params=setup.params["dense"], sparse_params=setup.params["sparse"],
               gflops_per_sample=setup.gflops_per_sample, training=setup.training)
    device = setup.device
    cuda = device.type == "cuda"
    start = time.perf_counter()
    unit = fn = plan_dir = None
    cudagraphs = False
    try:
        cfg = resolve_config(cfg_name)
        if deadline is not None and time.perf_counter() > deadline:
            raise BudgetExceeded("skipped: --total-seconds budget spent before this config")
        torch._dynamo.reset()
        _restore_inductor_config(inductor_config)
        unit = prepare_unit(setup.master, cfg, args.compile_scope, device)
        if calibrated(cfg_name, cfg):
            plan_dir = tempfile.TemporaryDirectory(prefix="loka_plan_")  # kept until the row is done
            plan_path = str(Path(plan_dir.name) / "plan.json")
            row["calibration"] = calibrate_plan(setup, unit, cfg, plan_path)
            cal = row["calibration"]
            log(f"  {setup.name}/{cfg_name}: calibrated {len(cal['site_errors'])} static-scale sites in "
                f"{cal['seconds']}s, max site error {_fmt(cal['max_error'], '.3e')}, {len(cal['unsafe'])} unsafe")
            cfg = dataclasses.replace(cfg, options=cfg.options + (("plan", plan_path),))
        needed = loka_untimed_calls(cfg, args.loka_options)
        if args.warmup < needed:
            raise ValueError(f"--warmup {args.warmup} would time the probe window: this loka row takes "
                             f"{needed - 2} probe calls per batch size, then compiles its FP8 variant; "
                             f"use --warmup >= {needed}")
        fn = compile_unit(unit, cfg, args.loka_options)
        cudagraphs = cuda and cfg.mode == "reduce-overhead"
        budget_end = start + args.max_seconds
        done: list[int] = []
        with torch.no_grad():
            for b, pool in setup.pools.items():
                now = time.perf_counter()
                if now > budget_end or (deadline is not None and now > deadline):
                    flag = "--max-seconds" if now > budget_end else "--total-seconds"
                    raise BudgetExceeded(f"{flag} spent after batches {done}; skipped "
                                         f"{[x for x in setup.pools if x not in done]}")
                first_s, t = _time_batch(fn, pool, args.warmup, args.iters, cuda, cudagraphs)
                if not all(math.isfinite(v) and v > 0 for v in (t.median_ms, t.p10_ms, t.p90_ms)):
                    raise RuntimeError(f"bad timing at batch {b}: {t}")
                row["per_batch"].append({
                    "batch": b, "median_ms": t.median_ms, "p10_ms": t.p10_ms, "p90_ms": t.p90_ms,
                    "min_ms": t.min_ms, "rows_per_s": b * 1e3 / t.median_ms,
                    "tflops": setup.gflops_per_sample * b / t.median_ms, "first_call_s": round(first_s, 3),
                    "speedup_vs_inductor_bf16": None,
                })
                done.append(b)
                log(f"  {setup.name}/{cfg_name}: batch {b}: {t.median_ms:.4f} ms "
                    f"(p10 {t.p10_ms:.4f}, p90 {t.p90_ms:.4f}; first call {first_s:.1f}s)")
    except Exception as e:  # noqa: BLE001 - every failure becomes a row
        row["error"] = _error_text(e)
        row["traceback"] = traceback.format_exc(limit=-12)
        log(f"  {setup.name}/{cfg_name}: ERROR {row['error']}\n{row['traceback']}")
    # Output error, held-out quality and loka's report for whatever ran, even when a budget
    # cut the row short.
    if fn is not None and row["per_batch"]:
        b = error_batch([r["batch"] for r in row["per_batch"]])
        try:
            with torch.no_grad():
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                out = fn(*setup.pools[b][0]).detach().double().clone()
            row["error_batch"], row["out_relerr"] = b, _relerr(out, setup.reference(b))
            log(f"  {setup.name}/{cfg_name}: out_relerr {row['out_relerr']:.3e} at batch {b}")
            if not math.isfinite(row["out_relerr"]):
                raise FloatingPointError(f"output error is {row['out_relerr']} at batch {b}")
        except Exception as e:  # noqa: BLE001
            row["error"] = row["error"] or f"error measurement: {_error_text(e)}"
            log(f"  {setup.name}/{cfg_name}: ERROR {row['error']}")
        if args.eval_batches:
            try:
                row.update(held_out_quality(setup, fn, b, cudagraphs))
                log(f"  {setup.name}/{cfg_name}: held out at batch {b}: logloss {row['logloss']:.5f}, "
                    f"NE {row['ne']:.5f}, AUC {row['auc']:.5f}")
                if not all(math.isfinite(row[k]) for k in ("logloss", "ne", "auc")):
                    raise FloatingPointError(f"held-out metrics are not finite at batch {b}")
            except Exception as e:  # noqa: BLE001
                row["error"] = row["error"] or f"quality: {_error_text(e)}"
                log(f"  {setup.name}/{cfg_name}: ERROR {row['error']}")
        if cfg.kind == "loka":
            try:
                row["loka_report"] = loka_report_summary(fn)
                log(f"  {setup.name}/{cfg_name}: {row['loka_report']['summary']}")
            except Exception as e:  # noqa: BLE001 - a report failure costs the report only
                row["loka_report"] = {"error": _error_text(e)}
    row["wall_s"] = round(time.perf_counter() - start, 2)
    del unit, fn
    release_config(row, f"{setup.name}/{cfg_name}", cuda)
    if plan_dir is not None:
        plan_dir.cleanup()
    return row


def fill_speedups(rows: list[dict]) -> None:
    """Each batch entry's speedup against Inductor bf16 in the row's mode, same model and
    batch size, rows of this run."""
    by = {(r["model"], r["preset"], r["compile_scope"], r["config"]): r for r in rows}
    for r in rows:
        ref = by.get((r["model"], r["preset"], r["compile_scope"], r["speedup_ref"]))
        ref_ms = {e["batch"]: e["median_ms"] for e in ref["per_batch"]} if ref else {}
        for e in r["per_batch"]:
            e["speedup_vs_inductor_bf16"] = ref_ms[e["batch"]] / e["median_ms"] if e["batch"] in ref_ms else None


def fill_quality(rows: list[dict]) -> None:
    """Each row's held-out logloss / NE / AUC relative to its speedup_ref row (Inductor bf16
    in the same mode, same model, same eval batch size), and whether NE and AUC are both
    within QUALITY_TOLERANCE of it."""
    by = {(r["model"], r["preset"], r["compile_scope"], r["config"]): r for r in rows}
    for r in rows:
        ref = by.get((r["model"], r["preset"], r["compile_scope"], r["speedup_ref"]))
        comparable = (ref is not None and r.get("ne") is not None and ref.get("ne") is not None
                      and r["eval_batch"] == ref["eval_batch"])
        for k in ("logloss", "ne", "auc"):
            r[f"{k}_rel_bf16"] = r[k] / ref[k] - 1.0 if comparable else None
        r["within_quality_target"] = (max(abs(r["ne_rel_bf16"]), abs(r["auc_rel_bf16"])) <= QUALITY_TOLERANCE
                                      if comparable else None)


# ------------------------------------------------------------------ output


def error_batch(batches: list[int]) -> int:
    """The batch size of a row's output error and held-out quality: the largest that ran, up
    to ERROR_BATCH_MAX."""
    within = [b for b in batches if b <= ERROR_BATCH_MAX]
    return max(within) if within else min(batches)


def _row_key(r: dict) -> tuple:
    return (r["model"], r["preset"], r["config"], r.get("compile_scope"))


def format_table(rows: list[dict]) -> str:
    """Per row: model, config, median ms and speedup at each batch size, output error, error."""
    from tabulate import tabulate
    batches = sorted({e["batch"] for r in rows for e in r["per_batch"]} | {b for r in rows for b in r["batch_sizes"]})
    cols = (["model", "config"] + [c for b in batches for c in (f"ms@{b}", f"x@{b}")]
            + ["out_err", "NE", "AUC", "dNE%", "dAUC%", "q_ok", "error"])
    table = []
    for r in rows:
        at = {e["batch"]: e for e in r["per_batch"]}
        cells = []
        for b in batches:
            e = at.get(b, {})
            cells += [_fmt(e.get("median_ms"), ".4f"), _fmt(e.get("speedup_vs_inductor_bf16"), ".2f")]
        err = r.get("error") or ""
        ok = r.get("within_quality_target")
        table.append([r["model"], r["config"], *cells, _fmt(r["out_relerr"], ".2e"),
                      _fmt(r.get("ne"), ".5f"), _fmt(r.get("auc"), ".5f"), _percent(r.get("ne_rel_bf16")),
                      _percent(r.get("auc_rel_bf16")), "" if ok is None else "yes" if ok else "no",
                      err if len(err) <= 60 else err[:57] + "..."])
    refs = sorted({r["speedup_ref"] for r in rows if r["speedup_ref"]})
    lines = [tabulate(table, headers=cols, tablefmt="github", disable_numparse=True),
             f"ms@B: median ms per call at batch B; x@B: speedup vs {' / '.join(refs) or 'Inductor bf16'} "
             f"(same mode); out_err: vs fp32 at the largest batch that ran, at most {ERROR_BATCH_MAX}; "
             "NE, AUC: held out, at that batch; "
             f"dNE%, dAUC%: vs the same reference; q_ok: both within {100 * QUALITY_TOLERANCE:g}%"]
    trained = {r["model"]: r["training"] for r in rows if r.get("training")}
    lines += [f"{m}: trained {t['steps']} steps at batch {t['batch']} ({t['config']}), loss "
              f"{t['first_loss']:.4f} -> {t['last_loss']:.4f}" for m, t in trained.items()]
    for r in rows:
        cal = r.get("calibration")
        if cal:
            errors = sorted(cal["site_errors"].values())
            spread = (f"site error median {statistics.median(errors):.3e}, max {errors[-1]:.3e}" if errors
                      else "no site")
            lines.append(f"{r['model']}/{r['config']}: {len(errors)} static-scale sites ({cal['policy']}), "
                         f"{spread}; {len(cal['unsafe'])} left bf16 over the error budget")
    return "\n".join(lines)


def _percent(v: float | None) -> str:
    return "" if v is None else format(100 * v, "+.3f")


def plot(rows: list[dict], path: Path) -> None:
    """Per model (a column): median ms per call against batch size (top, log-log), and the
    speedup vs Inductor bf16 (bottom); a line per config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 7), squeeze=False)
    for column, m in enumerate(models):
        latency, speedup = axes[0][column], axes[1][column]
        for r in rows:
            if r["model"] != m or not r["per_batch"]:
                continue
            latency.plot([e["batch"] for e in r["per_batch"]], [e["median_ms"] for e in r["per_batch"]],
                         marker="o", label=r["config"])
            pts = [(e["batch"], e["speedup_vs_inductor_bf16"]) for e in r["per_batch"]
                   if e["speedup_vs_inductor_bf16"] is not None]
            if pts and r["config"] != r["speedup_ref"]:
                speedup.plot(*zip(*pts), marker="o", label=r["config"])
        latency.set_xscale("log", base=2)
        latency.set_yscale("log")
        latency.set_title(f"{m}: ms per call (median)", fontsize=9)
        speedup.set_xscale("log", base=2)
        speedup.axhline(1.0, color="k", lw=0.8)
        speedup.set_title(f"{m}: speedup vs Inductor bf16 (same run)", fontsize=9)
        speedup.set_xlabel("batch size")
        for ax in (latency, speedup):
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


NOTES = {
    "per_batch": "median/p10/p90 ms per call over --iters calls after --warmup (CUDA events on GPU, "
                 "perf_counter on CPU); rows_per_s = batch / median; first_call_s = compile of that size",
    "speedup_vs_inductor_bf16": "Inductor bf16 median / this median, same mode (speedup_ref), same batch, same run",
    "out_relerr": "||out - ref|| / ||ref|| vs an fp32 copy of the initial model, first pool batch of error_batch",
    "inputs": "--pool distinct synthetic batches per batch size, cycled; made before any config",
    "compile_scope": "dense: lookups eager fp32 once per pool batch, untimed; dense arch compiled and timed",
    "dynamic_shapes": "false: one static graph (and CUDA graph) per batch size",
    "loka_report": "first line of str(loka_compile.report(compiled)), report.mods, cached_weight_bytes, "
                   "static_scale_sites (sites casting A with a calibrated constant scale); "
                   "over the graphs of every batch size",
    "training": "--train-steps: the master trained first like benchmarks.train's eager_bf16 row (bf16 dense "
                "arch, eager, its optimizer and lr warmup); every config starts from those weights",
    "quality": "logloss / ne / auc: --eval-batches held-out batches at eval_batch (the error batch: the "
               "largest that ran, at most ERROR_BATCH_MAX), through the config's compiled callable; *_rel_bf16 = this / speedup_ref's - 1 (same "
               f"eval_batch); within_quality_target: |ne_rel| and |auc_rel| <= {QUALITY_TOLERANCE}",
    "calibration": "loka_calibrated rows: loka_compile.calibrate on --calibration-batches training-stream "
                   "batches; site_errors = each static-scale site's error (the plan's a_scales[*].error, "
                   "loka's probe_metric); unsafe = sites left bf16 over max_probe_error",
}


# ------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.infer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list of {', '.join(MODEL_NAMES)}")
    p.add_argument("--preset", default="tiny", choices=["tiny", "paper"])
    p.add_argument("--batches", default=None,
                   help=f"comma list of batch sizes; default {DEFAULT_BATCHES['cuda']} on CUDA, "
                        f"{DEFAULT_BATCHES['tiny']} for tiny presets off CUDA")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma list, or 'all'; known: {', '.join(CONFIGS)} (off CUDA, _ro names run "
                        "their default-mode twin)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls per batch size (>= 3; the first compiles; loka rows: >= probe_steps + 2)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per batch size")
    p.add_argument("--pool", type=int, default=4, help="distinct input batches per batch size, cycled")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU; default 1 for tiny presets on CPU (with 2 OpenMP "
                        "threads on a shared 2-core box, tiny calls were at times 100x slower), 0 = torch's choice")
    p.add_argument("--compile-scope", default="dense", choices=["dense", "model"])
    p.add_argument("--dynamic-shapes", action="store_true",
                   help="let Dynamo make the batch dimension dynamic (default: a static graph per batch size)")
    p.add_argument("--loka-options", type=json.loads, default=None,
                   help='JSON dict merged under the loka rows\' own options, e.g. \'{"probe_steps": 10}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-steps", type=int, default=0,
                   help="train the fp32 master this many steps (bf16 dense arch, eager, like benchmarks.train's "
                        "eager_bf16 row) before any config; 0 = random initial weights")
    p.add_argument("--train-batch", type=int, default=None,
                   help="training batch size; default benchmarks.train's (256 tiny, 8192 paper)")
    p.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches (at the error batch: the largest that ran, at most 8192) for logloss / NE / AUC; 0 = none")
    p.add_argument("--calibration-batches", type=int, default=4,
                   help="training-stream batches (largest batch size) loka_compile.calibrate sees for the "
                        "loka_calibrated rows")
    p.add_argument("--calibration-policy", default="amax", help="loka_compile.calibrate policy: amax | percentile")
    p.add_argument("--max-seconds", type=float, default=300.0,
                   help="per-config budget: no further batch size starts once spent (row gets an error)")
    p.add_argument("--total-seconds", type=float, default=None,
                   help="whole-run budget: no config or batch size starts once spent (skipped rows)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON (and PNG)")
    p.add_argument("--name", default=None, help="file stem instead of <date>_<device>_infer")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    args = p.parse_args(argv)
    if args.warmup < 3 or args.iters < 1 or args.pool < 1:
        p.error("--warmup must be >= 3 (compile, CUDA graph warmup and recording), --iters and --pool >= 1")
    if min(args.train_steps, args.eval_batches) < 0 or args.calibration_batches < 1:
        p.error("--train-steps and --eval-batches must be >= 0, --calibration-batches >= 1")
    return args


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(spec)


def main(argv=None) -> Path:
    t_start = time.perf_counter()
    args = parse_args(argv)
    device = _device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    threads = args.cpu_threads if args.cpu_threads is not None else (1 if not cuda and args.preset == "tiny" else 0)
    if threads:
        torch.set_num_threads(threads)
    # fp32 references must be real fp32, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    batches_arg = args.batches or DEFAULT_BATCHES["cuda" if cuda or args.preset == "paper" else "tiny"]
    batches = list(dict.fromkeys(int(b) for b in batches_arg.split(",") if b.strip()))
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches: positive batch sizes needed, got {batches_arg!r}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    requested = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = list(dict.fromkeys(config_for_device(c, cuda) for c in requested))
    if configs != requested:
        log(f"no CUDA graphs on {device.type}: running {configs} for {requested}")
    env = environment(device, args)
    env["argv"] = list(argv) if argv is not None else sys.argv[1:]
    env["notes"] = NOTES
    env["cpu_threads"] = torch.get_num_threads()
    stem = args.name or f"{env['date']}_{device_tag(device)}_infer"
    out_path = Path(args.out) / f"{stem}.json"
    deadline = None if args.total_seconds is None else t_start + args.total_seconds
    log(f"device {env['device']}, torch {env['torch']}, "
        f"torchao {env['torchao'] or 'unavailable: ' + str(env['torchao_import_error'])}, "
        f"loka registered: {env['loka_registered']}; models {models}; configs {configs}; "
        f"preset {args.preset}, batches {batches}; writing {out_path}")

    try:
        inductor_config = torch._inductor.config.save_config()
    except Exception as e:  # noqa: BLE001 - without a snapshot, rows run in the process's config
        log(f"Inductor config snapshot failed ({_error_text(e)}); torchao rows may change later rows' config")
        inductor_config = None
    dynamo = {"automatic_dynamic_shapes": args.dynamic_shapes}
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    dynamo[limit] = max(getattr(torch._dynamo.config, limit), len(batches) + 4)

    rows: list[dict] = []
    with torch._dynamo.config.patch(**dynamo):
        for name in models:
            try:
                setup = ModelSetup(name, args, device, batches)
            except Exception as e:  # noqa: BLE001 - a model that cannot be built still gets rows
                log(f"{name}: setup failed: {_error_text(e)}")
                for c in configs:
                    rows.append({**_base_row(name, c, args, batches), "error": f"setup: {_error_text(e)}"})
                write_json(out_path, env, rows, key=_row_key)
                continue
            log(f"{name}: dense {setup.params['dense']:,} params, sparse {setup.params['sparse']:,}, "
                f"{setup.gflops_per_sample:.5f} GFLOP/sample forward")
            for c in configs:
                log(f"{name}/{c}: start")
                rows.append(run_config(setup, c, args, deadline, inductor_config))
                fill_speedups(rows)
                fill_quality(rows)
                write_json(out_path, env, rows, key=_row_key)
            del setup
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    _restore_inductor_config(inductor_config)

    fill_speedups(rows)
    fill_quality(rows)
    write_json(out_path, env, rows, key=_row_key)
    if args.plot:
        try:
            plot(rows, out_path.with_suffix(".png"))
            log(f"plot written to {out_path.with_suffix('.png')}")
        except Exception as e:  # noqa: BLE001 - a missing matplotlib must not lose the results
            log(f"plot failed: {_error_text(e)}")
    log(f"results written to {out_path}")
    print(format_table(rows), flush=True)
    return out_path


if __name__ == "__main__":
    main()
