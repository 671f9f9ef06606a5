"""The opt-in architecture Mods: block_norm numerics, the eager module swap, the Dynamo
graph pass (positive and negative cases), and a compiled training step."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx

import loka_compile
from loka_compile.kernels.block_norm import block_norm, block_size
from loka_compile.modules import BlockNorm
from loka_compile.passes import mods as arch_mods
from numerics import rel_error
from graphs import dynamo_graph, targets

ALL_MODS = ("blocknorm", "no_bias", "hardswish")

# block_norm against a float64 reference, worst over these shapes and 5 seeds (CPU):
# fp32 8e-8, bf16 1.8e-3 (the bf16 rounding of inputs and output).
REL_ERROR_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 5e-3}


@pytest.mark.parametrize("dim, width", [(512, 256), (768, 256), (384, 192), (320, 160), (48, 48),
                                        (100, 100), (1000, 1000)])
def test_block_size_rule(dim, width):
    assert block_size(dim) == width


def block_norm_float64(x, width, eps, weight, bias):
    blocks = [b / torch.sqrt(b.pow(2).mean(-1, keepdim=True) + eps) for b in x.double().split(width, -1)]
    y = torch.cat(blocks, -1)
    if weight is not None:
        y = y * weight.double()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 512), (3, 5, 384), (7, 100)])
@pytest.mark.parametrize("affine", [False, True])
def test_block_norm_matches_float64_reference(shape, dtype, affine):
    dim = shape[-1]
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    weight = torch.randn(dim).to(dtype) if affine else None
    bias = torch.randn(dim).to(dtype) if affine else None
    y = block_norm(x, eps=1e-6, weight=weight, bias=bias)
    assert y.dtype == dtype and y.shape == x.shape
    reference = block_norm_float64(x, block_size(dim), 1e-6, weight, bias)
    assert rel_error(reference, y) <= REL_ERROR_FLOOR[dtype]


def test_block_norm_normalizes_each_block_not_the_row():
    x = torch.cat([torch.full((2, 256), 10.0), torch.full((2, 256), 0.1)], -1)
    y = block_norm(x)
    torch.testing.assert_close(y, torch.ones_like(y), rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="block must be a positive int"):
        block_norm(x, block=0)
    with pytest.raises(ValueError, match="weight must have shape"):
        block_norm(x, weight=torch.ones(256))


class Tower(nn.Module):
    """fc1 -> LayerNorm -> SiLU -> fc2 (returned too, so a head) -> silu -> LayerNorm over
    two dims -> head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 512)
        self.norm = nn.LayerNorm(512)
        self.act = nn.SiLU()
        self.fc2 = nn.Linear(512, 64)
        self.pair_norm = nn.LayerNorm((4, 16))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.act(self.norm(self.fc1(x)))
        e = self.fc2(h)
        p = self.pair_norm(F.silu(e).view(-1, 4, 16)).flatten(1)
        return self.head(p), e


def tower_with_mods(m, x):
    """Tower's forward with all three Mods written out by hand."""
    h = F.hardswish(block_norm(F.linear(x, m.fc1.weight), eps=m.norm.eps, weight=m.norm.weight, bias=m.norm.bias))
    e = m.fc2(h)
    p = m.pair_norm(F.hardswish(e).view(-1, 4, 16)).flatten(1)
    return m.head(p), e


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 512), nn.LayerNorm(512), nn.SiLU(),
                                  nn.Linear(512, 64), nn.LayerNorm(64), nn.SiLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(x))


def test_module_swap_on_mlp():
    model = MLP()
    original = copy.deepcopy(model)
    norm_weight = model.body[1].weight
    x = torch.randn(16, 32)
    counts = loka_compile.apply_arch_mods(model, ALL_MODS)
    assert counts == {"blocknorm": 2, "no_bias": 2, "hardswish": 2}
    assert isinstance(model.body[1], BlockNorm) and model.body[1].weight is norm_weight
    assert isinstance(model.body[2], nn.Hardswish)
    assert model.body[0].bias is None and model.body[3].bias is None
    assert isinstance(model.head.bias, nn.Parameter)
    assert "body.0.bias" not in dict(model.named_parameters())

    b = original.body
    h = F.hardswish(block_norm(F.linear(x, b[0].weight), eps=b[1].eps, weight=b[1].weight, bias=b[1].bias))
    h = F.hardswish(block_norm(F.linear(h, b[3].weight), eps=b[4].eps, weight=b[4].weight, bias=b[4].bias))
    expected = original.head(h)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
        assert not torch.allclose(model(x), original(x), atol=1e-3)


