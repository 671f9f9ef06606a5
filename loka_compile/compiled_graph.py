"""What the backend returns to Dynamo for one graph (`LokaCompiledGraph`).

With `probe_steps > 0` each graph is compiled twice: a probe variant (observers in, GEMMs
in high precision) that runs for the first `probe_steps` calls, and, when that window
closes, the FP8 variant, compiled then with the Probe's verdicts so that unsafe sites
keep their high-precision GEMM. The second compile runs in the tracing context Dynamo
gave the first (same fake mode and shape environment, so symbolic sizes stay symbolic).
With `recheck_every` the probe variant runs again every N calls; when a re-check changes
a verdict, the FP8 variant is recompiled the same way (once per set of verdicts). With an
output budget the window's close weighs the sites first (`budget_window`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import logging
from typing import Optional

import torch
from torch._inductor.compile_fx import compile_fx

from loka_compile import graph_cache, graph_speed, kernel_builds, probe
from loka_compile.aot_capture import AotCapture
from loka_compile.amax_guard import AmaxGuards, demotion
from loka_compile.budget_window import OutputBudgetWindow
from loka_compile.config import LokaConfig
from loka_compile.fallback import error_text, forget_rewrite, is_dynamo_control, warn_fallback, fall_back_sites
from loka_compile.inductor_compile import inner_compile, weight_input_indices
from loka_compile.inductor_passes import (code_digest, GRAPH_SPEED, inductor_patches, LokaPostGradPass,
                                          verdict_signature)
from loka_compile.kernels import ops as loka_ops
from loka_compile.passes import Amendment, GraphKind, Phase, Reason
from loka_compile.ranks import decide_once
from loka_compile.state import GraphRecord, LokaState


log = logging.getLogger("loka")


def probe_site_keys(record: GraphRecord) -> list:
    """Probe keys of the sites a graph's probe variant observed."""
    return [s.key for ctx in record.contexts_of(Phase.PROBE).values() for s in ctx.sites]


@dataclasses.dataclass
class _GraphSource:
    """What compiling a graph again takes: Dynamo's graph, its example inputs (the first
    call's real tensors), its tracing context, how Dynamo fakified each input, and the
    AOTAutograd capture of its first compile (`aot_capture`).

    Dropped in place (`drop`), not by unsetting the attribute that holds it: Dynamo wraps
    the compiled graph with `functools.wraps`, which copies the instance's attributes into
    the wrapper once, so an attribute set to None later still holds the source there, and
    with it a batch of inputs for the life of the model."""

    gm: Optional[torch.fx.GraphModule]
    example_inputs: Optional[list]
    tracing_context: Optional[object]
    input_contexts: list  # (input tensor, its symbolic context)
    aot: AotCapture = dataclasses.field(default_factory=AotCapture)

    @property
    def kept(self) -> bool:
        return self.gm is not None

    def drop(self) -> None:
        self.gm = self.example_inputs = self.tracing_context = None
        self.input_contexts = []
        self.aot.drop()

    @contextlib.contextmanager
    def tracing(self):
        """Dynamo's tracing context of this graph's compile, with each input's fakification restored."""
        if self.tracing_context is None:
            yield
            return
        for tensor, symbolic_context in self.input_contexts:
            self.tracing_context.tensor_to_context[tensor] = symbolic_context
        context, buckets = self.tracing_context, self.tracing_context.ddp_optimizer_ctx
        if buckets is not None:
            # Under DDP's graph splitting every bucket's lazy backward compile takes its forward
            # metadata from one shared countdown, spent by the first variants: a recompile gets its own.
            context = copy.copy(context)
            context.ddp_optimizer_ctx = own = type(buckets)()
        with torch._guards.tracing(context):
            yield
        if buckets is not None:
            own.curr_bucket, own.metadata_per_bucket = 0, [context.fw_metadata]


