"""Reports: site by site, what loka chose and why; and the rewritten graphs."""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch
from tabulate import tabulate

from loka_compile import probe
from loka_compile.comm import gradient_comm_of
from loka_compile.plan import Plan, SitePlan, id_parts, param_fingerprint, upgrade_target
from loka_compile.passes import GraphKind, Phase, Reason
from loka_compile.passes import mods as mod_registry
from loka_compile.state import state_of


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
    fp8_us: Optional[float] = None    # speed check: the FP8 form's time, casts included
    detail: str = ""                  # the reason's particulars ("K=100", the timings, ...)
    # FP8 sites: "a"/"b" -> how it is cast; a high-precision site: only an operand it reads as
    # the dequantized FP8 copy the forward saved (the saved_fp8 Mod)
    casts: dict = dataclasses.field(default_factory=dict)
    fast_accum: bool = False          # FP8 sites: the GEMM accumulates in the fast mode
    padding: tuple = (0, 0)           # FP8 sites: zeros appended to K and N (the pad Mod)
    id: str = ""                      # stable site id, "<kind>/<module>:<role>#<n>": the plan's key
    # Probe verdict per FP8 candidate: name -> {"metric", "bound", "mean", "n", "within"}
    verdicts: dict = dataclasses.field(default_factory=dict)
    # Re-checks' verdict changes (`recheck_every`), oldest first: {"step", "from", "to", "change", ...}
    history: tuple = ()
    # Speed check per provider: name -> {"gemm_us" (None: could not run), "chosen", "lost"}
    candidates: dict = dataclasses.field(default_factory=dict)
    m_bucket: Optional[int] = None    # symbolic M: the M the speed check timed the site at
    # Output budget (`max_output_error`): the relative change of the graph's outputs per unit of
    # relative noise at this GEMM's output (forward sites; None when not measured)
    sensitivity: Optional[float] = None
    # Changes to the decision after Dispatch made it (`passes.Amendment`: by, why, fields), in order
    amendments: tuple = ()


@dataclasses.dataclass(frozen=True)
class GraphReport:
    name: str
    phase: Phase
    fallback: Optional[str]
    graph_modules: dict     # kind -> the rewritten post-grad GraphModule of the active phase
    config: object
    # What the output budget measured and kept (`output_budget.OutputBudget`: sensitivities,
    # errors, kept sites, predicted and measured output discrepancy), None when it did not act
    output_budget: Optional[object] = None
    output_budget_skipped: str = ""  # why the budget, on, did not act on this graph
    # What the graph speed check predicted, timed and kept (`graph_speed.GraphSpeed`), None when off
    graph_speed: Optional[object] = None

    @property
    def predicted_output_error(self) -> Optional[float]:
        """The output discrepancy the budget predicted for the FP8 variant as compiled."""
        budget = self.output_budget
        if budget is None:
            return None
        return budget.predicted_after if budget.predicted_after is not None else budget.predicted

    @property
    def measured_output_error(self) -> Optional[float]:
        """The FP8 variant's output discrepancy from high precision, measured at the window's close."""
        return None if self.output_budget is None else self.output_budget.measured


_KIND_ORDER = {GraphKind.FORWARD: 0, GraphKind.INFERENCE: 0, GraphKind.BACKWARD: 1}


def _verdicts(summary: dict, config) -> dict:
    """Each observed candidate's bound in the graph's probe metric, and whether it is within budget."""
    metric = getattr(config, "probe_metric", "row_rel_error")
    field = probe.METRICS[metric]
    return {name: {"metric": metric, "bound": c[field]["bound"], "mean": c[field]["mean"], "n": c["n"],
                   "within": c[field]["bound"] <= config.max_probe_error}
            for name, c in summary.get("candidates", {}).items()}


def _candidates(decision, fp8: bool) -> dict:
    """Each timed provider's GEMM time, the one chosen, and why the others lost (Dispatch's
    candidates; a graph that fell back runs none of them)."""
    return {c.provider: {"gemm_us": c.gemm_us, "chosen": c.chosen and fp8,
                         "lost": c.lost or ("" if fp8 else "the site stays in high precision")}
            for c in decision.candidates}


