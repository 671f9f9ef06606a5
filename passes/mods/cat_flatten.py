"""cat_flatten: concatenations that only move data already laid out as their result become one
concatenation, or a view. A Mod that is on by default (`disabled_mods=["cat_flatten"]` switches
it off); it runs on the Dynamo graph (torch-level IR), so the backward follows from the forward.
Bit-exact in the forward and the backward: no value is computed, only where it is stored.

Matches, in a Dynamo graph, two forms of `torch.cat` (`torch.concat`, `torch.concatenate`):

1. a cat whose inputs include cats along the same dim that nothing else reads:

       a = cat([a_1, ..., a_m], d)
       b = cat([b_1, ..., b_n], d)      ->    y = cat([a_1, ..., a_m, b_1, ..., b_n, c], d)
       y = cat([a, b, c], d)

   Inductor writes each input of a cat straight into the cat's buffer, but an input that is
   itself a cat has its own buffer, which the outer cat then copies (two interaction layers'
   outputs, each a cat of pairwise products, concatenated). A `torch.stack` along the cat's dim
   is a cat of its inputs unsqueezed there, and is absorbed the same way (embedding lookups
   stacked, then concatenated after the dense fields).

2. a cat of every piece of one `split`/`chunk`/`tensor_split` (or of every `unbind` piece,
   each unsqueezed at the same dim), in order, along dim c:

       pieces = split(x, s, d)               c == d:  y = x
       y = cat(pieces, c)              ->    c != d:  y = x.unflatten(d, (n, s)).movedim(d, c).flatten(c, c + 1)

   A cat along c != d takes pieces of one size s along d. Their values, side by side along c,
   are x's with its dim d cut into n blocks moved next to c: a view where x's strides allow it
   (`cat(split(x, 1, 1), -1)` of a contiguous [B, F, d], the fields put side by side for a
   DNN: the view [B, 1, F * d]), else one copy, the one the cat made (`.contiguous()`: the
   cat's readers may view its result as contiguous). Unbind pieces are `x.movedim(d, u)` split in ones at u.

Declines a match (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module      its module is under `exclude_modules` (the exclusion stays exact)
    inner_used_elsewhere every inner cat is also read by another node, or twice by this one (its buffer
                         is needed anyway)
    other_dim            every inner cat is along another dim, or its dim is unknown
    other_state_region   every inner cat, or the split, runs under another grad mode or autocast
                         state than the cat (`with torch.no_grad()` between them): read in the
                         cat's place, its inputs would pass gradients eager does not
    shared_input         an inner cat's input, or the split's source, is read three times or more,
                         or a piece of the split is read by another node: autograd sums its
                         gradients in an order the rewrite would change (two terms add the same
                         either way), so the backward would no longer be bit-exact
    mixed_dtypes         the inputs differ in dtype or device (cat promotes; nested cats promote
                         in steps)
    partial_split        the cat takes some of the split's pieces, or one twice, or other tensors
    pieces_out_of_order  the cat takes every piece once but not in order
    unknown_shape        the sizes along d or the dims are not known ints
    strided_result       the cat's result is not contiguous (a channels-last cat), which the
                         view or its copy would not reproduce
    aliased_write        x's storage, or the cat's result, is written in place in the graph, or
                         the result leaves the graph with x (a view would share what the cat
                         copied)

Cats of pieces of several sources are not counted. The bodies of higher-order ops in the graph
(an activation-checkpointed region is one) are rewritten the same way, each graph all or nothing.
The whole-split form runs first, so a cat of a cat of a whole split along its dim flattens too.

Inductor has both ideas as pre-grad passes that its default config leaves off
(`pre_grad_fusion_options` empty; `merge_concats_pass` a stub outside Meta's build); its
post-grad lowering undoes `cat(split_with_sizes(x))` only along the split's own dim. This walks
the Dynamo graph rather than using Inductor's pattern matcher (ATen graphs), since a cat has any
number of inputs and the rewrite must reach the backward.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch._prims_common import is_contiguous_or_false

from ..dynamo_graph import (Rewrites, alias_root, arg, copy_provenance, example_value, fake_mode, module_of,
                            rewrite_matches, set_example_values, state_regions, written_or_returned)
from .mod import Mod, Stage, count_rewritten

_CATS = {torch.cat, torch.concat, torch.concatenate}
_SPLITS = {torch.split, torch.functional.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk,
           torch.tensor_split, torch.Tensor.tensor_split, torch.split_with_sizes, torch.Tensor.split_with_sizes,
           torch.unsafe_split, torch.unsafe_split_with_sizes}
_SPLIT_METHODS = {"split", "chunk", "tensor_split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes"}
_UNBINDS = {torch.unbind, torch.Tensor.unbind}


def _is_cat(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _CATS \
        and node.kwargs.get("out") is None


def _is_stack(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is torch.stack \
        and node.kwargs.get("out") is None and isinstance(arg(node, 0, "tensors"), (list, tuple))


def _tensors(node: torch.fx.Node) -> list:
    return list(arg(node, 0, "tensors"))


def _cat_dim(node: torch.fx.Node):
    """A cat's dim as a non-negative int, else None (a symbolic or unknown one)."""
    dim = arg(node, 1, "dim", node.kwargs.get("axis", 0))
    value = example_value(node)
    if type(dim) is not int or not isinstance(value, torch.Tensor):
        return None
    return dim % value.dim()


