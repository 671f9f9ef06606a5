"""transposed_linear: a linear over the middle axis of a 3-D input, written as a linear of
its transpose, becomes a batched GEMM that reads the input as it is and writes its output
in the input's layout. A Mod that is on by default (`disabled_mods=["transposed_linear"]`
switches it off); it runs on the Dynamo graph (torch-level IR) after the horizontal Mod, so
the backward follows from the forward.

Matches, in a Dynamo graph, a linear (`torch._C._nn.linear`, `F.linear`, `aten.linear`,
an `nn.Linear` call_module node) whose input is x.transpose(1, 2) of a 3-D x (also written
transpose(-1, -2), transpose(2, 1), permute(0, 2, 1), torch.transpose/torch.permute, with
an optional .contiguous()), and the same product written `x.permute(0, 2, 1) @ W` or
`torch.matmul(x.transpose(1, 2), W)` with W a 2-D weight (a bare nn.Parameter, [n, N]:
the linear of weight W^T), as public Wukong code writes its projections:

    xt = x.transpose(1, 2)        # [B, d, n]          y_t = bmm(W.unsqueeze(0).expand(B, N, n), x)   # [B, N, d]
    y  = linear(xt, W, b)         # [B, d, N]    ->    y_t = y_t + b.unsqueeze(-1)                     # with a bias
                                                       y   = y_t.transpose(1, 2)                       # [B, d, N], a view

Feature-interaction layers are written this way: Wukong's linear compression (W_L X) and
FM projection, token- and feature-mixing MLPs. What it buys: as written, the GEMM reads xt
as a [B*d, n] matrix, so x is copied transposed, and its [B*d, N] output is read
transposed by every consumer that works in x's layout (Wukong: the LayerNorm over d of
cat(FMB, LCB) + residual), in the forward and again in the backward. W @ x needs neither.
Each output element is the same dot product over n; only the GEMM's summation order
changes, and the weight gradient is summed over the batch from per-sample bmm products.
docs/mods/transposed_linear.md has the measured effect.

Declines a linear (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module      its module is under `exclude_modules` (the exclusion stays exact)
    not_3d               x is not 3-D, or its shape is unknown
    transposed_input     x is itself a transposed view with a contiguous transpose: the
                         linear as written reads xt without a copy, and W @ x would move
                         the copy to its output
    narrow_output        d < 16: each sample's GEMM would be too narrow for tensor cores
    wide_weight_gradient the weight trains (it requires grad, under grad mode) and its
                         gradient, as a batched GEMM, would write B * N * n per-sample
                         products before summing them over the batch, more than the
                         transposed copies and reads W @ x saves, B * d * (n + N) (x's and its
                         gradient's copies, the output's and its gradient's reads):
                         N * n > d * (n + N). xDeepFM's compressed interaction network, as
                         conv1x1 writes it (N = 200, n = 39 * 200, d = 16), would write 25 GB
                         per layer at batch 8192 in bf16; Wukong (N = 56, n = 64, d = 160) is
                         far below. Byte accounting, not yet timed on a GPU
    weight_not_2d        the weight is not a 2-D tensor of known shape, or the bias not 1-D

Linears that read no transposed input are not counted. The bodies of higher-order ops in the
graph (an activation-checkpointed region is one) are rewritten the same way, each graph all
or nothing.

FP8: the batched sites this makes (fwd, and their dgrad and wgrad) go through Dispatch as any
bmm does. Their A, the broadcast weight, is cast once (`scaled_gemm.cast_operand`), but the
speed check still times a batched site on a full [B*M, K] A, so it overcharges these sites.
On Wukong they stay bf16 (their B, x with K = n, is cast across its rows: standalone).

Where a consumer needs the output contiguous in [B, d, N] layout (another linear), the
transposed copy moves there instead of disappearing.

Inductor's pattern matcher (DESIGN convention 5) rewrites ATen graphs after AOTAutograd,
where a forward rewrite no longer changes the backward; this rewrite must reach the
backward's transposes too, so it walks the Dynamo graph, as the horizontal Mod does.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..dynamo_graph import (LINEARS, Rewrites, arg, copy_provenance, example_value, fake_mode, module_of,
                            rewrite_matches, set_example_values, tensor_of, value_of)
from .mod import Mod, Stage, count_rewritten

# Timed only at d = 160 (Wukong, where it pays); below 16, one bf16 MMA tile's N, each
# sample's GEMM would leave most of its tile idle.
MIN_OUTPUT_WIDTH = 16

_TRANSPOSES = {torch.transpose, torch.swapaxes, torch.swapdims}
_MATMULS = {operator.matmul, torch.matmul}
_PASS_THROUGH_METHODS = {"contiguous"}


def _transposed_source(node) -> "torch.fx.Node | None":
    """x when `node` is a transpose of x's last two dims (through .contiguous()), else None."""
    while isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target in _PASS_THROUGH_METHODS:
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    x = node.args[0]
    value = example_value(x)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    rank = value.dim()
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return x
    if (node.op == "call_method" and node.target in ("transpose", "swapaxes", "swapdims")) \
            or (node.op == "call_function" and node.target in _TRANSPOSES):
        dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")]
        swapped = sorted(d % rank for d in dims) if all(isinstance(d, int) for d in dims) else None
        return x if swapped == [rank - 2, rank - 1] else None
    if (node.op == "call_method" and node.target == "permute") \
            or (node.op == "call_function" and node.target is torch.permute):
        dims = list(node.args[1:]) if node.op == "call_method" else list(node.args[1:2] or [node.kwargs.get("dims")])
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = list(dims[0])
        if not all(isinstance(d, int) for d in dims) or len(dims) != rank:
            return None
        return x if [d % rank for d in dims] == [*range(rank - 2), rank - 1, rank - 2] else None
    return None


