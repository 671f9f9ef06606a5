"""The copy kernels (cat, permute/transpose made contiguous, clone, expand) that Inductor's GPU code
spends around the public suite's interaction layers, read on a CPU-only machine with
`benchmarks.inductor_code_on_cpu`, for a training step's forward and backward.

    python -m benchmarks.interaction_copies --models FiBiNET,AutoInt --out /tmp/copies.json
    python -m benchmarks.interaction_copies --loka '{}'
    python -m benchmarks.interaction_copies --mods cat_flatten       # Inductor after loka's Dynamo-graph Mod

Each model is built as `benchmarks/public/models.py` builds it (production preset); its
interaction layer is called as the model's own forward calls it, on the embeddings the model's
lookups produce ([B, 1, d] per field, requiring grad), under bf16 autocast, and its output
reaches the loss through a fixed random projection. A small batch generates the code; bytes are
scaled per row to `--scale-batch`. A kernel is a copy when every op Inductor names it after moves
data without arithmetic; its traffic is excess, since a GEMM or the producer could read or write
the strided layout in place.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.inductor_code_on_cpu import gpu_codegen_on_cpu, kernel_traffic

# ops that only move data: a kernel fused from nothing else is a copy
_COPY_OPS = ("_unsafe_view", "permute", "transpose", "unsqueeze", "squeeze", "expand", "select", "clone",
             "slice", "split", "stack", "repeat", "view", "copy", "cat", "t")
_CAST_OPS = ("_to_copy",)


def kernel_kind(name: str) -> str:
    """'copy' (data movement only), 'cast+copy' (a dtype cast with data movement), 'cast', or
    'compute', from the ops in Inductor's kernel name."""
    ops = re.sub(r"^triton_(poi|red|per|tem)_fused_", "", name)
    ops = re.sub(r"_\d+$", "", ops)
    has_cast = "_to_copy" in ops
    rest = "_" + ops.replace("_to_copy", "") + "_"
    moved = False
    for op in _COPY_OPS:
        rest, n = re.subn(rf"_{op}(?=_)", "", rest)
        moved |= n > 0
    if rest.strip("_"):
        return "compute"
    return "cast+copy" if has_cast and moved else ("cast" if has_cast else "copy")


class Interaction(nn.Module):
    """The interaction part of one public model, as its forward calls it, from per-field embeddings."""

    def __init__(self, name: str, model: nn.Module, dense_fields: int = 0):
        super().__init__()
        self.name, self.model, self.dense_fields = name, model, dense_fields

    def forward(self, embeddings: list, dense: torch.Tensor | None = None) -> torch.Tensor:
        m, name = self.model, self.name
        if name == "deepctr_torch.FiBiNET":
            x = torch.cat(embeddings, dim=1)
            out = torch.cat((m.Bilinear(m.SE(x)), m.Bilinear(x)), dim=1)
            return torch.flatten(torch.cat(torch.split(out, 1, dim=1), dim=-1), start_dim=1)
        if name == "deepctr_torch.AutoInt":
            x = torch.cat(embeddings, dim=1)
            for layer in m.int_layers:
                # CPU autocast leaves tensordot's operands as they come: a bf16 layer output meets fp32 weights
                x = layer(x.to(layer.W_Query.dtype))
            return torch.flatten(x, start_dim=1)
        if name == "deepctr_torch.xDeepFM":
            return m.cin(torch.cat(embeddings, dim=1))
        if name == "deepctr_torch.PNN":
            linear_signal = torch.flatten(torch.cat(embeddings, dim=1), start_dim=1)
            inner = torch.flatten(m.innerproduct(embeddings), start_dim=1)
            return torch.cat([linear_signal, inner], dim=1)
        if name == "public_style.Wukong":
            h = torch.cat([dense, torch.cat(embeddings, dim=1)], dim=1)
            for layer in m.layers:
                h = layer(h)
            return h.flatten(1)
        raise ValueError(f"no interaction layer known for {name!r}")


