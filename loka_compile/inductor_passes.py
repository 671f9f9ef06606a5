"""loka's Inductor custom graph passes: the post-grad pass that runs loka's pipeline on each
ATen graph (`LokaPostGradPass`), the joint-graph pass of the saved_fp8 and weight_both_layouts
Mods (`LokaJointPass`), the provenance pre-pass, and the Inductor config a loka compile patches in."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import inspect
import logging
import pathlib
import sys
from typing import Optional

import torch
from torch._inductor import list_mode_options
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from loka_compile import dispatch, graph_cache, kernel_builds, passes, speed
from loka_compile.config import LokaConfig
from loka_compile.fallback import error_text
from loka_compile.kernels import ops as loka_ops
from loka_compile.passes import Decision, graph_kind, mods, PassContext, Phase, Reason, run_passes
from loka_compile.passes.find_sites import keep_gemm_provenance
from loka_compile.passes.mods import fused_casts, pair_products, saved_fp8, weight_both_layouts
from loka_compile.passes.mods.saved_fp8 import check_saves, find_operands, save_fp8_operands, SavedFp8
from loka_compile.passes.mods.weight_both_layouts import (check_shared, find_shared_weights, share_weight_casts,
                                                          WeightLayouts)
from loka_compile.passes.rewrite import all_or_nothing
from loka_compile.plan import Plan
from loka_compile.state import GraphRecord


log = logging.getLogger("loka")

# Who amends the sites of the graph speed check's high-precision variant (`Amendment.by`).
GRAPH_SPEED = "graph_speed"


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """loka's code: the passes, the kernels they trace into graphs, Dispatch and the rest
    of the package (a cached graph compiled by other code is not reused)."""
    digest = hashlib.sha256()
    for folder in (pathlib.Path(passes.__file__).parent, pathlib.Path(loka_ops.__file__).parent,
                   pathlib.Path(dispatch.__file__).parent):
        for path in sorted(folder.rglob("*.py")):  # passes/mods/ too
            digest.update(path.read_bytes())
    return digest.hexdigest()


class LokaPostGradPass(CustomGraphPass):
    """Runs loka's pass pipeline on one post-grad ATen graph (forward or backward)."""

    def __init__(self, record: GraphRecord, phase: Phase, param_input_indices: frozenset, high_precision: str = ""):
        self.record = record
        self.phase = phase
        self.param_input_indices = param_input_indices
        # The graph speed check's high-precision variant: every FP8 decision amended by
        # `graph_speed`, this the why (`graph_speed.py`).
        self.high_precision = high_precision
        self.digests = {}  # GraphKind -> digest of the graph as the passes left it (graph_cache)
        # Dispatch decides each site once per compile of a variant: the joint-graph Mods' call
        # (LokaJointPass) is the decision the forward and backward graphs' passes read.
        self.decided = DecidedOnce()

    def __call__(self, graph: torch.fx.Graph) -> None:
        if in_higher_order_op_body():
            return  # a branch or loop body: its GEMMs stay as they are (`hop_sites` reports them)
        # A failure here reaches `inner_compile`, which compiles the untouched graph.
        record = self.record
        kind = graph_kind(graph)
        # Static activation scales (a calibrated plan) serve inference graphs only.
        static = dict(record.plan.a_scales) if kind is passes.GraphKind.INFERENCE and record.plan.source else {}
        ctx = PassContext(graph=record.name, kind=kind, phase=self.phase,
                          param_input_indices=self.param_input_indices, decide=None,
                          inactive_mods=record.config.inactive_mods, static_a_scales=static,
                          perturb_outputs=self.phase is Phase.PROBE and record.config.output_budget_on,
                          speed_check=record.config.speed_check, time_chain=speed.chain_timing,
                          providers=tuple(record.config.providers or ()))
        ctx.decide = functools.partial(_decide, record=record, phase=self.phase, ctx=ctx, decided=self.decided,
                                       high_precision=self.high_precision)
        if self.phase is Phase.FP8 and record.amax_guards is not None:
            ctx.amax_guard_prefix, ctx.window_amax = record.amax_guards.prefix, record.amax_guards.window_amax
        # Recorded first, so that the sites of a graph whose passes fail are reported.
        record.contexts[(self.phase, kind)] = ctx
        if kind is passes.GraphKind.INFERENCE and self.phase is not Phase.PROBE \
                and pair_products.MOD.on(record.config.inactive_mods):
            _rewrite_pair_products(graph, record)  # a training graph's is the joint graph's (LokaJointPass)
        saved, layouts = (record.mod_results.get(mod.name) for mod in (saved_fp8.MOD, weight_both_layouts.MOD))
        if kind is passes.GraphKind.FORWARD and saved is not None:
            check_saves(graph, saved)  # as partitioned, before lower renames what it rewrites
        if kind is passes.GraphKind.FORWARD and layouts is not None:
            check_shared(graph, layouts)
        run_passes(graph, ctx)
        if self.phase is Phase.FP8:
            kernel_builds.start(graph)  # loka's own Triton kernels, built while Inductor generates the rest
        if ctx.amax_guard_prefix:
            record.amax_guards.register(graph)  # the guard op's buffer, before the graph first runs
        record.graph_modules[(self.phase, kind)] = graph.owning_module
        if inductor_config.fx_graph_cache and graph_cache.bypass_reason(
                self.phase, kind, record.config.inactive_mods, self.param_input_indices) is None:
            self.digests[kind] = graph_cache.graph_digest(graph)  # only a cacheable graph needs one
        if record.plan.source:
            missing = [site.id for site in ctx.sites if site.id not in record.plan.sites]
            if missing:
                log.warning("loka plan %s holds no decision for %d site(s) of %s/%s, decided here: %s",
                            record.plan.source, len(missing), record.name, kind.value, missing)
        fp8 = sum(d.fp8 for d in ctx.decisions.values())
        log.info("%s/%s (%s): %d GEMM sites, %d in FP8", record.name, kind.value, self.phase.value, len(ctx.sites), fp8)

    def uuid(self) -> str:
        """Part of Inductor's FX graph cache key: what the graph after loka's passes
        follows from besides the graph itself. The plan's verdicts as Dispatch acts on
        them (their measured values only reach the report, which a hit records afresh);
        a probe graph's name, which its site keys carry (`graph_cache` checks the rest)."""
        record, plan = self.record, self.record.plan
        unsafe, passing = verdict_signature(plan, record.config)
        verdicts = sorted(unsafe), sorted(passing), plan.digest() if plan.source else ""
        name = record.name if self.phase is Phase.PROBE else ""
        guards = record.amax_guards if self.phase is Phase.FP8 else None  # their ops carry its prefix and limits
        guards = "" if guards is None else f"{guards.prefix}|{sorted(guards.window_amax.items())}"
        variant = "high precision" if self.high_precision else ""
        return hashlib.sha256(f"{code_digest()}|{record.config}|{self.phase.value}|{name}|{verdicts}|{guards}"
                              f"|{variant}".encode()).hexdigest()


