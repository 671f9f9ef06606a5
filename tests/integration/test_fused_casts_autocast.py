"""The fused_casts Mod on and off give the same FP8 bits under autocast: a cast written as ATen
ops and fused into the kernel that produced its operand casts the operand's stored bf16 value,
as the opaque cast (the Mod off) and eager autocast do, not the producer's unrounded fp32
(`kernels/quantize.as_stored`). On CPU the FP8 GEMM is emulated; on an FP8 GPU (`cuda`) the Mod
off casts with loka's Triton kernels, on with Inductor's generated ones, and the GEMM is
`torch._scaled_mm`."""

import copy

import pytest
import torch
from torch import nn

import loka_compile
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

FP8_EVERYWHERE = {"recipe": "rowwise", "min_gemm_dim": 1, "probe_steps": 0, "graph_speed_check": "off",
                  "speed_check": False, "fallback": False}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Emulated rowwise e4m3 through two GEMMs against eager autocast (~27 dB measured on this model).
OUTPUT_SQNR_FLOOR_DB = 20.0


class NormTower(nn.Module):
    """Each FP8 operand made by a kernel Inductor generates: the input's autocast cast, the
    LayerNorm -> ReLU, and in the backward the ReLU's and LayerNorm's gradients."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _step(model, x, cotangent, disabled, training):
    torch._dynamo.reset()
    loka_compile.reset()
    model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options={**FP8_EVERYWHERE, "disabled_mods": disabled})
    with torch.autocast(x.device.type, dtype=torch.bfloat16), torch.set_grad_enabled(training):
        out = compiled(x)
    grads = {}
    if training:
        (out.float() * cotangent).sum().backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
    report = loka_compile.report(compiled)
    return out, grads, report


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_fused_and_opaque_casts_give_the_same_bits_under_autocast(training, device):
    model = (NormTower() if training else NormTower().eval()).to(device)
    x, cotangent = torch.randn(64, 32, device=device), torch.randn(64, 32, device=device)
    fused, fused_grads, report = _step(model, x, cotangent, [], training)
    opaque, opaque_grads, _ = _step(model, x, cotangent, ["fused_casts"], training)
    assert report.mods["fused_casts"] >= 1, report.table()
    assert all(site.fp8 for site in report.sites), report.table()
    assert fused.dtype == opaque.dtype == torch.bfloat16
    assert torch.equal(fused, opaque), f"{sqnr_db(opaque.float(), fused.float()):.1f} dB apart"
    for name, grad in fused_grads.items():
        assert torch.equal(grad, opaque_grads[name]), \
            f"{name}: {sqnr_db(opaque_grads[name].double(), grad.double()):.1f} dB apart"
    with torch.autocast(device, dtype=torch.bfloat16), torch.no_grad():
        eager = model(x)
    db = sqnr_db(eager.float(), fused.float())
    assert db >= OUTPUT_SQNR_FLOOR_DB, db

