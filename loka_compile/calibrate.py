"""Calibration: static activation scales for FP8 inference, from the Probe on real batches.

    plan = loka_compile.calibrate(model, batches, policy="percentile")
    plan.save("plan.json")
    with torch.no_grad():
        torch.compile(model, backend="loka", options={"plan": "plan.json"})(x)

In the inference graph compiled with that plan, each planned site casts A with its
constant scale (clamp(A / s) -> e4m3, no amax reduction), while its weight stays
cached per output channel (`passes/mods/cached_weights.py`). Calibration decides what it can
measure, safety; whether FP8 pays is decided when the served model compiles, in its mode.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import tempfile
from typing import Optional

import torch

from loka_compile import backend, dispatch, output_budget, probe, task_metrics
from loka_compile.compiled_graph import probe_site_keys
from loka_compile.config import LokaConfig
from loka_compile.kernels import metrics
from loka_compile.kernels import ops as loka_ops
from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_along, quantize_tensorwise, scale_from_amax
from loka_compile.kernels.scaled_gemm import quantize_static
from loka_compile.passes import GraphKind, Phase, Reason
from loka_compile.plan import Plan, SitePlan
from loka_compile.report import plan_of
from loka_compile.state import state_of

log = logging.getLogger("loka")

POLICIES = ("amax", "percentile")
# The task metric's relative tolerance when neither `tolerance` nor max_ne_increase gives one:
# the project's quality goal, NE within 0.1% of bf16.
DEFAULT_TOLERANCE = 0.001
# Task metrics `calibrate` measures with labels: NE lower is better, AUC higher.
TASK_METRICS = ("ne", "auc")


def calibrate(model: torch.nn.Module, batches, *, policy: str = "amax", percentile: float = 99.99,
              options=None, labels=None, metric="ne", tolerance: Optional[float] = None) -> Plan:
    """Run `model` on `batches` under `torch.no_grad()`, compiled with backend="loka", a
    probe window of `len(batches)` calls and no speed check, and return its Plan with a
    static activation scale per inference site the Probe judged safe and FP8 can serve
    (`Plan.a_scales`, by site id; save it with `plan.save(path)`, load it with
    `options={"plan": path}`). Then the last batch runs once more: each window closes on
    that call, so the output budget (`max_output_error`) keeps in high precision the
    forward sites whose measured sensitivity it cannot afford, as after any window. That
    window weighs each site at its dynamic cast's error; once the static scales are set the
    sites are weighed again at their static casts' errors, with the prediction scaled by
    what the FP8 variant's discrepancy measured against it, and what the budget can no
    longer afford is made safer as below, largest share first (`_rebudget`).

    The plan holds the Probe's verdicts (unsafe, upgraded), the scales, and the sites'
    decisions without a speed check: a compile that loads it on FP8 hardware with
    `speed_check` on times each FP8 site there, in its own mode (CUDA graphs or not) and
    with A cast by its static scale, and keeps in high precision where FP8 does not pay.
    So `mode` does not matter here; compile the served model with its own.

    Each batch is a tensor, a tuple of positional arguments or a dict of keyword
    arguments. `options` are the compile's options (LokaConfig or mapping; `probe_steps`
    and `speed_check` are set here, `plan` must be unset). Per site, A's range is:
    - "amax": the largest |A| the Probe saw over every calibration row;
    - "percentile": the `percentile`-th percentile of |A| over the rows the Probe's
      reservoir sampled (at most `probe.RESERVOIR_ROWS` rows per site, fewer for rows over
      4096 elements, uniform over all calibration rows), so outliers beyond it are clamped.
    The scale is range / e4m3 max; at run time values beyond the range saturate at +-448.

    Error check: the static cast is replayed on the reservoir's rows of A against the
    reservoir's columns of B (cast as the site casts it), and its error against the fp64
    product in `probe_metric` (row relative error by default) is compared with
    `max_probe_error`: a site over that budget
    stays bf16 (`probe_unsafe`, its detail naming the error). Tensorwise and rowwise
    sites get static scales; blockwise sites keep dynamic ones.

    Task quality (`_within_task_tolerance`): with `labels` (one tensor of 0/1 labels per
    batch, one label per prediction), the plan's `metric` on the calibration batches is
    measured against the model's own (high-precision, eager) predictions: "ne" (normalized
    entropy), "auc", or a callable (predictions as logits, labels) -> a loss, lower is
    better. While the plan's is worse by more than `tolerance` (relative; default
    `max_ne_increase`, else 0.001), its FP8 site with the largest share of the output
    budget is made safer (a static scale becomes a dynamic cast, then a finer scaling the
    Probe measured within its bound, then high precision: `_FinerScalings`) and the plan is
    measured again. Without labels, the output budget's predicted NE increase of the
    graph's binary heads stands in (sites made safer the same way until it is within
    `tolerance`). The plan's `task_metric` holds the metric before and after, the sites
    made safe and those backed off; it is logged."""
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if not 0.0 < float(percentile) <= 100.0:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    config = LokaConfig.from_options(options)
    if config.plan is not None:
        raise ValueError("calibrate makes a plan: leave the `plan` option unset")
    if not (callable(metric) or metric in TASK_METRICS):
        raise ValueError(f"metric must be one of {list(TASK_METRICS)} or a callable, got {metric!r}")
    if labels is not None:
        labels = list(labels)
        if len(labels) != len(batches):
            raise ValueError(f"labels must give one tensor per batch: {len(labels)} for {len(batches)} batches")
    tolerance = config.max_ne_increase or DEFAULT_TOLERANCE if tolerance is None else tolerance
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ValueError(f"tolerance must be a non-negative finite number, got {tolerance!r}")
    # No speed check: every safe site FP8 can serve gets its scale; speed is the serving compile's.
    config = dataclasses.replace(config, probe_steps=len(batches), speed_check=False)
    label = "amax" if policy == "amax" else f"percentile {float(percentile):g}"

    # A backend object of its own: Dynamo never serves this run with code compiled for another.
    compiled = torch.compile(model, backend=functools.partial(backend.loka_backend, options=config))
    with torch.no_grad():
        _call(compiled, batches[0])  # a probe call: its compile makes the state, which keeps every sample
        state = state_of(compiled)
        # The reservoirs' rows are read below, after the windows closed and the FP8 variants ran.
        with state.store.keeping_samples():  # the FP8 variants compile when the windows close
            for batch in batches[1:]:
                _call(compiled, batch)
            # The last batch again closes each window on a call, so the output budget
            # (`max_output_error`) weighs the sites on real arguments.
            _call(compiled, batches[-1])
            for graph in list(state.probing):  # a graph the last batch did not reach closes without a call
                graph._close_probe_window()
    plan = plan_of(compiled)
    records = state.records
    finer = _FinerScalings(records, config)
    for record in records:
        row_errors = _static_scales(record, plan, config, policy, float(percentile), label)
        finer.errors.update(row_errors)
        _rebudget(record, plan, config, row_errors, finer)
        state.store.release_samples(probe_site_keys(record))
    budgets = [r.output_budget for r in records if r.output_budget is not None]
    if labels is not None:
        _within_task_tolerance(model, batches, labels, plan, config, budgets, metric, float(tolerance), finer)
    else:
        _within_predicted_ne(plan, budgets, float(tolerance), finer)
    return plan


def _call(compiled, batch):
    if isinstance(batch, dict):
        return compiled(**batch)
    if isinstance(batch, (tuple, list)):
        return compiled(*batch)
    return compiled(batch)


def _static_scales(record, plan: Plan, config: LokaConfig, policy: str, percentile: float, label: str) -> dict:
    """Sets the record's sites' static scales in `plan`; returns site id -> the static cast's
    row relative error (the output budget's e) for the sites given one."""
    budget, metric = config.max_probe_error, getattr(config, "probe_metric", "row_rel_error")
    probed = record.contexts_of(Phase.PROBE).get(GraphKind.INFERENCE)
    final = record.contexts_of().get(GraphKind.INFERENCE)
    row_errors = {}
    if probed is None or final is None:
        return row_errors
    decisions = {s.id: final.decisions.get(s.id) for s in final.sites}
    for site in probed.sites:
        decision = decisions.get(site.id)
        summary = record.store.summary(site.key)
        if decision is None or not decision.fp8 or "operands" not in summary \
                or decision.scaling not in (Scaling.TENSORWISE.value, Scaling.ROWWISE.value):
            continue
        rows = record.store.reservoir(site.key, "a")
        rows = rows.reshape(-1, rows.shape[-1])
        if policy == "amax":
            value = summary["operands"]["a"]["amax"]
        else:
            value = float(torch.quantile(rows.float().abs().flatten(), percentile / 100.0))
        fmt = Fp8Format(decision.a_format)
        scale = float(scale_from_amax(torch.tensor(value), fmt)) if math.isfinite(value) else math.nan
        b_cols = record.store.reservoir(site.key, "b")
        error = _static_error(rows, b_cols, scale, decision, metric) if math.isfinite(scale) else math.inf
        if error <= budget:
            plan.a_scales[site.id] = {"scale": scale, "range": float(value), "policy": label, "error": error}
            row_errors[site.id] = error if metric == "row_rel_error" else \
                _static_error(rows, b_cols, scale, decision, "row_rel_error")
            continue
        _keep_in_high_precision(plan, site.id, error, f"calibrated static scale ({label}): {metric} {error:.3g} > "
                                f"{budget} on {rows.shape[0]} sampled rows")
    return row_errors


def _keep_in_high_precision(plan: Plan, sid: str, error: float, detail: str) -> None:
    log.warning("loka calibrate: %s stays in high precision (%s)", sid, detail)
    plan.unsafe[sid] = error
    plan.a_scales.pop(sid, None)
    if sid in plan.sites:
        plan.sites[sid] = dataclasses.replace(plan.sites[sid], fp8=False, reason=Reason.PROBE_UNSAFE.value,
                                              detail=detail)


# The step a site with a static scale takes first: its own scaling with a dynamic cast (an
# amax per row or tensor, as the window measured it) instead of one calibrated scale.
DYNAMIC_CAST = "dynamic "


class _FinerScalings:
    """What making a calibrated plan's site safer takes: per site id its Probe summary, its
    Site (for Dispatch) and its graph's record, and `errors`, the error each site runs at
    now (its static cast's where it has a static scale, else the window's). A site with a
    static scale first casts dynamically in its own scaling, where the Probe measured that
    with a smaller error; then it takes the finer scalings the Probe measured within its
    per-site bound (`output_budget.safer_scalings`, the window's own steps); then it stays
    in high precision."""

    def __init__(self, records, config: LokaConfig):
        self.config = config
        self.summaries, self.sites, self.records, self.errors = {}, {}, {}, {}
        for record in records:
            for ctx in record.contexts_of(Phase.PROBE).values():
                self.summaries.update({site.id: record.store.summary(site.key) for site in ctx.sites})
            for ctx in record.contexts_of().values():
                for site in ctx.sites:
                    self.sites[site.id], self.records[site.id] = site, record
            if record.output_budget is not None:
                self.errors.update(record.output_budget.error)
        self._left = {}

    def steps(self, plan: Plan, errors: dict) -> dict:
        """site id -> [(step, e), ...] for each site of `errors` (at that error now): each step
        a smaller error than the one before, "dynamic <scaling>" or a finer scaling."""
        scalings = {sid: plan.sites[sid].scaling for sid in errors if sid in plan.sites}
        first = {}
        for sid, e in errors.items():
            entry = plan.sites.get(sid)
            if sid in plan.a_scales and entry is not None and sid in self.summaries:
                dynamic = output_budget.candidate_error(
                    self.summaries[sid], loka_ops.candidate_name(entry.scaling, entry.a_format, entry.b_format))
                if dynamic is not None and dynamic < e:
                    first[sid] = (DYNAMIC_CAST + entry.scaling, dynamic)
        finer = output_budget.safer_scalings(self.summaries, {sid: first.get(sid, (0, e))[1]
                                                              for sid, e in errors.items()},
                                             scalings, self.sites, self.config)
        return {sid: [first[sid], *steps] if sid in first else steps for sid, steps in finer.items()}

    def next_step(self, plan: Plan, sid: str) -> Optional[tuple]:
        """(step, e): the next step a site of the plan may take (`steps`), None when none is left."""
        if sid not in self._left:
            self._left[sid] = self.steps(plan, {sid: self.errors.get(sid, math.inf)})[sid]
        return self._left[sid].pop(0) if self._left[sid] else None

    def take(self, plan: Plan, sid: str, step: str, e: float, detail: str) -> bool:
        """The plan's site runs at error `e` from now on: cast dynamically ("dynamic
        <scaling>"), or in a finer scaling (an upgrade verdict, decided again by Dispatch,
        dynamically cast); `detail` (`output_budget.made_safe_detail`) in its decision and in
        its graph's output budget (`made_safe`, for a finer scaling). False, changing
        nothing, where Dispatch would not run the finer scaling in FP8 there."""
        before = plan.sites[sid]
        budget = self.records[sid].output_budget
        weighed = budget is not None and sid in budget.error
        if step.startswith(DYNAMIC_CAST):
            plan.sites[sid] = dataclasses.replace(before, detail="; ".join(filter(None, (detail, before.detail))))
        else:
            entry = output_budget.upgrade_entry(self.summaries[sid], step, self.config.probe_metric)
            decision = dispatch.decide(self.sites[sid], self.config, Phase.FP8,
                                       plan=dataclasses.replace(plan, upgraded={**plan.upgraded, sid: entry},
                                                                source=""))
            if not decision.fp8 or decision.scaling != step:
                return False
            plan.upgraded[sid] = entry
            plan.sites[sid] = SitePlan.from_decision(
                dataclasses.replace(decision, detail="; ".join(filter(None, (detail, decision.detail)))),
                before.shape or self.sites[sid].shape, self.sites[sid].dtype)
            if weighed:
                budget.made_safe[sid], budget.upgraded[sid] = detail, entry
        log.info("loka calibrate: %s goes %s%s -> %s (%s)", sid, "static " if sid in plan.a_scales else "",
                 before.scaling, step, detail)
        plan.a_scales.pop(sid, None)
        self.errors[sid] = e
        if weighed:
            budget.error[sid] = e
        return True


def _rebudget(record, plan: Plan, config: LokaConfig, row_errors: dict,
              finer: Optional[_FinerScalings] = None) -> None:
    """Weigh the sites again, as calibrated. The window weighed each site at its dynamic
    cast's error, and a static scale has its own (one scale for all rows: often larger).
    And after the window the FP8 variant's output discrepancy was measured: where it came
    out k times the prediction (the sum in quadrature assumes independent site errors;
    MaskNet's calibration measured k 3.5 on the H100), the prediction is scaled by k. Sites the budget can
    no longer afford, largest s * e first, first take a finer scaling the Probe measured
    within their per-site bound (`finer`; as at the window's close), and with none left lose
    their static scale and stay in high precision."""
    budget = record.output_budget
    if budget is None or not config.output_budget_on:
        return
    errors = {sid: row_errors.get(sid, e) for sid, e in budget.error.items()
              if sid not in budget.kept and sid not in plan.unsafe}
    if not errors:
        return
    k = output_budget.measured_scale(budget)
    labels = {sid: "static scale" for sid in row_errors}
    weighed = output_budget.keep_within(budget.sensitivity, errors,
                                        budget.budget if budget.judged_outputs != "none" else None, labels, scale=k,
                                        heads=tuple(budget.heads), ne_budget=budget.ne_budget,
                                        budget_text=budget.describe_budget(),
                                        finer=finer.steps(plan, errors) if finer is not None else None,
                                        last_gemms=frozenset(budget.last_gemms))
    made_safe = []
    for sid, (scaling, detail) in weighed.made_safe.items():
        if finer.take(plan, sid, scaling, weighed.error[sid], detail):
            made_safe.append(sid)
        else:
            weighed.kept[sid] = detail
    for sid, detail in weighed.kept.items():
        _keep_in_high_precision(plan, sid, errors[sid], detail)
    log.info("loka calibrate: %s: output budget as calibrated (static scales, prediction x %.2g): predicted "
             "output discrepancy %.3g -> %.3g, %d site(s) made safe (a dynamic cast or a finer scaling), %d more "
             "kept in high precision", record.name, k, weighed.before, weighed.after, len(made_safe), len(weighed.kept))


def _static_error(a_rows: torch.Tensor, b_cols: torch.Tensor, scale: float, decision, metric: str) -> float:
    """`metric` (probe_metric: row_rel_error or mere) of the static-scale GEMM on sampled rows of A [R, K] and
    columns of B [n, K] against their fp64 product."""
    scaling = Scaling(decision.scaling)
    a_q, a_s = quantize_static(a_rows, scale, scaling, Fp8Format(decision.a_format))
    b_fmt = Fp8Format(decision.b_format)
    b_q, b_s = quantize_along(b_cols, -1, b_fmt) if scaling is Scaling.ROWWISE else quantize_tensorwise(b_cols, b_fmt)
    reference = a_rows.double() @ b_cols.double().T
    value = (a_q.double() * a_s.double()) @ (b_q.double() * b_s.double()).T
    return getattr(metrics, metric)(reference, value)


def _budget_order(plan: Plan, budgets: list) -> list:
    """The plan's FP8 sites, the largest share of the output budget first: per site the
    largest of (s e / budget)^2 and each binary head's predicted NE increase over its
    budget; sites the budget did not weigh last, by id."""
    share = {}
    for budget in budgets:
        for sid, e in budget.error.items():
            shares = [(budget.sensitivity[sid] * e / budget.budget) ** 2] \
                if budget.judged_outputs != "none" and budget.budget else []
            ne_budget = budget.ne_budget or DEFAULT_TOLERANCE
            shares += [head.relative_increase({sid: e})[sid] / ne_budget for head in budget.heads]
            share[sid] = max(shares, default=0.0)
    fp8 = [sid for sid, entry in plan.sites.items() if entry.fp8 and sid not in plan.unsafe]
    return sorted(fp8, key=lambda sid: (-share.get(sid, -1.0), sid))


def _site_error(budgets: list, sid: str) -> float:
    """The FP8 error the output budget weighed a site at (+inf where it weighed none)."""
    return next((budget.error[sid] for budget in budgets if sid in budget.error), math.inf)


def _predictions(run, batches) -> torch.Tensor:
    """Every floating output of `run` over the batches, concatenated, as logits (fp64):
    outputs that all lie in [0, 1] are taken for probabilities."""
    with torch.no_grad():
        outs = [torch.cat([t.reshape(-1) for t in output_budget.float_outputs(_call(run, batch))]) for batch in batches]
    values = torch.cat(outs).double()
    if bool(((values >= 0) & (values <= 1)).all()):
        return torch.logit(values.clamp(1e-7, 1 - 1e-7))
    return values


def _task_loss(metric, logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The metric as a loss, lower is better (AUC negated)."""
    if metric == "ne":
        return task_metrics.normalized_entropy(logits, labels)
    if metric == "auc":
        return -task_metrics.auc(logits, labels)
    return float(metric(logits, labels))


def _plan_predictions(model, batches, plan: Plan, config: LokaConfig) -> torch.Tensor:
    """The predictions of `model` compiled with `plan` (saved to a temporary file), as served."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "plan.json")
        plan.save(path)
        served = dataclasses.replace(config, plan=path, speed_check=False)
        compiled = torch.compile(model, backend=functools.partial(backend.loka_backend, options=served))
        return _predictions(compiled, batches)


def _within_task_tolerance(model, batches, labels, plan: Plan, config: LokaConfig, budgets: list, metric,
                           tolerance: float, finer: Optional[_FinerScalings] = None) -> None:
    """Make the plan's FP8 sites safer, largest budget share first (`_make_safer_until_within`),
    until its task metric on the calibration data is within `tolerance` (relative) of the
    high-precision model's, measured again after each change."""
    y = torch.cat([torch.as_tensor(l).reshape(-1) for l in labels]).double()
    reference = _predictions(model, batches)
    if reference.numel() != y.numel():
        raise ValueError(f"labels give {y.numel()} values for {reference.numel()} predictions")
    name = metric if isinstance(metric, str) else getattr(metric, "__name__", "metric")
    high = _task_loss(metric, reference, y)
    # Every compile of the model with a plan is a new backend: Dynamo keeps one entry each, and
    # a site may take each finer scaling (tensorwise -> rowwise -> blockwise) before high precision.
    changes = len(probe.SCALING_CHAIN) * len(_budget_order(plan, budgets))
    limit = max(torch._dynamo.config.recompile_limit, changes + 8)
    measured, asked = [], []

    def over() -> Optional[str]:
        if asked:  # asked again: the plan changed since the last measurement
            measured.append(_task_loss(metric, _plan_predictions(model, batches, plan, config), y))
        asked.append(True)
        value = measured[-1]
        if not _worse_by(value, high) > tolerance:
            return None
        return (f"{name} {_shown(metric, value):.5g} vs high precision {_shown(metric, high):.5g} on the calibration "
                f"data, worse by {_worse_by(value, high):.3g} > tolerance {tolerance:g}")

    with torch._dynamo.config.patch(recompile_limit=limit):
        measured.append(_task_loss(metric, _plan_predictions(model, batches, plan, config), y))
        made_safe, backed_off = _make_safer_until_within(plan, budgets, finer, over)
    before, value = measured[0], measured[-1]
    plan.task_metric = {"metric": name, "high_precision": _shown(metric, high), "before": _shown(metric, before),
                        "after": _shown(metric, value), "tolerance": tolerance, "made_safe": made_safe,
                        "backed_off": backed_off, "measured": True}
    log.info("loka calibrate: %s on the calibration data: high precision %.5g, the plan %.5g before, %.5g after "
             "making %d site(s) safe (a dynamic cast or a finer scaling) and backing off %d (tolerance %g)", name,
             _shown(metric, high), _shown(metric, before), _shown(metric, value), len(made_safe), len(backed_off),
             tolerance)


def _make_safer_until_within(plan: Plan, budgets: list, finer: Optional[_FinerScalings], over) -> tuple:
    """While `over()` says how the plan misses its tolerance (None once within it), the
    plan's FP8 site with the largest share of the output budget (`_budget_order`) is made
    safer: it takes its next finer scaling the Probe measured within its per-site bound
    (`finer`), or, with none left, stays in high precision. Returns ({site id: the finer
    scaling it runs}, [site ids backed off to high precision])."""
    made_safe, backed_off = {}, []
    why = over()
    while why:
        order = _budget_order(plan, budgets)
        if not order:
            break
        sid = order[0]
        why = f"calibrate: {why}; the largest budget share"
        step = finer.next_step(plan, sid) if finer is not None else None
        if step is not None and finer.take(plan, sid, *step, output_budget.made_safe_detail(
                why, step[0], finer.errors.get(sid, math.inf), step[1])):
            made_safe[sid] = step[0]
        else:
            _keep_in_high_precision(plan, sid, _site_error(budgets, sid), why)
            made_safe.pop(sid, None)
            backed_off.append(sid)
        why = over()
    return made_safe, backed_off


def _worse_by(value: float, reference: float) -> float:
    """The relative degradation of a loss-like value (a NaN is infinitely worse)."""
    if not value == value:
        return math.inf
    return (value - reference) / max(abs(reference), 1e-12)


def _shown(metric, value: float) -> float:
    return -value if metric == "auc" else value


def _within_predicted_ne(plan: Plan, budgets: list, tolerance: float, finer: Optional[_FinerScalings] = None) -> None:
    """Without labels: the output budget's predicted relative NE increase of each binary
    head, summed over the plan's FP8 sites, brought within `tolerance` by making the sites
    with the largest share of it safer (`_make_safer_until_within`)."""
    heads = [(budget, head) for budget in budgets for head in budget.heads]
    if not heads:
        log.info("loka calibrate: no labels and no binary head among the outputs: the output budget's verdicts stand")
        return

    def predicted() -> float:
        fp8 = {sid for sid, entry in plan.sites.items() if entry.fp8 and sid not in plan.unsafe}
        return max(sum(head.relative_increase({s: e for s, e in budget.error.items() if s in fp8}).values())
                   for budget, head in heads)

    def over() -> Optional[str]:
        value = predicted()
        return f"predicted relative NE increase {value:.3g} > tolerance {tolerance:g} (no labels)" \
            if value > tolerance else None

    before = predicted()
    made_safe, backed_off = _make_safer_until_within(plan, budgets, finer, over)
    plan.task_metric = {"metric": "predicted relative NE increase", "before": before, "after": predicted(),
                        "tolerance": tolerance, "made_safe": made_safe, "backed_off": backed_off, "measured": False}
    log.info("loka calibrate: predicted relative NE increase %.3g before, %.3g after making %d site(s) safe by a "
             "finer scaling or a dynamic cast and backing off %d (no labels; tolerance %g)", before,
             plan.task_metric["after"],
             len(made_safe), len(backed_off), tolerance)
