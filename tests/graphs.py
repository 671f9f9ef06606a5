"""Graph helpers for the tests: what a torch.compile backend receives."""

import torch


def dynamo_graph(model, *inputs):
    """The GraphModule and example inputs a torch.compile backend receives for `model`."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=record)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def loka_and_eager_grads(model, x, options):
    """One backward of sum(model(x)) compiled with loka (`options`) and of an eager copy:
    (loka's report, [(parameter name, loka's gradient, eager's gradient)])."""
    import copy

    import loka_compile

    eager = copy.deepcopy(model)
    eager(x).sum().backward()
    compiled = torch.compile(model, backend="loka", options=options)
    compiled(x).sum().backward()
    grads = [(name, p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), eager.parameters())]
    return loka_compile.report(compiled), grads
