"""Models written the way public recsys code writes them, each trained a few steps under
loka (emulated FP8 on CPU): no crash, finite loss that goes down, every parameter that
takes part gets a gradient, and the report covers every GEMM site."""

import math
import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import loka_compile
from numerics import sqnr_db

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
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
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
@pytest.mark.parametrize("case", sorted(CASES))
def test_pattern_trains_through_the_default_probe_window(case):
    """No options: each graph (one per side of a graph break, the checkpointed recompute
    inside its backward) runs its probe window, then its FP8 variant, and trains on."""
    cls, make_inputs, to_logit = CASES[case]
    assert_trains_through_the_probe_window(cls(), make_inputs, to_logit)


def assert_trains_through_the_probe_window(model, make_inputs, to_logit):
    """Compiled with no options, 8 steps: the loss goes down, every graph ends in its FP8
    variant without a fallback, some site runs FP8, none is left probing."""
    compiled = torch.compile(model, backend="loka")
    losses = _train(model, compiled, make_inputs, to_logit, steps=8)
    assert losses[-2] < losses[0], losses
    report = loka_compile.report(compiled)
    assert report.graphs and not any(g.fallback for g in report.graphs), str(report)
    assert all(g.phase == "fp8" for g in report.graphs), [g.phase for g in report.graphs]
    assert any(s.fp8 for s in report.sites), report.table()
    assert not any(s.reason == "probing" for s in report.sites), report.table()


@pytest.mark.slow
def test_no_grad_evaluation_then_training_with_dynamic_batches():
    """Scoring under torch.no_grad first (an inference graph), then training on batches of
    changing size with dynamic=True: both graphs compile and train."""
    model = MultiTaskWithGraphBreak()
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0})
    with torch.no_grad():
        scores = compiled(torch.randn(32, 48))
    assert torch.isfinite(scores).all()
    _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out.sum(-1), dynamic_batches=True)
    kinds = {s.kind for s in loka_compile.report(compiled).sites}
    assert kinds == {"inference", "forward", "backward"}, kinds


class SequenceTransformerRanker(nn.Module):
    """A behavior-sequence transformer (BST) as public code writes it: item and position
    embeddings, nn.TransformerEncoder with a padding mask, target attention through
    nn.MultiheadAttention, an MLP on top."""

    def __init__(self, items=500, d=32, heads=4):
        super().__init__()
        self.item = nn.Embedding(items, d, padding_idx=0)
        self.pos = nn.Embedding(64, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.target_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.top = nn.Sequential(nn.Linear(2 * d, 64), nn.LeakyReLU(), nn.Linear(64, 1))

    def forward(self, history, target):
        padding = history == 0
        h = self.item(history) + self.pos(torch.arange(history.shape[1], device=history.device))
        h = self.encoder(h, src_key_padding_mask=padding)
        t = self.item(target).unsqueeze(1)
        attended, _ = self.target_attention(t, h, h, key_padding_mask=padding)
        return self.top(torch.cat([attended.squeeze(1), t.squeeze(1)], -1)).squeeze(-1)


@pytest.mark.slow
def test_sequence_transformer_with_varying_lengths_trains_then_evaluates():
    """Histories of a new length every few steps under dynamic=True (attention's batched
    GEMMs over a symbolic length), padding masks, then scoring in eval mode: no fallback,
    the loss goes down, the attention projections run FP8."""
    torch.manual_seed(0)
    model = SequenceTransformerRanker()
    compiled = torch.compile(model, backend="loka", dynamic=True,
                             options={"recipe": "rowwise", "probe_steps": 0})
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    targets, labels = torch.randint(1, 500, (16,)), torch.rand(16).round()
    losses = []
    for length in (12, 20, 7, 33, 12, 12):
        history = torch.randint(1, 500, (16, length))
        history[:, :2] = 0
        torch.manual_seed(1)  # dropout draws from the same seed at every step
        loss = F.binary_cross_entropy_with_logits(compiled(history, targets), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.isfinite(loss)
        losses.append(loss.item())
    assert min(losses[-3:]) < losses[0], losses
    model.eval()
    with torch.no_grad():
        scores = compiled(torch.randint(1, 500, (8, 12)), torch.randint(1, 500, (8,)))
    assert scores.shape == (8,) and torch.isfinite(scores).all()
    report = loka_compile.report(compiled)
    assert report.graphs and not any(g.fallback for g in report.graphs), str(report)
    assert {s.kind for s in report.sites} == {"forward", "backward", "inference"}
    assert any(s.fp8 and s.kind == "forward" for s in report.sites), report.table()


class DotInteractionRanker(nn.Module):
    """DLRM's shape: a bottom MLP for dense features, EmbeddingBag lookups, pairwise dot
    products of all of them (bmm, lower triangle gathered with tril_indices), a top MLP."""

    def __init__(self, tables=7, rows=200, dim=64):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        n = tables + 1
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        features = torch.stack([x] + [bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)], 1)
        dots = torch.bmm(features, features.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], 1)).squeeze(-1)


