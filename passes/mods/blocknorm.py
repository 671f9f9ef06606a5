"""blocknorm (opt-in architecture Mod, `arch_mods=["blocknorm"]`): on the Dynamo graph, each
LayerNorm over the last dimension becomes a BlockNorm (RMSNorm over fixed 256-wide blocks,
`kernels/block_norm.py`), which fits a GEMM epilogue. It changes the model.

    layer_norm(x, (D,), w, b, eps)  ->  block_norm(x, eps=eps, weight=w, bias=b)
    (F.layer_norm, torch.layer_norm, aten.layer_norm, nn.LayerNorm modules)
    declines: a norm over more than the last dimension, normalized_shape (C, D)

`block_norm` is a plain function; AOTAutograd traces it into ATen ops. A walk over call nodes,
not the pattern matcher: the Dynamo graph holds torch-level calls and modules, which Inductor's
pattern matcher (ATen graphs) does not match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loka_compile.kernels.block_norm import block_norm

from ..dynamo_graph import arg, called_module, module_parameter, replace_call
from .mod import Mod, Stage, total_of_counts

_LAYER_NORMS = {F.layer_norm, torch.layer_norm, torch.ops.aten.layer_norm, torch.ops.aten.layer_norm.default}


def to_block_norm(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        module = called_module(gm, node, torch.nn.LayerNorm)
        if module is not None:
            shape, eps = module.normalized_shape, module.eps
            if len(shape) != 1:
                continue
            weight, bias = module_parameter(gm, node, "weight"), module_parameter(gm, node, "bias")
        elif node.op == "call_function" and node.target in _LAYER_NORMS:
            shape = arg(node, 1, "normalized_shape")
            if not isinstance(shape, int) and len(shape) != 1:
                continue
            weight, bias, eps = arg(node, 2, "weight"), arg(node, 3, "bias"), arg(node, 4, "eps", 1e-5)
        else:
            continue
        replace_call(gm, node, block_norm, (arg(node, 0, "input"),), {"eps": eps, "weight": weight, "bias": bias})
        count += 1
    return count


MOD = Mod("blocknorm", Stage.DYNAMO_GRAPH, False,
          "LayerNorm over the last dim -> BlockNorm (RMSNorm over 256-wide blocks)", arch=True,
          counters=("arch:blocknorm",), count=total_of_counts("arch:blocknorm", "blocknorm"), run=to_block_norm)