def _site_records(record) -> list:
    contexts = record.contexts_of()
    forward_names = {}
    for kind in (GraphKind.FORWARD, GraphKind.INFERENCE):
        if kind in contexts:
            forward_names.update({s.seq_nr: s.name for s in contexts[kind].sites if s.seq_nr is not None})
    budget = getattr(record, "output_budget", None)
    sensitivity = budget.sensitivity if budget is not None else {}
    rows = []
    for kind in sorted(contexts, key=_KIND_ORDER.get):
        ctx = contexts[kind]
        for site in ctx.sites:
            decision = ctx.decisions.get(site.id)  # a fallback amended it (`fallback.fall_back_sites`)
            fp8 = decision.fp8
            fell_back = record.fallback or record.fallen_back.get(kind)
            rows.append(SiteRecord(
                name=site.name, module=site.module, role=site.role.value, shape=site.shape, fp8=fp8,
                provider=decision.provider if fp8 else "aten", reason=decision.reason.value, graph=record.name,
                kind=kind.value, op=site.op, batch=site.batch, dtype=str(site.dtype).replace("torch.", ""),
                scaling=decision.scaling if fp8 else "", formats=f"{decision.a_format} x {decision.b_format}" if fp8 else "",
                producers=site.producers, consumers=site.consumers,
                forward_site=forward_names.get(site.seq_nr, "") if kind is GraphKind.BACKWARD else "",
                key=site.key, probe=(summary := record.store.summary(site.key)),
                history=tuple(record.plan.history.get(site.id, ())),
                verdicts=_verdicts(summary, record.config), candidates=_candidates(decision, fp8),
                bf16_us=decision.bf16_us, fp8_us=decision.fp8_us, detail=decision.detail,
                casts=dict(ctx.casts.get(site.id, {})) if not fell_back else {}, fast_accum=fp8 and decision.fast_accum,
                padding=(decision.pad_k, decision.pad_n) if fp8 else (0, 0), id=site.id,
                m_bucket=decision.m_bucket, sensitivity=sensitivity.get(site.id),
                amendments=record.amendments_of(site.id)))
    return rows


def _flops(site: SiteRecord) -> Optional[int]:
    """2 M K N (times the batch of a bmm), or None when a dim is symbolic."""
    dims = (*site.shape, site.batch if site.batch is not None else 1)
    if not all(isinstance(d, int) for d in dims):
        return None
    m, k, n, batch = dims
    return 2 * m * k * n * batch



def _budget_changes(budget) -> str:
    """What the output budget changed besides keeping sites: those a finer scaling made safe,
    and whether the sites it kept are only the model's last GEMMs (its prediction heads)."""
    text = ""
    if budget.made_safe:
        text += f"; {len(budget.made_safe)} made safe by a finer scaling: " + ", ".join(
            f"{sid} ({budget.upgraded[sid][0]})" for sid in budget.made_safe)
    if budget.kept and set(budget.kept) <= set(budget.last_gemms):
        text += "; only the model's last GEMM (its prediction head) kept: " + ", ".join(budget.kept)
    return text