MODELS = ("deepctr_torch.FiBiNET", "deepctr_torch.AutoInt", "deepctr_torch.xDeepFM", "deepctr_torch.PNN",
          "public_style.Wukong")


def with_mods(backend, mods: tuple):
    """`backend` after the named Dynamo-graph Mods of loka (their defaults' config) rewrite its graph."""
    from loka_compile import LokaConfig
    from loka_compile.passes.mods import BY_NAME
    config = LokaConfig(probe_steps=0)

    def rewritten(gm, example_inputs):
        for name in mods:
            print(f"  {name}: {BY_NAME[name].run(gm, example_inputs, config)}", flush=True)
        gm.recompile()
        return backend(gm, example_inputs)
    return rewritten


def study(name: str, batch: int, loka: dict | None, out_dir: Path | None, mods: tuple = ()) -> dict:
    """Codegen one model's interaction step; per graph, each kernel's kind and [B, *] MB at `batch`."""
    from benchmarks.public.models import build
    bench = build(name, "production")
    p = bench.preset
    dense_fields = p.dense_fields if name == "public_style.Wukong" else 0
    unit = Interaction(name, bench.model, dense_fields)
    g = torch.Generator().manual_seed(1)
    embeddings = [(torch.randn(batch, 1, p.embed_dim, generator=g) * p.embed_std).requires_grad_()
                  for _ in range(p.num_sparse)]
    dense = (torch.randn(batch, dense_fields, p.embed_dim, generator=g).requires_grad_() if dense_fields else None)
    with torch.no_grad():
        width = unit(embeddings, dense).shape[1]
    projection = torch.randn(width, generator=g) / width ** 0.5

    def step(embeddings, dense, projection):
        with torch.autocast("cpu", torch.bfloat16):
            y = unit(embeddings, dense)
        return (y.float() @ projection).square().mean()

    codes: list = []
    start = time.time()
    with gpu_codegen_on_cpu(codes) as inductor:
        compiled = (torch.compile(step, backend=with_mods(inductor, mods)) if loka is None else
                    torch.compile(step, backend="loka", options={"probe_steps": 0, **loka}))
        loss = compiled(embeddings, dense, projection)
        loss.backward()
    if not torch.isfinite(loss):
        raise RuntimeError(f"{name}: loss {loss.item()} is not finite")
    graphs = []
    for i, code in enumerate(codes):
        if out_dir:
            out_dir.mkdir(parents=True, exist_ok=True)
            config = _config_name(loka, mods)
            (out_dir / f"{name.split('.')[-1]}_{config}_graph{i}.py").write_text(code)
        rows = [dict(row, kind=kernel_kind(row["kernel"])) for row in kernel_traffic(code, batch, batch_anywhere=True)]
        graphs.append(rows)
    return dict(model=name, config=_config_name(loka, mods), batch=batch, graphs=graphs,
                codegen_s=round(time.time() - start, 1))


def _config_name(loka: dict | None, mods: tuple) -> str:
    if loka is not None:
        return "loka" + ("" if not loka else " " + json.dumps(loka, sort_keys=True))
    return "+".join(["inductor", *mods])


def summarize(result: dict, scale_batch: int) -> dict:
    """MB per step at `scale_batch` by kind and pass (graph 0 forward, the last backward)."""
    per_row = scale_batch / result["batch"]
    passes = {0: "forward", len(result["graphs"]) - 1: "backward"}
    summary: dict = {"copies": []}
    for i, rows in enumerate(result["graphs"]):
        which = passes.get(i, f"graph{i}")
        for row in rows:
            mb = (row["read_mb"] + row["written_mb"]) * per_row
            key = f"{which}_{row['kind']}_mb"
            summary[key] = summary.get(key, 0.0) + mb
            summary["total_mb"] = summary.get("total_mb", 0.0) + mb
            if row["kind"] != "compute":
                summary["copies"].append(dict(pass_=which, kernel=row["kernel"], kind=row["kind"], mb=round(mb, 1)))
    summary["excess_mb"] = sum(c["mb"] for c in summary["copies"] if c["kind"] in ("copy", "cast+copy"))
    summary["excess_us_at_3tbs"] = summary["excess_mb"] / 3.0
    return summary


