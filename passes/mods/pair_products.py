"""pair_products: inner products of pairs of fields, written as the sum of the product of two
concatenations of repeated fields, read the fields from one [B, F, d] tensor instead. An opt-in
Mod (`enabled_mods=["pair_products"]`) on the joint graph of training compiles past the probe
window (`LokaJointPass`), before the partitioner decides what the forward saves, and on
inference graphs (`LokaPostGradPass`, before loka's pipeline), where p and q have no backward.

Matches, in a joint graph, an inner-product layer that concatenates the field embeddings
[B, 1, d] of every pair (i, j), i < j, into p and q (F fields, K = F (F - 1) / 2 pairs):

    p = cat([e_0, e_0, ..., e_1, ...], 1)        # [B, K, d]
    q = cat([e_1, e_2, ..., e_2, ...], 1)
    y = sum(p * q, 2, keepdim=True)               # [B, K, 1] (or [B, K] without keepdim)
    backward: slice k of g * q (and of g * p), g = expand(dy), summed per field
      ->
    E = cat([e_0, ..., e_{F-1}], 1)               # [B, F, d], fields in order of first appearance
    y = cat([sum(E[:, i:i+1] * E[:, i+1:F], 2, keepdim) for each run of pairs (i, i+1..F-1)], 1)
    backward: g[:, k:k+1] * q_k (and * p_k), the same products of the same values, summed alike

As written the forward writes p and q (two [B, K, d] copies, from 2 K cat inputs), reads
them back once for the product and saves them for the backward, whose cat gradient
slices them again. After: the forward reads E and writes [B, K, 1]; the backward reads the
embeddings it already had. The backward's values and their order of summation are unchanged
(each slice of an elementwise product is the product of the slices). The forward's outputs are
the same products summed over d by the same kind of reduction (r = d) over shorter rows;
whether Inductor's reduction sums them in the same tree is its choice of block shape, as it is
between batch sizes, so the Mod is opt-in: bit-exact on CPU in the tests, not proven so on a GPU.
`bmm(E, E^T)` would sum in a GEMM's order instead, a different rounding.

Runs are the pairs in which p repeats one field and q takes consecutive fields of E (or the
other way round). Declines (logged at DEBUG) when p or q is read by anything but the product and
such slices of the backward's products, the inputs are not [B, 1, d] of one dtype, or the runs
are more than half the pairs (each run is a reduction launch).

Walks the graph: a cat has any number of inputs, which Inductor's pattern matcher does not
match as one pattern.
"""

from __future__ import annotations

import logging

import torch

from ..rewrite import insert_traced, replace_with_traced
from .mod import Mod, Stage

aten = torch.ops.aten
log = logging.getLogger("loka.passes")

