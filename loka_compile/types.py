"""The types every layer shares, with no dependency on loka's other modules (the standard library
and torch only): the enums of a GEMM site (role, graph kind, phase, reason), the Site that
`find_sites` records, Dispatch's Decision, and the Amendment that changes one. Site and
Decision are frozen: a pass that changes one makes a new one (`dataclasses.replace`), and a
decision changes only through `PassContext.amend`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

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
    GRAPH_SLOWER_THAN_BF16 = "graph_slower_than_bf16"  # the whole graph timed faster without FP8 (graph_speed)
    GRAPH_FALLBACK = "graph_fallback"
    HIGHER_ORDER_OP = "higher_order_op"  # inside a torch.cond branch, a while_loop body, ...: not rewritten


@dataclasses.dataclass(frozen=True)
class Site:
    """One GEMM in one ATen graph, as found by `find_sites`."""

    # The one identifier, stable across recompiles and processes: "<kind>/<module>:<role>#<n>"
    # (`find_sites.site_id`); decisions and plans are keyed by it.
    id: str
    graph: str
    kind: GraphKind
    node: torch.fx.Node      # the GEMM as found (`lower` replaces it in the graph, not here)
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
    fold: str = ""           # a bmm/baddbmm that is one 2-D GEMM (find_sites.batch_fold), and why

    @property
    def key(self) -> str:
        """The Probe's key: the id under its graph's name, unique across the graphs of a state
        (the observers' sink routes by the graph name, `probe.deliver`)."""
        return f"{self.graph}/{self.id}"

    @property
    def name(self) -> str:
        """The id as logs and the report show it: no kind, no "#1" on a module's only site of a role."""
        base, ordinal = self.id.split("/", 1)[-1].rsplit("#", 1)
        return base if ordinal == "1" else f"{base}#{ordinal}"


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
