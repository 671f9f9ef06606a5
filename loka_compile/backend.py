"""The `loka` torch.compile backend: a thin entry that parses options into LokaConfig and
hands each Dynamo graph to Inductor with loka's passes installed as Inductor's post-grad
custom pass. AOTAutograd, decompositions, `mode=` (CUDA graphs, max-autotune) and dynamic
shapes all stay Inductor's; loka's passes see the forward and backward ATen graphs just
before lowering.

With `probe_steps > 0` each graph is compiled twice: a probe variant (observers in, GEMMs
in high precision) that runs for the first `probe_steps` calls, and, when that window
closes, the FP8 variant, compiled then with the Probe's verdicts so that unsafe sites
keep their high-precision GEMM. The second compile runs in the tracing context Dynamo
gave the first (same fake mode and shape environment, so symbolic sizes stay symbolic).
With `recheck_every` the probe variant runs again every N calls; when a re-check changes
a verdict, the FP8 variant is recompiled the same way (once per set of verdicts).

With an output budget (`max_output_error`), the window's close also measures each forward
site's sensitivity on the closing call's arguments (the probe variant once plain, once per
site with noise at that site's output), keeps in high precision the sites the budget cannot
afford (`output_budget`), and after the FP8 variant compiles measures its outputs' distance
from the probe variant's on the same arguments.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import inspect
import logging
import math
import operator
import os
import pathlib
import sys
import time
import traceback
import unittest.mock
from typing import Optional

import torch
from torch._inductor import list_mode_options
from torch._inductor import config as inductor_config
from torch._inductor import fx_utils
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass

from loka_compile import dispatch, graph_cache, output_budget, passes, probe, ranks, speed
from loka_compile.state import LokaState, next_graph_name, state_for_compile
from loka_compile.ranks import decide_once
from loka_compile.amax_guard import AmaxGuards, demotion
from loka_compile.config import LokaConfig
from loka_compile.kernels import ops as loka_ops
from loka_compile.output_budget import OutputBudget
from loka_compile.passes import Decision, GraphKind, PassContext, Reason, Role, graph_kind, run_passes
from loka_compile.passes import mods
from loka_compile.passes.find_sites import clean_module_path, keep_gemm_provenance
from loka_compile.passes.mods import fused_casts, saved_fp8, weight_both_layouts
from loka_compile.passes.mods.cached_weights import RefreshingGraph, WeightCache, check_after_call
from loka_compile.passes.mods.saved_fp8 import SavedFp8, check_saves, find_operands, save_fp8_operands
from loka_compile.passes.mods.weight_both_layouts import (WeightLayouts, check_shared, find_shared_weights,
                                                          share_weight_casts)
from loka_compile.passes.mods.weight_both_layouts import strip as strip_weight_layouts
from loka_compile.passes.rewrite import all_or_nothing
from loka_compile.plan import Plan, load_plan, param_fingerprint

log = logging.getLogger("loka")

@functools.lru_cache(maxsize=None)
def _passes_digest() -> str:
    """loka's code: the passes, the kernels they trace into graphs, Dispatch and the rest
    of the package (a cached graph compiled by other code is not reused)."""
    digest = hashlib.sha256()
    for folder in (pathlib.Path(passes.__file__).parent, pathlib.Path(loka_ops.__file__).parent,
                   pathlib.Path(dispatch.__file__).parent):
        for path in sorted(folder.rglob("*.py")):  # passes/mods/ too
            digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass
class GraphRecord:
    """Everything loka did to one Dynamo graph: per (phase, ATen graph kind) the pass
    context (sites and decisions) and the rewritten GraphModule."""

    name: str
    config: LokaConfig
    store: probe.ProbeStore          # the Probe statistics of the compile that owns the graph (`LokaState`)
    contexts: dict = dataclasses.field(default_factory=dict)        # (phase, kind) -> PassContext
    graph_modules: dict = dataclasses.field(default_factory=dict)   # (phase, kind) -> GraphModule
    phase: str = "fp8"
    plan: Plan = dataclasses.field(default_factory=Plan)  # the graph's own: verdicts by site id, loaded sites
    fallback: Optional[str] = None   # why the graph runs without loka, if it does
    # Mod name -> what it returned on this graph, where it ran (a joint-graph Mod: its last run)
    mod_results: dict = dataclasses.field(default_factory=dict)
    fallen_back: dict = dataclasses.field(default_factory=dict)      # GraphKind -> why it runs without loka
    output_budget: Optional[OutputBudget] = None  # what max_output_error measured and kept, when it acted
    output_budget_skipped: str = ""  # why the output budget did not act on this graph, when it was on
    amax_guards: Optional[AmaxGuards] = None  # the tensorwise sites' run-time amax check (amax_guard.py)
    warned: bool = False


class LokaPostGradPass(CustomGraphPass):
    """Runs loka's pass pipeline on one post-grad ATen graph (forward or backward)."""

    def __init__(self, record: GraphRecord, phase: str, param_input_indices: frozenset):
        self.record = record
        self.phase = phase
        self.param_input_indices = param_input_indices
        self.digests = {}  # GraphKind -> digest of the graph as the passes left it (graph_cache)

    def __call__(self, graph: torch.fx.Graph) -> None:
        if in_higher_order_op_body():
            return  # a branch or loop body: its GEMMs stay as they are (`hop_sites` reports them)
        # A failure here reaches `_inner_compile`, which compiles the untouched graph.
        record = self.record
        kind = graph_kind(graph)
        decide = functools.partial(_decide, record=record, phase=self.phase)
        # Static activation scales (a calibrated plan) serve inference graphs only.
        static = dict(record.plan.a_scales) if kind is passes.GraphKind.INFERENCE and record.plan.source else {}
        ctx = PassContext(graph=record.name, kind=kind, phase=self.phase,
                          param_input_indices=self.param_input_indices, decide=decide,
                          inactive_mods=record.config.inactive_mods, static_a_scales=static,
                          perturb_outputs=self.phase == "probe" and record.config.output_budget_on,
                          speed_check=record.config.speed_check, time_chain=speed.chain_timing,
                          providers=tuple(record.config.providers or ()))
        if self.phase == "fp8" and record.amax_guards is not None:
            ctx.amax_guard_prefix, ctx.window_amax = record.amax_guards.prefix, record.amax_guards.window_amax
        # Recorded first, so that the sites of a graph whose passes fail are reported.
        record.contexts[(self.phase, kind)] = ctx
        saved, layouts = (record.mod_results.get(mod.name) for mod in (saved_fp8.MOD, weight_both_layouts.MOD))
        if kind is passes.GraphKind.FORWARD and saved is not None:
            check_saves(graph, saved)  # as partitioned, before lower renames what it rewrites
        if kind is passes.GraphKind.FORWARD and layouts is not None:
            check_shared(graph, layouts)
        run_passes(graph, ctx)
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
        log.info("%s/%s (%s): %d GEMM sites, %d in FP8", record.name, kind.value, self.phase, len(ctx.sites), fp8)

    def uuid(self) -> str:
        """Part of Inductor's FX graph cache key: what the graph after loka's passes
        follows from besides the graph itself. The plan's verdicts as Dispatch acts on
        them (their measured values only reach the report, which a hit records afresh);
        a probe graph's name, which its site keys carry (`graph_cache` checks the rest)."""
        record, plan = self.record, self.record.plan
        unsafe, passing = _verdict_signature(plan, record.config)
        verdicts = sorted(unsafe), sorted(passing), plan.digest() if plan.source else ""
        name = record.name if self.phase == "probe" else ""
        guards = record.amax_guards if self.phase == "fp8" else None  # their ops carry its prefix and limits
        guards = "" if guards is None else f"{guards.prefix}|{sorted(guards.window_amax.items())}"
        return hashlib.sha256(f"{_passes_digest()}|{record.config}|{self.phase}|{name}|{verdicts}|{guards}"
                              .encode()).hexdigest()


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
        # What the forward saves is measured with saved_fp8 off too (the report compares it).
        saved = record.mod_results[saved_fp8.MOD.name] = SavedFp8.of_joint_graph(graph)
        record.mod_results.pop(weight_both_layouts.MOD.name, None)
        if phase == "probe":
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
                        "operands itself", record.name, _error_text(error))
            return
        log.info("%s: saved_fp8: %d operands, declined %s", record.name, len(saved.operands), dict(saved.declined))

    def _joint_context(self, graph: torch.fx.Graph) -> PassContext:
        record, phase = self.post_grad.record, self.post_grad.phase
        guards = record.amax_guards if phase == "fp8" else None  # the saved_fp8 Mod's casts carry them
        return PassContext(graph=record.name, kind=passes.GraphKind.BACKWARD, phase=phase,
                           param_input_indices=self.post_grad.param_input_indices,
                           decide=functools.partial(_decide, record=record, phase=phase),
                           inactive_mods=record.config.inactive_mods, joint=True,
                           amax_guard_prefix=guards.prefix if guards else "",
                           window_amax=guards.window_amax if guards else {})

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
                        "its weight itself", record.name, _error_text(error))
            return
        record.mod_results[weight_both_layouts.MOD.name] = layouts
        log.info("%s: weight_both_layouts: %s", record.name, layouts.summary())

    def uuid(self) -> str:
        return hashlib.sha256(f"joint|{self.post_grad.uuid()}".encode()).hexdigest()