class LokaCompiledGraph(OutputBudgetWindow):
    """What the backend returns to Dynamo for one graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, record: GraphRecord, state: LokaState):
        self.record = record
        self.state = state
        self.param_input_indices = weight_input_indices(gm, example_inputs)
        self.calls = 0
        self._budget_waits = 0  # calls the output budget waited for a finite output (`_budget_reference`)
        self._rechecking = False  # the last call ran the probe variant for a re-check
        self._builds = collections.OrderedDict()  # verdict signature -> _Fp8Build, most recent last
        tracing_context = torch._guards.TracingContext.try_get()
        # How Dynamo fakified each input (static or symbolic dims, by source). Dynamo forgets
        # it once this compile returns (torch 2.13 clears the tracing context's
        # tensor_to_context for registered backends); without it a later compile of this
        # graph (the FP8 variant after the probe window, a fallback after a failed first
        # run) would fakify the real inputs afresh, every dim a new symbol, and its sites
        # would have symbolic K and N (on FP8 GPUs: symbolic_k_or_n, high precision).
        input_contexts = [(t, tracing_context.tensor_to_context[t]) for t in example_inputs
                          if isinstance(t, torch.Tensor) and t in tracing_context.tensor_to_context] \
            if tracing_context is not None else []
        if record.config.probe_steps and not record.plan.source:  # a loaded plan skips the window
            record.phase = Phase.PROBE
            state.probing.add(self)
        else:
            record.phase = Phase.FP8
            if record.config.recheck_every:
                log.info("%s: no re-checks: its decisions come from plan %s, without a probe window",
                         record.name, record.plan.source)
        # Kept while this graph may be compiled again: the FP8 variant when the probe window
        # closes, its rebuilds with re-checks, and a compile without loka when a variant fails
        # at its first run (where the compile did not: Inductor's multi-kernel times its
        # sub-kernels then, Triton kernels launch). Dropped after the FP8 variant's first run
        # unless re-checks rebuild it. It holds the first call's inputs (for an LRM's dense
        # graph, a batch of embeddings), so nothing else may keep them past that.
        self._source = _GraphSource(gm, example_inputs, tracing_context, input_contexts)
        self._traced_probe = None  # the probe variant while it runs as traced (`_compile`)
        # The graph speed check runs once, before the FP8 variant's first run (`_check_graph_speed`).
        self._graph_speed_pending = record.config.graph_speed_check != "off"
        self.variants = {record.phase: self._compile(gm, example_inputs, record.phase)}
        self._first_runs = set()  # ids of variants that have run once
        self._steady = None  # the callable each call runs once nothing else is left to do (`_settle`)

    def _compile(self, gm, example_inputs, phase: Phase, codegen: Optional[bool] = None):
        """A variant of the graph; `codegen` None: Inductor generates the FP8 variant's code, and
        the probe variant's only with `LokaConfig.compile_probe` (else it runs as traced)."""
        record = self.record
        if codegen is None:
            codegen = phase is not Phase.PROBE or record.config.compile_probe
        custom_pass = LokaPostGradPass(record, phase, self.param_input_indices)
        compile_inner = functools.partial(inner_compile, record=record, codegen=codegen)
        patches = inductor_patches(record.config, custom_pass)
        try:
            with graph_cache.autograd_cache_off(), self._source.aot.compiling(patches):
                compiled = compile_fx(gm, example_inputs, inner_compile=compile_inner, config_patches=patches)
                if not codegen:
                    self._traced_probe = compiled
                return compiled
        except Exception as error:
            if not record.config.fallback or is_dynamo_control(error):
                raise
            why = f"compile failed: {error_text(error)}"
            warn_fallback(record, why)
            forget_rewrite(record, why, phase=phase)
            return compile_fx(gm, example_inputs, config_patches=inductor_patches(record.config, None))

    def __call__(self, *args):
        steady = self._steady
        if steady is not None:  # nothing but the variant runs per call (`_settle`)
            self.calls += 1
            return steady(*args)
        return self._call(args)

    def _call(self, args: tuple):
        record = self.record
        if record.phase is Phase.PROBE and self.calls >= record.config.probe_steps:
            if self._close_probe_window(args) == "wait":  # no finite output to budget on: not observed either
                self.calls += 1
                with loka_ops.observers_off():
                    return self.variants[Phase.PROBE](*args)
        if self._rechecking:  # the re-check call's backward has run by now, observers and all
            self._rechecking = False
            self._close_recheck()
        if record.amax_guards is not None and record.phase is Phase.FP8 and self._builds \
                and record.amax_guards.due(self.calls):  # the call that copied them back
            self._check_amax_guards()
        self.calls += 1
        every = record.config.recheck_every
        if every and record.phase is Phase.FP8 and self._builds and (self.calls - record.config.probe_steps) % every == 0:
            return self._recheck_call(args)
        # Not while Dynamo compiles: DDP's graph splitting runs each compiled piece once then,
        # inside the compile (its backward would compile inside it too).
        if self._graph_speed_pending and record.phase is Phase.FP8 and torch._guards.TracingContext.try_get() is None:
            self._graph_speed_pending = False
            self._check_graph_speed(args)
            if id(self.variants[Phase.FP8]) in self._first_runs and not record.config.recheck_every \
                    and record.amax_guards is None:
                self._source.drop()  # ran before the check (inside Dynamo's compile); nothing compiles it again
                record.store.release_samples(probe_site_keys(record))
        variant = self.variants[record.phase]
        if id(variant) in self._first_runs:
            out = variant(*args)
            if record.amax_guards is not None and record.amax_guards.due(self.calls):
                record.amax_guards.copy_back()  # the amaxes this call left, read at a later one
            self._settle()
            return out
        try:
            out = variant(*args)
        except Exception as error:
            if not record.config.fallback or is_dynamo_control(error) or not self._source.kept:
                raise
            why = f"first run failed: {error_text(error)}"
        else:
            self._first_runs.add(id(variant))
            if record.phase is Phase.FP8 and not record.config.recheck_every and record.amax_guards is None \
                    and not self._graph_speed_pending:
                self._source.drop()  # nothing compiles this graph again
                record.store.release_samples(probe_site_keys(record))  # nor observes it
            if record.phase is Phase.FP8 and record.amax_guards is not None and record.amax_guards.due(self.calls):
                record.amax_guards.copy_back()
            self._settle()
            return out
        # Out of the except block: the failed run's frames hold its buffers, which under CUDA
        # graphs live in the graph pool, and the plain compile's first run refuses a pool
        # with untracked live tensors.
        gc.collect()
        if variant is self._traced_probe:
            return self._compile_probe_at_first_run(why, args)
        return self._fall_back_at_first_run(why, args)

    def _settle(self) -> None:
        """From now on call the running variant and nothing else, where nothing is left to do per
        call: the FP8 variant (or the probe variant kept as final) has run once, and there are no
        re-checks, amax guards or graph speed check. Without the variant's `disable` wrapper
        (AOTAutograd's): Dynamo calls this object inside one of its own, so it only repeats it."""
        record = self.record
        variant = self.variants[record.phase]
        if record.phase is Phase.FP8 and id(variant) in self._first_runs and not record.config.recheck_every \
                and record.amax_guards is None and not self._graph_speed_pending and not self._rechecking:
            self._steady = _without_disable(variant)

    def _compile_probe_at_first_run(self, why: str, args):
        """The probe variant, run as traced, failed at its first run (an op with no kernel of
        its own outside Inductor's code, memory Inductor's fused kernels do not need): it is
        compiled with Inductor, as the FP8 variant will be, and the call runs it. Its failure
        then goes the way of any variant's first run (`_fall_back_at_first_run`)."""
        record = self.record
        log.warning("loka: %s: the probe variant failed at its first run as traced (%s); compiled with Inductor",
                    record.name, why)
        record.store.forget(self._observed_sites())  # what the failed call observed before failing
        with self._source.tracing():
            self.variants[Phase.PROBE] = self._compile(self._source.gm, self._source.example_inputs, Phase.PROBE,
                                                       codegen=True)
        self._traced_probe = None
        self.calls -= 1  # the call runs again, from the top
        return self(*args)

    def _fall_back_at_first_run(self, why: str, args):
        """The running variant failed at its first run: the graph is compiled again without
        loka and, if that runs, runs so from now on, every site of it reporting
        graph_fallback. If it fails too, the failure is not loka's: it is raised and nothing
        changes."""
        record = self.record
        source = self._source
        with source.tracing():
            plain = compile_fx(source.gm, source.example_inputs, config_patches=inductor_patches(record.config, None))
        out = plain(*args)
        warn_fallback(record, why)
        for ctx in record.contexts.values():
            fall_back_sites(ctx, why)
        record.graph_modules.clear()
        record.store.release_samples(probe_site_keys(record))
        self.state.counters["first_run_fallbacks"] += 1
        # The report reads the contexts of the phase that runs.
        record.contexts = {(Phase.FP8, kind): ctx for kind, ctx in record.contexts_of().items()}
        self.state.probing.discard(self)
        self.state.rechecking.discard(self)
        record.amax_guards = None  # the plain compile has none, and nothing rebuilds it
        self._source.drop()
        record.phase = Phase.FP8
        self.variants = {Phase.FP8: plain}
        self._first_runs.add(id(plain))
        return out

    def _close_probe_window(self, args: Optional[tuple] = None) -> Optional[str]:
        """Judge the observed sites, apply the output budget on `args` (the closing call's
        arguments; without them, as when `calibrate` closes a window, it does not act),
        compile the FP8 variant. Returns "wait" when it did none of it: every output of this
        call is non-finite and the budget waits for the next (`_budget_reference`)."""
        record = self.record
        prepared = self._budget_reference(args)
        if prepared == "wait":
            return prepared  # the window stays open for this call (`_budget_reference`)
        ids = {s.key: s.id for ctx in record.contexts_of(Phase.PROBE).values() for s in ctx.sites}
        keys = list(ids)
        # probe.verdicts logs each verdict with every scaling's bound.
        unsafe, upgraded = decide_once(lambda: _verdicts_by_id(ids, record.config, record.store))
        # Kept by stable id in the graph's own plan: the FP8 variant's sites have the same ids.
        record.plan.unsafe.update(unsafe)
        record.plan.upgraded.update(upgraded)
        measured = self._apply_output_budget(args, prepared)
        self.state.probing.discard(self)
        if record.config.amax_guard:
            record.amax_guards = AmaxGuards.of_window(record.name, self._observed_sites(), self._tensorwise_sites(),
                                                      record.store)
        self.variants[Phase.FP8] = self._probe_variant_as_final() or self._compile_fp8()
        # Whether the budget acted is rank 0's word; this rank's own measurement may have failed.
        if record.output_budget is not None:
            if measured is not None:
                self._verify_output_budget(*measured)
            if self._tighten_output_budget(decide_once(self._weigh_at_measured_scale)):
                self.variants[Phase.FP8] = self._compile_fp8()
                if measured is not None:
                    self._verify_output_budget(*measured)
        if record.config.recheck_every or record.amax_guards is not None:
            self._builds[verdict_signature(record.plan, record.config)] = _Fp8Build(self.variants[Phase.FP8])
        if record.config.recheck_every:
            self.state.rechecking.add(self)
        record.phase = Phase.FP8
        log.info("%s: probe window closed after %d calls; of %d observed sites %d unsafe, %d upgraded%s",
                 record.name, self.calls, len(keys), len(unsafe), len(upgraded),
                 f", {len(record.output_budget.kept)} kept for the output budget" if record.output_budget else "")

    def _probe_variant_as_final(self):
        """The probe variant, to run from now on, when it already is what the FP8 variant
        would compile to: none of its sites was a candidate (no observer, no perturbation,
        no amax guard), every graph of it compiled (training: forward and backward), no
        re-checks. Its contexts become the FP8 phase's; else None."""
        record = self.record
        if self.variants[Phase.PROBE] is self._traced_probe:
            return None  # not compiled: the FP8 variant is the graph's one Inductor compile
        probed = record.contexts_of(Phase.PROBE)
        complete = GraphKind.INFERENCE in probed or {GraphKind.FORWARD, GraphKind.BACKWARD} <= set(probed)
        if not complete or self._observed_sites() or record.amax_guards is not None \
                or record.output_budget is not None or record.config.recheck_every or record.fallen_back:
            return None
        if any(d.reason is Reason.PROBING or d.fp8 for ctx in probed.values() for d in ctx.decisions.values()):
            return None
        for kind, ctx in probed.items():
            record.contexts[(Phase.FP8, kind)] = ctx
            if (Phase.PROBE, kind) in record.graph_modules:
                record.graph_modules[(Phase.FP8, kind)] = record.graph_modules[(Phase.PROBE, kind)]
        self._source.drop()  # nothing compiles this graph again
        log.info("%s: no site was a candidate for FP8; the probe variant runs on, not compiled again", record.name)
        return self.variants[Phase.PROBE]

    def _compile_fp8(self):
        """The FP8 variant, with the plan's verdicts as they stand, in Dynamo's tracing context."""
        source = self._source
        with source.tracing():
            return self._compile(source.gm, source.example_inputs, Phase.FP8)

    # ---- the graph speed check (LokaConfig.graph_speed_check, graph_speed.py) --------------

    def _check_graph_speed(self, args) -> None:
        """Before the FP8 variant's first run: where `graph_speed.skip_reason` lets it, time the
        variant against a high-precision compile of the same graph on this call's inputs and
        keep the faster. Never raises: a failure logs a warning and keeps the FP8 variant."""
        record, config = self.record, self.record.config
        # The forward (or inference) graph's sites: a training backward compiles at its first run.
        decided = [(site, ctx.decisions[site.id]) for kind, ctx in record.contexts_of(Phase.FP8).items()
                   if kind is not GraphKind.BACKWARD for site in ctx.sites if site.id in ctx.decisions]
        gain, sites = graph_speed.predicted_gain([decision for _, decision in decided])
        device = next((site.device for site, decision in decided if decision.fp8), torch.device("cpu"))
        why = graph_speed.skip_reason(config.graph_speed_check, gain, sites, device, config.speed_check)
        if why is None and (record.fallback or record.fallen_back):
            why = "the graph runs without loka's passes"
        if why is None and not self._source.kept:
            why = "its source is no longer kept"
        if why is None:
            why = graph_speed.mutation_skip(getattr(self._source.tracing_context, "fw_metadata", None), args)
        if why is not None:
            if config.graph_speed_check != "off":
                record.graph_speed = graph_speed.GraphSpeed(gain, sites, skipped=why)
                log.log(logging.INFO if sites else logging.DEBUG, "%s: graph speed check: not timed (%s)",
                        record.name, why)
            return
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                record.graph_speed = self._remembered_or_timed(args, gain, sites, device)
        except Exception as error:  # noqa: BLE001  (the check must never cost the model its call)
            if is_dynamo_control(error):
                raise
            record.graph_speed = graph_speed.GraphSpeed(gain, sites, skipped=f"timing failed: {error_text(error)}")
            log.warning("loka: %s: graph speed check failed (%s); the FP8 variant runs", record.name,
                        error_text(error))
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the timing's CUDA graphs and clones

    def _remembered_or_timed(self, args, gain, sites: int, device: torch.device) -> graph_speed.GraphSpeed:
        """The verdict an earlier compile of the same graph timed (the plan's, else the performance
        database's; rank 0's word), applied without timing; else the graph timed (`_time_graph`),
        its verdict remembered in the database."""
        record = self.record
        keys = self._graph_speed_keys(device, graph_speed.captures(record.config.mode, device))
        remembered = decide_once(lambda: self._remembered_verdict(keys, gain, sites)) if keys else None
        if remembered is not None:
            log.info("%s: graph speed check: %s: %s; %s kept, not timed again", record.name,
                     remembered.describe_prediction(), remembered.describe_times(), remembered.kept)
            if remembered.kept != "fp8":
                self._keep_remembered_high_precision(remembered)
            record.graph_speed_key = keys["plan"]
            return remembered
        result = self._time_graph(args, gain, sites, device)
        if keys is not None and result.timed:
            from loka_compile import perfdb  # here: `python -m loka_compile.perfdb` must not find it imported

            perfdb.default_db().put(keys["db"], result.stored())
            record.graph_speed_key = keys["plan"]
        return result

    def _graph_speed_keys(self, device: torch.device, captured: bool) -> Optional[dict]:
        """{"db": the performance database's key of this graph's verdict, "plan": the id a plan
        keeps it under} (`graph_speed.verdict_key`); None without the FP8 variant's forward (or
        inference) graph. The database's key adds the Probe's verdicts and the output budget's
        sites as Dispatch acts on them (the backward's sites follow from them, which the
        forward graph does not show); a plan checks its whole content instead (`Plan.graph_speed`)."""
        record, source = self.record, self._source
        forward = record.graph_modules.get((Phase.FP8, GraphKind.FORWARD)) \
            or record.graph_modules.get((Phase.FP8, GraphKind.INFERENCE))
        if forward is None:
            return None
        key = graph_speed.verdict_key(device, code=code_digest(), config=record.config, captured=captured,
                                      source=graph_cache.source_digest(source.gm, source.example_inputs),
                                      fp8_graph=graph_cache.graph_digest(forward.graph, values=False))
        unsafe, passing = verdict_signature(record.plan, record.config)
        budget = record.output_budget
        kept = (sorted(budget.kept), sorted(budget.made_safe)) if budget is not None else None
        return {"db": dict(key, verdicts=repr((sorted(unsafe), sorted(passing), kept))),
                "plan": graph_speed.key_id(key)}

    def _remembered_verdict(self, keys: dict, gain, sites: int) -> Optional[graph_speed.GraphSpeed]:
        from loka_compile import perfdb  # here: `python -m loka_compile.perfdb` must not find it imported

        plan = self.record.plan
        stored = plan.graph_speed.get(keys["plan"]) if plan.source else None
        if stored is not None:
            found = graph_speed.GraphSpeed.remember(stored, gain, sites, f"plan {plan.source}")
            if found is not None:
                return found
        stored = perfdb.default_db().get(keys["db"])
        return None if stored is None else graph_speed.GraphSpeed.remember(stored, gain, sites,
                                                                            "the performance database")

    def _keep_remembered_high_precision(self, result: graph_speed.GraphSpeed) -> None:
        """A remembered verdict for high precision: its variant compiled (with the mode's CUDA
        graphs) and kept, as a timed one would be; a failed compile leaves the FP8 variant
        running, its contexts restored, and is raised."""
        record = self.record
        running = _Fp8Build(self.variants[Phase.FP8])
        running.stash(record)
        try:
            self._keep_high_precision(result, None)
        except Exception:
            running.restore(record)
            raise

    def _time_graph(self, args, gain, sites: int, device: torch.device) -> graph_speed.GraphSpeed:
        """Compile the high-precision variant, time it against the FP8 one (compiled again
        without Inductor's CUDA graphs in a CUDA-graph mode, where the timing captures its own),
        keep the faster (`_keep_high_precision`). Rank 0 times for every rank (`decide_once`)."""
        record = self.record
        captured = graph_speed.captures(record.config.mode, device)
        inputs, leaves = graph_speed.step_inputs(args)
        running = _Fp8Build(self.variants[Phase.FP8])
        fp8 = graph_speed.Step(self._compile_for_check(cudagraphs=False) if captured else running.compiled,
                               inputs, leaves)
        fp8()  # a training variant's backward compiles at its first run, its contexts with the forward's
        running.stash(record)
        # A fallback of the high-precision variant's compile is the check's, not the graph's.
        kept = record.fallback, dict(record.fallen_back), record.warned
        try:
            high = _Fp8Build(self._compile_for_check(high_precision=_HIGH_PRECISION_WHY, cudagraphs=not captured))
            steps = {"fp8": fp8, "hp": graph_speed.Step(high.compiled, inputs, leaves)}
            steps["hp"]()
            high.stash(record)
            if (record.fallback, record.fallen_back) != kept[:2]:
                raise RuntimeError("the high-precision variant fell back to Inductor without loka's passes")
            kernel_builds.wait()  # no compile thread beside the timed steps (host-bound graphs feel it)
            times = decide_once(lambda: graph_speed.time_steps(steps, device, captured))
        except Exception:
            running.restore(record)
            record.fallback, record.fallen_back, record.warned = kept
            raise
        result = graph_speed.verdict(times, gain, sites, fp8.training)
        log.info("%s: graph speed check: %s: %s; %s kept", record.name, result.describe_prediction(),
                 result.describe_times(), result.kept)
        if result.kept == "fp8":
            running.restore(record)
            return result
        try:
            self._keep_high_precision(result, None if captured else high)
        except Exception:  # compiling it with the mode's CUDA graphs failed: the FP8 variant runs on
            running.restore(record)
            raise
        return result

    def _compile_for_check(self, high_precision: str = "", cudagraphs: bool = True):
        """A variant for the graph speed check, in Dynamo's tracing context: the FP8 one, or with
        `high_precision` (the why of its sites' amendment) the high-precision one; `cudagraphs`
        False: without the mode's CUDA graphs. A failure is raised (the check then keeps the
        running variant)."""
        record, source = self.record, self._source
        custom_pass = LokaPostGradPass(record, Phase.FP8, self.param_input_indices, high_precision=high_precision)
        patches = inductor_patches(record.config, custom_pass)
        if not cudagraphs:
            patches["triton.cudagraphs"] = False
        with source.tracing(), graph_cache.autograd_cache_off(), source.aot.compiling(patches):
            return compile_fx(source.gm, source.example_inputs, config_patches=patches,
                              inner_compile=functools.partial(inner_compile, record=record, codegen=True))

    def _keep_high_precision(self, result: graph_speed.GraphSpeed, timed: Optional["_Fp8Build"]) -> None:
        """High precision timed faster: it runs from now on, the FP8 sites amended by
        `graph_speed` with both times; `timed` is the variant that was timed, None where it ran
        without the mode's CUDA graphs (then compiled again with them). Nothing rebuilds the
        FP8 variant after this (re-checks and the amax guard stop)."""
        record = self.record
        why = f"the whole graph timed {result.describe_times()}"
        _drop_fp8(record)
        if timed is None:
            self.variants[Phase.FP8] = self._compile_for_check(high_precision=why)
        else:
            timed.restore(record)
            self.variants[Phase.FP8] = timed.compiled
            for ctx in record.contexts_of(Phase.FP8).values():
                ctx.amendments[:] = [dataclasses.replace(a, why=why) if a.by == GRAPH_SPEED else a
                                     for a in ctx.amendments]
                ctx.decisions.update({sid: dataclasses.replace(d, detail=why) for sid, d in ctx.decisions.items()
                                      if d.reason is Reason.GRAPH_SLOWER_THAN_BF16})
        record.amax_guards = None
        self._builds.clear()
        self.state.rechecking.discard(self)

    # ---- re-checks (LokaConfig.recheck_every) ------------------------------------------

    def _observed_sites(self) -> dict:
        """key -> (site id, own scaling) of the sites the probe variant observes."""
        return {site.key: (site.id, ctx.decisions[site.id].scaling)
                for ctx in self.record.contexts_of(Phase.PROBE).values() for site in ctx.sites
                if site.id in ctx.decisions and ctx.decisions[site.id].reason is Reason.PROBING}

    def _recheck_call(self, args):
        """One call through the probe variant, its observations the only ones the store
        holds for these sites (a fresh window); the next call judges them."""
        record = self.record
        record.store.forget(self._observed_sites())
        self._rechecking = True
        self.state.counters["rechecks"] += 1
        try:
            return self.variants[Phase.PROBE](*args)
        except Exception as error:  # noqa: BLE001  (a re-check must never cost the model its call)
            self._rechecking = False
            log.warning("loka: %s: re-check at call %d failed (%s: %s); the call runs the FP8 variant",
                        record.name, self.calls, type(error).__name__, error)
            return self.variants[Phase.FP8](*args)

    def _close_recheck(self) -> None:
        record = self.record
        saved = dict(record.plan.unsafe), dict(record.plan.upgraded)
        try:
            self._judge_recheck()
        except Exception as error:  # noqa: BLE001  (keep the running graph and the verdicts it was built with)
            record.plan.unsafe, record.plan.upgraded = saved
            log.warning("loka: %s: re-check at call %d failed (%s: %s); the graph keeps its decisions",
                        record.name, self.calls, type(error).__name__, error)

    def _judge_recheck(self) -> None:
        """Each site the re-check call observed is judged afresh from those observations
        alone; a change of verdict is logged and kept in the plan's history, and the FP8
        variant is switched to one built with the new verdicts (compiled once per set)."""
        record, config, step = self.record, self.record.config, self.calls
        store = record.store
        sites = {key: (sid, own) for key, (sid, own) in self._observed_sites().items() if store.observed(key)}
        unsafe, upgraded = decide_once(lambda: _verdicts_by_id({k: sid for k, (sid, _) in sites.items()}, config,
                                                               store, log_level=logging.DEBUG))
        # The output budget decided once, at the window's close: its sites stay kept.
        kept = record.output_budget.kept if record.output_budget is not None else {}
        unsafe.update({sid: record.plan.unsafe[sid] for sid, _ in sites.values()
                       if sid in kept and sid not in unsafe and sid in record.plan.unsafe})
        made_safe = record.output_budget.upgraded if record.output_budget is not None else {}
        upgraded.update({sid: made_safe[sid] for sid, _ in sites.values()
                         if sid in made_safe and sid not in unsafe and sid not in upgraded})
        plan = record.plan
        changes = []
        for key, (sid, own) in sites.items():
            before = _standing(sid, own, plan.unsafe, plan.upgraded)
            after = _standing(sid, own, unsafe, upgraded)
            if before != after:
                why = probe.describe_summary(store.summary(key), config.max_probe_error, config.probe_metric)
                changes.append((sid, before, after, why))
            plan.unsafe.pop(sid, None)
            plan.upgraded.pop(sid, None)
        plan.unsafe.update(unsafe)
        plan.upgraded.update(upgraded)
        signature = verdict_signature(plan, config)
        if signature == next(reversed(self._builds)):
            log.debug("%s: re-check at call %d: no verdict changed", record.name, step)
            return
        rebuilt = self._switch_build(signature)
        for sid, before, after, steps in changes:
            demoted = _CHAIN_RANK.get(after, 0) > _CHAIN_RANK.get(before, 0)
            plan.history.setdefault(sid, []).append(
                {"step": step + 1, "observed_at": step, "graph": record.name, "from": before, "to": after,
                 "change": "demoted" if demoted else "promoted", "detail": steps})
            record.verdict_amendments.append(Amendment(sid, "re-check", steps, (("verdict", before, after),)))
            log.log(logging.WARNING if demoted else logging.INFO,
                    "loka re-check: %s site %s %s %s -> %s from call %d (%s)", record.name, sid,
                    "demoted" if demoted else "promoted", before, after, step + 1, steps)
        log.info("%s: re-check at call %d changed %d verdict(s); FP8 variant %s", record.name, step, len(changes),
                 "rebuilt" if rebuilt else "reused from an earlier build with the same verdicts")

    # ---- the amax guard (amax_guard.py) -------------------------------------------------

    def _tensorwise_sites(self) -> dict:
        """site id -> (a_format, b_format) of the observed sites the verdicts keep in their
        own scaling, for the amax guard (it acts on those that run tensorwise)."""
        plan = self.record.plan
        return {site.id: (ctx.decisions[site.id].a_format, ctx.decisions[site.id].b_format)
                for ctx in self.record.contexts_of(Phase.PROBE).values() for site in ctx.sites
                if site.id in ctx.decisions and site.id not in plan.unsafe and site.id not in plan.upgraded}

    def _check_amax_guards(self) -> None:
        """Sites whose amax guard tripped since the last call go rowwise (high precision
        where the window measured no finer scaling within the bound), amended in the plan
        as a re-check amends it: logged, kept in its history, the FP8 variant switched."""
        record, config, plan = self.record, self.record.config, self.record.plan
        # A trip on any rank demotes the site on all (each rank's amaxes are its own data).
        trips = decide_once(record.amax_guards.trips, merge=_first_reason_per_site)
        if not trips:
            return
        keys = {sid: key for key, (sid, _) in self._observed_sites().items()}

        def demotions():  # from the window's statistics, rank 0's when distributed
            return {sid: demotion(record.store.summary(keys[sid]) if sid in keys else {}, config.max_probe_error,
                                  config.probe_metric, why)
                    for sid, why in trips.items() if sid not in plan.unsafe and sid not in plan.upgraded}

        moves = decide_once(demotions)
        saved = dict(plan.unsafe), dict(plan.upgraded)
        changes = []
        for sid, (table, entry) in moves.items():  # a site moved already had a trip still in flight when it was
            (plan.upgraded if table == "upgraded" else plan.unsafe)[sid] = entry
            changes.append((sid, _standing(sid, "tensorwise", plan.unsafe, plan.upgraded), trips[sid]))
        record.amax_guards.forget(trips)
        if not changes:
            return
        try:
            rebuilt = self._switch_build(verdict_signature(plan, config))
        except Exception as error:  # noqa: BLE001  (keep the running graph and the verdicts it was built with)
            plan.unsafe, plan.upgraded = saved
            log.warning("loka: %s: amax guard at call %d: rebuilding failed (%s: %s); the graph keeps its decisions",
                        record.name, self.calls, type(error).__name__, error)
            return
        self.state.counters["amax_guard_demotions"] += len(changes)
        for sid, after, why in changes:
            plan.history.setdefault(sid, []).append(
                {"step": self.calls + 1, "observed_at": self.calls, "graph": record.name, "from": "tensorwise",
                 "to": after, "change": "demoted", "detail": why, "by": "amax_guard"})
            record.verdict_amendments.append(Amendment(sid, "amax_guard", why, (("verdict", "tensorwise", after),)))
            log.warning("loka amax guard: %s site %s demoted tensorwise -> %s from call %d (%s)", record.name, sid,
                        after, self.calls + 1, why)
        log.info("%s: amax guard at call %d changed %d verdict(s); FP8 variant %s", record.name, self.calls,
                 len(changes), "rebuilt" if rebuilt else "reused from an earlier build with the same verdicts")

    def _switch_build(self, signature) -> bool:
        """Make the FP8 variant for `signature` the running one (its pass contexts and
        graphs the record's, for reports and plans); True when it had to be compiled."""
        record = self.record
        current = next(reversed(self._builds))
        self._builds[current].stash(record)
        build = self._builds.pop(signature, None)
        if build is None:
            try:
                build = _Fp8Build(self._compile_fp8())
            except Exception:
                self._builds[current].restore(record)
                raise
        self._builds[signature] = build
        while len(self._builds) > _MAX_FP8_BUILDS:
            self._builds.popitem(last=False)
        build.restore(record)
        self.variants[Phase.FP8] = build.compiled
        return build.contexts is None