class Report:
    """`report.sites`: one SiteRecord per GEMM site of every matching graph;
    `report.graphs`: per Dynamo graph, its phase, fallback and rewritten GraphModules;
    `str(report)`: the overview (summary, FP8 per role and FLOP share, why the rest stays
    in high precision); `report.table()`: every site. `report.communication`: the model's FP8
    gradient communication (`comm.GradientComm`: each bucket's decision), when it has one."""

    def __init__(self, records, communication=None):
        self.communication = communication
        self.graphs = [GraphReport(r.name, r.phase, r.fallback or "; ".join(r.fallen_back.values()) or None,
                                   {kind.value: gm for (phase, kind), gm in r.graph_modules.items() if phase is r.phase},
                                   r.config, getattr(r, "output_budget", None),
                                   getattr(r, "output_budget_skipped", ""), getattr(r, "graph_speed", None))
                       for r in records]
        self.sites = [row for r in records for row in _site_records(r)]
        results = collections.defaultdict(list)
        for r in records:
            for name, result in r.mod_results.items():
                results[name].append(result)
        self._mod_results = {name: tuple(found) for name, found in results.items()}
        self.cached_weights = [w for r in records for kind, ctx in r.contexts_of().items()
                                if not (r.fallback or r.fallen_back.get(kind))
                                for w in ctx.cached_weights]

    @property
    def mod_results(self) -> dict:
        """Mod name -> what it returned on each graph where it ran, in compile order."""
        return dict(self._mod_results)

    @property
    def cached_weight_bytes(self) -> tuple:
        """(bytes of the FP8 weight copies that inference GEMMs read, bytes the same
        operands take in bf16). The bf16 parameters stay with the model."""
        return sum(w.nbytes for w in self.cached_weights), sum(w.bf16_nbytes for w in self.cached_weights)

    @property
    def mods(self) -> dict:
        """What each Mod did, by the counters it declares (`loka_compile.passes.mods`, stage by
        stage; docs/mods/ says what each counts), and the FP8 sites whose GEMMs accumulate in
        the fast mode (`fast_accum`: the recipe's choice, not a Mod's)."""
        counts = mod_registry.counts(mod_registry.Evidence(tuple(self.sites), self._mod_results))
        counts["fast_accum"] = sum(s.fast_accum for s in self.sites)
        return counts

    @property
    def graph_modules(self) -> dict:
        """"g0/forward" -> rewritten GraphModule, for print_readable()."""
        return {f"{g.name}/{kind}": gm for g in self.graphs for kind, gm in g.graph_modules.items()}

    def _flops(self) -> dict:
        return {id(s): _flops(s) for s in self.sites}

    def _headline(self) -> str:
        flops = self._flops()
        known = [s for s in self.sites if flops[id(s)] is not None]
        total = sum(flops[id(s)] for s in known)
        share = sum(flops[id(s)] for s in known if s.fp8) / total if total else 0.0
        fp8 = sum(s.fp8 for s in self.sites)
        fallbacks = [f"{g.name}: {g.fallback}" for g in self.graphs if g.fallback]
        line = (f"{len(self.sites)} GEMM sites in {len(self.graphs)} graph(s), {fp8} in FP8 "
                f"({100 * share:.0f}% of GEMM FLOPs, sites of concrete shape)")
        mods = ", ".join(f"{name} {n}" for name, n in self.mods.items() if n)
        line += f"; Mods: {mods}" if mods else ""
        return line + ("; fallbacks: " + "; ".join(fallbacks) if fallbacks else "")

    def _kept_lines(self, largest: int) -> list:
        """Counts by reason, and the largest sites left in high precision with theirs."""
        kept = collections.Counter(s.reason for s in self.sites if not s.fp8)
        if not kept:
            return []
        lines = ["kept in high precision: " + ", ".join(f"{r} {n}" for r, n in kept.most_common())]
        flops = self._flops()
        biggest = sorted((s for s in self.sites if not s.fp8 and flops[id(s)]), key=lambda s: -flops[id(s)])[:largest]
        if biggest:
            lines.append(f"largest sites left in high precision ({len(biggest)} of "
                         f"{sum(not s.fp8 for s in self.sites)}):")
            lines += [f"  {s.graph} {s.id or s.name} {'x'.join(map(str, s.shape))} "
                      f"({flops[id(s)] / 1e6:.3g} MFLOP): {s.reason}" + (f" ({s.detail})" if s.detail else "")
                      for s in biggest]
        return lines

    def summary(self, largest: int = 5) -> str:
        """What to read first: sites and GEMM FLOPs in FP8 (and Mods, fallbacks), counts by
        reason, the largest sites left in high precision with their reasons, and the
        output budget's predicted and measured output discrepancy per graph, and the
        re-checks' verdict changes."""
        return "\n".join([self._headline(), *self._kept_lines(largest), *self._amendment_lines(largest),
                          *self._budget_lines(), *self._graph_speed_lines(), *self._history_lines()])

    def _graph_speed_lines(self) -> list:
        """One line per graph with an FP8 site that the graph speed check (`graph_speed_check`)
        saw: the gain the site timings predicted, and each variant's measured step and the one
        kept, or why it was not timed."""
        lines = []
        for g in self.graphs:
            speed = g.graph_speed
            if speed is None or not speed.sites:
                continue
            if speed.timed:
                amended = sum(1 for s in self.sites if s.graph == g.name and s.reason == "graph_slower_than_bf16")
                kept = f"kept {speed.kept}" + (f", {amended} site(s) amended" if speed.kept != "fp8" else "")
                lines.append(f"graph speed {g.name}: {speed.describe_prediction()}; {speed.describe_times()}; {kept}")
            else:
                lines.append(f"graph speed {g.name}: {speed.describe_prediction()}; not timed ({speed.skipped})")
        return lines

    def _amendment_lines(self, largest: int) -> list:
        """Counts of the decisions changed after Dispatch made them, by who changed them, and
        the first `largest` amended sites with each change."""
        amended = [s for s in self.sites if s.amendments]
        if not amended:
            return []
        by = collections.Counter(a.by for s in amended for a in s.amendments)
        lines = ["decisions amended after Dispatch: " + ", ".join(f"{name} {n}" for name, n in by.most_common())]
        lines += [f"  {s.graph} {s.id}: " + "; ".join(a.describe() for a in s.amendments) for s in amended[:largest]]
        return lines

    def _budget_lines(self) -> list:
        """One line per graph where the output budget (`max_output_error`) acted: its noise
        floor, the budget, the predicted and measured output discrepancy, the predicted NE
        increase of each binary head; and one per graph where it was on and did not act."""
        lines = []
        for g in self.graphs:
            b = g.output_budget
            if b is None:
                if g.output_budget_skipped:
                    lines.append(f"output budget {g.name}: not applied ({g.output_budget_skipped})")
                continue
            floor = ""
            if b.floor is not None:
                measured_floor = f"measured {b.floor.measured:.3g}" if b.floor.measured is not None else \
                    f"not measured: {b.floor.why_unmeasured}"
                floor = f"noise floor {b.floor.value:.3g} (predicted {b.floor.predicted:.3g}, {measured_floor}); "
            measured = f", measured {b.measured:.3g}" if b.measured is not None else \
                (f", not measured ({b.why_unmeasured})" if b.why_unmeasured else "")
            judged = {"all": "", "none": " (not judged: every output is a binary head)"}.get(
                b.judged_outputs, f" over the outputs {b.judged_outputs}")
            finite = f", on the {b.finite_fraction:.1%} finite output elements" if b.finite_fraction < 1 else ""
            waited = f", computed after waiting {b.deferred_calls} call(s) for a finite output" if b.deferred_calls \
                else ""
            lines.append(f"output budget {g.name}: {floor}budget {b.describe_budget()}; predicted output discrepancy"
                         f"{judged} {b.predicted_before:.3g} with every safe forward site in FP8, "
                         f"{g.predicted_output_error:.3g} as compiled{measured}{finite}{waited}; {len(b.kept)} of "
                         f"{len(b.sensitivity)} forward site(s) kept in high precision{_budget_changes(b)}")
            for head in b.heads:
                after = b.ne_after.get(head.name, b.ne_predicted.get(head.name, 0.0))
                absolute = head.ne_increase(after)
                absolute = f" ({absolute:.3g} in NE units)" if absolute is not None else ""
                lines.append(f"  binary head {head.name}: predicted relative NE increase {after:.3g}{absolute} as "
                             f"compiled, {b.ne_before.get(head.name, 0.0):.3g} with every safe forward site in FP8 "
                             f"(max_ne_increase {b.ne_budget:g})")
        return lines

    def _history_lines(self) -> list:
        """One line per site a re-check (`recheck_every`) or the amax guard moved: each
        change with its call (the guard's with why)."""
        def change(event):
            by = f" by the amax guard ({event['detail']})" if event.get("by") == "amax_guard" else ""
            return f"{event['change']} {event['from']} -> {event['to']} at call {event['step']}{by}"
        return [f"re-checked {s.graph} {s.id}: " + ", ".join(map(change, s.history)) for s in self.sites if s.history]

    def table(self) -> str:
        rows = [(s.graph, s.id, s.role, "x".join(map(str, s.shape)) + (f" (b={s.batch})" if s.batch else "")
                 + (f" (timed M={s.m_bucket})" if s.m_bucket else ""),
                 "yes" if s.fp8 else "no", s.provider, s.formats,
                 " ".join(f"{op}:{c.split(' ')[0]}" for op, c in s.casts.items()), s.reason,
                _probe_cell(s),
                 f"{s.bf16_us / s.fp8_us:.2f}x" if s.fp8_us else "",
                 ", ".join(dict.fromkeys(a.by for a in s.amendments)))
                for s in self.sites]
        return tabulate(rows, headers=["graph", "site id", "role", "M x K x N", "fp8", "provider", "formats",
                                       "casts", "reason", "probe bound (n)", "fp8 speedup", "amended by"])

    def overview(self, largest: int = 5, table_hint: str = "every site: print(report.table())") -> str:
        """The summary, with FP8 sites per role and the FP8 weight copies, ending with `table_hint`
        (how to list every site, in the caller's terms)."""
        roles = collections.OrderedDict()
        for s in self.sites:
            fp8_all = roles.setdefault(s.role, [0, 0])
            fp8_all[0] += s.fp8
            fp8_all[1] += 1
        lines = [f"loka: {self._headline()}",
                 "FP8 per role: " + ", ".join(f"{role} {n}/{all_}" for role, (n, all_) in roles.items())]
        fp8_bytes, bf16_bytes = self.cached_weight_bytes
        if self.cached_weights:
            lines.append(f"weights cached in FP8: {len(self.cached_weights)} operands, {fp8_bytes / 2**20:.2f} MiB "
                         f"read per call instead of {bf16_bytes / 2**20:.2f} MiB in bf16 "
                         f"(the copies are extra memory: the bf16 parameters stay with the model)")
        lines += self._kept_lines(largest)
        lines += self._amendment_lines(largest)
        lines += self._budget_lines()
        lines += self._graph_speed_lines()
        lines += self._history_lines()
        if self.communication is not None:
            lines.append(str(self.communication).split("\n")[0])  # its table: print(report.communication)
        if table_hint:
            lines.append(table_hint)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.overview()

    def __repr__(self) -> str:
        return f"<loka Report: {self._headline()}>"