def test_autocast_bf16_training_of_fp32_weights():
    """Public training code keeps fp32 weights and runs the forward under bf16 autocast:
    the weights reach their GEMMs through a cast in the graph, and their gradients
    through its backward; loka still tells wgrad from dgrad and trains."""
    model = DotInteractionRanker()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})

    def step(*inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return compiled(*inputs)

    def make_inputs(b):
        ids, offsets = zip(*(_bags(b) for _ in range(7)))
        return torch.randn(b, 16), list(ids), list(offsets)

    losses = _train(model, step, make_inputs, lambda out: out.float())
    assert losses[-2] < losses[0], losses
    assert all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.parameters())
    report = loka_compile.report(compiled)
    assert not any(g.fallback for g in report.graphs), str(report)
    linears = [s for s in report.sites if s.op != "bmm"]
    assert any(s.fp8 for s in linears), report.table()
    wgrad = {s.module for s in linears if s.role == "wgrad"}
    assert wgrad == {s.module for s in linears if s.role == "fwd"}, report.table()  # one per linear


class MMoE(nn.Module):
    """Multi-gate mixture of experts as public code writes it: the experts' weights stacked
    in one parameter and applied with einsum, a softmax gate and a tower per task."""

    def __init__(self, d_in=64, experts=4, d_expert=64, tasks=2):
        super().__init__()
        self.expert_w = nn.Parameter(torch.randn(experts, d_in, d_expert) * d_in ** -0.5)
        self.expert_b = nn.Parameter(torch.zeros(experts, d_expert))
        self.gates = nn.ModuleList(nn.Linear(d_in, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d_expert, 32), nn.ReLU(), nn.Linear(32, 1))
                                    for _ in range(tasks))

    def forward(self, x):
        h = F.relu(torch.einsum("bd,edh->ebh", x, self.expert_w) + self.expert_b[:, None, :])
        return torch.stack([tower(torch.einsum("be,ebh->bh", torch.softmax(gate(x), -1), h)).squeeze(-1)
                            for gate, tower in zip(self.gates, self.towers)], -1)


@pytest.mark.slow
def test_mmoe_with_einsum_experts_trains():
    """The stacked expert weights reach one GEMM through einsum; loka sees it as a weight
    (a wgrad site for it) and trains."""
    torch.manual_seed(0)
    model = MMoE()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    losses = _train(model, compiled, lambda b: (torch.randn(b, 64),), lambda out: out.sum(-1), steps=4)
    assert losses[-2] < losses[0], losses
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    report = loka_compile.report(compiled)
    assert not any(g.fallback for g in report.graphs), str(report)
    # einsum("bd,edh->ebh") is one bmm over a batch of 1, [1, batch, d] @ [1, d, experts * h],
    # which find_sites folds into a 2-D site (no batch)
    experts = [s for s in report.sites if s.module == "" and s.op == "bmm" and s.batch is None]  # the root module
    assert {s.role for s in experts} == {"fwd", "wgrad"}, report.table()
    assert all(s.shape == (64, 64, 4 * 64) for s in experts), report.table()  # batch x d @ d x (experts * h)


