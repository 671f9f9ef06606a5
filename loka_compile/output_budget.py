"""The output budget (`LokaConfig.max_output_error`): a bound on how far a compiled graph's
outputs move from its high-precision variant's, applied when a probe window closes.

Per-site bounds (`max_probe_error`) judge each GEMM alone; errors then add up through the
model. The output budget measures, per forward GEMM site i, its sensitivity

    s_i = relerr(y_i, y) / delta

y: the probe variant's floating outputs (high-precision GEMMs); y_i: the same call with
`loka.perturb` multiplying site i's output by (1 + delta z), z standard normal, delta =
`kernels.ops.PERTURB_DELTA`; relerr: ||a - b|| / ||b|| over all floating outputs at once.
A site whose FP8 error is e_i (its row relative error, the metric that matches a per-element
relative noise) then moves the output by about s_i e_i, and independent sites add in
quadrature:

    D^2 = sum_i (s_i e_i)^2    over the forward sites going FP8.

While D exceeds the budget the site with the largest s_i e_i stays in high precision.
Backward sites (dgrad, wgrad) do not move the forward's outputs: only their per-site bound
applies. The backend runs the measurements (`backend.LokaCompiledGraph`); this module holds
the arithmetic and the record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from loka_compile.kernels import metrics


@dataclasses.dataclass
class OutputBudget:
    """What the output budget measured and decided for one graph (`GraphRecord.output_budget`)."""

    budget: float
    sensitivity: dict           # site id -> s (forward sites the probe variant observed)
    error: dict                 # site id -> e: row relative error (mean) in the scaling it would run
    kept: dict                  # site id -> detail: the sites the budget keeps in high precision
    predicted_before: float     # D over every forward site the per-site verdicts let go FP8
    predicted: float            # D over those the budget leaves in FP8
    predicted_after: Optional[float] = None  # D over the sites the FP8 variant runs in FP8, as compiled
    measured: Optional[float] = None         # relerr(FP8 variant, probe variant) on the closing call
    seconds: float = 0.0        # the sensitivity runs' wall time
    runs: int = 0               # forward runs of the probe variant they took


def float_outputs(out) -> list:
    """The floating tensors among a graph's outputs (any nesting), detached copies."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def discrepancy(value: list, reference: list) -> float:
    """||value - reference|| / ||reference|| over every tensor of the two lists at once
    (`metrics.rel_error` of their concatenation, fp64); +inf when anything is not finite."""
    if len(value) != len(reference) or any(v.shape != r.shape for v, r in zip(value, reference)):
        raise ValueError("the runs' floating outputs differ in number or shape")
    if not reference:
        raise ValueError("the graph has no floating output")
    flat = lambda ts: torch.cat([t.detach().reshape(-1).double().cpu() for t in ts])  # noqa: E731
    return metrics.rel_error(flat(reference), flat(value))


def check_reference(reference: list) -> None:
    """The high-precision outputs must be finite and not all zero for relative errors to mean anything."""
    if not all(bool(torch.isfinite(t).all()) for t in reference):
        raise ValueError("the high-precision outputs are not finite")
    if not any(bool((t != 0).any()) for t in reference):
        raise ValueError("the high-precision outputs are all zero")


def candidate_error(summary: dict, candidate: str) -> Optional[float]:
    """The mean row relative error the Probe measured for `candidate` ("rowwise/e4m3/e4m3")
    at a site, whatever `probe_metric` judges bounds by: row relative error is the metric
    that matches a per-element relative noise (a noise of relative size delta measures
    delta), so s * e is the output's change. None when not measured."""
    cand = summary.get("candidates", {}).get(candidate)
    if cand is None:
        return None
    return float(cand["rel_error"]["mean"])


def predicted(contributions) -> float:
    """sqrt(sum c^2): independent errors add in quadrature (a NaN counts as +inf)."""
    total = 0.0
    for c in contributions:
        if not c <= math.inf:
            return math.inf
        total += c * c
    return math.sqrt(total)


def keep_within(sensitivity: dict, error: dict, budget: float, labels: Optional[dict] = None,
                scale: float = 1.0) -> tuple:
    """(kept {site id: detail}, D before, D after): the sites of `error` (those going FP8;
    `sensitivity` has each) kept in high precision, largest s * e first, until the
    predicted D is within `budget`. `labels`: site id -> the scaling e was measured in;
    `scale`: a factor on every prediction (`measured_scale`)."""
    labels = labels or {}
    contribution = {sid: scale * sensitivity[sid] * e for sid, e in error.items()}
    contribution = {sid: (c if c == c else math.inf) for sid, c in contribution.items()}  # NaN -> inf
    left = dict(contribution)
    before = d = predicted(left.values())
    kept = {}
    while d > budget and left:
        sid = max(left, key=left.get)
        factor = f" x {scale:.2g} (the prediction's measured shortfall)" if scale != 1.0 else ""
        kept[sid] = (f"output budget: sensitivity {sensitivity[sid]:.3g} x rel. error {error[sid]:.3g}"
                     f"{' (' + labels[sid] + ')' if sid in labels else ''}{factor} = {left[sid]:.3g}, the largest "
                     f"share of a predicted output discrepancy {d:.3g} > max_output_error {budget:g}")
        del left[sid]
        d = predicted(left.values())
    return kept, before, d


def measured_scale(budget: OutputBudget) -> float:
    """How many times its prediction the FP8 variant's output discrepancy measured (at
    least 1; 1 before it was measured). The sum in quadrature assumes independent site
    errors; on the H100 calibrated MaskNet measured 3.5x, Wukong 2.6x."""
    if budget.measured is None or not budget.predicted_after:
        return 1.0
    return max(1.0, budget.measured / budget.predicted_after)
