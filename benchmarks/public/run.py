"""Public-model benchmark: the models of benchmarks.public (deepctr-torch, torch-rechub, as
they ship) in training and inference, one row per (model, mode, config).

    python -m benchmarks.public.run --preset production --out DIR          # GPU
    python -m benchmarks.public.run --preset tiny --steps 2 --out /tmp/pub  # CPU smoke test
    python -m benchmarks.public.run --models sequence,torch_rechub.MMOE --modes train

Configurations (`--configs`, names of benchmarks.train): eager_bf16, inductor_bf16_ro,
torchao_tensorwise_ro, torchao_rowwise_ro, loka_ro (loka's defaults), loka_all_fp8_ro
(loka with {"speed_check": False, "probe_steps": 0}: every eligible site FP8). Off CUDA a
`_ro` name runs as its default-mode twin (no CUDA graphs), as in benchmarks.infer.
torchao rows record why when torchao does not import; torchao inference (post-training
quantization, benchmarks.infer's recipe) needs CUDA. `<loka config>_planned` (loka_planned,
loka_ro_planned, ...): the loka config compiled with the plan its own row saved earlier in
the run or in an earlier run into the same --out (every loka row saves its plan under
`<out>/plans/`): no probe window, one compile, its speed checks from the warm performance
database; list it after its base config. Its `first_steps_x_inductor` is the saved-plan
compile overhead.

bf16 here is autocast (torch.autocast, bf16) over the library's fp32 model: these models
take float inputs that carry ids (deepctr-torch) and feed fp32 embeddings into their
Linears, so casting the module, as benchmarks.train does to its zoo's dense arch, breaks
them; the weights, their gradients and Adam's state stay fp32 (master weights), and the
loss is computed in fp32 outside autocast. The whole model is compiled, embedding lookups
included, with its loss in training (the unit `TrainUnit`); Adam (fused on CUDA) steps
every parameter, tables included, as these libraries train.

Per row:
- `step_ms`: median of `--steps` timed steps (training: forward, loss, backward, Adam
  step; inference: one forward under torch.no_grad in eval mode), timed by
  benchmarks.infer's `_time_batch`: CUDA events around each call on GPU (CUDA graphs for
  `_ro` configs, each call marked a new step), cycling through `--pool` distinct
  synthetic batches made before any config, after the first steps and `--warmup` more
  untimed calls (and half a second of calls on GPU for the clocks to settle);
  `speedup_vs_inductor_bf16` = Inductor bf16's step_ms / the row's, Inductor in the same
  mode where the run has it (`speedup_ref` names it);
- `first_steps_s`: wall time of the first `--first-steps` (5) steps, from the first
  call (compiles, loka's probe window and FP8 compile, CUDA-graph recording), and
  `first_steps_x_inductor` against the Inductor row's;
- `out_relerr`: after the timed steps, the prediction of a held-out batch against an fp32
  eager copy of the row's own current weights, ||out - ref|| / ||ref|| (training: the
  training-mode forward; inference: the untrained fp32 model, in eval mode), and
  `out_relerr_x_bf16`, that as a multiple of eager bf16's in the same mode;
- `fp8_flop_share`: loka rows, the FP8 sites' share of the GEMM FLOPs loka found (sites of
  concrete shape, loka_compile.report), with the site counts and any graph loka had to
  run in high precision (`loka_fallbacks`); `seen_flop_share`, the share of the GEMM FLOPs
  in loka's graphs that it made sites of (the rest, `unseen_gemms` by op: attention
  kernels, convolutions; benchmarks.public.coverage audits every model); `graph_speed`, per
  graph the graph speed check saw (`loka_compile.graph_speed.GraphSpeed`): the gain the site
  timings predicted, each variant's measured step and the one kept, or why it did not time;
- `graph_breaks`: Dynamo's graph breaks while the row ran (library code it cannot trace),
  with the reasons, and `graphs` (Dynamo's unique graphs).
- `cudagraph_skips`: graphs Inductor compiled without CUDA graphs in a CUDA-graph mode, by
  Inductor's reason (its `cudagraphs` log; a skipped graph launches every kernel at every call);
- `host_reads` (with `--host-reads N`): over N more steps after the timed ones, each host
  read of a tensor value and each synchronization (on CUDA, a wait for the device), by the
  code that made it (`benchmarks.host_overhead.HostReads`), and `host_reads_per_step`.

Each row runs inside try/except: a failure (crash, missing library, budget) becomes a row
with `error` (and `traceback`), never an abort. Results: `<out>/<stem>.json` (rows merged
with those already there, rewritten after every row), `<stem>.md`, a markdown table of
every row in the JSON, and `<stem>.png` (with matplotlib, the bench extra): each config's
speedup over Inductor bf16 against its model's FP8 ceiling at 1.6x (profiled rows, `--profile`),
and every row's speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from benchmarks.ceiling import profile_kernels, summarize_kernels
from benchmarks.infer import _device as infer_device, _quantize_torchao, _time_batch, config_for_device
from benchmarks.public.models import (MODEL_NAMES, PRESETS, REGISTRY, build, clone_model, count_parameters,
                                      gemm_flops_per_sample, library_versions, prediction)
from benchmarks.train import (BudgetExceeded, Config, _error_text, _fmt, _fp8_linear_filter, _relerr, _torchao_import,
                              compile_unit, device_tag, log, loka_untimed_calls, release_config, resolve_config,
                              write_json)

DEFAULT_CONFIGS = ("eager_bf16", "inductor_bf16_ro", "torchao_tensorwise_ro", "torchao_rowwise_ro", "loka_ro",
                   "loka_all_fp8_ro")
MODES = ("train", "infer")
FAMILIES = ("interaction", "sequence", "multi_task", "retrieval")
# Inductor rows a row's speed is read against, in order of preference, by compile mode.
SPEEDUP_REFS = {"reduce-overhead": ("inductor_bf16_ro", "inductor_bf16"),
                "default": ("inductor_bf16", "inductor_bf16_ro"),
                "eager": ("inductor_bf16_ro", "inductor_bf16")}
ERROR_REFS = ("eager_bf16", "inductor_bf16_ro", "inductor_bf16")


PLANNED = "_planned"


def resolve_row_config(name: str) -> tuple[Config, str | None]:
    """(the row's Config, the loka config whose saved plan it loads or None)."""
    if name.endswith(PLANNED):
        base = name[:-len(PLANNED)]
        cfg = resolve_config(base)
        if cfg.kind != "loka":
            raise ValueError(f"{name!r}: only a loka config can load a saved plan ({base!r} is {cfg.kind})")
        return dataclasses.replace(cfg, name=name), base
    return resolve_config(name), None


def plan_path(out: str | Path, model: str, preset: str, batch: int, mode: str, cfg_name: str) -> Path:
    """Where a loka row saves its plan and a `_planned` row reads it."""
    return Path(out) / "plans" / f"{model}__{preset}_{batch}__{mode}__{cfg_name}.json"


# ------------------------------------------------------------------ compiled units


class TrainUnit(nn.Module):
    """What a training row compiles: the library model under autocast (bf16 rows) and its
    loss in fp32; returns (loss, prediction)."""

    def __init__(self, bench, model: nn.Module, amp: bool):
        super().__init__()
        self.model, self.amp = model, amp
        self.bench = bench
        self.device_type = bench.device.type

    def forward(self, inputs, labels):
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.amp):
            out = self.model(inputs)
        return self.bench.loss(out, labels, self.model), prediction(out)


