"""Inductor's GPU code for a training step, read on a CPU-only machine: which Triton kernels a
graph becomes and the bytes each moves over the batch-sized tensors, so a Mod's kernel plan can be
studied before a GPU run (the GPU's own code: the benchmarks' `--dump-code`).

    python -m benchmarks.inductor_code_on_cpu --out /tmp/code                         # Inductor
    python -m benchmarks.inductor_code_on_cpu --loka '{"enabled_mods": ["linear_batchnorm"]}'

How: Inductor's Triton backend for the CPU (`cpu_backend="triton"`), with H100 device properties
(132 SMs, sm90) and the GPU's realization thresholds, so its fusion, split-reduction and
realization choices are the GPU's; each graph's code is taken when generated
(`GraphLowering.save_output_code`) and the graph then runs as Inductor received it, its post-grad
passes applied, since this machine cannot run the kernels. Autotuning and the kernels' launch
parameters are not the GPU's.

Model: Linear -> BatchNorm1d -> ReLU -> Dropout per tower width, then a Linear head (the MLP of
torch-rechub and deepctr-torch), one forward and backward. Per kernel: reads and writes of
tensors whose first dim is the batch (each pointer once), in MB; their sum at 3 TB/s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
from pathlib import Path

import torch
from torch import nn

H100_PROPERTIES = dict(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                       regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                       max_threads_per_block=1024, warp_size=32)
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1, "bool": 1}


@contextlib.contextmanager
def gpu_codegen_on_cpu(codes: list):
    """Inductor generates Triton code with GPU heuristics for CPU tensors; each graph's code is
    appended to `codes` and the graph runs uncompiled."""
    import torch._inductor.compile_fx as compile_fx
    import torch.utils._triton as triton_utils
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering
    from torch._inductor.runtime import hints

    import loka_compile.inductor_compile as loka_inductor_compile

    real_inner = compile_fx.compile_fx_inner

    def codegen_then_run(gm, example_inputs, **kwargs):
        try:
            real_inner(gm, example_inputs, **kwargs)
        except Exception as error:  # noqa: BLE001 - loading the kernels needs a GPU; the code is taken
            if "GPU backend" not in str(error) and "driver" not in str(error):
                raise
        gm.recompile()

        def run(args):
            out = gm(*args)
            args.clear()
            return out
        run._boxed_call = True
        return run

    saved = (config.cpu_backend, config.realize_acc_reads_threshold, config.realize_opcount_threshold,
             config.force_disable_caches, hints.DeviceProperties.create, triton_utils.triton_hash_with_backend, GraphLowering.save_output_code,
             loka_inductor_compile.compile_fx_inner)
    config.cpu_backend = "triton"
    config.realize_acc_reads_threshold = config._realize_acc_reads_threshold_default
    config.realize_opcount_threshold = config._realize_opcount_threshold_default
    config.force_disable_caches = True   # a cache hit generates no code
    hints.DeviceProperties.create = classmethod(lambda cls, device: hints.DeviceProperties(**H100_PROPERTIES))
    triton_utils.triton_hash_with_backend = lambda: "0" * 64   # no Triton driver on this machine
    GraphLowering.save_output_code = staticmethod(codes.append)
    loka_inductor_compile.compile_fx_inner = codegen_then_run
    try:
        yield functools.partial(compile_fx.compile_fx, inner_compile=codegen_then_run)
    finally:
        (config.cpu_backend, config.realize_acc_reads_threshold, config.realize_opcount_threshold,
         config.force_disable_caches, hints.DeviceProperties.create, triton_utils.triton_hash_with_backend, GraphLowering.save_output_code,
         loka_inductor_compile.compile_fx_inner) = saved


def _call_args(args: str) -> list[str]:
    """A launch's arguments, split at the commas outside parentheses (`reinterpret_tensor(...)`)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(args):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(args[start:i].strip())
            start = i + 1
    parts.append(args[start:].strip())
    return parts


def _batch_sized(dims: list, batch: int, anywhere: bool) -> bool:
    if len(dims) < 2:
        return False
    if not anywhere:
        return dims[0] == batch
    return batch in dims or dims[0] % batch == 0


