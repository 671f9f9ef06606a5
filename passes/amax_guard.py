"""amax_guard: a graph's tensorwise amax guards as one op at its end.

Matches: the `loka.amax_guard` nodes that `lower` and the saved_fp8 Mod put after each
guarded tensorwise cast (`scaled_gemm.AmaxGuard`: an FP8 variant after a probe window).

Becomes, before the graph's output:
    amaxes = aten.stack([amax_1, ..., amax_n])
    loka.amax_guards(amaxes, name, [key_i], [operand_i], [limit_i])
so each amax is still computed where its cast computes it (by the same reduction, in the
same kernel) and a call runs one guard op for the whole graph, not one per operand: an
op call costs host time (about 15 us through torch.library) where the GPU does next to
nothing. The backend makes the buffer `name` before the graph first runs
(`loka_compile/amax_guard.py`) and reads it between calls.

Declines: graphs without guards (every graph outside an FP8 variant after a window, and
those whose sites are not tensorwise).
"""

from __future__ import annotations

import hashlib

import torch

from .context import PassContext
from .rewrite import insert_traced


def amax_guard(graph: torch.fx.Graph, ctx: PassContext) -> int:
    guards = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.loka.amax_guard.default]
    if not guards:
        return 0
    keys, operands, limits = (list(column) for column in zip(*(n.args[1:4] for n in guards)))
    entries = repr(list(zip(keys, operands, limits))).encode()
    # One buffer per set of guards: a rebuilt graph with other guards gets another (the
    # buffers a captured CUDA graph writes to live as long as the process).
    name = f"{keys[0].split('/')[0]}/{ctx.kind.value}/{hashlib.sha256(entries).hexdigest()[:12]}"
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    _, stacked = insert_traced(output, lambda *amaxes: torch.stack(amaxes), [n.args[0] for n in guards],
                               meta_from=guards[0])
    with graph.inserting_before(output):
        merged = graph.call_function(torch.ops.loka.amax_guards.default, (stacked, name, keys, operands, limits))
    merged.meta["val"] = None
    for node in guards:
        graph.erase_node(node)
    return len(guards)
