"""What passes share: the site record, the Dispatch decision, the fallback reasons, and the
per-graph context a pass reads and writes. Passes never import the backend; the backend
fills `PassContext.decide` with Dispatch."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Optional, Union

import torch

Dim = Union[int, str]  # a concrete size, or a symbolic one such as "s0" or "8*s0"


class Role(str, enum.Enum):
    """What a GEMM computes in training: the forward product, the gradient of its
    activation input (dgrad), or the gradient of its weight (wgrad)."""

    FWD = "fwd"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class Phase(str, enum.Enum):
    """Which variant of a graph runs: the probe one (observers, high-precision GEMMs) while the
    Probe learns, then the FP8 one. Plans and JSON hold the value."""

    PROBE = "probe"
    FP8 = "fp8"


class GraphKind(str, enum.Enum):
    FORWARD = "forward"      # training forward (AOT "primals")
    BACKWARD = "backward"    # training backward (AOT "tangents")
    INFERENCE = "inference"  # no_grad / eval forward


class Reason(str, enum.Enum):
    """Why a site runs where it runs. FP8 is the only reason that means FP8."""

    FP8 = "fp8"
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    PACKED_BY_FREEZING = "packed_by_freezing"
    K_NOT_MULTIPLE_OF_16 = "k_not_multiple_of_16"
    N_NOT_MULTIPLE_OF_16 = "n_not_multiple_of_16"
    SYMBOLIC_K_OR_N = "symbolic_k_or_n"
    TOO_SMALL = "too_small"
    UNSUPPORTED_VARIANT = "unsupported_variant"
    EXCLUDED_BY_CONFIG = "excluded_by_config"
    RECIPE_HIGH_PRECISION = "recipe_high_precision"
    NO_FP8_HARDWARE = "no_fp8_hardware"
    NO_PROVIDER = "no_provider"
    PROVIDER_FAILED = "provider_failed"
    PROBING = "probing"
    PROBE_UNSAFE = "probe_unsafe"
    SLOWER_THAN_BF16 = "slower_than_bf16"
    GRAPH_FALLBACK = "graph_fallback"
    HIGHER_ORDER_OP = "higher_order_op"  # inside a torch.cond branch, a while_loop body, ...: not rewritten


@dataclasses.dataclass
class Site:
    """One GEMM in one ATen graph, as found by `find_sites`."""

    key: str                 # unique across graphs: "<graph>/<kind>/<node name>"
    name: str                # readable: "<module>:<role>:<node name>"
    graph: str
    kind: GraphKind
    node: torch.fx.Node
    op: str                  # mm | addmm | bmm | baddbmm | packed_linear
    role: Role
    module: str
    shape: tuple             # (M, K, N), Dim each (a folded bmm: M counts every batch's rows)
    batch: Optional[Dim]     # bmm batch size, None for 2-D and folded bmm
    dtype: torch.dtype
    device: torch.device
    a_is_grad: bool          # operand depends on the incoming gradient
    b_is_grad: bool
    producers: tuple         # producing op of A and of B
    consumers: tuple         # ops that read the result
    seq_nr: Optional[int]    # autograd sequence number: forward and backward share it
    unit_scalars: bool = True  # addmm/baddbmm with beta == alpha == 1
    a_major: str = "row"     # operand layouts: "row" (last dim contiguous) or "column"
    b_major: str = "row"
    b_is_weight: bool = False  # B is a weight input of a forward/inference graph (through views)
    casts: dict = dataclasses.field(default_factory=dict)  # FP8 sites: operand -> how it is cast
    fold: str = ""           # a bmm/baddbmm that is one 2-D GEMM (find_sites.batch_fold), and why
    id: str = ""             # stable across recompiles and processes: "<kind>/<module>:<role>#<n>" (plans)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One provider the speed check timed at a site."""

    provider: str
    gemm_us: Optional[float]          # its FP8 GEMM alone; None: it raised at the site's shape
    chosen: bool                      # the site runs FP8 on it
    lost: str = ""                    # why it was not chosen ("" when chosen)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Dispatch's verdict for one site."""

    fp8: bool
    reason: Reason
    provider: str = "aten"
    scaling: str = ""
    a_format: str = ""
    b_format: str = ""
    detail: str = ""
    bf16_us: Optional[float] = None   # measured time of the high-precision GEMM (speed check)
    fp8_us: Optional[float] = None    # measured time of the FP8 form, casts included
    pad_k: int = 0                    # zeros appended to K / N to reach a multiple of 16
    pad_n: int = 0
    fast_accum: bool = False          # the GEMM accumulates in the tensor cores' fast mode
    candidates: tuple = ()            # Candidate per provider the speed check timed
    m_bucket: Optional[int] = None    # symbolic M: the M the speed check timed the site at


@dataclasses.dataclass(frozen=True)
class Amendment:
    """One change to a site's decision after Dispatch made it: who changed it (a Mod's name,
    "output_budget", "fallback"), why, and each changed field as (field, before, after)."""

    site_id: str
    by: str
    why: str
    changes: tuple

    def describe(self) -> str:
        fields = ", ".join(f"{name} {before!r} -> {after!r}" for name, before, after in self.changes
                           if name != "detail")
        return f"{self.by}: {fields or 'detail'} ({self.why})"


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
    decisions: dict = dataclasses.field(default_factory=dict)   # site key -> Decision
    amendments: list = dataclasses.field(default_factory=list)  # Amendment, in order (`amend`)
    changes: dict = dataclasses.field(default_factory=dict)     # pass name -> count
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
        before = self.decisions[site.key] if decision is None else decision
        after = dataclasses.replace(before, **changes)
        changed = tuple((name, _plain(getattr(before, name)), _plain(value)) for name, value in changes.items()
                        if getattr(before, name) != value)
        if changed:
            self.amendments.append(Amendment(site.id, by, why, changed))
        self.decisions[site.key] = after
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