class InferUnit(nn.Module):
    """What an inference row compiles: the model's prediction (labels are ignored)."""

    def __init__(self, bench, model: nn.Module, amp: bool):
        super().__init__()
        self.model, self.amp = model, amp
        self.device_type = bench.device.type

    def forward(self, inputs, labels=None):
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.amp):
            return prediction(self.model(inputs))


# ------------------------------------------------------------------ per model


class Setup:
    """The fp32 master (it never runs: every row starts from a copy), the pool of training
    batches and the held-out batch shared by every row of one model."""

    def __init__(self, name: str, args, device: torch.device):
        self.name, self.args, self.device = name, args, device
        self.bench = build(name, args.preset, device=device, seed=args.seed)
        self.master = self.bench.model
        self.pool = [self.bench.batch(i, args.batch) for i in range(args.pool)]
        self.heldout = self.bench.batch(0, args.batch, seed=args.seed + 1000)
        self.params = count_parameters(self.master)
        self.train_gflops = gemm_flops_per_sample(self.bench)
        self.infer_gflops = gemm_flops_per_sample(self.bench, forward_only=True)

    def fresh(self) -> nn.Module:
        return clone_model(self.master)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def fp8_summary(compiled) -> dict:
    """FP8 share of the GEMM FLOPs loka found (2 M K N per site, times a bmm's batch; sites
    with a symbolic dim left out), the share of the GEMM FLOPs in loka's graphs that it
    made sites of (`seen_flop_share`; the rest: GEMM ops no site covers, `unseen_gemms`, by
    op, see benchmarks.public.coverage), site counts, fallbacks and the report's first line."""
    import loka_compile
    from benchmarks.public.coverage import loka_coverage
    report = loka_compile.report(compiled)
    covered = loka_coverage(report)
    total, fp8 = covered["loka_flops"], covered["fp8_flops"]
    return {"fp8_flop_share": fp8 / total if total else None, "seen_flop_share": covered["seen_share"],
            "unseen_gemms": covered["unseen"] or None, "fp8_sites": sum(s.fp8 for s in report.sites),
            "sites": len(report.sites), "loka_graphs": len(report.graphs),
            "loka_fallbacks": [f"{g.name}: {g.fallback}" for g in report.graphs if g.fallback],
            "loka_summary": str(report).splitlines()[0] if report.sites else None,
            "graph_speed": [{"graph": g.name, **dataclasses.asdict(g.graph_speed)} for g in report.graphs
                            if g.graph_speed is not None] or None}


