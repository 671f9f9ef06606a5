"""Cached FP8 weights are never served stale, whatever path wrote the weight: fused
optimizers, writes through `.data` (EMA weights, checkpoint loading, pruning), in-place
updates under no_grad, and CUDA-graph replay. Each model is evaluated compiled under
`torch.no_grad()`, the way training loops evaluate between epochs."""

import copy

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile import inductor_compile
from loka_compile.kernels.fingerprint import (fingerprints, kernel_fingerprints, kernel_lane_sums, lane_sums,
                                              reference_fingerprint)
from loka_compile.passes.mods.cached_weights import writes_inputs
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# Emulated e4m3 on these MLPs against fp32: 25-28 dB; a stale weight gives < 5 dB.
SQNR_FLOOR_DB = 20.0


class Ranker(nn.Module):
    """A CTR tower as public recsys code writes one: Linear -> ReLU stacks and a logit."""

    def __init__(self, d_in=64, hidden=128):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 16)

    def forward(self, x):
        return self.head(self.mlp(x))


def _evaluate(compiled, x):
    with torch.no_grad():
        return compiled(x)


def _compiled_eval(model, **compile_kwargs):
    return torch.compile(model, backend="loka", options={"probe_steps": 0}, **compile_kwargs)


@pytest.fixture(params=["before", "after"])
def check(request, monkeypatch):
    """Both ways of checking the weights: before each call (CPU's way), and while the call
    runs with a rerun on a change (CUDA's way, here with the comparison on the host)."""
    monkeypatch.setattr(inductor_compile, "check_after_call", lambda graph, example_inputs: request.param == "after")
    return request.param


