"""fused_casts: each FP8 operand cast is written as ATen ops in the graph, so that Inductor
computes it in the kernel that produced the operand (docs/mods/fused_casts.md).

Driven by `lower` (`GemmSpec.fused_casts`, `kernels/scaled_gemm.py`) and by the saved_fp8
Mod's forward casts; off, each cast is one opaque `loka.quantize_operand` op. No subgraph to
match: every cast of an FP8 site is written this way.
"""

from __future__ import annotations

from ..find_sites import SAVED_IN_FP8
from .mod import Evidence, Mod, Stage


def _count(evidence: Evidence) -> dict:
    casts = evidence.fp8_casts
    fused = sum(c.startswith("fused") for c in casts)
    precast = sum(c.startswith("cached") or c == SAVED_IN_FP8 for c in casts)  # cast before the graph reads them
    return {"fused_casts": fused, "standalone_casts": len(casts) - fused - precast}


MOD = Mod("fused_casts", Stage.POST_GRAD, True,
          "FP8 casts as ATen ops that Inductor fuses into the kernel producing the operand",
          counters=("fused_casts", "standalone_casts"), count=_count)
