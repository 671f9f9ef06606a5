"""On an FP8 GPU: loka's Triton GEMMs are built while their graph compiles (`kernel_builds`),
so the graph's first call compiles none of them."""

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile import kernel_builds
from loka_compile.kernels import triton_gemm as tg
from numerics import sqnr_db

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_compile_state")]

# bf16 activations, rowwise e4m3 GEMMs against the fp32 model (as test_cuda_end_to_end's floor).
OUTPUT_SQNR_FLOOR_DB = 17.0


def _compiled_kernels() -> int:
    """Kernels Triton holds for loka's two GEMM kernels, over devices."""
    return sum(len(caches[0]) for fn in (tg._fp8_gemm_tma_kernel, tg._fp8_gemm_ptr_kernel)
               for caches in fn.device_caches.values())


@pytest.mark.parametrize("batch", [1536, 96])  # a bucket of its own, so no earlier test tuned its keys
def test_the_first_call_after_the_compile_compiles_no_loka_gemm(batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(320, 704), nn.ReLU(), nn.Linear(704, 208)).cuda().bfloat16()
    x = torch.randn(batch, 320, device="cuda", dtype=torch.bfloat16)
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        compiled = loka_compile.loka_backend(gm, [x], options={
            "probe_steps": 0, "speed_check": False, "providers": ["triton"], "graph_speed_check": "off"})
        built = kernel_builds.wait(timeout=300)
        before = _compiled_kernels()
        out = compiled(x)
        torch.cuda.synchronize()
    assert built > 0
    assert _compiled_kernels() == before, "the first call compiled a loka GEMM kernel"
    sites = loka_compile.report(compiled).sites
    assert sites and all(s.fp8 and s.provider == "triton" for s in sites), [(s.id, s.reason) for s in sites]
    assert sqnr_db(model.float()(x.float()), out.float()) > OUTPUT_SQNR_FLOOR_DB
