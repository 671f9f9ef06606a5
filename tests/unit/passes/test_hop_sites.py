"""GEMMs inside higher-order ops (a `torch.cond` branch, a `while_loop` body, a
`nested_compile_region`) on CPU, emulated FP8: loka leaves them in high precision and the
report lists each with the op it sits in; the GEMMs around the op go FP8 as usual. Before,
Inductor ran loka's passes on each branch as if it were a graph of its own: the branches'
GEMMs ran FP8 unreported, or read cached FP8 weights the branch could not see and the
graph failed at its first call."""

import collections
import logging

import pytest
import torch
from torch import nn
from torch._higher_order_ops import while_loop

import loka_compile
from models import RoutedTowers
from numerics import rel_error, sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# No window, and a failure raised instead of falling back: what runs is what loka compiled.
OPTIONS = {"probe_steps": 0, "fallback": False}
# Inductor's fp32 kernels against eager: summation order only.
HIGH_PRECISION_REL_ERROR = 1e-5
# Emulated e4m3 rowwise against fp32 on a 32-wide head: ~30 dB (FP8 is off by ~3%).
OUTPUT_SQNR_FLOOR_DB = 20.0
FP8_REL_ERROR_FLOOR = 1e-3
HIGHER_ORDER_OP = "higher_order_op"


def _batches(n=4, batch=64, d=32):
    """Batches whose mean alternates in sign, so that both towers run."""
    return [torch.randn(batch, d) + (1.0 if i % 2 == 0 else -1.0) for i in range(n)]


def _check_outputs(model, outs, x):
    """The routed tower's output equals eager's (its GEMMs in high precision); the head's is
    FP8's (close, not equal)."""
    with torch.no_grad():
        routed_ref, head_ref = model(x)
    routed, head = outs
    assert rel_error(routed_ref, routed.detach()) < HIGH_PRECISION_REL_ERROR
    assert sqnr_db(head_ref, head.detach()) > OUTPUT_SQNR_FLOOR_DB
    assert rel_error(head_ref, head.detach()) > FP8_REL_ERROR_FLOOR


def _branch_sites(report):
    return [s for s in report.sites if not s.module.startswith("head")]


def _check_report(report, kinds):
    branch = _branch_sites(report)
    assert {s.kind for s in branch} == set(kinds)
    assert branch and all(not s.fp8 and s.reason == HIGHER_ORDER_OP and "torch.cond" in s.detail for s in branch)
    forward = {s.module for s in branch if s.role == "fwd" and s.kind == kinds[0]}
    assert forward == {"left.0", "left.2", "right.0", "right.2"}
    head = [s for s in report.sites if s.module == "head" and s.role == "fwd"]
    assert len(head) == 1 and head[0].fp8
    assert not any(g.fallback for g in report.graphs)
    assert f"{HIGHER_ORDER_OP} {len(branch)}" in report.summary()


def test_cond_towers_train_with_their_branches_in_high_precision():
    model = RoutedTowers()
    compiled = torch.compile(model, backend="loka", options=OPTIONS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for x in _batches():
        outs = compiled(x)
        _check_outputs(model, outs, x)
        routed, head = outs
        optimizer.zero_grad()
        (routed.square().mean() + head.square().mean()).backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.head.parameters())
        optimizer.step()
    trained = [p.grad is not None for p in (*model.left.parameters(), *model.right.parameters())]
    assert all(trained)
    report = loka_compile.report(compiled)
    _check_report(report, ["forward", "backward"])
    # each tower's backward: both weights' gradients, and the gradient into its second linear
    backward = collections.Counter(s.role for s in _branch_sites(report) if s.kind == "backward")
    assert backward["wgrad"] == 4 and backward["dgrad"] == 2


def test_cond_towers_infer_without_cached_weights_in_the_branches():
    model = RoutedTowers().eval()
    compiled = torch.compile(model, backend="loka", options=OPTIONS)
    with torch.no_grad():
        for x in _batches():
            _check_outputs(model, compiled(x), x)
    report = loka_compile.report(compiled)
    _check_report(report, ["inference"])
    assert len(report.cached_weights) == 1  # the head's: the branches read their weights as they are


