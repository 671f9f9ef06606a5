"""torch.compile(model, backend="loka") end to end on CPU (emulated FP8)."""

import copy
import logging

import pytest
import torch

import loka_compile
from loka_compile import Reason
from models import MLPWithNorm, WukongLikeBlock
from numerics import rel_error, sqnr_db

# Floors against the fp32 reference, measured with emulated e4m3 on these models
# (2026-11-22, CPU, seed 0): outputs 22.9-28.1 dB over the three recipes; gradients
# 12.5-40 dB, the worst being the first layer's weight of the MLP, whose gradient passes
# through two FP8 dgrads and two LayerNorm backwards before its own FP8 wgrad (the
# compounding that the Probe exists to catch).
pytestmark = pytest.mark.usefixtures("fresh_compile_state")

OUTPUT_SQNR_FLOOR_DB = 20.0
GRAD_SQNR_FLOOR_DB = 10.0
# The per-site rule alone: the output budget (max_output_error, tests/unit/test_output_budget.py) would
# keep these small models' sites, each moving the output by ~0.04 against its default 0.003.
PER_SITE = {"max_output_error": None}




_TEACHER = torch.Generator().manual_seed(1234)
MLP_TEACHER = torch.randn(64, 16, generator=_TEACHER) / 8
WUKONG_TEACHER = torch.randn(32 * 32, 1, generator=_TEACHER) / 32


def make_batch(model_name, batch=64):
    """Inputs and learnable targets (a fixed hidden teacher)."""
    if model_name == "mlp":
        x = torch.randn(batch, 64)
        return x, torch.tanh(x @ MLP_TEACHER)
    x = torch.randn(batch, 32, 32)
    return x, torch.tanh(x.reshape(batch, -1) @ WUKONG_TEACHER)


def make_model(model_name):
    return MLPWithNorm() if model_name == "mlp" else WukongLikeBlock(n_features=32, dim=32, n_lcb=16)


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def train(model, steps, batches, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# (module, role) of the sites expected in FP8 under the rowwise recipe; "" is the root module
EXPECTED_FP8_SITES = {
    "mlp": {("fc1", "fwd"), ("fc2", "fwd"), ("head", "fwd"), ("fc2", "dgrad"), ("head", "dgrad"),
            ("fc1", "wgrad"), ("fc2", "wgrad"), ("head", "wgrad")},
    "wukong": {("", "fwd"), ("fm_mlp.0", "fwd"), ("fm_mlp.2", "fwd"), ("proj", "fwd"),
               ("proj", "dgrad"), ("fm_mlp.2", "dgrad"), ("proj", "wgrad"), ("fm_mlp.2", "wgrad"),
               ("fm_mlp.0", "wgrad"), ("", "wgrad")},
}


@pytest.mark.parametrize("model_name", ["mlp", "wukong"])
def test_training_matches_fp32_reference(model_name):
    reference = make_model(model_name)
    model = copy.deepcopy(reference)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    x, y = make_batch(model_name)

    out_ref, out = reference(x), compiled(x)
    assert sqnr_db(out_ref, out) > OUTPUT_SQNR_FLOOR_DB
    torch.nn.functional.mse_loss(out_ref, y).backward()
    torch.nn.functional.mse_loss(out, y).backward()
    for g_ref, g in zip(grads(reference), grads(model)):
        assert sqnr_db(g_ref, g) > GRAD_SQNR_FLOOR_DB

    report = loka_compile.report(compiled)
    fp8_sites = {(s.module, s.role) for s in report.sites if s.fp8}
    assert EXPECTED_FP8_SITES[model_name] <= fp8_sites
    assert all(s.provider == "emulated" and s.reason == "fp8" for s in report.sites if s.fp8)
    assert all(s.reason != "fp8" for s in report.sites if not s.fp8)
    for site in report.sites:
        if site.kind == "backward":
            assert site.forward_site.split(":")[0] == site.name.split(":")[0]  # linked to its forward op

    batches = [make_batch(model_name) for _ in range(4)] * 4
    model.zero_grad()
    losses = train(compiled, 16, batches)
    assert losses[-1] < 0.7 * losses[0]


def test_wukong_sites_cover_bmm_transposes_and_3d_linears():
    model = make_model("wukong")
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    x, _ = make_batch("wukong")
    compiled(x.requires_grad_(True)).sum().backward()
    sites = loka_compile.report(compiled).sites
    bmm = [s for s in sites if s.op == "bmm"]
    assert bmm and all(s.batch == 64 for s in bmm)
    # FM bmm: the forward product and, since x needs a gradient, both operand gradients
    assert {s.role for s in bmm} == {"fwd", "dgrad"}
    proj = next(s for s in sites if s.module == "proj" and s.role == "fwd")
    assert proj.shape == (64 * 32, 32, 32)   # linear over [B, nF, d] folds B*nF into M
    head = next(s for s in sites if s.module == "head" and s.role == "fwd")
    assert not head.fp8 and head.reason == Reason.TOO_SMALL.value  # N = 1: padding to 16 would not pay


def test_default_recipe_keeps_wgrad_high_precision():
    compiled = torch.compile(make_model("mlp"), backend="loka", options={"probe_steps": 0})
    x, y = make_batch("mlp")
    torch.nn.functional.mse_loss(compiled(x), y).backward()
    report = loka_compile.report(compiled)
    for site in report.sites:
        assert site.fp8 == (site.role != "wgrad"), site
    assert "recipe_high_precision" in str(report)


def test_inference_compiles_forward_only_graph():
    model = make_model("mlp").eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x, _ = make_batch("mlp")
    with torch.no_grad():
        out = compiled(x)
        ref = model(x)
    assert sqnr_db(ref, out) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert {s.kind for s in report.sites} == {"inference"}
    assert {s.role for s in report.sites} == {"fwd"} and all(s.fp8 for s in report.sites)
    name = report.graphs[0].name
    assert list(report.graph_modules) == [f"{name}/inference"]
    code = report.graph_modules[f"{name}/inference"].print_readable(print_output=False)
    assert "float8_e4m3fn" in code  # the operand casts are nodes of the graph


def test_dynamic_batch_compiles_once_with_symbolic_m():
    model = make_model("mlp")
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0, "recipe": "rowwise"})
    for batch in (32, 48, 80, 96):
        x, y = make_batch("mlp", batch)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
    report = loka_compile.report(compiled)
    assert len(report.graphs) == 1
    fwd = [s for s in report.sites if s.role == "fwd"]
    assert all(isinstance(s.shape[0], str) for s in fwd)          # M is symbolic, e.g. "s77"
    wgrad = [s for s in report.sites if s.role == "wgrad"]
    assert all(isinstance(s.shape[1], str) and s.fp8 for s in wgrad)  # K = batch, checked at run time