def _reads(node) -> int:
    """How many times other nodes read `node` (a list naming it twice reads it twice): the number of
    gradients autograd sums for it, whose order a rewrite keeps only while there are at most two."""
    reads = []
    for user in node.users:
        torch.fx.node.map_arg((user.args, user.kwargs), lambda n: reads.append(n) if n is node else None)
    return len(reads)


def _same_kind(values) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values) \
        and len({(v.dtype, v.device) for v in values}) == 1


# ------------------------------------------------------------ form 1: a cat of cats


@dataclasses.dataclass
class _NestedCat:
    node: torch.fx.Node
    inner: list          # the input cats to absorb
    module: str


def _candidate_inners(node: torch.fx.Node) -> list:
    return [t for t in dict.fromkeys(_tensors(node)) if _is_cat(t) or _is_stack(t)]


def _nested_cat_of(gm, node, inputs: dict) -> "_NestedCat | None":
    if not _is_cat(node) or not isinstance(arg(node, 0, "tensors"), (list, tuple)):
        return None
    inner = _candidate_inners(node)
    return _NestedCat(node, inner, module_of(node)) if inner else None


def _nested_decline(gm, found: _NestedCat, inputs: dict) -> "str | None":
    dim = _cat_dim(found.node)
    same_dim = [c for c in found.inner if dim is not None and _cat_dim(c) == dim]
    if not same_dim:
        return "other_dim"
    regions = state_regions(gm.graph)
    same_dim = [c for c in same_dim if regions[c] == regions[found.node]]
    if not same_dim:
        return "other_state_region"
    only_here = [c for c in same_dim if set(c.users) == {found.node} and _reads(c) == 1]
    if not only_here:
        return "inner_used_elsewhere"
    only_here = [c for c in only_here if all(_reads(t) <= 2 for t in _tensors(c))]
    if not only_here:
        return "shared_input"
    values = [example_value(t) for t in _tensors(found.node)] + \
        [example_value(t) for c in only_here for t in _tensors(c)]
    if not _same_kind(values):
        return "mixed_dtypes"
    found.inner = only_here
    return None


def _absorb_inner_cats(gm, found: _NestedCat) -> None:
    node = found.node
    flat = []
    for t in _tensors(node):  # read now: an inner cat may have absorbed its own inner cats first
        flat.extend(_pieces_of_inner(gm, t, node) if t in found.inner else [t])
    if "tensors" in node.kwargs:
        node.update_kwarg("tensors", flat)
    else:
        node.update_arg(0, flat)
    for inner in found.inner:
        gm.graph.erase_node(inner)


