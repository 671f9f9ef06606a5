"""One `LokaState` per `torch.compile` call: everything loka learns and decides for the
model (or function) that call compiled.

`torch.compile(model, backend="loka", options=...)` makes one `torch._TorchCompileWrapper`,
and Dynamo calls the backend from that wrapper's `__call__` (also through DDPOptimizer, which
calls it once per bucket). So the backend finds the wrapper on its own call stack
(`state_for_compile`), and the wrapper carries the state as an attribute; the compiled model
or function reaches the same wrapper through Dynamo's callback (`state_of`). The wrapper's
`__eq__` makes it unhashable, hence an attribute and not a weak dictionary.

Two compiles of one module are two wrappers, so two states: their reports, plans and Probe
statistics never mix. Nothing here is process-wide but the observers' routing table
(`probe.route_observations`), keyed by graph names that are unique for the process's life.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import weakref
from typing import Optional

import torch

from loka_compile import probe
from loka_compile.amax_guard import AmaxGuards
from loka_compile.config import LokaConfig
from loka_compile.graph_speed import GraphSpeed
from loka_compile.output_budget import OutputBudget
from loka_compile.passes import Phase
from loka_compile.plan import Plan

_STATE_ATTRIBUTE = "_loka_state"
# Attributes through which Dynamo's callback objects reach the backend they wrap (ConvertFrame,
# CatchErrorsWrapper, WrapBackendDebug: `_torchdynamo_orig_backend`; older wrappers: `_inner_fn`).
_INNER_BACKEND = ("_torchdynamo_orig_backend", "_inner_fn")
# Dynamo's wrapping is a handful of layers deep; a longer chain is not Dynamo's.
_MAX_WRAPPING_DEPTH = 8

# Graph names ("g0", "g1", ...) are unique for the process's life: Probe keys start with them.
_graph_ids = itertools.count()


def next_graph_name() -> str:
    return f"g{next(_graph_ids)}"


@dataclasses.dataclass
class GraphRecord:
    """Everything loka did to one Dynamo graph: per (phase, ATen graph kind) the pass
    context (sites and decisions) and the rewritten GraphModule."""

    name: str
    config: LokaConfig
    store: probe.ProbeStore          # the Probe statistics of the compile that owns the graph (`LokaState`)
    contexts: dict = dataclasses.field(default_factory=dict)        # (phase, kind) -> PassContext
    graph_modules: dict = dataclasses.field(default_factory=dict)   # (phase, kind) -> GraphModule
    phase: Phase = Phase.FP8       # the variant that runs
    plan: Plan = dataclasses.field(default_factory=Plan)  # the graph's own: verdicts by site id, loaded sites
    fallback: Optional[str] = None   # why the graph runs without loka, if it does
    # Mod name -> what it returned on this graph, where it ran (a joint-graph Mod: its last run)
    mod_results: dict = dataclasses.field(default_factory=dict)
    fallen_back: dict = dataclasses.field(default_factory=dict)      # GraphKind -> why it runs without loka
    output_budget: Optional[OutputBudget] = None  # what max_output_error measured and kept, when it acted
    output_budget_skipped: str = ""  # why the output budget did not act on this graph, when it was on
    amax_guards: Optional[AmaxGuards] = None  # the tensorwise sites' run-time amax check (amax_guard.py)
    warned: bool = False
    # Verdict changes at run time (a re-check, a tripped amax guard), as Amendments of a site's
    # "verdict": the variant they rebuild decides afresh, so its contexts do not show them.
    verdict_amendments: list = dataclasses.field(default_factory=list)
    # What the graph speed check (`LokaConfig.graph_speed_check`) predicted, timed and kept
    graph_speed: Optional[GraphSpeed] = None
    graph_speed_key: str = ""  # the id a saved plan keeps its timed verdict under (`graph_speed.key_id`)

    def amendments_of(self, site_id: str) -> tuple:
        """The running contexts' amendments of a site, then its verdict changes, in order."""
        return tuple(a for ctx in self.contexts_of().values() for a in ctx.amendments if a.site_id == site_id) + \
            tuple(a for a in self.verdict_amendments if a.site_id == site_id)

    def contexts_of(self, phase: Optional[Phase] = None) -> dict:
        """ATen graph kind -> PassContext of `phase` (None: the running one)."""
        phase = self.phase if phase is None else phase
        return {kind: ctx for (of, kind), ctx in self.contexts.items() if of is phase}