def _decide(site, record: GraphRecord, phase: str, **kwargs) -> Decision:
    """Dispatch's decision; a site the output budget keeps in high precision (in the plan's
    unsafe verdicts) says so in its detail."""
    decision = dispatch.decide(site, config=record.config, phase=phase, plan=record.plan, **kwargs)
    kept = record.output_budget.kept if record.output_budget is not None else {}
    if site.id in kept and decision.reason is Reason.PROBE_UNSAFE:
        decision = dataclasses.replace(decision, detail=kept[site.id])
    return decision


def _is_dynamo_control(error: Exception) -> bool:
    """Dynamo steers compilation with exceptions (restart analysis, skip frame); they
    are not failures and must reach Dynamo. (Inductor's own failures arrive wrapped in
    InductorError, also a Dynamo exception type, and are failures.)"""
    return isinstance(error, (torch._dynamo.exc.RestartAnalysis, torch._dynamo.exc.SkipFrame))


def _error_text(error: Exception) -> str:
    """"Type: message (at file:line in function)", the innermost frame, so that a
    fallback's reason says where the failure was; one line: the message's first (an error
    from compiled C++ code goes on with its C++ stack, frame by frame)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    message = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {message}{where}"


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


def _warn_fallback(record: GraphRecord, why: str, whole_graph: bool = True) -> None:
    if whole_graph:
        record.fallback = why
    if not record.warned:
        record.warned = True
        log.warning("loka could not handle graph %s (%s); it runs through Inductor in high precision", record.name, why)


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
        return hashlib.sha256(f"{_passes_digest()}|{user}".encode()).hexdigest()


def _inductor_patches(config: LokaConfig, custom_pass: Optional[CustomGraphPass]) -> dict:
    """Inductor's config for a loka compile (`custom_pass` None: a plain compile, as a
    fallback)."""
    patches = dict(list_mode_options(config.mode))
    if patches.get("triton.cudagraphs"):
        # An FX graph cache hit in a CUDA-graph mode raised TypeError ("'NoneType'
        # object does not support the context manager protocol") inside Inductor on
        # the H100 (torch 2.11) for graphs loka compiles after the probe window and
        # their fallbacks (DLRM training, MaskNet inference); cause not isolated.
        patches["fx_graph_cache"] = False
    if custom_pass is not None:
        patches["post_grad_custom_pre_pass"] = LokaProvenancePass(inductor_config.post_grad_custom_pre_pass)
        patches["post_grad_custom_post_pass"] = custom_pass
        if isinstance(custom_pass, LokaPostGradPass):  # not an export's (inference) pass
            patches["joint_custom_post_pass"] = LokaJointPass(custom_pass)
        patches.update(mods.inductor_settings(config.inactive_mods, lambda name: hasattr(inductor_config, name)))
    return patches


def _constants_reach_custom_ops(example_inputs):
    """Inductor re-runs a custom op (a provider's GEMM) on its inputs' example values to
    find its output layout, and a graph constant's example value is the real tensor: the
    cached_weights Mod's FP8 weights. Inductor's own freezing allows real inputs in its fake
    mode for the same reason."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        return contextlib.nullcontext()
    return unittest.mock.patch.object(fake_mode, "allow_non_fake_inputs", True)


def _storage_or_identity(tensor: torch.Tensor) -> int:
    """Inductor's `fx_utils.get_storage`, also for tensors without a storage (sparse
    gradients of `sparse=True` embeddings), which get a key of their own (negative, so it
    never equals a storage address). Inductor's fake-tensor update after the post-grad
    custom pass compares storages of every node downstream of a rewritten one; the
    original raises for a sparse tensor."""
    if torch._C._has_storage(tensor):
        return tensor.untyped_storage()._cdata
    return -id(tensor)


def _forget_rewrite(record: GraphRecord, why: str, kind=None, phase: Optional[str] = None) -> None:
    """Rewritten graphs (of `kind`, of `phase`; None: all) that will not run: drop them
    from the record, and give the sites their passes found but never decided a decision
    that says why."""
    def matches(key):
        return (kind is None or key[1] is kind) and (phase is None or key[0] == phase)

    for key in [key for key in record.graph_modules if matches(key)]:
        record.graph_modules.pop(key)
    for key, ctx in record.contexts.items():
        if matches(key):
            for site in ctx.sites:
                ctx.decisions.setdefault(site.key, Decision(fp8=False, reason=Reason.GRAPH_FALLBACK, detail=why))


def _compile_cached(gm: torch.fx.GraphModule, example_inputs, record: GraphRecord, kind: GraphKind,
                    retry: bool = True, **kwargs):
    """`compile_fx_inner` through Inductor's FX graph cache where it is on (`graph_cache`).
    A miss keeps the digest of the graph loka's pass made; a hit runs the post-grad passes
    again, so that loka's pass records the graph's sites and decisions as on a miss, and
    is used when the graph they make has the digest kept. Otherwise the entry is dropped
    and the graph compiled again, and cached anew (`retry`; else without the cache)."""
    loka_pass = inductor_config.post_grad_custom_post_pass
    if not isinstance(loka_pass, LokaPostGradPass) or not inductor_config.fx_graph_cache:
        return compile_fx_inner(gm, example_inputs, **kwargs)
    why = graph_cache.bypass_reason(loka_pass.phase, kind, record.config.inactive_mods, loka_pass.param_input_indices)
    if why is not None:
        log.debug("%s/%s (%s): FX graph cache bypassed: %s", record.name, kind.value, loka_pass.phase, why)
        with inductor_config.patch(fx_graph_cache=False):
            return compile_fx_inner(gm, example_inputs, **kwargs)
    slot = (loka_pass.phase, kind)
    before = record.contexts.get(slot), record.graph_modules.get(slot)
    loka_pass.digests.pop(kind, None)
    hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    tracing = torch._guards.TracingContext.try_get()
    strides = list(tracing.output_strides or ()) if tracing is not None else []
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    key = getattr(compiled, "_fx_graph_cache_key", None)
    if key is None:
        return compiled
    if torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] == hits:  # a miss: loka's pass ran
        if kind in loka_pass.digests:
            graph_cache.save(key, loka_pass.digests.pop(kind))
        return compiled
    why = "no digest kept for it"
    kept = graph_cache.load(key)
    if kept is not None:
        try:
            graph_cache.post_grad_passes(gm, example_inputs, kwargs.get("is_inference", False))
        except Exception as error:  # noqa: BLE001  (the compile below meets it again, and falls back)
            why = f"running the post-grad passes again failed: {type(error).__name__}: {error}"
        else:
            if loka_pass.digests.pop(kind, None) == kept:
                log.debug("%s/%s (%s): FX graph cache hit; sites recorded again", record.name, kind.value,
                          loka_pass.phase)
                return compiled
            why = "loka's passes make another graph now"
    log.info("loka: %s/%s (%s): FX graph cache entry not used (%s); compiled again", record.name, kind.value,
             loka_pass.phase, why)
    for table, value in zip((record.contexts, record.graph_modules), before):
        if value is None:
            table.pop(slot, None)
        else:
            table[slot] = value
    # The hit's post-compile step handed its output strides to Dynamo's tracing context,
    # which takes one graph's.
    tracing = torch._guards.TracingContext.try_get()
    if tracing is not None and tracing.output_strides is not None:
        tracing.output_strides[:] = strides
    if retry and graph_cache.drop_inductor_entry(key):
        return _compile_cached(gm, example_inputs, record, kind, retry=False, **kwargs)
    with inductor_config.patch(fx_graph_cache=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _inner_compile(gm: torch.fx.GraphModule, example_inputs, record: GraphRecord, **kwargs):
    """Inductor's compile of one ATen graph (forward, backward, inference), made whole or
    not at all: if it fails once loka's pass has rewritten the graph (in the pass or in
    Inductor after it, e.g. on sparse gradients), the untouched copy is compiled again
    without loka, and only that graph's sites are reported as fallen back. Inductor calls
    this for the lazily compiled backward too, so the fallback covers every graph."""
    pristine = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node meta is shared, not copied
    try:
        with _constants_reach_custom_ops(example_inputs), \
                unittest.mock.patch.object(fx_utils, "get_storage", _storage_or_identity):
            compiled = _compile_cached(gm, example_inputs, record, graph_kind(pristine.graph), **kwargs)
    except Exception as error:
        if not record.config.fallback or _is_dynamo_control(error):
            raise
        kind = graph_kind(pristine.graph)
        why = f"{kind.value} graph: {_error_text(error)}"
        record.fallen_back[kind] = why
        _forget_rewrite(record, why, kind=kind)
        _warn_fallback(record, why, whole_graph=False)
        _, left = strip_weight_layouts(pristine.graph)  # the joint graph's rewrite: weights as written
        if left:
            log.warning("loka: %s: %d GEMM(s) of the %s graph run in high precision on the FP8 copy of a "
                        "computed weight the forward saved", record.name, left, kind.value)
        pristine.recompile()
        with inductor_config.patch(post_grad_custom_post_pass=None):
            return compile_fx_inner(pristine, example_inputs, **kwargs)
    ctx = next((record.contexts[key] for key, module in record.graph_modules.items() if module is gm), None)
    if ctx is not None and ctx.cached_weights:
        return RefreshingGraph(compiled, WeightCache(ctx.cached_weights), check_after_call(gm.graph, example_inputs))
    return compiled


# Dynamo-graph ops that take a weight as their second argument, and ops a weight passes
# through on its way there.
_WEIGHT_TAKERS = {torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, torch.mm, operator.matmul}
_WEIGHT_VIEWS = {"t", "transpose", "permute", "to", "float", "half", "bfloat16", "contiguous", "view", "reshape"}


def _used_as_weight(node: torch.fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target in _WEIGHT_TAKERS and len(user.args) > 1 \
                    and user.args[1] is current:
                return True
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if user.op in ("call_method", "call_function") and name in _WEIGHT_VIEWS:
                stack.append(user)
    return False


def weight_input_indices(gm: torch.fx.GraphModule, example_inputs) -> frozenset:
    """Inputs of a Dynamo graph that are weights, whose gradients are wgrad: parameters,
    and leaf tensors that require grad and reach a linear's or a matmul's second operand
    (`torch.func.functional_call` passes parameters as plain tensors), with at most 2 dims
    (a 3-D leaf multiplied by its own transpose is an interaction, not a weight)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = set()
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, torch.nn.Parameter):
            found.add(i)
        elif isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad and value.dim() <= 2 \
                and _used_as_weight(node):
            found.add(i)
    return frozenset(found)


def probe_site_keys(record: GraphRecord) -> list:
    """Probe keys of the sites a graph's probe variant observed."""
    return [s.key for (phase, _), ctx in record.contexts.items() if phase == "probe" for s in ctx.sites]


@dataclasses.dataclass
class _GraphSource:
    """What compiling a graph again takes: Dynamo's graph, its example inputs (the first
    call's real tensors), its tracing context and how Dynamo fakified each input.

    Dropped in place (`drop`), not by unsetting the attribute that holds it: Dynamo wraps
    the compiled graph with `functools.wraps`, which copies the instance's attributes into
    the wrapper once, so an attribute set to None later still holds the source there, and
    with it a batch of inputs for the life of the model."""

    gm: Optional[torch.fx.GraphModule]
    example_inputs: Optional[list]
    tracing_context: Optional[object]
    input_contexts: list  # (input tensor, its symbolic context)

    @property
    def kept(self) -> bool:
        return self.gm is not None

    def drop(self) -> None:
        self.gm = self.example_inputs = self.tracing_context = None
        self.input_contexts = []

    def tracing(self):
        """Dynamo's tracing context of this graph's compile, with each input's fakification restored."""
        if self.tracing_context is None:
            return contextlib.nullcontext()
        for tensor, symbolic_context in self.input_contexts:
            self.tracing_context.tensor_to_context[tensor] = symbolic_context
        return torch._guards.tracing(self.tracing_context)


class LokaCompiledGraph:
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
            record.phase = "probe"
            state.probing.add(self)
        else:
            record.phase = "fp8"
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
        self.variants = {record.phase: self._compile(gm, example_inputs, record.phase)}
        self._first_runs = set()  # ids of variants that have run once

    def _compile(self, gm, example_inputs, phase):
        record = self.record
        custom_pass = LokaPostGradPass(record, phase, self.param_input_indices)
        try:
            with graph_cache.autograd_cache_off():
                return compile_fx(gm, example_inputs, inner_compile=functools.partial(_inner_compile, record=record),
                                  config_patches=_inductor_patches(record.config, custom_pass))
        except Exception as error:
            if not record.config.fallback or _is_dynamo_control(error):
                raise
            why = f"compile failed: {_error_text(error)}"
            _warn_fallback(record, why)
            _forget_rewrite(record, why, phase=phase)
            return compile_fx(gm, example_inputs, config_patches=_inductor_patches(record.config, None))

    def __call__(self, *args):
        record = self.record
        if record.phase == "probe" and self.calls >= record.config.probe_steps:
            if self._close_probe_window(args) == "wait":  # no finite output to budget on: not observed either
                self.calls += 1
                with loka_ops.observers_off():
                    return self.variants["probe"](*args)
        if self._rechecking:  # the re-check call's backward has run by now, observers and all
            self._rechecking = False
            self._close_recheck()
        if record.amax_guards is not None and record.phase == "fp8" and self._builds:
            self._check_amax_guards()
        self.calls += 1
        every = record.config.recheck_every
        if every and record.phase == "fp8" and self._builds and (self.calls - record.config.probe_steps) % every == 0:
            return self._recheck_call(args)
        variant = self.variants[record.phase]
        if id(variant) in self._first_runs:
            out = variant(*args)
            if record.amax_guards is not None:
                record.amax_guards.copy_back()  # the amaxes this call left, read at a later one
            return out
        try:
            out = variant(*args)
        except Exception as error:
            if not record.config.fallback or _is_dynamo_control(error) or not self._source.kept:
                raise
            why = f"first run failed: {_error_text(error)}"
        else:
            self._first_runs.add(id(variant))
            if record.phase == "fp8" and not record.config.recheck_every and record.amax_guards is None:
                self._source.drop()  # nothing compiles this graph again
                record.store.release_samples(probe_site_keys(record))  # nor observes it
            if record.phase == "fp8" and record.amax_guards is not None:
                record.amax_guards.copy_back()
            return out
        # Out of the except block: the failed run's frames hold its buffers, which under CUDA
        # graphs live in the graph pool, and the plain compile's first run refuses a pool
        # with untracked live tensors.
        gc.collect()
        return self._fall_back_at_first_run(why, args)

    def _fall_back_at_first_run(self, why: str, args):
        """The running variant failed at its first run: the graph is compiled again without
        loka and, if that runs, runs so from now on, every site of it reporting
        graph_fallback. If it fails too, the failure is not loka's: it is raised and nothing
        changes."""
        record = self.record
        source = self._source
        with source.tracing():
            plain = compile_fx(source.gm, source.example_inputs, config_patches=_inductor_patches(record.config, None))
        out = plain(*args)
        _warn_fallback(record, why)
        for ctx in record.contexts.values():
            for site in ctx.sites:
                ctx.decisions[site.key] = Decision(fp8=False, reason=Reason.GRAPH_FALLBACK, detail=why)
        record.graph_modules.clear()
        record.store.release_samples(probe_site_keys(record))
        self.state.counters["first_run_fallbacks"] += 1
        # The report reads the contexts of the phase that runs.
        record.contexts = {("fp8", kind): ctx for (phase, kind), ctx in record.contexts.items()
                           if phase == record.phase}
        self.state.probing.discard(self)
        self.state.rechecking.discard(self)
        record.amax_guards = None  # the plain compile has none, and nothing rebuilds it
        self._source.drop()
        record.phase = "fp8"
        self.variants = {"fp8": plain}
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
        ids = {s.key: s.id for (phase, _), ctx in record.contexts.items() if phase == "probe" for s in ctx.sites}
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
        self.variants["fp8"] = self._compile_fp8()
        # Whether the budget acted is rank 0's word; this rank's own measurement may have failed.
        if record.output_budget is not None:
            if measured is not None:
                self._verify_output_budget(*measured)
            if self._tighten_output_budget(decide_once(self._weigh_at_measured_scale)):
                self.variants["fp8"] = self._compile_fp8()
                if measured is not None:
                    self._verify_output_budget(*measured)
        if record.config.recheck_every or record.amax_guards is not None:
            self._builds[_verdict_signature(record.plan, record.config)] = _Fp8Build(self.variants["fp8"])
        if record.config.recheck_every:
            self.state.rechecking.add(self)
        record.phase = "fp8"
        log.info("%s: probe window closed after %d calls; of %d observed sites %d unsafe, %d upgraded%s",
                 record.name, self.calls, len(keys), len(unsafe), len(upgraded),
                 f", {len(record.output_budget.kept)} kept for the output budget" if record.output_budget else "")

    # ---- the output budget (LokaConfig.max_output_error) --------------------------------

    def _budget_sites(self) -> dict:
        """probe key -> site id of the forward sites the output budget weighs: observed
        `fwd` sites of the probe variant's forward or inference graph, which carry a
        `loka.perturb` (backward sites do not reach the outputs)."""
        record = self.record
        return {site.key: site.id for (phase, kind), ctx in record.contexts.items()
                if phase == "probe" and kind is not GraphKind.BACKWARD and kind not in record.fallen_back
                and not record.fallback and ctx.perturb_outputs
                for site in ctx.sites
                if site.role is Role.FWD and site.key in ctx.decisions
                and ctx.decisions[site.key].reason is Reason.PROBING and record.store.observed(site.key)}

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
            reference = runs.run(self.variants["probe"])
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
        variant = self.variants["probe"]
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
        """(measured noise floor or None, why not): the Dynamo graph run eagerly with its
        floating inputs in bf16 against the same in fp32, on the closing call's arguments
        (copies). Only where that is cheap and means something: a graph that holds no
        parameters of its own (they would keep their dtype) and sets no autocast (it would
        override both runs), with inputs under FLOOR_RUN_MAX_BYTES."""
        gm = self._source.gm
        if gm is None:
            return None, "the graph's source is gone"
        if any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in gm.graph.nodes):
            return None, "the graph sets its own precision (autocast)"
        if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
            return None, "the graph holds parameters of its own"
        floating = [a for a in runs.args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if sum(a.numel() for a in floating) * 6 > FLOOR_RUN_MAX_BYTES:  # an fp32 and a bf16 copy
            return None, "its inputs are too large to copy"
        try:
            high = [o.double() for o in runs.run_eager(gm, torch.float32)]
            low = runs.run_eager(gm, torch.bfloat16)
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
        error, labels, bf16 = {}, {}, {}
        for key, sid in sites.items():
            summary = self.record.store.summary(key)
            if math.isfinite(summary.get("mean_bf16_rel_error", math.inf)):
                bf16[sid] = summary["mean_bf16_rel_error"]
            if sid in plan.unsafe:
                continue
            target = plan.upgraded.get(sid, (None,))[0]
            candidate = probe._target_name(target) if isinstance(target, str) else summary.get("chosen")
            e = output_budget.candidate_error(summary, candidate) if candidate else None
            if e is None:  # no candidate statistics: the largest observed error
                e = float(summary.get("max_rel_error", math.inf))
            error[sid], labels[sid] = e, (candidate or "own").split("/")[0]
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
        weighed = output_budget.keep_within(sensitivity, error, budget if measured["judge_d"] else None, labels,
                                            heads=tuple(result.heads), ne_budget=ne_budget,
                                            budget_text=result.describe_budget())
        result.kept, result.predicted_before, result.predicted = weighed.kept, weighed.before, weighed.after
        result.ne_before, result.ne_predicted = weighed.ne_before, weighed.ne_after
        return result

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
            budget.measured = output_budget.discrepancy(select(runs.run(self.variants["fp8"])), select(reference),
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

    def _weigh_at_measured_scale(self) -> Optional[tuple]:
        """With `refit_output_budget`, when the FP8 variant measured over VERIFY_SLACK times
        the budget: the sites left in FP8 weighed again with the prediction scaled by what
        it measured (`output_budget.measured_scale`), as (Weighed, scale); else None. Never
        raises (on rank 0 when distributed)."""
        record, budget = self.record, self.record.output_budget
        try:
            if not record.config.refit_output_budget or budget.measured is None \
                    or budget.judged_outputs == "none" or budget.measured <= VERIFY_SLACK * budget.budget:
                return None
            scale = output_budget.measured_scale(budget)
            errors = {sid: e for sid, e in budget.error.items()
                      if sid not in budget.kept and sid not in record.plan.unsafe}
            return output_budget.keep_within(budget.sensitivity, errors, budget.budget, scale=scale,
                                             heads=tuple(budget.heads), ne_budget=budget.ne_budget,
                                             budget_text=budget.describe_budget()), scale
        except Exception as error:  # noqa: BLE001
            log.warning("loka: %s: output budget: weighing the sites again failed (%s: %s)",
                        record.name, type(error).__name__, error)
            return None

    def _tighten_output_budget(self, weighed: Optional[tuple]) -> bool:
        """Keep in high precision the sites `_weigh_at_measured_scale` found the budget can
        no longer afford; True when there were any (the FP8 variant is compiled again, once)."""
        if not weighed or not weighed[0].kept:
            return False
        weighed, scale = weighed
        record, budget = self.record, self.record.output_budget
        for sid, detail in weighed.kept.items():
            budget.kept[sid] = detail
            record.plan.unsafe[sid] = budget.error[sid]
        budget.predicted = weighed.after
        log.warning("loka: %s: output budget: the FP8 variant measured %.3g, %.2gx its prediction; weighed again "
                    "at that scale (predicted %.3g -> %.3g), %d more site(s) kept in high precision: %s; "
                    "compiling the FP8 variant again", record.name, budget.measured, scale, weighed.before,
                    weighed.after, len(weighed.kept), ", ".join(weighed.kept))
        return True

    def _predicted_as_compiled(self) -> float:
        """D over the forward sites the FP8 variant runs in FP8, each at the scaling it runs
        (and each binary head's predicted relative NE increase, into `ne_after`)."""
        record, budget = self.record, self.record.output_budget
        keys = {sid: key for key, sid in self._budget_sites().items()}
        errors = {}
        for (phase, kind), ctx in record.contexts.items():
            if phase != "fp8" or kind is GraphKind.BACKWARD or kind in record.fallen_back or record.fallback:
                continue
            for site in ctx.sites:
                decision = ctx.decisions.get(site.key)
                if decision is None or not decision.fp8 or site.id not in budget.sensitivity:
                    continue
                candidate = loka_ops.candidate_name(decision.scaling, decision.a_format, decision.b_format)
                e = output_budget.candidate_error(record.store.summary(keys[site.id]), candidate) \
                    if site.id in keys else None
                errors[site.id] = e if e is not None else budget.error[site.id]
        budget.ne_after = {head.name: sum(head.relative_increase(errors).values()) for head in budget.heads}
        return output_budget.predicted(budget.sensitivity[sid] * e for sid, e in errors.items())

    def _compile_fp8(self):
        """The FP8 variant, with the plan's verdicts as they stand, in Dynamo's tracing context."""
        source = self._source
        with source.tracing():
            return self._compile(source.gm, source.example_inputs, "fp8")

    # ---- re-checks (LokaConfig.recheck_every) ------------------------------------------

    def _observed_sites(self) -> dict:
        """key -> (site id, own scaling) of the sites the probe variant observes."""
        return {site.key: (site.id, ctx.decisions[site.key].scaling)
                for (phase, _), ctx in self.record.contexts.items() if phase == "probe" for site in ctx.sites
                if site.key in ctx.decisions and ctx.decisions[site.key].reason is Reason.PROBING}

    def _recheck_call(self, args):
        """One call through the probe variant, its observations the only ones the store
        holds for these sites (a fresh window); the next call judges them."""
        record = self.record
        record.store.forget(self._observed_sites())
        self._rechecking = True
        self.state.counters["rechecks"] += 1
        try:
            return self.variants["probe"](*args)
        except Exception as error:  # noqa: BLE001  (a re-check must never cost the model its call)
            self._rechecking = False
            log.warning("loka: %s: re-check at call %d failed (%s: %s); the call runs the FP8 variant",
                        record.name, self.calls, type(error).__name__, error)
            return self.variants["fp8"](*args)

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
        signature = _verdict_signature(plan, config)
        if signature == next(reversed(self._builds)):
            log.debug("%s: re-check at call %d: no verdict changed", record.name, step)
            return
        rebuilt = self._switch_build(signature)
        for sid, before, after, steps in changes:
            demoted = _CHAIN_RANK.get(after, 0) > _CHAIN_RANK.get(before, 0)
            plan.history.setdefault(sid, []).append(
                {"step": step + 1, "observed_at": step, "graph": record.name, "from": before, "to": after,
                 "change": "demoted" if demoted else "promoted", "detail": steps})
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
        return {site.id: (ctx.decisions[site.key].a_format, ctx.decisions[site.key].b_format)
                for (phase, _), ctx in self.record.contexts.items() if phase == "probe" for site in ctx.sites
                if site.key in ctx.decisions and site.id not in plan.unsafe and site.id not in plan.upgraded}

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
            rebuilt = self._switch_build(_verdict_signature(plan, config))
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
        self.variants["fp8"] = build.compiled
        return build.contexts is None


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


    def run_eager(self, gm: torch.fx.GraphModule, dtype: torch.dtype) -> list:
        """The floating outputs of the Dynamo graph run eagerly on copies of the arguments,
        every floating one in `dtype` but those that carry integers past bf16's exact range
        (ids in a float tensor, as deepctr-torch passes them): bf16 would change the ids."""
        def cast(a):
            if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
                return a
            ids = a.numel() > 0 and bool((a == a.round()).all()) and float(a.abs().max()) > BF16_EXACT_INTEGERS
            return a.detach().clone() if ids else a.detach().to(dtype, copy=True)
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
# bf16 holds every integer up to 2^8 exactly (8 significand bits).
BF16_EXACT_INTEGERS = 256

# FP8 variants a re-checking graph keeps, one per set of verdicts, so that a site whose bound
# hovers at the budget costs a switch rather than a compile at each re-check.
_MAX_FP8_BUILDS = 4
# Rank of a verdict along the upgrade chain: moving up is a demotion.
_CHAIN_RANK = {**{s: i for i, s in enumerate(probe.SCALING_CHAIN)}, "high precision": len(probe.SCALING_CHAIN)}


class _Fp8Build:
    """One compiled FP8 variant, and, while another runs, its pass contexts and graphs
    (a training graph's backward is compiled at its first backward, so they are taken when
    the variant stops running)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.contexts = None
        self.graph_modules = None

    def stash(self, record: GraphRecord) -> None:
        self.contexts = {k: record.contexts.pop(k) for k in [k for k in record.contexts if k[0] == "fp8"]}
        self.graph_modules = {k: record.graph_modules.pop(k) for k in [k for k in record.graph_modules
                                                                       if k[0] == "fp8"]}

    def restore(self, record: GraphRecord) -> None:
        record.contexts.update(self.contexts or {})
        record.graph_modules.update(self.graph_modules or {})


def _standing(sid: str, own: str, unsafe: dict, upgraded: dict) -> str:
    """Where verdicts put a site: its own scaling, an upgrade's target, or high precision."""
    if sid in unsafe:
        return "high precision"
    if sid in upgraded:
        target = upgraded[sid][0]
        return target if isinstance(target, str) else "rowwise"  # plans from before the chain
    return own


def _verdict_signature(plan: Plan, config: LokaConfig) -> tuple:
    """What of the plan's verdicts Dispatch acts on: the unsafe sites, and per upgraded
    site the finer scalings within the budget (it takes the first a provider runs)."""
    passing = {sid: tuple(s for s, bound in dispatch._upgrade_steps(entry)[1:] if bound <= config.max_probe_error)
               for sid, entry in plan.upgraded.items()}
    return frozenset(plan.unsafe), frozenset(passing.items())


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


def _graph_fingerprint(gm: torch.fx.GraphModule, example_inputs) -> tuple[dict, str]:
    """(parameter name -> (shape, dtype), device type) of a Dynamo graph: names from
    Dynamo's sources ("L['self']._modules['fc1']._parameters['weight']" -> "fc1.weight"),
    as `named_parameters()` of the compiled module gives them."""
    named = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.nn.Parameter):
            source = getattr(node.meta.get("grapharg"), "source", None)
            named.append((clean_module_path(source.name) if source is not None else node.name, value))
    named += list(gm.named_parameters())
    tensors = [t for _, t in named] or [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return param_fingerprint(named), (tensors[0].device.type if tensors else "cpu")


def _run_dynamo_graph_mod(mod: mods.Mod, gm: torch.fx.GraphModule, example_inputs, record: GraphRecord) -> None:
    """A Mod on the Dynamo graph (which its rewrite restores when it fails): its failure
    is raised without `fallback`, else logged, the graph left as written."""
    try:
        result = mod.run(gm, example_inputs, record.config)
    except Exception as error:
        if not record.config.fallback or _is_dynamo_control(error):
            raise
        log.warning("loka: the %s Mod failed on %s (%s: %s); %s", mod, record.name, type(error).__name__, error,
                    mod.if_failed)
        return
    record.mod_results[mod.name] = result
    log.info("%s: %s: %s", record.name, mod, result)


def loka_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode: Optional[str] = None):
    """`torch.compile(model, backend="loka", options={...} | LokaConfig(...))`. The graph's
    record joins the state of the compile it runs for (`state.state_for_compile`)."""
    config = LokaConfig.from_options(options)
    if mode is not None:
        config = dataclasses.replace(config, mode=mode)
    state = state_for_compile()
    fingerprint, device_type = _graph_fingerprint(gm, example_inputs)
    plan = Plan(params=fingerprint, device_type=device_type, recipe=config.recipe)
    if config.plan is not None:
        loaded = load_plan(config.plan)
        loaded.check(fingerprint, device_type, config.recipe)  # ValueError naming what differs
        plan = dataclasses.replace(loaded, params=fingerprint, unsafe=dict(loaded.unsafe),
                                   upgraded=dict(loaded.upgraded), a_scales=dict(loaded.a_scales))
    record = GraphRecord(name=next_graph_name(), config=config, store=state.store, plan=plan)
    if config.arch_mods:
        record.mod_results.update(mods.apply_arch_mods(gm, config.arch_mods))
        log.info("%s: architecture Mods %s", record.name, {name: record.mod_results[name] for name in config.arch_mods})
    for mod in mods.dynamo_graph_mods():
        if mod.on(config.inactive_mods):
            _run_dynamo_graph_mod(mod, gm, example_inputs, record)
    compiled = LokaCompiledGraph(gm, example_inputs, record, state)
    state.add(record)  # only once compiled: Dynamo may restart and call again
    return compiled


def reset() -> None:
    """Nothing process-wide to forget: each compile's records and Probe statistics live in
    its own state and go with the compiled model. Clears the speed check's in-process
    timings (the performance database on disk stays); call torch._dynamo.reset() to
    recompile."""
    speed.clear_cache()
