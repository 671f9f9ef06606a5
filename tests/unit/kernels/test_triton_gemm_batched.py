"""Batched Triton FP8 GEMM (bmm/baddbmm sites): `kernels/triton_gemm.py`'s pointer kernel on
[B, M, K] @ [B, K, N], against its fp64 reference and the emulated provider.

Floors (the 2-D kernel tests' own, `test_triton_gemm.py`):
- fp32 output, per-step fp32 accumulation: SQNR >= 60 dB against `reference_fp8_gemm` in
  fp64 and against the emulated provider (fp32 matmul of the same dequantized operands);
- bf16 output: >= 40 dB (bf16 rounding alone sits near 50 dB).
A wrong batch stride, scale or bias offset lands far below 10 dB. Each matrix of the batch
is also checked bit for bit against the 2-D kernel on that matrix.

Operands come from the lowering's own casts (`scaled_gemm.cast_operand`): A row-major, B
column-major per matrix; one tensorwise scale for the whole batch, rowwise scales [B, M, 1]
and [B, 1, N]. Blockwise operands (which no cast makes for 3-D, so no provider is offered
batched blockwise) are stacked from 2-D blockwise casts, to test the kernel's scale strides.
On CPU the kernels run under the Triton interpreter at small shapes.
"""

import copy

import pytest
import torch

from loka_compile.kernels import providers
from loka_compile.kernels import triton_gemm as tg
from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_blockwise
from loka_compile.kernels.scaled_gemm import GemmSpec, quantize_operand_aten, scaled_gemm
from tests.numerics import sqnr_db

E4M3 = Fp8Format.E4M3
FP32_FLOOR_DB = 60.0
BF16_FLOOR_DB = 40.0

interpreter = pytest.mark.interpreter

# (B, M, K, N): the brief's shape (two 32-wide K steps), and one where no dim is a
# multiple of the interpreter's 32-wide tiles (masked K step, edge tiles in M and N).
SHAPES = [(3, 33, 64, 48), (2, 19, 72, 40)]


def batched_values(batch, m, k, n):
    """High-precision A [B, M, K] and B [B, K, N] with magnitudes spread over 2^-4..2^4 by
    batch, row and column, so that each scale (and each batch's) matters."""
    a = torch.randn(batch, m, k) * 2.0 ** torch.randint(-4, 5, (batch, m, 1))
    b = torch.randn(batch, k, n) * 2.0 ** torch.randint(-4, 5, (batch, 1, n))
    return a, b


def batched_operands(batch, m, k, n, scaling):
    """(a_q, a_s, b_q, b_s): for tensorwise and rowwise the lowering's casts of 3-D
    operands; for blockwise the 2-D casts of each matrix stacked (B column-major)."""
    a, b = batched_values(batch, m, k, n)
    if scaling is not Scaling.BLOCKWISE:
        return (*quantize_operand_aten(a, "a", scaling, E4M3), *quantize_operand_aten(b, "b", scaling, E4M3))
    a_parts = [quantize_blockwise(x, 1, 128, E4M3) for x in a]
    b_parts = [quantize_blockwise(x.t(), 128, 128, E4M3) for x in b]  # B^T's 128x128 tiles
    a_q, a_s = torch.stack([q for q, _ in a_parts]), torch.stack([s for _, s in a_parts])
    b_q = torch.stack([q for q, _ in b_parts]).transpose(1, 2)
    b_s = torch.stack([s for _, s in b_parts]).transpose(1, 2)
    return a_q, a_s, b_q, b_s


@interpreter
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("scaling", list(Scaling))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_batched_kernel_matches_reference(shape, scaling, with_bias):
    batch, m, k, n = shape
    a_q, a_s, b_q, b_s = batched_operands(batch, m, k, n, scaling)
    assert b_q.stride(-2) == 1, "B must be column-major per matrix, as the lowering casts it"
    bias = torch.randn(n) if with_bias else None
    assert tg.infer_scaling(a_q, a_s, b_q, b_s) is scaling
    out = tg.fp8_gemm(a_q, a_s, b_q, b_s, scaling, bias=bias, out_dtype=torch.float32, impl="pointer")
    ref = tg.reference_fp8_gemm(a_q, a_s, b_q, b_s, scaling, bias=bias, out_dtype=torch.float64)
    assert out.shape == (batch, m, n) and torch.isfinite(out).all()
    assert sqnr_db(ref, out) >= FP32_FLOOR_DB
    if scaling is not Scaling.BLOCKWISE:  # the emulated provider takes batched tensorwise and rowwise
        emulated = providers.get("emulated").gemm(a_q, a_s, b_q, b_s, scaling, bias, torch.float32)
        assert sqnr_db(emulated.double(), out) >= FP32_FLOOR_DB


