"""keepdim_outputs: a graph output computed by a sum or product with keepdim=True is returned
as the reduction without its kept dims, viewed back to the kept shape.

Matches (any graph kind; the node read by the graph's output):

    r = aten.sum.dim_IntList(x, dims, True)      ->   r = aten.view(aten.sum.dim_IntList(x, dims), kept shape)
    r = aten.prod.dim_int(x, dim, True)          ->   r = aten.view(aten.prod.dim_int(x, dim), kept shape)

Why: Inductor's mix-order reduction (on by default, CUDA) fuses a row reduction and a column
sum of the same [M, N] data into one kernel, then finishes the column sum in the wrapper as
`buf = workspace.view(splits, N).sum(0)`: in torch 2.11 that rebinds the buffer as [N] and
drops the kept dims, so a keepdim result returned by the graph comes back with another shape
(torch later restores it with a view). loka makes the pair: a row-wise FP8 cast of a
gradient (its row amax) beside the column sum of the same gradient that is a broadcast
bias's gradient (`x @ W + b` of a 3-D x with b [1, 1, N]: a [1, 1, N] keepdim sum), and
autograd rejects the [N] gradient (docs/benchmarks.md has the model that met it). With the
kept dims in a view, the reduction's own buffer is [N] whatever Inductor does with it.

Declines: reductions without keepdim, and keepdim reductions that the graph does not return
(their readers are kernels that index the buffer, not its shape).
"""

from __future__ import annotations

import torch

from .context import PassContext
from .rewrite import replace_with_traced

aten = torch.ops.aten


def _kept_shape(shape, dims) -> list:
    rank = len(shape)
    reduced = {d % rank for d in dims} if rank else set()
    return [1 if i in reduced else size for i, size in enumerate(shape)]


def _keepdim_reduction(node: torch.fx.Node):
    """The function of its input that recomputes a keepdim sum/prod node without the kept
    dims and views it back, else None."""
    if node.op != "call_function" or node.target not in (aten.sum.dim_IntList, aten.prod.dim_int):
        return None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims, dtype = node.args[1], node.kwargs.get("dtype")
    if not keepdim or (node.target is aten.sum.dim_IntList and not dims):  # sum over dims [] is over every dim
        return None
    if node.target is aten.prod.dim_int:
        return lambda x: torch.prod(x, dims, dtype=dtype).view(_kept_shape(x.shape, [dims]))
    dims = list(dims)
    return lambda x: torch.sum(x, dims, dtype=dtype).view(_kept_shape(x.shape, dims))


def keepdim_outputs(graph: torch.fx.Graph, ctx: PassContext) -> int:
    """Rewrite each keepdim sum/prod the graph returns (module docstring); return how many."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    rewritten = 0
    for node in dict.fromkeys(output.all_input_nodes):
        recompute = _keepdim_reduction(node)
        if recompute is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        replace_with_traced(node, recompute, [node.args[0]])
        rewritten += 1
    return rewritten