def kernel_traffic(code: str, batch: int, batch_anywhere: bool = False) -> list[dict]:
    """Each Triton kernel launch of one graph's code: name, and the MB it reads and writes of
    tensors whose first dim is `batch` (`batch_anywhere`: any dim, or a first dim that is a
    multiple of it, as heads-major attention tensors are); a view argument
    (`reinterpret_tensor`, e.g. one input's slice of a cat) counts its own size."""
    kernels = dict(re.findall(r"(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, re.S))
    call = code[code.index("def call("):]
    shapes = {}
    for name, dims, dtype in re.findall(r"(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code):
        shapes[name] = ([int(d) for d in dims.split(",") if d.strip()], dtype)
    for name, dims, dtype in re.findall(r"assert_size_stride\((\w+), \(([^)]*)\), \([^)]*\), '(\w+)'", code):
        shapes.setdefault(name, ([int(d) for d in dims.split(",") if d.strip()], dtype.replace("torch.", "")))
    for name, base, dims in re.findall(r"(\w+) = reinterpret_tensor\((\w+), \(([^)]*)\), [^\n]*# alias", code):
        if base in shapes:
            shapes[name] = ([int(d) for d in dims.split(",") if d.strip()], shapes[base][1])
    for new, old in re.findall(r"(\w+) = (\w+); del \w+  # reuse", code):
        if old in shapes:
            shapes[new] = shapes[old]
    rows = []
    for name, args in re.findall(r"(triton_\w+)\.run\(([^\n]*)\)", call):
        body = kernels.get(name, "")
        params = [p.split(":")[0].strip() for p in re.search(r"def \w+\(([^)]*)\)", body).group(1).split(",")]
        loads = set(re.findall(r"tl\.load\((\w+) \+", body))
        stores = set(re.findall(r"tl\.store\((\w+) \+", body))
        read = written = 0
        call_args = _call_args(args)
        # a pointer is read or written at most once per element of the launch's iteration space
        launch_elements = math.prod(int(a) for a in call_args if a.isdigit())
        for param, arg in zip(params, call_args):
            view = re.match(r"reinterpret_tensor\((\w+), \(([^)]*)\)", arg)
            if view:
                dims = [int(d) for d in view.group(2).split(",") if d.strip()]
                dtype = shapes.get(view.group(1), (None, None))[1]
            else:
                dims, dtype = shapes.get(arg, (None, None))
            if not dims or not _batch_sized(dims, batch, batch_anywhere):
                continue
            size = _ELEMENT_BYTES.get(dtype, 2) * min(math.prod(dims), launch_elements)
            read += size if param in loads else 0
            written += size if param in stores else 0
        rows.append(dict(kernel=name, read_mb=read / 1e6, written_mb=written / 1e6))
    return rows


def build_mlp(width: int, towers: tuple) -> nn.Module:
    from benchmarks.public.written_here import mlp_bn
    return nn.Sequential(mlp_bn(width, towers), nn.Linear(towers[-1], 1))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.inductor_code_on_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--towers", default="2048,1024")
    p.add_argument("--precision", default="bf16", choices=("bf16", "autocast"))
    p.add_argument("--loka", type=json.loads, default=None,
                   help="JSON loka options, probe_steps 0 unless given: the first call compiles (default: Inductor)")
    p.add_argument("--out", default=None, help="directory for each graph's code")
    args = p.parse_args(argv)
    import loka_compile  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    model = build_mlp(args.width, tuple(int(t) for t in args.towers.split(",")))
    if args.precision == "bf16":
        model = model.bfloat16()
    x = torch.randn(args.batch, args.width, dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    codes: list = []
    with gpu_codegen_on_cpu(codes) as inductor:
        compiled = (torch.compile(model, backend=inductor) if args.loka is None else
                    torch.compile(model, backend="loka", options={"probe_steps": 0, **args.loka}))
        with torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "autocast"):
            y = compiled(x)
        y.float().sum().backward()
    total = 0.0
    for i, code in enumerate(codes):
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"graph{i}.py").write_text(code)
        print(f"graph {i}")
        for row in kernel_traffic(code, args.batch):
            if row["read_mb"] or row["written_mb"]:
                print(f"  {row['kernel'][:88]:88s} read {row['read_mb']:7.1f} MB  write {row['written_mb']:7.1f} MB")
            total += row["read_mb"] + row["written_mb"]
    print(f"[B, *] traffic of the step's kernels: {total:.1f} MB, {total / 3:.0f} us at 3 TB/s")
    return total


if __name__ == "__main__":
    main()
