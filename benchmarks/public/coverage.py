"""GEMM coverage audit of the public-model suite: for each model and mode (training, inference),
how many GEMM FLOPs the graphs Inductor compiles hold, how many of them loka made sites of
(and put in FP8), which GEMM ops it left unseen, and the graph breaks, crashes and
fallbacks on the way.

    python -m benchmarks.public.coverage --preset tiny --out /tmp/coverage          # every model
    python -m benchmarks.public.coverage --models torch_rechub.BST --modes train

Per (model, mode), three compiles of a fresh copy of the model, each run for one step
(training: forward, loss and backward of `run.TrainUnit`; inference: `run.InferUnit` under
no_grad in eval mode), under bf16 autocast as the public runner runs them (`--fp32`: none):
- eager, under torch's FlopCounterMode: `eager_flops`, the GEMM FLOPs the model computes
  (mm, addmm, bmm, baddbmm, convolution and attention kernels, by op);
- Inductor (`backend="inductor"`), with a post-grad pass that counts the GEMM ops of every
  graph it compiles (`gemm_ops`): `inductor_flops` by op and graph kind, the GEMMs Inductor
  sees after AOTAutograd's decompositions (a matmul or einsum arrives as mm/bmm; a product
  Inductor decomposes into a pointwise multiply and a sum is no GEMM there);
- loka (`backend="loka"`, {"probe_steps": 0}: its FP8 variant from the first call):
  `loka_flops`, the FLOPs of its sites (loka_compile.report; sites of concrete shape,
  `symbolic_sites` the others), `fp8_flops` of those in FP8, and `unseen` by op: the GEMM
  ops left in loka's rewritten graphs that are not sites (a convolution, an attention
  kernel, a matrix-vector product), with their FLOPs (`loka_coverage`).
`seen_share` = loka_flops / (loka_flops + unseen FLOPs), `fp8_share` = fp8_flops / the
same; `loka_x_inductor` = loka's graphs' GEMM FLOPs / Inductor's (below 1 where sites are
symbolic or a Mod computes a repeated GEMM once, as FiBiNET's repeated field Linears). Graph
breaks are Dynamo's under each backend (`loka_extra_breaks`: those loka adds), `fallbacks`
the graphs loka ran in high precision with why, and a crash of any compile is the row's
`error` (the audit goes on).

Output: a table on stdout, `<out>/coverage_<preset>.json` (or `--name`; rows merged with
those already there) and its markdown twin.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from benchmarks.public.models import MODEL_NAMES, PRESETS, build, clone_model
from benchmarks.public.run import InferUnit, TrainUnit, select_models
from benchmarks.train import _error_text, log

aten = torch.ops.aten

__all__ = ["gemm_flops", "graph_gemm_flops", "GemmCounter", "loka_coverage", "audit", "main"]


def _matvec(a, b, *args, **kwargs) -> int:
    return 2 * a[0] * a[1]


def _addmv(bias, a, b, *args, **kwargs) -> int:
    return 2 * a[0] * a[1]


def _dot(a, b, *args, **kwargs) -> int:
    return 2 * a[0]


def _cpu_flash_attention(q, k, v, *args, **kwargs) -> int:
    """Forward of a CPU flash attention, [B, H, L, E] operands: Q K^T and P V."""
    b, h, lq, e = q
    return 2 * b * h * lq * k[-2] * (e + v[-1])


def _cpu_flash_attention_backward(grad_out, q, k, v, *args, **kwargs) -> int:
    return 2 * _cpu_flash_attention(q, k, v)  # dQ, dK, dV and dP: twice the forward's GEMMs


_SHAPE_FLOPS = {
    aten.mv: _matvec, aten.addmv: _addmv, aten.dot: _dot, aten.vdot: _dot,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward,
}


def _flop_formula(target):
    """torch's FLOP formula of a GEMM-like op (torch.utils.flop_counter), else one of the
    few it lacks (matrix-vector, dot, CPU flash attention); None for any other op."""
    from torch.utils.flop_counter import flop_registry
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return None
    if packet in flop_registry:
        return flop_registry[packet]
    formula = _SHAPE_FLOPS.get(packet)
    if formula is None:
        return None

    def on_shapes(*args, out_val=None, **kwargs):
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        return formula(*shapes)
    return on_shapes


def _concrete(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError, RuntimeError):  # a symbolic count
        return None


def gemm_flops(node: torch.fx.Node) -> Optional[int]:
    """FLOPs of a GEMM-like node of an ATen graph (from its inputs' and output's meta
    values), 0 for a node that is no GEMM, None where a dim is symbolic."""
    if node.op != "call_function":
        return 0
    formula = _flop_formula(node.target)
    if formula is None:
        return 0

    def val(x):
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x
    args = torch.utils._pytree.tree_map(val, node.args)
    kwargs = torch.utils._pytree.tree_map(val, node.kwargs)
    try:
        return _concrete(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these values: not counted
        return None


def op_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", node.target)
    return getattr(packet, "__name__", str(packet))


def graph_gemm_flops(graph: torch.fx.Graph, skip: frozenset = frozenset()) -> collections.Counter:
    """FLOPs of the GEMM-like ops of `graph` by op name (ops named in `skip` left out; a
    symbolic count is counted as 0 under "<op> (symbolic)")."""
    out = collections.Counter()
    for node in graph.nodes:
        flops = gemm_flops(node)
        if flops is None:
            out[f"{op_name(node)} (symbolic)"] += 0
        elif flops and op_name(node) not in skip:
            out[op_name(node)] += flops
    return out


class GemmCounter:
    """An Inductor post-grad pass (`post_grad_custom_post_pass`) that changes nothing and
    adds each graph's GEMM FLOPs, by graph kind and op, to `flops`."""

    def __init__(self):
        self.flops: dict = collections.defaultdict(collections.Counter)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from loka_compile.passes.find_sites import graph_kind
        self.flops[graph_kind(graph).value].update(graph_gemm_flops(graph))

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.flops.values())


