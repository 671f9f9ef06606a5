"""One-run training benchmark over the LRM zoo: speed, numerical error and model quality.

    python -m benchmarks.train --models wukong,dlrm_dcnv2 --preset tiny --steps 5

For every model, every configuration trains from the same initial weights on the same
batches, in one process:

- speed: median step time (forward + backward + optimizer step) over `--steps` timed
  steps after `--warmup` steps (CUDA events on GPU, wall clock on CPU); speedup against
  Inductor bf16 in the same mode (eager rows against Inductor default); peak memory
  allocated during the timed steps (GPU only; under CUDA graphs, `_ro` rows, a replay
  allocates nothing, so it is what stays allocated between steps, parameters, optimizer
  state and the graphs' outputs, not the activations a step holds: compare activation
  memory on rows without CUDA graphs), and `held_mem_gb`, what is allocated as the timed
  steps begin (parameters, optimizer state, anything a backend keeps between steps). Loka
  rows run loka's default probe window
  (`probe_steps` calls in high precision, then the FP8 variant compiles) inside the
  untimed calls, so they need probe_steps + 2 of them (`loka_untimed_calls`): with the
  error measurement's call below, --warmup >= probe_steps + 1 (the default 5 covers the
  default window of 2); fewer makes the row an error;
- error: the logits and the gradients of one held-out batch against an fp32 copy of the
  model on the same batch, as ||x - ref|| / ||ref||: `*_init` columns at the shared initial
  weights (before the first step; every config against the same fp32 model; a loka row
  with a probe window measures its probe variant there, high precision), the plain
  columns after the timed steps against an fp32 copy of the config's weights at that point
  (so a backend that probes first is in its steady state, on trained weights).
  `grad_relerr` concatenates the gradients of all dense-arch parameters;
  `grad_relerr_first` is the weight gradient of the first Linear of the dense arch;
- quality: after max(--quality-steps, warmup + steps) training steps, logloss, NE and AUC
  on `--eval-batches` held-out batches, also relative to the bf16 Inductor row (or eager
  bf16 when that one is missing); `within_quality_target` when NE is at most the larger of
  0.1% and the bf16 rows' own logloss spread above bf16's (NE_TOLERANCE);
- the FP8 ceiling (`ceiling` in the JSON, a second table when printed), for the rows of
  `--ceiling-configs` (default inductor_bf16): right after the timed steps, one more
  forward + backward (no optimizer step, so training is unchanged) runs under
  torch.profiler. Each kernel is classified GEMM or not by name
  (`benchmarks.ceiling.is_gemm_kernel`); `gemm_share` g is the GEMMs' part of the summed
  kernel time, and `ceiling_1p6x` / `ceiling_2x` = 1 / ((1 - g) + g / s) for s = 1.6, 2:
  the step speedup if every GEMM ran s times faster in FP8 and the casts were free. The
  ten largest kernels (`top_kernels`, each with its GEMM verdict) and the largest non-GEMM
  kernel come with it. On CUDA these are device kernel times; on CPU there are none, and
  each op's self CPU time stands in (`source` says which).

Configurations (`--configs`; `all` = every named one):
- eager_bf16, eager_fp32; inductor_bf16 (default mode), inductor_bf16_ro (reduce-overhead,
  CUDA graphs); inductor_bf16_mk[_ro]: Inductor bf16 with the multi-kernel reductions of
  loka's benchmarked_reductions Mod (speedups stay against plain Inductor bf16; read these
  rows for what that Mod gives bf16 alone); torchao_{tensorwise,rowwise}[_ro] (torchao
  float8 training);
- loka, loka_ro: the loka backend with its defaults (Dispatch speed check on);
- loka_all_fp8, loka_all_fp8_ro: loka with {"speed_check": False, "probe_steps": 0}, every
  eligible site FP8
  whether or not it pays (what the Mods must make fast);
- loka_ro_graph_speed_off, loka_ro_graph_speed_always: loka_ro with the graph speed check
  (`graph_speed_check`) off, and timing every graph with an FP8 site;
- per-Mod ablation, `<loka config>_no_<mod>` (e.g. loka_ro_no_pad): the loka config with
  the loka option `disabled_mods=(mod,)`, for each Mod of `loka_compile.passes.MODS`.
  `--ablate-mods` adds them after loka_ro (or loka) when present, or after the configs it
  names; a loka without that option makes them error rows.
Loka rows take --loka-options under their own options; the JSON records both
(`loka_options`).

Training: BCE-with-logits, Adam (fused on CUDA) with lr --lr for the dense arch and
--sparse-lr for the tables, linear warmup over --lr-warmup steps; every config gets the
same schedule, initial weights and batches. Tables with sparse gradients
(`--sparse-embeddings on`, or the preset's choice: the dlrm_dcnv2 paper preset has them)
are updated by torch.optim.SparseAdam at --sparse-lr instead: the Adam rule applied lazily,
to the rows a batch looked up only (dense Adam also keeps moving untouched rows by their
momentum), so --sparse-lr and the schedule keep their meaning; Adagrad, the usual DLRM
choice, would change the optimizer along with the gradient format.
Sparse gradients need --compile-scope dense (the default): with `model`, Inductor itself
fails on them ("Cannot access storage of SparseTensorImpl", CPU check), so use
--sparse-embeddings off there.

Each configuration runs inside try/except: a failure (a crash, an unavailable backend, an
option the installed loka does not know, a time budget) becomes a row with `error` set,
never an abort. Results go to
`<out>/<date>_<device>_train.json` (merged with rows already there), rewritten after
every row, and the tables are printed last.

By default only the dense arch is compiled (`--compile-scope dense`); the EmbeddingBag
lookups run eagerly in fp32 in front of it, as TorchRec/FBGEMM lookups do in production
(and their CUDA backward stays out of CUDA graphs). `--compile-scope model` compiles the
whole model instead.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import datetime as _dt
import gc
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.ceiling import CPU_SOURCE, profile_kernels, summarize_kernels
from benchmarks.zoo import (MODEL_NAMES, SyntheticRecsysData, build_model, count_parameters,
                            dense_parameters, quality_metrics, sparse_grad_parameters, to_dense_dtype)

_T0 = time.perf_counter()
ERROR_CHARS = 300


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ configurations


@dataclass(frozen=True)
class Config:
    """How one row trains: `kind` eager | inductor | torchao | loka; `mode` is the
    torch.compile mode (\"eager\" for eager rows); `recipe` the torchao float8 recipe;
    `options` the loka options of the row as (key, value) pairs (merged over --loka-options);
    `ablated` the Mod a `<base>_no_<mod>` row switches off, `enabled` the opt-in Mod a
    `<base>_with_<mod>` row switches on; `benchmarked_reductions` an
    inductor row compiled with the Inductor setting of loka's Mod of that name (`_mk` rows:
    multi-kernel reductions on bf16, the baseline that tells that Mod's gain on non-FP8
    kernels from FP8's)."""

    name: str
    kind: str
    mode: str
    dtype: torch.dtype = torch.bfloat16
    recipe: str | None = None
    options: tuple = ()
    ablated: str | None = None
    benchmarked_reductions: bool = False
    enabled: str | None = None


# Every eligible site FP8, whether or not it pays, and without the probe window, whose
# verdicts and output budget would keep sites in high precision.
_ALL_FP8 = (("speed_check", False), ("probe_steps", 0))

CONFIGS: dict[str, Config] = {c.name: c for c in [
    Config("eager_bf16", "eager", "eager"),
    Config("eager_fp32", "eager", "eager", dtype=torch.float32),
    Config("inductor_bf16", "inductor", "default"),
    Config("inductor_bf16_ro", "inductor", "reduce-overhead"),
    Config("inductor_bf16_mk", "inductor", "default", benchmarked_reductions=True),
    Config("inductor_bf16_mk_ro", "inductor", "reduce-overhead", benchmarked_reductions=True),
    Config("torchao_tensorwise", "torchao", "default", recipe="tensorwise"),
    Config("torchao_rowwise", "torchao", "default", recipe="rowwise"),
    Config("torchao_tensorwise_ro", "torchao", "reduce-overhead", recipe="tensorwise"),
    Config("torchao_rowwise_ro", "torchao", "reduce-overhead", recipe="rowwise"),
    Config("loka", "loka", "default"),
    Config("loka_ro", "loka", "reduce-overhead"),
    Config("loka_all_fp8", "loka", "default", options=_ALL_FP8),
    Config("loka_all_fp8_ro", "loka", "reduce-overhead", options=_ALL_FP8),
    # The graph speed check (`graph_speed_check`) off, and on for every graph (its margin's data).
    Config("loka_ro_graph_speed_off", "loka", "reduce-overhead", options=(("graph_speed_check", "off"),)),
    Config("loka_ro_graph_speed_always", "loka", "reduce-overhead", options=(("graph_speed_check", "always"),)),
]}
DEFAULT_CONFIGS = ("eager_bf16", "inductor_bf16", "inductor_bf16_ro", "torchao_tensorwise",
                   "torchao_rowwise", "loka", "loka_ro", "loka_all_fp8_ro")
# Per-Mod ablation rows are named `<loka config>_no_<mod>` (loka_ro_no_pad, ...): the base
# loka config with `disabled_mods=(mod,)`. They are made on demand (`lookup_config`), for
# the Mods in `loka_compile.passes.MODS`, read when a row runs.
_ABLATION = re.compile(r"^(?P<base>loka\w*?)_no_(?P<mod>\w+)$")
# Rows of an opt-in Mod (`loka_compile.passes.mods.OPT_IN_MODS`) are `<loka config>_with_<mod>`.
_ENABLING = re.compile(r"^(?P<base>loka\w*?)_with_(?P<mod>\w+)$")
CEILING_CONFIGS = ("inductor_bf16",)


def lookup_config(name: str, configs: dict[str, Config] | None = None) -> Config | None:
    """The Config named `name`: one of `configs` (default: this harness's CONFIGS), or an
    ablation row `<loka config>_no_<mod>` (not checked against MODS here: `resolve_config`
    does that); None if neither."""
    configs = CONFIGS if configs is None else configs
    if name in configs:
        return configs[name]
    m = _ENABLING.match(name)
    base = configs.get(m.group("base")) if m else None
    if base is not None and base.kind == "loka" and not base.ablated:
        mod = m.group("mod")
        return dataclasses.replace(base, name=name, options=base.options + (("enabled_mods", (mod,)),), enabled=mod)
    m = _ABLATION.match(name)
    base = configs.get(m.group("base")) if m else None
    if base is None or base.kind != "loka" or base.ablated:
        return None
    mod = m.group("mod")
    return dataclasses.replace(base, name=name, options=base.options + (("disabled_mods", (mod,)),),
                               ablated=mod)


def loka_mods() -> tuple[str, ...]:
    """`loka_compile.passes.MODS`: the Mods the config can switch off (raises when loka
    cannot be imported)."""
    from loka_compile.passes import MODS
    return tuple(MODS)


def resolve_config(name: str, configs: dict[str, Config] | None = None) -> Config:
    """lookup_config, raising ValueError for an unknown name or an unknown Mod."""
    cfg = lookup_config(name, configs)
    if cfg is None:
        raise ValueError(f"unknown config {name!r}; valid: {', '.join(CONFIGS if configs is None else configs)}, "
                         f"<loka config>_no_<mod> (--ablate-mods) or <loka config>_with_<opt-in mod>")
    if cfg.ablated is not None:
        mods = loka_mods()
        if cfg.ablated not in mods:
            raise ValueError(f"unknown Mod {cfg.ablated!r} in {name!r}; loka_compile.passes.MODS: {list(mods)}")
    if cfg.enabled is not None:
        from loka_compile.passes.mods import OPT_IN_MODS
        if cfg.enabled not in OPT_IN_MODS:
            raise ValueError(f"unknown opt-in Mod {cfg.enabled!r} in {name!r}; "
                             f"loka_compile.passes.mods.OPT_IN_MODS: {list(OPT_IN_MODS)}")
    return cfg


def ablation_configs(configs: list[str], bases: str, cuda: bool) -> list[str]:
    """`configs` with a `<base>_no_<mod>` row per Mod after each ablated base. `bases`:
    "auto" ablates loka_ro when the run has it, else loka when it has that, else loka_ro on
    CUDA and loka on CPU (CUDA graphs matter for LRMs); or a comma list of loka configs.
    When MODS cannot be read, each base gets one `<base>_no_mods` row, whose run records
    why."""
    if bases == "auto":
        chosen = next((b for b in ("loka_ro", "loka") if b in configs), "loka_ro" if cuda else "loka")
        wanted = [chosen]
    else:
        wanted = [b.strip() for b in bases.split(",") if b.strip()]
    try:
        mods = loka_mods()
    except Exception as e:  # noqa: BLE001 - loka not importable: rows record it
        log(f"--ablate-mods: loka_compile.passes.MODS unavailable ({_error_text(e)})")
        mods = ("mods",)
    out = list(configs)
    for base in wanted:
        if base not in out:
            out.append(base)
        at = out.index(base) + 1
        new = [f"{base}_no_{m}" for m in mods if f"{base}_no_{m}" not in out]
        out[at:at] = new
    return out


class BudgetExceeded(RuntimeError):
    pass


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


# ------------------------------------------------------------------ model wrappers


class DenseWithLoss(nn.Module):
    """The compiled unit for --compile-scope dense: dense arch + BCE loss."""

    def __init__(self, dense: nn.Module):
        super().__init__()
        self.dense = dense

    def forward(self, labels, dense, pooled, seq, seq_valid):
        logits = self.dense(dense, pooled, seq, seq_valid).float()
        return F.binary_cross_entropy_with_logits(logits, labels), logits


class ModelWithLoss(nn.Module):
    """The compiled unit for --compile-scope model: lookups + dense arch + BCE loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, labels, dense, ids, offsets, seq_ids):
        logits = self.model(dense, ids, offsets, seq_ids).float()
        return F.binary_cross_entropy_with_logits(logits, labels), logits


class Runner:
    """Runs forward(+loss) of one model the way a config compiled it."""

    def __init__(self, model: nn.Module, scope: str, fn, cudagraphs: bool):
        self.model, self.scope, self.fn, self.cudagraphs = model, scope, fn, cudagraphs

    def loss_and_logits(self, batch):
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.scope == "dense":
            return self.fn(batch.labels, *self.model.sparse(*batch.model_inputs()))
        return self.fn(batch.labels, *batch.model_inputs())


def _fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """torchao float8 needs both GEMM dims divisible by 16 (e.g. not the 256 -> 1 head)."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def predicted_saving_ms(sites) -> float | None:
    """What the speed check expects the FP8 sites to save per step: the sum of bf16_us -
    fp8_us over FP8 sites it timed, in ms, counting each graph once (the zoo's dense arch
    runs each of its graphs once per step); None when it timed none. Read against the
    measured step saving (`step_saving_ms`)."""
    timed = [s.bf16_us - s.fp8_us for s in sites if s.fp8 and s.bf16_us is not None and s.fp8_us is not None]
    return sum(timed) / 1000.0 if timed else None


def loka_site_summary(compiled: nn.Module) -> dict:
    """What loka decided for the compiled unit (every graph of its compile): FP8 sites / all sites per role, counts by reason,
    how the FP8 operands were cast, the speed check's predicted saving, and every site
    (name, role, M x K x N, provider, reason, casts, detail)."""
    import loka_compile

    report = loka_compile.report(compiled)
    by_role: dict = {}
    for s in report.sites:
        fp8_total = by_role.setdefault(s.role, [0, 0])
        fp8_total[0] += s.fp8
        fp8_total[1] += 1
    casts = [c.split(" (")[0].split(" into ")[0] for s in report.sites for c in s.casts.values()]
    flops = report._flops()  # 2 M K N (x a bmm's batch); None for a symbolic dim
    return {
        "fp8_per_role": by_role,
        "reasons": dict(collections.Counter(s.reason for s in report.sites)),
        "casts": dict(collections.Counter(casts)),
        "fallbacks": [g.fallback for g in report.graphs if g.fallback],
        "predicted_saving_ms": predicted_saving_ms(report.sites),
        "mods": report.mods,
        "sites": [{"name": s.name, "role": s.role, "shape": [str(d) for d in s.shape], "fp8": s.fp8,
                   "provider": s.provider, "reason": s.reason, "casts": s.casts, "detail": s.detail,
                   "flops": flops[id(s)]}
                  for s in report.sites],
    }


def _first_linear_weight(model: nn.Module) -> str:
    for name, mod in model.dense.named_modules():
        if isinstance(mod, nn.Linear):
            return f"dense.{name}.weight" if name else "dense.weight"
    raise ValueError("dense arch has no Linear")


def _torchao_import() -> tuple[str | None, str | None]:
    """(version, None) when torchao imports, else (None, why not)."""
    try:
        import torchao
        from torchao.float8 import convert_to_float8_training  # noqa: F401
        return getattr(torchao, "__version__", "unknown"), None
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return None, _error_text(e)


def _torchao_version() -> str | None:
    return _torchao_import()[0]


def loka_options_for(cfg: Config, loka_options: dict | None = None) -> dict:
    """The options a loka row compiles with: --loka-options, then the config's own options
    (which win: they define the row), then the mode."""
    return {**(loka_options or {}), **dict(cfg.options), "mode": cfg.mode}


def loka_untimed_calls(cfg: Config, loka_options: dict | None = None) -> int:
    """Calls a row's compiled graph must take before its first timed call: for a loka row
    with a probe window, the window's probe_steps calls, the call that closes it (the FP8
    variant compiles and runs; under CUDA graphs a warm-up run) and one more (CUDA graphs
    record); 0 for other rows and for loka rows without a window (probe_steps 0, a plan)."""
    if cfg.kind != "loka":
        return 0
    from loka_compile import LokaConfig
    config = LokaConfig.from_options(loka_options_for(cfg, loka_options))
    return config.probe_steps + 2 if config.probe_steps and config.plan is None else 0


def prepare(model: nn.Module, cfg: Config, scope: str, loka_options: dict | None = None):
    """Apply cfg to a fresh fp32 model in place; return the callable that maps
    (labels, *inputs) to (loss, logits)."""
    to_dense_dtype(model, cfg.dtype)
    if cfg.kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model.dense, config=Float8LinearConfig.from_recipe_name(cfg.recipe),
                                   module_filter_fn=_fp8_linear_filter)
    unit = DenseWithLoss(model.dense) if scope == "dense" else ModelWithLoss(model)
    return compile_unit(unit, cfg, loka_options)


