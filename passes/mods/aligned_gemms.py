"""aligned_gemms: Inductor pads every GEMM whose M, K or N is off the 16-byte alignment (its
pad_mm pass, forced; CUDA only), high-precision GEMMs included: left to its own benchmark it
pads only compute-bound ones, and an unaligned cuBLAS kernel is several times slower
(docs/mods/aligned_gemms.md has the measurements).
"""

from __future__ import annotations

from .mod import Mod, Stage

MOD = Mod("aligned_gemms", Stage.INDUCTOR, True, "Inductor pads every unaligned GEMM, high-precision ones included",
          inductor_settings={"force_shape_pad": True})
