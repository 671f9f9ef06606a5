"""The quality study (issue "quality", item 3): which output budget keeps held-out NE at
bf16's while putting the most GEMM FLOPs in FP8?

    python -m benchmarks.quality_study --zoo dlrm_dcnv2,wukong --public deepctr_torch.DeepFM,torch_rechub.DCNv2 \
        --batch 256 --steps 500 --seeds 3 --multiples 16,64 --ne-increases 0.001,0.003 --rules "" \
        --eval-batches 8 --max-seconds 120 --total-seconds 480 --out $OUT      # one 9-minute GPU call
    python -m benchmarks.quality_study --zoo dlrm_dcnv2 --public deepctr_torch.DeepFM --preset tiny \
        --steps 6 --seeds 2 --batch 64 --timed 2 --eval-batches 1 --multiples 8,32 \
        --ne-increases 0.0003,0.003 --rules "" --out /tmp/qs                   # CPU smoke test

Per model and seed, every configuration trains from the same initial weights on the same
batches for --steps steps, then held-out NE is measured on --eval-batches batches:

- `bf16`: Inductor bf16 (benchmarks.train's inductor_bf16, or _ro with --mode
  reduce-overhead): the reference, and, over the seeds, the seed-to-seed spread of NE;
- `bf16_again` (--replicate): the same bf16 run once more, same seed, same batches. Its paired
  dNE is how far a rerun moves NE on its own (nondeterministic reductions, compounded over the
  steps): the noise any paired difference of this model must clear;
- `loka_k<k>_ne<n>`: loka with the relative output budget at noise_floor_multiple k and
  max_ne_increase n, one row per pair of --multiples and --ne-increases;
- `loka_mere`: LoKA's per-site rule alone (probe_metric "mere", bound 0.2; no output budget);
- `loka_per_site`: loka's own per-site rule alone (row relative error 0.1; no output budget);
- `loka_all_fp8`: every eligible site FP8 (no probe window: the budget and the rule off).

Per row: held-out NE, step time (median of --timed steps after the probe window; CUDA events
on GPU, wall clock on CPU), the FP8 share of forward and backward GEMM FLOPs
(`loka_compile.report`, sites of concrete shape), and the forward FLOPs left in high precision
by the reason that kept them (the speed check, the budget, the per-site error). Per model and config (`summary`): mean NE
over seeds, dNE = mean NE / bf16's mean NE - 1, the paired dNE (per seed, then averaged) and
its standard error over the seeds, the rerun noise (the mean |paired dNE| of `bf16_again`),
bf16's seed spread ((max - min) / min of its NE over seeds), `within` when dNE is at most the
larger of that spread and 0.1% (NE_TOLERANCE: the project's goal), the speedup of the median
step time against bf16's, and the FP8 shares.

Zoo models (benchmarks.zoo) train through benchmarks.train (its dense arch compiled, BCE with
logits); public models (benchmarks.public) as benchmarks.public.run trains them (the whole
model under bf16 autocast, their own loss, Adam); a multi-task model's NE is that of its first
head against its first label, a listwise model (DSSM, YouTubeDNN) gets none.

Runnable in slices. Before any row the run prints how many rows it will run and an estimate
of their time (each row: the median wall time of finished rows of its setting, model and config,
else of its model and kind, else a guess per size, GUESS_ROW_SECONDS; plus each zoo model's
measured setup), and how many calls of --total-seconds that takes. A row starts only when its
estimate fits what is left of --total-seconds, so a run ends inside its device call; the JSON is
rewritten after every row. Runs resume and merge: rows of earlier runs' JSON files (--merge; by
default <stem>.json and its shards' <stem>.shard*.json under benchmarks/results and under --out,
stem <date>_<device>_quality_study or --name) are kept, and those that finished (NE measured, or
failed other than by a time budget) are not run again, so the same command, called again with the
last call's JSON copied to benchmarks/results/, runs the next slice. --configs picks rows (e.g.
"bf16,loka_k16_ne0.001": the defaults against bf16 first); --shard i/n runs whole (model, seed)
groups, every n-th, into <stem>.shard<i>of<n>.json (one process per GPU of a multi-GPU call), and
--summary-only merges the shards' files into one summary. The summary covers the rows of this
run's setting (preset, steps, batch, mode, speed check; bf16 rows serve either speed check).
--preset production (= paper) is batch 8192 at the zoo's paper sizes and the public suite's
production preset. Output: <out>/<name>.json (rows, summary, environment), <name>.md (the
summary table), <name>.png when matplotlib imports (speedup against dNE per model, one point per
configuration).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as _dt
import json
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks import train
from benchmarks.train import NE_TOLERANCE, Config

_T0 = time.perf_counter()
BASELINE = "bf16"
REPLICATE = "bf16_again"


RULES = ("loka_mere", "loka_per_site", "loka_all_fp8")


def study_configs(multiples: list, ne_increases: list, mode: str, rules: tuple = RULES,
                  speed_check: bool = True, replicate: bool = False) -> dict:
    """The study's rows, name -> benchmarks.train Config (loka rows carry their options);
    `rules`: which of RULES (the rows without the output budget) to add; `speed_check=False`
    lets the quality rule alone decide every loka row's sites (small batches, where FP8 rarely pays)."""
    unknown = sorted(set(rules) - set(RULES))
    if unknown:
        raise ValueError(f"unknown rule rows {unknown}; valid: {', '.join(RULES)}")
    inductor = "inductor_bf16_ro" if mode == "reduce-overhead" else "inductor_bf16"
    configs = {BASELINE: dataclasses.replace(train.CONFIGS[inductor], name=BASELINE)}
    if replicate:
        configs[REPLICATE] = dataclasses.replace(train.CONFIGS[inductor], name=REPLICATE)
    for k, ne in zip(multiples, ne_increases):
        name = f"loka_k{k:g}_ne{ne:g}"
        configs[name] = Config(name, "loka", mode, options=(("noise_floor_multiple", k), ("max_ne_increase", ne)))
    every = {"loka_mere": Config("loka_mere", "loka", mode,
                                 options=(("max_output_error", None), ("probe_metric", "mere"))),
             "loka_per_site": Config("loka_per_site", "loka", mode, options=(("max_output_error", None),)),
             "loka_all_fp8": Config("loka_all_fp8", "loka", mode,
                                    options=(("speed_check", False), ("probe_steps", 0)))}
    configs.update({name: every[name] for name in RULES if name in rules})
    if not speed_check:
        configs = {name: c if c.kind != "loka" or ("speed_check", False) in c.options
                   else dataclasses.replace(c, options=(*c.options, ("speed_check", False)))
                   for name, c in configs.items()}
    return configs