@interpreter
@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
def test_each_matrix_equals_the_2d_kernel(scaling):
    batch, m, k, n = SHAPES[1]
    a_q, a_s, b_q, b_s = batched_operands(batch, m, k, n, scaling)
    out = tg.fp8_gemm(a_q, a_s, b_q, b_s, scaling, out_dtype=torch.float32)
    for i in range(batch):
        scales = (a_s, b_s) if scaling is Scaling.TENSORWISE else (a_s[i], b_s[i])
        assert torch.equal(out[i], tg.fp8_gemm(a_q[i], scales[0], b_q[i], scales[1], scaling,
                                               out_dtype=torch.float32))


@interpreter
@pytest.mark.parametrize("bias_shape", [(48,), (1, 48), (3, 1, 48), (33, 48), (3, 33, 48)],
                         ids=lambda s: "x".join(map(str, s)))
def test_bias_broadcasts_as_baddbmm(bias_shape):
    # Shapes varying along M take the epilogue's per-row bias load (BIAS_ROWS).
    a_q, a_s, b_q, b_s = batched_operands(3, 33, 64, 48, Scaling.ROWWISE)
    bias = torch.randn(bias_shape, dtype=torch.bfloat16)
    out = tg.fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", bias=bias)
    ref = tg.reference_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", bias=bias, out_dtype=torch.float64)
    assert out.dtype == torch.bfloat16 and sqnr_db(ref, out) >= BF16_FLOOR_DB


@interpreter
def test_residual_and_activation_per_batch():
    a_q, a_s, b_q, b_s = batched_operands(3, 33, 64, 48, Scaling.TENSORWISE)
    bias, residual = torch.randn(48), torch.randn(3, 33, 48)
    kw = dict(bias=bias, residual=residual, activation="relu")
    out = tg.fp8_gemm(a_q, a_s, b_q, b_s, "tensorwise", out_dtype=torch.float32, **kw)
    ref = tg.reference_fp8_gemm(a_q, a_s, b_q, b_s, "tensorwise", out_dtype=torch.float64, **kw)
    assert sqnr_db(ref, out) >= FP32_FLOOR_DB


@interpreter
def test_op_and_fake_impl_give_the_batched_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a_q, a_s, b_q, b_s = batched_operands(2, 16, 32, 16, Scaling.ROWWISE)
    bias = torch.randn(16, dtype=torch.bfloat16)
    out = torch.ops.loka.triton_fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", bias)
    assert out.shape == (2, 16, 16) and out.dtype == torch.bfloat16
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) for t in (a_q, a_s, b_q, b_s, bias)]
        fake = torch.ops.loka.triton_fp8_gemm(*fakes[:4], "rowwise", fakes[4], out_dtype=torch.float32)
    assert fake.shape == (2, 16, 16) and fake.dtype == torch.float32


@pytest.mark.parametrize("case, message", [
    ("batch_mismatch", "batch sizes differ"),
    ("2d_with_3d", "2-D or both 3-D"),
    ("4d", "must be 2-D, or 3-D"),
    ("2d_scale_for_3d", "rowwise scaling of A"),
    ("bias_does_not_broadcast", "broadcasts to the output"),
    ("tma", "the TMA kernel is 2-D"),
])
def test_bad_batched_input_raises_value_error(case, message):
    a_q, a_s, b_q, b_s = batched_operands(2, 16, 32, 16, Scaling.ROWWISE)
    bias, impl = None, "pointer"
    if case == "batch_mismatch":
        b_q, b_s = torch.cat([b_q, b_q]), torch.cat([b_s, b_s])
    elif case == "2d_with_3d":
        b_q, b_s = b_q[0], b_s[0]
    elif case == "4d":
        a_q, b_q = a_q[None], b_q[None]
    elif case == "2d_scale_for_3d":
        a_s = a_s[0]
    elif case == "bias_does_not_broadcast":
        bias = torch.randn(3, 16, 16)
    else:
        impl = "tma"
    with pytest.raises(ValueError, match=message):
        tg.fp8_gemm(a_q, a_s, b_q, b_s, "rowwise", bias=bias, impl=impl)
    if case != "tma":  # the op's fake runs the same checks
        with pytest.raises(ValueError, match=message):
            tg._triton_fp8_gemm_fake(a_q, a_s, b_q, b_s, "rowwise", bias, impl=impl)


def test_providers_declare_batched_tensorwise_and_rowwise_only():
    for name in ("triton", "emulated"):
        provider = providers.get(name)
        for scaling in Scaling:
            request = providers.GemmRequest(torch.device("cpu"), scaling, E4M3, E4M3, torch.bfloat16, True)
            batched_ok = provider.batched and scaling in provider.batched_scalings
            assert batched_ok == (scaling is not Scaling.BLOCKWISE)
            if name == "emulated":
                assert provider.supports(request) == batched_ok
    with pytest.raises(ValueError, match="batched_scalings"):
        providers.GemmProvider(name="bad", scalings=frozenset({Scaling.ROWWISE}), batched=True, emulated=True,
                               available=lambda d: True, gemm=lambda *a: None,
                               batched_scalings=frozenset({Scaling.BLOCKWISE}))


