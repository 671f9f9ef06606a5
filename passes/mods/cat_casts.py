"""cat_casts: an A concatenated along K from pieces whose casts fuse into their producers,
with rows longer than one persistent reduction, is cast per piece: each piece's amax in its
producer's kernel, one shared row scale, each piece cast into its slice
(docs/mods/cat_casts.md).

`find_sites.per_piece_cast` finds such an A and `lower` casts it (`scaled_gemm.cast_a_pieces`).
A graph walk, not the pattern matcher: the pieces are any number of producers of any kind,
and whether each one's cast fuses is a question about its producer.
"""

from __future__ import annotations

from typing import Optional

from .benchmarked_reductions import persistent_row_max
from .mod import Evidence, Mod, Stage

PER_PIECE = "per piece"  # how the A cast's description says it was cast piece by piece


def per_piece_row_max(benchmarked_reductions: bool, cat_casts: bool, pad_k: int) -> Optional[int]:
    """`row_max` for `find_sites.per_piece_cast`: the persistent row length when this Mod is
    on and K is not padded (a padded A keeps the whole-row cast), else None. Dispatch's
    timing and the lowering ask alike, so the report's label, the charge and the graph agree."""
    return persistent_row_max(benchmarked_reductions) if cat_casts and not pad_k else None


def _count(evidence: Evidence) -> dict:
    return {"cat_casts": sum(PER_PIECE in s.casts.get("a", "") for s in evidence.sites)}


MOD = Mod("cat_casts", Stage.POST_GRAD, True, "an A concatenated along K cast per piece, in each piece's producer",
          counters=("cat_casts",), count=_count)