def fp8_shares(sites: list) -> dict:
    """FP8 share of the forward ("fwd") and backward (dgrad + wgrad) GEMM FLOPs, from
    site dicts {"role", "fp8", "flops"} (sites without a FLOP count left out); None where
    a direction has no FLOPs."""
    totals = {"fwd": [0, 0], "bwd": [0, 0]}
    for s in sites:
        if s.get("flops") is None:
            continue
        side = totals["fwd" if s["role"] == "fwd" else "bwd"]
        side[0] += s["flops"] * bool(s["fp8"])
        side[1] += s["flops"]
    return {f"fp8_share_{d}": (fp8 / total if total else None) for d, (fp8, total) in totals.items()}


def kept_by_reason(sites: list) -> dict:
    """Share of the forward GEMM FLOPs left in high precision, by the decision's reason (site
    dicts {"role", "fp8", "flops", "reason"}; sites without a FLOP count or reason left out):
    which rule (speed check, budget, per-site error) kept the forward from FP8."""
    total = sum(s["flops"] for s in sites if s["role"] == "fwd" and s.get("flops") is not None)
    kept = collections.Counter()
    for s in sites:
        if s["role"] == "fwd" and not s["fp8"] and s.get("flops") is not None and s.get("reason"):
            kept[s["reason"]] += s["flops"]
    return {"fwd_kept_by_reason": {r: f / total for r, f in kept.most_common()} if total else {}}