def _probe_cell(site: SiteRecord) -> str:
    """The site's own candidate's bound and count, else the largest observed error."""
    own = site.verdicts.get(site.probe.get("chosen", ""))
    if own:
        return f"{own['bound']:.3g} ({own['n']})"
    if "failed" in site.probe:
        return "failed"
    return f"{site.probe['max_rel_error']:.3g}" if site.probe else ""


def report(compiled) -> Report:
    """The report for a loka-compiled model or function: the graphs of its compile's state
    (`state.state_of`; ValueError for anything else), with its FP8 gradient communication
    where `fp8_gradient_comm` gave it one."""
    return Report(state_of(compiled).records, gradient_comm_of(compiled))


# -- plans: a compiled model's, and a saved one's report ---------------------------------


def plan_of(compiled) -> Plan:
    """The plan of a compiled model (or function): every graph of its compile's state, each
    site's decision in its active phase under the site's id. Raises ValueError for anything
    but a loka-compiled model or function, while a graph is still in its probe window, or
    when it has none."""
    records = state_of(compiled).records
    if not records:
        raise ValueError("loka has compiled no graph for this model: run it once before saving its plan")
    probing = [r.name for r in records if r.phase is Phase.PROBE]
    if probing:
        raise ValueError(f"graphs {probing} are still in their probe window: save the plan after it closes")
    plan = Plan(device_type=records[0].plan.device_type, recipe=records[0].config.recipe)
    module = getattr(compiled, "_orig_mod", compiled)
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module  # Dynamo compiles DDP's inner module: its graphs name the parameters without "module."
    if isinstance(module, torch.nn.Module):
        plan.params = param_fingerprint(module.named_parameters())
    # A recompile (another batch size) has the sites of the graph it recompiles, under the
    # same ids: the later graph, the more general one, wins. Graphs with other site sets
    # (graph breaks) that share an id but not its decision leave it to be decided at load.
    owner, conflicts = {}, set()
    for record in records:
        if not isinstance(module, torch.nn.Module):
            plan.params.update(record.plan.params)
        plan.unsafe.update(record.plan.unsafe)
        plan.upgraded.update(record.plan.upgraded)
        plan.a_scales.update(record.plan.a_scales)
        for sid, events in record.plan.history.items():
            plan.history.setdefault(sid, []).extend(events)
        speed = record.graph_speed
        if speed is not None and speed.timed and record.graph_speed_key and not record.fallback:
            plan.graph_speed[record.graph_speed_key] = speed.stored()
        contexts = record.contexts_of()
        ids = frozenset(s.id for ctx in contexts.values() for s in ctx.sites)
        for kind, ctx in contexts.items():
            if record.fallback or record.fallen_back.get(kind):
                continue
            for site in ctx.sites:
                decision = ctx.decisions.get(site.id)
                if decision is None or decision.reason in (Reason.GRAPH_FALLBACK, Reason.PROBING):
                    continue
                entry = SitePlan.from_decision(decision, site.shape, site.dtype)
                if site.id in plan.sites and owner[site.id] != ids and plan.sites[site.id] != entry:
                    conflicts.add(site.id)
                plan.sites[site.id], owner[site.id] = entry, ids
    for sid in conflicts:
        plan.sites.pop(sid)
    return plan


