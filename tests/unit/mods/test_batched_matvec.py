"""The batched_matvec Mod: a 2-D matrix times a batch of columns, `W @ x` with x [B, K, 1],
written as one GEMM over the batch. The Dynamo graph pass (each way of writing the product,
what it leaves alone, an excluded module), numerics of the rewritten graph, then compiled
under loka: inference (no_grad, where matmul itself makes B matrix-vector products) with
the product as one 2-D site, training with gradients as eager's, and deepctr-torch's DCN-Mix
built as the library builds it."""

import importlib.util
import operator

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile.passes.mods.batched_matvec import rewrite_batched_matvecs
from graphs import dynamo_graph, loka_and_eager_grads
from numerics import rel_error, sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

MATMULS = (torch.matmul, operator.matmul)

# The rewrite alone (fp32, CPU): the bmm and the GEMM differ by summation order only
# (1e-7 relative measured); floor with margin.
REL_ERROR = 1e-5
# Emulated rowwise e4m3 against fp32 eager: 30-40 dB measured on these models; the floor
# of the public-model suite (tests/integration/test_public_models.py).
PREDICTION_SQNR_DB = 20.0
GRAD_SQNR_DB = 10.0


class CrossExperts(nn.Module):
    """A low-rank cross layer written as deepctr-torch writes CrossNetMix: per expert, slices
    of stacked parameters, transposed, times the column x_l [B, K, 1]."""

    def __init__(self, form="matmul", k=48, rank=16, experts=2):
        super().__init__()
        self.form = form
        self.V = nn.Parameter(torch.randn(experts, k, rank) / k ** 0.5)
        self.U = nn.Parameter(torch.randn(experts, k, rank) / rank ** 0.5)

    def product(self, w, x):
        if self.form == "operator":
            return w @ x
        if self.form == "method":
            return w.matmul(x)
        return torch.matmul(w, x)

    def forward(self, inputs):
        x0 = inputs.unsqueeze(2)                                   # [B, K, 1]
        out = x0
        for e in range(self.V.shape[0]):
            v_x = torch.tanh(self.product(self.V[e].t(), x0))     # [B, rank, 1]
            out = out + x0 * self.product(self.U[e], v_x)         # [B, K, 1]
        return out.squeeze(2)


class NotColumns(nn.Module):
    """Products the Mod leaves alone: columns of width 2, a batched matrix, a 2-D column."""

    def __init__(self, k=16):
        super().__init__()
        self.W = nn.Parameter(torch.randn(k, k))
        self.batched = nn.Parameter(torch.randn(4, k, k))

    def forward(self, x):                                          # x [4, k, 2]
        wide = torch.matmul(self.W, x)                             # N = 2
        per_batch = torch.matmul(self.batched, x[..., :1])         # W has a batch
        flat = torch.matmul(self.W, x[0, :, :1])                   # a 2-D product, already an mm
        return wide.sum() + per_batch.sum() + flat.sum()


def _matmul_count(gm):
    return sum((n.op == "call_function" and n.target in MATMULS) or (n.op == "call_method" and n.target == "matmul")
               for n in gm.graph.nodes)


