"""LayerNorm backward kernels (`kernels/layer_norm_backward.py`) against autograd of
F.layer_norm in fp64. CPU: the Triton interpreter at small shapes; `-m cuda`: real shapes.

Floors, relative Frobenius error of each gradient against fp64 (`rel_error`):
- fp32 inputs: 1e-5 (fp32 arithmetic over rows of <= 512 and sums over <= 2k rows);
- bf16/fp16 inputs: dx is rounded to the input dtype once (2^-8 relative for bf16, 2^-11
  for fp16), so 1e-2 for bf16 and 2e-3 for fp16; dw and db are summed in fp32 and rounded
  once to the weight's dtype, so the same floors;
- rows of tiny variance (std 1e-3 around 10, fp32): x - mean cancels 4 digits, so dx is
  held to 2x ATen's own fp32 backward's error on the same saved statistics (and 1e-2).
NaN never passes: non-finite inputs must give NaN exactly where the fp64 reference has it.
"""

import pytest
import torch
import torch.nn.functional as F

from loka_compile.kernels import layer_norm_backward as lnb
from tests.numerics import rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Few rows per tile and few programs: each program steps through several tiles, the last partial.
LOOPING = dict(BLOCK_M=4, num_warps=4, programs_per_sm=1)
# One row per program and more programs than stage 2 sums per step: its loop runs twice.
MANY_PROGRAMS = dict(BLOCK_M=1, num_warps=4, programs_per_sm=40)


def _inputs(shape, dtype, w_dtype=None, dy_dtype=None, *, spread=3.0, offset=0.5):
    x = (torch.randn(shape, device=DEVICE) * spread + offset).to(dtype)
    n = shape[-1]
    w = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(w_dtype or dtype)
    b = (0.1 * torch.randn(n, device=DEVICE)).to(w_dtype or dtype)
    dy = torch.randn(shape, device=DEVICE).to(dy_dtype or dtype)
    return x, w, b, dy


def _statistics(x, w, b):
    """The forward's saved mean and rstd, as ATen computes them (fp32 on CUDA)."""
    _, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), [x.shape[-1]], w.float(), b.float(), EPS)
    return mean, rstd


