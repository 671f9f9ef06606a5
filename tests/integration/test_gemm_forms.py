"""GEMM forms public model code writes, under loka (emulated FP8 on CPU): each is found as a
site of the right shape and kind, runs in FP8, and matches an fp64 reference within FP8's
error (SQNR floor).

- `x.permute(0, 2, 1) @ W` with W a bare nn.Parameter (public Wukong's projections) is the
  linear of a transposed input that the transposed_linear Mod computes as W^T @ x.
- A bmm that is one 2-D GEMM is folded into a 2-D site (find_sites.batch_fold) and lowered
  as mm/addmm: einsum's contractions arrive as a bmm with a batch of one; `x @ W` of a 3-D,
  transposed x and a 2-D weight arrives, under no_grad or autocast (matmul folds only where
  a gradient needs it), as a bmm of W expanded over the batch. Not folded: a product of two
  activations, a weight broadcast as A (W @ x), a bias per batch.
- The public-style Wukong and MaskNet layers (benchmarks/public/written_here.py) train
  under loka with their GEMMs as sites.
"""

import pytest
import torch
from torch import nn

import loka_compile
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

B, N, D, K = 4, 32, 48, 64
# Emulated e4m3 rowwise x e4m3: one GEMM's output has an SQNR of about 30 dB against fp64
# (3% relative error); the floor leaves room for bf16 autocast's rounding on top.
GEMM_SQNR_FLOOR_DB = 22.0

aten = torch.ops.aten


class Form(nn.Module):
    """One form over a [B, N, D] activation, with bare nn.Parameter weights."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.w_field = nn.Parameter(torch.randn(N, K) / N ** 0.5)  # over the field axis
        self.w_dim = nn.Parameter(torch.randn(D, K) / D ** 0.5)    # over the last axis
        self.bias = nn.Parameter(torch.randn(K))
        self.per_batch_bias = nn.Parameter(torch.randn(B, 1, K))
        self.shift = nn.Parameter(torch.randn(D) / 10)

    def forward(self, x):
        if self.form == "einsum_dim":
            return torch.einsum("bnd,dk->bnk", x, self.w_dim)
        if self.form == "einsum_field":
            return torch.einsum("bnd,nk->bdk", x, self.w_field)
        if self.form == "permute_matmul":
            return x.permute(0, 2, 1) @ self.w_field
        if self.form == "permute_matmul_back":
            return (x.permute(0, 2, 1) @ self.w_field).permute(0, 2, 1)
        if self.form == "baddbmm_vector_bias":
            return torch.baddbmm(self.bias, x, self.w_dim.expand(x.shape[0], D, K))
        if self.form == "baddbmm_batch_bias":
            return torch.baddbmm(self.per_batch_bias, x, self.w_dim.expand(x.shape[0], D, K))
        if self.form == "weight_as_a":
            return self.w_field.t().expand(x.shape[0], K, N) @ x
        if self.form == "pairwise":
            h = x + self.shift
            return torch.bmm(h, h.transpose(1, 2))
        raise ValueError(self.form)


# form -> (folded, the site's (M, K, N)); `x.permute(0, 2, 1) @ W` is W^T @ x once the
# transposed_linear Mod rewrites it: a bmm over W broadcast as A, not folded
FOLDED = {
    "einsum_dim": (True, (B * N, D, K)),
    "einsum_field": (True, (B * D, N, K)),
    "permute_matmul": (False, (K, N, D)),
    "permute_matmul_back": (False, (K, N, D)),
    "baddbmm_vector_bias": (True, (B * N, D, K)),
    "baddbmm_batch_bias": (False, (N, D, K)),
    "weight_as_a": (False, (K, N, D)),
    "pairwise": (False, (N, D, N)),
}


class AllForms(nn.Module):
    def __init__(self, forms):
        super().__init__()
        self.forms = nn.ModuleDict({form: Form(form) for form in forms})

    def forward(self, x):
        return {form: module(x) for form, module in self.forms.items()}


def _inference(amp: bool, forms=tuple(FOLDED), **options):
    torch.manual_seed(0)
    model = AllForms(forms).eval()
    x = torch.randn(B, N, D)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, **options})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = compiled(x)
    with torch.no_grad():
        ref = model.double()(x.double())
    return out, ref, loka_compile.report(compiled)


@pytest.mark.slow
def test_inference_forms_are_sites_of_their_shapes_in_fp8():
    """Under autocast, as the public runner's inference runs: each form one site of its
    shape, folded or not as FOLDED says, in FP8, its output within FP8's error of fp64's;
    a folded site runs as a 2-D GEMM reading its weight's cached FP8 copy."""
    out, ref, report = _inference(amp=True)
    (graph,) = report.graph_modules.values()
    batched = [n for n in graph.graph.nodes if n.op == "call_function"
               and n.target in (aten.bmm.default, aten.baddbmm.default)]
    assert len(batched) == sum(not folded for folded, _ in FOLDED.values()), graph.code
    for form, (folded, shape) in FOLDED.items():
        (site,) = [s for s in report.sites if s.module == f"forms.{form}"]
        assert site.shape == shape and (site.batch is None) == folded, (form, report.table())
        assert site.op in ("bmm", "baddbmm") and site.fp8, (form, report.table())
        assert torch.isfinite(out[form]).all(), form
        db = sqnr_db(ref[form], out[form].double())
        assert db > GEMM_SQNR_FLOOR_DB, (form, db)
        if folded and form != "einsum_field":  # einsum reads that weight through a copy it makes
            assert site.casts["b"].startswith("cached"), (form, site.casts)