class NormDropoutRanker(nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(48, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1))
        self.top = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.top(self.bottom(x)).squeeze(-1)


@pytest.mark.slow
def test_freezing_the_bottom_mid_training_recompiles_and_trains_on():
    """Fine-tuning code freezes a tower between steps: Dynamo recompiles with other inputs
    requiring grad and loka compiles the new graphs without touching the frozen weights."""
    torch.manual_seed(0)
    model = NormDropoutRanker()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out, steps=2)
    for p in model.bottom.parameters():
        p.requires_grad_(False)
    frozen = [p.detach().clone() for p in model.bottom.parameters()]
    losses = _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out, steps=4)
    assert losses[-2] < losses[0], losses
    assert all(torch.equal(before, p) for before, p in zip(frozen, model.bottom.parameters()))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.top.parameters())
    report = loka_compile.report(compiled)
    assert len(report.graphs) >= 2 and not any(g.fallback for g in report.graphs), str(report)


@pytest.mark.slow
def test_train_then_eval_then_train_with_batchnorm_and_dropout():
    """model.eval() under torch.no_grad between training steps: the inference graph, past its
    probe window, uses the running statistics and no dropout (two calls agree, and agree
    with eager), and training resumes on its own graph."""
    torch.manual_seed(0)
    model = NormDropoutRanker()
    compiled = torch.compile(model, backend="loka")
    _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out, steps=3)
    model.eval()
    x = torch.randn(64, 48)
    with torch.no_grad():
        window = [compiled(x) for _ in range(2)]  # the inference graph's probe window
        first, second, eager = compiled(x), compiled(x), model(x)
    assert all(g.phase == "fp8" for g in loka_compile.report(compiled).graphs)
    torch.testing.assert_close(first, second)
    assert sqnr_db(eager, first) > 20.0 and sqnr_db(eager, window[0]) > 20.0
    model.train()
    losses = _train(model, compiled, lambda b: (torch.randn(b, 48),), lambda out: out, steps=4)
    assert all(math.isfinite(v) for v in losses)
    report = loka_compile.report(compiled)
    assert {s.kind for s in report.sites} == {"inference", "forward", "backward"}
    assert not any(g.fallback for g in report.graphs), str(report)


# LoRA fine-tuning of a pretrained ranking tower: the pretrained weights (and the embedding
# table) are frozen, the low-rank factors, the LayerNorm and a new task head train.


class MergedLoRALinear(nn.Module):
    """The adapter merged into the weight before the matmul, as code that serves merged
    adapters writes it: one GEMM with `W + A @ B`. W is frozen; A and B train."""

    def __init__(self, in_features, out_features, rank=16):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.lora_a = nn.Parameter(torch.zeros(out_features, rank))
        self.lora_b = nn.Parameter(torch.empty(rank, in_features))
        nn.init.kaiming_uniform_(self.lora_b, a=math.sqrt(5))

    def forward(self, x):
        return F.linear(x, self.weight + self.lora_a @ self.lora_b)


class LoRAAdapter(nn.Module):
    """The common unmerged form: a frozen base linear plus `(x @ A) @ B * scaling`."""

    def __init__(self, in_features, out_features, rank=16, alpha=32):
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(in_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(rank, out_features))
        self.scaling = alpha / rank

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a) @ self.lora_b * self.scaling