def test_mark_dynamic_batch():
    compiled = torch.compile(make_model("mlp"), backend="loka", options={"probe_steps": 0})
    for batch in (32, 64):
        x, _ = make_batch("mlp", batch)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            compiled(x)
    report = loka_compile.report(compiled)
    assert len(report.graphs) == 1 and isinstance(report.sites[0].shape[0], str)


class GraphBroken(MLPWithNorm):
    def forward(self, x):
        x = torch.relu(self.norm1(self.fc1(x)))
        torch._dynamo.graph_break()
        x = torch.relu(self.norm2(self.fc2(x)))
        return self.head(x)


def test_graph_breaks_and_recompiles_are_all_reported():
    model = GraphBroken()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    for batch in (32, 64):  # the second batch size recompiles both graphs
        x, y = make_batch("mlp", batch)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
    report = loka_compile.report(compiled)
    assert len(report.graphs) >= 3
    modules = {(s.module, s.role) for s in report.sites}
    assert {("fc1", "fwd"), ("fc2", "fwd"), ("head", "fwd"), ("fc1", "wgrad")} <= modules


def test_probe_window_then_fp8_and_unsafe_sites_stay_high_precision():
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka",
                             options={**PER_SITE, "recipe": "rowwise", "probe_steps": 2, "max_probe_error": 1e-6})
    x, y = make_batch("mlp")
    for _ in range(2):  # probe window: high precision, observers record
        out = compiled(x)
        torch.nn.functional.mse_loss(out, y).backward()
    report = loka_compile.report(compiled)
    assert {s.reason for s in report.sites} == {"probing"}
    assert all(s.probe["observations"] == 2 and 0 < s.probe["max_rel_error"] < 0.1 for s in report.sites)
    torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)

    out = compiled(x)  # window closed: every site measured above 1e-6 stays high precision
    torch.nn.functional.mse_loss(out, y).backward()
    report = loka_compile.report(compiled)
    assert report.sites and {s.reason for s in report.sites} == {"probe_unsafe"}
    torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)


class ResidualTower(torch.nn.Module):
    """fc1 -> LayerNorm -> ReLU -> head, plus a branch off the LayerNorm scaled by 1e-2 (its
    own input, so horizontal fusion leaves it apart from head): fc1 and head move the output
    about 1:1 (sensitivity ~1), the branch about 1e-2."""

    def __init__(self, d=64, d_out=16):
        super().__init__()
        self.fc1, self.norm = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.head, self.branch = torch.nn.Linear(d, d_out), torch.nn.Linear(d, d_out)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        return self.head(torch.relu(h)) + 1e-2 * self.branch(h)


