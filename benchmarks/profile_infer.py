"""Where an inference call's device time goes, per kernel, for several configs of one model.

    python -m benchmarks.profile_infer --model masknet --batch 8192 \
        --configs inductor_bf16,loka_all_fp8 --out $OUT

For each config (names from `benchmarks.infer`; default-mode names profile without CUDA
graphs, `_ro` names with them, whose replayed kernels the profiler also sees), the model's dense arch at its paper preset is compiled in
bf16 / eval / no_grad, called three times, then one call is profiled
(`benchmarks.ceiling.profile_kernels`). Prints, per config, the summed kernel time, the
GEMM share and the top kernels (with call counts); for loka configs also the report's
site table. Writes everything as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.ceiling import profile_kernels, summarize_kernels
from benchmarks.infer import ModelSetup, prepare_unit, resolve_config
from benchmarks.infer import parse_args as infer_parse_args
from benchmarks.train import compile_unit, loka_untimed_calls


def profile_config(setup: ModelSetup, name: str, batch: int, top: int) -> dict:
    cfg = resolve_config(name)
    fn = compile_unit(prepare_unit(setup.master, cfg, "dense", setup.device), cfg)
    inputs = setup.pools[batch]
    cuda = setup.device.type == "cuda"
    cudagraphs = cuda and cfg.mode == "reduce-overhead"

    def call(i):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(*inputs[i % len(inputs)])

    with torch.no_grad():
        for i in range(max(3, loka_untimed_calls(cfg))):  # compile, CUDA graphs, a loka probe window
            call(i)
        if cuda:
            torch.cuda.synchronize()
        times, source = profile_kernels(lambda: call(0), cuda=cuda)
    summary = summarize_kernels(times, source, top=top, name_chars=120)
    if cfg.kind == "loka":
        import loka_compile
        summary["sites"] = loka_compile.report(fn).table()
    torch._dynamo.reset()
    return summary


def _raise_persistent_threshold(threshold: int) -> None:
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    default = InductorChoices.should_use_persistent_reduction

    def should_use(features, cooperative_reduction):
        if (features.get_reduction_hint() == ReductionHint.INNER and not cooperative_reduction
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, threshold)):
            return True
        return default(features, cooperative_reduction)

    InductorChoices.should_use_persistent_reduction = staticmethod(should_use)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="masknet")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--preset", default="paper", choices=["tiny", "paper"])
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (CPU op self times: checks the script)")
    p.add_argument("--configs", default="inductor_bf16,loka_all_fp8")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    p.add_argument("--persistent-threshold", type=int, default=0,
                   help="experiment: Inductor makes inner reductions up to this many elements persistent "
                        "(its default: 1024), in every config")
    args = p.parse_args(argv)
    if args.persistent_threshold:
        _raise_persistent_threshold(args.persistent_threshold)
    device = torch.device(args.device)
    setup_args = infer_parse_args(["--preset", args.preset, "--pool", "2", "--models", args.model])
    setup = ModelSetup(args.model, setup_args, device, [args.batch])
    results = {}
    for name in args.configs.split(","):
        results[name] = summary = profile_config(setup, name, args.batch, args.top)
        print(f"\n== {args.model} {name} batch {args.batch}: kernels {summary['total_ms']:.3f} ms, "
              f"GEMM {summary['gemm_ms']:.3f} ms ({100 * summary['gemm_share']:.0f}%)")
        for k in summary["top_kernels"]:
            print(f"  {k['ms']:8.3f} ms {k['calls']:4d}x {'G' if k['gemm'] else ' '} {k['name']}")
    for name, summary in results.items():
        if "sites" in summary:
            print(f"\n== {name} sites\n{summary['sites']}")
    if args.out:
        path = Path(args.out) / f"profile_infer_{args.model}_{args.batch}.json"
        path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