def compile_unit(unit: nn.Module, cfg: Config, loka_options: dict | None = None):
    """`unit` compiled the way cfg says: itself for eager rows, torch.compile in cfg.mode for
    inductor and torchao rows (torchao's conversion is the caller's), the loka backend with
    loka_options_for(cfg, loka_options) for loka rows (shared with benchmarks.infer)."""
    if cfg.kind == "eager":
        return unit
    mode = None if cfg.mode == "default" else cfg.mode
    if cfg.kind in ("inductor", "torchao"):
        if cfg.benchmarked_reductions:  # torch.compile takes mode or options, not both
            from torch._inductor import list_mode_options
            from loka_compile.passes.mods.benchmarked_reductions import BENCHMARKED_REDUCTIONS
            return torch.compile(unit, options={**list_mode_options(cfg.mode), **BENCHMARKED_REDUCTIONS})
        return torch.compile(unit, mode=mode)
    if cfg.kind == "loka":
        if "loka" not in torch._dynamo.list_backends(exclude_tags=()):
            raise RuntimeError("backend 'loka' is not registered (pip install -e . to register it)")
        options = loka_options_for(cfg, loka_options)
        if len(options) > 1:  # torch.compile takes mode or options, not both: mode goes inside
            # Validate now, so an option this loka does not know (e.g. disabled_mods before
            # LokaConfig has it) is this row's error, not a failure deep inside compile.
            from loka_compile import LokaConfig
            LokaConfig.from_options(options)
            return torch.compile(unit, backend="loka", options=options)
        return torch.compile(unit, backend="loka", mode=mode)
    raise ValueError(f"unknown config kind {cfg.kind!r}")