class LokaState:
    """What one compile owns: the records of its Dynamo graphs (each with its plan, pass
    contexts and decisions), the Probe's statistics of their sites, the graphs still in their
    probe window or re-checking, and the run-time counters (fallbacks at a first run,
    re-checks, amax-guard demotions). The speed check's timings are not the model's: they
    are the device's, shared like the performance database (`speed`, `perfdb`)."""

    def __init__(self):
        self.records: list = []                   # GraphRecord per Dynamo graph, in compile order
        self.store = probe.ProbeStore()
        self.probing: "weakref.WeakSet" = weakref.WeakSet()      # compiled graphs in their probe window
        self.rechecking: "weakref.WeakSet" = weakref.WeakSet()   # compiled graphs that re-check
        self.counters: collections.Counter = collections.Counter()

    def add(self, record) -> None:
        """Own a compiled graph's record; its observers report into this state's store."""
        self.records.append(record)
        probe.route_observations(record.name, self.store)

    @property
    def decisions(self) -> dict:
        """site id -> Decision, over every graph's running phase (a later graph's decision for
        an id, a recompile's, wins)."""
        table = {}
        for record in self.records:
            for ctx in record.contexts_of().values():
                table.update({site.id: ctx.decisions[site.id] for site in ctx.sites if site.id in ctx.decisions})
        return table

    @property
    def amendments(self) -> list:
        """Every change to a decision after Dispatch made it (`passes.Amendment`), over every
        graph's running phase, in order."""
        return [a for record in self.records
                for a in [*(a for ctx in record.contexts_of().values() for a in ctx.amendments),
                          *record.verdict_amendments]]

    def __repr__(self) -> str:
        return f"<LokaState: {len(self.records)} graph(s) {[r.name for r in self.records]}>"


def _compile_wrapper_on_stack() -> Optional[object]:
    """The nearest `torch._TorchCompileWrapper` whose `__call__` is on the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, torch._TorchCompileWrapper):
            return candidate
        frame = frame.f_back
    return None


def state_for_compile() -> LokaState:
    """The state of the `torch.compile` call the backend runs for, made at its first graph.
    Called without one (the backend called directly), each call gets a state of its own."""
    wrapper = _compile_wrapper_on_stack()
    if wrapper is None:
        return LokaState()
    state = getattr(wrapper, _STATE_ATTRIBUTE, None)
    if state is None:
        state = LokaState()
        setattr(wrapper, _STATE_ATTRIBUTE, state)
    return state


def _dynamo_callbacks(compiled) -> list:
    """The Dynamo callback objects a compiled module or function holds: an OptimizedModule's
    `dynamo_ctx.callback`, those in the closure of a compiled function (a module compiled in
    place by `Module.compile` holds one as `_compiled_call_impl`); DDP's, of the module it wraps."""
    if isinstance(compiled, torch.nn.parallel.DistributedDataParallel):
        compiled = compiled.module  # DDP(torch.compile(model))
    if isinstance(compiled, torch.nn.Module):
        context = getattr(compiled, "dynamo_ctx", None)
        if context is not None:
            return [getattr(context, "callback", None)]
        compiled = compiled.__dict__.get("_compiled_call_impl")
    values = [_cell_value(cell) for cell in getattr(compiled, "__closure__", None) or ()]
    return [value for value in values if any(hasattr(value, name) for name in _INNER_BACKEND)]


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _compiles_with_loka(wrapper) -> bool:
    """Whether a compile wrapper's backend is loka's (by name, or a partial of it)."""
    backend = getattr(wrapper.compiler_fn, "func", wrapper.compiler_fn)
    return getattr(backend, "__module__", "") == "loka_compile.backend"


def state_of(compiled) -> LokaState:
    """The state of a loka-compiled model or function (or of a graph the backend returned).
    Raises ValueError for anything else, and for a compile that has no graph of its own: not
    run yet, or served by Dynamo with the graphs of an earlier compile with equal options (of
    the same class, or function), which Dynamo's cache reuses."""
    for name in (_STATE_ATTRIBUTE, "state"):
        direct = getattr(compiled, name, None)
        if isinstance(direct, LokaState):
            return direct
    for callback in _dynamo_callbacks(compiled):
        current = callback
        for _ in range(_MAX_WRAPPING_DEPTH):
            if current is None:
                break
            if isinstance(current, torch._TorchCompileWrapper):
                state = getattr(current, _STATE_ATTRIBUTE, None)
                if state is not None:
                    return state
                if not _compiles_with_loka(current):
                    break
                raise ValueError("this torch.compile has compiled no graph of its own: call it first (Dynamo serves "
                                 "a compile with equal options of the same code with the graphs of the first, whose "
                                 "report holds them)")
            current = next((getattr(current, name) for name in _INNER_BACKEND if hasattr(current, name)), None)
    raise ValueError(f"{type(compiled).__name__} is not a model or function compiled with backend=\"loka\" "
                     "(pass what torch.compile returned)")