def _hint(size):
    return size.node.hint if isinstance(size, torch.SymInt) else size


@dataclasses.dataclass
class _TransposedLinear:
    node: torch.fx.Node
    x: torch.fx.Node             # the 3-D input whose transpose the linear reads
    weight: object               # fx.Node (None for a call_module node)
    bias: object                 # fx.Node or None
    module: str
    call_module: str = ""        # target of an nn.Linear call_module node
    weight_in_out: bool = False  # `x^T @ W`: W is [in, out], the linear's weight is W^T


def _transposed_linear_of(gm, node, inputs: dict) -> "_TransposedLinear | None":
    """The linear `node` computes when it reads a transposed 3-D input, else None."""
    if node.op == "call_function" and node.target in LINEARS:
        x_t, weight, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        found = dict(weight=weight, bias=bias, module=module_of(node))
    elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.Linear):
        x_t = arg(node, 0, "input")
        found = dict(weight=None, bias=None, module=node.target, call_module=node.target)
    elif _weight_matmul(gm, node, inputs):
        x_t, weight = node.args
        found = dict(weight=weight, bias=None, module=module_of(node), weight_in_out=True)
    else:
        return None
    x = _transposed_source(x_t)
    return None if x is None else _TransposedLinear(node, x, **found)


def _decline_reason(gm, found: _TransposedLinear, inputs: dict) -> "str | None":
    """Why the linear of x^T is not rewritten (module docstring), else None."""
    if found.call_module:
        linear = gm.get_submodule(found.call_module)
        weight, bias = linear.weight, linear.bias
    elif found.weight_in_out:
        weight, bias = tensor_of(gm, found.weight, inputs)[0], None
    else:
        weight, bias = value_of(gm, found.weight, inputs), value_of(gm, found.bias, inputs)
    value = example_value(found.x)
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        return "not_3d"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "weight_not_2d"
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1):
        return "weight_not_2d"
    d = _hint(value.shape[2])
    if d is None or int(d) < MIN_OUTPUT_WIDTH:
        return "narrow_output"
    if value.stride(1) == 1 and value.shape[1] > 1:
        return "transposed_input"  # xt is contiguous already
    out_features, in_features = (_hint(s) for s in (reversed(weight.shape) if found.weight_in_out else weight.shape))
    if weight.requires_grad and torch.is_grad_enabled() and None not in (out_features, in_features) \
            and out_features * in_features > int(d) * (in_features + out_features):
        return "wide_weight_gradient"
    return None


def rewrite_transposed_linears(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> Rewrites:
    """Rewrite each linear of a transposed 3-D input of `gm` in place (module docstring);
    return what was rewritten and declined."""
    return rewrite_matches(gm, example_inputs, "transposed_linear", _transposed_linear_of, _decline_reason, _rewrite,
                           exclude_modules, becomes="now W @ x")


def _weight_matmul(gm, node, inputs: dict) -> bool:
    """Whether `node` is `a @ W` (operator.matmul, torch.matmul) of a 2-D weight W: an
    nn.Parameter input of the graph or a get_attr."""
    if node.op != "call_function" or node.target not in _MATMULS or len(node.args) != 2 or node.kwargs \
            or not isinstance(node.args[1], torch.fx.Node):
        return False
    weight, is_weight = tensor_of(gm, node.args[1], inputs)
    return is_weight and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _rewrite(gm, found: _TransposedLinear) -> None:
    graph, node, x, w_node, b_node = gm.graph, found.node, found.x, found.weight, found.bias
    call_module, weight_in_out = found.call_module, found.weight_in_out
    with graph.inserting_before(node):
        if call_module:
            w_node = graph.get_attr(f"{call_module}.weight")
            has_bias = gm.get_submodule(call_module).bias is not None
            b_node = graph.get_attr(f"{call_module}.bias") if has_bias else None
        attrs = [n for n in (w_node, b_node) if call_module and n is not None]
        if weight_in_out:  # x^T @ W is the linear of x^T by W^T
            w_node = graph.call_method("t", (w_node,))
            attrs.append(w_node)
        # Under autocast the linear cast W to x's dtype itself; the bmm's example value needs it written
        w_node = graph.call_method("type_as", (w_node, x))
        attrs.append(w_node)
        batch = graph.call_method("size", (x, 0))
        expanded = graph.call_method("expand", (graph.call_method("unsqueeze", (w_node, 0)), batch, -1, -1))
        out = graph.call_function(torch.bmm, (expanded, x))
        new = [*attrs, batch, expanded.args[0], expanded, out]
        if b_node is not None:
            column = graph.call_method("unsqueeze", (b_node, -1))
            out = graph.call_function(torch.add, (out, graph.call_method("type_as", (column, out))))
            new += [column, out.args[1], out]
        result = graph.call_method("transpose", (out, 1, 2))
        new.append(result)
    copy_provenance(node, new)
    set_example_values(gm, new, fake_mode([x, node]))
    x_t = node.args[0] if node.args else node.kwargs.get("input")
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    while isinstance(x_t, torch.fx.Node) and x_t is not x and not x_t.users:  # the transpose copy, now unread
        source = x_t.args[0]
        graph.erase_node(x_t)
        x_t = source


MOD = Mod("transposed_linear", Stage.DYNAMO_GRAPH, True,
          "`linear(x.transpose(1, 2), W)` computed as W @ x, with no transposed copies",
          counters=("transposed_linear",),
          count=count_rewritten("transposed_linear"),
          if_failed="those linears stay as written",
          run=lambda gm, example_inputs, config: rewrite_transposed_linears(gm, example_inputs,
                                                                            exclude_modules=config.exclude_modules))
