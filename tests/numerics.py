"""Numerics helpers for the tests: errors against higher-precision references. The
definitions live in `loka_compile.kernels.metrics` (shared with the Probe and the benchmarks)."""

import torch

from loka_compile.kernels.metrics import MERE_EPS_REL, mere, rel_error, row_rel_error, sqnr_db

__all__ = ["sqnr_db", "rel_error", "row_rel_error", "mere", "MERE_EPS_REL", "sqnr_against_terms_db", "cancellation"]


def sqnr_against_terms_db(reference: torch.Tensor, value: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The SQNR of `value` against `reference`, a sum of terms, with the terms' size as the
    signal: `magnitude` is the same sum taken over the terms' absolute values. Each term
    brings an error relative to itself (FP8's is), so the sum's error is bounded by the terms'
    size, not by the residue left where they cancel. Equal to `sqnr_db` where nothing cancels
    (magnitude == |reference|); a NaN or inf in `value` gives -inf, as there."""
    return sqnr_db(magnitude, magnitude + (value - reference))


def cancellation(reference: torch.Tensor, magnitude: torch.Tensor) -> float:
    """|sum| / sum |terms| over all elements, as norms: 1 where nothing cancels, near 0 where
    the terms cancel almost entirely."""
    size = float(magnitude.double().norm())
    return float(reference.double().norm()) / size if size > 0 else 1.0
