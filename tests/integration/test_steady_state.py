"""After the probe window, a loka graph call is the compiled variant's call and nothing else:
no host read of a device value (on CUDA each is a sync), no per-call bookkeeping. Counted on
CPU with `benchmarks.host_overhead.HostReads`, which sees the reads a GPU would wait on."""

import pytest
import torch
from torch import nn

from benchmarks.host_overhead import HostReads
from loka_compile import amax_guard, ranks
from loka_compile.compiled_graph import LokaCompiledGraph

WIDTH, BATCH = 32, 32
WARMUP_STEPS = 5  # the window (2 calls), its close and the FP8 variant's first run
STEADY_STEPS = 4


class TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x)


class ReadsBetweenGraphs(TwoGraphs):
    """Reads a value back between its graphs, as a model's own code may."""

    def forward(self, x):
        x = torch.relu(self.first(x))
        if x.sum().item() > -1.0:
            x = x + 0
        return self.second(x)


def _steady_steps(model, options, monkeypatch):
    """(host reads, loka's slow-path calls) over STEADY_STEPS training steps after the window."""
    compiled = torch.compile(model, backend="loka", options=options)
    x = torch.randn(BATCH, WIDTH)
    for _ in range(WARMUP_STEPS):
        compiled(x).sum().backward()
    slow_calls = []
    slow_path = LokaCompiledGraph._call
    monkeypatch.setattr(LokaCompiledGraph, "_call", lambda self, args: slow_calls.append(1) or slow_path(self, args))
    with HostReads() as reads:
        for _ in range(STEADY_STEPS):
            out = compiled(torch.randn(BATCH, WIDTH))
            out.sum().backward()
    assert torch.isfinite(out).all()
    return reads, len(slow_calls)


def test_a_steady_state_call_runs_the_variant_and_reads_nothing_back(fresh_compile_state, one_thread, monkeypatch):
    reads, slow_calls = _steady_steps(TwoGraphs(), {}, monkeypatch)
    assert reads.by_caller() == {}
    assert slow_calls == 0


def test_host_reads_are_counted_with_their_caller(fresh_compile_state, one_thread, monkeypatch):
    reads, _ = _steady_steps(ReadsBetweenGraphs(), {}, monkeypatch)
    assert reads.total() == STEADY_STEPS
    ((what, where),) = reads.counts
    assert what == "item" and where.startswith("test_steady_state.py:")


def test_with_amax_guards_only_the_guard_buffer_is_read(fresh_compile_state, one_thread, monkeypatch):
    """Tensorwise sites keep their guard: each call reads the guards' buffer (a CPU tensor here;
    on CUDA a pinned copy that has landed, `AmaxGuards._landed`) and nothing else."""
    reads, slow_calls = _steady_steps(TwoGraphs(), {"recipe": "tensorwise"}, monkeypatch)
    assert reads.total() > 0 and slow_calls == 2 * STEADY_STEPS
    assert {(what, where.split(" < ")[0]) for what, where in reads.counts} == {("tolist", "amax_guard.py:trips")}


@pytest.mark.parametrize("distributed", [False, True])
def test_ranks_merge_guards_every_few_calls(monkeypatch, distributed):
    """Across ranks the trips are merged by a collective that waits for the device: every
    RANK_MERGE_EVERY calls of a graph, and at every call in one process."""
    monkeypatch.setattr(ranks, "distributed", lambda: distributed)
    due = [call for call in range(1, 3 * amax_guard.RANK_MERGE_EVERY + 1) if amax_guard.AmaxGuards.due(call)]
    every = amax_guard.RANK_MERGE_EVERY if distributed else 1
    assert due == list(range(every, 3 * amax_guard.RANK_MERGE_EVERY + 1, every))


def test_only_recursive_disable_wrappers_are_skipped():
    """The steady call skips AOTAutograd's `disable` around a variant, and nothing else: not a
    compiling wrapper, not a non-recursive disable, not a function that wraps one."""
    import functools

    from loka_compile.compiled_graph import _without_disable

    def graph():
        return 1

    disabled = torch._dynamo.disable(graph)
    assert _without_disable(disabled) is graph
    assert _without_disable(torch._dynamo.disable(disabled)) is graph
    wrapping = functools.wraps(disabled)(lambda: disabled())
    for kept in (wrapping, torch.compiler.disable(graph, recursive=False), torch.compile(graph, backend="eager")):
        assert _without_disable(kept) is kept
