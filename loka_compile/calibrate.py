"""Calibration: static activation scales for FP8 inference, from the Probe on real batches.

    plan = loka_compile.calibrate(model, batches, policy="percentile")
    plan.save("plan.json")
    with torch.no_grad():
        torch.compile(model, backend="loka", options={"plan": "plan.json"})(x)

In the inference graph compiled with that plan, each planned site casts A with its
constant scale (clamp(A / s) -> e4m3, no amax reduction), while its weight stays
cached per output channel (`passes/weight_cache.py`). Calibration decides what it can
measure, safety; whether FP8 pays is decided when the served model compiles, in its mode.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch

from loka_compile import backend, output_budget, probe
from loka_compile.config import LokaConfig
from loka_compile.kernels import metrics
from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_along, quantize_tensorwise, scale_from_amax
from loka_compile.kernels.scaled_gemm import quantize_static
from loka_compile.passes import GraphKind, Reason
from loka_compile.plan import Plan, plan_of

log = logging.getLogger("loka")

POLICIES = ("amax", "percentile")


def calibrate(model: torch.nn.Module, batches, *, policy: str = "amax", percentile: float = 99.99,
              options=None) -> Plan:
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
    longer afford stays in high precision, largest share first (`_rebudget`).

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
    sites get static scales; blockwise sites keep dynamic ones."""
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
    # No speed check: every safe site FP8 can serve gets its scale; speed is the serving compile's.
    config = dataclasses.replace(config, probe_steps=len(batches), speed_check=False)
    label = "amax" if policy == "amax" else f"percentile {float(percentile):g}"

    known = {id(r) for r in backend.GRAPHS}
    # A backend object of its own: Dynamo never serves this run with code compiled for another.
    compiled = torch.compile(model, backend=functools.partial(backend.loka_backend, options=config))
    # The reservoirs' rows are read below, after the windows closed and the FP8 variants ran.
    with torch.no_grad(), probe.STORE.keeping_samples():  # the FP8 variants compile when the windows close
        for batch in batches:
            _call(compiled, batch)
        # The last batch again closes each window on a call, so the output budget
        # (`max_output_error`) weighs the sites on real arguments.
        _call(compiled, batches[-1])
        records = [r for r in backend.GRAPHS if id(r) not in known]
        ours = {id(r) for r in records}
        for graph in list(backend._PROBING):  # a graph the last batch did not reach closes without a call
            if id(graph.record) in ours and graph.record.phase == "probe":
                graph._close_probe_window()
    plan = plan_of(compiled)
    for record in records:
        row_errors = _static_scales(record, plan, config, policy, float(percentile), label)
        _rebudget(record, plan, config, row_errors)
        probe.STORE.release_samples(backend.probe_site_keys(record))
    # The calibration's graphs are its own: reports of the model's later compiles leave them out.
    backend.GRAPHS[:] = [r for r in backend.GRAPHS if id(r) in known]
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
    probed = record.contexts.get(("probe", GraphKind.INFERENCE))
    final = record.contexts.get((record.phase, GraphKind.INFERENCE))
    row_errors = {}
    if probed is None or final is None:
        return row_errors
    decisions = {s.id: final.decisions.get(s.key) for s in final.sites}
    for site in probed.sites:
        decision = decisions.get(site.id)
        summary = probe.STORE.summary(site.key)
        if decision is None or not decision.fp8 or "operands" not in summary \
                or decision.scaling not in (Scaling.TENSORWISE.value, Scaling.ROWWISE.value):
            continue
        rows = probe.STORE.reservoir(site.key, "a")
        rows = rows.reshape(-1, rows.shape[-1])
        if policy == "amax":
            value = summary["operands"]["a"]["amax"]
        else:
            value = float(torch.quantile(rows.float().abs().flatten(), percentile / 100.0))
        fmt = Fp8Format(decision.a_format)
        scale = float(scale_from_amax(torch.tensor(value), fmt)) if math.isfinite(value) else math.nan
        b_cols = probe.STORE.reservoir(site.key, "b")
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


def _rebudget(record, plan: Plan, config: LokaConfig, row_errors: dict) -> None:
    """Weigh the sites again, as calibrated. The window weighed each site at its dynamic
    cast's error, and a static scale has its own (one scale for all rows: often larger).
    And after the window the FP8 variant's output discrepancy was measured: where it came
    out k times the prediction (the sum in quadrature assumes independent site errors;
    MaskNet's calibration measured k 3.5 on the H100), the prediction is scaled by k. Sites the budget can
    no longer afford, largest s * e first, lose their static scale and stay in high precision."""
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
                                        budget_text=budget.describe_budget())
    for sid, detail in weighed.kept.items():
        _keep_in_high_precision(plan, sid, errors[sid], detail)
    log.info("loka calibrate: %s: output budget as calibrated (static scales, prediction x %.2g): predicted "
             "output discrepancy %.3g -> %.3g, %d more site(s) kept in high precision",
             record.name, k, weighed.before, weighed.after, len(weighed.kept))


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
