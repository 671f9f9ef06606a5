"""Error metrics of a low-precision result against a higher-precision reference: the one
definition the Probe, the tests and the benchmarks share.

Every metric takes (reference, value). Non-finite values anywhere in either never pass:
errors are +inf, SQNR is -inf. The `*_tensor` forms return 0-d float64 tensors on the
inputs' device and never read back (no host sync); the plain forms return Python floats.

- `sqnr_db`: 20 log10(||ref|| / ||value - ref||); +inf for an exact result.
- `rel_error`: ||value - ref|| / ||ref|| over the whole tensor (0 when both are zero).
- `row_rel_error`: the mean over rows (last dim) of each row's ||value_r - ref_r|| / ||ref_r||,
  so one large row cannot hide the error of all the others; the Probe's verdict metric.
- `mere`: LoKA's mean element-wise relative error, mean_i |value_i - ref_i| / (|ref_i| + eps)
  with eps = MERE_EPS_REL * median_i |ref_i| (see below).
"""

from __future__ import annotations

import math

import torch

# MERE's eps, relative to the median |reference|: an output element smaller than 1% of
# the typical magnitude counts as if it were that size. Without it the mean is ruled by
# the elements a GEMM's cancellation leaves near zero. The median, not the mean, so that
# one outlier row (a tensorwise site's trouble) cannot inflate eps and hide the flushed
# rows. Measured on a random 256x512x256 GEMM, rowwise e4m3 (row relative error 0.037):
# MERE 0.119 with 1e-2, 0.148 with 3e-3, 0.176 with 1e-3, 0.283 with eps -> 0, so 1e-2
# leaves a clean e4m3 GEMM well under LoKA's 0.2.
MERE_EPS_REL = 1e-2


def _pair(reference: torch.Tensor, value: torch.Tensor):
    reference, value = reference.detach().double(), value.detach().double()
    finite = torch.isfinite(reference).all() & torch.isfinite(value).all()
    return reference, value, finite


def _bad(finite: torch.Tensor, x: torch.Tensor, bad_value: float) -> torch.Tensor:
    return torch.where(finite, x, torch.full_like(x, bad_value))


def sqnr_db_tensor(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    reference, value, finite = _pair(reference, value)
    noise = (reference - value).norm()
    signal = reference.norm()
    db = 20 * torch.log10(signal / noise)  # noise 0 -> +inf; signal 0, noise > 0 -> -inf
    db = torch.where(noise == 0, torch.full_like(db, math.inf), db)
    return _bad(finite, db, -math.inf)


def rel_error_tensor(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    reference, value, finite = _pair(reference, value)
    noise = (reference - value).norm()
    err = torch.where(noise == 0, torch.zeros_like(noise), noise / reference.norm())
    return _bad(finite, err, math.inf)


def row_rel_error_tensor(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    reference, value, finite = _pair(reference, value)
    reference = reference.reshape(-1, reference.shape[-1])
    value = value.reshape(-1, value.shape[-1])
    row_ref = reference.norm(dim=-1)
    row_diff = (value - reference).norm(dim=-1)
    # A floor of 1e-6 of the mean row norm keeps an all-zero reference row finite.
    err = (row_diff / (row_ref + 1e-6 * row_ref.mean() + 1e-300)).mean()
    return _bad(finite, err, math.inf)


def mere_tensor(reference: torch.Tensor, value: torch.Tensor, eps_rel: float = MERE_EPS_REL) -> torch.Tensor:
    reference, value, finite = _pair(reference, value)
    ref_abs = reference.abs()
    eps = eps_rel * ref_abs.median() + 1e-300  # 1e-300: an all-zero reference
    err = ((value - reference).abs() / (ref_abs + eps)).mean()
    return _bad(finite, err, math.inf)


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    return float(sqnr_db_tensor(reference, value))


def rel_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return float(rel_error_tensor(reference, value))


def row_rel_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    return float(row_rel_error_tensor(reference, value))


def mere(reference: torch.Tensor, value: torch.Tensor, eps_rel: float = MERE_EPS_REL) -> float:
    return float(mere_tensor(reference, value, eps_rel))