def _pieces_of_inner(gm, inner: torch.fx.Node, before: torch.fx.Node) -> list:
    """An inner cat's inputs; a stack's, each unsqueezed at its dim (a view), inserted before `before`."""
    if _is_cat(inner):
        return _tensors(inner)
    dim = _cat_dim(inner)
    with gm.graph.inserting_before(before):
        pieces = [gm.graph.call_function(torch.unsqueeze, (t, dim)) for t in _tensors(inner)]
    copy_provenance(inner, pieces)
    set_example_values(gm, pieces, fake_mode([inner, before]))
    return pieces


# ------------------------------------------------------------ form 2: a cat of a whole split


@dataclasses.dataclass
class _WholeSplit:
    node: torch.fx.Node
    split: torch.fx.Node
    source: torch.fx.Node
    module: str
    unbind: bool
    pieces: list          # the cat's inputs, each (getitem index, unsqueeze dim or None)


def _piece_of(node):
    """(split node, getitem index, unsqueeze dim or None) when `node` is a getitem of a split-like
    node, or an unsqueeze of a getitem of an unbind; else None."""
    unsqueeze = None
    if isinstance(node, torch.fx.Node) and node.op in ("call_method", "call_function") \
            and (node.target == "unsqueeze" or node.target is torch.unsqueeze):
        unsqueeze = arg(node, 1, "dim")
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node) and type(node.args[1]) is int):
        return None
    split = node.args[0]
    is_unbind = _is_unbind(split)
    if not (is_unbind or _is_split(split)) or (unsqueeze is not None) != is_unbind:
        return None
    return split, node.args[1], unsqueeze


def _is_split(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _SPLITS) \
        or (node.op == "call_method" and node.target in _SPLIT_METHODS)


def _is_unbind(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _UNBINDS) \
        or (node.op == "call_method" and node.target == "unbind")


def _whole_split_of(gm, node, inputs: dict) -> "_WholeSplit | None":
    if not _is_cat(node) or not isinstance(arg(node, 0, "tensors"), (list, tuple)):
        return None
    pieces = [_piece_of(t) for t in _tensors(node)]
    if not pieces or None in pieces or len({p[0] for p in pieces}) != 1:
        return None
    split = pieces[0][0]
    if not isinstance(split.args[0] if split.args else None, torch.fx.Node):
        return None
    return _WholeSplit(node, split, split.args[0], module_of(node), _is_unbind(split),
                       [(index, unsqueeze) for _, index, unsqueeze in pieces])


def _split_dim(found: _WholeSplit):
    value = example_value(found.source)
    dim = arg(found.split, 1, "dim", 0) if found.unbind else arg(found.split, 2, "dim", 0)
    if type(dim) is not int or not isinstance(value, torch.Tensor):
        return None
    return dim % value.dim()


def _whole_split_decline(gm, found: _WholeSplit, inputs: dict) -> "str | None":
    x, pieces = example_value(found.source), example_value(found.split)
    d, c = _split_dim(found), _cat_dim(found.node)
    if not isinstance(x, torch.Tensor) or not isinstance(pieces, (tuple, list)) or d is None or c is None:
        return "unknown_shape"
    regions = state_regions(gm.graph)
    if regions[found.split] != regions[found.node]:
        return "other_state_region"
    indices = [index for index, _ in found.pieces]
    if sorted(indices) != list(range(len(pieces))):
        return "partial_split"
    if indices != sorted(indices):
        return "pieces_out_of_order"
    if found.unbind:
        unsqueezed = {u for _, u in found.pieces}
        if len(unsqueezed) != 1 or type(next(iter(unsqueezed))) is not int:
            return "unknown_shape"
    sizes = [p.shape[d] if not found.unbind else 1 for p in pieces]
    if not all(type(s) is int for s in sizes) or type(x.shape[d]) is not int or sum(sizes) != x.shape[d]:
        return "unknown_shape"
    if not _same_kind([x, *pieces]):
        return "mixed_dtypes"
    piece_sizes = _sizes(x, d, keep=False) if found.unbind else _sizes(x, d)
    if any(_sizes(p, None if found.unbind else d) != piece_sizes for p in pieces):
        return "unknown_shape"  # the split's dim was not read as the one it cut
    if _reads(found.source) > 2 or not all(_read_only_by_cat(t, found.node) for t in _tensors(found.node)):
        return "shared_input"
    if not is_contiguous_or_false(example_value(found.node)):
        return "strided_result"
    root = alias_root(found.source)
    source_written, source_returned = written_or_returned(root)
    cat_written, cat_returned = written_or_returned(found.node)
    if source_written or cat_written or (cat_returned and (source_returned or root.op in ("placeholder", "get_attr"))):
        return "aliased_write"
    return None