def _graph_breaks() -> dict:
    from torch._dynamo.utils import counters
    reasons = collections.Counter()
    for reason, n in counters["graph_break"].items():
        reasons[reason.splitlines()[0].strip()[:160]] += n
    return dict(reasons)


def _unit(bench, mode: str, amp: bool):
    model = clone_model(bench.model)
    if mode == "infer":
        model.eval()
    return model, (TrainUnit if mode == "train" else InferUnit)(bench, model, amp)


def _one_step(fn, mode: str, inputs, labels) -> None:
    if mode == "train":
        loss, _ = fn(inputs, labels)
        loss.backward()
    else:
        with torch.no_grad():
            fn(inputs)


def _eager_flops(bench, mode: str, amp: bool, inputs, labels) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    _, unit = _unit(bench, mode, amp)
    with FlopCounterMode(display=False) as counter:
        _one_step(unit, mode, inputs, labels)
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items() if n}


def _inductor_flops(bench, mode: str, amp: bool, inputs, labels) -> tuple:
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    counter = GemmCounter()
    _, unit = _unit(bench, mode, amp)
    # No FX graph cache: a cache hit would skip the counting pass.
    fn = torch.compile(unit, backend="inductor", options={"post_grad_custom_post_pass": counter,
                                                            "fx_graph_cache": False})
    with _no_autograd_cache():
        _one_step(fn, mode, inputs, labels)
    return {kind: dict(c) for kind, c in counter.flops.items()}, _graph_breaks()


@contextlib.contextmanager
def _no_autograd_cache():
    import torch._functorch.config as functorch_config
    with functorch_config.patch(enable_autograd_cache=False):
        yield


LOWERED_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})  # what find_sites records, lowered or not


def loka_coverage(report) -> dict:
    """What a loka report covers: its sites' FLOPs by op and role (sites of concrete shape;
    `symbolic_sites` counts the others), those in FP8, the GEMM ops left in its rewritten
    graphs that are no site (`unseen`, by op), and `seen_share` = site FLOPs / (site +
    unseen FLOPs), `fp8_share` = FP8 FLOPs / the same."""
    from loka_compile.report import _flops
    by_role, fp8, symbolic = collections.Counter(), 0, 0
    for s in report.sites:
        flops = _flops(s)
        if flops is None:
            symbolic += 1
            continue
        by_role[f"{s.op}:{s.role}"] += flops
        fp8 += flops if s.fp8 else 0
    unseen = collections.Counter()
    for gm in report.graph_modules.values():
        unseen.update(graph_gemm_flops(gm.graph, skip=LOWERED_OPS))
    seen = sum(by_role.values())
    total = seen + sum(unseen.values())
    return {"loka_flops_by_op_role": dict(by_role), "loka_flops": seen, "fp8_flops": fp8,
            "unseen": dict(unseen), "unseen_flops": sum(unseen.values()), "symbolic_sites": symbolic,
            "seen_share": seen / total if total else None, "fp8_share": fp8 / total if total else None}


def _loka_flops(bench, mode: str, amp: bool, inputs, labels) -> dict:
    """One step under loka: `loka_coverage` of its report, site counts, graph breaks and
    fallbacks."""
    import loka_compile
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    loka_compile.reset()
    counters.clear()
    _, unit = _unit(bench, mode, amp)
    fn = torch.compile(unit, backend="loka", options={"probe_steps": 0})
    _one_step(fn, mode, inputs, labels)
    report = loka_compile.report(fn)
    return {**loka_coverage(report), "sites": len(report.sites), "fp8_sites": sum(s.fp8 for s in report.sites),
            "fallbacks": [f"{g.name}: {g.fallback}" for g in report.graphs if g.fallback],
            "loka_graphs": len(report.graphs), "loka_breaks": _graph_breaks()}


