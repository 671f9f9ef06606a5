"""cached_weights: in inference graphs, a weight's FP8 copy is made once and
read by its GEMMs as a constant, instead of being cast on every call.

Matches: the B operand of an FP8 site in an inference graph that is made of weight inputs
of the graph (parameters) through views, dtype casts and concatenations only (sibling
linears fused by the horizontal Mod read `cat([W_1, ..., W_n])`), of concrete shape.
Becomes: two `get_attr` constants, the FP8 operand and its scales in the layout the GEMM
reads (column-major B, padded as the site is). `lower` emits them instead of the cast.
Declines: operands computed from anything else (weight_norm's g * v / |v|, a LoRA sum),
symbolic shapes, operands whose elements share memory (a weight expanded over a batch for
a bmm, as nn.MultiheadAttention's projection is under autocast), training graphs (their
weights change every step).

The constants are filled outside the graph by the `WeightCache` the backend wraps the
compiled graph in (`RefreshingGraph`): a weight is (re)quantized at the first call and
whenever the content fingerprint of any weight it is made of changed. On CUDA the check
does not stall the host before the call: the fingerprints are compared on the device, the
graph runs, and the host reads the comparison while the graph executes; on a change the
weights are requantized and the graph runs again, its first outputs dropped. A graph that
writes its inputs would write them twice, so it is checked before its call instead. The fingerprint
hashes every byte (`kernels/fingerprint.py`, one launch for all the graph's weights), so
every write path is seen: an optimizer step, fused optimizers, `load_state_dict`, writes
through `.data`, a new tensor. Version counters are not enough: writes through `.data` and
fused optimizers leave them unchanged. The constants keep their addresses, so a CUDA graph
replayed after a refresh reads the new values. The eager cast uses the same ATen ops the
graph would have run.

A walk up from each B operand, not the pattern matcher: the weights behind it come through any
number of views, casts and concatenations.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_symbols

from loka_compile.kernels.fingerprint import fingerprints, lane_sums
from loka_compile.kernels.scaled_gemm import GemmSpec, cast_operand

from ..context import PassContext
from ..find_sites import weight_placeholders, weight_source
from .mod import Mod, Stage


@dataclasses.dataclass
class CachedWeight:
    """One weight operand held in FP8 for one site."""

    input_indices: tuple             # the graph inputs it is made from
    weight_shapes: tuple             # their shapes and dtypes, checked at each refresh
    weight_dtypes: tuple
    derive: torch.fx.GraphModule     # those inputs -> the site's B operand (views, casts, cat)
    spec: GemmSpec
    q: torch.Tensor                  # the FP8 operand, [K(+pad), N(+pad)] column-major
    scale: torch.Tensor              # its scales; a 0-d scale is kept as [1, 1]
    seen: Optional[tuple] = None     # content fingerprint of each weight last quantized
    refreshes: int = 0               # times the weight was quantized
    reruns: int = 0                  # calls run again because it changed while checked after the call
    key: tuple = ()                  # (inputs, views, cast): sites with equal keys share the copy

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def bf16_nbytes(self) -> int:
        """What the same operand takes in bf16, unpadded."""
        k, n = self.q.shape[-2] - self.spec.pad_k, self.q.shape[-1] - self.spec.pad_n
        return 2 * k * n * (self.q.numel() // max(1, self.q.shape[-2] * self.q.shape[-1]))

    def refresh(self, weights: list, prints: tuple) -> None:
        """Quantize `weights` into the constants unless their fingerprints are those last quantized."""
        if prints == self.seen:
            return
        self.requantize(weights)
        self.seen = prints

    def requantize(self, weights: list) -> None:
        for index, weight, shape, dtype in zip(self.input_indices, weights, self.weight_shapes, self.weight_dtypes):
            if tuple(weight.shape) != shape or weight.dtype != dtype:
                raise RuntimeError(f"loka cached weights: graph input {index} is {tuple(weight.shape)} "
                                   f"{weight.dtype}, compiled for {shape} {dtype}")
        with torch.no_grad():
            q, scale = cast_operand(self.derive(*weights), "b", self.spec)
            self.q.copy_(q)
            self.scale.copy_(scale.reshape(self.scale.shape))
        self.refreshes += 1


@dataclasses.dataclass
class PendingCheck:
    """A fingerprint comparison enqueued on the device: per graph input, whether it changed."""

    changed: torch.Tensor                   # bool [inputs], on the host once `ready` has fired
    ready: Optional[torch.cuda.Event]       # None when `changed` was computed on the host


class WeightCache:
    """The cached weights of one compiled ATen graph."""

    def __init__(self, weights: list):
        self.weights = weights
        self.input_indices = sorted({i for w in weights for i in w.input_indices})
        self.seen_lanes: Optional[torch.Tensor] = None  # the inputs' fingerprint lanes last compared
        self._changed_host: Optional[torch.Tensor] = None  # pinned: where the comparison lands

    def _inputs(self, inputs) -> list:
        tensors = [inputs[i] for i in self.input_indices]
        if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "loka cached weights: the compiled model is being captured into a CUDA graph by the caller; "
                "its FP8 weight copies are refreshed outside the graph and would go stale on replay. Use "
                "torch.compile's mode='reduce-overhead' (loka refreshes before each replay) or "
                "options={'disabled_mods': ('cached_weights',)}")
        return tensors

    def refresh(self, inputs) -> None:
        """Bring every cached weight up to its graph inputs' current values (waits for the device)."""
        prints = dict(zip(self.input_indices, fingerprints(self._inputs(inputs))))
        for weight in self.weights:
            weight.refresh([inputs[i] for i in weight.input_indices], tuple(prints[i] for i in weight.input_indices))

    def start_check(self, inputs) -> Optional[PendingCheck]:
        """Enqueue the comparison of the inputs' fingerprints with those last seen, without
        waiting for the device. At the first call every weight is quantized here instead,
        and None is returned."""
        lanes = lane_sums(self._inputs(inputs))
        if self.seen_lanes is None:
            for weight in self.weights:
                weight.requantize([inputs[i] for i in weight.input_indices])
            self.seen_lanes = lanes
            return None
        changed = (lanes != self.seen_lanes).view(-1, 2).any(dim=1)
        self.seen_lanes = lanes
        if not changed.is_cuda:
            return PendingCheck(changed, None)
        if self._changed_host is None:
            self._changed_host = torch.empty(changed.shape, dtype=torch.bool, pin_memory=True)
        self._changed_host.copy_(changed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingCheck(self._changed_host, ready)

    def finish_check(self, pending: PendingCheck, inputs: list) -> bool:
        """Requantize the weights whose inputs changed; whether any did."""
        if pending.ready is not None:
            pending.ready.synchronize()
        changed = {i for i, flag in zip(self.input_indices, pending.changed.tolist()) if flag}
        stale = [w for w in self.weights if changed.intersection(w.input_indices)]
        for weight in stale:
            weight.requantize([inputs[i] for i in weight.input_indices])
            weight.reruns += 1
        return bool(stale)


class RefreshingGraph:
    """A compiled ATen graph (Inductor's boxed callable) whose cached weights are up to
    date whenever its outputs are returned. With `check_after`, the check overlaps the
    call and a change runs the graph again; otherwise the weights are checked before it."""

    _boxed_call = True

    def __init__(self, compiled, cache: WeightCache, check_after: bool):
        self.__name__ = type(self).__name__  # read at every call by Dynamo's disable wrapper: no __getattr__ miss
        self.compiled = compiled
        self.cache = cache
        self.check_after = check_after

    def __call__(self, inputs):
        if not self.check_after:
            self.cache.refresh(inputs)
            return self.compiled(inputs)
        kept = list(inputs)  # a boxed callable may clear `inputs`
        pending = self.cache.start_check(kept)
        out = self.compiled(inputs)
        if pending is not None and self.cache.finish_check(pending, kept):
            del out  # computed with the previous FP8 copies
            out = self.compiled(list(kept))
        return out

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def check_after_call(graph: torch.fx.Graph, example_inputs) -> bool:
    """Whether a graph's cached weights may be checked while it runs: its weights are on
    CUDA (the comparison stays on the device) and it writes none of its inputs (a second
    run would write them twice)."""
    on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
    return on_cuda and not writes_inputs(graph)


def writes_inputs(graph: torch.fx.Graph) -> bool:
    """Whether an op of the graph writes one of its placeholders in place."""
    placeholders = set(graph.find_nodes(op="placeholder"))
    return any(_written_arguments(node) & placeholders for node in graph.nodes)


def _written_arguments(node: torch.fx.Node) -> set:
    """The nodes an op call writes in place (its schema's mutable arguments)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return set()
    written = set()
    for position, argument in enumerate(node.target._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            written.update(_nodes_in(value))
    return written


def _nodes_in(value) -> list:
    found = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _has_symbols(args) -> bool:
    found = []
    torch.fx.node.map_aggregate(args, lambda x: found.append(x) if isinstance(x, torch.SymInt) else None)
    return bool(found)


def _derive_module(source, operand: torch.fx.Node) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = {p: graph.placeholder(f"weight_{i}") for i, p in enumerate(source.placeholders)}
    for node in source.nodes:
        env[node] = graph.node_copy(node, lambda x: env[x])
    graph.output(env[operand])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def cached_operand(site_node: torch.fx.Node, operand: torch.fx.Node, spec: GemmSpec, ctx: PassContext):
    """(q node, scale node) reading constants that hold `operand`'s FP8 cast, registered
    in `ctx.cached_weights`; or None when `operand` is not a cacheable weight."""
    graph = site_node.graph
    source = weight_source(operand, weight_placeholders(graph, ctx.param_input_indices))
    if source is None:
        return None
    weight_vals, operand_val = [p.meta.get("val") for p in source.placeholders], operand.meta.get("val")
    if not all(isinstance(v, torch.Tensor) and not free_symbols(v) for v in weight_vals) \
            or free_symbols(operand_val) or any(_has_symbols((n.args, n.kwargs)) for n in source.nodes):
        return None
    derive = _derive_module(source, operand)
    key = (source.indices, _chain_key(source), _cast_key(spec))
    shared = next((w for w in ctx.cached_weights if w.key == key), None)
    with operand_val.fake_mode:
        q_fake, scale_fake = cast_operand(operand_val, "b", spec)
    if any(stride == 0 and size > 1 for stride, size in zip(q_fake.stride(), q_fake.shape)):
        return None  # an expanded weight (a broadcast bmm operand): its cast stays in the graph
    if shared is not None:  # a weight two sites read alike (a shared tower) is cached once
        q, scale = shared.q, shared.scale
        scale_shape = tuple(scale.shape)
    else:
        with unset_fake_temporarily():
            q = torch.empty_strided(q_fake.shape, q_fake.stride(), dtype=q_fake.dtype, device=q_fake.device)
            # Inductor inlines a 0-d constant's value at compile time: keep scales >= 2-D.
            scale_shape = tuple(scale_fake.shape) if scale_fake.dim() >= 2 else (1, 1)
            scale = torch.ones(scale_shape, dtype=scale_fake.dtype, device=scale_fake.device)
    module = graph.owning_module
    base = f"_loka_cached_{site_node.name}"
    module.register_buffer(f"{base}_q", q, persistent=False)
    module.register_buffer(f"{base}_scale", scale, persistent=False)
    with graph.inserting_before(site_node):
        q_node = graph.get_attr(f"{base}_q")
        scale_node = graph.get_attr(f"{base}_scale")
    q_node.meta["val"] = q_fake
    with scale_fake.fake_mode:
        scale_node.meta["val"] = torch.empty(scale_shape, dtype=scale_fake.dtype, device=scale_fake.device)
    if shared is None:
        ctx.cached_weights.append(CachedWeight(
            input_indices=source.indices, weight_shapes=tuple(tuple(v.shape) for v in weight_vals),
            weight_dtypes=tuple(v.dtype for v in weight_vals),
            derive=derive, spec=spec, q=q, scale=scale, key=key))
    return q_node, scale_node


def _chain_key(source) -> tuple:
    """The views' and concatenations' ops and arguments, each node argument as its
    position (a weight's among the source's inputs, or an earlier node's): with the same
    inputs, equal keys derive the same operand."""
    position = {node: i for i, node in enumerate(source.placeholders + source.nodes)}
    return tuple((node.target, torch.fx.node.map_arg((node.args, node.kwargs), position.get))
                 for node in source.nodes)


def _cast_key(spec: GemmSpec) -> tuple:
    return spec.scaling, spec.b_format, spec.pad_k, spec.pad_n, spec.fused_casts


MOD = Mod("cached_weights", Stage.INFERENCE, True,
          "each weight's FP8 copy read as a constant, remade whenever the weight's content changes",
          # the weight_both_layouts Mod's copies are cached weights too, and count here
          counters=("cached_weights",),
          count=lambda evidence: {"cached_weights": sum(c.startswith("cached") for c in evidence.fp8_casts)})
