"""A public-suite model's training step as Inductor's GPU kernel plan, read on a CPU-only machine
(`benchmarks.inductor_code_on_cpu`): the kernels of each compiled graph and the bytes each moves over
the batch-sized tensors, Inductor bf16 against loka, so the non-GEMM kernels and bytes loka adds can be
found before a GPU run.

    python -m benchmarks.public_kernel_plans --models deepctr_torch.DCNMix,torch_rechub.BST,torch_rechub.DIN
    python -m benchmarks.public_kernel_plans --models torch_rechub.DIN --configs loka_hp --code-dir /tmp/code

The unit is `benchmarks.public.run`'s `TrainUnit` (the library model under bf16 autocast and its loss in
fp32), the production preset at a batch small enough for CPU (`--batch`; bytes scale with the batch, and
are reported at `--scale-batch`); one forward and backward. Configs: `inductor` (Inductor bf16),
`loka_hp` (loka with every site too small for FP8: its Mods and passes alone, what a graph whose speed
check kept high precision runs), `loka_fp8` (`loka_all_fp8_ro`'s options: no probe window, no speed
check, every eligible site FP8, the graph speed check's FP8 variant). loka configs decide as on an H100
(`loka_as_on_gpu`): Dispatch sees FP8 hardware and picks `torch._scaled_mm` (cuBLASLt), which runs on
CPU, so the plan has the GPU's GEMM epilogue (bf16 out, bias fused) and casts, and `aligned_gemms` pads
as on CUDA; loka's own Triton GEMM is left out. Per kernel its kind
(`benchmarks.interaction_copies.kernel_kind`: copy, cast, cast+copy, compute); per graph the extern (GEMM)
calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path

import torch

from benchmarks.inductor_code_on_cpu import gpu_codegen_on_cpu, kernel_traffic
from benchmarks.interaction_copies import kernel_kind

CONFIGS = {"inductor": None, "loka_hp": {"probe_steps": 0, "min_gemm_dim": 1_000_000},
           "loka_fp8": {"probe_steps": 0, "speed_check": False}}
# H100 SXM datasheet: dense bf16 tensor-core peak and HBM3 bandwidth, for Inductor's compute-bound rule.
H100_BF16_TFLOPS, H100_DRAM_GBPS = 989.0, 3350.0
DEFAULT_MODELS = ("deepctr_torch.DCNMix", "torch_rechub.BST", "torch_rechub.DIN")


def compute_bound_on_h100(m: int, k: int, n: int) -> bool:
    """Inductor's `pad_mm.is_mm_compute_bound` on an H100: arithmetic intensity above half the
    machine balance (its bf16 special case is for pre-sm90 devices)."""
    intensity = m * n * k / (m * k + n * k + m * n)
    return intensity > 0.5 * 1000 * H100_BF16_TFLOPS / H100_DRAM_GBPS


@contextlib.contextmanager
def loka_as_on_gpu():
    """loka's device-dependent choices made as on an H100: Dispatch sees FP8 hardware and its
    `torch._scaled_mm` providers run on the CPU (CPU `_scaled_mm` takes the same operands), and the
    `aligned_gemms` Mod pads high-precision GEMMs as it does on CUDA (the compute-bound ones, by
    Inductor's rule with H100 numbers, it leaves to Inductor's timed pad_mm, which pads nothing off
    CUDA: they stay unpadded here)."""
    from loka_compile.kernels import providers
    from loka_compile.passes.mods import aligned_gemms
    real = {name: providers.get(name) for name in ("scaled_mm_tensorwise", "scaled_mm_rowwise")}
    real_check, real_pads_on = providers.has_fp8_hardware, aligned_gemms.pads_on
    real_judges = aligned_gemms.inductor_judges
    providers.has_fp8_hardware = lambda device: True
    aligned_gemms.pads_on = lambda device: True
    aligned_gemms.inductor_judges = lambda dims, a_val: compute_bound_on_h100(*dims)
    for provider in real.values():
        providers.register(dataclasses.replace(provider, available=lambda device: True), replace=True)
    try:
        yield
    finally:
        providers.has_fp8_hardware, aligned_gemms.pads_on = real_check, real_pads_on
        aligned_gemms.inductor_judges = real_judges
        for provider in real.values():
            providers.register(provider, replace=True)


def extern_calls(code: str) -> list[str]:
    """The extern kernels (GEMMs, library ops) one graph's code calls, by name."""
    call = code[code.index("def call("):]
    return re.findall(r"extern_kernels\.(\w+)\(", call) + re.findall(r"torch\.ops\.(\w+\.\w+)\.\w+\(", call)


