"""hardswish (opt-in architecture Mod, `arch_mods=["hardswish"]`): on the Dynamo graph, each
SiLU becomes a hard-swish, which a GEMM epilogue computes without an exponential. It changes
the model.

    silu(x, inplace)  ->  hardswish(x, inplace)      (F.silu, aten.silu, nn.SiLU modules)

A walk over call nodes, not the pattern matcher: the Dynamo graph holds torch-level calls and
modules, which Inductor's pattern matcher (ATen graphs) does not match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dynamo_graph import arg, called_module, replace_call
from .mod import Mod, Stage, total_of_counts

_SILU_TO_HARDSWISH = {
    F.silu: F.hardswish,
    torch.ops.aten.silu: torch.ops.aten.hardswish,
    torch.ops.aten.silu.default: torch.ops.aten.hardswish.default,
}


def to_hardswish(gm: torch.fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        module = called_module(gm, node, torch.nn.SiLU)
        if module is not None:
            replace_call(gm, node, F.hardswish, (arg(node, 0, "input"),), {"inplace": module.inplace})
        elif node.op == "call_function" and node.target in _SILU_TO_HARDSWISH:
            node.target = _SILU_TO_HARDSWISH[node.target]
        else:
            continue
        count += 1
    return count


MOD = Mod("hardswish", Stage.DYNAMO_GRAPH, False, "SiLU -> hard-swish", arch=True,
          counters=("arch:hardswish",), count=total_of_counts("arch:hardswish", "hardswish"), run=to_hardswish)