def graph_break_summary() -> dict:
    from torch._dynamo.utils import counters
    reasons = {}
    for reason, n in counters["graph_break"].items():
        key = reason.splitlines()[0].strip()[:120]
        reasons[key] = reasons.get(key, 0) + n
    return {"graph_breaks": sum(reasons.values()), "graph_break_reasons": reasons,
            "graphs": counters["stats"].get("unique_graphs")}


def _base_row(setup: Setup, mode: str, cfg_name: str, args) -> dict:
    e = setup.bench.entry
    return {"model": setup.name, "library": e.library, "class": e.cls, "family": e.family, "preset": args.preset,
            "batch": args.batch, "mode": mode, "config": cfg_name, "compile_mode": None, "loka_options": None,
            "step_ms": None, "p10_ms": None, "p90_ms": None, "min_ms": None, "tflops": None,
            "speedup_vs_inductor_bf16": None, "speedup_ref": None,
            "first_steps": args.first_steps, "first_steps_s": None, "first_steps_x_inductor": None,
            "out_relerr": None, "out_relerr_x_bf16": None, "error_ref": None, "out_relerr_failed": None,
            "loss_first": None, "heldout_loss": None, "heldout_loss_fp32": None,
            "fp8_flop_share": None, "seen_flop_share": None, "unseen_gemms": None, "fp8_sites": None, "sites": None,
            "loka_graphs": None, "loka_fallbacks": None,
            "loka_summary": None, "graph_speed": None, "graph_breaks": None, "graph_break_reasons": None, "graphs": None,
            "dense_params": setup.params["dense"], "sparse_params": setup.params["sparse"],
            "gemm_gflops_per_sample": setup.train_gflops if mode == "train" else setup.infer_gflops,
            "cudagraph_skips": None, "host_reads": None, "host_reads_per_step": None,
            "skipped": False, "error": None, "traceback": None, "wall_s": None}