def site_summary(sites: list) -> dict:
    return {**fp8_shares(sites), **kept_by_reason(sites)} if sites else {}


def _report_sites(compiled) -> list:
    import loka_compile
    report = loka_compile.report(compiled)
    flops = report._flops()
    return [{"role": s.role, "fp8": s.fp8, "flops": flops[id(s)], "reason": s.reason} for s in report.sites]


# ------------------------------------------------------------------ rows


# --preset names one size for both suites: the zoo's preset of that name ("tiny", "paper") or
# the public suite's ("tiny", "production"); "production" and "paper" name the same size, batch
# 8192, in each suite's terms.
ZOO_PRESET = {"production": "paper"}
PUBLIC_PRESET = {"paper": "production"}
PRESETS = ("tiny", "paper", "production")


def zoo_setup(name: str, seed: int, args, device) -> tuple:
    """(benchmarks.train ModelSetup, its arguments) of one zoo model and seed, shared by its rows."""
    train_args = train.parse_args([
        "--models", name, "--preset", ZOO_PRESET.get(args.preset, args.preset), "--steps", str(args.timed),
        "--warmup", str(args.warmup),
        "--quality-steps", str(args.steps), "--eval-batches", str(args.eval_batches), "--seed", str(seed),
        "--max-seconds", str(args.max_seconds), "--ceiling-configs", "", "--device", str(device),
        *(["--batch", str(args.batch)] if args.batch else [])])
    if train_args.batch is None:
        train_args.batch = 256 if args.preset == "tiny" else 8192
    return train.ModelSetup(name, train_args, device), train_args


def zoo_row(setup, train_args, cfg_name: str, seed: int, deadline, args) -> dict:
    """One (zoo model, config, seed) row through benchmarks.train.run_config."""
    row = train.run_config(setup, cfg_name, train_args, deadline)
    sites = (row.get("loka_sites") or {}).get("sites", [])
    return {"model": setup.name, "source": "zoo", "config": cfg_name, "seed": seed, **setting(args),
            "ne": row.get("final_ne"),
            "step_ms": row.get("step_ms"), **site_summary(sites), "error": row.get("error"),
            "wall_s": row.get("wall_s")}


def _public_ne(bench, fn, args, seed: int):
    """Held-out NE of a public model's compiled training unit (grad mode on: the training
    graph serves, no inference compile), first head against first label."""
    from benchmarks.zoo import normalized_entropy
    if bench.entry.loss == "listwise":
        return None
    preds, labels = [], []
    for i in range(args.eval_batches):
        inputs, y = bench.batch(i, args.batch, seed=seed + 1000)
        _, p = fn(inputs, y)
        p = p.detach().float()
        preds.append((p[:, 0] if p.dim() > 1 else p).reshape(-1))
        labels.append((y[:, 0] if y.dim() > 1 else y).reshape(-1).float())
    p = torch.cat(preds).double().clamp(1e-7, 1 - 1e-7)
    return normalized_entropy(torch.logit(p), torch.cat(labels))