# The why of the high-precision variant's amendments while it is timed (the times replace it).
_HIGH_PRECISION_WHY = "the graph speed check's high-precision variant, timed against the FP8 one"


# FP8 variants a re-checking graph keeps, one per set of verdicts, so that a site whose bound
# hovers at the budget costs a switch rather than a compile at each re-check.
_MAX_FP8_BUILDS = 4


# Rank of a verdict along the upgrade chain: moving up is a demotion.
_CHAIN_RANK = {**{s: i for i, s in enumerate(probe.CHAIN_ORDER)}, "high precision": len(probe.CHAIN_ORDER)}


class _Fp8Build:
    """One compiled FP8 variant, and, while another runs, its pass contexts and graphs
    (a training graph's backward is compiled at its first backward, so they are taken when
    the variant stops running)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.contexts = None
        self.graph_modules = None

    def stash(self, record: GraphRecord) -> None:
        self.contexts = {k: record.contexts.pop(k) for k in [k for k in record.contexts if k[0] is Phase.FP8]}
        self.graph_modules = {k: record.graph_modules.pop(k) for k in [k for k in record.graph_modules
                                                                       if k[0] is Phase.FP8]}

    def restore(self, record: GraphRecord) -> None:
        """The stashed contexts and graphs in place of the record's FP8 ones (a failed or
        replaced variant's); a build never stashed leaves the record as it is."""
        if self.contexts is None:
            return
        _drop_fp8(record)
        record.contexts.update(self.contexts)
        record.graph_modules.update(self.graph_modules)