class LokaJointPass(CustomGraphPass):
    """On the joint graph of each training compile: the saved_fp8 Mod, where it is active
    and the graph is past its probe window (a failure leaves the joint graph as it was, and
    is logged, unless fallback is off), and the count of the forward's own outputs, which
    the forward graph's check of what it saves for the backward needs (`check_saves`)."""

    def __init__(self, post_grad: LokaPostGradPass):
        self.post_grad = post_grad

    def __call__(self, graph: torch.fx.Graph) -> None:
        if graph_kind(graph) is not passes.GraphKind.BACKWARD or in_higher_order_op_body():
            return  # Inductor runs its joint-graph passes on inference graphs and on bodies too
        record, phase = self.post_grad.record, self.post_grad.phase
        inactive = record.config.inactive_mods
        if phase is not Phase.PROBE and pair_products.MOD.on(inactive):
            _rewrite_pair_products(graph, record)
        # What the forward saves is measured with saved_fp8 off too (the report compares it).
        saved = record.mod_results[saved_fp8.MOD.name] = SavedFp8.of_joint_graph(graph)
        record.mod_results.pop(weight_both_layouts.MOD.name, None)
        if phase is Phase.PROBE:
            return
        if weight_both_layouts.MOD.on(inactive):
            self._share_weight_casts(graph)
        if not saved_fp8.MOD.on(inactive):
            return
        ctx = self._joint_context(graph)
        try:
            found = find_operands(graph, ctx, saved)
            if found:  # the copy all_or_nothing keeps costs compile time: only when rewriting
                with all_or_nothing(graph.owning_module):
                    save_fp8_operands(found, fused_casts.MOD.on(inactive), saved)
        except Exception as error:
            if not record.config.fallback:
                raise
            record.mod_results[saved_fp8.MOD.name] = SavedFp8.of_joint_graph(graph)
            log.warning("loka: %s: the saved_fp8 Mod failed on the joint graph (%s); the backward casts its "
                        "operands itself", record.name, error_text(error))
            return
        log.info("%s: saved_fp8: %d operands, declined %s", record.name, len(saved.operands), dict(saved.declined))

    def _joint_context(self, graph: torch.fx.Graph) -> PassContext:
        record, phase = self.post_grad.record, self.post_grad.phase
        guards = record.amax_guards if phase is Phase.FP8 else None  # the saved_fp8 Mod's casts carry them
        ctx = PassContext(graph=record.name, kind=passes.GraphKind.BACKWARD, phase=phase,
                          param_input_indices=self.post_grad.param_input_indices, decide=None,
                          inactive_mods=record.config.inactive_mods, joint=True,
                          amax_guard_prefix=guards.prefix if guards else "",
                          window_amax=guards.window_amax if guards else {})
        ctx.decide = functools.partial(_decide, record=record, phase=phase, ctx=ctx, decided=self.post_grad.decided,
                                       high_precision=self.post_grad.high_precision)
        return ctx

    def _share_weight_casts(self, graph: torch.fx.Graph) -> None:
        """The weight_both_layouts Mod (a failure leaves the joint graph as it was, and is
        logged, unless fallback is off)."""
        record = self.post_grad.record
        layouts = WeightLayouts()
        try:
            shared = find_shared_weights(graph, self._joint_context(graph), layouts)
            if shared:
                with all_or_nothing(graph.owning_module):
                    share_weight_casts(shared, layouts)
        except Exception as error:
            if not record.config.fallback:
                raise
            log.warning("loka: %s: the weight_both_layouts Mod failed on the joint graph (%s); each GEMM casts "
                        "its weight itself", record.name, error_text(error))
            return
        record.mod_results[weight_both_layouts.MOD.name] = layouts
        log.info("%s: weight_both_layouts: %s", record.name, layouts.summary())

    def uuid(self) -> str:
        return hashlib.sha256(f"joint|{self.post_grad.uuid()}".encode()).hexdigest()