def run_row(setup: Setup, mode: str, cfg_name: str, args, deadline: float | None) -> dict:
    """One (mode, config) row of one model; every failure is the row's error."""
    from torch._dynamo.utils import counters
    row = _base_row(setup, mode, cfg_name, args)
    cuda = setup.device.type == "cuda"
    start = time.perf_counter()
    model = unit = fn = opt = None
    skips = _CudagraphSkips()
    try:
        cfg, planned_from = resolve_row_config(cfg_name)
        row["compile_mode"] = cfg.mode
        loka_options = args.loka_options
        if planned_from is not None:
            saved = plan_path(args.out, setup.name, args.preset, args.batch, mode, planned_from)
            if not saved.is_file():
                row["skipped"] = True
                raise FileNotFoundError(f"skipped: no plan saved by a {planned_from} row at {saved} "
                                        f"(list {planned_from} before {cfg_name})")
            loka_options = {**(loka_options or {}), "plan": str(saved)}
        if cfg.kind == "loka":
            from benchmarks.train import loka_options_for
            row["loka_options"] = loka_options_for(cfg, loka_options)
        if deadline is not None and time.perf_counter() > deadline:
            row["skipped"] = True
            raise BudgetExceeded("skipped: --total-seconds budget spent before this row")
        if cfg.kind == "torchao":
            version, why = _torchao_import()
            if version is None:
                row["skipped"] = True
                raise ModuleNotFoundError(f"skipped: torchao is not importable ({why})")
            if mode == "infer" and not cuda:
                row["skipped"] = True
                raise RuntimeError("skipped: torchao float8 inference needs a CUDA device with FP8 support")
        needed = loka_untimed_calls(cfg, loka_options)
        if args.first_steps + args.warmup < needed:
            raise ValueError(f"--first-steps + --warmup = {args.first_steps + args.warmup} would time loka's "
                             f"probe window: this row needs {needed} untimed calls")
        torch._dynamo.reset()
        counters.clear()
        amp = cfg.dtype == torch.bfloat16
        model = setup.fresh()
        if mode == "infer":
            model.eval()
        if cfg.kind == "torchao":
            if mode == "train":
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
                convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(cfg.recipe),
                                           module_filter_fn=_fp8_linear_filter)
            else:
                _quantize_torchao(model, cfg.recipe)
        unit = (TrainUnit if mode == "train" else InferUnit)(setup.bench, model, amp)
        fn = compile_unit(unit, cfg, loka_options)
        cudagraphs = cuda and cfg.mode == "reduce-overhead"

        if mode == "train":
            opt = torch.optim.Adam(model.parameters(), lr=args.lr, **({"fused": True} if cuda else {}))

            def call(inputs, labels):
                loss, _ = fn(inputs, labels)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
        else:
            def call(inputs, labels):
                # no_grad in every inference call (timed, profiled): grad mode is in Dynamo's guards
                # and in how matmul decomposes, so a call with grad on profiles another graph
                with torch.no_grad():
                    return fn(inputs)

        budget_end = start + args.max_seconds
        with torch.set_grad_enabled(mode == "train"):
            t_first = time.perf_counter()
            for i in range(args.first_steps):
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                out = call(*setup.pool[i % len(setup.pool)])
                if i == 0 and mode == "train":
                    row["loss_first"] = out.item()
                    if not math.isfinite(row["loss_first"]):
                        raise FloatingPointError(f"loss is {row['loss_first']} at the first step")
                if time.perf_counter() > budget_end:
                    raise BudgetExceeded(f"--max-seconds {args.max_seconds} spent after {i + 1} steps")
            _sync(cuda)
            row["first_steps_s"] = round(time.perf_counter() - t_first, 3)
            log(f"  {setup.name}/{mode}/{cfg_name}: first {args.first_steps} steps {row['first_steps_s']:.1f}s")
            _, t = _time_batch(call, setup.pool, args.warmup, args.steps, cuda, cudagraphs)
        row.update(step_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms, min_ms=t.min_ms,
                   tflops=row["gemm_gflops_per_sample"] * args.batch / t.median_ms)
        log(f"  {setup.name}/{mode}/{cfg_name}: {t.median_ms:.3f} ms (p10 {t.p10_ms:.3f}, p90 {t.p90_ms:.3f})")
        if args.host_reads:
            row.update(_host_reads(call, setup, args.host_reads, cudagraphs))
        try:  # a failed error measurement costs the error columns, not the row's timing
            row.update(_measure_error(setup, mode, model, fn, cudagraphs))
        except Exception as e:  # noqa: BLE001
            row["out_relerr_failed"] = _error_text(e)
            log(f"  {setup.name}/{mode}/{cfg_name}: error measurement failed: {row['out_relerr_failed']}")
        if args.profile:
            row.update(_profile_row(call, setup, cuda, cudagraphs))
        if cfg.kind == "loka":
            row.update(fp8_summary(fn))
            if planned_from is None:
                row.update(_save_plan(fn, plan_path(args.out, setup.name, args.preset, args.batch, mode, cfg_name)))
        if cfg.kind != "eager":
            row.update(graph_break_summary())
    except Exception as e:  # noqa: BLE001 - every failure becomes a row
        row["error"] = _error_text(e)
        if not row["skipped"]:
            row["traceback"] = traceback.format_exc(limit=-12)
        log(f"  {setup.name}/{mode}/{cfg_name}: {'SKIPPED' if row['skipped'] else 'ERROR'} {row['error']}")
        if fn is not None and "loka_options" in row and not cfg_name.endswith(PLANNED) and "plan_saved" not in row:
            # the failed row's decisions: loading its plan elsewhere (a CPU) makes the same graphs
            row.update(_save_plan(fn, plan_path(args.out, setup.name, args.preset, args.batch, mode, cfg_name)))
    finally:
        row["cudagraph_skips"] = skips.close()
        if row["cudagraph_skips"]:
            log(f"  {setup.name}/{mode}/{cfg_name}: graphs without CUDA graphs: {row['cudagraph_skips']}")
        row["wall_s"] = round(time.perf_counter() - start, 2)
        del model, unit, fn, opt
        release_config(row, f"{setup.name}/{mode}/{cfg_name}", cuda)
    return row


