"""Triton FP8 quantization kernels against the references of kernels/quantize.py, bit for
bit (fp8 bytes and fp32 scales). CPU: Triton interpreter at small and misaligned shapes;
`-m cuda`: the compiled kernels at real shapes."""

import pytest
import torch

from loka_compile.kernels import triton_quant as tq
from loka_compile.kernels.quantize import Fp8Format, quantize_along, quantize_blockwise, quantize_tensorwise
from tests.shapes import SMALL_SHAPES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ["e4m3", "e5m2"]
# A operands [M, K]: the misaligned pairs named in the issue plus every shared small
# GEMM shape; B operands [K, N] of the shared shapes for the columnwise cast.
SHAPES_2D = sorted({(13, 96), (67, 272)} | {(m, k) for m, k, _ in SMALL_SHAPES})
B_SHAPES = sorted({(k, n) for _, k, n in SMALL_SHAPES})


def _wide_range(rows, cols, dtype=torch.bfloat16, device=DEVICE):
    """Random values spanning several decades per row, so casts hit fp8 subnormals and
    rounding carries into the exponent, plus a different magnitude per row."""
    x = torch.randn(rows, cols, device=device) * torch.exp(torch.randn(rows, cols, device=device) * 2)
    x = x * torch.exp2(torch.randint(-20, 20, (rows, 1), device=device).float())
    return x.to(dtype)


