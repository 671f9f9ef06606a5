"""The Triton dequantization (`kernels/triton_dequantize.py`) against the reference
(`quantize.dequantize`, then one rounding into the output), bit for bit: every FP8 byte, rowwise,
columnwise and tensorwise scales (zero, infinite and NaN ones included), e4m3 and e5m2, into fp32
and bf16, at small misaligned shapes and non-contiguous layouts. CPU: Triton interpreter; `-m cuda`:
the compiled kernel."""

import pytest
import torch

from loka_compile.kernels import triton_dequantize as td
from loka_compile.kernels.quantize import Fp8Format
from tests.shapes import SMALL_SHAPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = sorted({(13, 96), (67, 272), (5, 300)} | {(n, k) for _, k, n in SMALL_SHAPES})


def every_byte(rows, cols, fmt, seed=0):
    """FP8 bytes covering all 256 encodings (NaN, infinities, zeros of both signs, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32)
    bits.view(-1)[:256] = torch.arange(256, dtype=torch.int32)  # every shape here has 256 elements or more
    return bits.to(torch.uint8).view(fmt.dtype).to(DEVICE)


def scales(rows, cols, kind, seed=0):
    """fp32 scales of the kind's shape over 60 binades, with a zero-row's 1, an inf and a NaN."""
    g = torch.Generator().manual_seed(seed)
    shape = {"rowwise": (rows, 1), "columnwise": (1, cols), "tensorwise": ()}[kind]
    scale = torch.exp2(torch.rand(shape, generator=g) * 60 - 30)
    if kind != "tensorwise" and scale.numel() >= 3:
        flat = scale.view(-1)
        flat[0], flat[1], flat[2] = 1.0, float("inf"), float("nan")
    return scale.to(DEVICE)


def assert_same(value, reference):
    assert value.dtype == reference.dtype and value.shape == reference.shape
    a, b = value.float(), reference.float()
    assert torch.equal(a.isnan(), b.isnan()), "NaN differs"
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    bad = (a != b) | (torch.signbit(a) != torch.signbit(b))
    assert not bad.any(), f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("kind", ["rowwise", "columnwise", "tensorwise"])
@pytest.mark.parametrize("dtype", td.OUT_DTYPES)
def test_bit_exact(shape, fmt, kind, dtype):
    q, scale = every_byte(*shape, fmt), scales(*shape, kind)
    value = td.dequantize_into_triton(q, scale, torch.empty(shape, dtype=dtype, device=DEVICE))
    assert_same(value, td.dequantize_into_reference(q, scale, torch.empty(shape, dtype=dtype, device=DEVICE)))
    assert not torch.isnan(value.float()[q.float() == 0]).any()  # a quantized zero stays zero, even inf-scaled


def test_non_contiguous_layouts():
    q = every_byte(96, 40, Fp8Format.E4M3).t()  # [40, 96] column-major
    scale = scales(40, 96, "rowwise")
    out = torch.empty(96, 40, dtype=torch.bfloat16, device=DEVICE).t()
    value = td.dequantize_into_triton(q, scale, out)
    assert value is out
    assert_same(value, td.dequantize_into_reference(q, scale, torch.empty(40, 96, dtype=torch.bfloat16, device=DEVICE)))


def test_bad_inputs_are_refused():
    q = every_byte(16, 32, Fp8Format.E4M3)
    out = torch.empty(16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="2-D fp8"):
        td.dequantize_into_triton(q.float(), scales(16, 32, "rowwise"), out)
    with pytest.raises(ValueError, match="scale must be fp32"):
        td.dequantize_into_triton(q, scales(16, 32, "rowwise").t(), out)
    with pytest.raises(ValueError, match="out must be"):
        td.dequantize_into_triton(q, scales(16, 32, "rowwise"), torch.empty(16, 32, dtype=torch.float16, device=DEVICE))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (8192, 1024), (1000, 1000)])
@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("dtype", td.OUT_DTYPES)
def test_cuda_bit_exact(shape, fmt, dtype):
    q = every_byte(*shape, fmt).cuda()
    for kind in ("rowwise", "columnwise", "tensorwise"):
        scale = scales(*shape, kind).cuda()
        value = td.dequantize_into_triton(q, scale, torch.empty(shape, dtype=dtype, device="cuda"))
        assert_same(value, td.dequantize_into_reference(q, scale, torch.empty(shape, dtype=dtype, device="cuda")))
