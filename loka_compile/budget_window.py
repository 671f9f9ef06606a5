"""The output budget (`max_output_error`) at a probe window's close: the window's close also
measures each forward site's sensitivity on the closing call's arguments (the probe variant once
plain, once per site with noise at that site's output), keeps in high precision the sites the
budget cannot afford (`output_budget`), and after the FP8 variant compiles measures its outputs'
distance from the probe variant's on the same arguments. `OutputBudgetWindow` is the part of
`compiled_graph.LokaCompiledGraph` that does it."""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import torch

from loka_compile import output_budget, probe, ranks
from loka_compile.kernels import ops as loka_ops
from loka_compile.output_budget import OutputBudget
from loka_compile.passes import GraphKind, Phase, Reason, Role
from loka_compile.ranks import decide_once


log = logging.getLogger("loka")


class OutputBudgetWindow:
    """The output budget (`LokaConfig.max_output_error`) at a probe window's close, for
    LokaCompiledGraph: its `record`, `variants`, `_traced_probe`, `_source` and `_budget_waits`."""


    def _budget_sites(self) -> dict:
        """probe key -> site id of the forward sites the output budget weighs: observed
        `fwd` sites of the probe variant's forward or inference graph, which carry a
        `loka.perturb` (backward sites do not reach the outputs)."""
        record = self.record
        return {site.key: site.id for kind, ctx in record.contexts_of(Phase.PROBE).items()
                if kind is not GraphKind.BACKWARD and kind not in record.fallen_back
                and not record.fallback and ctx.perturb_outputs
                for site in ctx.sites
                if site.role is Role.FWD and site.id in ctx.decisions
                and ctx.decisions[site.id].reason is Reason.PROBING and record.store.observed(site.key)}

    def _budget_reference(self, args):
        """(side runs, reference outputs) of the probe variant on the closing call's
        arguments for the output budget, None when it does not act, or "wait": every
        floating output of this call is non-finite (a NaN batch), so the window stays open
        and the budget is computed at the next call whose outputs are partly finite (up to
        BUDGET_WAIT_CALLS calls; then the window closes without it, logged and reported).
        A partly non-finite output is judged on its finite elements."""
        record = self.record
        if not record.config.output_budget_on or args is None or not self._budget_sites():
            return None
        try:
            runs = _SideRuns(args)
            reference = runs.run(self.variants[Phase.PROBE])
        except Exception as error:  # noqa: BLE001  (the budget must never cost the model its call)
            self._skip_budget(f"running the probe variant failed ({type(error).__name__}: {error})")
            return None
        if reference and not bool(output_budget.finite_mask(reference).any()):
            self._budget_waits += 1
            # Ranks close their windows at the same call (`decide_once`): none may wait alone.
            if self._budget_waits <= BUDGET_WAIT_CALLS and not ranks.distributed():
                log.warning("loka: %s: output budget: every output of call %d is non-finite; the probe window stays "
                            "open and the budget is computed at the next finite call", record.name, self.calls + 1)
                return "wait"
            self._skip_budget(f"the outputs of {self._budget_waits} calls in a row were all non-finite")
            return None
        return runs, reference

    def _skip_budget(self, why: str) -> None:
        self.record.output_budget_skipped = why
        log.warning("loka: %s: output budget not applied: %s; the per-site verdicts stand", self.record.name, why)

    def _apply_output_budget(self, args, prepared=None) -> Optional[tuple]:
        """Measure each forward site's sensitivity on `args` and keep in high precision,
        largest contribution first, the sites whose predicted output discrepancy (or a
        binary head's predicted NE increase) the budget cannot afford (in the plan's
        unsafe verdicts, the budget in their detail). `prepared`: `_budget_reference`'s.
        Returns (side runs, reference outputs, judged) for `_verify_output_budget`, or None
        when the budget is off or did not act. Never raises: a failure logs a warning and
        leaves the per-site verdicts as they are."""
        record, config = self.record, self.record.config
        if not config.output_budget_on:
            return None
        sites = self._budget_sites()
        if not sites:
            return None
        measured = None
        if args is None:
            log.info("%s: output budget not applied: the probe window closed without a call to measure on",
                     record.name)
        elif prepared is not None:
            try:
                measured = self._measure_sensitivities(args, sites, *prepared)
            except Exception as error:  # noqa: BLE001  (the budget must never cost the model its call)
                self._skip_budget(f"measuring the sites' sensitivities failed ({type(error).__name__}: {error})")

        def decide():  # on rank 0 when distributed; must not raise there, the other ranks wait for it
            if measured is None:
                return None
            try:
                return self._budget_verdicts(sites, measured)
            except Exception as error:  # noqa: BLE001
                self._skip_budget(f"weighing the sites failed ({type(error).__name__}: {error})")
                return None

        decided = decide_once(decide)
        if decided is None:
            return None
        decided.deferred_calls = self._budget_waits
        record.output_budget = decided
        for sid in decided.kept:
            record.plan.unsafe[sid] = decided.error[sid]
        record.plan.upgraded.update(decided.upgraded)  # sites a finer scaling made safe for the budget
        heads = "".join(f"; {name}: predicted relative NE increase {decided.ne_before[name]:.3g} -> "
                        f"{decided.ne_predicted[name]:.3g} (max_ne_increase {decided.ne_budget:g})"
                        for name in decided.ne_predicted)
        floor = decided.floor
        log.info("%s: output budget %s (noise floor %.3g: predicted %.3g, measured %s): predicted output discrepancy "
                 "%.3g -> %.3g%s; %d of %d forward site(s) kept in high precision%s (sensitivities: %d runs, %.2f s)",
                 record.name, decided.describe_budget(), floor.value, floor.predicted,
                 f"{floor.measured:.3g}" if floor.measured is not None else floor.why_unmeasured,
                 decided.predicted_before, decided.predicted, heads, len(decided.kept), len(decided.sensitivity),
                 f": {', '.join(decided.kept)}" if decided.kept else "", decided.runs, decided.seconds)
        if decided.below_floor:
            log.warning("loka: %s: max_output_error %g is below the graph's noise floor %.3g: bf16 itself would not "
                        "meet it", record.name, decided.budget, decided.floor.value)
        if measured is None:  # rank 0 weighed the sites; this rank's own measurement failed
            return None
        return measured["runs"], measured["reference"], measured["judged"]

    def _measure_sensitivities(self, args, sites: dict, runs: "_SideRuns", reference: list) -> dict:
        """The probe variant once per site with noise at that site's output (twice, at +z and
        -z, where a loss is among the binary heads): per site its sensitivity over the
        judged outputs and each binary head's second-order loss change; and the measured
        noise floor."""
        config = self.record.config
        start = time.perf_counter()
        variant = self.variants[Phase.PROBE]
        kinds = output_budget.head_kinds(self._source.gm, config.binary_outputs) if self._source.kept else []
        if len(kinds) == len(runs.float_leaves):  # the reference run's output leaves
            kinds = [kind for kind, floating in zip(kinds, runs.float_leaves) if floating]
        else:
            kinds = [None] * len(reference)  # outputs not as the Dynamo graph lists them: no heads known
        heads_on = bool(config.max_ne_increase) and any(kinds)
        heads = [(i, kind) for i, kind in enumerate(kinds) if kind] if heads_on else []
        other = [i for i, kind in enumerate(kinds) if not kind or not heads_on]
        judged = other if other else list(range(len(reference)))
        select = lambda outputs: [outputs[i] for i in judged]  # noqa: E731
        finite = output_budget.finite_mask(select(reference))
        output_budget.check_reference(select(reference), finite)
        records = [output_budget.measure_head(f"output {i} ({kind})", kind, reference[i]) for i, kind in heads]
        sensitivity, runs_made = {}, 1
        for key, sid in sites.items():
            with loka_ops.perturbing(key):
                out = runs.run(variant)
            mirrored = None
            if any(kind == output_budget.LOSS for _, kind in heads):
                with loka_ops.perturbing(key, sign=-1):
                    mirrored = runs.run(variant)
                runs_made += 1
            runs_made += 1
            sensitivity[sid] = output_budget.discrepancy(select(out), select(reference), finite) \
                / loka_ops.PERTURB_DELTA
            for head, (i, kind) in zip(records, heads):
                head.per_site[sid] = output_budget.second_order_loss(
                    kind, reference[i], out[i], mirrored[i] if mirrored is not None else None)
        floor_measured, why = self._measure_floor(runs, judged, finite)
        return {"runs": runs, "reference": reference, "judged": (judged, finite), "sensitivity": sensitivity,
                "heads": records, "judge_d": bool(other), "floor_measured": floor_measured, "why": why,
                "finite_fraction": float(finite.double().mean()) if finite.numel() else 1.0,
                "seconds": time.perf_counter() - start, "runs_made": runs_made,
                "judged_outputs": "all" if not heads else ("other than the binary heads" if other else "none")}

    def _measure_floor(self, runs: "_SideRuns", judged: list, finite) -> tuple:
        """(measured noise floor or None, why not): the Dynamo graph run eagerly in its bf16
        arithmetic against the same function in fp32 (`output_budget.floor_graphs`), on the
        closing call's arguments (copies), where the inputs' copies fit FLOOR_RUN_MAX_BYTES."""
        gm = self._source.gm
        if gm is None:
            return None, "the graph's source is gone"
        floating = [a for a in runs.args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if sum(a.numel() for a in floating) * 6 > FLOOR_RUN_MAX_BYTES:  # an fp32 and a bf16 copy
            return None, "its inputs are too large to copy"
        try:
            high_gm, low_gm, low_dtype = output_budget.floor_graphs(gm, runs.args)
            high = [o.double() for o in runs.run_eager(high_gm, torch.float32)]
            low = runs.run_eager(low_gm, low_dtype)
            if len(high) != len(low) or max(judged, default=-1) >= len(high):
                return None, "its eager outputs differ from the compiled ones"
            select = lambda outputs: [outputs[i] for i in judged]  # noqa: E731
            return output_budget.discrepancy(select(low), select(high), output_budget.finite_mask(select(high))), ""
        except Exception as error:  # noqa: BLE001  (the prediction stands alone)
            return None, f"the eager runs failed ({type(error).__name__}: {error})"

    def _budget_verdicts(self, sites: dict, measured: dict) -> OutputBudget:
        """The budget's picks over the forward sites the per-site verdicts let go FP8, each
        with its error in the scaling it would run (its own, or its upgrade's)."""
        plan, config = self.record.plan, self.record.config
        sensitivity = measured["sensitivity"]
        summaries = {sid: self.record.store.summary(key) for key, sid in sites.items()}
        bf16 = {sid: summary["mean_bf16_rel_error"] for sid, summary in summaries.items()
                if math.isfinite(summary.get("mean_bf16_rel_error", math.inf))}
        error, labels = self._running_errors({sid: summaries[sid] for sid in summaries if sid not in plan.unsafe})
        site_of = self._probed_sites()
        last_gemms = output_budget.last_gemm_sites(self._source.gm, site_of, sensitivity) if self._source.kept else ()
        floor = output_budget.NoiseFloor(predicted=output_budget.floor_prediction(sensitivity, bf16),
                                         measured=measured["floor_measured"], why_unmeasured=measured["why"])
        relative = config.relative_budget
        if relative and not floor.value > 0:
            raise ValueError("the relative budget needs a noise floor, and none was measured or predicted")
        budget = config.noise_floor_multiple * floor.value if relative else config.max_output_error
        ne_budget = config.max_ne_increase if measured["heads"] else None
        result = OutputBudget(budget=budget, sensitivity=sensitivity, error=error, kept={}, predicted_before=0.0,
                              predicted=0.0, seconds=measured["seconds"], runs=measured["runs_made"], floor=floor,
                              multiple=config.noise_floor_multiple if relative else None, heads=measured["heads"],
                              ne_budget=ne_budget, judged_outputs=measured["judged_outputs"],
                              finite_fraction=measured["finite_fraction"])
        weighed = output_budget.make_safe_or_keep(sensitivity, error, budget if measured["judge_d"] else None, labels,
                                                  summaries, site_of, config, heads=tuple(result.heads),
                                                  ne_budget=ne_budget, budget_text=result.describe_budget(),
                                                  last_gemms=frozenset(last_gemms))
        result.kept, result.predicted_before, result.predicted = weighed.kept, weighed.before, weighed.after
        result.last_gemms = last_gemms
        output_budget.record_made_safe(result, weighed, summaries, config.probe_metric)
        result.ne_before, result.ne_predicted = weighed.ne_before, weighed.ne_after
        return result

    def _running_errors(self, summaries: dict) -> tuple:
        """({site id: e}, {site id: scaling}) of forward sites (`summaries`: id -> the Probe's
        summary) going FP8: each in the scaling it runs, its upgrade's (the Probe's or the
        budget's, in the plan) or else its own, and e that scaling's mean row relative error
        (the largest observed error where the Probe has no candidate statistics)."""
        plan = self.record.plan
        error, scalings = {}, {}
        for sid, summary in summaries.items():
            target = plan.upgraded.get(sid, (None,))[0]
            candidate = probe._target_name(target) if isinstance(target, str) else summary.get("chosen")
            e = output_budget.candidate_error(summary, candidate) if candidate else None
            if e is None:  # no candidate statistics: the largest observed error
                e = float(summary.get("max_rel_error", math.inf))
            error[sid], scalings[sid] = e, (candidate or "own").split("/")[0]
        return error, scalings

    def _probed_sites(self) -> dict:
        """site id -> Site of the probe variant's sites."""
        return {s.id: s for ctx in self.record.contexts_of(Phase.PROBE).values() for s in ctx.sites}

    def _verify_output_budget(self, runs: "_SideRuns", reference: list, judged: tuple) -> None:
        """Run the FP8 variant on the closing call's arguments and record its outputs'
        discrepancy from the probe variant's (over the judged outputs' finite elements);
        warn when it exceeds the budget by over VERIFY_SLACK (with `refit_output_budget`
        the sites are then weighed again, once). Never raises."""
        record, budget = self.record, self.record.output_budget
        indices, finite = judged
        select = lambda outputs: [outputs[i] for i in indices]  # noqa: E731
        try:
            budget.predicted_after = self._predicted_as_compiled()
            if self.variants[Phase.PROBE] is self._traced_probe and self._probe_draws_random_numbers():
                budget.why_unmeasured = "the graph draws random numbers (dropout), the FP8 variant in Inductor's " \
                    "code and the probe variant, run as traced, in eager kernels: their draws differ"
                log.info("loka: %s: output discrepancy of the FP8 variant not measured: %s", record.name,
                         budget.why_unmeasured)
                return
            budget.measured = output_budget.discrepancy(select(runs.run(self.variants[Phase.FP8])), select(reference),
                                                        finite)
        except Exception as error:  # noqa: BLE001
            log.warning("loka: %s: output budget: measuring the FP8 variant's output failed (%s: %s)",
                        record.name, type(error).__name__, error)
            return
        over = budget.judged_outputs != "none" and not budget.measured <= VERIFY_SLACK * budget.budget
        log.log(logging.WARNING if over else logging.INFO,
                "loka: %s: output discrepancy of the FP8 variant from high precision: measured %.3g, predicted %.3g "
                "(budget %s%s)", record.name, budget.measured, budget.predicted_after, budget.describe_budget(),
                f", exceeded over {VERIFY_SLACK:g}x: the sensitivities did not predict it" if over else "")

    def _probe_draws_random_numbers(self) -> bool:
        return any(output_budget.draws_random_numbers(module) for (phase, kind), module
                   in self.record.graph_modules.items() if phase is Phase.PROBE and kind is not GraphKind.BACKWARD)

    def _weigh_at_measured_scale(self) -> Optional[tuple]:
        """With `refit_output_budget`, when the FP8 variant measured over VERIFY_SLACK times
        the budget: the sites left in FP8 weighed again with the prediction scaled by what
        it measured (`output_budget.measured_scale`), each first offered its finer scalings
        as at the window's close (`output_budget.make_safe_or_keep`), as (Weighed, scale,
        the sites' Probe summaries); else None. Never raises (on rank 0 when distributed)."""
        record, budget = self.record, self.record.output_budget
        try:
            if not record.config.refit_output_budget or budget.measured is None \
                    or budget.judged_outputs == "none" or budget.measured <= VERIFY_SLACK * budget.budget:
                return None
            scale = output_budget.measured_scale(budget)
            summaries = {sid: record.store.summary(key) for key, sid in self._budget_sites().items()
                         if sid in budget.error and sid not in budget.kept and sid not in record.plan.unsafe}
            _, scalings = self._running_errors(summaries)
            errors = {sid: budget.error[sid] for sid in summaries}
            weighed = output_budget.make_safe_or_keep(budget.sensitivity, errors, budget.budget, scalings, summaries,
                                                      self._probed_sites(), record.config, scale=scale,
                                                      heads=tuple(budget.heads), ne_budget=budget.ne_budget,
                                                      budget_text=budget.describe_budget(),
                                                      last_gemms=frozenset(budget.last_gemms))
            return weighed, scale, summaries
        except Exception as error:  # noqa: BLE001
            log.warning("loka: %s: output budget: weighing the sites again failed (%s: %s)",
                        record.name, type(error).__name__, error)
            return None

    def _tighten_output_budget(self, weighed: Optional[tuple]) -> bool:
        """Apply what `_weigh_at_measured_scale` found: the sites a finer scaling makes safe
        at the measured scale take it (an upgrade of the plan, its reason in the budget's
        `made_safe`, which the FP8 variant's compile records as the budget's amendment), and
        those the budget can no longer afford stay in high precision; True when either
        changed a site (the FP8 variant is compiled again, once)."""
        if not weighed or not (weighed[0].kept or weighed[0].made_safe):
            return False
        weighed, scale, summaries = weighed
        record, budget = self.record, self.record.output_budget
        for sid, detail in weighed.kept.items():
            budget.kept[sid] = detail
            record.plan.unsafe[sid] = budget.error[sid]
            budget.made_safe.pop(sid, None)  # the window's finer scaling no longer suffices
            if budget.upgraded.pop(sid, None) is not None:
                record.plan.upgraded.pop(sid, None)
        output_budget.record_made_safe(budget, weighed, summaries, record.config.probe_metric)
        record.plan.upgraded.update({sid: budget.upgraded[sid] for sid in weighed.made_safe})
        budget.predicted = weighed.after
        made_safe = ", ".join(f"{sid} ({scaling})" for sid, (scaling, _) in weighed.made_safe.items())
        log.warning("loka: %s: output budget: the FP8 variant measured %.3g, %.2gx its prediction; weighed again "
                    "at that scale (predicted %.3g -> %.3g): %d site(s) made safe by a finer scaling%s, %d more kept "
                    "in high precision%s; compiling the FP8 variant again", record.name, budget.measured, scale,
                    weighed.before, weighed.after, len(weighed.made_safe), f": {made_safe}" if made_safe else "",
                    len(weighed.kept), f": {', '.join(weighed.kept)}" if weighed.kept else "")
        return True

    def _predicted_as_compiled(self) -> float:
        """D over the forward sites the FP8 variant runs in FP8, each at the scaling it runs
        (and each binary head's predicted relative NE increase, into `ne_after`)."""
        record, budget = self.record, self.record.output_budget
        keys = {sid: key for key, sid in self._budget_sites().items()}
        errors = {}
        for kind, ctx in record.contexts_of(Phase.FP8).items():
            if kind is GraphKind.BACKWARD or kind in record.fallen_back or record.fallback:
                continue
            for site in ctx.sites:
                decision = ctx.decisions.get(site.id)
                if decision is None or not decision.fp8 or site.id not in budget.sensitivity:
                    continue
                candidate = loka_ops.candidate_name(decision.scaling, decision.a_format, decision.b_format)
                e = output_budget.candidate_error(record.store.summary(keys[site.id]), candidate) \
                    if site.id in keys else None
                errors[site.id] = e if e is not None else budget.error[site.id]
        budget.ne_after = {head.name: sum(head.relative_increase(errors).values()) for head in budget.heads}
        return output_budget.predicted(budget.sensitivity[sid] * e for sid, e in errors.items())


class _SideRuns:
    """Extra runs of a compiled variant on one call's arguments that leave no trace: no
    gradient, no Probe observation, each from the RNG state of the moment this was made (so
    dropout draws alike in every run) with the caller's state restored after, and inputs
    the graph mutates in place (BatchNorm's running statistics) restored to their values."""

    def __init__(self, args):
        self.args = args
        self.float_leaves = []
        self.rng = _rng_state()
        self.inputs = [(a, a.detach().clone(), a._version) for a in args
                       if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)
                       and not a.is_inference()]

    def run(self, variant, args=None) -> list:
        """The floating outputs (copies) of variant(*args) (default: the call's arguments)."""
        caller = _rng_state()
        try:
            _set_rng_state(self.rng)
            with torch.no_grad(), loka_ops.observers_off():
                out = variant(*(self.args if args is None else args))
                self.float_leaves = output_budget.float_leaf_mask(out)  # which output leaves the list holds
                return output_budget.float_outputs(out)
        finally:
            _set_rng_state(caller)
            with torch.no_grad():
                for i, (tensor, saved, version) in enumerate(self.inputs):
                    if tensor._version != version:
                        tensor.copy_(saved)
                        self.inputs[i] = (tensor, saved, tensor._version)


    def run_eager(self, gm: torch.fx.GraphModule, dtype: Optional[torch.dtype]) -> list:
        """The floating outputs of the Dynamo graph run eagerly on the arguments, every
        floating one copied in `dtype` (None: as they are; a graph that rounds its inputs
        itself, `output_budget.floor_graphs`, keeps ids carried in floats exact)."""
        def cast(a):
            if not (isinstance(a, torch.Tensor) and a.is_floating_point()) or dtype is None:
                return a
            return a.detach().to(dtype, copy=True)
        return self.run(gm, [cast(a) for a in self.args])


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# The output budget's check after the FP8 variant compiles: a measured discrepancy over this
# many times the budget is logged as a warning (the prediction missed); with
# `refit_output_budget` the sites are then weighed again at the prediction's measured scale,
# once (`_weigh_at_measured_scale`). The
# sensitivities come from one noise draw per site and FP8 errors are not exactly a
# per-element relative noise, so predictions within 1.5x are taken as agreeing.
VERIFY_SLACK = 1.5


# Calls the output budget waits, window open, for a call whose outputs are not all
# non-finite (`_budget_reference`); after them the window closes without it, reported.
BUDGET_WAIT_CALLS = 8


# The measured noise floor copies the graph's floating inputs once in fp32 and once in bf16;
# above this many bytes of copies the predicted floor stands alone.
FLOOR_RUN_MAX_BYTES = 2 << 30

