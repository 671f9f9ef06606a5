"""Roles (fwd, dgrad, wgrad) that find_sites gives the GEMMs of models written the ways
users write them: a layer applied twice, weight_norm, functional_call, a product of two
activations, activation checkpointing. Each test trains one step under loka (emulated FP8
on CPU) and asserts the exact (kind, module, role) list of the report."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import loka_compile
from loka_compile.passes import GraphKind, Role
from loka_compile.passes.find_sites import clean_module_path, find_sites
from graphs import aot_graphs, make_ctx

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def _roles(sites) -> list:
    return sorted((s.kind, s.module, s.role) for s in sites)


def _step(fn, *inputs):
    """One forward and backward of `fn` under loka; every site of the report."""
    compiled = torch.compile(fn, backend="loka", options={"probe_steps": 0})
    compiled(*inputs).float().pow(2).sum().backward()
    sites = loka_compile.report(compiled).sites
    print(loka_compile.report(compiled).table())  # shown on failure
    return sites


F, B = "forward", "backward"


class SharedTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = nn.Linear(32, 32)

    def forward(self, user, item):
        return (self.tower(user) * self.tower(item)).sum(-1)


@pytest.mark.parametrize("inputs_need_grad", [False, True])
def test_shared_tower_weight_gradient_is_wgrad(inputs_need_grad):
    """The tower's weight gradient is g_u^T @ u + g_i^T @ i; Inductor turns the addition
    into one addmm that carries no module stack: still wgrad, still the tower's, and in
    high precision under the default recipe."""
    user, item = (torch.randn(64, 32, requires_grad=inputs_need_grad) for _ in range(2))
    sites = _step(SharedTower(), user, item)
    dgrads = [(B, "tower", "dgrad")] * 2 if inputs_need_grad else []
    assert _roles(sites) == sorted([(F, "tower", "fwd")] * 2 + [(B, "tower", "wgrad")] * 2 + dgrads)
    wgrads = [s for s in sites if s.role == "wgrad"]
    assert all(s.reason == "recipe_high_precision" and not s.fp8 for s in wgrads), wgrads


@pytest.mark.parametrize("form", ["parametrizations", "legacy"])
def test_weight_norm_weight_gradient_is_wgrad(form):
    """W = g * v / |v|: the GEMM computing dW is wgrad (its result reaches g and v through
    weight_norm's backward). The legacy hook also returns W, so its gradient adds a
    tangent to dW: the addmm Inductor makes of it is still fc's wgrad."""
    fc = nn.Linear(32, 32)
    fc = nn.utils.parametrizations.weight_norm(fc) if form == "parametrizations" else nn.utils.weight_norm(fc)
    model = nn.Sequential(fc, nn.ReLU(), nn.Linear(32, 16))
    sites = _step(model, torch.randn(64, 32, requires_grad=True))
    assert _roles(sites) == sorted([(F, "0", "fwd"), (F, "2", "fwd"), (B, "0", "dgrad"), (B, "0", "wgrad"),
                                    (B, "2", "dgrad"), (B, "2", "wgrad")])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("params_as", ["parameters", "leaf_tensors"])
@pytest.mark.parametrize("rank", [2, 3])
def test_functional_call_weight_gradients_are_wgrad(params_as, rank):
    """`torch.func.functional_call(model, params, x)`: the weights reach the graph as
    inputs (plain tensors when the caller detaches them): every weight gradient is wgrad
    and kept in high precision by the default recipe."""
    model = MLP()
    params = dict(model.named_parameters())
    if params_as == "leaf_tensors":
        params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    x = torch.randn(*([4, 16] if rank == 3 else [64]), 32, requires_grad=True)
    sites = _step(lambda p, x: torch.func.functional_call(model, p, (x,)), params, x)
    assert _roles(sites) == sorted([(F, "a", "fwd"), (F, "b", "fwd"), (B, "a", "dgrad"), (B, "a", "wgrad"),
                                    (B, "b", "dgrad"), (B, "b", "wgrad")])
    assert all(not s.fp8 and s.reason == "recipe_high_precision" for s in sites if s.role == "wgrad")
    assert all(p.grad is not None for p in params.values())


_GLOBAL_MLP = MLP()


def _call_global_mlp(params, x):
    return torch.func.functional_call(_GLOBAL_MLP, params, (x,))


def test_functional_call_on_a_global_module_names_its_layers():
    """A module reached through a global: Dynamo's path "G['_GLOBAL_MLP'].a" -> "_GLOBAL_MLP.a"."""
    sites = _step(_call_global_mlp, dict(_GLOBAL_MLP.named_parameters()), torch.randn(64, 32))
    assert _roles(sites) == sorted([(F, "_GLOBAL_MLP.a", "fwd"), (F, "_GLOBAL_MLP.b", "fwd"),
                                    (B, "_GLOBAL_MLP.a", "wgrad"), (B, "_GLOBAL_MLP.b", "dgrad"),
                                    (B, "_GLOBAL_MLP.b", "wgrad")])


class Interaction(nn.Module):
    """p(x) @ q(z)^T: a product of two activations, whose gradients (bmm) are dgrad, while
    the linears' bias gradients are sums over the rows of those bmm results."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(32, 32)
        self.q = nn.Linear(32, 32)

    def forward(self, x, z):
        return torch.bmm(self.p(x), self.q(z).transpose(1, 2))


def test_bmm_of_two_activations_has_dgrads_only():
    sites = _step(Interaction(), torch.randn(8, 16, 32), torch.randn(8, 16, 32))
    assert _roles(sites) == sorted([(F, "", "fwd"), (F, "p", "fwd"), (F, "q", "fwd"), (B, "", "dgrad"),
                                    (B, "", "dgrad"), (B, "p", "wgrad"), (B, "q", "wgrad")])
    assert sorted(s.role for s in sites if s.op == "bmm") == ["dgrad", "dgrad", "fwd"]


class BroadcastWeight(nn.Module):
    """The other side of the sum rule: a weight broadcast over the batch of a bmm; its
    gradient is a bmm summed over the batch, a wgrad."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 48) / 6)

    def forward(self, x):
        return torch.bmm(x, self.w.expand(x.shape[0], 32, 48))


def test_bmm_with_weight_broadcast_over_batch_has_wgrad():
    sites = _step(BroadcastWeight(), torch.randn(8, 16, 32, requires_grad=True))
    assert sorted((s.kind, s.role) for s in sites) == [(B, "dgrad"), (B, "wgrad"), (F, "fwd")]


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)
        self.head = nn.Linear(32, 16)

    def block(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_checkpoint_recomputed_gemms_are_fwd():
    """The backward graph recomputes the checkpointed block's forward GEMMs: they read no
    incoming gradient, so they are fwd (named `:recomputed`, linked to their forward
    site), not dgrad."""
    sites = _step(Checkpointed(), torch.randn(64, 32, requires_grad=True))
    expected = [(F, m, "fwd") for m in ("a", "b", "head")] + [(B, m, "fwd") for m in ("a", "b")] \
        + [(B, m, r) for m in ("a", "b", "head") for r in ("dgrad", "wgrad")]
    assert _roles(sites) == sorted(expected)
    recomputed = sorted((s.name, s.forward_site) for s in sites if s.kind == B and s.role == "fwd")
    assert recomputed == [("a:fwd:recomputed", "a:fwd"), ("b:fwd:recomputed", "b:fwd")], recomputed


def test_gradient_addition_keeps_its_module_with_the_provenance_pre_pass():
    """LoRA's `base(x) + (x @ A) @ B * s` with a frozen base: Inductor adds the base's
    dgrad to the adapter path's into one addmm that keeps no module; find_sites cannot
    tell it from the backward graph alone, but `keep_gemm_provenance`, run before
    Inductor's post-grad patterns, keeps it (tests/integration/test_model_patterns.py's strict xfail
    shows the backend does not install it yet)."""
    from torch._inductor import config as inductor_config

    from loka_compile.passes.find_sites import keep_gemm_provenance
    from test_model_patterns import _lora_sites

    with inductor_config.patch(post_grad_custom_pre_pass=keep_gemm_provenance):
        sites = _lora_sites("adapter")
    assert sorted(s.module for s in sites if s.role == "dgrad") == ["fc1", "fc2", "fc2", "fc2.base", "head"]
    base = [s for s in sites if s.module == "fc2.base" and s.role == "dgrad"]
    assert [s.forward_site for s in base] == ["fc2.base:fwd"], base


class TestFindSites:
    def test_roles_shapes_and_links(self, mlp_graphs):
        fwd, bwd = mlp_graphs
        fctx = make_ctx(fwd.graph)
        assert fctx.kind is GraphKind.FORWARD
        assert find_sites(fwd.graph, fctx) == 2
        assert [(s.op, s.role, s.shape) for s in fctx.sites] == [
            ("addmm", Role.FWD, (32, 64, 128)), ("mm", Role.FWD, (32, 128, 48))]
        # forward inputs are (x, w1, b1, w2): 1, 2 and 3 are parameters
        bctx = make_ctx(bwd.graph, params=frozenset({1, 2, 3}))
        assert bctx.kind is GraphKind.BACKWARD
        find_sites(bwd.graph, bctx)
        roles = sorted((s.role.value, s.shape) for s in bctx.sites)
        assert roles == [("dgrad", (32, 48, 128)), ("wgrad", (48, 32, 128)), ("wgrad", (128, 32, 64))]
        for site in bctx.sites:
            assert site.a_is_grad and not site.b_is_grad  # the incoming gradient is always A here
        assert {s.seq_nr for s in bctx.sites} <= {s.seq_nr for s in fctx.sites}

    def test_operand_layouts(self, mlp_graphs):
        fwd, bwd = mlp_graphs
        fctx = make_ctx(fwd.graph)
        find_sites(fwd.graph, fctx)
        # x @ W^T: W arrives as a transposed view
        assert [(s.a_major, s.b_major) for s in fctx.sites] == [("row", "column"), ("row", "column")]
        bctx = make_ctx(bwd.graph, params=frozenset({1, 2, 3}))
        find_sites(bwd.graph, bctx)
        layouts = {(s.role.value, s.shape): (s.a_major, s.b_major) for s in bctx.sites}
        assert layouts[("wgrad", (128, 32, 64))][0] == "column"  # dY^T @ x
        assert layouts[("dgrad", (32, 48, 128))] == ("row", "row")  # dY @ W

    def test_no_parameters_means_no_wgrad(self, mlp_graphs):
        _, bwd = mlp_graphs
        ctx = make_ctx(bwd.graph, params=frozenset())
        find_sites(bwd.graph, ctx)
        assert {s.role for s in ctx.sites} == {Role.DGRAD}

    def test_graph_without_gemms(self):
        fwd, _ = aot_graphs(lambda x: torch.relu(x) * 2, torch.randn(8, 8, requires_grad=True))
        ctx = make_ctx(fwd.graph)
        assert find_sites(fwd.graph, ctx) == 0 and ctx.sites == []

    def test_module_paths(self):
        assert clean_module_path("L['self'].layers[0].fc") == "layers.0.fc"
        assert clean_module_path("L['self']._modules['head']") == "head"
        assert clean_module_path("getattr(G.m, '0')") == "m.0"
        assert clean_module_path("L['self']") == ""