def public_row(name: str, cfg_name: str, seed: int, args, device, deadline) -> dict:
    """One (public model, config, seed) row: benchmarks.public.run's training unit, Adam."""
    from benchmarks.public.models import build
    from benchmarks.public.run import TrainUnit
    row = {"model": name, "source": "public", "config": cfg_name, "seed": seed, **setting(args), "ne": None,
           "step_ms": None, "error": None}
    start = time.perf_counter()
    try:
        if deadline is not None and time.perf_counter() > deadline:
            raise train.BudgetExceeded("skipped: --total-seconds budget spent before this row")
        cfg = train.resolve_config(cfg_name)
        torch._dynamo.reset()
        bench = build(name, PUBLIC_PRESET.get(args.preset, args.preset), device=device, seed=seed)
        unit = TrainUnit(bench, bench.model, amp=cfg.dtype == torch.bfloat16)
        fn = train.compile_unit(unit, cfg)
        opt = torch.optim.Adam(bench.model.parameters(), lr=args.lr)
        cuda = device.type == "cuda"
        times = []
        for i in range(args.steps):
            inputs, y = bench.batch(i, args.batch)
            timed = args.warmup <= i < args.warmup + args.timed
            if cuda and cfg.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            if timed and cuda:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            t = time.perf_counter()
            loss, _ = fn(inputs, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if timed:
                if cuda:
                    events[1].record()
                    times.append(events)
                else:
                    times.append((time.perf_counter() - t) * 1e3)
            if time.perf_counter() - start > args.max_seconds:
                raise train.BudgetExceeded(f"--max-seconds {args.max_seconds} spent after {i + 1} steps")
        if cuda:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in times]
        row["step_ms"] = statistics.median(times) if times else None
        row["ne"] = _public_ne(bench, fn, args, seed)
        if cfg.kind == "loka":
            row.update(site_summary(_report_sites(fn)))
    except Exception as e:  # noqa: BLE001 - every failure becomes a row
        row["error"] = train._error_text(e)
        train.log(f"  {name}/{cfg_name}/seed {seed}: ERROR {row['error']}")
    row["wall_s"] = round(time.perf_counter() - start, 2)
    train.release_config(row, f"{name}/{cfg_name}", device.type == "cuda")
    return row


# ------------------------------------------------------------------ summary


def is_bf16(config: str) -> bool:
    return config in (BASELINE, REPLICATE)


