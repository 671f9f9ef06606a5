"""The per-graph context a pass reads and writes (the types it holds, Site and Decision among
them, are `loka_compile.types`'s). Passes never import the backend; the backend
fills `PassContext.decide` with Dispatch."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Optional

from loka_compile.types import Amendment, Candidate, Decision, Dim, GraphKind, Phase, Reason, Role, Site

# The shared types, where the passes have always found them.
__all__ = ["Amendment", "Candidate", "Decision", "Dim", "GraphKind", "PassContext", "Phase", "Reason", "Role", "Site"]


def _plain(value):
    """A decision field as the report shows it (enums by value)."""
    return value.value if isinstance(value, enum.Enum) else value


@dataclasses.dataclass
class PassContext:
    """Per ATen graph: inputs the passes read, and what they record."""

    graph: str
    kind: GraphKind
    phase: Phase
    param_input_indices: frozenset               # forward inputs that are parameters
    decide: Callable[..., Decision]              # (site, a_static=bool) -> Decision
    inactive_mods: frozenset = frozenset()      # names of Mods that do not run (LokaConfig.inactive_mods)
    sites: list = dataclasses.field(default_factory=list)
    decisions: dict = dataclasses.field(default_factory=dict)   # site id -> Decision
    amendments: list = dataclasses.field(default_factory=list)  # Amendment, in order (`amend`)
    changes: dict = dataclasses.field(default_factory=dict)     # pass name -> count
    casts: dict = dataclasses.field(default_factory=dict)       # site id -> {operand: how `lower` casts it}
    cached_weights: list = dataclasses.field(default_factory=list)  # weight_cache.CachedWeight, inference
    # Inference graphs with a calibrated plan: site id -> {"scale", "policy", ...} (Plan.a_scales)
    static_a_scales: dict = dataclasses.field(default_factory=dict)
    # Probe graphs under an output budget (`LokaConfig.max_output_error`): the probe pass puts
    # a `loka.perturb` after each forward-role GEMM, for the budget's sensitivity runs.
    perturb_outputs: bool = False
    # A joint forward+backward graph (the saved_fp8 Mod's), seen as a backward one: its
    # outputs are the forward's followed by the gradients.
    joint: bool = False
    # Dispatch times sites (`LokaConfig.speed_check`): Mods that change a site's form time it too.
    speed_check: bool = False
    # With it, how a gemm_epilogue chain is timed (`speed.chain_timing`, filled in by the backend:
    # passes do not import Dispatch's timing); None: chains are fused untimed.
    time_chain: Optional[Callable] = None
    # The providers the config allows (`LokaConfig.providers`); empty: every registered one.
    # A Mod that moves a site onto a provider asks here first (an export allows ATen ones only).
    providers: tuple = ()
    # An FP8 variant after a probe window: the amax guard of its tensorwise sites
    # (`scaled_gemm.AmaxGuard`): the key prefix naming this graph to the backend, and
    # site id -> (A's, B's) largest amax in the window (None: not measured).
    amax_guard_prefix: str = ""
    window_amax: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.phase = Phase(self.phase)  # its value ("probe", "fp8") names it too; anything else raises

    def amend(self, site: Site, by: str, why: str, decision: Optional[Decision] = None, **changes) -> Decision:
        """Change a site's decision (its stored one, or `decision` before it is stored): the one
        way a decision changes after Dispatch made it, kept as an Amendment the report lists.
        Stores and returns the changed decision."""
        before = self.decisions[site.id] if decision is None else decision
        after = dataclasses.replace(before, **changes)
        changed = tuple((name, _plain(getattr(before, name)), _plain(value)) for name, value in changes.items()
                        if getattr(before, name) != value)
        if changed:
            self.amendments.append(Amendment(site.id, by, why, changed))
        self.decisions[site.id] = after
        return after

    def amax_guard(self, site: Site, spec):
        """The amax guard of `site` as `spec` (a `scaled_gemm.GemmSpec`) casts it: for a
        tensorwise site with window statistics, else None."""
        from loka_compile.kernels.scaled_gemm import AmaxGuard, Scaling

        if spec.scaling is not Scaling.TENSORWISE or site.id not in self.window_amax:
            return None
        a_amax, b_amax = self.window_amax[site.id]
        return AmaxGuard.of_window(f"{self.amax_guard_prefix}/{site.id}", a_amax, b_amax, spec.a_format,
                                   spec.b_format)

    def static_a_scale(self, site: Site) -> Optional[dict]:
        """The calibrated static scale of `site`'s A in this graph (inference graphs only),
        None where A has a dynamic one. Blockwise decisions ignore it (Dispatch, lower)."""
        return self.static_a_scales.get(site.id) if self.kind is GraphKind.INFERENCE else None
