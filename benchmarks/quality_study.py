"""The quality study (issue "quality", item 3): which output budget keeps held-out NE at
bf16's while putting the most GEMM FLOPs in FP8?

    python -m benchmarks.quality_study --zoo dlrm_dcnv2,wukong --public deepctr_torch.DeepFM \
        --steps 500 --seeds 3 --total-seconds 520 --out $OUT        # one 9-minute GPU call
    python -m benchmarks.quality_study --zoo dlrm_dcnv2 --public "" --preset tiny \
        --steps 6 --seeds 2 --batch 64 --timed 2 --eval-batches 1 --out /tmp/qs   # CPU smoke test

Per model and seed, every configuration trains from the same initial weights on the same
batches for --steps steps, then held-out NE is measured on --eval-batches batches:

- `bf16`: Inductor bf16 (benchmarks.train's inductor_bf16, or _ro with --mode
  reduce-overhead): the reference, and, over the seeds, the seed-to-seed spread of NE;
- `loka_k<k>_ne<n>`: loka with the relative output budget at noise_floor_multiple k and
  max_ne_increase n, one row per pair of --multiples and --ne-increases;
- `loka_mere`: LoKA's per-site rule alone (probe_metric "mere", bound 0.2; no output budget);
- `loka_per_site`: loka's own per-site rule alone (row relative error 0.1; no output budget);
- `loka_all_fp8`: every eligible site FP8 (no probe window: the budget and the rule off).

Per row: held-out NE, step time (median of --timed steps after the probe window; CUDA events
on GPU, wall clock on CPU), and the FP8 share of forward and backward GEMM FLOPs
(`loka_compile.report`, sites of concrete shape). Per model and config (`summary`): mean NE
over seeds, dNE = mean NE / bf16's mean NE - 1, the paired dNE (per seed, then averaged),
bf16's seed spread ((max - min) / min of its NE over seeds), `within` when dNE is at most the
larger of that spread and 0.1% (NE_TOLERANCE: the project's goal), the speedup of the median
step time against bf16's, and the FP8 shares.

Zoo models (benchmarks.zoo) train through benchmarks.train (its dense arch compiled, BCE with
logits); public models (benchmarks.public) as benchmarks.public.run trains them (the whole
model under bf16 autocast, their own loss, Adam); a multi-task model's NE is that of its first
head against its first label, a listwise model (DSSM, YouTubeDNN) gets none.

--total-seconds stops starting rows once spent (later rows record `skipped`), so a run fits a
device call; the JSON is rewritten after every row. Output: <out>/<name>.json (rows, summary,
environment), <name>.md (the summary table), <name>.png when matplotlib imports (speedup
against dNE per model, one point per configuration).
"""

from __future__ import annotations

import argparse
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


def study_configs(multiples: list, ne_increases: list, mode: str) -> dict:
    """The study's rows, name -> benchmarks.train Config (loka rows carry their options)."""
    inductor = "inductor_bf16_ro" if mode == "reduce-overhead" else "inductor_bf16"
    configs = {BASELINE: dataclasses.replace(train.CONFIGS[inductor], name=BASELINE)}
    for k, ne in zip(multiples, ne_increases):
        name = f"loka_k{k:g}_ne{ne:g}"
        configs[name] = Config(name, "loka", mode, options=(("noise_floor_multiple", k), ("max_ne_increase", ne)))
    configs["loka_mere"] = Config("loka_mere", "loka", mode,
                                  options=(("max_output_error", None), ("probe_metric", "mere")))
    configs["loka_per_site"] = Config("loka_per_site", "loka", mode, options=(("max_output_error", None),))
    configs["loka_all_fp8"] = Config("loka_all_fp8", "loka", mode, options=(("speed_check", False), ("probe_steps", 0)))
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


def _report_sites(compiled) -> list:
    import loka_compile
    report = loka_compile.report(compiled)
    flops = report._flops()
    return [{"role": s.role, "fp8": s.fp8, "flops": flops[id(s)]} for s in report.sites]


