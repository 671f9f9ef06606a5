"""Reports: site by site, what loka chose and why; and the rewritten graphs."""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch
from tabulate import tabulate

from loka_compile import backend, probe
from loka_compile.passes import GraphKind, Reason


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    name: str
    module: str
    role: str
    shape: tuple            # (M, K, N); symbolic dims are strings such as "s0"
    fp8: bool
    provider: str
    reason: str
    graph: str
    kind: str               # forward | backward | inference
    op: str
    batch: object           # bmm batch size or None
    dtype: str
    scaling: str
    formats: str            # "e4m3 x e4m3", or "" when not FP8
    producers: tuple
    consumers: tuple
    forward_site: str       # for backward sites: the forward site of the same op
    key: str
    probe: dict             # Probe summary, empty when the site was not observed
    bf16_us: Optional[float] = None   # speed check: high-precision GEMM time at this shape
    fp8_us: Optional[float] = None    # speed check: fp8_gemm time, casts included
    detail: str = ""                  # the reason's particulars ("K=100", the timings, ...)


@dataclasses.dataclass(frozen=True)
class GraphReport:
    name: str
    phase: str
    fallback: Optional[str]
    graph_modules: dict     # kind -> the rewritten post-grad GraphModule of the active phase
    config: object


_KIND_ORDER = {GraphKind.FORWARD: 0, GraphKind.INFERENCE: 0, GraphKind.BACKWARD: 1}


def _site_records(record) -> list:
    contexts = {kind: ctx for (phase, kind), ctx in record.contexts.items() if phase == record.phase}
    forward_names = {}
    for kind in (GraphKind.FORWARD, GraphKind.INFERENCE):
        if kind in contexts:
            forward_names.update({s.seq_nr: s.name for s in contexts[kind].sites if s.seq_nr is not None})
    rows = []
    for kind in sorted(contexts, key=_KIND_ORDER.get):
        ctx = contexts[kind]
        for site in ctx.sites:
            decision = ctx.decisions.get(site.key)
            fp8, reason = decision.fp8, decision.reason
            if fp8 and site.key in record.unsafe:  # vetoed by the Probe after compilation
                fp8, reason = False, Reason.PROBE_UNSAFE
            if record.fallback:
                fp8, reason = False, Reason.GRAPH_FALLBACK
            rows.append(SiteRecord(
                name=site.name, module=site.module, role=site.role.value, shape=site.shape, fp8=fp8,
                provider=decision.provider if fp8 else "aten", reason=reason.value, graph=record.name,
                kind=kind.value, op=site.op, batch=site.batch, dtype=str(site.dtype).replace("torch.", ""),
                scaling=decision.scaling if fp8 else "", formats=f"{decision.a_format} x {decision.b_format}" if fp8 else "",
                producers=site.producers, consumers=site.consumers,
                forward_site=forward_names.get(site.seq_nr, "") if kind is GraphKind.BACKWARD else "",
                key=site.key, probe=probe.STORE.summary(site.key),
                bf16_us=decision.bf16_us, fp8_us=decision.fp8_us, detail=decision.detail))
    return rows


class Report:
    """`report.sites`: one SiteRecord per GEMM site of every matching graph;
    `report.graphs`: per Dynamo graph, its phase, fallback and rewritten GraphModules;
    `str(report)`: a table of the sites."""

    def __init__(self, records):
        self.graphs = [GraphReport(r.name, r.phase, r.fallback,
                                   {kind.value: gm for (phase, kind), gm in r.graph_modules.items() if phase == r.phase},
                                   r.config) for r in records]
        self.sites = [row for r in records for row in _site_records(r)]

    @property
    def graph_modules(self) -> dict:
        """"g0/forward" -> rewritten GraphModule, for print_readable()."""
        return {f"{g.name}/{kind}": gm for g in self.graphs for kind, gm in g.graph_modules.items()}

    def summary(self) -> str:
        fp8 = sum(s.fp8 for s in self.sites)
        fallbacks = [f"{g.name}: {g.fallback}" for g in self.graphs if g.fallback]
        line = f"{len(self.sites)} GEMM sites in {len(self.graphs)} graph(s), {fp8} in FP8"
        return line + ("; fallbacks: " + "; ".join(fallbacks) if fallbacks else "")

    def table(self) -> str:
        rows = [(s.graph, s.name, s.role, "x".join(map(str, s.shape)) + (f" (b={s.batch})" if s.batch else ""),
                 "yes" if s.fp8 else "no", s.provider, s.formats, s.reason,
                 f"{s.probe['max_rel_error']:.3g}" if s.probe else "",
                 f"{s.bf16_us / s.fp8_us:.2f}x" if s.fp8_us else "")
                for s in self.sites]
        return tabulate(rows, headers=["graph", "site", "role", "M x K x N", "fp8", "provider", "formats",
                                       "reason", "probe err", "fp8 speedup"])

    def __str__(self) -> str:
        return self.table() + "\n" + self.summary()

    def __repr__(self) -> str:
        return f"<loka Report: {self.summary()}>"


def report(compiled: Optional[object] = None) -> Report:
    """The report for a compiled model: every loka graph that reads one of its parameters.
    Dynamo may serve a second instance of a class with the graphs compiled for the first;
    a model none of whose parameters any graph has seen gets the graphs whose parameter
    shapes it has. With a function, or no argument: every graph loka compiled here."""
    records = list(backend.GRAPHS)
    if isinstance(compiled, torch.nn.Module):
        module = getattr(compiled, "_orig_mod", compiled)
        params = list(module.parameters())
        own = [r for r in records if any(r.reads(p) for p in params)]
        shapes = collections.Counter(tuple(p.shape) for p in params)
        records = own or [r for r in records if r.param_shapes
                          and not collections.Counter(r.param_shapes) - shapes]
    return Report(records)