def test_defaults_with_an_absolute_budget_probe_then_run_fp8_within_it():
    """The defaults but the absolute output budget 0.003 (the default before the relative
    one): the first probe_steps calls run the probe variant (high precision, observers), the
    next compiles and runs the FP8 variant, in which the budget keeps the two sites that
    move the output 1:1 (each ~0.036 alone) and lets the branch, 1e-2 as sensitive, go FP8."""
    defaults = loka_compile.LokaConfig(max_output_error=0.003)
    assert defaults.probe_steps > 0
    model = ResidualTower()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options=defaults)
    x, y = make_batch("mlp")
    for _ in range(defaults.probe_steps):
        out = compiled(x)
        torch.nn.functional.mse_loss(out, y).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        report = loka_compile.report(compiled)
        assert [g.phase for g in report.graphs] == ["probe"]
        assert {s.reason for s in report.sites if s.role != "wgrad"} == {"probing"}  # wgrad: the recipe's
        torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)  # high precision
    assert report.graphs[0].config == defaults

    out = compiled(x)  # the window closes: the FP8 variant compiles and runs
    torch.nn.functional.mse_loss(out, y).backward()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    report = loka_compile.report(compiled)
    graph = report.graphs[0]
    assert graph.phase == "fp8"
    fwd = {s.module: s for s in report.sites if s.role == "fwd"}
    for site in [s for s in report.sites if s.role != "wgrad"]:  # observed over the window, bounded by it
        assert site.probe["observations"] == defaults.probe_steps, site
        own = site.verdicts[site.probe["chosen"]]
        assert own["n"] == defaults.probe_steps and 0 < own["bound"] < defaults.max_probe_error, site
    for name in ("fc1", "head"):
        assert not fwd[name].fp8 and fwd[name].reason == "probe_unsafe" and "output budget" in fwd[name].detail
    assert fwd["branch"].fp8 and fwd["branch"].sensitivity < 0.05
    assert {s.fp8 for s in report.sites if s.role == "dgrad"} == {True}  # the budget weighs forward sites only
    assert all(s.reason == "recipe_high_precision" for s in report.sites if s.role == "wgrad")
    budget = graph.output_budget
    assert sorted(budget.kept) == sorted([fwd["fc1"].id, fwd["head"].id])
    # measured: predicted 4.8e-4, measured 4.9e-4
    assert 0 < graph.predicted_output_error <= 0.003 and 0 < graph.measured_output_error <= 0.003
    assert f"output budget {graph.name}: noise floor" in report.summary()
    with torch.no_grad():
        assert rel_error(reference(x).double(), out.double()) <= 0.003
    for g_ref, g in zip(grads(reference), grads(model)):
        assert sqnr_db(g_ref, g) > GRAD_SQNR_FLOOR_DB


def test_fp8_variant_after_the_window_keeps_the_static_shapes():
    """The FP8 variant compiles when the window closes, after Dynamo has forgotten how it
    fakified the inputs (torch 2.13 clears that for registered backends): the backend keeps
    it, so the sites keep concrete K and N (symbolic ones stay bf16 on FP8 GPUs)."""
    compiled = torch.compile(make_model("mlp"), backend="loka", options={**PER_SITE, "probe_steps": 1})
    x, _ = make_batch("mlp")
    with torch.no_grad():
        compiled(x)
        compiled(x)
    (record,) = loka_compile.state_of(compiled).records
    shapes = {phase: [s.shape for s in ctx.sites] for (phase, _), ctx in record.contexts.items()}
    assert shapes["fp8"] == shapes["probe"] and all(isinstance(d, int) for shape in shapes["fp8"] for d in shape)


def test_probe_with_safe_bound_goes_fp8():
    compiled = torch.compile(make_model("mlp"), backend="loka", options={**PER_SITE, "recipe": "rowwise",
                                                                       "probe_steps": 1})
    x, y = make_batch("mlp")
    for _ in range(2):
        torch.nn.functional.mse_loss(compiled(x), y).backward()
    sites = loka_compile.report(compiled).sites
    assert sites and all(s.fp8 and s.probe for s in sites)