# ------------------------------------------------------------------ per-model setup


class ModelSetup:
    """The fp32 master weights, the data streams and cached batches shared by every
    config of one model."""

    def __init__(self, name: str, args, device: torch.device):
        self.name, self.args, self.device = name, args, device
        sparse = {"auto": None, "on": True, "off": False}[args.sparse_embeddings]
        self.master, self.spec = build_model(name, args.preset, positive_rate=args.positive_rate,
                                             seed=args.seed, device=device, sparse=sparse)
        self.sparse_grads = bool(sparse_grad_parameters(self.master))
        self.train_data = SyntheticRecsysData(self.spec, seed=1000 + args.seed)
        self.heldout_data = SyntheticRecsysData(self.spec, seed=2000 + args.seed)
        # Every training batch is made before the first config runs: no data generation
        # (and no host syncs it needs) inside any config's timed steps.
        total = max(args.quality_steps, args.warmup + args.steps)
        self._train = [self.train_data.batch(i, args.batch, device) for i in range(total)]
        self.eval_batches = [self.heldout_data.batch(i, args.batch, device) for i in range(args.eval_batches)]
        self.error_batch = self.eval_batches[0]
        self.params = count_parameters(self.master)
        self.first_linear = _first_linear_weight(self.master)
        self.train_gflops_per_sample = self._count_train_flops()

    def train_batch(self, i: int):
        while len(self._train) <= i:
            self._train.append(self.train_data.batch(len(self._train), self.args.batch, self.device))
        return self._train[i]

    def _count_train_flops(self) -> float:
        """GEMM FLOPs of one fp32 forward + backward, per sample."""
        from torch.utils.flop_counter import FlopCounterMode
        b = 16
        batch = self.train_data.batch(10**9, b, self.device)
        with FlopCounterMode(display=False) as counter:
            logits = self.master(*batch.model_inputs())
            F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        self.master.zero_grad(set_to_none=True)
        return counter.get_total_flops() / b / 1e9


