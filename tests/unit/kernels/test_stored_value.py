"""`quantize.as_stored`: a bf16 or fp16 value as its dtype stores it, computed by arithmetic so
that a cast Inductor fuses into the kernel producing the value reads the stored value."""

import pytest
import torch

from loka_compile.kernels.quantize import Fp8Format, as_stored, quantize_along

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SPECIAL = (0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11,
           1.0 + 3 * 2 ** -11, 65504.0, 65519.99, 65520.0, -65520.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
           2.0 ** -26, 3.3895314e38, 3.4028235e38, 1e-40, -1e-45)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounds_every_fp32_as_a_conversion_does(dtype, device):
    """Random fp32 bit patterns (every exponent: subnormals, overflow, NaN), ties and edges,
    eager and compiled: the bits of x.to(dtype).float()."""
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=generator, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor(SPECIAL),
                   torch.randn(20_000, generator=generator) * 1e-5,
                   torch.randn(20_000, generator=generator) * 3e4]).to(device)
    want = x.to(dtype).float()
    for got in (as_stored(x.to(dtype)), torch.compile(lambda v: as_stored(v.to(dtype)), backend="inductor")(x)):
        assert got.dtype == torch.float32
        assert _same_bits(got, want).all(), x[~_same_bits(got, want)][:5]


def test_fp32_passes_unchanged():
    x = torch.randn(64, 32)
    assert torch.equal(as_stored(x), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stored", [False, True], ids=["fused", "also_stored"])
def test_a_cast_fused_into_the_producer_reads_the_stored_value(dtype, stored, device):
    """Inductor computes the cast in the kernel that computes its low-precision operand in fp32
    (and, `also_stored`, writes it out): the scale and the FP8 bytes are those of the operand
    as stored, bit for bit."""

    def produce_and_cast(x, w):
        y = torch.relu((x * w).to(dtype))
        q, scale = quantize_along(as_stored(y), -1, Fp8Format.E4M3)
        return (y, q, scale) if stored else (y.float(), q, scale)

    x, w = torch.randn(64, 48, device=device) * 3, torch.randn(48, device=device)
    y, q, scale = torch.compile(produce_and_cast, backend="inductor", fullgraph=True)(x, w)
    stored_y = torch.relu((x * w).to(dtype))
    ref_q, ref_scale = quantize_along(stored_y, -1, Fp8Format.E4M3)
    assert (ref_scale > 0).all()
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