@interpreter
@pytest.mark.parametrize("scaling", [Scaling.TENSORWISE, Scaling.ROWWISE])
def test_lowered_baddbmm_on_the_triton_provider_matches_emulation(scaling):
    """What the lower pass traces for a baddbmm site (`scaled_gemm` on the 3-D operands,
    the cast inside), on the triton provider and on the emulated one."""
    a, b = batched_values(3, 33, 64, 48)
    b = b.transpose(1, 2).contiguous().transpose(1, 2)  # a weight-like column-major B
    bias = torch.randn(3, 1, 48)

    def run(provider):
        return scaled_gemm(a, b, bias, GemmSpec(scaling, E4M3, E4M3, provider, torch.float32))

    out, emulated = run("triton"), run("emulated")
    assert out.shape == (3, 33, 48)
    assert sqnr_db(emulated.double(), out) >= FP32_FLOOR_DB
    assert sqnr_db(torch.baddbmm(bias.double(), a.double(), b.double()), out) > 25.0  # FP8 e4m3 itself


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("b_major", ["row", "column"])
def test_speed_check_times_batched_sites_on_the_lowerings_operands(scaling, b_major):
    """The speed check casts a batched site's operands as 2-D stacks ([B*M, K], [K, B*N]);
    viewed batched, they are bit for bit the lowering's 3-D casts."""
    from loka_compile import speed

    shape = speed.SiteShape(16, 32, 48, "row", b_major, True, torch.float32, torch.device("cpu"), batch=3)
    a, b, _, _, _ = speed._site_operands(shape)
    a3, b3 = speed._batched(a, "a", 3), speed._batched(b, "b", 3)
    assert a3.shape == (3, 16, 32) and b3.shape == (3, 32, 48)
    assert (b3.stride(-2) == 1) == (b_major == "column")
    for operand, stack, x in (("a", a, a3), ("b", b, b3)):
        q, s = (speed._batched(t, operand, 3) for t in torch.ops.loka.quantize_operand(stack, operand, scaling,
                                                                                        "e4m3"))
        q_ref, s_ref = quantize_operand_aten(x, operand, Scaling(scaling), E4M3)
        assert q.shape == q_ref.shape and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(s, s_ref)
    timing = speed.site_timing(shape, scaling, "e4m3", "e4m3", ("emulated",))
    assert timing.provider == "emulated" and timing.bf16_us > 0 and timing.fp8_us > timing.cast_us > 0


class Interaction(torch.nn.Module):
    """A projection, then the pairwise interaction of its features: bmm(y, y^T)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):  # [batch, 32 features, 64]
        y = self.proj(x)
        return torch.bmm(y, y.transpose(1, 2)).flatten(1)


@interpreter
@pytest.mark.usefixtures("fresh_compile_state")
def test_compiled_bmm_lowers_to_the_triton_op_under_the_interpreter(monkeypatch):
    """Dispatch and lowering of a bmm site onto the triton provider, on CPU: FP8 hardware
    stood in for, the provider made available under the interpreter."""
    import dataclasses

    import loka_compile
    from loka_compile import dispatch

    monkeypatch.setattr(dispatch.providers, "has_fp8_hardware", lambda device: True)
    monkeypatch.setitem(providers._REGISTRY, "triton",
                        dataclasses.replace(providers.get("triton"), available=lambda device: True))
    model = Interaction().eval()
    x = torch.randn(4, 32, 64)
    compiled = torch.compile(model, backend="loka", options={"speed_check": False, "probe_steps": 0})
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert sqnr_db(ref.double(), out) > 20.0  # test_end_to_end's output floor (e4m3, two FP8 GEMMs)
    report = loka_compile.report(compiled)
    bmm = [s for s in report.sites if s.op == "bmm"]
    assert len(bmm) == 1 and bmm[0].fp8 and bmm[0].provider == "triton", str(report)


# ---------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_compile_state")
def test_compiled_interaction_bmm_runs_on_the_triton_provider():
    """A 3-D interaction layer (x @ x^T over features) compiled with backend="loka": its
    forward bmm goes FP8 on the triton provider, the only one serving batched sites."""
    import loka_compile

    model = Interaction().cuda().bfloat16().eval()
    x = torch.randn(256, 32, 64, device="cuda", dtype=torch.bfloat16)
    # No probe window: every eligible site goes FP8 at the first compile (speed check off).
    compiled = torch.compile(model, backend="loka", options={"speed_check": False, "probe_steps": 0})
    with torch.no_grad():
        out = compiled(x)
        ref = copy.deepcopy(model).float()(x.float())
    assert sqnr_db(ref, out.float()) > 17.0  # test_cuda_end_to_end's bf16 output floor
    report = loka_compile.report(compiled)
    bmm = [s for s in report.sites if s.op == "bmm"]
    assert bmm and all(s.fp8 and s.provider == "triton" for s in bmm), str(report)