@pytest.mark.slow
def test_matmul_of_a_transposed_activation_folds_only_where_matmul_did_not():
    """Without the transposed_linear Mod: in fp32 inference matmul folds `x.permute(0, 2, 1)
    @ W` itself (W requires grad): an mm site; under autocast the weight's bf16 copy does
    not, and the bmm over W expanded is folded to the same 2-D site."""
    _, _, plain = _inference(amp=False, forms=["permute_matmul"], disabled_mods=["transposed_linear"])
    torch._dynamo.reset()
    loka_compile.reset()
    _, _, autocast = _inference(amp=True, forms=["permute_matmul"], disabled_mods=["transposed_linear"])
    (mm,) = [s for s in plain.sites if s.module == "forms.permute_matmul"]
    (bmm,) = [s for s in autocast.sites if s.module == "forms.permute_matmul"]
    assert mm.op == "mm" and bmm.op == "bmm" and mm.shape == bmm.shape and bmm.batch is None


@pytest.mark.slow
@pytest.mark.parametrize("form", ["einsum_dim", "permute_matmul_back"])
def test_training_form_matches_eager(form):
    """A training step: the forward in FP8 (einsum folded; `x.permute(0, 2, 1) @ W` and
    back rewritten as W^T @ x by transposed_linear), the output and the gradients of x and
    of the weight close to fp64's."""
    torch.manual_seed(0)
    model = Form(form)
    x = torch.randn(B, N, D, requires_grad=True)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    out = compiled(x)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_model = Form(form).double()
    ref_model.load_state_dict(model.state_dict())
    x64 = x.detach().double().requires_grad_(True)
    ref = ref_model(x64)
    ref.backward(grad_out.double())
    report = loka_compile.report(compiled)
    fwd = [s for s in report.sites if s.role == "fwd"]
    assert fwd and all(s.fp8 for s in fwd), report.table()
    if form == "einsum_dim":  # folded: a 2-D GEMM
        assert all(s.batch is None for s in fwd), report.table()
    else:  # the transposed_linear Mod: W^T @ x, a bmm with the weight's gradient summed over the batch
        assert report.mods["transposed_linear"] == 1, report.mods
        assert {s.role for s in report.sites} == {"fwd", "dgrad", "wgrad"}, report.table()
        assert all(s.op == "bmm" and s.batch == B for s in report.sites), report.table()
    assert sqnr_db(ref.detach(), out.detach().double()) > GEMM_SQNR_FLOOR_DB
    assert sqnr_db(x64.grad, x.grad.double()) > GEMM_SQNR_FLOOR_DB
    weight = "w_dim" if form == "einsum_dim" else "w_field"
    assert sqnr_db(getattr(ref_model, weight).grad, getattr(model, weight).grad.double()) > GEMM_SQNR_FLOOR_DB