class _Each:
    """Several optimizers (or lr schedulers) stepped as one."""

    def __init__(self, items):
        self.items = list(items)

    def step(self):
        for x in self.items:
            x.step()

    def zero_grad(self, set_to_none: bool = True):
        for x in self.items:
            x.zero_grad(set_to_none=set_to_none)


def _make_optimizer(model: nn.Module, args, device: torch.device):
    """Adam (fused on CUDA) with lr --lr for the dense arch and --sparse-lr for the tables;
    tables with sparse gradients get torch.optim.SparseAdam at --sparse-lr instead (Adam
    rejects sparse gradients). SparseAdam rather than Adagrad (DLRM's usual choice): it is
    the same Adam update on the rows a batch touched (lazy: untouched rows and their moments
    stay as they are), so --sparse-lr and the schedule keep their meaning between sparse and
    dense tables, and only looked-up rows are read and written."""
    dense = [p for _, p in dense_parameters(model)]
    sparse_grad = {id(p) for _, p in sparse_grad_parameters(model)}
    tables = [p for p in model.sparse.parameters() if id(p) not in sparse_grad]
    sparse = [p for p in model.sparse.parameters() if id(p) in sparse_grad]
    kw = {"fused": True} if device.type == "cuda" else {}
    groups = [{"params": dense, "lr": args.lr}] + ([{"params": tables, "lr": args.sparse_lr}] if tables else [])
    opts = [torch.optim.Adam(groups, **kw)]
    if sparse:
        opts.append(torch.optim.SparseAdam(sparse, lr=args.sparse_lr))
    # Linear warmup: Adam's first updates are +-lr on every coordinate, which on the paper
    # Wukong (fan-in 2048-10240) swung the loss to 13 at step 2 without it (CPU check).
    warmup = max(1, args.lr_warmup)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, (step + 1) / warmup)) for o in opts]
    return _Each(opts), _Each(scheds)


def train_step(runner: Runner, opt: _Each, sched: _Each, batch) -> torch.Tensor:
    """One training step (forward, BCE loss, backward, optimizer and lr step); the loss."""
    loss, _ = runner.loss_and_logits(batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss


def _relerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(x.double() - ref.double())
            / torch.linalg.vector_norm(ref.double()).clamp_min(1e-30)).item()


def _measure_errors(setup: ModelSetup, model: nn.Module, runner: Runner, scope: str) -> dict:
    """Logit and gradient error of the config against an fp32 copy of its current weights."""
    batch = setup.error_batch
    model.zero_grad(set_to_none=True)
    loss, logits = runner.loss_and_logits(batch)
    loss.backward()
    out = logits.detach().float().clone()
    grads = {n: p.grad.detach().float().clone() for n, p in dense_parameters(model) if p.grad is not None}
    model.zero_grad(set_to_none=True)
    del loss, logits

    ref = copy.deepcopy(setup.master)
    current = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(current[n].float())
    ref_loss, ref_logits = ModelWithLoss(ref)(batch.labels, *batch.model_inputs())
    ref_loss.backward()
    ref_grads = {n: p.grad.detach() for n, p in dense_parameters(ref)}
    missing = sorted(set(ref_grads) - set(grads))
    if missing:
        raise RuntimeError(f"config produced no grad for {missing[:3]}")
    names = sorted(ref_grads)
    result = {
        "out_relerr": _relerr(out, ref_logits.detach()),
        "grad_relerr": _relerr(torch.cat([grads[n].flatten() for n in names]),
                               torch.cat([ref_grads[n].flatten() for n in names])),
        "grad_relerr_first": _relerr(grads[setup.first_linear], ref_grads[setup.first_linear]),
    }
    del ref, ref_loss, ref_logits, ref_grads, grads
    return result


