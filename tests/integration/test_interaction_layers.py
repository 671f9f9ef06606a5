"""Recsys interaction layers written the way public recsys code (DeepCTR-Torch, FuxiCTR,
torchrec examples, RecBole) writes them, each trained a few steps under loka (emulated FP8
on CPU): no crash, finite loss that goes down, every parameter that takes part gets a
finite gradient, no graph falls back, and some GEMM site runs in FP8."""

import functools
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.parametrizations import weight_norm

import loka_compile
from numerics import sqnr_db
from test_model_patterns import _train, assert_trains_through_the_probe_window

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

FIELDS, ROWS, ITEMS, HISTORY = 8, 200, 500, 12


class FieldEmbeddings(nn.Module):
    """One table for all fields, each field's ids shifted into its own rows (FuxiCTR's and
    torchrec's layout): ids [B, F] -> embeddings [B, F, d]."""

    def __init__(self, fields=FIELDS, rows=ROWS, dim=16):
        super().__init__()
        self.table = nn.Embedding(fields * rows, dim)
        self.register_buffer("field_offsets", torch.arange(fields) * rows, persistent=False)

    def forward(self, ids):
        return self.table(ids + self.field_offsets)


class AutoInt(nn.Module):
    """AutoInt: multi-head self-attention over the fields, with a residual projection and a
    ReLU per layer (DeepCTR's InteractingLayer through nn.MultiheadAttention), flattened into
    a linear head."""

    def __init__(self, dim=32, heads=2, layers=2):
        super().__init__()
        self.embed = nn.ModuleList(nn.Embedding(ROWS, dim) for _ in range(FIELDS))
        self.attention = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.residual = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.head = nn.Linear(FIELDS * dim, 1)

    def forward(self, ids):
        x = torch.stack([embed(ids[:, f]) for f, embed in enumerate(self.embed)], 1)
        for attention, residual in zip(self.attention, self.residual):
            attended, _ = attention(x, x, x)
            x = F.relu(attended + residual(x))
        return self.head(x.flatten(1)).squeeze(-1)