def plan(name: str, config: str, batch: int, code_dir: Path | None = None, loka_options: dict | None = None) -> dict:
    """One model's training-step kernel plan under one config: per graph, each Triton launch with its
    kind and [B, *] MB at `batch`, and the extern calls."""
    from benchmarks.public.models import build
    from benchmarks.public.run import TrainUnit

    bench = build(name, "production")
    unit = TrainUnit(bench, bench.model, amp=True)
    inputs, labels = bench.batch(0, batch)
    options = CONFIGS[config] if loka_options is None else {**CONFIGS[config], **loka_options}
    codes: list = []
    start = time.time()
    torch._dynamo.reset()
    as_on_gpu = loka_as_on_gpu() if options is not None else contextlib.nullcontext()
    with gpu_codegen_on_cpu(codes) as inductor, as_on_gpu:
        compiled = (torch.compile(unit, backend=inductor) if options is None else
                    torch.compile(unit, backend="loka", options=options))
        loss, _ = compiled(inputs, labels)
        loss.backward()
    if not torch.isfinite(loss):
        raise RuntimeError(f"{name} [{config}]: loss {loss.item()} is not finite")
    sites = []
    if options is not None:
        import loka_compile
        sites = [dict(id=str(site.id), fp8=site.fp8, shape=list(site.shape), reason=str(site.reason),
                      casts=dict(site.casts)) for site in loka_compile.report(compiled).sites]
    graphs = []
    for i, code in enumerate(codes):
        if code_dir:
            code_dir.mkdir(parents=True, exist_ok=True)
            (code_dir / f"{name.split('.')[-1]}_{config}_graph{i}.py").write_text(code)
        rows = [dict(row, kind=kernel_kind(row["kernel"])) for row in kernel_traffic(code, batch, batch_anywhere=True)]
        graphs.append(dict(kernels=rows, extern=extern_calls(code)))
    return dict(model=name, config=config, batch=batch, graphs=graphs, sites=sites,
                codegen_s=round(time.time() - start, 1))


def summarize(result: dict, scale_batch: int) -> dict:
    """Launches (Triton and extern) and GB per step at `scale_batch`, by kind."""
    per_row = scale_batch / result["batch"]
    s = {"triton_launches": 0, "extern_calls": 0, "gb": 0.0}
    for g in result["graphs"]:
        s["triton_launches"] += len(g["kernels"])
        s["extern_calls"] += len(g["extern"])
        for row in g["kernels"]:
            gb = (row["read_mb"] + row["written_mb"]) * per_row / 1e3
            s["gb"] += gb
            s[f"{row['kind']}_gb"] = s.get(f"{row['kind']}_gb", 0.0) + gb
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}


def kernel_table(result: dict, scale_batch: int, min_mb: float = 1.0) -> list[str]:
    per_row = scale_batch / result["batch"]
    lines = ["| graph | kind | kernel | MB read | MB written |", "|---|---|---|---|---|"]
    for i, g in enumerate(result["graphs"]):
        for row in g["kernels"]:
            if (row["read_mb"] + row["written_mb"]) * per_row >= min_mb:
                lines.append(f"| {i} | {row['kind']} | `{row['kernel'][:80]}` | {row['read_mb'] * per_row:.1f} | "
                             f"{row['written_mb'] * per_row:.1f} |")
        lines.append(f"| {i} | extern | {', '.join(g['extern'])} | | |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.public_kernel_plans", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=640, help="codegen batch (no other dim of the model may equal it)")
    p.add_argument("--scale-batch", type=int, default=8192)
    p.add_argument("--loka", type=json.loads, default=None, help="JSON loka options for the loka configs instead")
    p.add_argument("--code-dir", default=None)
    p.add_argument("--out", default=None, help="JSON of every kernel and the summaries")
    p.add_argument("--kernels", action="store_true", help="print each kernel moving at least 1 MB")
    args = p.parse_args(argv)
    import loka_compile  # noqa: F401  (registers the backend)

    results = []
    for name in args.models.split(","):
        for config in args.configs.split(","):
            if config not in CONFIGS:
                raise ValueError(f"unknown config {config!r}; valid: {', '.join(CONFIGS)}")
            result = plan(name, config, args.batch, Path(args.code_dir) if args.code_dir else None,
                          None if config == "inductor" else args.loka)
            result["summary"] = summarize(result, args.scale_batch)
            results.append(result)
            s = result["summary"]
            print(f"{name} [{config}] codegen {result['codegen_s']} s at batch {args.batch}: {s['triton_launches']} "
                  f"Triton launches, {s['extern_calls']} extern calls, {s['gb']:.2f} GB of [B, *] traffic at batch "
                  f"{args.scale_batch} (" + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in s.items() if k.endswith("_gb"))
                  + ")", flush=True)
            if args.kernels:
                print("\n".join(kernel_table(result, args.scale_batch)), flush=True)
                for site in result["sites"]:
                    verdict = "FP8" if site["fp8"] else site["reason"]
                    print(f"  site {site['id']} {site['shape']} {verdict} {site['casts']}")
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
