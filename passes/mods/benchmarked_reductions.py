"""benchmarked_reductions: Inductor's multi-kernel, which builds each reduction (a rowwise
cast fused into its producer is one) persistent and looped and runs the faster at the first
call; CUDA-graph modes only, where the pick costs no host time per call
(docs/mods/benchmarked_reductions.md has the measurements).
"""

from __future__ import annotations

from .mod import Mod, Stage

# Multi-kernel alone: also what the benchmarks' `inductor_bf16_mk` baseline compiles with.
BENCHMARKED_REDUCTIONS = {"triton.multi_kernel": 1}

# Longest row Inductor reduces in one persistent pass, and the longest a fused cast is charged
# only its byte for with multi-kernel (docs/mods/benchmarked_reductions.md: how both were set).
PERSISTENT_ROW_MAX = 1024
MULTI_KERNEL_PERSISTENT_ROW_MAX = 4096


def persistent_row_max(benchmarked_reductions: bool) -> int:
    """The longest row a fused cast reduces in one pass, with or without this Mod."""
    return MULTI_KERNEL_PERSISTENT_ROW_MAX if benchmarked_reductions else PERSISTENT_ROW_MAX


MOD = Mod("benchmarked_reductions", Stage.INDUCTOR, True,
          "Inductor's multi-kernel: each reduction persistent or looped, whichever is faster",
          # A multi-kernel call inside a CUDA-graph partition passes its sub-kernels the wrong
          # arguments (docs/mods/benchmarked_reductions.md), so graphs stay unpartitioned.
          inductor_settings={**BENCHMARKED_REDUCTIONS, "graph_partition": False}, cuda_graphs_only=True)