class _CudagraphSkips(logging.Handler):
    """Collects Inductor's reasons for compiling a graph without CUDA graphs while installed
    (from `__init__` to `close`), on its `cudagraphs` log."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: dict = {}
        from torch._inductor import cudagraph_utils
        self._log = cudagraph_utils.cudagraphs_log
        self._log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        reason = record.getMessage().splitlines()[0][:200]
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def close(self):
        self._log.removeHandler(self)
        super().close()
        return self.reasons or None


def _host_reads(call, setup: Setup, steps: int, cudagraphs: bool) -> dict:
    """The host reads and synchronizations of `steps` more steps, by caller."""
    from benchmarks.host_overhead import HostReads
    with HostReads() as reads:
        for i in range(steps):
            if cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            call(*setup.pool[i % len(setup.pool)])
    return {"host_reads": reads.by_caller(), "host_reads_per_step": reads.total() / steps}


def _save_plan(compiled, path: Path) -> dict:
    """The row's plan written to `path` for a `_planned` row; a failure costs only that."""
    import loka_compile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        loka_compile.save_plan(compiled, path)
    except Exception as e:  # noqa: BLE001
        return {"plan_saved": None, "plan_failed": _error_text(e)}
    return {"plan_saved": str(path)}


def _profile_row(call, setup: Setup, cuda: bool, cudagraphs: bool) -> dict:
    """One profiled step: kernel time, GEMM share, the ceiling at 1.6x and the three largest
    non-GEMM kernels (benchmarks.ceiling's classification)."""
    inputs, labels = setup.pool[0]

    def step():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        call(inputs, labels)

    try:
        summary = summarize_kernels(*profile_kernels(step, cuda), top=30)
    except Exception as e:  # noqa: BLE001 - a failed profile costs the profile columns only
        return {"profile_failed": _error_text(e)}
    non_gemm = [k for k in summary["top_kernels"] if not k["gemm"]][:3]
    return {"kernel_ms": summary["total_ms"], "gemm_share": summary["gemm_share"],
            "ceiling_1p6x": summary["ceiling_1p6x"], "top_non_gemm": non_gemm,
            "top_kernels": summary["top_kernels"][:10]}


def _measure_error(setup: Setup, mode: str, model: nn.Module, fn, cudagraphs: bool) -> dict:
    """The row's prediction on the held-out batch against an fp32 eager copy of its weights
    (training: its current weights, training-mode forward; inference: the master)."""
    inputs, labels = setup.heldout
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    if mode == "train":
        loss, pred = fn(inputs, labels)
        out, heldout_loss = pred.detach().float().clone(), loss.item()
        loss.backward()
        model.zero_grad(set_to_none=True)
        ref = setup.fresh()
        ref.load_state_dict(model.state_dict())
        ref_out = ref(inputs)
        ref_loss = setup.bench.loss(ref_out, labels, ref).item()
    else:
        with torch.no_grad():
            out = fn(inputs).detach().float().clone()
            ref = setup.fresh().eval()
            ref_out = ref(inputs)
        heldout_loss = setup.bench.loss_fn(out, labels).item() if setup.bench.entry.loss != "ctr_aux" else None
        ref_loss = None
    ref_pred = prediction(ref_out).detach()
    del ref
    return {"out_relerr": _relerr(out, ref_pred), "heldout_loss": heldout_loss, "heldout_loss_fp32": ref_loss}


# ------------------------------------------------------------------ relative columns