class FiBiNET(nn.Module):
    """FiBiNET: SENET re-weights the fields (squeeze by the mean over d, excite through a
    bottleneck and a sigmoid), then a bilinear interaction of the raw and of the re-weighted
    embeddings, concatenated into an MLP. "field_all": one shared Linear(d, d) applied to
    every field, times the other field of each pair (pairs gathered by index); "field_each":
    DeepCTR-Torch's per-field form, one Linear per field, the fields split apart and the
    pairs taken in a Python loop, so each field's Linear is called once per pair it leads."""

    def __init__(self, fields=FIELDS, dim=16, reduction=3, bilinear_type="field_all"):
        super().__init__()
        self.embed = FieldEmbeddings(fields, dim=dim)
        reduced = max(1, fields // reduction)
        self.excitation = nn.Sequential(nn.Linear(fields, reduced, bias=False), nn.ReLU(),
                                        nn.Linear(reduced, fields, bias=False), nn.Sigmoid())
        self.bilinear_type = bilinear_type
        if bilinear_type == "field_all":
            self.bilinear = nn.Linear(dim, dim, bias=False)
        else:
            # DeepCTR-Torch makes one per field; the last field leads no pair, its Linear no gradient
            self.bilinear = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(fields - 1))
        left, right = zip(*itertools.combinations(range(fields), 2))
        self.register_buffer("left", torch.tensor(left), persistent=False)
        self.register_buffer("right", torch.tensor(right), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * len(left) * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def interact(self, x):
        if self.bilinear_type == "field_all":
            return (self.bilinear(x)[:, self.left] * x[:, self.right]).flatten(1)
        fields = torch.split(x, 1, dim=1)
        return torch.cat([self.bilinear[i](fields[i]) * fields[j]
                          for i, j in itertools.combinations(range(len(fields)), 2)], 1).flatten(1)

    def forward(self, ids):
        x = self.embed(ids)
        reweighted = x * self.excitation(x.mean(-1)).unsqueeze(-1)
        return self.mlp(torch.cat([self.interact(x), self.interact(reweighted)], 1)).squeeze(-1)


class XDeepFM(nn.Module):
    """xDeepFM: the compressed interaction network (the outer product x0 ⊗ xk by einsum,
    compressed by a 1x1 Conv1d, two layers, each sum-pooled over d) beside a DNN over the
    flattened embeddings, concatenated into a linear head. The conv1x1 Mod makes each
    Conv1d a linear of the transposed outer product (at these widths transposed_linear then
    computes it as W @ x, a bmm over the broadcast weight with fwd, dgrad and wgrad sites),
    except when training on CPU under Inductor's vectorized C++ code, as here (its
    `cpu_training` decline): test_conv1x1 trains this model with scalar code."""

    def __init__(self, dim=16, cin_sizes=(16, 16)):
        super().__init__()
        self.embed = FieldEmbeddings(dim=dim)
        widths = (FIELDS, *cin_sizes)
        self.cin = nn.ModuleList(nn.Conv1d(FIELDS * widths[i], widths[i + 1], kernel_size=1)
                                 for i in range(len(cin_sizes)))
        self.dnn = nn.Sequential(nn.Linear(FIELDS * dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(sum(cin_sizes) + 32, 1)

    def compressed_interactions(self, x0):
        xk, pooled = x0, []
        for conv in self.cin:
            z = torch.einsum("bhd,bmd->bhmd", x0, xk)
            batch, h, m, d = z.shape
            xk = F.relu(conv(z.reshape(batch, h * m, d)))
            pooled.append(xk.sum(-1))
        return torch.cat(pooled, 1)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(torch.cat([self.compressed_interactions(x), self.dnn(x.flatten(1))], 1)).squeeze(-1)


class Dice(nn.Module):
    """DIN's data-adaptive activation: a sigmoid gate over batch-normalized inputs mixes x
    and alpha * x."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.BatchNorm1d(width, eps=1e-9, affine=False)
        self.alpha = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        gate = torch.sigmoid(self.norm(x))
        return self.alpha * (1 - gate) * x + gate * x


class DIN(nn.Module):
    """Deep Interest Network: target attention over a padded behaviour sequence (an MLP
    with PReLU over [h, t, h - t, h * t] scores each position, padding masked with
    DeepCTR's -2^32 + 1 before the softmax, the history summed by those weights), then an
    MLP with Dice."""

    def __init__(self, dim=16):
        super().__init__()
        self.item = nn.Embedding(ITEMS, dim, padding_idx=0)
        self.attention = nn.Sequential(nn.Linear(4 * dim, 64), nn.PReLU(), nn.Linear(64, 32), nn.PReLU(),
                                       nn.Linear(32, 1))
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), Dice(64), nn.Linear(64, 1))

    def forward(self, history, target):
        h = self.item(history)
        t = self.item(target).unsqueeze(1).expand_as(h)
        scores = self.attention(torch.cat([h, t, h - t, h * t], -1)).squeeze(-1)
        scores = scores.masked_fill(history == 0, -2 ** 32 + 1)
        interest = torch.matmul(torch.softmax(scores, -1).unsqueeze(1), h).squeeze(1)
        return self.mlp(torch.cat([interest, t[:, 0]], -1)).squeeze(-1)


class GRUInterest(nn.Module):
    """DIEN's interest extractor without AUGRU: a GRU over the behaviour sequence, the state
    at each history's last valid position taken as the user's interest, next to the target
    item, through an MLP."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.item = nn.Embedding(ITEMS, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden + dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 1))

    def forward(self, history, lengths, target):
        states, _ = self.gru(self.item(history))
        interest = states[torch.arange(history.shape[0], device=history.device), lengths - 1]
        return self.mlp(torch.cat([interest, self.item(target)], -1)).squeeze(-1)


class WeightNormTower(nn.Module):
    """EmbeddingBag lookups into an MLP tower whose hidden linears are weight-normalized
    through torch.nn.utils.parametrizations.weight_norm: each GEMM's weight is g * v / ||v||
    computed in the graph from two parameters."""

    def __init__(self, tables=4, dim=32):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, dim, mode="sum") for _ in range(tables))
        self.tower = nn.Sequential(weight_norm(nn.Linear(tables * dim, 128)), nn.ReLU(),
                                   weight_norm(nn.Linear(128, 64)), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids, offsets):
        pooled = [bag(i, o) for bag, i, o in zip(self.bags, ids, offsets)]
        return self.tower(torch.cat(pooled, 1)).squeeze(-1)


def _field_ids(batch, fields=FIELDS):
    return (torch.randint(0, ROWS, (batch, fields)),)


def _history(batch, length=HISTORY):
    """Item ids padded with 0 at the end of each row, every row at least one item long."""
    lengths = torch.randint(1, length + 1, (batch,))
    ids = torch.randint(1, ITEMS, (batch, length))
    return ids.masked_fill(torch.arange(length) >= lengths[:, None], 0), lengths


def _din_inputs(batch, length=HISTORY):
    history, _ = _history(batch, length)
    return history, torch.randint(1, ITEMS, (batch,))


def _gru_inputs(batch, length=6):
    # short: Dynamo unrolls the GRU over the sequence, one set of GEMMs per step
    history, lengths = _history(batch, length)
    return history, lengths, torch.randint(1, ITEMS, (batch,))


def _bag_inputs(batch, tables=4, per_row=3):
    ids = [torch.randint(0, ROWS, (batch * per_row,)) for _ in range(tables)]
    offsets = [torch.arange(0, batch * per_row, per_row) for _ in range(tables)]
    return ids, offsets


CASES = {
    "autoint": (AutoInt, _field_ids),
    "fibinet": (FiBiNET, _field_ids),
    "xdeepfm_cin": (XDeepFM, _field_ids),
    "din": (DIN, _din_inputs),
    "weight_norm_tower": (WeightNormTower, _bag_inputs),
}
# FiBiNET's per-field form, five fields (its graph has a Linear call per pair, slow to
# compile on CPU): test_fibinet_field_each_repeated_calls_are_computed_once
FIBINET_FIELD_EACH = (functools.partial(FiBiNET, fields=5, bilinear_type="field_each"),
                      functools.partial(_field_ids, fields=5))


def _assert_first_step_matches_eager(model, compiled, make_inputs, batch=64):
    """One step's output and parameter gradients, compiled against eager: the output
    within 20 dB SQNR, each gradient pointing the same way (cosine similarity > 0.9)."""
    inputs, labels = make_inputs(batch), torch.randint(0, 2, (batch,)).float()

    def output_and_gradients(forward):
        out = forward(*inputs)
        F.binary_cross_entropy_with_logits(out, labels).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.detach(), grads

    eager_out, eager_grads = output_and_gradients(model)
    loka_out, loka_grads = output_and_gradients(compiled)
    assert sqnr_db(eager_out, loka_out) > 20.0, sqnr_db(eager_out, loka_out)
    assert loka_grads.keys() == eager_grads.keys()
    for name, expected in eager_grads.items():
        # a bias right before a softmax has a zero gradient in exact arithmetic (the softmax
        # ignores a shift): eager's is rounding noise, nothing to compare against
        if expected.norm() > 1e-6:
            cosine = F.cosine_similarity(expected.flatten(), loka_grads[name].flatten(), 0)
            assert cosine > 0.9, (name, cosine.item())


def _assert_trains_in_fp8(model, make_inputs, **compile_kwargs):
    """Compiled with FP8 from the first call: the first step agrees with eager, six steps
    train (the loss finite and lower on a repeated batch), every parameter gets a finite
    gradient, no graph falls back, some site runs in FP8, and a product of two activations
    (bmm) has no wgrad (a linear that transposed_linear made a bmm over its broadcast weight
    has one, as any linear). Returns the report."""
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0}, **compile_kwargs)
    _assert_first_step_matches_eager(model, compiled, make_inputs)
    losses = _train(model, compiled, make_inputs, lambda out: out)
    assert losses[-2] < losses[0], losses  # the same batch, four Adam steps later
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    report = loka_compile.report(compiled)
    print(report.table())  # shown on failure
    assert report.sites and not any(g.fallback for g in report.graphs), str(report)
    assert any(s.fp8 for s in report.sites), report.table()
    weight_bmms = {m for result in report.mod_results.get("transposed_linear", ()) for m in result.modules}
    assert {s.role for s in report.sites if s.op == "bmm" and s.module not in weight_bmms} <= {"fwd", "dgrad"}, \
        report.table()
    linears = [s for s in report.sites if s.op != "bmm" or s.module in weight_bmms]
    wgrad = {s.module for s in linears if s.role == "wgrad"}
    assert wgrad == {s.module for s in linears if s.role == "fwd"}, report.table()  # every linear trains
    return report


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_interaction_layer_trains_under_loka(case):
    """Each model with FP8 from the first call (the checks of _assert_trains_in_fp8)."""
    cls, make_inputs = CASES[case]
    _assert_trains_in_fp8(cls(), make_inputs)


