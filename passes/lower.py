"""lower: replace each GEMM that Dispatch sent to FP8 with its operand casts and an FP8
GEMM on the quantized operands (`kernels/scaled_gemm.py`).

Matches:
    C = aten.mm(A, B)               C = aten.addmm(bias, A, B)
    C = aten.bmm(A, B)              C = aten.baddbmm(bias, A, B)
Becomes (rowwise, `fused_casts` on; tensorwise and blockwise alike with their scales):
    a_q, a_s = amax(|A|, K) -> scale -> A / a_s -> clamp -> fp8          (ATen ops)
    b_q, b_s = the same over B^T, written [N, K] and viewed [K, N]       (ATen ops)
    C = provider GEMM(a_q, a_s, b_q, b_s, bias)   aten._scaled_mm | loka.triton_fp8_gemm
                                                  | dequantize + fp32 matmul (emulated)
With the `cat_casts` Mod, an A concatenated along K from pieces whose casts fuse into their
producers, with rows longer than one persistent reduction, is cast per piece
(`find_sites.per_piece_cast`, `scaled_gemm.cast_a_pieces`): each piece's row amax, their
max as the row's scale, each piece cast with it, the FP8 pieces concatenated.
With K or N padded (the `pad` Mod) the operands are zero-padded inside the casts and C
is sliced back. Inductor then fuses each cast into the kernel that produced its operand.
A bmm/baddbmm that find_sites folded (`Site.fold`: a batch of one, or B one matrix
expanded over the batch) is first rewritten as the mm/addmm it is (`_fold_batch`: A viewed
[B * M, K], B's matrix, the output viewed back), then lowered as any 2-D site. Any other
bmm/baddbmm hands the provider 3-D operands as cast ([B, M, K] row-major, [B, K, N]
column-major per matrix, scales per `scaled_gemm`'s docstring) and baddbmm's bias as it
broadcasts; Dispatch gives such sites only providers that declare them (`batched`,
`batched_scalings`) and never pads them.

In training backward graphs, an operand the `saved_fp8` Mod cast in the forward (an
activation the partitioner saves as its FP8 copy and scales) is not cast again: the GEMM
reads that copy.

In inference graphs with the `cached_weights` Mod on, a B operand that is a weight is
not cast in the graph: the GEMM reads its FP8 copy and scales as constants, made once
and refreshed when the weight changes (`mods/cached_weights.py`).

In inference graphs compiled with a calibrated plan (`loka_compile.calibrate`), A of a
tensorwise or rowwise site is cast with its constant scale: clamp(A / s) -> fp8, no amax
(`scaled_gemm.quantize_static`); training graphs ignore static scales. With the
`gemm_epilogue` Mod, a GEMM whose output reaches such an A through an activation and a
residual add writes that FP8 operand from its epilogue (`mods/gemm_epilogue.py`).

Records on each lowered site how each operand is cast (`site.casts`, from
`find_sites.cast_origin`): "fused into <op>" where Inductor computes the cast in the
kernel of the op that produced the operand, else "standalone (<why>)". With
`fused_casts` off every cast is "standalone (loka.quantize_operand)".

Declines: sites whose decision is not FP8 (they keep their ATen op, and the reason is in
the report), addmm/baddbmm with beta or alpha other than 1 (Dispatch marks those).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.kernels.scaled_gemm import (GemmSpec, cast_a_pieces, cast_operand, gemm_quantized,
                                              gemm_norm_to_next_operand, gemm_to_next_operand, static_scale_of)

from .context import GraphKind, PassContext
from .find_sites import (FOLD_SINGLE, VIEW_LIKE, broadcast_matrix, operand_casts, operands, per_piece_cast,
                         saved_operand)
from .mods.benchmarked_reductions import MOD as BENCHMARKED_REDUCTIONS
from .mods.cached_weights import MOD as CACHED_WEIGHTS, cached_operand
from .mods.cat_casts import MOD as CAT_CASTS, per_piece_row_max
from .mods.fused_casts import MOD as FUSED_CASTS
from .mods.gemm_norm import MOD as NORM_MOD
from .mods.gemm_epilogue import MOD as EPILOGUE_MOD
from .mods.gemm_epilogue import (Chain, consumer_scale_constant, description, erase_links, insertion_point,
                                 out_scale_constant, plan_chains, time_chain)
from .mods.weight_both_layouts import restore_original
from .rewrite import insert_traced, replace_with_traced

CACHED_WEIGHT = "cached weight (FP8 copy remade whenever the weight's content changes)"

log = logging.getLogger("loka")
aten = torch.ops.aten


def lower(graph: torch.fx.Graph, ctx: PassContext) -> int:
    lowered = 0
    fused_casts = FUSED_CASTS.on(ctx.inactive_mods)
    cache_weights = ctx.kind is GraphKind.INFERENCE and CACHED_WEIGHTS.on(ctx.inactive_mods)
    chains = plan_chains(ctx, functools.partial(time_chain, ctx=ctx) if ctx.speed_check else None)
    by_producer = {chain.producer.id: chain for chain in chains}
    by_consumer = {piece.consumer.id: (chain, piece) for chain in chains for piece in chain.pieces}
    dangling = []  # views that led cached weights to their GEMMs
    for site in ctx.sites:
        decision = ctx.decisions[site.id]
        if not decision.fp8:
            restore_original(site.node, operands(site.node)[1])
            _report_saved_operands_of_high_precision(site, ctx.casts.setdefault(site.id, {}))
            continue
        if site.fold:  # the site as lowered: its GEMM is the 2-D one now (ctx.sites keeps it as found)
            site = dataclasses.replace(site, node=_fold_batch(site.node, site.fold))
        node = site.node
        a, b, bias, _ = operands(node)
        spec = GemmSpec(Scaling(decision.scaling), Fp8Format(decision.a_format), Fp8Format(decision.b_format),
                        decision.provider, site.dtype, decision.pad_k, decision.pad_n, fused_casts,
                        decision.fast_accum)
        static = ctx.static_a_scale(site)
        if static is not None and spec.scaling is not Scaling.BLOCKWISE:
            spec = dataclasses.replace(spec, a_static_scale=float(static["scale"]))
        spec = dataclasses.replace(spec, amax_guard=ctx.amax_guard(site, spec))
        row_max = per_piece_row_max(BENCHMARKED_REDUCTIONS.on(ctx.inactive_mods), CAT_CASTS.on(ctx.inactive_mods),
                                    spec.pad_k)
        casts = ctx.casts[site.id] = operand_casts(site, decision.scaling, fused_casts,
                                                   a_static=spec.a_static_scale is not None, row_max=row_max)
        if spec.a_static_scale is not None:
            casts["a"] = f"static scale (calibrated {static['policy']})"
        saved_a, saved_b = (_saved(x, which, spec, site, node, casts) for which, x in (("a", a), ("b", b)))
        if operands(node)[1] is not b:  # a weight the Mod cast another way: `_saved` restored it
            b = operands(node)[1]
            casts["b"] = operand_casts(site, decision.scaling, fused_casts)["b"]
        fed, piece = by_consumer.get(site.id, (None, None))
        pieces = None if saved_a or fed else per_piece_cast(a, decision.scaling, fused_casts,
                                                            spec.a_static_scale is not None, row_max)
        if fed is not None:
            casts["a"] = description(fed)
            scale = consumer_scale_constant(fed, piece, spec.scaling, node)
            a_args = [fed.output] if scale is None else [fed.output, scale]
            columns = None if len(fed.pieces) == 1 else (piece.start, piece.width)
            a_cast = functools.partial(_cast_a_from_epilogue, scale=None if scale is not None else piece.scale,
                                       scaling=spec.scaling, columns=columns)
        elif saved_a:
            a_args, a_cast = list(saved_a), _cast_a_saved
        else:
            a_args = [a] if pieces is None else list(pieces[0])
            a_cast = functools.partial(_cast_a, spec=spec, pieces=None if pieces is None else
                                       (len(pieces[0]), a.meta["val"].dtype, pieces[1]))
        cached = cached_operand(node, b, spec, ctx) if cache_weights else None
        if cached is not None:
            casts["b"] = CACHED_WEIGHT
        quantized_b = cached or saved_b
        feeds = by_producer.get(site.id)
        gemm = functools.partial(_gemm_on_cast_b if quantized_b else _gemm, a_cast=a_cast, spec=spec, feeds=feeds)
        args = [*a_args, *quantized_b] if quantized_b else [*a_args, b]
        args += [] if bias is None else [bias]
        if feeds is None:
            replace_with_traced(node, gemm, args)
        else:
            # The consumer's A, written where it is first read; the bf16 links go once it is lowered.
            norm = feeds.norm
            args += [] if feeds.residual is None else [feeds.residual]
            args += [] if norm is None else [p for p in (norm.weight, norm.bias) if p is not None]
            args += [out_scale_constant(feeds, node)]
            _, written = insert_traced(insertion_point(feeds), gemm, args, meta_from=node)
            feeds.output = written[0] if isinstance(written, tuple) else written
            if isinstance(written, tuple):
                _read_pre_norm_value(feeds, written[1], chains)
            note = _feed_note(feeds)
            ctx.amend(site, (NORM_MOD if feeds.norm is not None else EPILOGUE_MOD).name, note, provider="triton",
                      detail=f"{decision.detail}; {note}" if decision.detail else note)
        if cached is not None:
            dangling.append(b)
        lowered += 1
    erase_links(chains)
    for views in dangling:
        _erase_unused_views(views)
    return lowered


def _fold_batch(node: torch.fx.Node, fold: str) -> torch.fx.Node:
    """A bmm/baddbmm that `find_sites.batch_fold` found to be one 2-D GEMM (`fold`: why),
    rewritten as that mm/addmm over A viewed [B * M, K] (a copy where A's rows do not merge:
    fused into A's cast), B's one matrix and the bias as a vector, its output viewed back
    [B, M, N]. Returns the mm/addmm node."""
    a, b, bias, _ = operands(node)
    matrix = b if fold == FOLD_SINGLE else broadcast_matrix(b)
    dtype = node.meta["val"].dtype  # the matrix before its expand may be before autocast's cast too

    def folded(a, matrix, *bias):
        k, n = matrix.shape[-2], matrix.shape[-1]
        rows, weight = a.reshape(-1, k), matrix.reshape(k, n).to(dtype)
        out = torch.addmm(bias[0].reshape(-1), rows, weight) if bias else torch.mm(rows, weight)
        return out.view(a.shape[0], a.shape[1], n)

    inserted = replace_with_traced(node, folded, [a, matrix] + ([] if bias is None else [bias]))
    return next(n for n in inserted if n.op == "call_function" and n.target in (aten.mm.default, aten.addmm.default))


def _read_pre_norm_value(chain: Chain, pre: torch.fx.Node, chains: list) -> None:
    """The readers of the value a fused norm normalized (gemm_norm) read the copy the
    fused GEMM wrote instead, and so does a later chain that adds it as its residual."""
    old = chain.norm.pre
    for reader in chain.norm.pre_readers:
        reader.replace_input_with(old, pre)
    for other in chains:
        if other.residual is old:
            other.residual = pre


def _feed_note(chain: Chain) -> str:
    """Why the producer's decision now runs on loka's Triton GEMM."""
    timing = chain.timing
    measured = "" if timing is None else f": {timing.fused_us:.1f} us vs {timing.unfused_us:.1f} us unfused"
    norm = "" if chain.norm is None else f", {chain.norm.kind} norm" + (
        " (and the pre-norm value)" if chain.norm.write_pre else "")
    return f"gemm_epilogue writes the FP8 A of {chain.consumer_names} ({chain.activation}" + (
        ", residual" if chain.residual is not None else "") + norm + ")" + measured


def _erase_unused_views(node: torch.fx.Node) -> None:
    """Drop the views that led a cached weight to its GEMM once nothing reads them."""
    while node.op == "call_function" and node.target in VIEW_LIKE and not node.users:
        source = node.all_input_nodes[0]
        node.graph.erase_node(node)
        node = source


def _cast_a(args: tuple, *, spec: GemmSpec, pieces):
    """(A's cast, the arguments after A's): A is args[0], or with `pieces` (count, A's
    dtype, flatten) the first `count` arguments are the pieces of its concatenation."""
    if pieces is None:
        return cast_operand(args[0], "a", spec), args[1:]
    count, dtype, flatten = pieces
    return cast_a_pieces(list(args[:count]), spec, dtype, flatten), args[count:]


def _gemm(*args, a_cast, spec: GemmSpec, feeds: Optional[Chain] = None):
    (a_q, a_s), (b, *rest) = a_cast(args)
    return _gemm_of(a_q, a_s, *cast_operand(b, "b", spec), rest, spec, feeds)


def _gemm_of(a_q, a_s, b_q, b_s, rest: list, spec: GemmSpec, feeds: Optional[Chain]):
    """The GEMM on quantized operands; `rest` is [bias] or [], then, for a GEMM that
    `feeds` a chain (the gemm_epilogue Mod), the residual if any and the consumer's scale,
    whose FP8 A it then returns."""
    if feeds is None:
        return gemm_quantized(a_q, a_s, b_q, b_s, rest[0] if rest else None, spec)
    out_scale = rest.pop()
    norm = feeds.norm
    norm_bias = rest.pop() if norm is not None and norm.bias is not None else None
    norm_weight = rest.pop() if norm is not None and norm.weight is not None else None
    residual = rest.pop() if feeds.residual is not None else None
    bias = rest[0] if rest else None
    if norm is None:
        return gemm_to_next_operand(a_q, a_s, b_q, b_s, bias, residual, feeds.activation, spec, feeds.out_format,
                                    out_scale)
    return gemm_norm_to_next_operand(a_q, a_s, b_q, b_s, bias, residual, feeds.activation, norm.kind, norm_weight,
                                     norm_bias, norm.eps, norm.post_activation, spec, feeds.out_format, out_scale,
                                     norm.write_pre)


def _cast_a_saved(args: tuple):
    return (args[0], args[1]), args[2:]


def _cast_a_from_epilogue(args: tuple, *, scale: Optional[float], scaling: Scaling, columns: Optional[tuple]):
    """A written in FP8 by the producing GEMM's epilogue with this site's static scale:
    args[0] (its columns [start, start + width) for a piece of a split: a strided view,
    no copy), then its scale constant (`gemm_epilogue.consumer_scale_constant`), or with
    `scale` given, the scale made here."""
    q = args[0] if columns is None else args[0][:, columns[0]:columns[0] + columns[1]]
    if scale is not None:
        return (q, static_scale_of(q, scale, scaling)), args[1:]
    constant = args[1].reshape(()) if scaling is Scaling.TENSORWISE else args[1]
    return (q, constant), args[2:]


def _saved(operand: torch.fx.Node, which: str, spec: GemmSpec, site, node: torch.fx.Node, casts: dict) -> Optional[tuple]:
    """(q, scale) of an operand the saved_fp8 or weight_both_layouts Mod cast in the
    forward, when that cast is the one `spec` asks for; else None: a weight the GEMM then
    reads as written where it can (`restore_original`), else the operand is cast here from
    its dequantized copy, which a warning reports."""
    found = saved_operand(operand)
    if found is None:
        return None
    q, scale = found
    fmt = spec.a_format if which == "a" else spec.b_format
    tensorwise = spec.scaling is Scaling.TENSORWISE
    if q.meta["val"].dtype == fmt.dtype and spec.scaling in (Scaling.TENSORWISE, Scaling.ROWWISE) \
            and (scale.meta["val"].dim() == 0) == tensorwise and not (spec.pad_k or spec.pad_n) \
            and spec.a_static_scale is None:
        return found
    if restore_original(node, operand):
        return None
    log.warning("loka: %s: operand %s was saved in FP8 by the forward as another cast than this GEMM's (%s %s); "
                "cast again from its dequantized copy", site.name, which, spec.scaling.value, fmt.value)
    casts[which] = "standalone (cast again from the forward's FP8 copy: another cast than this GEMM's)"
    return None


def _report_saved_operands_of_high_precision(site, casts: dict) -> None:
    """A site kept in high precision here that the saved_fp8 Mod, deciding in the joint
    graph, took for FP8 reads the dequantized FP8 copy: say so (rare: the two decisions
    differ only where the speed check's timings do)."""
    a, b, _, _ = operands(site.node)
    for which, operand in (("a", a), ("b", b)):
        if saved_operand(operand) is not None:
            casts[which] = "dequantized FP8 copy saved by the forward (the GEMM runs in high precision)"
            log.warning("loka: %s runs in high precision on the FP8 copy of operand %s that the forward saved "
                        "(%s)", site.name, which, site.id)


def _gemm_on_cast_b(*args, a_cast, spec: GemmSpec, feeds: Optional[Chain] = None):
    (a_q, a_s), (b_q, b_scale, *rest) = a_cast(args)
    if spec.scaling is Scaling.TENSORWISE:
        b_scale = b_scale.reshape(())  # cached as [1, 1]
    return _gemm_of(a_q, a_s, b_q, b_scale, rest, spec, feeds)