def fill_relative(rows: list[dict]) -> None:
    """Speed and first-steps time against Inductor bf16, output error against bf16's, per
    (model, preset, batch, mode)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["preset"], r["batch"], r["mode"]), []).append(r)
    for group in groups.values():
        by = {r["config"]: r for r in group}
        err_ref = next((by[c] for c in ERROR_REFS if c in by and by[c].get("out_relerr")), None)
        for r in group:
            ref = next((by[c] for c in SPEEDUP_REFS.get(r.get("compile_mode") or "default", ())
                        if c in by and by[c].get("step_ms")), None)
            if ref is not None and r.get("step_ms"):
                r["speedup_ref"] = ref["config"]
                r["speedup_vs_inductor_bf16"] = ref["step_ms"] / r["step_ms"]
                if ref.get("first_steps_s") and r.get("first_steps_s"):
                    r["first_steps_x_inductor"] = r["first_steps_s"] / ref["first_steps_s"]
            if err_ref is not None and r.get("out_relerr") is not None:
                r["error_ref"] = err_ref["config"]
                r["out_relerr_x_bf16"] = r["out_relerr"] / err_ref["out_relerr"]


# ------------------------------------------------------------------ output


def _row_key(r: dict) -> tuple:
    return (r["model"], r["preset"], r["batch"], r["mode"], r["config"])


def environment(device: torch.device, args) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    version, why = _torchao_import()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version, "torchao": version, "torchao_import_error": why,
        "libraries": library_versions(), "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "date": _dt.date.today().isoformat(), "argv": sys.argv[1:], "preset": args.preset,
        "loka_registered": "loka" in torch._dynamo.list_backends(exclude_tags=()),
        "notes": {
            "bf16": "torch.autocast(bf16) over the fp32 library model; loss in fp32; Adam on fp32 weights",
            "step_ms": "median of the timed steps (CUDA events on GPU); train: forward+loss+backward+Adam, "
                       "infer: forward under no_grad in eval mode",
            "speedup_vs_inductor_bf16": "speedup_ref's step_ms / this row's",
            "first_steps_s": "wall time of the first first_steps steps, compiles included",
            "out_relerr": "held-out batch prediction vs an fp32 eager copy of the row's weights",
            "out_relerr_x_bf16": "out_relerr / error_ref's out_relerr",
            "fp8_flop_share": "loka rows: FP8 sites' share of GEMM FLOPs (loka_compile.report, concrete shapes)",
            "seen_flop_share": "loka rows: share of the GEMM FLOPs in loka's graphs that are sites",
            "graph_breaks": "Dynamo graph breaks while the row ran (compiled rows)",
        },
    }


def format_markdown(env: dict, rows: list[dict]) -> str:
    from tabulate import tabulate
    cols = ["model", "mode", "config", "step ms", "vs Inductor bf16", "out err", "err x bf16", "FP8 FLOPs",
            "GEMM FLOPs seen", "first steps s", "x Inductor", "graph breaks", "GEMM share", "ceiling 1.6x",
            "largest non-GEMM", "error"]
    table = []
    for r in rows:
        err = r.get("error") or ""
        share = r.get("fp8_flop_share")
        table.append([r["model"], r["mode"], r["config"], _fmt(r.get("step_ms"), ".3f"),
                      _fmt(r.get("speedup_vs_inductor_bf16"), ".2f"), _fmt(r.get("out_relerr"), ".2e"),
                      _fmt(r.get("out_relerr_x_bf16"), ".2f"), "" if share is None else f"{100 * share:.0f}%",
                      "" if r.get("seen_flop_share") is None else f"{100 * r['seen_flop_share']:.0f}%",
                      _fmt(r.get("first_steps_s"), ".2f"), _fmt(r.get("first_steps_x_inductor"), ".2f"),
                      "" if r.get("graph_breaks") is None else str(r["graph_breaks"]),
                      _fmt(r.get("gemm_share"), ".2f"), _fmt(r.get("ceiling_1p6x"), ".2f"), _largest_non_gemm(r),
                      err if len(err) <= 80 else err[:77] + "..."])
    libs = ", ".join(f"{k} {v}" for k, v in env.get("libraries", {}).items() if v)
    head = [f"# Public-model benchmark, preset {env.get('preset')}",
            "",
            f"{env.get('date')}, {env.get('device')}, torch {env.get('torch')}, "
            f"torchao {env.get('torchao') or 'not importable'}; {libs}.",
            "",
            "step ms: median step (train: forward + loss + backward + Adam; infer: forward); vs Inductor bf16: "
            "Inductor bf16's step time / the row's (same mode where the run has it); out err: held-out "
            "prediction vs an fp32 eager copy of the row's weights, err x bf16 that over eager bf16's; "
            "FP8 FLOPs: loka's FP8 share of GEMM FLOPs; GEMM FLOPs seen: the share of the GEMM FLOPs in loka's "
            "graphs it made sites of; first steps s: wall time of the first steps, "
            "compiles included, x Inductor against Inductor bf16's. bf16 = autocast.",
            ""]
    return "\n".join(head) + tabulate(table, headers=cols, tablefmt="github") + "\n"


def _largest_non_gemm(row: dict) -> str:
    top = row.get("top_non_gemm") or []
    return "; ".join(f"{k['name'][:40]} {k['ms']:.2f} ms" for k in top[:3])


def write_outputs(path: Path, env: dict, rows: list[dict]) -> None:
    write_json(path, env, rows, key=_row_key)
    merged = json.loads(path.read_text())["rows"]
    fill_relative(merged)
    path.with_suffix(".md").write_text(format_markdown(env, merged))
    try:
        plot_speedups(merged, path.with_suffix(".png"))
    except ImportError as error:  # matplotlib is the bench extra's; the JSON and table stand without it
        log(f"plot skipped: {error}")


def ceilings(rows: list[dict]) -> dict:
    """(model, preset, batch, mode) -> the FP8 ceiling at 1.6x of a profiled row of that group
    (Inductor bf16's where it was profiled: the ceiling describes the model, not a config)."""
    found = {}
    for r in sorted(rows, key=lambda r: r.get("config") not in SPEEDUP_REFS.get(r.get("compile_mode") or "default", ())):
        group = (r["model"], r["preset"], r["batch"], r["mode"])
        if r.get("ceiling_1p6x") and group not in found:
            found[group] = r["ceiling_1p6x"]
    return found


def plot_speedups(rows: list[dict], path: Path) -> None:
    """Two panels: each config's speedup over Inductor bf16 against its model's FP8 ceiling at
    1.6x (models with a profiled row; the diagonal is the ceiling reached), and every row's
    speedup per model and mode. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("speedup_vs_inductor_bf16") and r.get("speedup_ref") != r["config"]]
    ceiling = ceilings(rows)
    configs = list(dict.fromkeys(r["config"] for r in timed))
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5))
    for config in configs:
        mine = [r for r in timed if r["config"] == config
                and (r["model"], r["preset"], r["batch"], r["mode"]) in ceiling]
        left.scatter([ceiling[(r["model"], r["preset"], r["batch"], r["mode"])] for r in mine],
                     [r["speedup_vs_inductor_bf16"] for r in mine], label=config)
        for r in mine:
            left.annotate(f"{r['model'].split('.')[-1]} {r['mode']}",
                          (ceiling[(r["model"], r["preset"], r["batch"], r["mode"])], r["speedup_vs_inductor_bf16"]),
                          fontsize=7, xytext=(3, 3), textcoords="offset points")
    plotted = [r["speedup_vs_inductor_bf16"] for r in timed if (r["model"], r["preset"], r["batch"], r["mode"]) in ceiling]
    top = 1.05 * max([1.5, *ceiling.values(), *plotted])
    left.plot([1, top], [1, top], color="gray", linewidth=0.8, linestyle="--")
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("FP8 ceiling at 1.6x (GEMM share of a profiled step)")
    left.set_ylabel("speedup over Inductor bf16")
    left.set_title(f"against the ceiling ({len(ceiling)} profiled model/mode pairs)")
    groups = list(dict.fromkeys(f"{r['model'].split('.')[-1]} {r['mode']}" for r in timed))
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        speed = {f"{r['model'].split('.')[-1]} {r['mode']}": r["speedup_vs_inductor_bf16"]
                 for r in timed if r["config"] == config}
        right.bar([g + i * width for g in range(len(groups))], [speed.get(g, 0.0) for g in groups], width,
                  label=config)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_yscale("log")  # a 14x row and 0.96x rows on one axis
    right.set_xticks([g + width * (len(configs) - 1) / 2 for g in range(len(groups))])
    right.set_xticklabels(groups, rotation=45, ha="right", fontsize=8)
    right.set_ylabel("speedup over Inductor bf16 (log scale)")
    right.set_title("every timed row")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main


def select_models(spec: str) -> list[str]:
    """'all', or a comma list of names, families (interaction, sequence, multi_task,
    retrieval) and libraries (deepctr-torch, torch-rechub, written-here)."""
    if spec.strip() == "all":
        return list(MODEL_NAMES)
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in REGISTRY:
            names = [item]
        else:
            names = [n for n, e in REGISTRY.items() if item in (e.family, e.library)]
            if not names:
                raise SystemExit(f"unknown model, family or library {item!r}; models: {', '.join(MODEL_NAMES)}; "
                                 f"families: {', '.join(FAMILIES)}; libraries: deepctr-torch, torch-rechub, "
                                 f"written-here (models written here in the public style)")
        out += [n for n in names if n not in out]
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.public.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--models", default="all", help="'all' or a comma list of models, families, libraries")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of benchmarks.train configs")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of train, infer")
    p.add_argument("--batch", type=int, default=None, help="default: the preset's (tiny 32, production 8192)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--first-steps", type=int, default=5, help="untimed steps measured as first_steps_s")
    p.add_argument("--warmup", type=int, default=3, help="more untimed steps before timing")
    p.add_argument("--pool", type=int, default=8, help="distinct synthetic batches cycled through")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loka-options", type=json.loads, default=None, help="JSON dict of loka options for loka rows")
    p.add_argument("--max-seconds", type=float, default=600.0, help="per-row budget for the untimed first steps")
    p.add_argument("--total-seconds", type=float, default=None,
                   help="whole-run budget: rows not started by then are skipped rows")
    p.add_argument("--out", default="benchmarks/results", help="directory of the JSON and markdown")
    p.add_argument("--name", default=None, help="file stem instead of <date>_<device>_public_<preset>")
    p.add_argument("--host-reads", type=int, default=0, metavar="N",
                   help="count host reads and syncs by caller over N steps after the timed ones")
    p.add_argument("--profile", action="store_true",
                   help="profile one step per row: GEMM share, ceiling at 1.6x, largest non-GEMM kernels")
    p.add_argument("--list", action="store_true", help="print the registry and exit")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = PRESETS[args.preset].batch
    if args.steps < 1 or args.first_steps < 1 or args.warmup < 0 or args.pool < 1:
        p.error("--steps, --first-steps and --pool must be >= 1, --warmup >= 0")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(args.modes) <= set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    return args


def main(argv=None) -> Path | None:
    args = parse_args(argv)
    if args.list:
        for n, e in REGISTRY.items():
            print(f"{n:28s} {e.family:12s} {e.cls:45s} {e.note}")
        return None
    device = infer_device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references are fp32
    torch.backends.cudnn.allow_tf32 = False

    models = select_models(args.models)
    configs = []
    for c in (c.strip() for c in args.configs.split(",") if c.strip()):
        base = c[:-len(PLANNED)] if c.endswith(PLANNED) else c
        c = config_for_device(base, cuda) + c[len(base):]
        resolve_row_config(c)  # an unknown name fails here, before any model runs
        if c not in configs:
            configs.append(c)
    env = environment(device, args)
    stem = args.name or f"{env['date']}_{device_tag(device)}_public_{args.preset}"
    path = Path(args.out) / f"{stem}.json"
    deadline = None if args.total_seconds is None else time.perf_counter() + args.total_seconds
    log(f"device {env['device']}, torch {env['torch']}, torchao {env['torchao'] or 'unavailable'}, "
        f"{env['libraries']}; preset {args.preset}, batch {args.batch}; models {models}; modes {args.modes}; "
        f"configs {configs}; writing {path}")

    rows: list[dict] = []
    for name in models:
        try:
            setup = Setup(name, args, device)
        except Exception as e:  # noqa: BLE001 - a model that cannot be built still gets rows
            log(f"{name}: setup failed: {_error_text(e)}")
            for mode in args.modes:
                for c in configs:
                    rows.append({"model": name, "preset": args.preset, "batch": args.batch, "mode": mode,
                                 "config": c, "error": f"setup: {_error_text(e)}",
                                 "traceback": traceback.format_exc(limit=-8)})
            write_outputs(path, env, rows)
            continue
        log(f"{name}: dense {setup.params['dense']:,} params, tables {setup.params['sparse']:,}; "
            f"{setup.train_gflops:.4f} train GFLOP/sample")
        for mode in args.modes:
            for c in configs:
                rows.append(run_row(setup, mode, c, args, deadline))
                fill_relative(rows)
                write_outputs(path, env, rows)
        del setup
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    write_outputs(path, env, rows)
    log(f"results: {path} and {path.with_suffix('.md')}")
    print(path.with_suffix(".md").read_text(), flush=True)
    return path


if __name__ == "__main__":
    main()