@pytest.mark.slow
@torch._dynamo.config.patch(allow_rnn=True)  # off (Dynamo's default), Dynamo runs the whole forward eagerly
def test_gru_interest_extractor_trains_under_loka():
    """The GRU traced into the graph: its input projection and each step's hidden GEMM
    (the first over an all-zero h0) are sites of their own, with gradients of both kinds."""
    report = _assert_trains_in_fp8(GRUInterest(), _gru_inputs)
    gru = [s for s in report.sites if s.module == "gru"]
    assert {s.role for s in gru} == {"fwd", "dgrad", "wgrad"}, report.table()
    assert any(s.fp8 for s in gru if s.role == "fwd"), report.table()


@pytest.mark.slow
def test_din_with_history_lengths_changing_under_dynamic_shapes():
    """dynamic=True, the histories' length changing from step to step: one graph whose attention
    GEMMs run over a symbolic B * L rows, in FP8; trains on (the loss on the repeated
    length-12 batch goes down)."""
    model = DIN()
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0})
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = {length: (_din_inputs(64, length), torch.randint(0, 2, (64,)).float()) for length in (12, 20, 7, 33)}
    losses = []
    for length in (12, 20, 7, 33, 12, 12):
        inputs, labels = batches[length]
        loss = F.binary_cross_entropy_with_logits(compiled(*inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.isfinite(loss), (length, loss.item())
        losses.append(loss.item())
    assert losses[4] < losses[0], losses
    report = loka_compile.report(compiled)
    print(report.table())  # shown on failure
    assert len(report.graphs) == 1 and not report.graphs[0].fallback, str(report)
    attention = [s for s in report.sites if s.module.startswith("attention.") and s.role == "fwd"]
    assert any(s.fp8 and isinstance(s.shape[0], str) for s in attention), report.table()


PROBED_CASES = ("weight_norm_tower",)  # test_model_patterns runs three more through the window


@pytest.mark.slow
@pytest.mark.parametrize("case", PROBED_CASES)
def test_interaction_layer_trains_through_the_default_probe_window(case):
    """No options: each graph runs its probe window, then its FP8 variant, and trains on."""
    cls, make_inputs = CASES[case]
    assert_trains_through_the_probe_window(cls(), make_inputs, lambda out: out)


@pytest.mark.slow
def test_fibinet_field_each_repeated_calls_are_computed_once():
    """In the per-field bilinear each field's Linear is called once per pair it leads, on
    the same input. Those calls are one product: horizontal fusion hands the repeats the
    first call's output instead of concatenating the weight again, so each Linear keeps one
    forward GEMM per input, named after it, as without the Mod (where AOTAutograd's CSE merges
    the repeats of this training graph), and the model computes what it computes without the Mod."""
    cls, make_inputs = FIBINET_FIELD_EACH
    torch.manual_seed(0)
    model = cls()
    inputs = make_inputs(64)

    def run(options):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, **options})
        out = compiled(*inputs)  # forward sites only: its backward (compiled at the first backward()) is not run
        report = loka_compile.report(compiled)
        return out, sorted(s.module for s in report.sites if s.role == "fwd"), report

    out, forward_sites, report = run({})
    plain_out, plain_forward_sites, _ = run({"disabled_mods": ["horizontal"]})
    # each Linear once per input it is applied to (the raw and the re-weighted embeddings)
    bilinear = [f"bilinear.{i}" for i in range(len(model.bilinear)) for _ in range(2)]
    assert [m for m in forward_sites if m.startswith("bilinear")] == bilinear, forward_sites
    assert plain_forward_sites == forward_sites
    assert report.mods["horizontal"] == 0, report.table()
    assert sqnr_db(plain_out.double(), out.double()) > 40