# Each run is one reduction launch; past one run per two pairs the runs would launch more
# kernels than the cats they replace (Inductor's plan packs several cat inputs per launch;
# docs/mods/pair_products.md has the count).
MAX_RUN_SHARE = 0.5


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _field_cat(node) -> "list | None":
    """The [B, 1, d] inputs, of one dtype, of a cat along dim 1, else None."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.cat.default):
        return None
    inputs = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    values = [_val(t) for t in inputs]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 3 for v in values) or dim % 3 != 1:
        return None
    if any(type(v.shape[1]) is not int or v.shape[1] != 1 for v in values):
        return None
    if len({(v.dtype, v.device, str(v.shape[2])) for v in values}) != 1:
        return None
    return list(inputs)


def _runs(left: list, right: list, fields: list) -> list:
    """(index in E of the repeated field, first index in E of the consecutive ones, length,
    whether the repeated one is on the left) per run of pairs, in order."""
    index = {f: i for i, f in enumerate(fields)}
    runs, k = [], 0
    while k < len(left):
        best = None
        for fixed, moving, on_left in ((left, right, True), (right, left, False)):
            n = 1
            while k + n < len(left) and fixed[k + n] is fixed[k] and index[moving[k + n]] == index[moving[k]] + n:
                n += 1
            if best is None or n > best[2]:
                best = (index[fixed[k]], index[moving[k]], n, on_left)
        runs.append(best)
        k += best[2]
    return runs


def _product_sum(node: torch.fx.Node) -> "torch.fx.Node | None":
    """The product when `node` is sum(p * q, last dim) of two different tensors."""
    if node.target is not aten.sum.dim_IntList or len(node.args) < 2 or node.kwargs.get("dtype") is not None:
        return None
    product, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not (isinstance(product, torch.fx.Node) and product.target is aten.mul.Tensor and len(product.users) == 1):
        return None
    if list(dims or ()) not in ([2], [-1]) or not isinstance(keepdim, bool) or product.args[0] is product.args[1]:
        return None
    return product


def _sliced_products(cat: torch.fx.Node, product: torch.fx.Node) -> "list | None":
    """(slice node, the other factor, whether it came first, k) for every width-1 slice along
    dim 1 of each backward product `other * cat` (or `cat * other`); None when the cat has
    another reader."""
    found = []
    for user in cat.users:
        if user is product:
            continue
        if user.target is not aten.mul.Tensor or len(user.args) != 2 or user.args[0] is user.args[1]:
            return None
        other_first = user.args[1] is cat
        other = user.args[0] if other_first else user.args[1]
        if not (isinstance(_val(other), torch.Tensor) and _val(other).dim() == 3
                and str(_val(other).shape[1]) == str(_val(cat).shape[1])):
            return None  # a factor broadcast along the pairs has no slice k to take
        for piece in user.users:
            args = list(piece.args) + [1] * (5 - len(piece.args))
            if piece.target is not aten.slice.Tensor or piece.kwargs or args[1] % 3 != 1 or args[4] != 1 \
                    or type(args[2]) is not int or type(args[3]) is not int or args[3] - args[2] != 1:
                return None
            found.append((piece, other, other_first, args[2]))
    return found


def _replace_sliced_products(graph: torch.fx.Graph, pieces: list) -> None:
    """Each backward slice k of `g * p` (or of `g * q`) replaced by `g[:, k:k+1] * p_k`, all traced
    at once (one trace per graph, not per pair)."""
    if not pieces:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    factors = list(dict.fromkeys(f for _, other, _, field, _ in pieces for f in (other, field)))
    where = {f: i for i, f in enumerate(factors)}
    spec = [(where[other], where[field], k, other_first) for _, other, other_first, field, k in pieces]

    def products(*values):
        return tuple(values[g][:, k:k + 1] * values[e] if other_first else values[e] * values[g][:, k:k + 1]
                     for g, e, k, other_first in spec)

    first = min((piece for piece, *_ in pieces), key=order.__getitem__)
    _, results = insert_traced(first, products, factors, meta_from=first)
    for (piece, *_), result in zip(pieces, results):
        piece.replace_all_uses_with(result)
        graph.erase_node(piece)


def _per_run(runs: list, keepdim: bool):
    """The pair products from the fields, one reduction per run of pairs, in the pairs' order."""
    def products(*fields):
        table = torch.cat(fields, 1)
        outs = []
        for fixed, start, n, on_left in runs:
            one, many = table[:, fixed:fixed + 1], table[:, start:start + n]
            outs.append((one * many if on_left else many * one).sum(2, keepdim=keepdim))
        return torch.cat(outs, 1)
    return products


def rewrite_pair_products(graph: torch.fx.Graph) -> int:
    """Rewrite each product-sum of two concatenations of fields in a joint graph (module
    docstring), forward and backward, or in an inference graph; return how many."""
    rewritten = 0
    for node in list(graph.nodes):
        product = _product_sum(node)
        if product is None:
            continue
        cats = list(product.args[:2])
        left, right = (_field_cat(c) for c in cats)
        if left is None or right is None or len(left) != len(right):
            continue
        sliced = [_sliced_products(c, product) for c in cats]
        if None in sliced:
            log.debug("pair_products: %s declined: p or q has another reader", node.name)
            continue
        fields = list(dict.fromkeys(left + right))
        runs = _runs(left, right, fields)
        if len(runs) > MAX_RUN_SHARE * len(left):
            log.debug("pair_products: %s declined: %d runs of %d pairs", node.name, len(runs), len(left))
            continue
        _replace_sliced_products(graph, [(piece, other, other_first, inputs[k], k)
                                         for inputs, pieces in zip((left, right), sliced)
                                         for piece, other, other_first, k in pieces])
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        replace_with_traced(node, _per_run(runs, keepdim), fields)
        for dead in dict.fromkeys([product, *(u for c in cats for u in c.users), *cats]):
            if not dead.users:  # the product, the backward's products, then p and q
                graph.erase_node(dead)
        rewritten += 1
        log.debug("pair_products: %s: %d pairs of %d fields in %d runs", node.name, len(left), len(fields), len(runs))
    return rewritten


MOD = Mod("pair_products", Stage.JOINT_GRAPH, False,
          "inner products of field pairs read from one [B, F, d] tensor, not from two concatenated copies",
          counters=("pair_products",),
          count=lambda evidence: {"pair_products": sum(evidence.results.get("pair_products", ()))})