def _reruns(compiled) -> int:
    """Calls run again because a weight changed (counted per changed weight)."""
    return sum(w.reruns for w in loka_compile.report(compiled).cached_weights)


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_fused_optimizer_steps_reach_the_evaluation_graph(optimizer):
    model = Ranker()
    compiled = _compiled_eval(model)
    opt = optimizer(model.parameters(), lr=0.05, fused=True)
    x, target = torch.randn(32, 64), torch.randn(32, 16)
    _evaluate(compiled, x)
    for _ in range(3):  # an epoch of training, then evaluation
        for _ in range(2):
            nn.functional.mse_loss(model(x), target).backward()
            opt.step()
            opt.zero_grad()
        assert sqnr_db(model(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    assert loka_compile.report(compiled).cached_weights


@pytest.mark.parametrize("write", ["copy_", "mul_", "slice_assign", "ema"])
def test_writes_through_data_reach_the_evaluation_graph(write, check):
    model = Ranker().eval()
    compiled = _compiled_eval(model)
    x = torch.randn(32, 64)
    _evaluate(compiled, x)
    new_weights = Ranker()
    for p, new in zip(model.parameters(), new_weights.parameters()):
        if write == "copy_":          # checkpoint loading
            p.data.copy_(new.data)
        elif write == "mul_":         # pruning, rescaling
            p.data.mul_(0.5)
        elif write == "slice_assign":
            p.data[:] = new.data
        else:                          # an EMA of another model's weights
            p.data.mul_(0.9).add_(new.data, alpha=0.1)
    assert sqnr_db(model(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    assert (_reruns(compiled) > 0) == (check == "after")


def test_one_changed_weight_is_requantized_alone(check):
    model = Ranker().eval()
    compiled = _compiled_eval(model)
    x = torch.randn(32, 64)
    _evaluate(compiled, x)
    report = loka_compile.report(compiled)
    before = {id(w): w.refreshes for w in report.cached_weights}
    _evaluate(compiled, x)
    assert {id(w): w.refreshes for w in report.cached_weights} == before
    assert _reruns(compiled) == 0
    model.head.weight.data[3, 5] += 1.0  # one element, through .data
    assert sqnr_db(model(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    assert sum(w.refreshes for w in report.cached_weights) == sum(before.values()) + 1
    assert (_reruns(compiled) > 0) == (check == "after")


def test_a_graph_that_writes_its_inputs_is_checked_before_its_call():
    """Checked after its call, a changed weight would run such a graph twice: its input written twice."""
    def counts(x, n):
        n.add_(1)
        return x * 2

    def pure(x, n):
        return x * n

    args = (torch.randn(4), torch.zeros(()))
    assert writes_inputs(torch.fx.experimental.proxy_tensor.make_fx(counts)(*args).graph)
    assert not writes_inputs(torch.fx.experimental.proxy_tensor.make_fx(pure)(*args).graph)


def test_fingerprint_sees_every_byte():
    weight = torch.randn(64, 48, dtype=torch.bfloat16)
    base = reference_fingerprint(weight)
    assert reference_fingerprint(weight.clone()) == base
    swapped = weight.clone()
    swapped[[0, 1]] = weight[[1, 0]]           # same values, other places
    flipped = weight.clone()
    flipped.view(torch.int16)[7, 3] ^= 1        # one bit
    signed = weight.clone()
    signed[5, 5] = -signed[5, 5]
    prints = {base, reference_fingerprint(swapped), reference_fingerprint(flipped), reference_fingerprint(signed)}
    assert len(prints) == 4


def test_fingerprint_kernel_matches_the_reference():
    """The Triton kernel under the interpreter, bit for bit, across dtypes, sizes that do
    not fill a program, a non-contiguous tensor, an empty one, an odd one-byte one and a
    view off the 16-byte alignment."""
    tensors = [torch.randn(100, 37, dtype=torch.bfloat16), torch.randn(5000), torch.randn(3, 9).t(),
               torch.zeros(0), torch.randint(-100, 100, (7,), dtype=torch.int8),
               torch.randn(9000, dtype=torch.float16)]
    tensors.append(torch.randn(5001)[1:])  # a view 4 bytes into its storage: loads without the alignment hint
    assert kernel_fingerprints(tensors) == [reference_fingerprint(t) for t in tensors]
    assert fingerprints(tensors) == [reference_fingerprint(t) for t in tensors]
    assert torch.equal(kernel_lane_sums(tensors), lane_sums(tensors))  # the host's lanes, as the device's


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_fused_adam_and_data_writes_with_cuda_graph_replay(mode):
    model = Ranker().cuda()
    options = {"probe_steps": 0, "recipe": "rowwise", **({"mode": mode} if mode else {})}
    compiled = torch.compile(model, backend="loka", options=options)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    x, target = torch.randn(256, 64, device="cuda"), torch.randn(256, 16, device="cuda")
    for _ in range(3):
        _evaluate(compiled, x)  # replayed after the first calls under reduce-overhead
    for _ in range(3):
        nn.functional.mse_loss(model(x), target).backward()
        opt.step()
        opt.zero_grad()
        assert sqnr_db(model(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.05)
    for p, new in zip(model.parameters(), other.parameters()):
        p.data.copy_(new.data)
    assert sqnr_db(other(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    assert loka_compile.report(compiled).cached_weights


@pytest.mark.cuda
def test_cuda_fingerprint_kernel_matches_the_reference():
    tensors = [torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(513, 77, device="cuda"),
               torch.randn(64, 32, device="cuda", dtype=torch.float16).t()]
    assert fingerprints(tensors) == [reference_fingerprint(t) for t in tensors]  # aligned: the hinted loads
    unaligned = [torch.randn(5001, device="cuda")[1:], tensors[0]]
    assert fingerprints(unaligned) == [reference_fingerprint(t) for t in unaligned]


def test_a_failing_fingerprint_kernel_falls_back_to_the_reference(monkeypatch, caplog):
    from loka_compile.kernels import fingerprint

    def broken(tensors):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(fingerprint, "kernel_fingerprints", broken)
    monkeypatch.setattr(fingerprint, "_kernel_failed", [])
    tensors = [torch.randn(8, 8)]
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with caplog.at_level("WARNING", logger="loka"):
        assert fingerprint.fingerprints(tensors) == [reference_fingerprint(tensors[0])]
        assert fingerprint.fingerprints(tensors) == [reference_fingerprint(tensors[0])]
    assert sum("fingerprint kernel failed" in r.message for r in caplog.records) == 1


class BatchedProjection(nn.Module):
    """A weight broadcast over the batch for a baddbmm, as attention layers project a
    sequence, with a bias per batch: a batched GEMM find_sites does not fold into a 2-D one
    (a bare bmm of a broadcast weight is folded, and its weight cached as any 2-D one's)."""

    def __init__(self, d=32, n=48, batch=5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) / d ** 0.5)
        self.bias = nn.Parameter(torch.randn(batch, 1, n) / 10)

    def forward(self, x):
        return torch.baddbmm(self.bias, x, self.weight.t().expand(x.shape[0], -1, -1)).relu()


def test_an_expanded_weight_keeps_its_cast_in_the_graph():
    """An operand whose elements share memory (stride 0) has no dense FP8 copy to cache."""
    model = BatchedProjection().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "fallback": False})
    x = torch.randn(5, 16, 32)
    assert sqnr_db(model(x), _evaluate(compiled, x)) > SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    assert any(s.fp8 for s in report.sites) and not report.cached_weights