def grouped_kernels(result: dict, scale_batch: int) -> list[dict]:
    """One row per generated kernel (launches of it counted), per pass and kind, MB at `scale_batch`."""
    per_row = scale_batch / result["batch"]
    last = len(result["graphs"]) - 1
    groups: dict = {}
    for i, rows in enumerate(result["graphs"]):
        which = "forward" if i == 0 else ("backward" if i == last else f"graph{i}")
        for row in rows:
            key = (which, row["kind"], re.sub(r"_\d+$", "", row["kernel"]))
            g = groups.setdefault(key, dict(pass_=which, kind=row["kind"], kernel=key[2], launches=0, mb=0.0))
            g["launches"] += 1
            g["mb"] += (row["read_mb"] + row["written_mb"]) * per_row
    return sorted(groups.values(), key=lambda g: (g["pass_"] != "forward", -g["mb"]))


def markdown(results: list, scale_batch: int, min_mb: float = 1.0) -> str:
    """Per model and config: the totals, then each kernel (grouped) moving at least `min_mb`, at `scale_batch`."""
    lines = []
    for result in results:
        s = result["summary"]
        lines += [f"### {result['model']}, {result['config']}", "",
                  f"Kernels' [B, *] traffic {s['total_mb']:.0f} MB per step, copies {s['excess_mb']:.0f} MB "
                  f"({s['excess_mb'] * 1e3 / scale_batch:.1f} KB per sample, "
                  f"{s['excess_us_at_3tbs']:.0f} us at 3 TB/s).", "",
                  "| pass | kind | kernel | launches | MB | KB/sample |", "|---|---|---|---|---|---|"]
        for g in grouped_kernels(result, scale_batch):
            if g["mb"] < min_mb:
                continue
            lines.append(f"| {g['pass_']} | {g['kind']} | `{g['kernel'][:90]}` | {g['launches']} | {g['mb']:.1f} | "
                         f"{g['mb'] * 1e3 / scale_batch:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.interaction_copies", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(m.split(".")[-1] for m in MODELS))
    p.add_argument("--batch", type=int, default=192, help="codegen batch (no other dim may equal it)")
    p.add_argument("--scale-batch", type=int, default=8192)
    p.add_argument("--loka", type=json.loads, default=None, help="JSON loka options (default: Inductor)")
    p.add_argument("--mods", default="", help="Inductor after these loka Dynamo-graph Mods (comma-separated)")
    p.add_argument("--code-dir", default=None)
    p.add_argument("--out", default=None, help="JSON of every kernel and the summaries")
    p.add_argument("--table", nargs="*", default=None, help="print the markdown of these JSON files and stop")
    args = p.parse_args(argv)
    if args.table:
        print(markdown([r for f in args.table for r in json.loads(Path(f).read_text())], args.scale_batch))
        return None
    import loka_compile  # noqa: F401  (registers the backend)

    wanted = args.models.split(",")
    results = []
    for name in MODELS:
        if name.split(".")[-1] not in wanted:
            continue
        result = study(name, args.batch, args.loka, Path(args.code_dir) if args.code_dir else None,
                       tuple(m for m in args.mods.split(",") if m))
        result["summary"] = summarize(result, args.scale_batch)
        results.append(result)
        s = result["summary"]
        print(f"{name} [{result['config']}] codegen {result['codegen_s']} s: kernels' [B, *] traffic "
              f"{s['total_mb']:.0f} MB, copies {s['excess_mb']:.0f} MB ({s['excess_us_at_3tbs']:.0f} us at 3 TB/s) "
              f"at batch {args.scale_batch}", flush=True)
        for g in grouped_kernels(result, args.scale_batch):
            print(f"  {g['pass_']:8s} {g['kind']:9s} x{g['launches']:<4d} {g['mb']:8.1f} MB  {g['kernel'][:90]}")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