def audit(name: str, mode: str, preset: str = "tiny", amp: bool = True, batch: Optional[int] = None,
          seed: int = 0) -> dict:
    """The coverage row of one model in one mode (see the module docstring)."""
    start = time.perf_counter()
    row = {"model": name, "mode": mode, "preset": preset, "amp": amp, "error": None, "traceback": None}
    try:
        bench = build(name, preset, seed=seed)
        inputs, labels = bench.batch(0, batch)
        row["batch"] = batch or bench.preset.batch
        row["eager_flops_by_op"] = _eager_flops(bench, mode, amp, inputs, labels)
        row["eager_flops"] = sum(row["eager_flops_by_op"].values())
        row["inductor_flops_by_kind"], row["inductor_breaks"] = _inductor_flops(bench, mode, amp, inputs, labels)
        row["inductor_flops"] = sum(sum(c.values()) for c in row["inductor_flops_by_kind"].values())
        row.update(_loka_flops(bench, mode, amp, inputs, labels))
        total = row["inductor_flops"]
        # Below 1: GEMMs loka's graphs do not hold (symbolic sites, Mods that compute a repeated GEMM once)
        row["loka_x_inductor"] = (row["loka_flops"] + row["unseen_flops"]) / total if total else None
        extra = collections.Counter(row["loka_breaks"])
        extra.subtract(row["inductor_breaks"])
        row["loka_extra_breaks"] = {k: n for k, n in extra.items() if n > 0}
    except Exception as e:  # noqa: BLE001 - a crash is what the audit reports
        row["error"] = _error_text(e)
        row["traceback"] = traceback.format_exc(limit=-12)
    row["wall_s"] = round(time.perf_counter() - start, 1)
    return row


def _mflops(n) -> str:
    return "" if n is None else f"{n / 1e6:.3g}"


def _share(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def format_table(rows: list, fmt: str = "github") -> str:
    from tabulate import tabulate
    table = []
    for r in rows:
        unseen = ", ".join(f"{op} {_mflops(n)}" for op, n in sorted(r.get("unseen", {}).items(), key=lambda x: -x[1]))
        breaks = sum(r.get("loka_breaks", {}).values()) if "loka_breaks" in r else None
        notes = "; ".join(filter(None, [r.get("error"), *r.get("fallbacks", []),
                                        *(f"loka adds break: {k}" for k in r.get("loka_extra_breaks", {}))]))
        table.append([r["model"], r["mode"], _mflops(r.get("eager_flops")), _mflops(r.get("inductor_flops")),
                      _mflops(r.get("loka_flops")), _share(r.get("loka_x_inductor")), _share(r.get("seen_share")),
                      _share(r.get("fp8_share")),
                      f"{r.get('fp8_sites', '')}/{r.get('sites', '')}" if "sites" in r else "",
                      r.get("symbolic_sites", ""), unseen, "" if breaks is None else breaks, notes[:160]])
    return tabulate(table, headers=["model", "mode", "eager MFLOP", "Inductor MFLOP", "loka sites MFLOP",
                                    "loka graphs / Inductor", "seen", "FP8", "FP8/sites", "symbolic sites",
                                    "unseen GEMMs (MFLOP)", "breaks", "errors, fallbacks"], tablefmt=fmt)


def write(path: Path, rows: list, env: dict) -> None:
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    keys = {(r["model"], r["mode"]) for r in rows}
    merged = [r for r in old if (r["model"], r["mode"]) not in keys] + rows
    merged.sort(key=lambda r: (MODEL_NAMES.index(r["model"]) if r["model"] in MODEL_NAMES else 10**6, r["mode"]))
    path.write_text(json.dumps({"env": env, "rows": merged}, indent=1, default=str))
    path.with_suffix(".md").write_text(
        f"# GEMM coverage of the public suite, preset {env['preset']}\n\n{env['date']}, torch {env['torch']}, "
        f"{'bf16 autocast' if env['amp'] else 'fp32'}; MFLOP of one step at batch {env['batch']}: eager "
        f"(FlopCounterMode), "
        f"in the graphs Inductor compiles, in loka's sites; seen and FP8: shares of the GEMM FLOPs in loka's graphs "
        f"(sites + unseen GEMM ops).{' ' + env['note'] if env.get('note') else ''}\n\n"
        + format_table(merged) + "\n")


def main(argv=None) -> list:
    import datetime as _dt
    p = argparse.ArgumentParser(prog="python -m benchmarks.public.coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--models", default="all", help="'all' or a comma list of models, families, libraries")
    p.add_argument("--modes", default="train,infer")
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--out", default=None, help="directory of the JSON and markdown")
    p.add_argument("--name", default=None, help="file stem instead of coverage_<preset>")
    args = p.parse_args(argv)
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = []
    env = {"preset": args.preset, "amp": not args.fp32, "batch": args.batch or PRESETS[args.preset].batch,
           "torch": torch.__version__, "date": _dt.date.today().isoformat(), "argv": sys.argv[1:]}
    for name in select_models(args.models):
        for mode in modes:
            row = audit(name, mode, args.preset, amp=not args.fp32, batch=args.batch)
            log(f"{name}/{mode}: seen {_share(row.get('seen_share'))}, FP8 {_share(row.get('fp8_share'))}, "
                f"unseen {row.get('unseen')}, {row['wall_s']} s" + (f", ERROR {row['error']}" if row["error"] else ""))
            rows.append(row)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                write(Path(args.out) / f"{args.name or 'coverage_' + args.preset}.json", rows, env)
    print(format_table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
