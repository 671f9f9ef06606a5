"""passes/keepdim_outputs.py on small AOTAutograd graphs: a keepdim sum/prod the graph returns
becomes the reduction without its kept dims, viewed back; a negative case each; and the
rewrite guard of passes/rewrite.py that refuses a replacement of another shape."""

import pytest
import torch

from loka_compile.passes.keepdim_outputs import keepdim_outputs
from loka_compile.passes.rewrite import MisshapedReplacement, replace_with_traced
from graphs import aot_graphs, make_ctx, targets

aten = torch.ops.aten


def _returned(graph):
    return next(n for n in graph.nodes if n.op == "output").all_input_nodes


def _broadcast_bias(x, w, b):  # deepctr-torch's LogTransformLayer form: its bias's gradient is a keepdim sum
    return torch.exp(torch.matmul(x, w) + b)


def test_a_returned_keepdim_sum_becomes_a_view_of_the_plain_sum():
    x, w, b = torch.randn(4, 6, 8), torch.randn(8, 16), torch.randn(1, 1, 16)
    backward = aot_graphs(_broadcast_bias, x, w.requires_grad_(), b.requires_grad_())[1]
    kept = [n for n in _returned(backward.graph) if n.target is aten.sum.dim_IntList and n.args[2:3] == (True,)]
    assert len(kept) == 1  # the bias's gradient, as AOTAutograd writes it
    inputs = [torch.randn(p.meta["val"].shape, dtype=p.meta["val"].dtype)
              for p in backward.graph.find_nodes(op="placeholder")]
    before = backward(*inputs)
    assert keepdim_outputs(backward.graph, make_ctx(backward.graph)) == 1
    backward.graph.lint()
    backward.recompile()
    bias_grad = next(n for n in _returned(backward.graph) if tuple(n.meta["val"].shape) == (1, 1, 16))
    assert bias_grad.target is aten.view.default
    assert bias_grad.args[0].target is aten.sum.dim_IntList and bias_grad.args[0].args[2:] in ((), (False,))
    assert tuple(bias_grad.args[0].meta["val"].shape) == (16,)
    after = backward(*inputs)
    assert all(a.shape == c.shape and torch.equal(a, c) for a, c in zip(before, after) if a is not None)


def test_keepdim_prod_returned_and_reductions_not_returned():
    forward = aot_graphs(lambda t: t.sum(0, keepdim=True).exp() * t + t.sum(1), torch.rand(5, 5, requires_grad=True))[0]
    code = forward.graph.python_code("self").src
    assert keepdim_outputs(forward.graph, make_ctx(forward.graph)) == 0  # the keepdim sum is read, not returned
    assert forward.graph.python_code("self").src == code

    graph = aot_graphs(lambda t: t.prod(1, keepdim=True), torch.rand(5, 7).requires_grad_())[0]
    assert keepdim_outputs(graph.graph, make_ctx(graph.graph)) == 1
    graph.recompile()
    out = graph(torch.rand(5, 7) + 0.5)[0]
    assert out.shape == (5, 1)
    assert aten.prod.dim_int in targets(graph.graph) and aten.view.default in targets(graph.graph)


def test_a_replacement_of_another_shape_is_refused_and_the_graph_left_as_it_was():
    b = torch.randn(1, 1, 16, requires_grad=True)
    backward = aot_graphs(_broadcast_bias, torch.randn(4, 6, 8), torch.randn(8, 16), b)[1]
    (kept,) = [n for n in _returned(backward.graph) if n.target is aten.sum.dim_IntList]
    code = backward.graph.python_code("self").src
    with pytest.raises(MisshapedReplacement, match=r"\[16\] where the node gives torch.float32 \[1, 1, 16\]"):
        replace_with_traced(kept, lambda g: g.sum([0, 1]), [kept.args[0]])  # the flat [N] gradient
    backward.graph.lint()
    assert backward.graph.python_code("self").src == code
    replace_with_traced(kept, lambda g: g.sum([0, 1]).view(1, 1, -1), [kept.args[0]])  # the same tensor: taken
