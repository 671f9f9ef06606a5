"""gemm_epilogue: in an inference graph with calibrated activation scales, an FP8 GEMM whose
output becomes, through an activation and a residual add, the A operand of the next FP8
GEMM writes that operand in FP8 from its own epilogue. A Mod that is on by default
(`disabled_mods=["gemm_epilogue"]` switches it off); `lower` runs it.

Matches (inference graph; both GEMMs FP8 sites Dispatch sent to FP8, or, with the speed
check on, kept in high precision only because FP8 was slower at the site alone):

    C = mm(A, B) | addmm(bias, A, B)      2-D, K and N unpadded ("producer")
        [views that keep the last dim]
    Y = act(C)                            optional: relu, silu, gelu, gelu(tanh), hardswish,
        [views]                           in the decomposed form the graph holds
    Y = Y + R                             optional: R of Y's shape and dtype (no broadcast)
        [views]
    D = mm(Y, B2) | addmm(bias2, Y, B2)   Y is A of an FP8 site ("consumer") whose A has a
                                          calibrated static scale s, tensorwise or rowwise,
                                          K unpadded

each link read by nothing but the next, becomes

    Q = loka.triton_fp8_gemm(A_q, A_s, B_q, B_s, bias, R, act, out_dtype=fp8, out_scale=s)
    D = the consumer's FP8 GEMM on (Q, s)

A split of C along N right after the GEMM (MaskNet's mask layers once the horizontal Mod
fused their first linears) hands each piece to its own consumer, through the same
activation and no residual:

    C = addmm(bias, A, B)                 pieces_i = split(C, [n_1, ..., n_k], -1)
    D_i = mm(act(pieces_i), B_i)          each D_i an FP8 site with its own static scale s_i

becomes one fused GEMM whose out_scale is per column (s_i over piece i's columns), each
consumer reading its columns of Q as a strided view (no copy).

A LayerNorm or RMSNorm after the residual add (N <= 256) joins the chain under the
`gemm_norm` Mod (`gemm_norm.py`): the value it normalizes may then have other readers, and
the fused kernel writes it for them.

So the activation, the residual add and the consumers' casts happen in the producer's
epilogue: C never goes to memory in bf16, and no pointwise kernel reads it back (3 bytes
per element of C in bf16, 4 with a residual, against 1). The producer runs on loka's
Triton GEMM whatever provider Dispatch chose for it. A chain may continue: a consumer can
be the producer of the next link.

Declines (the site keeps its ordinary lowering):
    not inference, or no static scale on the consumer's A (a dynamic cast needs the
        whole row's amax before any element is cast);
    a producer that is batched, padded, or has addmm scalars other than 1;
    a consumer that is blockwise or padded;
    any link with another reader (its bf16 value is needed), a split piece not read, or
        pieces with different activations or FP8 formats;
    loka's Triton GEMM not runnable on the device (it runs on FP8 GPUs, and on CPU as
        its reference), or not among the config's `providers` (an AOTInductor export
        allows ATen ops only, so its packages never hold this Mod's `loka::` op);
    with the speed check on an FP8 GPU: the fused GEMM measured slower than the
        producer's chosen GEMM plus the pointwise kernel (`speed.epilogue_timing`), or
        its timing raised (a kernel that cannot build or run at this shape; logged);
    a chain with a site kept in high precision: the chain fused in FP8 (the fused GEMM,
        the producer's casts, each consumer's GEMM) not beating its sites as decided
        (each at its measured time, plus the pointwise kernel). Where it does, those
        sites go FP8, and their decisions say why;
    with the speed check on an FP8 GPU, a link under MIN_CHAIN_US (unfused, or its sites as
        decided): at that size a link timed faster fused was slower in the model's graph.

The activations are recognized with Inductor's pattern matcher (each activation traced
through the decompositions Inductor applies, and without them, per dtype, and matched
rooted at its output); the chain itself has optional links and views between them, so
it is walked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor import pattern_matcher
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from loka_compile.kernels import providers
from loka_compile.kernels.quantize import Fp8Format, Scaling

from ..context import GraphKind, PassContext, Reason, Site
from ..find_sites import operands
from .gemm_norm import EPILOGUE_CAST, MOD as NORM_MOD, NormLink, norm_of
from ..rewrite import users_within
from .mod import Evidence, Mod, Stage

aten = torch.ops.aten
log = logging.getLogger("loka")

# Views that keep the last dim (the GEMM's N) and the element order.
_ROW_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default}
# gelu_tanh before gelu: the pattern of aten.gelu without its `approximate` argument
# matches the tanh form too.
_ACTIVATIONS = {
    "relu": torch.relu,
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "hardswish": F.hardswish,
}
# A chain fuses only at this size and above (us: the unfused link as timed, or its sites as
# decided where the chain would take sites kept in high precision): below it, a link timed
# faster fused is not faster in the model's graph (docs/mods/gemm_epilogue.md: how it was set).
MIN_CHAIN_US = 30.0
_MAX_ACTIVATION_NODES = 16  # the longest decomposition (gelu tanh in bf16) is 11 nodes

@dataclasses.dataclass
class Piece:
    """One consumer of a chain: it reads columns [start, start + width) of the output."""

    consumer: Site
    start: int
    width: int
    scale: float                          # the consumer's static A scale

@dataclasses.dataclass
class Chain:
    """One producer and the consumer(s) it feeds: one, or one per piece of a split."""

    producer: Site
    pieces: list                          # Piece per consumer, by column
    activation: str                       # "none" or a key of _ACTIVATIONS
    residual: Optional[torch.fx.Node]     # R of Y + R
    links: list                           # nodes from the producer's output to the consumers' A, in order
    producer_node: torch.fx.Node          # the producer's GEMM as found (erased once fused)
    out_format: Fp8Format                 # the consumers' A format
    norm: Optional[NormLink] = None       # the norm after the residual add (the gemm_norm Mod)
    timing: Optional[object] = None       # speed.EpilogueTiming, where measured
    output: Optional[torch.fx.Node] = None  # the fused GEMM node, once lowered

    @property
    def consumer_names(self) -> str:
        return ", ".join(piece.consumer.name for piece in self.pieces)

@functools.lru_cache(maxsize=None)
def _activation_patterns(dtype: torch.dtype) -> list:
    """(name, pattern) of act(x) for an x of `dtype`: as Inductor decomposes it (its
    post-grad graphs), and as the ATen op itself (graphs traced without decompositions)."""
    def search_fn(fn):
        def search(x):
            return fn(x)
        return search

    example = [torch.empty(8, 16, dtype=dtype)]
    return [(name, pattern_matcher.gen_pattern(search_fn(fn), example, trace))
            for trace in (pattern_matcher.fwd_only, _trace_undecomposed) for name, fn in _ACTIVATIONS.items()]

def _trace_undecomposed(fn, args, **_):
    # gen_pattern passes its own decomposition table in torch 2.13 (not in 2.11): ignored here.
    return pattern_matcher.fwd_only(fn, args, get_decomp_fn=dict)

def _activation_of(node: torch.fx.Node, dtype: torch.dtype) -> Optional[tuple]:
    """(name, output node, the nodes it spans) of an activation whose only input is `node`
    and whose inner nodes nothing else reads; None if none starts there."""
    patterns = _activation_patterns(dtype)
    for root in reversed(users_within(node, _MAX_ACTIVATION_NODES)):  # the outermost match first
        for name, pattern in patterns:
            match = pattern.match(root)
            if not match or match.kwargs.get("x") is not node:
                continue
            inner = set(match.nodes)
            if all(set(n.users) <= inner for n in match.nodes if n is not root) and set(node.users) <= inner:
                return name, root, [n for n in root.graph.nodes if n in inner]
    return None

def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))

def _only_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None

_SPLITS = {aten.split_with_sizes.default, aten.unsafe_split_with_sizes.default, aten.split.Tensor}

def _split_pieces(split: torch.fx.Node, node: torch.fx.Node) -> Optional[list]:
    """[(getitem node, start, width)] of a split of `node` along its last dim whose every
    piece is read (by one getitem each), or None."""
    val = node.meta["val"]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    width = val.shape[-1]
    if split.args[0] is not node or dim not in (-1, val.dim() - 1) or not isinstance(width, int):
        return None
    sizes = split.args[1]
    if isinstance(sizes, int):
        sizes = [sizes] * (width // sizes) + ([width % sizes] if width % sizes else [])
    if not all(isinstance(size, int) for size in sizes) or sum(sizes) != width:
        return None
    getitems = {user.args[1]: user for user in split.users
                if user.op == "call_function" and user.target is operator.getitem}
    if len(getitems) != len(split.users) or sorted(getitems) != list(range(len(sizes))):
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(getitems[i], starts[i], sizes[i]) for i in range(len(sizes))]

def _walk(producer: Site, consumers: dict, norms: bool) -> Optional[tuple]:
    """(pieces [(consumer site, start, width)], activation, residual, norm, links) of the
    chain from `producer`'s output, or None where it is not one (module docstring). A split
    of the output along N, right after the GEMM (its views aside), hands each piece to a
    chain of its own; the pieces must share their activation and have no residual or norm.
    `norms`: a LayerNorm/RMSNorm after the residual add may join (the gemm_norm Mod)."""
    node = producer.node
    found = _walk_from(node, node.meta["val"].dtype, consumers, split_ok=True, norms=norms)
    if found is None:
        return None
    consumer, activation, residual, norm, links = found
    if isinstance(consumer, list):  # the split's pieces
        return consumer, activation, residual, norm, links
    return [(consumer, 0, node.meta["val"].shape[-1])], activation, residual, norm, links

def _walk_from(node: torch.fx.Node, dtype: torch.dtype, consumers: dict, split_ok: bool,
               norms: bool = False) -> Optional[tuple]:
    activation, residual, norm, links = "none", None, None, []
    while True:
        if norm is None and norms:
            # Before the one-reader rule: the value normalized may have other readers.
            found = norm_of(node, dtype)
            if found is not None:
                norm, norm_nodes = found
                links.extend(norm_nodes)
                node = norm.output
                continue
        if (activation == "none" and residual is None and norm is None) or (
                norm is not None and norm.post_activation == "none" and node is norm.output):
            # Before the one-reader rule: a decomposed activation may read its input twice.
            found = _activation_of(node, dtype)
            if found is not None and found[1].meta["val"].dtype == dtype:
                if norm is None:
                    activation = found[0]
                else:
                    norm.post_activation = found[0]
                links.extend(found[2])
                node = found[1]
                continue
        user = _only_user(node)
        if user is None:
            return None
        consumer = consumers.get(user)
        if consumer is not None:
            a, b, bias, _ = operands(user)
            if a is node and b is not node and bias is not node:
                return consumer, activation, residual, norm, links
            return None
        if user.op != "call_function":
            return None
        if user.target in _ROW_VIEWS:
            val = user.meta.get("val")
            if val is None or not statically_known_true(val.shape[-1] == node.meta["val"].shape[-1]):
                return None
            links.append(user)
            node = user
            continue
        if user.target == aten.add.Tensor and residual is None and norm is None and len(user.args) == 2 \
                and not user.kwargs:
            other = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(other, torch.fx.Node) or other is node:
                return None
            out, val = user.meta.get("val"), other.meta.get("val")
            if out is None or val is None or out.dtype != dtype or val.dtype != dtype \
                    or not _same_shape(out, node.meta["val"]) or not _same_shape(val, out):
                return None
            residual = other
            links.append(user)
            node = user
            continue
        if user.target in _SPLITS and split_ok and activation == "none" and residual is None and norm is None:
            return _walk_split(user, node, dtype, consumers, links)
        return None

def _walk_split(split: torch.fx.Node, node: torch.fx.Node, dtype: torch.dtype, consumers: dict,
                links: list) -> Optional[tuple]:
    split_pieces = _split_pieces(split, node)
    if split_pieces is None:
        return None
    links = [*links, split]
    pieces, activations = [], set()
    for getitem, start, width in split_pieces:
        found = _walk_from(getitem, dtype, consumers, split_ok=False)
        if found is None or found[2] is not None:
            return None
        consumer, activation, _, _, piece_links = found
        activations.add(activation)
        pieces.append((consumer, start, width))
        links += [getitem, *piece_links]
    if len(activations) != 1 or len({id(c) for c, _, _ in pieces}) != len(pieces):
        return None
    return pieces, activations.pop(), None, None, links

def _producer_declines(site: Site, decision, allowed: tuple) -> Optional[str]:
    if site.op not in ("mm", "addmm") or site.batch is not None or not site.unit_scalars:
        return "not a 2-D mm/addmm with unit scalars"
    if decision.pad_k or decision.pad_n:
        return "padded"
    device = site.device
    if "triton" not in providers.names():
        return "loka's Triton GEMM is not installed"
    if allowed and "triton" not in allowed:
        return "loka's Triton GEMM is not among the configured providers"
    if device.type != "cpu" and not providers.get("triton").available(device):
        return f"loka's Triton GEMM cannot run on {device}"
    return None

def plan_chains(ctx: PassContext, time_epilogue=None) -> list:
    """The Chains the Mod (and gemm_norm, for chains through a norm) fuses in this graph,
    in graph order. `time_epilogue(chain) -> speed.EpilogueTiming`, where given, decides
    whether it pays."""
    epilogues, norms = MOD.on(ctx.inactive_mods), NORM_MOD.on(ctx.inactive_mods)
    if ctx.kind is not GraphKind.INFERENCE or not (epilogues or norms) or not ctx.static_a_scales:
        return []
    # A site the speed check kept in high precision may still pay as part of a fused chain.
    slow_ok = time_epilogue is not None
    consumers = {}
    for site in ctx.sites:
        decision = ctx.decisions[site.id]
        static = ctx.static_a_scale(site)
        if _eligible(decision, slow_ok) and static is not None and site.op in ("mm", "addmm") \
                and site.batch is None and decision.scaling in (Scaling.TENSORWISE.value, Scaling.ROWWISE.value) \
                and not decision.pad_k:
            consumers[site.node] = site
    order = {node: i for i, node in enumerate(ctx.sites[0].node.graph.nodes)} if ctx.sites else {}
    chains = []
    for site in ctx.sites:
        decision = ctx.decisions[site.id]
        if not _eligible(decision, slow_ok) or _producer_declines(site, decision, ctx.providers) is not None:
            continue
        found = _walk(site, consumers, norms)
        if found is None:
            continue
        pieces, activation, residual, norm, links = found
        formats = {ctx.decisions[consumer.id].a_format for consumer, _, _ in pieces}
        if len(formats) != 1 or (norm is None and not epilogues):
            continue
        chain = Chain(site, [Piece(consumer, start, width, float(ctx.static_a_scale(consumer)["scale"]))
                             for consumer, start, width in pieces],
                      activation, residual, links, site.node, Fp8Format(formats.pop()), norm)
        why = None if norm is None else _norm_declines(chain, decision, order)
        if why is not None:
            log.debug("loka: %s: %s declined: %s", site.name, NORM_MOD, why)
            continue
        if time_epilogue is not None:
            try:
                chain.timing = time_epilogue(chain)
            except Exception as error:  # noqa: BLE001 - a kernel that cannot build or run here costs the link only
                log.warning("loka: %s: %s: timing the fused GEMM failed (%s: %s); not fused", site.name, MOD,
                            type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
                continue
            if any(not ctx.decisions[member.id].fp8 for member in _members(chain)):
                if not _upgrade_in_chain(chain, ctx):
                    continue
            elif chain.timing is not None and not chain.timing.pays:
                log.info("loka: %s: %s: the fused GEMM epilogue is slower (%.1f us vs %.1f us); not fused",
                         site.name, MOD, chain.timing.fused_us, chain.timing.unfused_us)
                continue
            elif chain.timing is not None and chain.timing.unfused_us < MIN_CHAIN_US:
                log.info("loka: %s: %s: the link (%.1f us unfused) is under %.0f us; not fused", site.name, MOD,
                         chain.timing.unfused_us, MIN_CHAIN_US)
                continue
        chains.append(chain)
    return chains

def _eligible(decision, slow_ok: bool) -> bool:
    """A site a chain may take: FP8, or (with the speed check timing chains) kept in high
    precision only because its FP8 GEMM was slower on its own."""
    return decision.fp8 or (slow_ok and decision.reason is Reason.SLOWER_THAN_BF16 and decision.bf16_us is not None
                            and decision.fp8_us is not None and bool(decision.scaling))

def _members(chain: Chain) -> list:
    return [chain.producer, *(piece.consumer for piece in chain.pieces)]

def _cast_us(decision) -> float:
    """The casts in a site's measured FP8 time: its time less its chosen provider's GEMM."""
    gemm = next((c.gemm_us for c in decision.candidates
                 if c.provider == decision.provider and c.gemm_us is not None), None)
    return max(decision.fp8_us - gemm, 0.0) if gemm is not None else 0.0

def _upgrade_in_chain(chain: Chain, ctx: PassContext) -> bool:
    """For a chain with members the speed check kept in high precision (each slower in FP8
    on its own): whether the chain fused in FP8 (the fused GEMM, the producer's casts, each
    consumer's GEMM) beats the sites as decided, each member at its decided time plus the
    pointwise kernel between them. Where it does, those members
    go FP8 (their decisions say why); else the chain is not fused. The pointwise kernel is
    charged only where the chain has an op between its GEMMs."""
    timing = chain.timing
    if timing is None:
        return False
    members = _members(chain)
    decisions = [ctx.decisions[member.id] for member in members]
    if any(d.fp8_us is None or d.bf16_us is None for d in decisions):  # a member's FP8 went untimed
        return False
    # A chain with no op between its GEMMs runs no pointwise kernel as decided either
    # (the consumer's own cast is in its FP8 time).
    tail_us = timing.pointwise_us if chain.activation != "none" or chain.residual is not None or chain.norm else 0.0
    as_decided = sum(d.fp8_us if d.fp8 else d.bf16_us for d in decisions) + tail_us
    # Fused, each consumer's A comes from the epilogue: its GEMM alone (its B is cached).
    fused = timing.fused_us + _cast_us(decisions[0]) + sum(d.fp8_us - _cast_us(d) for d in decisions[1:])
    if as_decided < MIN_CHAIN_US:
        log.info("loka: %s: %s: the chain (%.1f us as decided) is under %.0f us; not fused", chain.producer.name,
                 MOD, as_decided, MIN_CHAIN_US)
        return False
    if as_decided <= fused:
        log.info("loka: %s: %s: the chain in FP8 (%.1f us) does not beat its sites as decided (%.1f us); not fused",
                 chain.producer.name, MOD, fused, as_decided)
        return False
    note = (f"FP8 in the fused chain {chain.producer.name} -> {chain.consumer_names}: {fused:.1f} us vs "
            f"{as_decided:.1f} us with its sites as decided alone")
    log.info("loka: %s: %s", MOD, note)
    for member, decision in zip(members, decisions):
        if not decision.fp8:
            ctx.amend(member, MOD.name, note, fp8=True, reason=Reason.FP8,
                      detail="; ".join(filter(None, (decision.detail, note))))
    return True

def _norm_declines(chain: Chain, decision, order: dict) -> Optional[str]:
    """Why a chain through a norm cannot fuse (gemm_norm's declines beyond gemm_epilogue's)."""
    norm, producer = chain.norm, chain.producer_node
    if decision.scaling not in (Scaling.TENSORWISE.value, Scaling.ROWWISE.value):
        return f"{decision.scaling} producer (the GEMM->norm kernel takes tensorwise and rowwise)"
    bias = operands(producer)[2]
    if bias is not None and bias.meta["val"].dim() != 1:
        return "a bias that varies along M"
    if norm.write_pre and chain.residual is None and not _same_shape(norm.pre.meta["val"], producer.meta["val"]):
        return "the pre-norm value is read elsewhere, as another shape than the GEMM's [M, N] output"
    first = insertion_point(chain)
    if any(param is not None and order.get(param, -1) >= order.get(first, -1) for param in (norm.weight, norm.bias)):
        return "a norm parameter made after the pre-norm value's first reader"
    return None

def insertion_point(chain: Chain) -> torch.fx.Node:
    """Where the fused GEMM goes: before the first node that reads what it writes (a
    consumer, or a reader of the pre-norm value it writes for the gemm_norm Mod)."""
    readers = {piece.consumer.node for piece in chain.pieces}
    if chain.norm is not None:
        readers.update(chain.norm.pre_readers)
    return next(node for node in chain.producer_node.graph.nodes if node in readers)

def _constant(before: torch.fx.Node, name: str, value: torch.Tensor, fake_like: torch.Tensor) -> torch.fx.Node:
    """A get_attr node before `before` reading `value`, registered on the graph module as
    a buffer: Inductor reads a constant, where a `full` in the graph is a fill kernel per call."""
    graph = before.graph
    graph.owning_module.register_buffer(name, value, persistent=False)
    with graph.inserting_before(before):
        node = graph.get_attr(name)
    with fake_like.fake_mode:
        node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return node

def out_scale_constant(chain: Chain, before: torch.fx.Node) -> torch.fx.Node:
    """The consumers' static scales as the producer's fp32 out_scale constant: [1] for one
    consumer, one per output column ([N]) for the pieces of a split."""
    val = chain.producer_node.meta["val"]
    with unset_fake_temporarily():
        if len(chain.pieces) == 1:
            value = torch.full((1,), chain.pieces[0].scale, dtype=torch.float32, device=val.device)
        else:
            value = torch.cat([torch.full((p.width,), p.scale, dtype=torch.float32, device=val.device)
                               for p in chain.pieces])
    return _constant(before, f"_loka_epilogue_scale_{chain.producer_node.name}", value, val)

def consumer_scale_constant(chain: Chain, piece: Piece, scaling: Scaling,
                            before: torch.fx.Node) -> Optional[torch.fx.Node]:
    """A consumer's A scale as a constant: [1, 1] tensorwise (the GEMM reads it as 0-d;
    Inductor would inline a 0-d constant), [M, 1] rowwise when M is concrete; None for a
    symbolic M (the scale is then made in the graph)."""
    val = chain.producer_node.meta["val"]
    rows = val.shape[0]
    if scaling is Scaling.ROWWISE and not isinstance(rows, int):
        return None
    shape = (1, 1) if scaling is Scaling.TENSORWISE else (rows, 1)
    with unset_fake_temporarily():
        value = torch.full(shape, piece.scale, dtype=torch.float32, device=val.device)
    return _constant(before, f"_loka_epilogue_a_scale_{piece.consumer.node.name}", value, val)

def erase_links(chains: list) -> None:
    """Drop each fused chain's bf16 links and its producer's original GEMM, now unread;
    later chains first, so an earlier one's links lose their last reader first."""
    for chain in reversed(chains):
        for node in reversed([chain.producer_node, *chain.links]):
            if not node.users:
                node.graph.erase_node(node)

def time_chain(chain: Chain, ctx: PassContext):
    """The chain's timing by the speed check Dispatch gave the context (`PassContext.time_chain`);
    None without one."""
    return ctx.time_chain(chain, ctx) if ctx.time_chain is not None else None

def description(chain: Chain) -> str:
    parts = [chain.activation] if chain.activation != "none" else []
    parts += ["residual add"] if chain.residual is not None else []
    parts += [chain.norm.description()] if chain.norm is not None else []
    return f"{EPILOGUE_CAST} {chain.producer.name}'s GEMM" + (f" ({', '.join(parts)})" if parts else "")

def _count(evidence: Evidence) -> dict:
    return {"gemm_epilogue": sum(s.casts.get("a", "").startswith(EPILOGUE_CAST) for s in evidence.sites if s.fp8)}

MOD = Mod("gemm_epilogue", Stage.INFERENCE, True,
          "a GEMM writes the next FP8 GEMM's operand from its epilogue (activation, residual)",
          counters=("gemm_epilogue",), count=_count)
