"""The operand casts fp8_gemm runs: the fused Triton path must give the references' bytes
and scales exactly, in the K-major layouts (A row-major, B column-major) FP8 tensor cores
read, whatever layout the operands arrive in (forward, grad-input, grad-weight)."""

import pytest
import torch

from loka_compile.kernels import gemm_operands
from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_operands

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALINGS = [Scaling.ROWWISE, Scaling.TENSORWISE, Scaling.BLOCKWISE]
# (a layout, b layout) as the three roles present them: forward x @ W^T, grad-input
# dY @ W, grad-weight X^T @ dY.
LAYOUTS = {"forward": ("row", "column"), "grad_input": ("row", "row"), "grad_weight": ("column", "row")}


def _operand(rows, cols, major, device):
    x = torch.randn(rows, cols, device=device) * torch.exp(torch.randn(rows, cols, device=device))
    x = x.to(torch.bfloat16)
    return x if major == "row" else x.t().contiguous().t()


def _assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point() and got.element_size() > 1:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _check(m, k, n, scaling, role, a_fmt=Fp8Format.E4M3, b_fmt=Fp8Format.E4M3):
    a_major, b_major = LAYOUTS[role]
    a, b = _operand(m, k, a_major, DEVICE), _operand(k, n, b_major, DEVICE)
    got = gemm_operands.quantize_gemm_operands(a, b, scaling, a_fmt, b_fmt, use_triton=True)
    want = quantize_operands(a, b, scaling, a_fmt, b_fmt)
    for g, w in zip(got, want):
        _assert_same(g, w.expand_as(g) if g.dim() == w.dim() else w)
    a_q, _, b_q, _ = got
    assert a_q.stride(1) == 1 or k == 1, f"A not K-major: strides {a_q.stride()}"
    assert b_q.stride(0) == 1 or k == 1, f"B not K-major: strides {b_q.stride()}"


@pytest.mark.parametrize("role", sorted(LAYOUTS))
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.value)
@pytest.mark.parametrize("m, k, n", [(13, 96, 48), (67, 272, 144), (64, 128, 256)])
def test_fused_cast_matches_reference_in_k_major_layout(m, k, n, scaling, role):
    if DEVICE == "cuda":
        pytest.skip("covered at real shapes by the cuda test")
    _check(m, k, n, scaling, role)


def test_gradient_formats():
    if DEVICE == "cuda":
        pytest.skip("covered by the cuda test")
    _check(32, 64, 48, Scaling.ROWWISE, "grad_input", Fp8Format.E5M2, Fp8Format.E4M3)
    _check(32, 64, 48, Scaling.TENSORWISE, "grad_weight", Fp8Format.E4M3, Fp8Format.E5M2)


def test_cpu_and_batched_operands_take_the_references():
    a, b = torch.randn(2, 16, 32), torch.randn(2, 32, 16)
    assert not gemm_operands.fused_cast_applies(a, b)
    assert not gemm_operands.fused_cast_applies(a[0], b[0])  # CPU
    got = gemm_operands.quantize_gemm_operands(a, b, Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3)
    for g, w in zip(got, quantize_operands(a, b, Scaling.ROWWISE, Fp8Format.E4M3, Fp8Format.E4M3)):
        _assert_same(g, w)


@pytest.mark.cuda
@pytest.mark.parametrize("role", sorted(LAYOUTS))
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s.value)
@pytest.mark.parametrize("m, k, n", [(8192, 1024, 512), (2048, 4096, 256), (67, 272, 144)])
def test_fused_cast_matches_reference_cuda(m, k, n, scaling, role):
    assert gemm_operands.fused_cast_applies(torch.empty(2, 2, device="cuda"), torch.empty(2, 2, device="cuda"))
    _check(m, k, n, scaling, role)
    _check(m, k, n, scaling, role, Fp8Format.E5M2, Fp8Format.E4M3)