@torch.no_grad()
def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().clone()


def _evaluate(setup: ModelSetup, runner: Runner) -> dict:
    """Held-out logloss / NE / AUC through the config's own (compiled) forward. Grad mode
    stays on so the training graph is reused instead of compiling an inference one."""
    logits, labels = [], []
    for batch in setup.eval_batches:
        _, lg = runner.loss_and_logits(batch)
        logits.append(_detached(lg))
        labels.append(batch.labels)
    m = quality_metrics(torch.cat(logits), torch.cat(labels))
    return {"final_logloss": m["logloss"], "final_ne": m["ne"], "final_auc": m["auc"]}


def _profile_ceiling(setup: ModelSetup, model: nn.Module, runner: Runner, batch, cfg_name: str,
                     after_steps: int, cuda: bool) -> dict:
    """Profile one forward + backward (no optimizer step, weights unchanged) of the warm
    compiled model, the way the row trains (eager lookups and their backward included under
    --compile-scope dense), and summarize it into the ceiling record (benchmarks.ceiling)."""
    def step():
        loss, _ = runner.loss_and_logits(batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    model.zero_grad(set_to_none=True)
    times, source = profile_kernels(step, cuda)
    out = summarize_kernels(times, source, top=setup.args.profile_top)
    out["profiled"] = (f"{cfg_name}: one forward+backward (no optimizer step) after {after_steps} "
                       f"training steps, batch {setup.args.batch}")
    return out


# ------------------------------------------------------------------ one config


def _base_row(setup: ModelSetup, cfg_name: str, args) -> dict:
    cfg = lookup_config(cfg_name)
    return {
        "model": setup.name, "preset": args.preset, "config": cfg_name,
        "mode": cfg.mode if cfg else None, "batch": args.batch,
        "compile_scope": args.compile_scope, "sparse_embeddings": setup.sparse_grads,
        "loka_options": (loka_options_for(cfg, args.loka_options) if cfg and cfg.kind == "loka" else None),
        "disabled_mods": [cfg.ablated] if cfg and cfg.ablated else None,
        "steps": args.steps, "train_steps": None,
        "step_ms": None, "step_ms_min": None, "step_ms_mean": None, "step_ms_max": None,
        "speedup_vs_inductor_bf16": None,
        "peak_mem_gb": None, "held_mem_gb": None, "first_step_s": None,
        "out_relerr": None, "grad_relerr": None, "grad_relerr_first": None,
        "out_relerr_x_bf16": None,
        "out_relerr_init": None, "grad_relerr_init": None, "grad_relerr_first_init": None,
        "final_logloss": None, "final_ne": None, "final_auc": None,
        "logloss_rel_bf16": None, "ne_rel_bf16": None, "auc_rel_bf16": None, "quality_ref": None,
        "within_quality_target": None, "step_saving_ms": None,
        "bf16_logloss_spread": None, "dense_params": setup.params["dense"], "sparse_params": setup.params["sparse"],
        "train_gflops_per_sample": setup.train_gflops_per_sample,
        "tflops": None, "ceiling": None, "wall_s": None, "error": None,
    }


def run_config(setup: ModelSetup, cfg_name: str, args, deadline: float | None) -> dict:
    row = _base_row(setup, cfg_name, args)
    device = setup.device
    cuda = device.type == "cuda"
    start = time.perf_counter()
    model = opt = sched = fn = runner = None
    try:
        cfg = resolve_config(cfg_name)
        if deadline is not None and time.perf_counter() > deadline:
            raise BudgetExceeded("skipped: --total-seconds budget spent before this config")
        if cfg.kind == "torchao":
            version, why = _torchao_import()
            if version is None:
                raise ModuleNotFoundError(f"torchao is not importable ({why})")
        # The error measurement's call, then --warmup steps, precede the timed steps.
        needed = loka_untimed_calls(cfg, args.loka_options)
        if 1 + args.warmup < needed:
            raise ValueError(f"--warmup {args.warmup} would time the probe window: this loka row takes "
                             f"{needed - 2} probe calls, then compiles its FP8 variant; use --warmup >= {needed - 1}")
        torch._dynamo.reset()
        model = copy.deepcopy(setup.master)
        fn = prepare(model, cfg, args.compile_scope, args.loka_options)
        runner = Runner(model, args.compile_scope, fn, cudagraphs=cuda and cfg.mode == "reduce-overhead")
        opt, sched = _make_optimizer(model, args, device)

        # Error at the shared initial weights (every config against the same fp32 model);
        # this first call also compiles.
        init_err = _measure_errors(setup, model, runner, args.compile_scope)
        row.update({f"{k}_init": v for k, v in init_err.items()})

        timed_from, timed_to = args.warmup, args.warmup + args.steps
        total = max(args.quality_steps, timed_to)
        budget_end = start + args.max_seconds
        times: list[float] = []
        done = 0
        for i in range(total):
            batch = setup.train_batch(i)
            timed = timed_from <= i < timed_to
            if timed and i == timed_from and cuda:
                torch.cuda.synchronize()
                row["held_mem_gb"] = round(torch.cuda.memory_allocated() / 2**30, 3)
                torch.cuda.reset_peak_memory_stats()
            if timed and cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            t_step = time.perf_counter()
            loss = train_step(runner, opt, sched, batch)
            if timed:
                if cuda:
                    ev[1].record()
                    times.append(ev)
                else:
                    times.append(time.perf_counter() - t_step)
            if i == 0:
                if cuda:
                    torch.cuda.synchronize()
                row["first_step_s"] = round(time.perf_counter() - start, 2)
                if not math.isfinite(loss.item()):
                    raise FloatingPointError(f"loss is {loss.item()} at step 0")
                log(f"  {setup.name}/{cfg_name}: first step (compile) {row['first_step_s']}s")
            done = i + 1
            if i + 1 == total:  # read before any later replay can overwrite a CUDA-graph output
                final_loss = loss.item()
            if i + 1 == timed_to:
                if cuda:
                    torch.cuda.synchronize()
                    ms = [a.elapsed_time(b) for a, b in times]
                    row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                else:
                    ms = [t * 1e3 for t in times]
                row["step_ms"] = statistics.median(ms)
                row["step_ms_min"] = min(ms)
                row["step_ms_mean"], row["step_ms_max"] = statistics.fmean(ms), max(ms)
                # GFLOP per step / ms per step = TFLOP/s
                row["tflops"] = setup.train_gflops_per_sample * args.batch / row["step_ms"]
                log(f"  {setup.name}/{cfg_name}: step {row['step_ms']:.3f} ms (median of {len(ms)})")
                if cfg_name in args.ceiling_configs:
                    try:  # a profiler failure costs the ceiling, not the row
                        row["ceiling"] = _profile_ceiling(setup, model, runner, batch, cfg_name, done, cuda)
                        c = row["ceiling"]
                        log(f"  {setup.name}/{cfg_name}: GEMM share {100 * c['gemm_share']:.0f}% of "
                            f"{c['total_ms']:.3f} ms{' (CPU op time)' if c['source'] == CPU_SOURCE else ''}, "
                            f"FP8 ceiling {c['ceiling_1p6x']:.2f}x at 1.6x GEMMs, {c['ceiling_2x']:.2f}x at 2x")
                    except Exception as e:  # noqa: BLE001
                        row["ceiling"] = {"error": _error_text(e)}
                        log(f"  {setup.name}/{cfg_name}: ceiling profile failed: {row['ceiling']['error']}")
                row.update(_measure_errors(setup, model, runner, args.compile_scope))
                if cfg.kind == "loka":
                    row["loka_sites"] = loka_site_summary(fn)
            if time.perf_counter() > budget_end and i + 1 < total:
                raise BudgetExceeded(f"--max-seconds {args.max_seconds} spent after {i + 1}/{total} steps")
        row["train_steps"] = done
        if not math.isfinite(final_loss):
            raise FloatingPointError(f"training loss is {final_loss} after {done} steps")
        if args.quality_steps > 0:
            row.update(_evaluate(setup, runner))
    except Exception as e:  # noqa: BLE001 - every failure becomes a row
        row["error"] = _error_text(e)
        log(f"  {setup.name}/{cfg_name}: ERROR {row['error']}")
    finally:
        row["wall_s"] = round(time.perf_counter() - start, 2)
        del model, opt, sched, fn, runner
        release_config(row, f"{setup.name}/{cfg_name}", cuda)
    return row


def release_config(row: dict, label: str, cuda: bool) -> None:
    """Free what a config compiled (Dynamo's code, loka's graph records, which hold its
    FP8 weight copies, cached GPU memory) before the next config; a failure here is the
    row's error, never the run's."""
    try:  # a broken CUDA context must not take the remaining configs' rows with it
        gc.collect()
        torch._dynamo.reset()
        if "loka_compile" in sys.modules:
            sys.modules["loka_compile"].reset()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        log(f"  {label}: cleanup failed: {_error_text(e)}")
        row["error"] = row["error"] or f"cleanup: {_error_text(e)}"


# ------------------------------------------------------------------ relative columns


# An NE above bf16's is judged against the larger of this and the bf16 rows' own spread: at 200
# steps held-out NE moves with rounding-level changes alone (DLRM-DCNv2, seed 0, H100:
# Inductor bf16 with multi-kernel reductions 0.91% above plain Inductor; seed 1 0.03%).
NE_TOLERANCE = 0.001


def fill_relative(rows: list[dict]) -> None:
    """Speedup vs Inductor bf16 in the same mode (eager rows vs default), output error as a
    multiple of eager bf16's, quality relative to bf16 Inductor (or eager bf16)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["preset"], r["batch"], r["compile_scope"]), []).append(r)
    for group in groups.values():
        by = {r["config"]: r for r in group}
        ind = {"default": by.get("inductor_bf16"), "reduce-overhead": by.get("inductor_bf16_ro")}
        ind["eager"] = ind["default"]
        eager = by.get("eager_bf16")
        qref = next((by[c] for c in ("inductor_bf16", "inductor_bf16_ro", "eager_bf16")
                     if c in by and by[c].get("final_logloss") is not None), None)
        # The bf16 rows compute the same function; their spread in held-out logloss is the
        # run-to-run noise (GPU nondeterminism, kernel choice) any quality delta must beat.
        bf16_ll = [by[c]["final_logloss"] for c in ("eager_bf16", "inductor_bf16", "inductor_bf16_ro",
                                                      "inductor_bf16_mk", "inductor_bf16_mk_ro")
                   if c in by and by[c].get("final_logloss") is not None]
        spread = (max(bf16_ll) - min(bf16_ll)) / min(bf16_ll) if len(bf16_ll) >= 2 else None
        tolerance = max(NE_TOLERANCE, spread or 0.0)
        for r in group:
            r["bf16_logloss_spread"] = spread
            ref = ind.get(r["mode"])
            if ref and ref.get("step_ms") and r.get("step_ms"):
                r["speedup_vs_inductor_bf16"] = ref["step_ms"] / r["step_ms"]
                r["step_saving_ms"] = ref["step_ms"] - r["step_ms"]
            if eager and eager.get("out_relerr") and r.get("out_relerr") is not None:
                r["out_relerr_x_bf16"] = r["out_relerr"] / eager["out_relerr"]
            if qref and r.get("final_logloss") is not None:
                r["quality_ref"] = qref["config"]
                r["logloss_rel_bf16"] = r["final_logloss"] / qref["final_logloss"] - 1.0
                r["ne_rel_bf16"] = r["final_ne"] / qref["final_ne"] - 1.0
                r["auc_rel_bf16"] = r["final_auc"] / qref["final_auc"] - 1.0
                r["within_quality_target"] = r["ne_rel_bf16"] <= tolerance  # a lower NE is no loss


# ------------------------------------------------------------------ output


def device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type.upper()
    name = torch.cuda.get_device_name(device)
    m = re.search(r"\b([ABHLV]\d{2,3}|GB\d{3}|MI\d{3}X?)\b", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def environment(device: torch.device, args) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version, "torchao": _torchao_version(),
        "torchao_import_error": _torchao_import()[1],
        "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "date": _dt.date.today().isoformat(),
        "loka_registered": "loka" in torch._dynamo.list_backends(exclude_tags=()),
        "argv": sys.argv[1:],
        "notes": {
            "step_ms": "median forward+backward+optimizer step (CUDA events on GPU)",
            "step_ms_mean": "mean of the timed steps: what occasional slow steps (loka re-checks, "
                            "recheck_every) cost in steady state; step_ms_max the slowest",
            "grad_relerr": "all dense-arch parameter grads concatenated vs fp32 copy",
            "grad_relerr_first": "weight grad of the first Linear of the dense arch",
            "errors": "*_init: at the shared initial weights; plain: after the timed steps, "
                      "vs an fp32 copy of the config's weights at that point",
            "first_step_s": "config start to end of first training step, compile included",
            "bf16_logloss_spread": "(max-min)/min held-out logloss over eager/Inductor bf16 rows: noise floor "
                                   "(NE moves by the same ratio: one eval set)",
            "within_quality_target": "ne_rel_bf16 <= max(0.1%, bf16_logloss_spread); include "
                                    "inductor_bf16_mk[_ro] for a rounding-level bf16 floor",
            "compile_scope": "dense: EmbeddingBag lookups eager fp32, dense arch + loss compiled",
            "sparse_embeddings": "tables with sparse gradients, updated by torch.optim.SparseAdam",
            "ceiling": "rows of --ceiling-configs: one profiled forward+backward (no optimizer) after the "
                       "timed steps; gemm_share = GEMM kernels' share of summed kernel time (CUDA: device "
                       "kernels; CPU: op self time, a host-side stand-in); ceiling_1p6x / ceiling_2x = "
                       "1 / ((1 - g) + g / s), the step speedup if every GEMM ran s times faster and casts "
                       "were free; top_kernels lists the 10 largest with their GEMM verdict",
            "disabled_mods": "per-Mod ablation rows (<loka config>_no_<mod>): loka with that Mod off",
            "step_saving_ms": "Inductor bf16's step_ms (same mode) minus the row's; for loka rows compare "
                              "loka_sites.predicted_saving_ms, the speed check's expected saving from its "
                              "FP8 sites (the Mods' non-FP8 effects are not in it)",
        },
    }


def _train_row_key(r: dict) -> tuple:
    return (r["model"], r["preset"], r["config"], r["batch"], r.get("compile_scope"), r.get("sparse_embeddings"))


def write_json(path: Path, env: dict, rows: list[dict], key=_train_row_key) -> None:
    """Rows replace rows with the same key (a hashable function of a row) already in the
    file; others are kept."""
    kept = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
            new_keys = {key(r) for r in rows}
            kept = [r for r in old.get("rows", []) if key(r) not in new_keys]
        except (json.JSONDecodeError, KeyError, TypeError):
            kept = []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"env": env, "rows": kept + rows}, indent=1, default=str))
    os.replace(tmp, path)


def _fmt(v, spec: str):
    if v is None:
        return ""
    return format(v, spec)


def format_table(rows: list[dict]) -> str:
    from tabulate import tabulate
    cols = ["model", "config", "mode", "step_ms", "speedup", "mem_gb", "out_err0", "out_err", "out_err_x",
            "grad_err", "grad1_err", "logloss", "NE", "AUC", "dLL%", "q_ok", "error"]
    table = []
    for r in rows:
        err = r.get("error") or ""
        table.append([
            r["model"], r["config"], r["mode"], _fmt(r["step_ms"], ".3f"),
            _fmt(r["speedup_vs_inductor_bf16"], ".2f"), _fmt(r["peak_mem_gb"], ".2f"),
            _fmt(r["out_relerr_init"], ".2e"), _fmt(r["out_relerr"], ".2e"), _fmt(r["out_relerr_x_bf16"], ".1f"),
            _fmt(r["grad_relerr"], ".2e"), _fmt(r["grad_relerr_first"], ".2e"),
            _fmt(r["final_logloss"], ".5f"), _fmt(r["final_ne"], ".4f"), _fmt(r["final_auc"], ".4f"),
            _fmt(None if r["logloss_rel_bf16"] is None else 100 * r["logloss_rel_bf16"], "+.2f"),
            {True: "yes", False: "NO", None: ""}[r.get("within_quality_target")],
            err if len(err) <= 60 else err[:57] + "...",
        ])
    lines = [tabulate(table, headers=cols, tablefmt="github")]
    spreads = {r["model"]: r["bf16_logloss_spread"] for r in rows if r.get("bf16_logloss_spread") is not None}
    if spreads:
        lines.append("noise floor, spread of held-out logloss over the bf16 rows: "
                     + ", ".join(f"{m} {100 * v:.2f}%" for m, v in spreads.items()))
    ceiling = format_ceiling_table(rows)
    if ceiling:
        lines += ["", ceiling]
    return "\n".join(lines)


def format_ceiling_table(rows: list[dict]) -> str:
    """One line per profiled row: GEMM share, FP8 ceilings, largest non-GEMM kernel ('' when
    no row has a ceiling)."""
    from tabulate import tabulate
    table, cpu = [], False
    for r in rows:
        c = r.get("ceiling")
        if not c:
            continue
        if c.get("error"):
            table.append([r["model"], r["config"], "", "", "", "", "", "error: " + c["error"][:60]])
            continue
        cpu = cpu or c["source"] == CPU_SOURCE
        big = c.get("largest_non_gemm") or {}
        name = big.get("name", "")
        name = name if len(name) <= 60 else name[:57] + "..."
        table.append([r["model"], r["config"], _fmt(c["total_ms"], ".3f"), _fmt(100 * c["gemm_share"], ".0f"),
                      _fmt(c["ceiling_1p6x"], ".2f"), _fmt(c["ceiling_2x"], ".2f"),
                      _fmt(big.get("ms"), ".3f"), name])
    if not table:
        return ""
    head = ("FP8 ceiling: one profiled forward+backward; if every GEMM ran 1.6x (2x) faster and casts were "
            "free, 1 / ((1 - g) + g / s)")
    if cpu:
        head += "; CPU rows: op self time on the host, not device kernels"
    cols = ["model", "config", "kernel_ms", "gemm%", "ceil_1.6x", "ceil_2x", "top_non_gemm_ms",
            "largest non-GEMM kernel"]
    return head + "\n" + tabulate(table, headers=cols, tablefmt="github")


def plot(rows: list[dict], path: Path) -> None:
    """Speedup vs Inductor bf16 and held-out logloss change vs bf16, per model and config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(models) * 2), 4.5))
    width = 0.8 / max(len(configs), 1)
    for ax, field, scale, title in [
        (axes[0], "speedup_vs_inductor_bf16", 1.0, "training step speedup vs Inductor bf16 (same mode)"),
        (axes[1], "logloss_rel_bf16", 100.0, "held-out logloss change vs bf16 (%)"),
    ]:
        for j, c in enumerate(configs):
            vals = []
            for m in models:
                r = next((r for r in rows if r["model"] == m and r["config"] == c), None)
                v = r.get(field) if r else None
                vals.append(float("nan") if v is None else v * scale)
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
        ax.set_title(title, fontsize=10)
        ax.axhline(1.0 if field.startswith("speedup") else 0.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma list of {', '.join(MODEL_NAMES)}")
    p.add_argument("--preset", default="tiny", choices=["tiny", "paper"])
    p.add_argument("--batch", type=int, default=None, help="default: 256 for tiny, 8192 for paper")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps before timing (compile, CUDA graphs; loka rows: >= probe_steps + 1)")
    p.add_argument("--quality-steps", type=int, default=100,
                   help="train max(this, warmup + steps) steps, then evaluate held out; 0 skips evaluation")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma list, or 'all' (every config below); known: {', '.join(CONFIGS)}, "
                        "and <loka config>_no_<mod> for a Mod of loka_compile.passes.MODS")
    p.add_argument("--ablate-mods", nargs="?", const="auto", default=None, metavar="BASES",
                   help="add a row per Mod of loka_compile.passes.MODS with that Mod off "
                        "(<base>_no_<mod>, loka option disabled_mods), after its base row; BASES: "
                        "comma list of loka configs, default loka_ro if in --configs, else loka")
    p.add_argument("--profile-top", type=int, default=10, help="kernels listed per profiled row")
    p.add_argument("--ceiling-configs", default=",".join(CEILING_CONFIGS),
                   help="configs whose warm step is profiled for the GEMM share and FP8 ceiling "
                        "(comma list; 'none' for none)")
    p.add_argument("--sparse-embeddings", default="auto", choices=["auto", "on", "off"],
                   help="embedding tables with sparse gradients (SparseAdam): auto = the preset's choice "
                        "(on for the dlrm_dcnv2 paper preset)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (1 is fastest for tiny presets on a shared box)")
    p.add_argument("--compile-scope", default="dense", choices=["dense", "model"])
    p.add_argument("--loka-options", type=json.loads, default=None,
                   help='JSON dict passed as torch.compile(options=...) to loka rows, e.g. \'{"probe_steps": 10}\'')
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr of the dense arch")
    p.add_argument("--sparse-lr", type=float, default=1e-2, help="Adam lr of the embedding tables")
    p.add_argument("--lr-warmup", type=int, default=20, help="steps of linear lr warmup (1 = none)")
    p.add_argument("--positive-rate", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=300.0,
                   help="per-config budget; training stops (row gets an error) once spent")
    p.add_argument("--total-seconds", type=float, default=None,
                   help="whole-run budget; configs not started by then become skipped rows")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON (and PNG)")
    p.add_argument("--name", default=None, help="file stem instead of <date>_<device>_train")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 8192 if args.preset == "paper" else 256
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first step compiles)")
    args.ceiling_configs = () if args.ceiling_configs.strip() in ("", "none") else tuple(
        c.strip() for c in args.ceiling_configs.split(",") if c.strip())
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    # fp32 references must be real fp32, not TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    configs = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.ablate_mods:
        configs = ablation_configs(configs, args.ablate_mods, device.type == "cuda")
    env = environment(device, args)
    stem = args.name or f"{env['date']}_{device_tag(device)}_train"
    out_path = Path(args.out) / f"{stem}.json"
    deadline = None if args.total_seconds is None else _T0 + args.total_seconds
    log(f"device {env['device']}, torch {env['torch']}, "
        f"torchao {env['torchao'] or 'unavailable: ' + str(env['torchao_import_error'])}, "
        f"loka registered: {env['loka_registered']}; models {models}; configs {configs}; "
        f"preset {args.preset}, batch {args.batch}; writing {out_path}")

    rows: list[dict] = []
    for name in models:
        try:
            setup = ModelSetup(name, args, device)
        except Exception as e:  # noqa: BLE001 - a model that cannot be built still gets rows
            log(f"{name}: setup failed: {_error_text(e)}")
            for c in configs:
                cfg = lookup_config(c)
                row = {"model": name, "preset": args.preset, "config": c,
                       "mode": cfg.mode if cfg else None, "batch": args.batch,
                       "compile_scope": args.compile_scope, "error": f"setup: {_error_text(e)}"}
                rows.append({**{k: None for k in _ROW_KEYS}, **row})
            write_json(out_path, env, rows)
            continue
        log(f"{name}: dense {setup.params['dense']:,} params, sparse {setup.params['sparse']:,}, "
            f"{setup.train_gflops_per_sample:.4f} train GFLOP/sample")
        for c in configs:
            log(f"{name}/{c}: start")
            rows.append(run_config(setup, c, args, deadline))
            fill_relative(rows)
            write_json(out_path, env, rows)
        del setup
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    fill_relative(rows)
    write_json(out_path, env, rows)
    if args.plot:
        try:
            plot(rows, out_path.with_suffix(".png"))
            log(f"plot written to {out_path.with_suffix('.png')}")
        except Exception as e:  # noqa: BLE001 - a missing matplotlib must not lose the results
            log(f"plot failed: {_error_text(e)}")
    log(f"results written to {out_path}")
    print(format_table(rows), flush=True)
    return out_path


_ROW_KEYS = ["model", "preset", "config", "mode", "batch", "compile_scope", "sparse_embeddings", "loka_options",
             "disabled_mods", "steps", "train_steps",
             "step_ms", "step_ms_min", "speedup_vs_inductor_bf16", "step_saving_ms", "peak_mem_gb", "held_mem_gb",
             "first_step_s", "out_relerr", "grad_relerr", "grad_relerr_first", "out_relerr_x_bf16", "out_relerr_init",
             "grad_relerr_init", "grad_relerr_first_init", "final_logloss",
             "final_ne", "final_auc", "logloss_rel_bf16", "ne_rel_bf16", "auc_rel_bf16", "quality_ref",
             "within_quality_target",
             "bf16_logloss_spread",
             "dense_params", "sparse_params", "train_gflops_per_sample", "tflops", "ceiling", "loka_sites", "wall_s",
             "error"]


if __name__ == "__main__":
    main()