@pytest.mark.parametrize("form", ["matmul", "operator", "method"])
@pytest.mark.parametrize("grad", [False, True])
def test_rewrites_each_form_to_the_same_values(form, grad):
    torch.manual_seed(0)
    model = CrossExperts(form)
    x = torch.randn(8, 48)
    with torch.set_grad_enabled(grad):
        gm, inputs = dynamo_graph(model, x)
        expected = model(x)
        assert _matmul_count(gm) == 4
        result = rewrite_batched_matvecs(gm, inputs)
        got = gm(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert result.rewritten == 4 and not result.declined
    assert _matmul_count(gm) == 0
    assert sum(n.target is torch._C._nn.linear for n in gm.graph.nodes) == 4
    assert torch.isfinite(got).all()
    assert rel_error(expected.detach(), got.detach()) < REL_ERROR


def test_leaves_other_products_and_excluded_modules_alone():
    torch.manual_seed(0)
    gm, inputs = dynamo_graph(NotColumns(), torch.randn(4, 16, 2))
    result = rewrite_batched_matvecs(gm, inputs)
    assert result.rewritten == 0 and not result.declined and _matmul_count(gm) == 3

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.cross = CrossExperts()

        def forward(self, x):
            return self.cross(x)

    class IntegerProduct(nn.Module):
        def forward(self, w, x):
            return torch.matmul(w, x)

    gm, inputs = dynamo_graph(IntegerProduct(), torch.randint(0, 5, (6, 16)), torch.randint(0, 5, (4, 16, 1)))
    result = rewrite_batched_matvecs(gm, inputs)
    assert result.rewritten == 0 and result.declined == {"not_floating": 1} and _matmul_count(gm) == 1

    gm, inputs = dynamo_graph(Outer(), torch.randn(8, 48))
    result = rewrite_batched_matvecs(gm, inputs, exclude_modules=("cross",))
    assert result.rewritten == 0 and result.declined == {"excluded_module": 4} and _matmul_count(gm) == 4


def _sites(compiled):
    report = loka_compile.report(compiled)
    return report, [(s.op, s.batch) for s in report.sites]


@pytest.mark.parametrize("disabled", [(), ("batched_matvec",)])
def test_inference_computes_the_products_as_2d_gemms(disabled):
    """Under no_grad and autocast (W a bf16 copy that needs no grad) matmul writes the
    products as bmm of W expanded over the batch (batched sites, B matrix-vector products);
    with the Mod they are 2-D sites of M = B rows, FP8."""
    torch.manual_seed(0)
    model = CrossExperts().eval()
    x = torch.randn(64, 48)
    compiled = torch.compile(model, backend="loka",
                             options={"probe_steps": 0, "speed_check": False, "disabled_mods": list(disabled)})
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x).float()
        ref = model(x)
    report, sites = _sites(compiled)
    assert torch.isfinite(out).all()
    assert sqnr_db(ref.double(), out.double()) > PREDICTION_SQNR_DB
    if disabled:
        assert report.mods.get("batched_matvec", 0) == 0
        assert any(op == "bmm" for op, _ in sites), sites
    else:
        assert report.mods["batched_matvec"] == 4
        assert sites and all(op in ("mm", "addmm") for op, _ in sites), sites
        assert all(s.fp8 and s.shape[0] == 64 for s in report.sites), report.table()


@pytest.mark.slow
def test_training_gradients_match_eager():
    torch.manual_seed(0)
    model = CrossExperts()
    x = torch.randn(64, 48)
    report, grads = loka_and_eager_grads(model, x, {"probe_steps": 0, "speed_check": False})
    assert report.mods["batched_matvec"] == 4
    assert all(s.op in ("mm", "addmm") for s in report.sites), report.table()
    assert any(s.fp8 for s in report.sites)
    for name, got, want in grads:
        assert torch.isfinite(got).all(), name
        assert sqnr_db(want.double(), got.double()) > GRAD_SQNR_DB, name


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepctr_torch") is None or importlib.util.find_spec("requests") is None,
                    reason="the public extra is not installed: pip install -e '.[public]'")
def test_deepctr_dcnmix_inference_runs_its_cross_layers_as_gemms():
    """deepctr-torch's DCN-Mix, built as the library builds it (benchmarks.public registry):
    in inference every cross-expert product is a 2-D site (3 per expert and layer), none a
    batch of matrix-vector products, and the prediction stays within the suite's floor."""
    from benchmarks.public.models import PRESETS, build, clone_model
    bench = build("deepctr_torch.DCNMix", "tiny", seed=0)
    model = clone_model(bench.model).eval()
    inputs, _ = bench.batch(0)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        out = bench.prediction(compiled(inputs)).double()
        ref = bench.prediction(model(inputs)).double()
    report = loka_compile.report(compiled)
    preset = PRESETS["tiny"]
    assert report.mods["batched_matvec"] == 3 * preset.cross_layers * preset.experts
    cross = [s for s in report.sites if s.module.startswith("crossnet") and "gating" not in s.module]
    # the one batched product left is the mixture itself: [B, K, experts] @ [B, experts, 1]
    assert [s.op for s in cross].count("bmm") == preset.cross_layers, report.table()
    assert sum(s.op == "mm" for s in cross) == 3 * preset.cross_layers * preset.experts, report.table()
    assert torch.isfinite(out).all()
    assert sqnr_db(ref, out) > PREDICTION_SQNR_DB