def _drop_fp8(record: GraphRecord) -> None:
    for key in [key for key in record.contexts if key[0] is Phase.FP8]:
        record.contexts.pop(key)
        record.graph_modules.pop(key, None)


def _without_disable(fn):
    """`fn` out of the recursive `torch._dynamo.disable` wrappers around it: only those (a
    wrapper that compiles, or lets the functions it calls compile, is kept), and only a
    wrapper's own marks (`functools.wraps` copies them onto a function that wraps one, whose
    wrapper id is then not its own)."""
    while getattr(fn, "_torchdynamo_disable", False) and getattr(fn, "_torchdynamo_disable_recursive", True) \
            and callable(getattr(fn, "_torchdynamo_orig_callable", None)) \
            and getattr(fn, "_torchdynamo_wrapper_id", id(fn)) == id(fn):
        fn = fn._torchdynamo_orig_callable
    return fn


def _standing(sid: str, own: str, unsafe: dict, upgraded: dict) -> str:
    """Where verdicts put a site: its own scaling, an upgrade's target, or high precision."""
    if sid in unsafe:
        return "high precision"
    if sid in upgraded:
        target = upgraded[sid][0]
        return target if isinstance(target, str) else "rowwise"  # plans from before the chain
    return own


def _verdicts_by_id(ids: dict, config: LokaConfig, store: probe.ProbeStore,
                    log_level: int = logging.WARNING) -> tuple[dict, dict]:
    """The Probe's (unsafe, upgraded) verdicts for sites key -> id of `store`, keyed by id; an
    unsafe site is upgraded along tensorwise -> rowwise -> blockwise where a finer scaling's
    bound is within the budget."""
    unsafe, upgraded = probe.verdicts(store, list(ids), config.max_probe_error, metric=config.probe_metric, chain=True,
                                      log_level=log_level)
    return {ids[k]: v for k, v in unsafe.items()}, {ids[k]: tuple(v) for k, v in upgraded.items()}


def _first_reason_per_site(trips_per_rank: list) -> dict:
    """The ranks' amax guard trips merged: every site that tripped on any rank, with the
    reason of the lowest rank that saw it."""
    merged = {}
    for trips in trips_per_rank:
        for sid, why in trips.items():
            merged.setdefault(sid, why)
    return merged