def _rewrite_pair_products(graph: torch.fx.Graph, record: GraphRecord) -> None:
    """The pair_products Mod on a joint or inference graph (a failure leaves the graph as it
    was, and is logged, unless fallback is off)."""
    try:
        with all_or_nothing(graph.owning_module):
            rewritten = pair_products.rewrite_pair_products(graph)
    except Exception as error:
        if not record.config.fallback:
            raise
        log.warning("loka: %s: the pair_products Mod failed (%s); the pairs stay concatenated", record.name,
                    error_text(error))
        return
    record.mod_results[pair_products.MOD.name] = rewritten
    log.info("%s: pair_products: %d", record.name, rewritten)


class DecidedOnce:
    """Dispatch's decision per site id, made at the first `ctx.decide` of a compile and read by
    every later one: the joint graph's Mods decide a site that the forward or backward graph
    finds again under the same id. A site found again as another GEMM (a shape, role or operand
    that differs) is decided afresh, logged."""

    def __init__(self):
        self._first: dict = {}  # site id -> (what the decision depends on, Decision)

    @staticmethod
    def _gemm(site, kwargs) -> tuple:
        return (site.op, site.role, site.shape, site.batch, site.dtype, site.device, site.module, site.unit_scalars,
                site.a_is_grad, site.b_is_grad, sorted((k, v) for k, v in kwargs.items() if v))  # a_static=False: none

    def get(self, site, make, **kwargs) -> Decision:
        gemm = self._gemm(site, kwargs)
        first = self._first.get(site.id)
        if first is not None and first[0] == gemm:
            return first[1]
        if first is not None:
            log.info("loka: site %s is found again as another GEMM (%s, was %s); decided afresh", site.id, gemm,
                     first[0])
        decision = make(site, **kwargs)
        self._first[site.id] = gemm, decision
        return decision


def _decide(site, record: GraphRecord, phase: Phase, ctx: PassContext, decided: DecidedOnce,
            high_precision: str = "", **kwargs) -> Decision:
    """Dispatch's decision from the per-site verdicts, made once per site of the compile
    (`decided`); a site the output budget keeps in high precision (in the plan's unsafe
    verdicts beside them) is then amended by the budget in `ctx`, with its reason; in the
    graph speed check's high-precision variant (`high_precision`: why) every FP8 site is
    amended by `graph_speed`."""
    kept = record.output_budget.kept if record.output_budget is not None else {}
    plan = record.plan
    if site.id in kept:  # decided as if safe, then amended below; not timed, since it stays high precision
        plan = dataclasses.replace(plan, unsafe={sid: e for sid, e in plan.unsafe.items() if sid not in kept})
        kwargs = {**kwargs, "untimed": "the output budget keeps it in high precision"}
    decision = decided.get(site, functools.partial(dispatch.decide, config=record.config, phase=phase, plan=plan),
                           **kwargs)
    if site.id in kept and decision.fp8:
        decision = ctx.amend(site, "output_budget", kept[site.id], decision=decision, fp8=False,
                             reason=Reason.PROBE_UNSAFE, detail=kept[site.id])
    made_safe = record.output_budget.made_safe if record.output_budget is not None else {}
    if site.id in made_safe and decision.fp8:  # its finer scaling is the budget's, in plan.upgraded
        decision = ctx.amend(site, "output_budget", made_safe[site.id], decision=decision,
                             detail="; ".join(filter(None, (made_safe[site.id], decision.detail))))
    if high_precision and decision.fp8:
        decision = ctx.amend(site, GRAPH_SPEED, high_precision, decision=decision, fp8=False,
                             reason=Reason.GRAPH_SLOWER_THAN_BF16, detail=high_precision)
    return decision


