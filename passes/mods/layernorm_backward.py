"""layernorm_backward: a LayerNorm over a short last dim, with an affine weight, in a training
graph on CUDA keeps ATen's forward and gets loka's Triton backward. A Mod that is off unless
named in `enabled_mods` (`LokaConfig`); it runs on the Dynamo graph (torch-level IR), after
transposed_linear.

Matches, in a Dynamo graph, `F.layer_norm` / `torch.layer_norm` / `aten.layer_norm`,
`aten.native_layer_norm` whose mean and rstd outputs nothing reads, and `nn.LayerNorm`
call_module nodes (exact type), normalizing the last dim only:

    y = layer_norm(x, (N,), w, b, eps)       # x [..., N], N <= MAX_WIDTH, rows >= MIN_ROWS
      ->
    y = loka layer_norm(x, w, b, eps)        # kernels/layer_norm_backward.py

whose forward is `aten.native_layer_norm` (AOTAutograd traces it, Inductor decomposes and
fuses it as before, with its producers: a cat and a residual add in public Wukong) and whose
backward is one `loka::layer_norm_backward` node: dx, and dw/db as per-program fp32 partials
summed by a second small kernel. Values and dtypes are the forward's (autocast's fp32
LayerNorm included); only the backward's summation order changes.

Why on the Dynamo graph: AOTAutograd derives the backward from the forward's autograd
formula and Inductor decomposes `native_layer_norm_backward` while tracing it, so by the
joint or post-grad graph there is no backward op left to replace, only its decomposed
pointwise ops and reductions.

Declines a LayerNorm (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module   its module is under `exclude_modules`
    unknown_shape     x's shape or the width is unknown or symbolic (or eps is not a constant)
    not_last_dim      it normalizes more than the last dim
    no_weight         no affine weight (its backward has no column reduction to speed up)
    wide_rows         the width is over MAX_WIDTH (not a short row)
    few_rows          fewer than MIN_ROWS rows (by the size hint where rows are symbolic)
    dtype             x, the weight or the bias is not float32, bfloat16 or float16
    not_cuda          x is not on a device in MOD_DEVICES (CPU keeps Inductor's backward)
    no_grad           nothing asks for its gradient (inference, no_grad regions)
    statistics_used   a native_layer_norm whose mean or rstd output is read
Bodies of higher-order ops are rewritten the same way, each graph all or nothing.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.nn.functional as F

from loka_compile.kernels.layer_norm_backward import layer_norm

from ..dynamo_graph import Rewrites, arg, copy_provenance, example_value, module_of, rewrite_matches, value_of
from ..shapes import size_hint
from .mod import Mod, Stage, count_rewritten

aten = torch.ops.aten

# Rows this short are where Inductor's column reduction for dw/db costs more than dx (issue 33).
MAX_WIDTH = 512
# Below this many rows the whole backward is a few microseconds either way.
MIN_ROWS = 16384
# Devices where the Triton backward runs compiled (tests add "cpu" to run the interpreter).
MOD_DEVICES = ("cuda",)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_LAYER_NORMS = {F.layer_norm, torch.layer_norm, aten.layer_norm, aten.layer_norm.default}
_NATIVE_LAYER_NORMS = {aten.native_layer_norm, aten.native_layer_norm.default}


@dataclasses.dataclass
class _Norm:
    node: torch.fx.Node          # the norm; its output (or getitem 0 of native_layer_norm) is y
    x: object
    weight: object               # fx.Node, or None (a call_module's come from its module)
    bias: object
    shape: object                # normalized_shape
    eps: float
    module: str
    call_module: str = ""
    output: object = None        # the node whose users read y
    reads_statistics: bool = False   # a native_layer_norm whose mean or rstd is read


def _norm_of(gm, node, inputs: dict) -> "_Norm | None":
    if node.op == "call_function" and node.target in _LAYER_NORMS | _NATIVE_LAYER_NORMS:
        norm = _Norm(node, arg(node, 0, "input"), arg(node, 2, "weight"), arg(node, 3, "bias"),
                     arg(node, 1, "normalized_shape"), arg(node, 4, "eps", 1e-5), module_of(node), output=node)
        if node.target in _NATIVE_LAYER_NORMS:  # (y, mean, rstd), read through getitem
            outputs = {user.args[1] if user.target is operator.getitem else None: user for user in node.users}
            if not outputs:
                return None
            norm.output, norm.reads_statistics = outputs.get(0), set(outputs) != {0}
        return norm
    if node.op == "call_module" and type(gm.get_submodule(node.target)) is torch.nn.LayerNorm:
        module = gm.get_submodule(node.target)
        return _Norm(node, arg(node, 0, "input"), None, None, module.normalized_shape, module.eps, node.target,
                     call_module=node.target, output=node)
    return None


def _parameter(gm, norm: _Norm, name: str, inputs: dict):
    """The weight's or bias's tensor (real or example), or None."""
    if norm.call_module:
        return getattr(gm.get_submodule(norm.call_module), name)
    return value_of(gm, norm.weight if name == "weight" else norm.bias, inputs)


def _decline_reason(gm, norm: _Norm, inputs: dict) -> "str | None":
    if norm.reads_statistics:
        return "statistics_used"
    x = value_of(gm, norm.x, inputs)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return "unknown_shape"
    shape = [norm.shape] if isinstance(norm.shape, int) else list(norm.shape)
    if len(shape) != 1:
        return "not_last_dim"
    width = x.shape[-1]
    if type(width) is not int or shape[0] != width or not isinstance(norm.eps, (int, float)):
        return "unknown_shape"
    weight, bias = _parameter(gm, norm, "weight", inputs), _parameter(gm, norm, "bias", inputs)
    if not isinstance(weight, torch.Tensor):
        return "no_weight"
    if width > MAX_WIDTH:
        return "wide_rows"
    rows = math.prod(size_hint(s) or 0 for s in x.shape[:-1])
    if rows < MIN_ROWS:
        return "few_rows"
    if any(t.dtype not in _DTYPES for t in (x, weight, bias) if isinstance(t, torch.Tensor)):
        return "dtype"
    if x.device.type not in MOD_DEVICES:
        return "not_cuda"
    out = example_value(norm.output)
    if isinstance(out, torch.Tensor):
        training = out.requires_grad
    else:  # a graph without example values (traced, not from Dynamo)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias)
                                                   if isinstance(t, torch.Tensor))
    if not training:
        return "no_grad"
    return None


def rewrite_layer_norm_backwards(gm: torch.fx.GraphModule, example_inputs=(), *,
                                 exclude_modules=()) -> Rewrites:
    """Rewrite each matching LayerNorm of `gm` in place (module docstring); return what was
    rewritten and declined."""
    return rewrite_matches(gm, example_inputs, "layernorm_backward", _norm_of, _decline_reason, _rewrite,
                           exclude_modules, becomes="now with loka's backward")


def _rewrite(gm, norm: _Norm) -> None:
    graph, node = gm.graph, norm.node
    with graph.inserting_before(node):
        weight, bias = norm.weight, norm.bias
        if norm.call_module:
            module = gm.get_submodule(norm.call_module)
            weight = graph.get_attr(f"{norm.call_module}.weight")
            bias = graph.get_attr(f"{norm.call_module}.bias") if module.bias is not None else None
            copy_provenance(node, filter(None, (weight, bias)))
        new = graph.call_function(layer_norm, (norm.x, weight, bias, norm.eps))
    new.meta = dict(norm.output.meta)
    norm.output.replace_all_uses_with(new)
    if norm.output is not node:
        graph.erase_node(norm.output)
    graph.erase_node(node)


MOD = Mod("layernorm_backward", Stage.DYNAMO_GRAPH, False,
          "LayerNorm over a short last dim keeps ATen's forward and gets loka's Triton backward",
          counters=("layernorm_backward",),
          count=count_rewritten("layernorm_backward"),
          if_failed="those LayerNorms keep Inductor's backward",
          run=lambda gm, example_inputs, config: rewrite_layer_norm_backwards(gm, example_inputs,
                                                                              exclude_modules=config.exclude_modules))
