"""conv1x1: a 1x1 convolution that is a linear over the channel axis becomes that linear,
written as a linear of the transposed input. A Mod that is on by default
(`disabled_mods=["conv1x1"]` switches it off); it runs on the Dynamo graph (torch-level
IR) after the horizontal Mod and before transposed_linear, so the backward follows from the
forward.

Matches, in a Dynamo graph, a convolution (`torch.conv1d` / `F.conv1d`, `torch.conv2d` /
`F.conv2d`, `aten.conv1d` / `aten.conv2d`, an `nn.Conv1d` / `nn.Conv2d` call_module node)
with kernel size 1, stride 1, zero padding and one group, of a batched input. (Dynamo in
torch 2.13 inlines an nn.Conv1d into `torch.conv1d(x, weight, bias, stride, padding,
dilation, groups)` with its parameters as graph inputs; call_module nodes come from graphs
traced without inlining.)

    y = conv1d(x, W, b)           # x [B, C_in, L], W [C_out, C_in, 1]
      ->
    xt = x.transpose(1, 2)                            # [B, L, C_in]
    y  = linear(xt, W.flatten(1), b).transpose(1, 2)  # [B, C_out, L]

    y = conv2d(x, W, b)           # x [B, C_in, H, W'], W [C_out, C_in, 1, 1]
      ->
    xt = x.flatten(2).transpose(1, 2)                 # [B, H*W', C_in]
    y  = linear(xt, W.flatten(1), b).transpose(1, 2).unflatten(2, (H, W'))

Public recsys code computes its largest GEMMs this way: xDeepFM's compressed interaction
network (DeepCTR, FuxiCTR) compresses each outer product [B, F * H_k, d] with
`nn.Conv1d(F * H_k, H_k+1, kernel_size=1)`. As a convolution, AOTAutograd hands loka
`aten.convolution` and `aten.convolution_backward`, which find_sites does not see (it finds
mm/addmm/bmm), so those FLOPs never run in FP8. As a linear they are GEMM sites with fwd,
dgrad and wgrad roles, which Dispatch may put in FP8. The output is the convolution's,
shape and values (each element the same dot product over C_in; only the summation order
may change), a view in the convolution's [B, C_out, L] layout.

The linear of a transposed 3-D input is the form transposed_linear matches next: where it
pays it becomes W @ x, a batched GEMM that reads x as it is and writes y in x's layout (the
layout the convolution read and wrote); where it declines, the linear stays a 2-D GEMM over
[B * L, C_in] rows. docs/mods/conv1x1.md has the measured effect.

Declines a convolution (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module      its module is under `exclude_modules` (the exclusion stays exact)
    unknown_shape        the weight is not a tensor of known shape and rank 3 (conv1d) or
                         4 (conv2d), or x's shape is unknown
    unbatched            x has no batch dim (conv1d of a [C_in, L] x, conv2d of [C_in, H, W])
    not_1x1              a kernel size other than 1
    strided              a stride other than 1 (or not a constant)
    padded               a padding other than 0 ("valid", or "same", which is 0 for kernel
                         size 1), or not a constant; a module's padding_mode matters only
                         where its padding is not 0
    grouped              groups other than 1 (or not a constant)
    cpu_training         x on CPU, its weight trains, and Inductor's C++ code is vectorized
                         (`cpp.simdlen` not 1): that code computes an embedding gradient of
                         the linear form wrong (docs/mods/conv1x1.md; tests/unit/mods/test_conv1x1.py
                         keeps a strict xfail); CPU FP8 is emulated, so the Mod buys nothing
                         there but the test of its own path

Dilation changes nothing at kernel size 1 (the kernel has no gaps to spread), so any is
taken. Convolutions of other kinds (transposed, 3-D, call_module nodes of subclasses of
nn.Conv1d / nn.Conv2d, whose forward may differ) are not counted. The bodies of
higher-order ops in the graph (an activation-checkpointed region is one) are rewritten the
same way, each graph all or nothing.

Inductor's pattern matcher (DESIGN convention 5) rewrites ATen graphs after AOTAutograd,
where the convolution's backward is already `convolution_backward`; this rewrite must
change the backward too, so it walks the Dynamo graph, as transposed_linear does.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._inductor import config as inductor_config

from ..dynamo_graph import (Rewrites, arg, copy_provenance, fake_mode, module_of, rewrite_matches, set_example_values,
                            value_of)
from .mod import Mod, Stage, count_rewritten

aten = torch.ops.aten

# convolution target -> spatial dims
_CONVS = {torch.conv1d: 1, aten.conv1d.default: 1, aten.conv1d.padding: 1,
          torch.conv2d: 2, aten.conv2d.default: 2, aten.conv2d.padding: 2}
_CONV_MODULES = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2}  # exact types: a subclass may have its own forward


@dataclasses.dataclass
class _Conv:
    node: torch.fx.Node
    x: torch.fx.Node
    weight: object         # fx.Node (None for a call_module node)
    bias: object           # fx.Node or None
    spatial: int           # 1 (conv1d) or 2 (conv2d)
    module: str
    call_module: str = ""  # target of an nn.Conv1d / nn.Conv2d call_module node


def _all_equal(value, expected: int, spatial: int) -> bool:
    """Whether a conv argument (an int or a sequence of one per spatial dim) is `expected`
    in every dim: plain ints only, a symbolic value declines."""
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    if len(values) not in (1, spatial):
        return False
    return all(type(v) is int and v == expected for v in values)


def _conv_of(gm, node, inputs: dict) -> "_Conv | None":
    if node.op == "call_function" and node.target in _CONVS:
        x, w, b = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
        if not isinstance(x, torch.fx.Node):
            return None
        return _Conv(node, x, w, b, _CONVS[node.target], module_of(node))
    if node.op == "call_module" and type(gm.get_submodule(node.target)) in _CONV_MODULES:
        x = arg(node, 0, "input")
        if not isinstance(x, torch.fx.Node):
            return None
        return _Conv(node, x, None, None, _CONV_MODULES[type(gm.get_submodule(node.target))], node.target,
                     call_module=node.target)
    return None


def _hyperparameters(gm, conv: _Conv) -> tuple:
    """(stride, padding, dilation, groups, padding_mode) of a convolution."""
    if conv.call_module:
        m = gm.get_submodule(conv.call_module)
        return m.stride, m.padding, m.dilation, m.groups, m.padding_mode
    node = conv.node
    return (arg(node, 3, "stride", 1), arg(node, 4, "padding", 0), arg(node, 5, "dilation", 1),
            arg(node, 6, "groups", 1), "zeros")


def _weight(gm, conv: _Conv, inputs: dict):
    """The real or example weight tensor of a convolution, or None."""
    if conv.call_module:
        return gm.get_submodule(conv.call_module).weight
    return value_of(gm, conv.weight, inputs)


def _decline_reason(gm, conv: _Conv, inputs: dict) -> "str | None":
    weight = _weight(gm, conv, inputs)
    x = value_of(gm, conv.x, inputs)
    if not isinstance(weight, torch.Tensor) or weight.dim() != conv.spatial + 2 or not isinstance(x, torch.Tensor):
        return "unknown_shape"
    if x.dim() == conv.spatial + 1:
        return "unbatched"
    if x.dim() != conv.spatial + 2:
        return "unknown_shape"
    if not all(type(k) is int for k in weight.shape[2:]):
        return "unknown_shape"
    if any(k != 1 for k in weight.shape[2:]):
        return "not_1x1"
    stride, padding, _dilation, groups, _padding_mode = _hyperparameters(gm, conv)
    if not _all_equal(stride, 1, conv.spatial):
        return "strided"
    # "same" at kernel size 1 pads by dilation * (1 - 1) = 0; padding_mode pads only a padding
    if not (padding in ("valid", "same") or _all_equal(padding, 0, conv.spatial)):
        return "padded"
    if not (type(groups) is int and groups == 1):
        return "grouped"
    if x.device.type == "cpu" and weight.requires_grad and torch.is_grad_enabled() \
            and inductor_config.cpp.simdlen != 1:
        return "cpu_training"
    return None


def rewrite_conv1x1(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> Rewrites:
    """Rewrite each 1x1 convolution of `gm` that is a linear over channels in place (module
    docstring); return what was rewritten and declined."""
    return rewrite_matches(gm, example_inputs, "conv1x1", _conv_of, _decline_reason, _rewrite,
                           exclude_modules, becomes="now a linear")


def _rewrite(gm, conv: _Conv) -> None:
    graph, node, x = gm.graph, conv.node, conv.x
    w_node, b_node = conv.weight, conv.bias
    with graph.inserting_before(node):
        new = []
        if conv.call_module:
            w_node = graph.get_attr(f"{conv.call_module}.weight")
            has_bias = gm.get_submodule(conv.call_module).bias is not None
            b_node = graph.get_attr(f"{conv.call_module}.bias") if has_bias else None
            new += [n for n in (w_node, b_node) if n is not None]
        rows = x
        if conv.spatial > 1:
            sizes = [graph.call_method("size", (x, 2 + i)) for i in range(conv.spatial)]
            rows = graph.call_method("flatten", (x, 2))                      # [B, C_in, H*W]
            new += [*sizes, rows]
        x_t = graph.call_method("transpose", (rows, 1, 2))                  # [B, L, C_in]
        weight = graph.call_method("flatten", (w_node, 1))                   # [C_out, C_in]
        linear = graph.call_function(torch._C._nn.linear, (x_t, weight, b_node))
        out = graph.call_method("transpose", (linear, 1, 2))                # [B, C_out, L]
        new += [x_t, weight, linear, out]
        if conv.spatial > 1:
            out = graph.call_method("unflatten", (out, 2, tuple(sizes)))    # [B, C_out, H, W]
            new.append(out)
    copy_provenance(node, new)
    set_example_values(gm, new, fake_mode([x, node]))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


MOD = Mod("conv1x1", Stage.DYNAMO_GRAPH, True, "1x1 convolutions written as linears, so their GEMMs can go FP8",
          counters=("conv1x1",), count=count_rewritten("conv1x1"),
          if_failed="those convolutions stay as written",
          run=lambda gm, example_inputs, config: rewrite_conv1x1(gm, example_inputs,
                                                                 exclude_modules=config.exclude_modules))