@functools.lru_cache(maxsize=None)
def _graph_pass_drivers() -> tuple:
    """(code of Inductor's recursive drivers of its post-grad and joint-graph passes, code
    of AOTAutograd's driver of the joint-graph passes on invoke_subgraph bodies); absent
    ones left out."""
    from torch._functorch._aot_autograd import graph_compile
    from torch._inductor import compile_fx as inductor

    def code(module, name):
        fn = getattr(module, name, None)
        return inspect.unwrap(fn).__code__ if fn is not None else None

    recursive = {code(inductor, "_recursive_post_grad_passes"), code(inductor, "_recursive_joint_graph_passes")}
    return frozenset(recursive - {None}), code(graph_compile, "run_joint_graph_passes_on_hops")


def in_higher_order_op_body() -> bool:
    """Whether Inductor is running its graph passes (loka's among them) on the body of a
    higher-order op: a torch.cond branch, a while_loop's condition or body, an
    invoke_subgraph region. Inductor runs them on each body first, then on the graph that
    calls it, through the same recursive function, and tells a pass nothing of where the
    graph sits: a body's passes run inside two or more frames of it (or inside AOTAutograd's
    partitioning of an invoke_subgraph body), a compiled graph's inside one. loka leaves
    bodies as they are (their sites are reported from the calling graph, `hop_sites`)."""
    recursive, hop_partition = _graph_pass_drivers()
    depth = collections.Counter()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in recursive:
            depth[frame.f_code] += 1
        elif frame.f_code is hop_partition:
            return True
        frame = frame.f_back
    return any(n > 1 for n in depth.values())


class LokaProvenancePass(CustomGraphPass):
    """Before Inductor's post-grad patterns: each gradient addition keeps the module of the
    GEMM it adds (`find_sites.keep_gemm_provenance`), which Inductor's mm + add -> addmm
    fusion would drop; then the user's own pre-pass, if one was set."""

    def __init__(self, user_pass):
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not in_higher_order_op_body():
            keep_gemm_provenance(graph)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> str:
        user = self.user_pass.uuid() if isinstance(self.user_pass, CustomGraphPass) else repr(self.user_pass)
        return hashlib.sha256(f"{code_digest()}|{user}".encode()).hexdigest()


def inductor_patches(config: LokaConfig, custom_pass: Optional[CustomGraphPass]) -> dict:
    """Inductor's config for a loka compile (`custom_pass` None: a plain compile, as a
    fallback)."""
    patches = dict(list_mode_options(config.mode))
    if patches.get("triton.cudagraphs"):
        # A cache hit for a graph compiled after the probe window failed inside Inductor (docs/design.md).
        patches["fx_graph_cache"] = False
    if custom_pass is not None:
        patches["post_grad_custom_pre_pass"] = LokaProvenancePass(inductor_config.post_grad_custom_pre_pass)
        patches["post_grad_custom_post_pass"] = custom_pass
        if isinstance(custom_pass, LokaPostGradPass):  # not an export's (inference) pass
            patches["joint_custom_post_pass"] = LokaJointPass(custom_pass)
        patches.update(mods.inductor_settings(config.inactive_mods, lambda name: hasattr(inductor_config, name)))
    return patches


def verdict_signature(plan: Plan, config: LokaConfig) -> tuple:
    """What of the plan's verdicts Dispatch acts on: the unsafe sites, and per upgraded
    site the finer scalings within the budget (it takes the first a provider runs)."""
    passing = {sid: tuple(s for s, bound in dispatch.upgrade_steps(entry)[1:] if bound <= config.max_probe_error)
               for sid, entry in plan.upgraded.items()}
    return frozenset(plan.unsafe), frozenset(passing.items())