def _fp64_grads(x, w, b, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(leaves[0], (x.shape[-1],), leaves[1], leaves[2], EPS)
    return torch.autograd.grad(y, leaves, dy.double())


def _config(n, **overrides):
    return {**lnb.backward_config(n), **overrides}


@pytest.mark.parametrize("shape, dtype", [((13, 96), torch.bfloat16), ((2, 33, 128), torch.bfloat16),
                                          ((67, 272), torch.float32), ((5, 7, 64), torch.float16),
                                          ((9, 512), torch.float32)])
@pytest.mark.parametrize("tiling", [None, LOOPING, MANY_PROGRAMS])
def test_backward_matches_fp64(shape, dtype, tiling):
    x, w, b, dy = _inputs(shape, dtype)
    mean, rstd = _statistics(x, w, b)
    config = None if tiling is None else _config(shape[-1], **tiling)
    dx, dw, db = lnb.layer_norm_backward_triton(dy, x, w, mean, rstd, config=config)
    ref = _fp64_grads(x, w, b, dy)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dw.dtype == db.dtype == w.dtype
    for mine, expected in zip((dx, dw, db), ref):
        assert rel_error(expected, mine) < FLOOR[dtype]


def test_mixed_dtypes_as_under_autocast():
    # autocast runs LayerNorm in fp32: dy fp32 while x is bf16; fp32 parameters.
    x, w, b, dy = _inputs((37, 128), torch.bfloat16, w_dtype=torch.float32, dy_dtype=torch.float32)
    mean, rstd = _statistics(x, w, b)
    dx, dw, db = lnb.layer_norm_backward_triton(dy, x, w, mean, rstd, config=_config(128, **LOOPING))
    ref = _fp64_grads(x, w, b, dy)
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
    assert rel_error(ref[0], dx) < FLOOR[torch.bfloat16]
    assert rel_error(ref[1], dw) < 1e-5 and rel_error(ref[2], db) < 1e-5


def test_strided_inputs_and_low_precision_statistics():
    x, w, b, dy = _inputs((6, 20, 96), torch.float32)
    wide = torch.randn(6, 20, 160, device=DEVICE)
    wide[..., :96] = x
    x_view = wide[..., :96]                       # rows 160 apart: read in place
    dy_t = dy.transpose(0, 1).contiguous().transpose(0, 1)   # not viewable as rows: copied
    mean, rstd = _statistics(x, w, b)
    dx, dw, db = lnb.layer_norm_backward_triton(dy_t, x_view, w, mean.bfloat16(), rstd.bfloat16())
    ref_dx, ref_dw, ref_db = lnb.layer_norm_backward_reference(dy, x, w, mean.bfloat16(), rstd.bfloat16())
    assert dx.is_contiguous()
    for mine, expected in zip((dx, dw, db), (ref_dx, ref_dw, ref_db)):
        assert rel_error(expected, mine) < 1e-5


def test_rows_of_tiny_variance():
    x, w, b, dy = _inputs((64, 128), torch.float32, spread=1e-3, offset=10.0)
    x[::7] = 10.0 + 1e-6 * torch.randn(x[::7].shape, device=DEVICE)   # variance far below eps
    mean, rstd = _statistics(x, w, b)
    dx, dw, db = lnb.layer_norm_backward_triton(dy, x, w, mean, rstd, config=_config(128, **LOOPING))
    ref = _fp64_grads(x, w, b, dy)
    aten = torch.ops.aten.native_layer_norm_backward(dy, x, [128], mean, rstd, w, b, [True, True, True])
    for mine, theirs, expected in zip((dx, dw, db), aten, ref):
        assert torch.isfinite(mine).all()
        assert rel_error(expected, mine) <= max(2 * rel_error(expected, theirs), 1e-6)
        assert rel_error(expected, mine) < 1e-2


def test_non_finite_inputs_propagate():
    x, w, b, dy = _inputs((24, 96), torch.float32)
    x[3, 5] = float("nan")
    x[10, 0] = float("inf")
    dy[17, 40] = float("nan")
    mean, rstd = _statistics(x, w, b)
    dx, dw, db = lnb.layer_norm_backward_triton(dy, x, w, mean, rstd, config=_config(96, **LOOPING))
    ref = _fp64_grads(x, w, b, dy)
    for mine, expected in zip((dx, dw, db), ref):
        assert torch.equal(mine.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert finite.any() or expected.isnan().all()
        if finite.any():
            assert rel_error(expected[finite], mine[finite]) < 1e-5
    assert dx[[3, 10, 17]].isnan().all() and dw.isnan().all()
    assert db[40].isnan() and db.isnan().sum() == 1 and dx[[0, 1, 2, 23]].isfinite().all()


def test_no_rows():
    x, w, b, dy = _inputs((0, 64), torch.bfloat16)
    dx, dw, db = torch.ops.loka.layer_norm_backward(dy, x, w, x.new_empty(0, 1).float(), x.new_empty(0, 1).float())
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


def test_bad_arguments_raise():
    x, w, b, dy = _inputs((8, 64), torch.float32)
    mean, rstd = _statistics(x, w, b)
    with pytest.raises(ValueError, match="weight must have shape"):
        torch.ops.loka.layer_norm_backward(dy, x, w[:10], mean, rstd)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        torch.ops.loka.layer_norm_backward(dy[:4], x, w, mean, rstd)
    with pytest.raises(ValueError, match="one value per row"):
        torch.ops.loka.layer_norm_backward(dy, x, w, mean[:4], rstd)
    with pytest.raises(ValueError, match="MAX_WIDTH"):
        wide = torch.zeros(1, lnb.MAX_WIDTH * 2, device=DEVICE)
        lnb.layer_norm_backward_triton(wide, wide, wide[0], wide[:, :1], wide[:, :1])
    with pytest.raises(ValueError, match="must be float32, bfloat16, float16"):
        torch.ops.loka.layer_norm_backward(dy, x.int(), w, mean, rstd)


def test_reference_path_matches_kernels():
    """The op's reference (where Triton cannot run) and the kernels agree."""
    x, w, b, dy = _inputs((19, 160), torch.bfloat16, w_dtype=torch.float32)
    mean, rstd = _statistics(x, w, b)
    ref = lnb.layer_norm_backward_reference(dy, x, w, mean, rstd)
    mine = torch.ops.loka.layer_norm_backward(dy, x, w, mean, rstd)
    assert rel_error(ref[0], mine[0]) < FLOOR[torch.bfloat16]
    assert rel_error(ref[1], mine[1]) < 1e-5 and rel_error(ref[2], mine[2]) < 1e-5


def test_opcheck():
    x, w, b, dy = _inputs((13, 96), torch.bfloat16)
    mean, rstd = _statistics(x, w, b)
    torch.library.opcheck(torch.ops.loka.layer_norm_backward, (dy, x, w, mean, rstd))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_function_autograd(dtype, with_bias):
    x, w, b, dy = _inputs((3, 11, 96), dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = lnb.layer_norm(leaves[0], leaves[1], leaves[2] if with_bias else None, EPS)
    y_ref = F.layer_norm(x, (96,), w, b if with_bias else None, EPS)
    assert torch.equal(y, y_ref)
    y.backward(dy)
    ref = _fp64_grads(x, w, b, dy)
    for leaf, expected in zip(leaves, ref):
        if leaf is leaves[2] and not with_bias:
            assert leaf.grad is None
            continue
        assert rel_error(expected, leaf.grad) < FLOOR[dtype]


# ---- real shapes, compiled kernels ----------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(8192, 64, 128), (65536, 64), (4096, 33, 512), (1000, 7, 200)])
def test_cuda_backward(shape):
    x, w, b, dy = _inputs(shape, torch.bfloat16)
    mean, rstd = _statistics(x, w, b)
    dx, dw, db = lnb.layer_norm_backward_triton(dy, x, w, mean, rstd)
    ref = _fp64_grads(x, w, b, dy)
    for mine, expected in zip((dx, dw, db), ref):
        assert rel_error(expected, mine) < FLOOR[torch.bfloat16]
    torch.library.opcheck(torch.ops.loka.layer_norm_backward, (dy[:64], x[:64], w, mean[:64], rstd[:64]))
