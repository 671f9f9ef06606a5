"""Numerics helpers for the tests: errors against higher-precision references. The
definitions live in `loka_compile.kernels.metrics` (shared with the Probe and the benchmarks)."""

from loka_compile.kernels.metrics import MERE_EPS_REL, mere, rel_error, row_rel_error, sqnr_db

__all__ = ["sqnr_db", "rel_error", "row_rel_error", "mere", "MERE_EPS_REL"]