class LoRARanker(nn.Module):
    """Dense features and a frozen EmbeddingBag lookup, concatenated, through two adapted
    layers, then a trainable head. No input needs a gradient, so fc1 has no dgrad of x."""

    def __init__(self, adapter, rows=200, dim=32, n_dense=32):
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum")
        self.emb.requires_grad_(False)
        self.fc1 = adapter(n_dense + dim, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = adapter(128, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, dense, ids, offsets):
        x = torch.cat([dense, self.emb(ids, offsets)], dim=1)
        x = torch.relu(self.norm(self.fc1(x)))
        return self.head(torch.relu(self.fc2(x))).squeeze(-1)


LORA_FORMS = {"merged": MergedLoRALinear, "adapter": LoRAAdapter}


def _ranker_inputs(batch):
    return (torch.randn(batch, 32), *_bags(batch))


def _lora_sites(form):
    """One training step of a fresh LoRARanker under loka: its report's sites."""
    compiled = torch.compile(LoRARanker(LORA_FORMS[form]), backend="loka", options={"probe_steps": 0})
    compiled(*_ranker_inputs(64)).sum().backward()
    sites = loka_compile.report(compiled).sites
    print(form, sorted((s.module, s.role, s.reason) for s in sites))  # shown on failure
    return sites


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(LORA_FORMS))
def test_lora_fine_tuning_trains_under_loka(form):
    model = LoRARanker(LORA_FORMS[form])
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    losses = _train(model, compiled, _ranker_inputs, lambda out: out)
    assert losses[-2] < losses[0], losses
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        else:
            assert p.grad is None and torch.equal(p, frozen[name]), name
    assert all(layer.lora_a.grad.abs().sum() > 0 for layer in (model.fc1, model.fc2))
    report = loka_compile.report(compiled)
    assert report.sites and not any(g.fallback for g in report.graphs), str(report)
    assert any(s.fp8 for s in report.sites), report.table()


def test_unmerged_lora_adapter_roles():
    """`base(x) + (x @ A) @ B * scaling`: per adapted layer three forward GEMMs; in the
    backward the gradients of B (h^T @ g) and of A (x^T @ dh) are wgrad, kept in high
    precision by the default recipe; dh = g @ B^T and the gradients of the layer's input
    (through A and through the frozen base weight) are dgrad, in FP8. The frozen base has
    no wgrad, and fc1's input needs no gradient, so fc1 has one dgrad (dh) only."""
    sites = _lora_sites("adapter")
    roles = sorted(s.role for s in sites)
    assert roles == ["dgrad"] * 5 + ["fwd"] * 7 + ["wgrad"] * 5, roles
    by_module = sorted((s.module, s.role) for s in sites if s.role != "dgrad")
    assert by_module == [("fc1", "fwd"), ("fc1", "fwd"), ("fc1", "wgrad"), ("fc1", "wgrad"), ("fc1.base", "fwd"),
                         ("fc2", "fwd"), ("fc2", "fwd"), ("fc2", "wgrad"), ("fc2", "wgrad"), ("fc2.base", "fwd"),
                         ("head", "fwd"), ("head", "wgrad")], by_module
    lora = [s for s in sites if s.module in ("fc1", "fc2")]
    assert all(s.reason == "recipe_high_precision" for s in lora if s.role == "wgrad")
    assert all(s.fp8 for s in lora if s.role != "wgrad")


def test_unmerged_lora_adapter_dgrad_modules():
    sites = _lora_sites("adapter")
    dgrad = sorted(s.module for s in sites if s.role == "dgrad")
    assert dgrad == ["fc1", "fc2", "fc2", "fc2.base", "head"], dgrad


def test_merged_lora_roles():
    """`F.linear(x, W + A @ B)` with W frozen: per layer two forward GEMMs (A @ B, and the
    linear). Backward: dW_eff = g^T @ x is the weight gradient of the merged weight (it
    contracts over the batch, and all of it goes into dA and dB), and dA, dB are the
    parameters' gradients: three wgrad GEMMs per layer, all in high precision under the
    default recipe. fc2's dgrad (g @ W_eff) is the only dgrad besides the head's; fc1's
    input needs no gradient."""
    sites = _lora_sites("merged")
    roles = sorted((s.module, s.role) for s in sites)
    assert roles == [("fc1", "fwd"), ("fc1", "fwd"), ("fc1", "wgrad"), ("fc1", "wgrad"), ("fc1", "wgrad"),
                     ("fc2", "dgrad"), ("fc2", "fwd"), ("fc2", "fwd"), ("fc2", "wgrad"), ("fc2", "wgrad"),
                     ("fc2", "wgrad"), ("head", "dgrad"), ("head", "fwd"), ("head", "wgrad")], roles
    lora_wgrad = [s for s in sites if s.role == "wgrad" and s.module != "head"]  # the 1-wide head is too_small
    assert all(s.reason == "recipe_high_precision" and not s.fp8 for s in lora_wgrad), lora_wgrad