def assert_same(q, scale, q_ref, scale_ref):
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert scale.shape == scale_ref.shape and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} fp8 bytes differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rowwise_bit_exact(shape, fmt):
    x = _wide_range(*shape)
    for p2 in (False, True):
        q, s = tq.quantize_rowwise_triton(x, fmt, p2)
        assert q.is_contiguous()
        assert_same(q, s, *quantize_along(x, -1, Fp8Format(fmt), p2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rowwise_other_dtypes_and_column_major_input(dtype):
    x = _wide_range(67, 272, dtype=torch.float32).to(dtype)
    assert_same(*tq.quantize_rowwise_triton(x, "e4m3"), *quantize_along(x, -1, Fp8Format.E4M3))
    xt = x.t().contiguous().t()  # column-major
    q, s = tq.quantize_rowwise_triton(xt, "e4m3")
    assert q.stride() == xt.stride()
    assert_same(q, s, *quantize_along(xt, -1, Fp8Format.E4M3))


def test_rowwise_two_pass_wide_rows():
    x = _wide_range(5, 3 * 4096 + 40)
    cfg = dict(BLOCK_R=1, BLOCK_C=4096, SINGLE_PASS=False, num_warps=4)
    assert_same(*tq.quantize_rowwise_triton(x, "e5m2", config=cfg), *quantize_along(x, -1, Fp8Format.E5M2))


def test_rowwise_split_reduction_wide_rows_and_transposing_cast(monkeypatch):
    # Rows longer than one program holds take the split-reduction kernels; shrink the
    # single-pass limit so an interpreter-sized row exercises them.
    monkeypatch.setattr(tq, "MAX_SINGLE_PASS_COLS", 64)
    x = _wide_range(13, 272)
    x[3, 200] = float("nan")
    assert tq._rows_config(x.stride(1), x.shape[1]) is None
    assert_same(*tq.quantize_rowwise_triton(x, "e4m3"), *quantize_along(x, -1, Fp8Format.E4M3))
    for out_major, strides in (("column", (1, 272)), ("row", (13, 1))):
        q, s = tq.quantize_columnwise_triton(x.t(), "e5m2", out_major=out_major)  # [272, 13]
        assert q.stride() == strides
        assert_same(q, s, *quantize_along(x.t(), -2, Fp8Format.E5M2))
    with pytest.raises(ValueError, match="out_major"):
        tq.quantize_rowwise_triton(x, "e4m3", out_major="k")


@pytest.mark.parametrize("shape", B_SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_columnwise_bit_exact_both_layouts(shape, fmt):
    b = _wide_range(shape[1], shape[0]).t()  # [K, N] column-major (a weight's transpose)
    q, s = tq.quantize_columnwise_triton(b, fmt)
    assert q.stride() == b.stride(), "a column-major B operand must give a column-major q"
    assert_same(q, s, *quantize_along(b, -2, Fp8Format(fmt)))
    b = b.contiguous()
    q, s = tq.quantize_columnwise_triton(b, fmt, True)
    assert q.is_contiguous()
    assert_same(q, s, *quantize_along(b, -2, Fp8Format(fmt), True))


@pytest.mark.parametrize("shape", [(13, 96), (67, 272), (3, 5, 7), (4096 * 3 + 5,)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensorwise_bit_exact(shape, fmt):
    x = (torch.randn(shape, device=DEVICE) * 1e-3).to(torch.bfloat16)
    for p2 in (False, True):
        q, s = tq.quantize_tensorwise_triton(x, fmt, p2, amax_programs_per_sm=1)
        assert s.shape == () and q.shape == x.shape
        assert_same(q, s, *quantize_tensorwise(x, Fp8Format(fmt), p2))


@pytest.mark.parametrize("shape", [(13, 96), (67, 272), (130, 160)])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_blockwise_bit_exact(shape, block, fmt):
    x = _wide_range(*shape)
    for xin in (x, x.t().contiguous().t()):
        q, s = tq.quantize_blockwise_triton(xin, *block, fmt, power_of_two=block[0] == 1)
        assert q.stride() == xin.stride()
        assert_same(q, s, *quantize_blockwise(xin, *block, Fp8Format(fmt), block[0] == 1))


@pytest.mark.parametrize("shape", [(13, 96), (67, 272), (160, 130)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dual_axis_bit_exact_and_layouts(shape, fmt):
    x = _wide_range(*shape)
    q_row, s_row, q_col, s_col = tq.quantize_dual_axis_triton(x, fmt, fmt == "e5m2")
    assert q_row.is_contiguous() and q_col.t().is_contiguous()
    assert s_row.shape == (shape[0], 1) and s_col.shape == (1, shape[1])
    assert_same(q_row, s_row, *quantize_along(x, -1, Fp8Format(fmt), fmt == "e5m2"))
    assert_same(q_col, s_col, *quantize_along(x, -2, Fp8Format(fmt), fmt == "e5m2"))


def _poisoned(rows, cols):
    x = torch.randn(rows, cols, device=DEVICE).to(torch.bfloat16)
    x[1, 3] = float("nan")
    x[4, 0] = float("inf")
    x[5, 7] = -float("inf")
    x[6] = 0
    return x


ONE_BYTE = {"e4m3": 0x38, "e5m2": 0x3C}  # the bits of 1.0; 0x80 is the sign


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_policy(fmt):
    """A NaN makes its group NaN; an infinity (no NaN) makes its group's scale +inf, its
    own byte its sign (+-1.0) and the group's finite bytes +-0; tensorwise each bad element
    alone is NaN, or +-inf in e5m2."""
    x = _poisoned(13, 96)
    q, s = tq.quantize_rowwise_triton(x, fmt)
    assert_same(q, s, *quantize_along(x, -1, Fp8Format(fmt)))
    assert s[1].isnan() and (q[1].view(torch.uint8) == tq.NAN_BYTE).all()
    assert s[[4, 5]].isposinf().all() and s[6].item() == 1.0
    bits = q.view(torch.uint8)
    assert bits[4, 0] == ONE_BYTE[fmt] and bits[5, 7] == 0x80 + ONE_BYTE[fmt]
    others = torch.ones_like(bits[4:6], dtype=torch.bool)
    others[0, 0] = others[1, 7] = False
    assert ((bits[4:6][others] & 0x7F) == 0).all()  # +-0
    assert (q[6].view(torch.uint8) == 0).all()
    finite = [i for i in range(13) if i not in (1, 4, 5)]
    assert s[finite].isfinite().all()
    # tensorwise: the scale comes from the finite values; only the bad elements are NaN (+-inf in e5m2)
    q, s = tq.quantize_tensorwise_triton(x, fmt)
    bad = ~torch.isfinite(x)
    assert s.isfinite() and q.float()[1, 3].isnan()
    assert (q.float()[4, 0].isposinf() and q.float()[5, 7].isneginf()) if fmt == "e5m2" else q.float()[bad].isnan().all()
    assert not q.float()[~bad].isnan().any()
    assert_same(q, s, *quantize_tensorwise(x, Fp8Format(fmt)))
    # blockwise and dual-axis: only the groups that hold the bad elements
    assert_same(*tq.quantize_blockwise_triton(x, 1, 128, fmt), *quantize_blockwise(x, 1, 128, Fp8Format(fmt)))
    assert_same(*tq.quantize_blockwise_triton(x, 16, 16, fmt), *quantize_blockwise(x, 16, 16, Fp8Format(fmt)))
    q_row, s_row, q_col, s_col = tq.quantize_dual_axis_triton(x, fmt)
    assert_same(q_row, s_row, *quantize_along(x, -1, Fp8Format(fmt)))
    assert_same(q_col, s_col, *quantize_along(x, -2, Fp8Format(fmt)))
    assert s_col[0, 3].isnan() and s_col[0, [0, 7]].isposinf().all() and s_col.isfinite().sum() == 93


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_policy_split_reduction(fmt):
    """The split-reduction row casts (a strided reduction axis: columnwise on a row-major
    tensor) order NaN above inf in their atomic amax too."""
    x = _poisoned(13, 96)  # row-major: each column's reduction is strided
    q, s = tq.quantize_columnwise_triton(x, fmt)
    assert_same(q, s, *quantize_along(x, -2, Fp8Format(fmt)))
    assert s[0, 3].isnan() and s[0, [0, 7]].isposinf().all()
    y = x.clone()
    y[2, 3] = float("inf")  # an inf and a NaN in one group: NaN wins
    q, s = tq.quantize_columnwise_triton(y, fmt)
    assert_same(q, s, *quantize_along(y, -2, Fp8Format(fmt)))
    assert s[0, 3].isnan() and (q[:, 3].view(torch.uint8) == tq.NAN_BYTE).all()


def test_all_zero_tensor_scale_one():
    x = torch.zeros(13, 96, device=DEVICE, dtype=torch.bfloat16)
    q, s = tq.quantize_tensorwise_triton(x, "e4m3")
    assert s.item() == 1.0 and (q.view(torch.uint8) == 0).all()


def test_power_of_two_scale_rounds_up_exactly():
    # amax a hair above 448 * 2^-10: the scale must round up to 2^-9 so that no element
    # saturates. (The reference's ceil(log2(s)) can round this one down to 2^-10.)
    amax = torch.tensor(448 * 2.0 ** -10, dtype=torch.float32)
    amax = torch.nextafter(amax, torch.tensor(1.0))
    x = torch.full((1, 16), 0.5, device=DEVICE)
    x[0, 0] = amax.item()
    _, s = tq.quantize_rowwise_triton(x, "e4m3", True)
    assert s.item() == 2.0 ** -9
    _, s = tq.quantize_rowwise_triton(x * 0 + 448 * 2.0 ** -10, "e4m3", True)
    assert s.item() == 2.0 ** -10
    # every power-of-two scale covers its row's amax
    y = _wide_range(67, 272, dtype=torch.float32)
    _, s = tq.quantize_rowwise_triton(y, "e4m3", True)
    assert (torch.log2(s) == torch.log2(s).round()).all()
    assert (y.abs().amax(1, keepdim=True) / s <= 448).all()


def test_bad_inputs_raise():
    x = torch.randn(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="row-major or column-major"):
        tq.quantize_rowwise_triton(x[:, ::2], "e4m3")
    with pytest.raises(ValueError, match="2-D"):
        tq.quantize_rowwise_triton(x.view(4, 4, 64), "e4m3")
    with pytest.raises(ValueError, match="dtype"):
        tq.quantize_rowwise_triton(x.to(torch.int32), "e4m3")
    with pytest.raises(ValueError, match="unknown fp8 format"):
        tq.quantize_rowwise_triton(x, "e3m4")
    with pytest.raises(ValueError, match="block_cols"):
        tq.quantize_blockwise_triton(x, 1, 100, "e4m3")
    with pytest.raises(ValueError, match="block_rows"):
        tq.quantize_blockwise_triton(x, 3, 128, "e4m3")
    with pytest.raises(ValueError, match="row-major"):
        tq.quantize_dual_axis_triton(x.t(), "e4m3")
    with pytest.raises(ValueError, match="contiguous"):
        tq.quantize_tensorwise_triton(x.t(), "e4m3")


OPS = [
    (torch.ops.loka.quantize_rowwise, lambda x: (x, "e4m3", False)),
    (torch.ops.loka.quantize_columnwise, lambda x: (x.t().contiguous().t(), "e5m2", True)),
    (torch.ops.loka.quantize_tensorwise, lambda x: (x, "e4m3", False)),
    (torch.ops.loka.quantize_blockwise, lambda x: (x, 1, 128, "e4m3", False)),
    (torch.ops.loka.quantize_blockwise, lambda x: (x, 128, 128, "e4m3", True)),
    (torch.ops.loka.quantize_dual_axis, lambda x: (x, "e4m3", False)),
]


@pytest.mark.parametrize("op, make_args", OPS)
def test_opcheck(op, make_args):
    x = torch.randn(13, 96, device=DEVICE, dtype=torch.bfloat16)
    torch.library.opcheck(op, make_args(x))


def test_ops_match_launchers():
    x = _wide_range(67, 272)
    assert_same(*torch.ops.loka.quantize_rowwise(x, "e4m3"), *quantize_along(x, -1, Fp8Format.E4M3))
    out = torch.ops.loka.quantize_dual_axis(x, "e5m2")
    assert_same(out[2], out[3], *quantize_along(x, -2, Fp8Format.E5M2))


# ---- real shapes, compiled kernels ----------------------------------------------------

CUDA_2D = [(2048, 1024), (8192, 4096), (4096, 8192), (32768, 2048), (1000, 1000)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", CUDA_2D)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_bit_exact(shape, fmt):
    f = Fp8Format(fmt)
    x = _wide_range(*shape, device="cuda")
    for p2 in (False, True):
        assert_same(*tq.quantize_rowwise_triton(x, fmt, p2), *quantize_along(x, -1, f, p2))
        assert_same(*tq.quantize_columnwise_triton(x.t(), fmt, p2), *quantize_along(x.t(), -2, f, p2))
        assert_same(*tq.quantize_blockwise_triton(x, 1, 128, fmt, p2), *quantize_blockwise(x, 1, 128, f, p2))
        assert_same(*tq.quantize_blockwise_triton(x, 128, 128, fmt, p2), *quantize_blockwise(x, 128, 128, f, p2))
        q_row, s_row, q_col, s_col = tq.quantize_dual_axis_triton(x, fmt, p2)
        assert_same(q_row, s_row, *quantize_along(x, -1, f, p2))
        assert_same(q_col, s_col, *quantize_along(x, -2, f, p2))
    xs = (x.float() * 1e-2).to(torch.bfloat16)
    assert_same(*tq.quantize_tensorwise_triton(xs, fmt), *quantize_tensorwise(xs, f))
    assert_same(*tq.quantize_tensorwise_triton(xs, fmt, True), *quantize_tensorwise(xs, f, True))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_non_finite_policy(fmt):
    x = _poisoned(4096, 1024)
    assert_same(*tq.quantize_rowwise_triton(x, fmt), *quantize_along(x, -1, Fp8Format(fmt)))
    assert_same(*tq.quantize_tensorwise_triton(x, fmt), *quantize_tensorwise(x, Fp8Format(fmt)))
    q_row, s_row, q_col, s_col = tq.quantize_dual_axis_triton(x, fmt)
    assert_same(q_col, s_col, *quantize_along(x, -2, Fp8Format(fmt)))
    assert_same(q_row, s_row, *quantize_along(x, -1, Fp8Format(fmt)))


@pytest.mark.cuda
@pytest.mark.parametrize("op, make_args", OPS)
def test_cuda_opcheck(op, make_args):
    torch.library.opcheck(op, make_args(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)))