def test_cond_towers_with_the_default_options_train_without_a_fallback(caplog):
    """The probe window and the output budget on: the branches' GEMMs are neither observed
    nor kept for the budget, and nothing falls back."""
    model = RoutedTowers()
    compiled = torch.compile(model, backend="loka")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="loka"):
        for x in _batches(n=4):  # the FP8 variant runs from the third
            routed, head = compiled(x)
            with torch.no_grad():
                assert rel_error(model(x)[0], routed.detach()) < HIGH_PRECISION_REL_ERROR
            optimizer.zero_grad()
            (routed.square().mean() + head.square().mean()).backward()
            optimizer.step()
    assert not [r for r in caplog.records if "could not handle" in r.getMessage()]
    report = loka_compile.report(compiled)
    branch = _branch_sites(report)
    assert branch and all(s.reason == HIGHER_ORDER_OP and not s.probe for s in branch)
    assert not any(g.fallback for g in report.graphs)


class RecurrentCell(nn.Module):
    """One linear applied `steps` times in a `while_loop`, then a head."""

    def __init__(self, d=32, steps=3):
        super().__init__()
        self.steps = steps
        self.cell = nn.Linear(d, d)
        self.head = nn.Linear(d, 16)

    def forward(self, x):
        def more(i, h):
            return i < self.steps

        def step(i, h):
            return i + 1, torch.tanh(self.cell(h))

        _, h = while_loop(more, step, (torch.zeros((), dtype=torch.int64), x))
        return self.head(h)


class SharedBlock(nn.Module):
    """One block compiled once as a nested region (`invoke_subgraph`) and called twice."""

    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.head = nn.Linear(d, 16)

    @torch.compiler.nested_compile_region
    def block(self, x):
        return self.down(torch.relu(self.up(x)))

    def forward(self, x):
        return self.head(self.block(self.block(x)))


@pytest.mark.parametrize("model_class, op, body_modules", [
    (RecurrentCell, "while_loop", {"cell"}),
    (SharedBlock, "invoke_subgraph", {"up", "down"}),
], ids=["while_loop", "nested_compile_region"])
def test_loop_and_region_bodies_infer_in_high_precision(model_class, op, body_modules):
    model = model_class().eval()
    compiled = torch.compile(model, backend="loka", options=OPTIONS)
    x = torch.randn(64, 32)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert sqnr_db(ref, out) > OUTPUT_SQNR_FLOOR_DB
    report = loka_compile.report(compiled)
    body = [s for s in report.sites if s.module != "head"]
    assert {s.module for s in body} == body_modules
    assert all(not s.fp8 and s.reason == HIGHER_ORDER_OP and op in s.detail for s in body)
    assert [s.fp8 for s in report.sites if s.module == "head"] == [True]


def test_a_first_run_failure_is_reported_in_one_line(monkeypatch, caplog):
    """An error from compiled C++ code carries its C++ stack in its message; the fallback's
    warning and the report say what failed in one line."""
    from loka_compile import compiled_graph

    real = compiled_graph.compile_fx

    def compile_fx(gm, example_inputs, **kwargs):
        compiled = real(gm, example_inputs, **kwargs)
        if kwargs["config_patches"].get("post_grad_custom_post_pass") is None:
            return compiled

        def fails(*args):
            raise RuntimeError("kernel launch failed\nException raised from launch at kernel.cpp:12 (most recent "
                               "call first):\nframe #0: c10::Error::Error() + 0x9d (0x7f in libc10.so)\n")
        return fails

    monkeypatch.setattr(compiled_graph, "compile_fx", compile_fx)
    model = RoutedTowers().eval()
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    with caplog.at_level(logging.WARNING, logger="loka"), torch.no_grad():
        compiled(torch.randn(64, 32))
    warnings = [r.getMessage() for r in caplog.records if "could not handle" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "RuntimeError: kernel launch failed" in warnings[0]
    report = loka_compile.report(compiled)
    assert all(s.reason == "graph_fallback" and "\n" not in s.detail for s in report.sites)
    assert "\n" not in report.graphs[0].fallback and "frame #0" not in report.summary()
