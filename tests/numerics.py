"""Numerics helpers for the tests: errors against higher-precision references."""

import math

import torch


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; NaN anywhere gives -inf (never passes)."""
    reference, value = reference.detach().double(), value.detach().double()
    if not torch.isfinite(value).all():
        return -math.inf
    noise = (reference - value).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(reference.norm() / noise))


def rel_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    reference, value = reference.detach().double(), value.detach().double()
    if not torch.isfinite(value).all():
        return math.inf
    return float((reference - value).norm() / reference.norm())