def save_plan(compiled, path) -> Plan:
    """Write the plan of `compiled` (see `plan_of`) to `path` as JSON; returns it. Load it
    with `torch.compile(model, backend="loka", options={"plan": path})`."""
    return plan_of(compiled).save(path)


def plan_site_records(plan: Plan) -> list:
    """The plan's sites as `report.SiteRecord`s, forward (or inference) sites first, by
    id, for the report's table and summary lines. A plan keeps no graph names, operand
    casts but static scales, or bmm batch sizes; a site the Probe found unsafe shows its
    observed error."""
    records = []
    backward_last = lambda item: (id_parts(item[0])[0] == GraphKind.BACKWARD.value, item[0])  # noqa: E731
    for sid, entry in sorted(plan.sites.items(), key=backward_last):
        kind, module, role = id_parts(sid)
        static = plan.a_scales.get(sid)
        records.append(SiteRecord(
            name=sid, module=module, role=role, shape=entry.shape, fp8=entry.fp8,
            provider=entry.provider if entry.fp8 else "aten", reason=entry.reason, graph="", kind=kind, op="",
            batch=None, dtype=entry.dtype, scaling=entry.scaling if entry.fp8 else "",
            formats=f"{entry.a_format} x {entry.b_format}" if entry.fp8 else "", producers=(), consumers=(),
            forward_site="", key=sid,
            probe={"max_rel_error": plan.unsafe[sid]} if sid in plan.unsafe else {},
            bf16_us=entry.bf16_us, fp8_us=entry.fp8_us, detail=entry.detail,
            casts={"a": f"static scale (calibrated {static['policy']})"} if static and entry.fp8 else {},
            fast_accum=entry.fp8 and entry.fast_accum,
            padding=(entry.pad_k, entry.pad_n) if entry.fp8 else (0, 0), id=sid,
            history=tuple(plan.history.get(sid, ())), candidates=_candidates(entry, entry.fp8),
            m_bucket=entry.m_bucket))
    return records


