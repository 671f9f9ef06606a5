"""linear_batchnorm: Linear -> BatchNorm1d in training -> ReLU (the MLP block as recsys model
libraries write it, a BatchNorm between each Linear and its activation) gets a BatchNorm backward of
two passes over [B, N] instead of four. A Mod that is off unless named in `enabled_mods`
(`LokaConfig`); it runs on the Dynamo graph (torch-level IR), after layernorm_backward.

Matches, in a Dynamo graph, `F.batch_norm` in training over a 2-D Linear output that nothing
else reads, with the ReLU after it when the norm's one reader is one (else no activation):

    h = linear(x, W, bias)                         h = linear(x, W)
    z = batch_norm(h, rm, rv, w, b, True, m, eps)   ->  y = loka linear_batch_norm(h, bias, w, b, rm, rv, m, eps, relu)
    y = relu(z)                                     # kernels/batch_norm.py

whose forward is ATen ops Inductor fuses as it fuses BatchNorm's (a column reduction for the
statistics, the running statistics' update, one pointwise pass for y) and whose backward reads
h and dy, not y: the ReLU mask is recomputed from h, and the Linear's bias gradient (the column
sum of dh) comes from the backward's column sums instead of another pass over dh. Quality-
neutral: the bias, which the normalization cancels, shifts the batch mean instead of being
added to each element (one bf16 rounding of h + bias fewer), and the sums' order changes.

Why on the Dynamo graph: AOTAutograd derives the backward from BatchNorm's autograd formula
and decomposes it while tracing, so by the joint or post-grad graph there is no backward op
left to replace, only its decomposed reductions and pointwise ops.

Declines a BatchNorm (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module     its module is under `exclude_modules`
    not_training        it uses the running statistics (eval mode: left as written)
    no_linear           its input is not a Linear's output, or something else reads that output
    other_state_region  the Linear, the norm or the ReLU runs under another grad mode or autocast state
                        than the others (`torch.autocast(...)` around the Linear alone): the linear,
                        moved to the norm's place, would compute in another dtype
    unknown_shape       its input is not 2-D [B, N] (BatchNorm1d over [B, C, L]) or has no example value,
                        or momentum or eps is not a number
    no_affine           no weight or no bias (affine=False)
    dtype               its input, weight or bias is not float32, bfloat16 or float16
    no_grad             nothing asks for its gradient (the forward is Inductor's either way)
Bodies of higher-order ops are rewritten the same way, each graph all or nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from loka_compile.kernels.batch_norm import DTYPES, linear_batch_norm

from ..dynamo_graph import (LINEARS, Rewrites, arg, copy_provenance, example_value, module_of, rewrite_matches,
                            state_regions, value_of)
from .mod import Mod, Stage, count_rewritten

aten = torch.ops.aten

_BATCH_NORMS = {F.batch_norm, torch.batch_norm, aten.batch_norm, aten.batch_norm.default}
_RELUS = {F.relu, torch.relu, torch.relu_, aten.relu, aten.relu.default, aten.relu_, aten.relu_.default}


@dataclasses.dataclass
class _Block:
    node: torch.fx.Node          # the batch_norm
    linear: torch.fx.Node        # its input, if a Linear
    running_mean: object
    running_var: object
    weight: object
    beta: object
    training: object
    momentum: object
    eps: object
    module: str
    relu: "torch.fx.Node | None" = None


def _block_of(gm, node, inputs: dict) -> "_Block | None":
    if node.op != "call_function" or node.target not in _BATCH_NORMS:
        return None
    if node.target in (torch.batch_norm, aten.batch_norm, aten.batch_norm.default):
        # (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
        weight, beta, rm, rv = arg(node, 1, "weight"), arg(node, 2, "bias"), arg(node, 3, "running_mean"), \
            arg(node, 4, "running_var")
    else:
        rm, rv, weight, beta = arg(node, 1, "running_mean"), arg(node, 2, "running_var"), arg(node, 3, "weight"), \
            arg(node, 4, "bias")
    block = _Block(node, arg(node, 0, "input"), rm, rv, weight, beta, arg(node, 5, "training", False),
                   arg(node, 6, "momentum", 0.1), arg(node, 7, "eps", 1e-5), module_of(node))
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _RELUS:
        block.relu = users[0]
    return block


def _is_linear(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in LINEARS


def _decline_reason(gm, block: _Block, inputs: dict) -> "str | None":
    if block.training is not True:
        return "not_training"
    if not _is_linear(block.linear) or len(block.linear.users) != 1:
        return "no_linear"
    regions = state_regions(gm.graph)
    if len({regions[n] for n in (block.linear, block.node, block.relu) if n is not None}) > 1:
        return "other_state_region"
    h = value_of(gm, block.linear, inputs)
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        return "unknown_shape"
    if not isinstance(block.weight, torch.fx.Node) or not isinstance(block.beta, torch.fx.Node):
        return "no_affine"
    if not isinstance(block.momentum, (int, float)) or not isinstance(block.eps, (int, float)):
        return "unknown_shape"
    weight, beta = value_of(gm, block.weight, inputs), value_of(gm, block.beta, inputs)
    if any(not isinstance(t, torch.Tensor) or t.dtype not in DTYPES for t in (h, weight, beta)):
        return "dtype"
    out = example_value(block.relu or block.node)
    if isinstance(out, torch.Tensor):
        training = out.requires_grad
    else:  # a graph without example values (traced, not from Dynamo)
        training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                   for t in (h, weight, beta))
    if not training:
        return "no_grad"
    return None


def rewrite_linear_batch_norms(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> Rewrites:
    """Rewrite each matching Linear -> BatchNorm (-> ReLU) of `gm` in place (module docstring);
    return what was rewritten and declined."""
    return rewrite_matches(gm, example_inputs, "linear_batchnorm", _block_of, _decline_reason, _rewrite,
                           exclude_modules, becomes="now with loka's two-pass BatchNorm backward")


def _rewrite(gm, block: _Block) -> None:
    graph, linear = gm.graph, block.linear
    x, w, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
    with graph.inserting_before(block.node):
        h = graph.call_function(F.linear, (x, w))
        new = graph.call_function(linear_batch_norm, (h, bias, block.weight, block.beta, block.running_mean,
                                                      block.running_var, float(block.momentum), float(block.eps),
                                                      block.relu is not None))
    h.meta = dict(linear.meta)
    output = block.relu or block.node
    new.meta = dict(output.meta)
    copy_provenance(block.node, [new])
    output.replace_all_uses_with(new)
    if block.relu is not None:
        graph.erase_node(block.relu)
    graph.erase_node(block.node)
    graph.erase_node(linear)


MOD = Mod("linear_batchnorm", Stage.DYNAMO_GRAPH, False,
          "Linear -> BatchNorm1d (training) -> ReLU gets a two-pass BatchNorm backward (mask from h, bias gradient "
          "from the column sums)",
          counters=("linear_batchnorm",),
          count=count_rewritten("linear_batchnorm"),
          if_failed="those BatchNorms keep Inductor's backward",
          run=lambda gm, example_inputs, config: rewrite_linear_batch_norms(gm, example_inputs,
                                                                            exclude_modules=config.exclude_modules))