def _read_only_by_cat(piece: torch.fx.Node, cat: torch.fx.Node) -> bool:
    """Whether the cat alone reads this input (a getitem, or an unsqueeze of one) and its getitem."""
    if set(piece.users) != {cat}:
        return False
    return piece.target is operator.getitem or set(piece.args[0].users) == {piece}


def _sizes(value, dim=None, keep=True) -> list:
    """A tensor's sizes as strings (no guard on a symbolic one), the one at `dim` as "*" or dropped."""
    sizes = [str(s) for s in value.shape]
    if dim is not None:
        sizes[dim:dim + 1] = ["*"] if keep else []
    return sizes


def _unsqueezed_dim(found: _WholeSplit, x) -> int:
    return found.pieces[0][1] % x.dim()


def _undo_split(gm, found: _WholeSplit) -> None:
    graph, node, x = gm.graph, found.node, found.source
    value = example_value(x)
    d, c = _split_dim(found), _cat_dim(node)
    n = len(found.pieces)
    size = 1 if found.unbind else value.shape[d] // n
    new = []
    with graph.inserting_before(node):
        if found.unbind:  # piece i unsqueezed at u is x.movedim(d, u) cut in ones at u
            u = _unsqueezed_dim(found, value)
            if u != d:
                x = graph.call_method("movedim", (x, d, u))
                new.append(x)
            d = u
        if c != d:
            x = graph.call_method("unflatten", (x, d, (n, size)))
            x = graph.call_method("movedim", (x, d, c))
            x = graph.call_method("flatten", (x, c, c + 1))
            new += [x.args[0].args[0], x.args[0], x]
    copy_provenance(node, new)
    set_example_values(gm, new, fake_mode([found.source, node]))
    if not is_contiguous_or_false(example_value(x)):  # readers may view the cat's contiguous result
        with graph.inserting_before(node):
            x = graph.call_method("contiguous", (x,))
        copy_provenance(node, [x])
        set_example_values(gm, [x], fake_mode([found.source, node]))
    node.replace_all_uses_with(x)
    graph.erase_node(node)
    for piece in _tensors_of_erased(found):
        if not piece.users:
            graph.erase_node(piece)


def _tensors_of_erased(found: _WholeSplit) -> list:
    """The cat's former inputs (unsqueezes, then getitems, then the split), to erase when unread."""
    getitems = sorted(found.split.users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
    unsqueezes = [u for g in getitems for u in g.users]
    return [*unsqueezes, *getitems, found.split]


# ------------------------------------------------------------ the Mod


def flatten_cats(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> Rewrites:
    """Rewrite each cat of a whole split, then each cat of cats, of `gm` in place (module
    docstring); return what was rewritten and declined."""
    result = rewrite_matches(gm, example_inputs, "cat_flatten", _whole_split_of, _whole_split_decline, _undo_split,
                             exclude_modules, becomes="now its split's source")
    result.add(rewrite_matches(gm, example_inputs, "cat_flatten", _nested_cat_of, _nested_decline,
                               _absorb_inner_cats, exclude_modules, becomes="now one cat"))
    return result


MOD = Mod("cat_flatten", Stage.DYNAMO_GRAPH, True,
          "a cat of cats made one cat, a cat of a whole split its source or a view of it: no copies",
          counters=("cat_flatten",),
          count=count_rewritten("cat_flatten"),
          if_failed="those cats stay as written",
          run=lambda gm, example_inputs, config: flatten_cats(gm, example_inputs,
                                                              exclude_modules=config.exclude_modules))
