"""What the cached weights' content check costs per inference call.

    python -m benchmarks.weight_check --models wukong,masknet --preset paper --batches 512,8192

Before each call of an inference graph, the `cached_weights` Mod fingerprints every weight
the graph's FP8 copies are made from (`kernels/fingerprint.py`) and remakes the copies whose
weights changed. Per model and batch size, in one process and on the same compiled graphs
(benchmarks.infer's setup, pools and timing: CUDA events around each call, medians):

- `checked`: loka_ro as it ships (on CUDA the check overlaps the call: the fingerprints are
  compared on the device and read by the host while the graph runs);
- `checked_before`: the same graphs with the weights checked before each call, the host
  waiting for the comparison before it launches the graph;
- `unchecked`: the same graphs with no check at all, the cost floor a check can approach
  (and the stale behaviour it prevents);
- `checked_again`: as `checked`, after the others, to expose drift between the runs;
- `refresh_only`: the check before the call alone (fingerprints, the host sync, no change
  found), timed on the host around 50 calls, with the weights' MiB it reads;
- `inductor_bf16_ro` and `loka_ro_no_cached_weights` (benchmarks.infer's row: every site FP8,
  weights cast in the graph every call), the baselines the cache is there to beat.

Writes <out>/<date>_<device>_weight_check.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import infer
from benchmarks.train import compile_unit, device_tag, loka_untimed_calls


def _timed(fn, pool, args, cuda) -> float:
    _, timing = infer._time_batch(fn, pool, args.warmup, args.iters, cuda, cudagraphs=cuda)
    return timing.median_ms


def _check_cost(caches: list, inputs: list, cuda: bool, calls: int = 50) -> float:
    for cache in caches:
        cache.refresh(inputs)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        for cache in caches:
            cache.refresh(inputs)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def run_model(name: str, args, device: torch.device) -> list:
    from loka_compile.passes.mods import cached_weights as weight_cache

    cuda = device.type == "cuda"
    setup = infer.ModelSetup(name, args, device, args.batch_list)
    rows = []
    for cfg_name in ("inductor_bf16_ro", "loka_ro_no_cached_weights"):
        cfg = infer.resolve_config(infer.config_for_device(cfg_name, cuda))
        torch._dynamo.reset()
        fn = compile_unit(infer.prepare_unit(setup.master, cfg, args.compile_scope, device), cfg)
        with torch.no_grad():
            for b, pool in setup.pools.items():
                rows.append({"model": name, "batch": b, "config": cfg_name, "median_ms": _timed(fn, pool, args, cuda)})
    cfg = infer.resolve_config(infer.config_for_device("loka_ro", cuda))
    args.warmup = max(args.warmup, loka_untimed_calls(cfg))
    torch._dynamo.reset()
    fn = compile_unit(infer.prepare_unit(setup.master, cfg, args.compile_scope, device), cfg)
    shipped = weight_cache.RefreshingGraph.__call__
    seen: dict = {}

    def recording(graph, inputs):
        seen[id(graph)] = (graph, list(inputs))
        return shipped(graph, inputs)

    def before(graph, inputs):
        graph.cache.refresh(inputs)
        return graph.compiled(inputs)

    def unchecked(graph, inputs):
        return graph.compiled(inputs)

    def timed_as(call) -> float:
        weight_cache.RefreshingGraph.__call__ = call
        try:
            return _timed(fn, pool, args, cuda)
        finally:
            weight_cache.RefreshingGraph.__call__ = shipped

    with torch.no_grad():
        for b, pool in setup.pools.items():
            seen.clear()
            row = {"model": name, "batch": b, "config": "loka_ro", "checked_ms": timed_as(recording)}
            row["checked_before_ms"] = timed_as(before)
            row["unchecked_ms"] = timed_as(unchecked)
            row["checked_again_ms"] = timed_as(shipped)
            graphs = [graph for graph, _ in seen.values()]
            inputs = next(iter(seen.values()))[1] if seen else []
            row["graphs_with_cached_weights"] = len(graphs)
            row["checked_after_call"] = [g.check_after for g in graphs]
            row["weights_checked"] = sum(len(g.cache.input_indices) for g in graphs)
            row["weight_mib_checked"] = sum(inputs[i].numel() * inputs[i].element_size()
                                            for g in graphs for i in g.cache.input_indices) / 2**20 if len(graphs) == 1 else None
            row["refresh_only_ms"] = _check_cost([g.cache for g in graphs], inputs, cuda) if len(graphs) == 1 else None
            checked_ms = statistics.mean([row["checked_ms"], row["checked_again_ms"]])
            row["check_cost_pct"] = 100 * (checked_ms / row["unchecked_ms"] - 1)
            row["check_before_cost_pct"] = 100 * (row["checked_before_ms"] / row["unchecked_ms"] - 1)
            rows.append(row)
            infer.log(f"  {name}/loka_ro batch {b}: {row}")
    return rows


def format_table(rows: list) -> str:
    base = {(r["model"], r["batch"], r["config"]): r.get("median_ms") for r in rows}
    lines = ["| model | batch | inductor bf16 ms | loka all-FP8, weights cast in the graph ms | loka checked ms | loka unchecked ms "
             "| check cost | checked before the call ms (cost) | check alone ms | weights (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["config"] != "loka_ro":
            continue
        key = (r["model"], r["batch"])
        mib = r.get("weight_mib_checked")
        alone = r.get("refresh_only_ms")
        lines.append(f"| {r['model']} | {r['batch']} | {base.get(key + ('inductor_bf16_ro',)):.3f} "
                     f"| {base.get(key + ('loka_ro_no_cached_weights',)):.3f} "
                     f"| {r['checked_ms']:.3f} / {r['checked_again_ms']:.3f} | {r['unchecked_ms']:.3f} "
                     f"| {r['check_cost_pct']:+.1f}% | {r['checked_before_ms']:.3f} ({r['check_before_cost_pct']:+.1f}%) "
                     f"| {'' if alone is None else f'{alone:.3f}'} "
                     f"| {r['weights_checked']} ({'' if mib is None else f'{mib:.1f}'}) |")
    return "\n".join(lines)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="python -m benchmarks.weight_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wukong,masknet")
    p.add_argument("--preset", default="tiny", choices=["tiny", "paper"])
    p.add_argument("--batches", default="512,8192")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    # benchmarks.infer's ModelSetup reads these
    args.seed, args.pool, args.compile_scope, args.train_steps, args.loka_options = 0, 4, "dense", 0, None
    args.batch_list = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, args, device)
    stem = f"{datetime.date.today()}_{device_tag(device)}_weight_check"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "preset": args.preset, "iters": args.iters}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = format_table(rows)
    (out / f"{stem}.md").write_text(f"# Cached weights' content check, per call ({meta['device']})\n\n{table}\n")
    print(table)
    return out / f"{stem}.json"


if __name__ == "__main__":
    main()
