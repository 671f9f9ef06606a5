"""The pair_products Mod (opt-in): PNN's inner products of field pairs read from one [B, F, d]
tensor instead of two concatenations of repeated fields. The joint-graph rewrite on deepctr-torch's
InnerProductLayer as the library builds it (outputs and every gradient bit-exact on CPU, p and q
no longer saved for the backward), the products it leaves alone, then compiled under loka with the
Mod on and off."""

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import loka_compile
from loka_compile.passes.mods.pair_products import rewrite_pair_products

pytestmark = [pytest.mark.usefixtures("fresh_compile_state", "one_thread"),
              pytest.mark.skipif(importlib.util.find_spec("deepctr_torch") is None,
                                 reason="the public extra is not installed: pip install -e '.[public]'")]


def _inner_product(*embeddings):
    from deepctr_torch.layers.interaction import InnerProductLayer
    return torch.flatten(InnerProductLayer()(list(embeddings)), start_dim=1)


def _run(fn, embeddings, rewrite: bool):
    """fn's output and its embeddings' gradients through AOTAutograd's joint graph, rewritten by
    the Mod or not, partitioned as Inductor partitions; (output, gradients, rewrites, the tensors
    the forward saves for the backward)."""
    inputs = [e.detach().clone().requires_grad_() for e in embeddings]
    found, saved = [], []

    def partition(joint, joint_inputs, **kwargs):
        found.append(rewrite_pair_products(joint.graph) if rewrite else 0)
        joint.graph.lint()
        joint.recompile()
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        saved.extend(n.meta["val"] for n in backward.graph.find_nodes(op="placeholder")
                     if not n.name.startswith("tangents"))
        return forward, backward

    def keep(gm, _):
        return make_boxed_func(gm.forward)

    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    return out.detach(), [e.grad for e in inputs], found[0], saved


def _embeddings(fields=6, batch=16, dim=8):
    return [torch.randn(batch, 1, dim) for _ in range(fields)]


def test_pnn_inner_products_are_bit_exact_and_save_no_copies():
    torch.manual_seed(0)
    embeddings = _embeddings()
    out, grads, _, saved_before = _run(_inner_product, embeddings, rewrite=False)
    got, got_grads, rewritten, saved_after = _run(_inner_product, embeddings, rewrite=True)
    assert rewritten == 1
    assert torch.isfinite(got).all() and torch.equal(out, got)
    for want, have in zip(grads, got_grads):
        assert torch.isfinite(have).all() and torch.equal(want, have)
    pairs = 6 * 5 // 2
    assert any(t.shape[1] == pairs and t.dim() == 3 for t in saved_before)  # p and q, as written
    assert not any(t.dim() == 3 and t.shape[1] == pairs for t in saved_after)


def test_without_keepdim():
    torch.manual_seed(0)
    embeddings = _embeddings(fields=5)

    def inner_product(*fields):                  # InnerProductLayer's pairs, summed without keepdim
        pairs = [(i, j) for i in range(len(fields)) for j in range(i + 1, len(fields))]
        p = torch.cat([fields[i] for i, _ in pairs], 1)
        q = torch.cat([fields[j] for _, j in pairs], 1)
        return (p * q).sum(-1)

    out, grads, _, _ = _run(inner_product, embeddings, rewrite=False)
    got, got_grads, rewritten, _ = _run(inner_product, embeddings, rewrite=True)
    assert rewritten == 1 and got.shape == (16, 10) and torch.equal(out, got)
    assert all(torch.equal(a, b) for a, b in zip(grads, got_grads))


def test_leaves_other_products_alone():
    torch.manual_seed(0)
    e = _embeddings(fields=4)

    def scattered(*fields):                      # every pair its own run: more runs than half the pairs
        order = [(0, 3), (1, 2), (0, 1), (2, 3), (1, 3), (0, 2)]
        p = torch.cat([fields[i] for i, _ in order], 1)
        q = torch.cat([fields[j] for _, j in order], 1)
        return (p * q).sum(2, keepdim=True).flatten(1)

    def p_read_elsewhere(*fields):               # p is an output too: its copy is needed anyway
        p = torch.cat([fields[0], fields[0], fields[1]], 1)
        q = torch.cat([fields[1], fields[2], fields[2]], 1)
        return torch.cat([(p * q).sum(2, keepdim=True).flatten(1), p.flatten(1)], 1)

    for fn in (scattered, p_read_elsewhere):
        out, grads, _, _ = _run(fn, e, rewrite=False)
        got, got_grads, rewritten, _ = _run(fn, e, rewrite=True)
        assert rewritten == 0 and torch.equal(out, got), fn.__name__
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, got_grads))


class PNNInteraction(nn.Module):
    """deepctr-torch PNN's inner-product path: the flattened embeddings and their pair products
    into the DNN's first Linear."""

    def __init__(self, fields=6, dim=16):
        super().__init__()
        self.dnn = nn.Linear(fields * dim + fields * (fields - 1) // 2, 16)

    def forward(self, embeddings):
        linear_signal = torch.flatten(torch.cat(embeddings, dim=1), start_dim=1)
        return self.dnn(torch.cat([linear_signal, _inner_product(*embeddings)], dim=1))


@pytest.mark.slow
def test_pnn_under_loka_is_bit_exact_with_the_mod_on_and_off():
    torch.manual_seed(0)
    model, embeddings = PNNInteraction(), _embeddings(batch=32, dim=16)
    runs = {}
    for enabled in ((), ("pair_products",)):
        loka_compile.reset()
        torch._dynamo.reset()
        trained = copy.deepcopy(model)
        inputs = [e.clone().requires_grad_() for e in embeddings]
        compiled = torch.compile(trained, backend="loka", options=dict(probe_steps=0, speed_check=False,
                                                                       enabled_mods=list(enabled)))
        out = compiled(inputs)
        out.square().mean().backward()
        runs[enabled] = out.detach(), [p.grad for p in trained.parameters()] + [e.grad for e in inputs], \
            loka_compile.report(compiled)
    (out, grads, report_off), (got, got_grads, report) = runs[()], runs[("pair_products",)]
    assert report.mods["pair_products"] == 1 and report_off.mods["pair_products"] == 0
    assert torch.isfinite(got).all() and torch.equal(out, got)
    assert all(torch.equal(a, b) for a, b in zip(grads, got_grads))


@pytest.mark.slow
def test_pnn_inference_under_loka_is_bit_exact_with_the_mod_on_and_off():
    """Inference graphs have no backward to save p and q for: the forward rewrite alone."""
    torch.manual_seed(0)
    model, embeddings = PNNInteraction().eval(), _embeddings(batch=32, dim=16)
    outs = {}
    for enabled in ((), ("pair_products",)):
        loka_compile.reset()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="loka", options=dict(probe_steps=0, speed_check=False,
                                                                     enabled_mods=list(enabled)))
        with torch.no_grad():
            outs[enabled] = compiled(embeddings), loka_compile.report(compiled)
    (out, report_off), (got, report) = outs[()], outs[("pair_products",)]
    assert report.mods["pair_products"] == 1 and report_off.mods["pair_products"] == 0
    assert torch.isfinite(got).all() and torch.equal(out, got)
    graph = next(gm for name, gm in report.graph_modules.items() if name.endswith("inference"))
    assert max(len(n.args[0]) for n in graph.graph.nodes if n.target is torch.ops.aten.cat.default) < 15
