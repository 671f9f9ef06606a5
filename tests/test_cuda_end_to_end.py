"""The end-to-end checks on an FP8 GPU: real FP8 kernels through torch._scaled_mm."""

import copy

import pytest
import torch

import loka_compile
from models import MLPWithNorm, WukongLikeBlock
from numerics import sqnr_db

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_compile_state")]

# bf16 models on the GPU: the reference is the fp32 copy. Floors as on CPU, less 3 dB for
# bf16 activations between the GEMMs.
OUTPUT_SQNR_FLOOR_DB = 17.0
GRAD_SQNR_FLOOR_DB = 7.0




def check_training_step(model, x, recipe, mode="default"):
    reference = copy.deepcopy(model).float()
    # Every eligible site in FP8 (speed check off): these tests are about FP8 numerics.
    compiled = torch.compile(model, backend="loka", options={"recipe": recipe, "mode": mode, "speed_check": False})
    for _ in range(3):  # CUDA graphs record on a later call
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.float().square().mean().backward()
    ref = reference(x.float())
    ref.square().mean().backward()
    assert sqnr_db(ref, out.float()) > OUTPUT_SQNR_FLOOR_DB
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        assert sqnr_db(p_ref.grad, p.grad.float()) > GRAD_SQNR_FLOOR_DB
    return loka_compile.report(compiled)


@pytest.mark.parametrize("recipe, provider", [("rowwise", "scaled_mm_rowwise"),
                                              ("tensorwise", "scaled_mm_tensorwise")])
def test_mlp_training_on_scaled_mm(recipe, provider):
    model = MLPWithNorm(d_in=256, hidden=512, d_out=64).cuda().bfloat16()
    report = check_training_step(model, torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16), recipe)
    assert len(report.sites) == 8 and all(s.fp8 and s.provider == provider for s in report.sites)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_modes(mode):
    model = MLPWithNorm(d_in=256, hidden=512, d_out=64).cuda().bfloat16()
    report = check_training_step(model, torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16),
                                 "rowwise", mode)
    assert all(s.fp8 for s in report.sites)


def test_wukong_like_training_step_on_scaled_mm():
    model = WukongLikeBlock(n_features=32, dim=64, n_lcb=16, hidden=512).cuda().bfloat16()
    x = torch.randn(2048, 32, 64, device="cuda", dtype=torch.bfloat16)
    report = check_training_step(model, x, "rowwise")
    print("\n" + str(report))
    eligible = [s for s in report.sites if s.op in ("mm", "addmm") and s.reason not in
                ("too_small", "k_not_multiple_of_16", "n_not_multiple_of_16")]
    assert eligible and all(s.fp8 and s.provider == "scaled_mm_rowwise" for s in eligible)
    bmm = [s for s in report.sites if s.op == "bmm"]
    assert bmm and all(s.reason in ("no_provider", "too_small", "k_not_multiple_of_16", "n_not_multiple_of_16")
                       for s in bmm)


def test_inference_and_dynamic_batch_on_gpu():
    model = MLPWithNorm(d_in=256, hidden=512, d_out=64).cuda().bfloat16().eval()
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"speed_check": False})
    with torch.no_grad():
        for batch in (256, 384, 1024):
            x = torch.randn(batch, 256, device="cuda", dtype=torch.bfloat16)
            assert sqnr_db(model(x).float(), compiled(x).float()) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    # On the H100 Dynamo first compiled batch 256 statically, then one graph symbolic in M
    # (g1 256x256x512, g2 s77x256x512): at most two graphs, the last one symbolic.
    assert 1 <= len(report.graphs) <= 2, str(report)
    assert all(s.fp8 and s.provider == "scaled_mm_rowwise" for s in report.sites), str(report)
    last_graph = report.graphs[-1].name
    assert all(isinstance(s.shape[0], str) for s in report.sites if s.graph == last_graph), str(report)


def test_speed_check_keeps_sites_where_fp8_does_not_pay_in_bf16():
    # In CUDA graphs on the H100: 8192x4096x4096 FP8 with its casts 1.17x bf16; 8192x4096x64
    # 0.44x (the casts of A alone cost more than the bf16 GEMM). Without CUDA graphs both
    # lose: fp8_gemm costs about 250 us of host time per call (Triton launches + custom op).
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 64))
    model = model.cuda().bfloat16().eval()
    compiled = torch.compile(model, backend="loka", mode="reduce-overhead")
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = compiled(x)
        assert sqnr_db(model(x).float(), out.float()) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    big, small = sorted(report.sites, key=lambda s: -s.shape[2])
    assert big.fp8 and big.reason == "fp8" and big.bf16_us / big.fp8_us >= 1.05, str(report)
    assert not small.fp8 and small.reason == "slower_than_bf16" and small.fp8_us > small.bf16_us, str(report)
    assert "slower_than_bf16" in str(report)