def summarize(rows: list) -> list:
    """Per (model, config): NE over seeds against the bf16 rows', speed and FP8 shares."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("ne") is not None and not r.get("error")]
        base = {r["seed"]: r for r in mine if r["config"] == BASELINE}
        base_ne = [r["ne"] for r in base.values()]
        spread = (max(base_ne) - min(base_ne)) / min(base_ne) if len(base_ne) >= 2 else None
        base_ms = [r["step_ms"] for r in base.values() if r.get("step_ms")]
        again = [abs(r["ne"] / base[r["seed"]]["ne"] - 1) for r in mine
                 if r["config"] == REPLICATE and r["seed"] in base]
        rerun_noise = statistics.fmean(again) if again else None
        for config in dict.fromkeys(r["config"] for r in rows if r["model"] == model):
            runs = [r for r in mine if r["config"] == config]
            entry = {"model": model, "config": config, "seeds": len(runs), "bf16_spread": spread,
                     "rerun_noise": rerun_noise}
            if runs and base_ne:
                ne = statistics.fmean(r["ne"] for r in runs)
                entry["ne"] = ne
                entry["dne"] = ne / statistics.fmean(base_ne) - 1
                paired = [r["ne"] / base[r["seed"]]["ne"] - 1 for r in runs if r["seed"] in base]
                entry["dne_paired"] = statistics.fmean(paired) if paired else None
                entry["dne_paired_se"] = statistics.stdev(paired) / math.sqrt(len(paired)) if len(paired) >= 2 else None
                entry["within"] = entry["dne"] <= max(spread or 0.0, NE_TOLERANCE)
            ms = [r["step_ms"] for r in runs if r.get("step_ms")]
            if ms:
                entry["step_ms"] = statistics.median(ms)
                entry["speedup"] = statistics.median(base_ms) / entry["step_ms"] if base_ms else None
            for key in ("fp8_share_fwd", "fp8_share_bwd"):
                values = [r[key] for r in runs if r.get(key) is not None]
                entry[key] = statistics.fmean(values) if values else None
            kept = [r["fwd_kept_by_reason"] for r in runs if r.get("fwd_kept_by_reason") is not None]
            if kept:
                reasons = dict.fromkeys(reason for k in kept for reason in k)
                entry["fwd_kept_by_reason"] = {reason: statistics.fmean(k.get(reason, 0.0) for k in kept)
                                               for reason in reasons}
            out.append(entry)
    return out


def _cell(value, spec: str) -> str:
    return "" if value is None else (format(value, spec) if isinstance(value, float) else str(value))


def _kept_cell(kept) -> str:
    """The two reasons that kept the most forward FLOPs in high precision, with their shares."""
    if not kept:
        return ""
    top = sorted(kept.items(), key=lambda item: -item[1])[:2]
    return ", ".join(f"{reason} {share:.0%}" for reason, share in top if share > 0)


def markdown(summary: list) -> str:
    lines = ["| model | config | seeds | NE | dNE | dNE paired | +- s.e. | rerun noise | bf16 spread | within | speedup "
             "| FP8 fwd | FP8 bwd | fwd kept by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        lines.append(f"| {e['model']} | {e['config']} | {e['seeds']} | {_cell(e.get('ne'), '.5f')} | "
                     f"{_cell(e.get('dne'), '+.3%')} | {_cell(e.get('dne_paired'), '+.3%')} | "
                     f"{_cell(e.get('dne_paired_se'), '.3%')} | {_cell(e.get('rerun_noise'), '.3%')} | "
                     f"{_cell(e.get('bf16_spread'), '.3%')} | {_cell(e.get('within'), '')} | "
                     f"{_cell(e.get('speedup'), '.3f')} | {_cell(e.get('fp8_share_fwd'), '.0%')} | "
                     f"{_cell(e.get('fp8_share_bwd'), '.0%')} | {_kept_cell(e.get('fwd_kept_by_reason'))} |")
    return "\n".join(lines)


def plot(summary: list, path: Path) -> None:
    """Speedup against dNE, one panel per model, one point per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(e["model"] for e in summary))
    if not models:  # a call that ran no row yet: nothing to plot
        return
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for e in summary:
            if e["model"] == model and e.get("dne") is not None and e.get("speedup") is not None:
                ax.scatter(100 * e["dne"], e["speedup"])
                ax.annotate(e["config"], (100 * e["dne"], e["speedup"]), fontsize=6)
        spread = next((e["bf16_spread"] for e in summary if e["model"] == model and e.get("bf16_spread")), None)
        if spread:
            ax.axvspan(-100 * spread, 100 * spread, color="0.9")
        ax.axvline(100 * NE_TOLERANCE, color="r", lw=0.8)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("dNE vs bf16 (%)")
        ax.set_ylabel("step speedup vs bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ resuming and merging


# What makes rows comparable: a row counts toward the summary only where these match the run's.
SETTING = ("preset", "steps", "batch", "mode", "speed_check")
# The guess of one row's wall time before any row of its setting has run; measured rows
# replace it. Tiny (GPU): the first compile of a tiny zoo model's graphs, probe and FP8
# variants, and 500 steps. Production (H100, batch 8192): public Wukong's loka row took 91 s and
# its bf16 row 42 s for their compiles and 17 steps
# (benchmarks/results/2026-11-27_H100_public_production_wukong.json), DLRM-DCNv2's step is
# 100-104 ms (2026-11-25_H100_train_final.md): 500 steps add 15-50 s.
GUESS_ROW_SECONDS = {"tiny": {"bf16": 20.0, "loka": 20.0}, "production": {"bf16": 90.0, "loka": 150.0}}


def guess_seconds(config: str, preset: str) -> float:
    size = GUESS_ROW_SECONDS["tiny" if preset == "tiny" else "production"]
    return size["bf16" if is_bf16(config) else "loka"]


def setting(args) -> dict:
    return {name: getattr(args, name) for name in SETTING}


def of_setting(row: dict, here: dict) -> bool:
    """Whether a row counts in a run of setting `here`. A bf16 row counts whatever the speed
    check (it has none), so runs with it on and off share their bf16 rows."""
    return all(row.get(k) == v for k, v in here.items() if not (k == "speed_check" and is_bf16(row["config"])))


def row_key(row: dict) -> tuple:
    return (row["model"], row["config"], row["seed"], *(row.get(name) for name in SETTING))


def finished(row: dict) -> bool:
    """A row that need not run again: it measured NE, or failed other than by a time budget."""
    error = row.get("error") or ""
    return row.get("ne") is not None or (bool(error) and "BudgetExceeded" not in error)


def load_rows(paths: list) -> list:
    """The rows of earlier runs' JSON files (missing files skipped), later files' rows
    replacing earlier ones with the same key, unfinished ones after finished ones dropped."""
    rows = {}
    for path in paths:
        path = Path(path)
        if not path.exists():
            continue
        for row in json.loads(path.read_text()).get("rows", []):
            key = row_key(row)
            if key not in rows or finished(row) or not finished(rows[key]):
                rows[key] = row
    return list(rows.values())


def planned_rows(zoo: list, public: list, configs: dict, seeds: int) -> list:
    """(model, source, config, seed) in run order: seeds outermost, so a time budget cuts whole seeds."""
    return [(name, source, config, seed) for seed in range(seeds)
            for source, names in (("zoo", zoo), ("public", public)) for name in names for config in configs]


def row_seconds(model: str, config: str, done: list, preset: str = "tiny") -> tuple:
    """(seconds, basis) of one row: the median wall time of the finished rows `done` (of the
    run's setting) of its model and config, else of its model and kind (bf16 or loka), else
    of its model, else `guess_seconds`."""
    walls = [r for r in done if r.get("wall_s") and finished(r)]
    kind = is_bf16
    for level, rows in (("model and config", [r for r in walls if (r["model"], r["config"]) == (model, config)]),
                        ("model and kind", [r for r in walls if r["model"] == model
                                            and kind(r["config"]) == kind(config)]),
                        ("model", [r for r in walls if r["model"] == model])):
        if rows:
            return statistics.median(r["wall_s"] for r in rows), level
    guess = guess_seconds(config, preset)
    return guess, f"{guess:g} s guessed"


def setup_seconds(model: str, done: list) -> float:
    """A zoo model's setup (its master weights and batches, once per seed), as measured in
    the rows `done` it preceded (`setup_s`); 0 before one was measured."""
    setups = [r["setup_s"] for r in done if r["model"] == model and r.get("setup_s")]
    return statistics.median(setups) if setups else 0.0


def estimate_seconds(todo: list, done: list, preset: str = "tiny") -> tuple:
    """(seconds, basis) for the rows `todo` [(model, source, config, seed)], each `row_seconds`,
    and each zoo (model, seed) group's `setup_seconds`."""
    total, basis = 0.0, collections.Counter()
    for model, source, config, _ in todo:
        seconds, level = row_seconds(model, config, done, preset)
        total += seconds
        basis[level] += 1
    total += sum(setup_seconds(model, done) for model, source, _, _ in
                 dict.fromkeys((m, s, None, seed) for m, s, _, seed in todo) if source == "zoo")
    return total, ", ".join(f"{n} from {level}" for level, n in basis.items())


def shard_rows(plan: list, shard: tuple) -> list:
    """The rows of `plan` of shard (i, n): whole (model, seed) groups, every n-th from the i-th,
    so a model's bf16 and loka rows of one seed run in one process (one GPU) and stay paired."""
    index, count = shard
    groups = list(dict.fromkeys((model, seed) for model, _, _, seed in plan))
    mine = {group for i, group in enumerate(groups) if i % count == index}
    return [row for row in plan if (row[0], row[3]) in mine]


# ------------------------------------------------------------------ main


def _floats(text: str) -> list:
    return [float(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list:
    return [m.strip() for m in text.split(",") if m.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default="dlrm_dcnv2,wukong,masknet", help="comma list of benchmarks.zoo models")
    p.add_argument("--public", default="deepctr_torch.DeepFM,deepctr_torch.DCN",
                   help="comma list of benchmarks.public models")
    p.add_argument("--preset", default="tiny", choices=PRESETS,
                   help="tiny, or production (= paper): batch 8192, the zoo's paper and the public suite's "
                        "production sizes")
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=500, help="training steps before held-out NE")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--timed", type=int, default=20, help="steps timed (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (loka's probe window among them)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--multiples", default="4,16,64", help="noise_floor_multiple per budget level")
    p.add_argument("--ne-increases", default="0.0003,0.001,0.003", help="max_ne_increase per budget level")
    p.add_argument("--rules", default=",".join(RULES),
                   help=f"comma list of the rows without the output budget among {', '.join(RULES)} ('' for none)")
    p.add_argument("--replicate", action="store_true",
                   help=f"add {REPLICATE}: bf16 again at the same seed, the rerun noise of paired dNE")
    p.add_argument("--configs", default=None,
                   help="comma list of the rows to run among bf16, the budget levels' and --rules' (default: all)")
    p.add_argument("--shard", default=None,
                   help="i/n: run the i-th (0-based) of n shares of the rows, whole (model, seed) groups, into "
                        "<stem>.shard<i>of<n>.json: one process per GPU")
    p.add_argument("--summary-only", action="store_true",
                   help="run no row: merge (--merge, or the default files and their shards) and write the summary")
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    p.add_argument("--speed-check", default="on", choices=["on", "off"],
                   help="off: every loka row runs without the speed check, so its quality rule alone decides")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr (public models)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-seconds", type=float, default=300.0, help="per row")
    p.add_argument("--total-seconds", type=float, default=None, help="no row starts after this")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem instead of <date>_<device>_quality_study")
    p.add_argument("--merge", default=None,
                   help="comma list of earlier runs' JSON files whose rows this run keeps and does not run again "
                        "(default: <stem>.json under benchmarks/results and under --out, where they exist)")
    args = p.parse_args(argv)
    args.multiples, args.ne_increases = _floats(args.multiples), _floats(args.ne_increases)
    if len(args.multiples) != len(args.ne_increases):
        p.error("--multiples and --ne-increases give one value per budget level each")
    args.rules = tuple(_names(args.rules))
    if set(args.rules) - set(RULES):
        p.error(f"--rules: unknown {sorted(set(args.rules) - set(RULES))}; valid: {', '.join(RULES)}")
    if args.shard is not None:
        try:
            index, count = (int(v) for v in args.shard.split("/"))
        except ValueError:
            p.error(f"--shard takes i/n such as 0/4, not {args.shard!r}")
        if not 0 <= index < count:
            p.error(f"--shard {args.shard}: i must be in 0..n-1")
        args.shard = (index, count)
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    configs = study_configs(args.multiples, args.ne_increases, args.mode, args.rules, args.speed_check == "on",
                            args.replicate)
    if args.configs is not None:
        unknown = sorted(set(_names(args.configs)) - set(configs))
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown}; this run's rows: {', '.join(configs)}")
        configs = {name: c for name, c in configs.items() if name in _names(args.configs)}
    train.CONFIGS.update(configs)  # run_config and compile_unit resolve rows by name there
    deadline = None if args.total_seconds is None else _T0 + args.total_seconds
    stem = args.name or f"{_dt.date.today().isoformat()}_{train.device_tag(device)}_quality_study"
    name = stem if args.shard is None else f"{stem}.shard{args.shard[0]}of{args.shard[1]}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}}
    merge = _names(args.merge) if args.merge is not None else default_merge(stem, out)
    rows = load_rows(merge)
    here = setting(args)
    current = lambda: [r for r in rows if of_setting(r, here)]  # noqa: E731
    if rows:
        train.log(f"merged {len(rows)} rows of {', '.join(m for m in merge if Path(m).exists())} "
                  f"({len(current())} of this run's setting {here})")
    done = {(r["model"], r["config"], r["seed"]) for r in current() if finished(r)}
    plan = planned_rows(_names(args.zoo), _names(args.public), configs, args.seeds)
    todo = [] if args.summary_only else [p for p in plan if (p[0], p[2], p[3]) not in done]
    earlier = len(plan) - len(todo)
    if args.shard is not None:  # of the rows left, so that every call spreads them over its GPUs afresh
        todo = shard_rows(todo, args.shard)
    seconds, basis = estimate_seconds(todo, current(), args.preset)
    calls = f"; about {math.ceil(seconds / args.total_seconds)} call(s) of --total-seconds " \
            f"{args.total_seconds:g}" if args.total_seconds and todo else ""
    share = f" (shard {args.shard[0]} of {args.shard[1]}: {len(todo)} of the rows left)" if args.shard else ""
    train.log(f"estimate: {len(todo)} of {len(plan)} rows to run ({earlier} done earlier){share}, "
              f"{seconds:.0f} s ({basis}){calls}")

    def write() -> None:
        (out / f"{name}.json").write_text(json.dumps(
            {"environment": env, "rows": rows, "summary": summarize(current())}, indent=1, default=str))

    def keep(row: dict) -> None:
        rows[:] = [r for r in rows if row_key(r) != row_key(row)] + [row]
        write()

    built = None  # (model, seed, setup, its train args): the zoo model and seed whose rows run
    for model, source, cfg_name, seed in todo:
        expected, level = row_seconds(model, cfg_name, current(), args.preset)
        if source == "zoo" and (built is None or built[:2] != (model, seed)):
            expected += setup_seconds(model, current())
        if deadline is not None and time.perf_counter() + expected > deadline:
            left = todo[todo.index((model, source, cfg_name, seed)):]
            train.log(f"stopping: {model}/{cfg_name}/seed {seed} would take about {expected:.0f} s ({level}), "
                      f"{max(0.0, deadline - time.perf_counter()):.0f} s of --total-seconds left; {len(left)} "
                      f"row(s) left for the next call")
            break
        train.log(f"{model}/{cfg_name}/seed {seed}: start ({time.perf_counter() - _T0:.0f} s in)")
        if source == "public":
            keep(public_row(model, cfg_name, seed, args, device, deadline))
            continue
        setup_s = None
        if built is None or built[:2] != (model, seed):
            built = None  # the previous model's batches go before this one's are made
            start = time.perf_counter()
            try:
                built = (model, seed, *zoo_setup(model, seed, args, device))
            except Exception as e:  # noqa: BLE001 - a model that cannot be built still gets its rows
                keep({"model": model, "source": "zoo", "config": cfg_name, "seed": seed, **here, "ne": None,
                      "step_ms": None, "error": f"setup: {train._error_text(e)}"})
                continue
            setup_s = round(time.perf_counter() - start, 2)
        keep({**zoo_row(built[2], built[3], cfg_name, seed, deadline, args), "setup_s": setup_s})
    write()
    summary = summarize(current())
    table = markdown(summary)
    (out / f"{name}.md").write_text(table + "\n")
    try:
        plot(summary, out / f"{name}.png")
    except ImportError as e:
        train.log(f"no plot: {e}")
    print(table, flush=True)
    return out / f"{name}.json"


def default_merge(stem: str, out: Path) -> list:
    """The earlier runs' files a run merges by default: <stem>.json and its shards'
    <stem>.shard*.json, under benchmarks/results and under `out`."""
    paths = []
    for folder in dict.fromkeys([Path("benchmarks/results"), out]):
        paths += [folder / f"{stem}.json", *sorted(folder.glob(f"{stem}.shard*.json"))]
    return list(dict.fromkeys(map(str, paths)))


if __name__ == "__main__":
    main()