def plan_report(plan: Plan) -> Report:
    """A `report.Report` whose sites are this plan's (its graph-level parts empty)."""
    report = Report([])
    report.sites = plan_site_records(plan)
    return report


def plan_summary(plan: Plan, largest: int = 5) -> str:
    """What the plan is for, its sites in FP8 (and their share of GEMM FLOPs), the
    Probe's verdicts and static scales it holds, then the report's lines: counts by
    reason, the largest sites left in high precision, re-check history."""
    report = plan_report(plan)
    sites = report.sites
    flops = {s.id: _flops(s) for s in sites}
    total = sum(f for f in flops.values() if f is not None)
    share = sum(flops[s.id] for s in sites if s.fp8 and flops[s.id] is not None) / total if total else 0.0
    roles = {}
    for s in sites:
        roles.setdefault(s.role, [0, 0])
        roles[s.role][0] += s.fp8
        roles[s.role][1] += 1
    lines = [f"loka plan {plan.source or '(in memory)'}: recipe {plan.recipe}, device type {plan.device_type}, "
             f"format version {plan.version}, {len(plan.params)} parameters",
             f"{len(sites)} GEMM sites, {sum(s.fp8 for s in sites)} in FP8 ({100 * share:.0f}% of GEMM FLOPs, "
             f"sites of concrete shape)",
             "FP8 per role: " + ", ".join(f"{role} {n}/{all_}" for role, (n, all_) in roles.items())]
    if plan.unsafe or plan.upgraded:
        upgrades = ", ".join(f"{sid} -> {upgrade_target(entry)}" for sid, entry in sorted(plan.upgraded.items()))
        lines.append(f"probe verdicts: {len(plan.unsafe)} unsafe, {len(plan.upgraded)} upgraded"
                     + (f" ({upgrades})" if upgrades else ""))
    if plan.a_scales:
        policies = sorted({entry["policy"] for entry in plan.a_scales.values()})
        lines.append(f"static activation scales: {len(plan.a_scales)} site(s), {', '.join(policies)}")
    return "\n".join(lines + report._kept_lines(largest) + report._history_lines())


def plan_table(plan: Plan) -> str:
    """Every site as `report.table()` shows it (the graph column empty: a plan keeps
    decisions by site id across graphs), then the static activation scales."""
    text = plan_report(plan).table()
    if plan.a_scales:
        text += "\n\nstatic activation scales:\n" + tabulate(
            [(sid, e["scale"], e["range"], e["policy"], e["error"]) for sid, e in sorted(plan.a_scales.items())],
            headers=["site id", "scale", "range", "policy", "error"])
    return text