def test_module_swap_options():
    model = MLP()
    assert loka_compile.apply_arch_mods(model, ()) == {}
    assert loka_compile.apply_arch_mods(model, ["no_bias"], heads=["head", "body.3"]) == {"no_bias": 1}
    assert model.body[3].bias is not None and model.body[0].bias is None
    assert isinstance(model.body[1], nn.LayerNorm)
    with pytest.raises(ValueError, match="valid arch_mods"):
        loka_compile.apply_arch_mods(model, ["layernorm"])
    with pytest.raises(ValueError, match="not nn.Linear submodules"):
        loka_compile.apply_arch_mods(model, ["no_bias"], heads=["body.1"])
    with pytest.raises(ValueError, match="last dimension only"):
        BlockNorm((4, 16))


def linear_bias_args(gm):
    return [len(n.args) == 3 and n.args[2] is not None
            for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear]


def test_graph_pass_on_dynamo_graph():
    model, x = Tower(), torch.randn(8, 32)
    gm, example_inputs = dynamo_graph(model, x)
    assert targets(gm.graph).count(F.layer_norm) == 2 and targets(gm.graph).count(F.silu) == 2
    assert linear_bias_args(gm) == [True, True, True]

    counts = arch_mods.apply_arch_mods(gm, ALL_MODS)

    assert counts == {"blocknorm": 1, "no_bias": 1, "hardswish": 2}
    assert targets(gm.graph).count(block_norm) == 1
    assert targets(gm.graph).count(F.layer_norm) == 1          # the norm over (4, 16) declined
    assert F.silu not in targets(gm.graph) and targets(gm.graph).count(F.hardswish) == 2
    assert linear_bias_args(gm) == [False, True, True]   # fc2 (returned) and head are heads
    with torch.no_grad():
        torch.testing.assert_close(gm(*example_inputs), tower_with_mods(model, x))


def test_graph_pass_on_call_module_nodes():
    model, x = Tower(), torch.randn(8, 32)
    gm = torch.fx.symbolic_trace(model)
    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} == \
        {"fc1", "norm", "act", "fc2", "pair_norm", "head"}

    assert arch_mods.apply_arch_mods(gm, ALL_MODS) == {"blocknorm": 1, "no_bias": 1, "hardswish": 2}

    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} == {"fc2", "pair_norm", "head"}
    with torch.no_grad():
        torch.testing.assert_close(gm(x), tower_with_mods(model, x))


def test_graph_pass_declines():
    model, x = Tower(), torch.randn(8, 32)
    gm, _ = dynamo_graph(model, x)
    code = gm.code
    assert arch_mods.apply_arch_mods(gm, ()) == {}
    assert arch_mods.apply_arch_mods(gm, ["hardswish"]) == {"hardswish": 2}
    assert F.layer_norm in targets(gm.graph) and linear_bias_args(gm) == [True, True, True]
    assert gm.code != code
    with pytest.raises(ValueError, match="valid arch_mods"):
        arch_mods.apply_arch_mods(gm, ["swish"])


def test_config_arch_mods_names_match_the_pass():
    assert loka_compile.LokaConfig(arch_mods=ALL_MODS).arch_mods == arch_mods.ARCH_MODS == ALL_MODS


def test_compiled_training_step_with_arch_mods():
    torch._dynamo.reset()
    model, x, y = MLP(), torch.randn(32, 32), torch.randn(32, 1)
    reference = copy.deepcopy(model)
    loka_compile.apply_arch_mods(reference, ALL_MODS)
    counts = []

    def backend(gm, example_inputs):
        counts.append(arch_mods.apply_arch_mods(gm, ALL_MODS))
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.mse_loss(compiled(x), y)
    loss.backward()
    optimizer.step()

    assert counts == [{"blocknorm": 2, "no_bias": 2, "hardswish": 2}]
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.mse_loss(reference(x), y), rtol=1e-5, atol=1e-6)
    assert model.body[0].bias.grad is None and model.head.bias.grad is not None
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.isfinite(F.mse_loss(compiled(x), y))