def test_folding_rejects_a_bmm_of_two_activations_and_per_batch_biases():
    """find_sites.batch_fold on a traced graph: only a batch of one or a broadcast B folds."""
    import importlib
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    fs = importlib.import_module("loka_compile.passes.find_sites")  # the module, not the pass it exports
    w = torch.randn(D, K)

    def graph_of(fn, *args):
        with FakeTensorMode(allow_non_fake_inputs=True):
            return make_fx(fn, tracing_mode="fake")(*args)

    def folds(gm):
        return [fs.batch_fold(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in fs.BATCHED_GEMMS]

    x = torch.randn(B, N, D)
    assert folds(graph_of(lambda x: torch.bmm(x, x.transpose(1, 2)), x)) == [""]
    assert folds(graph_of(lambda x: torch.bmm(x, w.expand(B, D, K)), x)) == [fs.FOLD_BROADCAST]
    assert folds(graph_of(lambda x: torch.bmm(x[:1], x[:1].transpose(1, 2)), x)) == [fs.FOLD_SINGLE]
    assert folds(graph_of(lambda x: torch.baddbmm(torch.ones(B, 1, K), x, w.expand(B, D, K)), x)) == [""]
    assert folds(graph_of(lambda x: torch.baddbmm(torch.ones(K), x, w.expand(B, D, K), beta=0.5), x)) == [""]
    assert folds(graph_of(lambda x: torch.bmm(w.t().expand(B, K, D), x.transpose(1, 2)), x)) == [""]


# ------------------------------------------------------------------ the public-style models


def _feature_dict(batch, tables, num_dense):
    x = {f"C{t}": torch.randint(0, rows, (batch,)) for t, rows in enumerate(tables)}
    x.update({f"I{j}": torch.randn(batch) for j in range(num_dense)})
    return x


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["wukong", "masknet_serial"])
def test_public_style_model_trains_in_fp8(arch):
    """Wukong (x.permute(0, 2, 1) @ W with bare Parameters, LayerNorm of cat + residual,
    BatchNorm MLPs) and serial MaskNet, small: four Adam steps on a repeated batch lower the
    loss, every parameter gets a finite gradient, the projections are sites with fwd,
    dgrad and wgrad, some site runs in FP8, no graph falls back."""
    from benchmarks.public.written_here import MaskNet, Wukong
    torch.manual_seed(0)
    tables = [50, 60, 70, 80]
    if arch == "wukong":
        model = Wukong(tables, num_dense=3, dim=16, dense_fields=12, layers=2, n_fm=16, n_lc=16, rank=16,
                       fm_hidden=(32,), top_hidden=(32,))
        projections = {"layers.1.lcb", "layers.1.fmb"}
    else:
        model = MaskNet(tables, num_dense=3, dim=16, blocks=2, block_width=32, top_hidden=(32,), parallel=False)
        projections = {"blocks.1.hidden", "blocks.1.mask.aggregate"}
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = _feature_dict(64, tables, 3), torch.randint(0, 2, (64,)).float()
    losses = []
    for _ in range(5):
        loss = nn.functional.binary_cross_entropy(compiled(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    report = loka_compile.report(compiled)
    assert not any(g.fallback for g in report.graphs), str(report)
    assert any(s.fp8 for s in report.sites), report.table()
    for module in projections:
        assert {s.role for s in report.sites if s.module == module} == {"fwd", "dgrad", "wgrad"}, report.table()


class WeightMatmuls(nn.Module):
    """`x.permute(0, 2, 1) @ W` and back with bare Parameters (Wukong's linear compression
    and FM projection as public code writes them), and matmuls the Mod leaves alone."""

    def __init__(self):
        super().__init__()
        self.compress = nn.Parameter(torch.randn(N, K) / N ** 0.5)
        self.project = nn.Parameter(torch.randn(N, 16) / N ** 0.5)
        self.stacked = nn.Parameter(torch.randn(1, N, K) / N ** 0.5)

    def forward(self, x, activation):
        lcb = (x.permute(0, 2, 1) @ self.compress).permute(0, 2, 1)        # [B, K, D]
        fm = torch.matmul(x, torch.matmul(x.transpose(1, 2), self.project))  # [B, N, 16]
        not_a_weight = x.permute(0, 2, 1) @ activation                      # B is an activation
        not_2d = x.permute(0, 2, 1) @ self.stacked                           # a 3-D weight
        return lcb, fm, not_a_weight, not_2d


def test_transposed_linear_rewrites_a_matmul_of_a_transposed_input_by_a_weight():
    """On the Dynamo graph: both weight matmuls become bmm(W^T broadcast, x), with nothing
    left transposing x for them; the matmul by an activation and by a 3-D weight are not
    counted; every output as before."""
    from graphs import dynamo_graph
    from loka_compile.passes.mods.transposed_linear import rewrite_transposed_linears
    from numerics import rel_error
    torch.manual_seed(0)
    model, x, activation = WeightMatmuls(), torch.randn(B, N, D), torch.randn(N, K)
    gm, example_inputs = dynamo_graph(model, x, activation)
    expected = model(x, activation)
    result = rewrite_transposed_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (2, {}), result
    assert sum(n.op == "call_function" and n.target is torch.bmm for n in gm.graph.nodes) == 2
    got = gm(*example_inputs)
    for e, g in zip(expected, got):
        assert rel_error(e, g) < 1e-5


class DictInputWukongLayer(nn.Module):
    """A public-style Wukong layer reading its input from a dict through a Linear, under bf16
    autocast as the public runner runs models: the projections' matmuls see a bf16 x (the
    Linear's output) and an fp32 W."""

    def __init__(self):
        super().__init__()
        from benchmarks.public.written_here import WukongLayer
        self.embed = nn.Linear(D, D)
        self.layer = WukongLayer(N, D, 16, 16, 16, (32,), 0.0)

    def forward(self, inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.layer(self.embed(inputs["x"])).float()


@pytest.mark.slow
@pytest.mark.parametrize("mod_fails", [False, True])
def test_wukong_layer_under_autocast_runs_its_projections_as_weight_bmms(monkeypatch, mod_fails):
    """Both projections (FM, linear compression) become W^T @ x under autocast (the
    rewrite writes W's cast to x's dtype, which autocast made implicitly); when the Mod
    fails part way, the graph as written (its inputs' Dynamo sources kept) still compiles
    under loka, without a fallback. The output within FP8's error of fp64 eager's."""
    import loka_compile.passes.mods.transposed_linear as transposed_linear
    if mod_fails:
        def injected(*args, **kwargs):
            raise RuntimeError("injected")
        monkeypatch.setattr(transposed_linear, "_rewrite", injected)
    torch.manual_seed(0)
    model = DictInputWukongLayer().eval()
    x = torch.randn(B, N, D)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        out = compiled({"x": x})
        model.double()
        ref = model.layer(model.embed(x.double()))
    report = loka_compile.report(compiled)
    assert report.mods["transposed_linear"] == (0 if mod_fails else 2), report.mods
    assert not any(g.fallback for g in report.graphs), str(report)
    assert any(s.fp8 for s in report.sites), report.table()
    assert sqnr_db(ref, out.double()) > GEMM_SQNR_FLOOR_DB - 6  # several FP8 GEMMs in a row, in bf16


def test_a_square_broadcast_matrix_read_transposed_after_its_expand_is_not_folded_as_itself():
    """`x @ w.expand(...).transpose(1, 2)` with a square w: the matrix before the expand is w, the
    bmm reads w^T. Folding it as w gave the wrong product; it stays a bmm, and the output is x @ w^T."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(D, D))

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return torch.bmm(x, self.w.unsqueeze(0).expand(x.shape[0], D, D).transpose(1, 2))

    model, x = Transposed(), torch.randn(B, N, D)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "speed_check": False})
    with torch.no_grad():
        out = compiled(x)
    ref = x.double() @ w.detach().double().t()
    assert torch.isfinite(out).all() and sqnr_db(ref, out.double()) > GEMM_SQNR_FLOOR_DB
    (site,) = loka_compile.report(compiled).sites
    assert site.batch is not None, loka_compile.report(compiled).table()  # a batched site: not folded