# ------------------------------------------------------------------ rows


def zoo_setup(name: str, seed: int, args, device) -> tuple:
    """(benchmarks.train ModelSetup, its arguments) of one zoo model and seed, shared by its rows."""
    train_args = train.parse_args([
        "--models", name, "--preset", args.preset, "--steps", str(args.timed), "--warmup", str(args.warmup),
        "--quality-steps", str(args.steps), "--eval-batches", str(args.eval_batches), "--seed", str(seed),
        "--max-seconds", str(args.max_seconds), "--ceiling-configs", "", "--device", str(device),
        *(["--batch", str(args.batch)] if args.batch else [])])
    if train_args.batch is None:
        train_args.batch = 256 if args.preset == "tiny" else 8192
    return train.ModelSetup(name, train_args, device), train_args


def zoo_row(setup, train_args, cfg_name: str, seed: int, deadline) -> dict:
    """One (zoo model, config, seed) row through benchmarks.train.run_config."""
    row = train.run_config(setup, cfg_name, train_args, deadline)
    sites = (row.get("loka_sites") or {}).get("sites", [])
    return {"model": setup.name, "source": "zoo", "config": cfg_name, "seed": seed, "ne": row.get("final_ne"),
            "step_ms": row.get("step_ms"), **(fp8_shares(sites) if sites else {}), "error": row.get("error"),
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
    row = {"model": name, "source": "public", "config": cfg_name, "seed": seed, "ne": None, "step_ms": None,
           "error": None}
    start = time.perf_counter()
    try:
        if deadline is not None and time.perf_counter() > deadline:
            raise train.BudgetExceeded("skipped: --total-seconds budget spent before this row")
        cfg = train.resolve_config(cfg_name)
        torch._dynamo.reset()
        bench = build(name, args.preset, device=device, seed=seed)
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
            row.update(fp8_shares(_report_sites(fn)))
    except Exception as e:  # noqa: BLE001 - every failure becomes a row
        row["error"] = train._error_text(e)
        train.log(f"  {name}/{cfg_name}/seed {seed}: ERROR {row['error']}")
    row["wall_s"] = round(time.perf_counter() - start, 2)
    train.release_config(row, f"{name}/{cfg_name}", device.type == "cuda")
    return row


# ------------------------------------------------------------------ summary


def summarize(rows: list) -> list:
    """Per (model, config): NE over seeds against the bf16 rows', speed and FP8 shares."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("ne") is not None and not r.get("error")]
        base = {r["seed"]: r for r in mine if r["config"] == BASELINE}
        base_ne = [r["ne"] for r in base.values()]
        spread = (max(base_ne) - min(base_ne)) / min(base_ne) if len(base_ne) >= 2 else None
        base_ms = [r["step_ms"] for r in base.values() if r.get("step_ms")]
        for config in dict.fromkeys(r["config"] for r in rows if r["model"] == model):
            runs = [r for r in mine if r["config"] == config]
            entry = {"model": model, "config": config, "seeds": len(runs), "bf16_spread": spread}
            if runs and base_ne:
                ne = statistics.fmean(r["ne"] for r in runs)
                entry["ne"] = ne
                entry["dne"] = ne / statistics.fmean(base_ne) - 1
                paired = [r["ne"] / base[r["seed"]]["ne"] - 1 for r in runs if r["seed"] in base]
                entry["dne_paired"] = statistics.fmean(paired) if paired else None
                entry["within"] = entry["dne"] <= max(spread or 0.0, NE_TOLERANCE)
            ms = [r["step_ms"] for r in runs if r.get("step_ms")]
            if ms:
                entry["step_ms"] = statistics.median(ms)
                entry["speedup"] = statistics.median(base_ms) / entry["step_ms"] if base_ms else None
            for key in ("fp8_share_fwd", "fp8_share_bwd"):
                values = [r[key] for r in runs if r.get(key) is not None]
                entry[key] = statistics.fmean(values) if values else None
            out.append(entry)
    return out


def _cell(value, spec: str) -> str:
    return "" if value is None else (format(value, spec) if isinstance(value, float) else str(value))


def markdown(summary: list) -> str:
    lines = ["| model | config | seeds | NE | dNE | dNE paired | bf16 spread | within | speedup | FP8 fwd | FP8 bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        lines.append(f"| {e['model']} | {e['config']} | {e['seeds']} | {_cell(e.get('ne'), '.5f')} | "
                     f"{_cell(e.get('dne'), '+.3%')} | {_cell(e.get('dne_paired'), '+.3%')} | "
                     f"{_cell(e.get('bf16_spread'), '.3%')} | {_cell(e.get('within'), '')} | "
                     f"{_cell(e.get('speedup'), '.3f')} | {_cell(e.get('fp8_share_fwd'), '.0%')} | "
                     f"{_cell(e.get('fp8_share_bwd'), '.0%')} |")
    return "\n".join(lines)


def plot(summary: list, path: Path) -> None:
    """Speedup against dNE, one panel per model, one point per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(e["model"] for e in summary))
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


