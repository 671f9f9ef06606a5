"""Inductor's compile of one ATen graph under loka: through the FX graph cache where it is on
(`graph_cache`), or, for a probe variant, only up to Inductor's post-grad passes (`_as_traced`);
made whole or not at all (a failure compiles the untouched graph without loka); and which inputs
of a Dynamo graph are weights."""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import unittest.mock

import torch
from torch._inductor import config as inductor_config
from torch._inductor import fx_utils
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx_inner
from torch.fx.experimental.symbolic_shapes import free_symbols

from loka_compile import graph_cache
from loka_compile.fallback import error_text, forget_rewrite, is_dynamo_control, warn_fallback
from loka_compile.inductor_passes import LokaPostGradPass
from loka_compile.passes import graph_kind, GraphKind
from loka_compile.passes.mods.cached_weights import check_after_call, RefreshingGraph, WeightCache, writes_inputs
from loka_compile.passes.mods.weight_both_layouts import strip as strip_weight_layouts
from loka_compile.state import GraphRecord


log = logging.getLogger("loka")


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
        log.debug("%s/%s (%s): FX graph cache bypassed: %s", record.name, kind.value, loka_pass.phase.value, why)
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
                          loka_pass.phase.value)
                return compiled
            why = "loka's passes make another graph now"
    log.info("loka: %s/%s (%s): FX graph cache entry not used (%s); compiled again", record.name, kind.value,
             loka_pass.phase.value, why)
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


def _as_traced(gm: torch.fx.GraphModule, example_inputs, is_inference: bool = False, **_inductor_options):
    """The graph after Inductor's post-grad passes (loka's among them), run as it is: each ATen
    op a kernel call, no Inductor code generation. A probe variant's job is statistics over a
    few calls, so it skips the compile only the FP8 variant needs; its graph, and so its sites,
    are the ones an Inductor compile would lower. Inductor's options (CUDA graphs among them)
    do not apply."""
    traced = graph_cache.post_grad_passes(gm, example_inputs, is_inference)
    traced.recompile()
    return make_boxed_func(traced.forward)


def inner_compile(gm: torch.fx.GraphModule, example_inputs, record: GraphRecord, codegen: bool = True, **kwargs):
    """Inductor's compile of one ATen graph (forward, backward, inference), made whole or
    not at all: if it fails once loka's pass has rewritten the graph (in the pass or in
    Inductor after it, e.g. on sparse gradients), the untouched copy is compiled again
    without loka, and only that graph's sites are reported as fallen back. Inductor calls
    this for the lazily compiled backward too, so the fallback covers every graph.
    `codegen` False: the graph only goes through the post-grad passes (`_as_traced`)."""
    pristine = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node meta is shared, not copied
    try:
        with _constants_reach_custom_ops(example_inputs), \
                unittest.mock.patch.object(fx_utils, "get_storage", _storage_or_identity):
            if codegen:
                compiled = _compile_cached(gm, example_inputs, record, graph_kind(pristine.graph), **kwargs)
            else:
                compiled = _as_traced(gm, example_inputs, **kwargs)
    except Exception as error:
        if not record.config.fallback or is_dynamo_control(error):
            raise
        kind = graph_kind(pristine.graph)
        _fall_back_graph(record, pristine, f"{kind.value} graph: {error_text(error)}", kind)
        with inductor_config.patch(post_grad_custom_post_pass=None):
            return compile_fx_inner(pristine, example_inputs, **kwargs)
    key = next((key for key, module in record.graph_modules.items() if module is gm), None)
    ctx = record.contexts.get(key) if key is not None else None
    if ctx is not None and ctx.cached_weights:
        return RefreshingGraph(compiled, WeightCache(ctx.cached_weights), check_after_call(gm.graph, example_inputs))
    if record.config.fallback and graph_kind(pristine.graph) is GraphKind.BACKWARD and not writes_inputs(pristine.graph):
        return BackwardFirstRun(compiled, pristine, record, key[0] if key is not None else None)
    return compiled


def _fall_back_graph(record: GraphRecord, pristine: torch.fx.GraphModule, why: str, kind: GraphKind,
                     phase=None) -> None:
    """A graph of `kind` runs without loka's post-grad pass from now on: its sites report
    `why`, and `pristine` (the graph as AOTAutograd gave it) loses the joint graph's weight
    layouts, which only loka's lowering reads."""
    record.fallen_back[kind] = why
    forget_rewrite(record, why, kind=kind, phase=phase)
    warn_fallback(record, why, whole_graph=False)
    _, left = strip_weight_layouts(pristine.graph)  # the joint graph's rewrite: weights as written
    if left:
        log.warning("loka: %s: %d GEMM(s) of the %s graph run in high precision on the FP8 copy of a "
                    "computed weight the forward saved", record.name, left, kind.value)
    pristine.recompile()


class BackwardFirstRun:
    """A backward graph's callable whose first run, if it fails, falls back: the graph as
    AOTAutograd gave it runs instead, as traced (ATen ops, no loka pass, no Inductor code),
    for that call and every later one, and its sites report why. A forward's first run has
    its own fallback (`LokaCompiledGraph`); a backward runs inside autograd, where only the
    graph's callable can step in. Graphs that write their inputs are not wrapped: a failed
    run may have written them already."""

    def __init__(self, compiled, pristine: torch.fx.GraphModule, record: GraphRecord, phase):
        self._boxed_call = True  # on the instance: the wrappers Inductor puts around it copy its __dict__
        self.__name__ = type(self).__name__  # read at every call by Dynamo's disable wrapper: no __getattr__ miss
        self.compiled = compiled
        self._pristine = pristine
        self._record = record
        self._phase = phase
        self._ran = False

    def __call__(self, inputs):
        if self._ran:
            return self.compiled(inputs)
        kept = list(inputs)  # a boxed callable clears `inputs`; the retry needs them (held to the call's end)
        try:
            out = self.compiled(inputs)
            _check_output_shapes(out, self._pristine)
        except Exception as error:  # noqa: BLE001  (any failure of loka's graph; the plain graph's is raised)
            if is_dynamo_control(error):
                raise
            why = f"backward graph failed at its first run: {error_text(error)}"
            _fall_back_graph(self._record, self._pristine, why, GraphKind.BACKWARD, self._phase)
            self.compiled = make_boxed_func(self._pristine.forward)
            out = self.compiled(kept)
        self._ran = True
        self._pristine = None
        return out

    def __getattr__(self, name):
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)


def _check_output_shapes(outputs, pristine: torch.fx.GraphModule) -> None:
    """Raise where a compiled backward's output (a gradient) has another shape than the graph
    as AOTAutograd gave it says: autograd would reject it after the call, past any fallback."""
    expected = next(n for n in pristine.graph.nodes if n.op == "output").args[0]
    for i, (got, node) in enumerate(zip(outputs, expected)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(got, torch.Tensor) and isinstance(val, torch.Tensor) and not free_symbols(val) \
                and tuple(got.shape) != tuple(val.shape):
            raise RuntimeError(f"output {i} has shape {list(got.shape)} where the graph gives {list(val.shape)}")


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
