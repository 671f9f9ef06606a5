"""Fused norm + FP8 quant kernels: forward against fp64 references, the FP8 output bit
for bit against the reference rowwise cast of the kernel's own high-precision output,
backward against autograd of the reference. CPU: Triton interpreter; `-m cuda`: real
shapes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.runtime.interpreter  # noqa: E402

from loka_compile.kernels import triton_norm_quant as nq  # noqa: E402
from loka_compile.kernels.quantize import Fp8Format, quantize_along  # noqa: E402
from tests.numerics import rel_error  # noqa: E402

if not torch.cuda.is_available() and not isinstance(nq._norm_fwd_kernel, triton.runtime.interpreter.InterpretedFunction):
    pytest.skip("loka's Triton kernels were imported before TRITON_INTERPRET=1 was set; "
                "run with TRITON_INTERPRET=1 in the environment", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# Forward outputs in x's dtype against an fp64 reference: one bf16 rounding plus fp32
# arithmetic, so within 2^-8 relative (one bf16 ulp) and a small absolute floor; fp32
# outputs within 1e-5. Backward: relative Frobenius error of each gradient.
FWD_TOL = {torch.bfloat16: dict(rtol=2 ** -8, atol=2 ** -8), torch.float32: dict(rtol=1e-5, atol=1e-5)}
BWD_REL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _inputs(shape, dtype, affine):
    x = (torch.randn(shape, device=DEVICE) * 3 + 0.5).to(dtype)
    n = shape[-1]
    w = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype) if affine else None
    b = (0.1 * torch.randn(n, device=DEVICE)).to(dtype) if affine else None
    return x, w, b


def _assert_fp8_is_reference_cast(y, q, scale, fmt, p2=False):
    q_ref, s_ref = quantize_along(y, -1, Fp8Format(fmt), p2)
    torch.testing.assert_close(scale, s_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


CASES = [((13, 96), torch.bfloat16, True), ((67, 272), torch.bfloat16, False),
         ((2, 33, 256), torch.float32, True), ((16, 512), torch.bfloat16, True)]


@pytest.mark.parametrize("shape, dtype, affine", CASES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_layer_norm_quant_forward(shape, dtype, affine, fmt):
    x, w, b = _inputs(shape, dtype, affine)
    y, q, s, mean, rstd = nq.norm_quant_forward(x, w, b, EPS, fmt, False, rms=False, write_y=True, write_q=True)
    y_ref, mean_ref, rstd_ref = nq.layer_norm_reference(x.double(), None if w is None else w.double(),
                                                        None if b is None else b.double(), EPS)
    torch.testing.assert_close(y.double(), y_ref, **FWD_TOL[dtype])
    torch.testing.assert_close(mean.double(), mean_ref.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), rstd_ref.double(), rtol=1e-5, atol=1e-6)
    assert s.shape == mean.shape == x.shape[:-1] + (1,)
    _assert_fp8_is_reference_cast(y, q, s, fmt)
    _, q_only, s_only, _, _ = nq.norm_quant_forward(x, w, b, EPS, fmt, False, rms=False, write_y=False, write_q=True)
    assert torch.equal(q_only.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_only, s)


@pytest.mark.parametrize("shape, dtype, affine", CASES)
def test_rms_norm_quant_forward(shape, dtype, affine):
    x, w, _ = _inputs(shape, dtype, affine)
    y, q, s, _, rstd = nq.norm_quant_forward(x, w, None, EPS, "e4m3", True, rms=True, write_y=True, write_q=True)
    y_ref, rstd_ref = nq.rms_norm_reference(x.double(), None if w is None else w.double(), EPS)
    torch.testing.assert_close(y.double(), y_ref, **FWD_TOL[dtype])
    torch.testing.assert_close(rstd.double(), rstd_ref.double(), rtol=1e-5, atol=1e-6)
    _assert_fp8_is_reference_cast(y, q, s, "e4m3", True)


@pytest.mark.parametrize("shape, dtype, affine", CASES)
def test_norm_backward(shape, dtype, affine):
    x, w, b = _inputs(shape, dtype, affine)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    _, _, _, mean, rstd = nq.norm_quant_forward(x, w, b, EPS, "e4m3", False, rms=False, write_y=False, write_q=True)
    dx, dw, db = nq.norm_backward(dy, x, w, mean, rstd, rms=False)
    ref = nq.layer_norm_backward_reference(dy.double(), x.double(), w if w is None else w.double(),
                                           b if b is None else b.double(), EPS)
    assert rel_error(ref[0], dx) < BWD_REL[dtype]
    if affine:
        assert rel_error(ref[1], dw) < BWD_REL[dtype] and rel_error(ref[2], db) < BWD_REL[dtype]
    _, _, _, _, rstd = nq.norm_quant_forward(x, w, None, EPS, "e4m3", False, rms=True, write_y=False, write_q=True)
    dx, dw, _ = nq.norm_backward(dy, x, w, None, rstd, rms=True)
    ref = nq.rms_norm_backward_reference(dy.double(), x.double(), w if w is None else w.double(), EPS)
    assert rel_error(ref[0], dx) < BWD_REL[dtype]
    if affine:
        assert rel_error(ref[1], dw) < BWD_REL[dtype]


def test_layer_norm_quant_autograd_matches_reference():
    x, w, b = _inputs((4, 5, 96), torch.float32, True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y, q, s, _, _ = torch.ops.loka.layer_norm_quant(*leaves, EPS, "e4m3")
    g = torch.randn_like(y)
    (y * g).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b)]
    y_ref = torch.nn.functional.layer_norm(ref_leaves[0], (96,), ref_leaves[1], ref_leaves[2], EPS)
    (y_ref * g.double()).sum().backward()
    for mine, ref in zip(leaves, ref_leaves):
        assert rel_error(ref.grad, mine.grad) < 1e-5


def test_rms_norm_quant_autograd_matches_reference():
    x, w, _ = _inputs((13, 96), torch.float32, True)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, *_ = torch.ops.loka.rms_norm_quant(xl, wl, EPS, "e4m3")
    g = torch.randn_like(y)
    (y * g).sum().backward()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ((xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS) * wr) * g.double()).sum().backward()
    assert rel_error(xr.grad, xl.grad) < 1e-5 and rel_error(wr.grad, wl.grad) < 1e-5


@pytest.mark.parametrize("shape, dtype", [((13, 256), torch.bfloat16), ((67, 768), torch.float32)])
def test_block_norm_forward_backward(shape, dtype):
    x = (torch.randn(shape, device=DEVICE) * torch.linspace(0.1, 10, shape[-1], device=DEVICE)).to(dtype)
    y, q, s, rstd = nq.block_norm_forward(x, 1e-6, "e4m3", False, write_q=True)
    y_ref, rstd_ref = nq.block_norm_reference(x.double(), 1e-6)
    torch.testing.assert_close(y.double(), y_ref, **FWD_TOL[dtype])
    torch.testing.assert_close(rstd.double(), rstd_ref.double(), rtol=1e-5, atol=1e-6)
    assert rstd.shape == (shape[0], shape[1] // 256)
    _assert_fp8_is_reference_cast(y, q, s, "e4m3")
    y2, rstd2 = torch.ops.loka.block_norm(x, 1e-6)
    assert torch.equal(y2, y) and torch.equal(rstd2, rstd)
    dy = torch.randn(shape, device=DEVICE).to(dtype)
    dx = nq.block_norm_backward_launch(dy, x, rstd)
    assert rel_error(nq.block_norm_backward_reference(dy.double(), x.double(), 1e-6), dx) < BWD_REL[dtype]
    xl = x.clone().requires_grad_()
    y3, *_ = torch.ops.loka.block_norm_quant(xl, 1e-6, "e5m2")
    (y3.float() * dy.float()).sum().backward()
    assert torch.equal(xl.grad, dx)


def test_non_finite_rows_get_nan_scale():
    x, w, b = _inputs((13, 96), torch.bfloat16, True)
    x[2, 5] = float("nan")
    x[7, 0] = float("inf")
    _, q, s, _, _ = nq.norm_quant_forward(x, w, b, EPS, "e4m3", False, rms=False, write_y=False, write_q=True)
    assert s[[2, 7]].isnan().all() and s[[0, 1, 3, 4, 5, 6, 8]].isfinite().all()
    assert (q[[2, 7]].view(torch.uint8) == 0x7F).all()


def test_bad_inputs_raise():
    x, w, b = _inputs((16, 96), torch.bfloat16, True)
    with pytest.raises(ValueError, match="multiple of 256"):
        nq.block_norm_forward(x, 1e-6, "e4m3", False, write_q=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        torch.ops.loka.block_norm(x, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        nq.norm_quant_forward(x.t(), None, None, EPS, "e4m3", False, rms=False, write_y=True, write_q=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        nq.norm_quant_forward(x, w[:10], b, EPS, "e4m3", False, rms=False, write_y=True, write_q=True)
    with pytest.raises(ValueError, match="MAX_NORM_WIDTH"):
        nq.norm_quant_forward(torch.zeros(1, nq.MAX_NORM_WIDTH * 2, device=DEVICE), None, None, EPS, "e4m3",
                              False, rms=False, write_y=True, write_q=True)
    with pytest.raises(ValueError, match="unknown fp8 format"):
        nq.norm_quant_forward(x, w, b, EPS, "fp8", False, rms=False, write_y=True, write_q=True)


def _op_cases(device, shape):
    x, w, b = _inputs(shape, torch.bfloat16, True)
    x, w, b = x.to(device), w.to(device), b.to(device)
    xg = x.float().requires_grad_()
    wg, bg = w.float().requires_grad_(), b.float().requires_grad_()
    n = shape[-1]
    mean = x.float().mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.float().var(-1, unbiased=False, keepdim=True) + EPS)
    xb = torch.randn(shape[0], 256, device=device, dtype=torch.bfloat16)
    return [
        (torch.ops.loka.layer_norm_quant, (xg, wg, bg, EPS, "e4m3", False)),
        (torch.ops.loka.layer_norm_quant_only, (x, w, b, EPS, "e5m2", True)),
        (torch.ops.loka.layer_norm_backward, (torch.randn_like(x), x, w, mean, rstd)),
        (torch.ops.loka.rms_norm_quant, (xg, wg, EPS, "e4m3", False)),
        (torch.ops.loka.rms_norm_quant_only, (x, None, EPS, "e4m3", False)),
        (torch.ops.loka.rms_norm_backward, (torch.randn_like(x), x, w, rstd)),
        (torch.ops.loka.block_norm, (xb.float().requires_grad_(), 1e-6)),
        (torch.ops.loka.block_norm_quant, (xb.float().requires_grad_(), 1e-6, "e4m3", False)),
        (torch.ops.loka.block_norm_backward, (torch.randn_like(xb), xb,
                                              torch.rand(shape[0], 1, device=device) + 0.5)),
    ]


def _opcheck(op, args):
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # opcheck's AOT test sums every floating output to backpropagate, and fp8 has no
        # sum kernel: with grad inputs, check schema/autograd/fake; without, everything.
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("index", range(9))
def test_opcheck(index):
    _opcheck(*_op_cases(DEVICE, (13, 96))[index])


# ---- real shapes, compiled kernels ----------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32768, 2048), (8192, 512), (2048, 4096), (1000, 1000)])
def test_cuda_norm_quant(shape):
    x, w, b = _inputs(shape, torch.bfloat16, True)
    y, q, s, mean, rstd = nq.norm_quant_forward(x, w, b, EPS, "e4m3", False, rms=False, write_y=True, write_q=True)
    y_ref, _, _ = nq.layer_norm_reference(x.double(), w.double(), b.double(), EPS)
    torch.testing.assert_close(y.double(), y_ref, **FWD_TOL[torch.bfloat16])
    _assert_fp8_is_reference_cast(y, q, s, "e4m3")
    _, q2, s2, _, _ = nq.norm_quant_forward(x, w, b, EPS, "e4m3", False, rms=False, write_y=False, write_q=True)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    dy = torch.randn_like(x)
    dx, dw, db = nq.norm_backward(dy, x, w, mean, rstd, rms=False)
    ref = nq.layer_norm_backward_reference(dy, x, w, b, EPS)
    assert rel_error(ref[0], dx) < 1e-2 and rel_error(ref[1], dw) < 1e-2 and rel_error(ref[2], db) < 1e-2
    y, q, s, _, rstd = nq.norm_quant_forward(x, w, None, EPS, "e5m2", True, rms=True, write_y=True, write_q=True)
    torch.testing.assert_close(y.double(), nq.rms_norm_reference(x.double(), w.double(), EPS)[0],
                               **FWD_TOL[torch.bfloat16])
    _assert_fp8_is_reference_cast(y, q, s, "e5m2", True)
    if shape[1] % 256 == 0:
        y, q, s, rstd = nq.block_norm_forward(x, 1e-6, "e4m3", False, write_q=True)
        torch.testing.assert_close(y.double(), nq.block_norm_reference(x.double(), 1e-6)[0],
                                   **FWD_TOL[torch.bfloat16])
        _assert_fp8_is_reference_cast(y, q, s, "e4m3")
        dx = nq.block_norm_backward_launch(dy, x, rstd)
        assert rel_error(nq.block_norm_backward_reference(dy, x, 1e-6), dx) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("index", range(9))
def test_cuda_opcheck(index):
    _opcheck(*_op_cases("cuda", (2048, 1024))[index])
