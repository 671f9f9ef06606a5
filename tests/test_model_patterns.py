"""Models written the way public recsys code writes them, each trained a few steps under
loka (emulated FP8 on CPU): no crash, finite loss that goes down, every parameter that
takes part gets a gradient, and the report covers every GEMM site."""

import pytest
import torch
from torch import nn

import loka_compile

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


class TwoTowerWithBags(nn.Module):
    """EmbeddingBag lookups with offsets, a shared tower for user and item, dot scoring."""

    def __init__(self, rows=200, dim=32):
        super().__init__()
        self.user_bag = nn.EmbeddingBag(rows, dim, mode="sum")
        self.item_bag = nn.EmbeddingBag(rows, dim, mode="mean")
        self.tower = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, user_ids, user_offsets, item_ids, item_offsets):
        user = self.tower(self.user_bag(user_ids, user_offsets))
        item = self.tower(self.item_bag(item_ids, item_offsets))
        return (user * item).sum(-1)


class MultiTaskWithGraphBreak(nn.Module):
    """A shared bottom, a graph break (logging in the middle of forward), two task heads."""

    def __init__(self):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(48, 96), nn.LayerNorm(96), nn.ReLU())
        self.ctr = nn.Sequential(nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 1))
        self.cvr = nn.Sequential(nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        h = self.bottom(x)
        torch._dynamo.graph_break()
        return torch.cat([self.ctr(h), self.cvr(h)], dim=-1)


class InteractionWithCheckpoint(nn.Module):
    """A 3-D pairwise interaction (bmm of features with themselves) inside activation
    checkpointing, then an MLP over the flattened interactions."""

    def __init__(self, features=8, dim=32):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(features * features, 64), nn.ReLU(), nn.Linear(64, 1))

    def interact(self, x):
        y = self.proj(x)
        return torch.bmm(y, y.transpose(1, 2)).flatten(1)

    def forward(self, x):
        z = torch.utils.checkpoint.checkpoint(self.interact, x, use_reentrant=False)
        return self.mlp(z).squeeze(-1)


def _bags(batch, rows=200, per_row=3):
    ids = torch.randint(0, rows, (batch * per_row,))
    offsets = torch.arange(0, batch * per_row, per_row)
    return ids, offsets


CASES = {
    "two_tower_bags": (TwoTowerWithBags, lambda b: (*_bags(b), *_bags(b)), lambda out: out),
    "multi_task_graph_break": (MultiTaskWithGraphBreak, lambda b: (torch.randn(b, 48),), lambda out: out.sum(-1)),
    "interaction_checkpoint": (InteractionWithCheckpoint, lambda b: (torch.randn(b, 8, 32),), lambda out: out),
}


def _train(model, compiled, make_inputs, to_logit, steps=6, batch=64, dynamic_batches=False):
    torch.manual_seed(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    fixed = [make_inputs(batch) for _ in range(2)]
    labels = [torch.randint(0, 2, (batch,)).float() for _ in range(2)]
    losses = []
    for step in range(steps):
        inputs, y = fixed[step % 2], labels[step % 2]
        if dynamic_batches and step % 2:
            size = batch // 2 + step
            inputs, y = make_inputs(size), torch.randint(0, 2, (size,)).float()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.binary_cross_entropy_with_logits(to_logit(compiled(*inputs)), y)
        loss.backward()
        assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_pattern_trains_under_loka(case):
    cls, make_inputs, to_logit = CASES[case]
    model = cls()
    compiled = torch.compile(model, backend="loka")
    losses = _train(model, compiled, make_inputs, to_logit)
    assert losses[-2] < losses[0], losses  # the same batch, four Adam steps later
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    report = loka_compile.report(compiled)
    assert report.sites and not any(g.fallback for g in report.graphs), str(report)
    assert any(s.fp8 for s in report.sites), report.table()
    assert {s.role for s in report.sites} == {"fwd", "dgrad", "wgrad"}
    # a product of two activations has no weight: its gradients are dgrad
    assert {s.role for s in report.sites if s.op == "bmm"} <= {"fwd", "dgrad"}


@pytest.mark.slow
def test_no_grad_evaluation_then_training_with_dynamic_batches():
    """Scoring under torch.no_grad first (an inference graph), then training on batches of
    changing size with dynamic=True: both graphs compile and train."""
    model = MultiTaskWithGraphBreak()
    compiled = torch.compile(model, backend="loka", dynamic=True)
    with torch.no_grad():
        scores = compiled(torch.randn(32, 48))
    assert torch.isfinite(scores).all()
    _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out.sum(-1), dynamic_batches=True)
    kinds = {s.kind for s in loka_compile.report(compiled).sites}
    assert kinds == {"inference", "forward", "backward"}, kinds
