"""pad: a 2-D FP8 site whose K or N is off the 16-element alignment runs at the next multiple
of 16, its operands zero-padded inside their casts and C sliced back (docs/mods/pad.md).

Dispatch decides the padding (`Decision.pad_k`, `pad_n`); `lower` writes it into the casts.
No subgraph to match: the site's shape decides.
"""

from __future__ import annotations

from .mod import Mod, Stage

MOD = Mod("pad", Stage.POST_GRAD, True, "K or N padded to a multiple of 16 so a misaligned site can still run FP8",
          counters=("pad",), count=lambda evidence: {"pad": sum(any(s.padding) for s in evidence.sites)})