# ------------------------------------------------------------------ main


def _floats(text: str) -> list:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default="dlrm_dcnv2,wukong,masknet", help="comma list of benchmarks.zoo models")
    p.add_argument("--public", default="deepctr_torch.DeepFM,deepctr_torch.DCN",
                   help="comma list of benchmarks.public models")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=500, help="training steps before held-out NE")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--timed", type=int, default=20, help="steps timed (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (loka's probe window among them)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--multiples", default="4,16,64", help="noise_floor_multiple per budget level")
    p.add_argument("--ne-increases", default="0.0003,0.001,0.003", help="max_ne_increase per budget level")
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr (public models)")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-seconds", type=float, default=300.0, help="per row")
    p.add_argument("--total-seconds", type=float, default=None, help="no row starts after this")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default=None, help="file stem instead of <date>_<device>_quality_study")
    args = p.parse_args(argv)
    args.multiples, args.ne_increases = _floats(args.multiples), _floats(args.ne_increases)
    if len(args.multiples) != len(args.ne_increases):
        p.error("--multiples and --ne-increases give one value per budget level each")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    configs = study_configs(args.multiples, args.ne_increases, args.mode)
    train.CONFIGS.update(configs)  # run_config and compile_unit resolve rows by name there
    deadline = None if args.total_seconds is None else _T0 + args.total_seconds
    stem = args.name or f"{_dt.date.today().isoformat()}_{train.device_tag(device)}_quality_study"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()}}
    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        (out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows, "summary": summarize(rows)},
                                                     indent=1, default=str))

    zoo = [m.strip() for m in args.zoo.split(",") if m.strip()]
    public = [m.strip() for m in args.public.split(",") if m.strip()]
    for seed in range(args.seeds):  # seeds outermost: a time budget cuts whole seeds, last first
        for name in zoo:
            try:
                setup, train_args = zoo_setup(name, seed, args, device)
            except Exception as e:  # noqa: BLE001 - a model that cannot be built still gets rows
                for cfg_name in configs:
                    keep({"model": name, "source": "zoo", "config": cfg_name, "seed": seed, "ne": None,
                          "step_ms": None, "error": f"setup: {train._error_text(e)}"})
                continue
            for cfg_name in configs:
                train.log(f"{name}/{cfg_name}/seed {seed}: start")
                keep(zoo_row(setup, train_args, cfg_name, seed, deadline))
            del setup
        for name in public:
            for cfg_name in configs:
                train.log(f"{name}/{cfg_name}/seed {seed}: start")
                keep(public_row(name, cfg_name, seed, args, device, deadline))
    summary = summarize(rows)
    table = markdown(summary)
    (out / f"{stem}.md").write_text(table + "\n")
    try:
        plot(summary, out / f"{stem}.png")
    except ImportError as e:
        train.log(f"no plot: {e}")
    print(table, flush=True)
    return out / f"{stem}.json"


if __name__ == "__main__":
    main()