# DistributedDataParallel: two CPU ranks over gloo, each compiling its DDP-wrapped model
# with loka. With `optimize_ddp` on (Dynamo's default) DDPOptimizer splits the graph at
# DDP's bucket boundaries, and loka compiles each piece.


class DDPTower(nn.Module):
    """A user-defined module: Dynamo compiles nothing of DDP(nn.Sequential(...)) in torch
    2.13 (the inner Sequential.forward frame, run after DDP's forward graph-breaks, is
    skipped), whatever the backend."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm = nn.Linear(64, 256), nn.LayerNorm(256)
        self.fc2, self.fc3, self.head = nn.Linear(256, 512), nn.Linear(512, 512), nn.Linear(512, 16)

    def forward(self, x):
        x = torch.relu(self.norm(self.fc1(x)))
        return self.head(torch.relu(self.fc3(torch.relu(self.fc2(x)))))


DDP_WORLD_SIZE = 2
DDP_TIMEOUT_S = 240


def _ddp_rank(rank, optimize_ddp):
    """One rank: DDP over gloo, compiled with loka, three SGD steps on this rank's data:
    its parameters, losses and report sites."""
    torch._dynamo.config.optimize_ddp = optimize_ddp
    torch.manual_seed(0)
    model = DDPTower()
    initial = [p.detach().clone() for p in model.parameters()]
    # 1 MiB buckets (DDP's first bucket size): fc3's 1 MiB weight starts a second one
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    compiled = torch.compile(ddp, backend="loka", options={"probe_steps": 0})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 16, generator=data)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    report = loka_compile.report(compiled)
    return {
        "initial": initial, "params": [p.detach().clone() for p in model.parameters()], "losses": losses,
        "graphs": [(g.name, g.fallback) for g in report.graphs],
        "sites": [(s.graph, s.module, s.role, s.fp8, s.reason) for s in report.sites],
        "table": report.table(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("optimize_ddp", [True, False], ids=["ddp_optimizer", "whole_graph"])
def test_ddp_two_cpu_ranks_gloo(optimize_ddp, tmp_path):
    from spawn_ranks import run_ranks

    results = run_ranks(_ddp_rank, (optimize_ddp,), DDP_WORLD_SIZE, DDP_TIMEOUT_S, tmp_path,
                        threads=max(1, (os.cpu_count() or 2) // DDP_WORLD_SIZE))

    for r in results:
        assert all(math.isfinite(loss) for loss in r["losses"]), r["losses"]
        assert not any(torch.equal(p, q) for p, q in zip(r["initial"], r["params"]))  # every parameter moved
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own data
    # the gradients were all-reduced: both ranks took the same steps
    for p0, p1 in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p0, p1)

    for r in results:
        print(r["table"])
        assert r["graphs"] and not any(fallback for _, fallback in r["graphs"]), r["graphs"]
        # DDPOptimizer: one graph per bucket, [fc1, norm, fc2] and [fc3, head]
        assert len(r["graphs"]) == (2 if optimize_ddp else 1), r["graphs"]
        assert any(fp8 for _, _, _, fp8, _ in r["sites"])
        roles = sorted((module, role) for _, module, role, _, _ in r["sites"])
        assert roles == [("fc1", "fwd"), ("fc1", "wgrad"), ("fc2", "dgrad"), ("fc2", "fwd"), ("fc2", "wgrad"),
                         ("fc3", "dgrad"), ("fc3", "fwd"), ("fc3", "wgrad"),
                         ("head", "dgrad"), ("head", "fwd"), ("head", "wgrad")], roles
        assert all(fp8 == (role != "wgrad") for _, _, role, fp8, _ in r["sites"]), r["table"]
