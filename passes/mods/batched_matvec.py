"""batched_matvec: a 2-D matrix times a batch of column vectors, `W @ x` with x [..., K, 1],
becomes one GEMM over the batch, `linear(x.squeeze(-1), W).unsqueeze(-1)`, in every grad
mode. A Mod that is on by default (`disabled_mods=["batched_matvec"]` switches it off); it
runs on the Dynamo graph (torch-level IR), so a training graph's backward follows from the
forward.

Matches, in a Dynamo graph, `torch.matmul(W, x)`, `W @ x` or `W.matmul(x)` with W 2-D [M, K]
(a weight, a slice or transpose of one, or any 2-D tensor) and x of rank 3 or more whose
last dim is 1, as public DCN code writes its cross layers (deepctr-torch's CrossNetMix and
CrossNet with parameterization="matrix": `torch.matmul(self.V_list[i][e].t(), x_l)` with
x_l [B, in_features, 1]):

    y = torch.matmul(W, x)        # W [M, K], x [B, K, 1]
      ->
    y = linear(x.squeeze(-1), W).unsqueeze(-1)      # [B, K] @ W^T: one [B, K] x [K, M] GEMM

Why: ATen's matmul folds a 2-D @ 3-D product into one GEMM only when the 2-D operand
requires grad. Where it does not (autocast's bf16 copy of W under no_grad, a frozen or
inference-mode weight, a W computed without grad), the product becomes a bmm of W expanded
over the batch ([B, M, K], batch stride 0) by x: B matrix-vector products, each reading all
of W, in eager and under Inductor alike. At DCN-Mix's production shapes (B 8192, K 3341,
M 256) each such bmm reads B * M * K * 2 = 14 GB of bf16 where the GEMM reads W once
(docs/mods/batched_matvec.md). With grad, the rewrite is what matmul does itself. Each
output element is the same dot product over K; only the summation order may change.

Declines a match (the reason counted in `declined`, logged at DEBUG) when:
    excluded_module      its module is under `exclude_modules` (the exclusion stays exact)
    unknown_shape        W or x has no example value of known shape, or K differs
    not_floating         W or x is not a floating-point tensor (linear takes floats only)

Products of other ranks (1-D W, 2-D x, a W with a batch) are not counted. The bodies of
higher-order ops in the graph (an activation-checkpointed region is one) are rewritten the
same way, each graph all or nothing.

FP8: the GEMM it makes is a 2-D site (fwd; dgrad and wgrad in training) that Dispatch
treats as any linear.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ..dynamo_graph import (Rewrites, copy_provenance, example_value, fake_mode, module_of, rewrite_matches,
                            set_example_values)
from .mod import Mod, Stage, count_rewritten

_MATMULS = {operator.matmul, torch.matmul}
_MATMUL_METHODS = {"matmul", "__matmul__"}


@dataclasses.dataclass
class _Matvec:
    node: torch.fx.Node
    matrix: torch.fx.Node
    columns: torch.fx.Node
    module: str


def _matvec_of(gm, node, inputs: dict) -> "_Matvec | None":
    """The product `node` computes when it is a 2-D matrix times a batch of columns
    ([..., K, 1], rank 3 or more), else None."""
    is_matmul = (node.op == "call_function" and node.target in _MATMULS) \
        or (node.op == "call_method" and node.target in _MATMUL_METHODS)
    if not is_matmul or len(node.args) != 2 or node.kwargs:
        return None
    matrix, columns = node.args
    if not isinstance(matrix, torch.fx.Node) or not isinstance(columns, torch.fx.Node):
        return None
    w, x = example_value(matrix), example_value(columns)
    if not isinstance(w, torch.Tensor) or not isinstance(x, torch.Tensor) or w.dim() != 2 or x.dim() < 3:
        return None
    if not (type(x.shape[-1]) is int and x.shape[-1] == 1):  # Dynamo specializes a size of 1
        return None
    return _Matvec(node, matrix, columns, module_of(node))


def _decline_reason(gm, found: _Matvec, inputs: dict) -> "str | None":
    w, x = example_value(found.matrix), example_value(found.columns)
    k_w, k_x = w.shape[-1], x.shape[-2]
    if type(k_w) is not int or type(k_x) is not int or k_w != k_x:
        return "unknown_shape"
    if not (w.is_floating_point() and x.is_floating_point()):
        return "not_floating"
    return None


def rewrite_batched_matvecs(gm: torch.fx.GraphModule, example_inputs=(), *, exclude_modules=()) -> Rewrites:
    """Rewrite each 2-D matrix times a batch of columns of `gm` in place (module docstring);
    return what was rewritten and declined."""
    return rewrite_matches(gm, example_inputs, "batched_matvec", _matvec_of, _decline_reason, _rewrite,
                           exclude_modules, becomes="now one GEMM")


def _rewrite(gm, found: _Matvec) -> None:
    graph, node = gm.graph, found.node
    with graph.inserting_before(node):
        rows = graph.call_method("squeeze", (found.columns, -1))                      # [..., K]
        linear = graph.call_function(torch._C._nn.linear, (rows, found.matrix))        # [..., M]
        out = graph.call_method("unsqueeze", (linear, -1))                            # [..., M, 1]
    new = [rows, linear, out]
    copy_provenance(node, new)
    set_example_values(gm, new, fake_mode([found.columns, node]))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


MOD = Mod("batched_matvec", Stage.DYNAMO_GRAPH, True,
          "`W @ x` of a 2-D W and columns x [B, K, 1] computed as one GEMM, not B matrix-vector products",
          counters=("batched_matvec",),
          count=count_rewritten("batched_matvec"),
          if_failed="those products stay as written",
          run=lambda gm, example_inputs, config: rewrite_batched_matvecs(gm, example_inputs,
                                                                         exclude_modules=config.exclude_modules))
