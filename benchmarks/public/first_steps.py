"""Where the first steps' time goes: one public model's first steps under one config, run
under cProfile, with the cumulative wall time of each compile phase (Inductor's compiles,
loka's probe and FP8 variants, the speed check, the output budget's side runs, CUDA-graph
recording, Triton's compiles and autotuning).

    python -m benchmarks.public.first_steps --model deepctr_torch.DeepFM --config loka --preset tiny
    python -m benchmarks.public.first_steps --model public_style.Wukong --config loka_ro \
        --preset production --out $OUT/first_steps            # GPU
    python -m benchmarks.public.first_steps --model deepctr_torch.DeepFM --config loka --save-plan plan.json
    python -m benchmarks.public.first_steps --model deepctr_torch.DeepFM --config loka \
        --loka-options '{"plan": "plan.json"}'               # the first steps with that plan
    bash benchmarks/public/first_steps_matrix.sh $OUT deepctr_torch.DeepFM torch_rechub.DCNv2  # GPU matrix

Run each config in a fresh process (one call per config), with a fresh TORCHINDUCTOR_CACHE_DIR
and LOKA_CACHE_DIR for a cold start; the phases of one run overlap (a variant's compile holds
its passes, which hold the speed check), so they do not sum to the total. cProfile slows Python
code, so `first_steps_s` here is above run.py's; compare phases within one run, and totals
between runs of this script. Writes `<out>/<name>.json` and `.md`, and with `--pstats PATH` the
whole profile (read it with `pstats`: callers and callees of any phase).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time
from pathlib import Path

import torch

# (phase, path suffix of the file, function name): cumulative time of each, summed over matches
PHASES = (
    ("first steps (profiled)", "benchmarks/public/first_steps.py", "run_steps"),
    ("Dynamo + backend (whole first compile)", "torch/_dynamo/convert_frame.py", "_compile"),
    ("AOTAutograd (all graphs)", "torch/_functorch/aot_autograd.py", "aot_module_simplified"),
    ("AOTAutograd metadata runs", "torch/_functorch/aot_autograd.py", "create_aot_state"),
    ("AOTAutograd traces (joint graph capture)", "torch/_functorch/_aot_autograd/graph_compile.py",
     "aot_stage1_graph_capture"),
    ("AOTAutograd partitions (joint-graph passes + partitioner)", "torch/_inductor/compile_fx.py", "partition_fn"),
    ("Inductor compile_fx_inner (all graphs)", "torch/_inductor/compile_fx.py", "compile_fx_inner"),
    ("Inductor codegen + kernel loads", "torch/_inductor/graph.py", "compile_to_module"),
    ("Triton compile", "triton/compiler/compiler.py", "compile"),
    ("Triton autotuning", "triton/runtime/autotuner.py", "_bench"),
    ("CUDA-graph trees (warm-up, record)", "torch/_inductor/cudagraph_trees.py", "run"),
    ("loka: probe variant (backend call)", "loka_compile/backend.py", "loka_backend"),
    ("loka: close the probe window", "loka_compile/compiled_graph.py", "_close_probe_window"),
    ("loka: FP8 variant compile", "loka_compile/compiled_graph.py", "_compile_fp8"),
    ("loka: probe variant's graphs traced (no Inductor codegen)", "loka_compile/inductor_compile.py", "_as_traced"),
    ("loka: passes (all graphs)", "passes/__init__.py", "run_passes"),
    ("loka: AOTAutograd captures reused (copies)", "loka_compile/aot_capture.py", "_copy_graph_module"),
    ("loka: probe observers (statistics)", "kernels/ops.py", "gemm_statistics"),
    ("loka: speed check (site timings)", "loka_compile/speed.py", "site_timing"),
    ("loka: site timings measured (not in the perf DB)", "loka_compile/speed.py", "_measure_site"),
    ("loka: site timing runs (each timed call set)", "loka_compile/speed.py", "_time_runs_us"),
    ("loka: epilogue timings", "loka_compile/speed.py", "epilogue_timing"),
    ("loka: provider trials (speed check off)", "loka_compile/speed.py", "_try_providers"),
    ("loka: graph speed check", "loka_compile/compiled_graph.py", "_check_graph_speed"),
    ("loka: probe verdicts", "loka_compile/compiled_graph.py", "_verdicts_by_id"),
    ("loka: output budget reference run", "loka_compile/budget_window.py", "_budget_reference"),
    ("loka: output budget sensitivities", "loka_compile/budget_window.py", "_measure_sensitivities"),
    ("loka: output budget noise floor (eager runs)", "loka_compile/budget_window.py", "_measure_floor"),
    ("loka: output budget verification run", "loka_compile/budget_window.py", "_verify_output_budget"),
    ("loka: fallback compile at a first run", "loka_compile/compiled_graph.py", "_fall_back_at_first_run"),
)


def phase_times(stats: pstats.Stats, phases=PHASES) -> list[dict]:
    """Each phase's cumulative seconds and call count in `stats` (0 where it never ran).
    A function that calls itself counts once (cProfile's cumulative time does)."""
    out = []
    for label, path, name in phases:
        seconds, calls = 0.0, 0
        for (filename, _line, function), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
            if function == name and filename.replace("\\", "/").endswith(path):
                seconds += ct
                calls += nc
        out.append({"phase": label, "seconds": round(seconds, 3), "calls": calls})
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (Inductor's C++
    compiles): on a shared machine less noisy than wall time, where every config runs on the
    same threads (one compile worker)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_steps(call, batches, steps: int, cuda: bool) -> list[float]:
    """Wall seconds of each of the first `steps` calls (synchronized on GPU)."""
    times = []
    for i in range(steps):
        start = time.perf_counter()
        call(*batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> dict:
    from benchmarks.infer import _device as infer_device, config_for_device
    from benchmarks.public.models import build, clone_model
    from benchmarks.public.run import InferUnit, TrainUnit, resolve_row_config
    from benchmarks.train import compile_unit, device_tag

    p = argparse.ArgumentParser(prog="python -m benchmarks.public.first_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="a benchmarks.public.run config (inductor_bf16, loka_ro, ...)")
    p.add_argument("--mode", default="train", choices=("train", "infer"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--loka-options", type=json.loads, default=None)
    p.add_argument("--save-plan", default=None, help="a loka config: write its plan here after the steps "
                   "(pass it back with --loka-options '{\"plan\": PATH}' for the planned first steps)")
    p.add_argument("--out", default=None, help="directory for <name>.json and .md (default: print only)")
    p.add_argument("--name", default=None)
    p.add_argument("--pstats", default=None, help="also write the whole cProfile of the steps here (for pstats)")
    p.add_argument("--no-profile", action="store_true", help="run the steps without cProfile (no phase table): "
                   "wall times without its overhead on Python-heavy compiles")
    args = p.parse_args(argv)

    device = infer_device(args.device)
    cuda = device.type == "cuda"
    cfg, planned_from = resolve_row_config(config_for_device(args.config, cuda))
    if planned_from is not None:
        raise SystemExit("a _planned config needs run.py's saved plan: pass it with --loka-options '{\"plan\": PATH}'")
    bench = build(args.model, args.preset, device=device, seed=0)
    batch = args.batch or bench.preset.batch
    batches = [bench.batch(i, batch) for i in range(4)]
    model = clone_model(bench.model)
    if args.mode == "infer":
        model.eval()
    unit = (TrainUnit if args.mode == "train" else InferUnit)(bench, model, cfg.dtype == torch.bfloat16)
    fn = compile_unit(unit, cfg, args.loka_options)
    cudagraphs = cuda and cfg.mode == "reduce-overhead"
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3) if args.mode == "train" else None

    def call(inputs, labels):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if optimizer is None:
            with torch.no_grad():
                return fn(inputs)
        loss, _ = fn(inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    profiler = None if args.no_profile else cProfile.Profile()
    cpu_start = cpu_seconds()
    if profiler is not None:
        profiler.enable()
    per_step = run_steps(call, batches, args.steps, cuda)
    if profiler is not None:
        profiler.disable()
    cpu_s = cpu_seconds() - cpu_start
    if args.pstats and profiler is not None:
        profiler.dump_stats(args.pstats)
    if args.save_plan:
        import loka_compile
        loka_compile.save_plan(fn, args.save_plan)
    result = {"model": args.model, "config": cfg.name, "mode": args.mode, "preset": args.preset, "batch": batch,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "first_steps_s": round(sum(per_step), 3), "per_step_s": [round(t, 3) for t in per_step],
              "first_steps_cpu_s": round(cpu_s, 3), "loka_options": args.loka_options,
              "phases": phase_times(pstats.Stats(profiler)) if profiler is not None else []}
    lines = [f"# First {args.steps} steps: {args.model} {args.mode}, {cfg.name} ({result['device']}, preset "
             f"{args.preset}, batch {batch}): {result['first_steps_s']:.2f} s "
             f"{'without' if profiler is None else 'under'} cProfile ({cpu_s:.2f} CPU s), "
             f"per step {result['per_step_s']}", "", "| phase | seconds | calls |", "|---|---|---|"]
    lines += [f"| {ph['phase']} | {ph['seconds']:.2f} | {ph['calls']} |" for ph in result["phases"] if ph["calls"]]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        name = args.name or f"{device_tag(device)}_first_steps_{args.model}_{args.mode}_{cfg.name}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{name}.md").write_text(text)
    return result


if __name__ == "__main__":
    main()