def test_probe_upgrades_a_tensorwise_site_an_outlier_would_wreck():
    """One finite outlier sets a tensorwise scale so large that every other row of the
    operand flushes to zero. The Probe sees it and sends the site rowwise instead."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)).eval()
    x = torch.randn(64, 64)
    x[10, 3] = 1e6
    clean = [r for r in range(64) if r != 10]
    with torch.no_grad():
        reference = model(x)
        plain = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "tensorwise"})(x)
        assert sqnr_db(reference[clean], plain[clean]) < 10.0  # what the upgrade prevents
        torch._dynamo.reset()
        loka_compile.reset()
        compiled = torch.compile(model, backend="loka", options={**PER_SITE, "recipe": "tensorwise",
                                                                  "probe_steps": 1})
        compiled(x)
        out = compiled(x)
    fc1 = next(s for s in loka_compile.report(compiled).sites if s.module == "0")
    assert fc1.fp8 and fc1.scaling == "rowwise" and "tensorwise rel. error" in fc1.detail, fc1
    assert sqnr_db(reference[clean], out[clean]) > OUTPUT_SQNR_FLOOR_DB


def test_emulation_off_without_fp8_hardware_keeps_high_precision():
    model = make_model("mlp")
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "emulate": False})
    x, _ = make_batch("mlp")
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert {s.reason for s in loka_compile.report(compiled).sites} == {"no_fp8_hardware"}


def test_unsupported_dtype_falls_back():
    model = make_model("mlp").double()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x = torch.randn(32, 64, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), model(x))
    assert {s.reason for s in loka_compile.report(compiled).sites} == {"unsupported_dtype"}


def test_bf16_model():
    model = make_model("mlp").to(torch.bfloat16)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "tensorwise"})
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    out = compiled(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert sqnr_db(model(x).float(), out.float()) > OUTPUT_SQNR_FLOOR_DB - 3
    sites = loka_compile.report(compiled).sites
    dgrad = [s for s in sites if s.role == "dgrad" and s.fp8]
    assert dgrad and all(s.formats == "e5m2 x e4m3" for s in dgrad)  # tensorwise: e5m2 gradients


def test_a_graph_loka_cannot_handle_runs_in_high_precision_with_one_warning(monkeypatch, caplog):
    from loka_compile.passes import find_sites as find_sites_module  # noqa: F401
    import importlib

    module = importlib.import_module("loka_compile.passes")

    def broken(graph, ctx):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(module, "PIPELINE", (("find_sites", broken),) + module.PIPELINE[1:])
    model = make_model("mlp")
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x, y = make_batch("mlp")
    with caplog.at_level(logging.WARNING, logger="loka"):
        out = compiled(x)
        torch.nn.functional.mse_loss(out, y).backward()
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    warnings = [r for r in caplog.records if r.name == "loka" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "synthetic failure" in warnings[0].getMessage()
    report = loka_compile.report(compiled)
    assert report.graphs[0].fallback and "fallbacks" in report.summary()


def test_reduce_overhead_mode_through_options():
    compiled = torch.compile(make_model("mlp"), backend="loka", mode="reduce-overhead")
    x, _ = make_batch("mlp")
    with torch.no_grad():
        compiled(x)
    graph = loka_compile.report(compiled).graphs[0]
    assert graph.config.mode == "reduce-overhead"


def test_report_table_and_fields():
    compiled = torch.compile(make_model("mlp"), backend="loka", options={"probe_steps": 0})
    x, _ = make_batch("mlp")
    compiled(x).sum().backward()
    report = loka_compile.report(compiled)
    text = report.table()
    for column in ("site", "role", "M x K x N", "fp8", "provider", "reason"):
        assert column in text
    overview = str(report)
    assert overview.startswith("loka: 8 GEMM sites") and "FP8 per role: fwd 3/3, dgrad 2/2, wgrad 0/3" in overview
    assert "kept in high precision: recipe_high_precision" in overview and "report.table()" in overview
    site = report.sites[0]
    for field in ("name", "module", "role", "shape", "fp8", "provider", "reason"):
        assert hasattr(site, field)
    (graph,) = report.graphs
    assert set(report.graph_modules) == {f"{graph.name}/forward", f"{graph.name}/backward"}
    other = torch.compile(torch.nn.Linear(64, 32), backend="loka", options={"probe_steps": 0})
    other(x)
    assert len(loka_compile.report(compiled).graphs) == 1  # reports are per model
    assert [s.module for s in loka_compile.report(other).sites] == ["Linear"]
    # Dynamo serves another instance of the same class compiled with equal options with the first's
    # graphs: the twin has none of its own, and its report says so
    twin = torch.compile(make_model("mlp"), backend="loka", options={"probe_steps": 0})
    twin(x)
    with pytest.raises(ValueError, match="compiled no graph of its own"):
        loka_compile.report(twin)
    assert len(loka_compile.report(compiled).graphs) == 1


def test_report_counts_what_each_mod_did():
    """Fused and standalone casts, padded sites and fast-accumulation GEMMs, as the summary
    states them; opt-in architecture Mods rewrite the graph only when named."""

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.fc2 = torch.nn.Linear(64, 100), torch.nn.LayerNorm(100), torch.nn.Linear(100, 64)

        def forward(self, x):
            return self.fc2(torch.nn.functional.silu(self.norm(self.fc1(x))))

    x = torch.randn(128, 64)
    compiled = torch.compile(Tower(), backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    compiled(x).sum().backward()
    report = loka_compile.report(compiled)
    mods = report.mods
    assert mods["pad"] == 4  # fc1 fwd/wgrad (N=100), fc2 fwd/dgrad (K=100)
    assert mods["fast_accum"] == 2 and mods["fused_casts"] == 1 and mods["standalone_casts"] >= 4  # silu -> fc2
    assert not any(k.startswith("arch:") for k in mods)
    assert "Mods: fused_casts" in report.summary() and "a:fused" in report.table()

    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(Tower(), backend="loka",
                             options={"probe_steps": 0, "arch_mods": ["blocknorm", "hardswish"]})
    compiled(x).sum().backward()
    mods = loka_compile.report(compiled).mods
    assert mods["arch:blocknorm"] == 1 and mods["arch:hardswish"] == 1


def test_tiny_gradients_keep_their_values():
    """A loss scaled by 1e-15: the gradient casts' scales follow the data down (an amax
    floor of 1e-12 once flushed the dgrad, and with it the first layer's weight gradient,
    to zero)."""
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x, y = make_batch("mlp")
    (1e-15 * torch.nn.functional.mse_loss(compiled(x), y)).backward()
    (1e-15 * torch.nn.functional.mse_loss(reference(x), y)).backward()
    for p, p_ref in zip(model.parameters(), reference.parameters()):
        assert p.grad.abs().max() > 0
        assert sqnr_db(p_ref.grad.double(), p.grad.double()) > GRAD_SQNR_FLOOR_DB


def test_functional_call_weight_gradients_are_wgrad():
    """torch.func.functional_call passes the weights as plain leaf tensors: their
    gradients are still wgrad (kept in high precision by the default recipe), and an
    input that requires grad but is no weight keeps dgrad."""
    from torch.func import functional_call

    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in module.named_parameters()}
    step = torch.compile(lambda p, x: functional_call(module, p, (x,)), backend="loka", options={"probe_steps": 0})
    x = torch.randn(32, 64, requires_grad=True)
    step(params, x).sum().backward()
    roles = sorted((s.module.rsplit(".", 1)[-1], s.role) for s in loka_compile.report(step).sites)
    assert roles == [("0", "dgrad"), ("0", "fwd"), ("0", "wgrad"),
                     ("2", "dgrad"), ("2", "fwd"), ("2", "wgrad")], roles
    assert all(s.reason == "recipe_high_precision" for s in loka_compile.report(step).sites if s.role == "wgrad")


def test_freezing_packed_linears_are_reported_with_their_reason():
    """Inductor's freezing packs CPU linears for mkl/mkldnn before post-grad passes run:
    loka cannot cast those weights, and the report says so instead of showing no sites."""
    import torch._inductor.config as inductor_config

    # Not monkeypatch: its undo deletes a config module's attribute, which hides it for good.
    model = make_model("mlp").eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    x, _ = make_batch("mlp")
    with torch.no_grad(), inductor_config.patch(freezing=True):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    sites = loka_compile.report(compiled).sites
    if not any(s.op == "packed_linear" for s in sites):
        pytest.skip("this torch build's freezing did not pack the linears")
    packed = [s for s in sites if s.op == "packed_linear"]
    assert all(s.reason == "packed_by_freezing" and not s.fp8 and s.shape[1] > 0 for s in packed)


def test_weight_norm_weight_gradient_is_wgrad():
    """weight_norm reparametrizes the weight as g * v / |v|: the GEMM that computes the
    whole weight's gradient feeds `_weight_norm_interface_backward`, and is wgrad."""
    from torch.nn.utils.parametrizations import weight_norm

    model = torch.nn.Sequential(weight_norm(torch.nn.Linear(64, 64)), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    compiled(torch.randn(32, 64, requires_grad=True)).sum().backward()
    roles = sorted((s.module, s.role) for s in loka_compile.report(compiled).sites)
    assert roles == [("0", "dgrad"), ("0", "fwd"), ("0", "wgrad"), ("2", "dgrad"), ("2", "fwd"), ("2", "wgrad")]
