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
