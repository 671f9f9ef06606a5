"""The output budget (`max_output_error`) on the LRM zoo: each dense arch's output error
against its fp32 copy (TF32 off) for bf16 (Inductor), loka with every eligible site in FP8
(no probe window), loka with a probe window and the per-site rule only, and loka with a probe
window and the output budget; with the budget, its sites kept, the predicted and measured
discrepancy D from high precision, and the time its sensitivity runs took.

The window runs on pool batches 0-1, closes on batch 2; errors are measured on batch 3 (not
seen by the window). `--mode train` calls each compiled arch with gradients and runs a
backward of the mean logit at every call (the budget then acts on the training forward).
Speed check off: this measures quality only. One JSON per run under benchmarks/results/.

    python -m benchmarks.output_budget --models masknet,wukong --mode infer --batch 8192
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import pathlib
import time

import torch

import loka_compile
from benchmarks.zoo import SyntheticRecsysData, build_model
from loka_compile.kernels import ops

WINDOW = 2  # probe_steps
DELTA = ops.PERTURB_DELTA


def _relerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def _call(unit, inputs, train: bool) -> torch.Tensor:
    if train:
        out = unit(*inputs)
        out.float().mean().backward()
        return out.detach()
    with torch.no_grad():
        return unit(*inputs)


def run_model(name: str, args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    master, spec = build_model(name, args.preset, seed=0, device=device)
    master.eval()
    data = SyntheticRecsysData(spec, seed=1)
    with torch.no_grad():
        pool = [tuple(t.detach() if isinstance(t, torch.Tensor) else t
                      for t in master.sparse(*data.batch(i, args.batch, device).model_inputs())) for i in range(4)]
        reference = master.dense(*pool[3]).double()
    train = args.mode == "train"
    rows = {}
    loka_base = {"speed_check": False, "disabled_mods": ["benchmarked_reductions"], "recipe": args.recipe}
    configs = {
        "inductor_bf16": None,
        "loka_all_fp8": {**loka_base, "probe_steps": 0},
        "loka_per_site": {**loka_base, "probe_steps": WINDOW, "max_output_error": None},
        "loka_budget": {**loka_base, "probe_steps": WINDOW, "max_output_error": args.budget},
    }
    # A budget nothing exceeds: every site the per-site rule passes goes FP8, and the check after
    # compile measures the D that the sensitivities predicted (at each noise size asked for).
    for delta in args.loose_deltas:
        configs[f"loka_loose_delta{delta:g}"] = {**loka_base, "probe_steps": WINDOW, "max_output_error": 1e9,
                                                 "_delta": delta}
    configs = {k: v for k, v in configs.items() if k == "inductor_bf16" or not args.configs or k in args.configs}
    for cfg, options in configs.items():
        options = dict(options) if options is not None else None
        ops.PERTURB_DELTA = (options or {}).pop("_delta", DELTA)
        torch._dynamo.reset()
        loka_compile.reset()
        unit = copy.deepcopy(master.dense).to(torch.bfloat16)
        if train:
            unit.train()
        compiled = torch.compile(unit) if options is None else torch.compile(unit, backend="loka", options=options)
        start = time.perf_counter()
        for i in range(3):
            _call(compiled, pool[i], train)
        torch.cuda.synchronize() if device.type == "cuda" else None
        row = {"compile_and_window_s": round(time.perf_counter() - start, 1),
               "out_relerr": _relerr(_call(compiled, pool[3], train), reference)}
        if options is not None:
            report = loka_compile.report(compiled)
            fwd = [s for s in report.sites if s.role == "fwd"]
            row.update(fwd_sites=len(fwd), fwd_fp8=sum(s.fp8 for s in fwd),
                       sites=len(report.sites), fp8=sum(s.fp8 for s in report.sites))
            budgets = [g.output_budget for g in report.graphs if g.output_budget is not None]
            if budgets:
                row["budget"] = [{"kept": len(b.kept), "weighed": len(b.sensitivity),
                                  "predicted_before": b.predicted_before, "predicted_after": b.predicted_after,
                                  "measured": b.measured, "sensitivity_s": round(b.seconds, 3), "runs": b.runs,
                                  "sensitivities": {k: round(v, 4) for k, v in sorted(b.sensitivity.items())},
                                  "errors": {k: round(v, 4) for k, v in sorted(b.error.items())}}
                                 for b in budgets]
        rows[cfg] = row
        print(f"{name} {args.mode} {cfg}: out_relerr {row['out_relerr']:.4g} "
              f"({row['out_relerr'] / rows['inductor_bf16']['out_relerr']:.2f}x bf16)"
              + (f", fwd FP8 {row['fwd_fp8']}/{row['fwd_sites']}, all FP8 {row['fp8']}/{row['sites']}"
                 if options is not None else "")
              + "".join(f"; budget: kept {b['kept']}/{b['weighed']}, D predicted {b['predicted_before']:.3g} -> "
                        f"{b['predicted_after']:.3g}, measured {b['measured']:.3g}, sensitivity runs "
                        f"{b['runs']} in {b['sensitivity_s']} s" for b in row.get("budget", [])), flush=True)
        del compiled, unit
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="masknet", help="comma list of zoo models")
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--budget", type=float, default=0.003)
    parser.add_argument("--loose-deltas", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                        help="comma list of noise sizes (kernels.ops.PERTURB_DELTA) for loka_loose_delta<d> rows")
    parser.add_argument("--configs", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="comma list of rows besides inductor_bf16 (default: all)")
    parser.add_argument("--name", default=None, help="results file name (default: <date>_output_budget_<mode>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"device": device, "torch": torch.__version__, "args": vars(args), "perturb_delta": DELTA,
               "models": {}}
    for name in args.models.split(","):
        results["models"][name] = run_model(name, args)
    name = args.name or f"{time.strftime('%Y-%m-%d')}_output_budget_{args.mode}"
    path = pathlib.Path(__file__).parent / "results" / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], path.name).write_text(path.read_text())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
