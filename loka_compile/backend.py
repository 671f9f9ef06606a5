"""The `loka` torch.compile backend: a thin entry that parses options into LokaConfig and
hands each Dynamo graph to Inductor with loka's passes installed as Inductor's post-grad
custom pass. AOTAutograd, decompositions, `mode=` (CUDA graphs, max-autotune) and dynamic
shapes all stay Inductor's; loka's passes see the forward and backward ATen graphs just
before lowering.

With `probe_steps > 0` each graph is compiled twice: a probe variant (observers in, GEMMs
in high precision) that runs for the first `probe_steps` calls, and the FP8 variant that
runs after. Sites the Probe judges unsafe then run in high precision.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import pathlib
import weakref
from typing import Optional

import torch
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from loka_compile import dispatch, passes, probe
from loka_compile.config import LokaConfig
from loka_compile.kernels import ops
from loka_compile.passes import GraphKind, PassContext, graph_kind, run_passes

log = logging.getLogger("loka")

@functools.lru_cache(maxsize=None)
def _passes_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(passes.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    digest.update(pathlib.Path(dispatch.__file__).read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass
class GraphRecord:
    """Everything loka did to one Dynamo graph: per (phase, ATen graph kind) the pass
    context (sites and decisions) and the rewritten GraphModule."""

    name: str
    config: LokaConfig
    params: dict                     # id -> weakref of each parameter the graph reads
    param_shapes: tuple = ()         # shapes of those parameters, sorted
    contexts: dict = dataclasses.field(default_factory=dict)        # (phase, kind) -> PassContext
    graph_modules: dict = dataclasses.field(default_factory=dict)   # (phase, kind) -> GraphModule
    phase: str = "fp8"
    unsafe: dict = dataclasses.field(default_factory=dict)          # site key -> observed error
    fallback: Optional[str] = None   # why the graph runs without loka, if it does
    warned: bool = False

    def reads(self, param: torch.Tensor) -> bool:
        ref = self.params.get(id(param))
        return ref is not None and ref() is param


GRAPHS: list = []
_graph_ids = itertools.count()


class LokaPostGradPass(CustomGraphPass):
    """Runs loka's pass pipeline on one post-grad ATen graph (forward or backward)."""

    def __init__(self, record: GraphRecord, phase: str, param_input_indices: frozenset):
        self.record = record
        self.phase = phase
        self.param_input_indices = param_input_indices

    def __call__(self, graph: torch.fx.Graph) -> None:
        record = self.record
        kind = graph_kind(graph)
        decide = functools.partial(dispatch.decide, config=record.config, phase=self.phase, unsafe_sites=record.unsafe)
        ctx = PassContext(graph=record.name, kind=kind, phase=self.phase,
                          param_input_indices=self.param_input_indices, decide=decide)
        try:
            run_passes(graph, ctx)
        except Exception as error:  # a model never crashes because loka could not rewrite it
            if not record.config.fallback or _is_dynamo_control(error):
                raise
            _warn_fallback(record, f"{kind.value} graph: {type(error).__name__}: {error}")
            return
        record.contexts[(self.phase, kind)] = ctx
        record.graph_modules[(self.phase, kind)] = graph.owning_module
        fp8 = sum(d.fp8 for d in ctx.decisions.values())
        log.info("%s/%s (%s): %d GEMM sites, %d in FP8", record.name, kind.value, self.phase, len(ctx.sites), fp8)

    def uuid(self) -> str:
        return hashlib.sha256(f"{_passes_digest()}|{self.record.config}|{self.phase}".encode()).hexdigest()


def _is_dynamo_control(error: Exception) -> bool:
    """Dynamo steers compilation with exceptions (restart analysis, skip frame); they
    are not failures and must reach Dynamo."""
    return isinstance(error, torch._dynamo.exc.TorchDynamoException)


def _warn_fallback(record: GraphRecord, why: str) -> None:
    record.fallback = why
    if not record.warned:
        record.warned = True
        log.warning("loka could not handle graph %s (%s); it runs through Inductor in high precision", record.name, why)


def _inductor_patches(config: LokaConfig, custom_pass: Optional[CustomGraphPass]) -> dict:
    patches = dict(list_mode_options(config.mode))
    if custom_pass is not None:
        patches["post_grad_custom_post_pass"] = custom_pass
        # Site records are made by the pass; a cache hit would skip it and leave the
        # report empty, so loka graphs are always compiled.
        patches["fx_graph_cache"] = False
    return patches


class LokaCompiledGraph:
    """What the backend returns to Dynamo for one graph."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, record: GraphRecord):
        self.record = record
        config = record.config
        param_input_indices = frozenset(i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter))
        phases = ("probe", "fp8") if config.probe_steps else ("fp8",)
        self.variants = {phase: self._compile(gm, example_inputs, phase, param_input_indices) for phase in phases}
        record.phase = phases[0]
        self.calls = 0

    def _compile(self, gm, example_inputs, phase, param_input_indices):
        record = self.record
        custom_pass = LokaPostGradPass(record, phase, param_input_indices)
        try:
            return compile_fx(gm, example_inputs, config_patches=_inductor_patches(record.config, custom_pass))
        except Exception as error:
            if not record.config.fallback or _is_dynamo_control(error):
                raise
            _warn_fallback(record, f"compile failed: {type(error).__name__}: {error}")
            return compile_fx(gm, example_inputs, config_patches=_inductor_patches(record.config, None))

    def __call__(self, *args):
        record = self.record
        if record.phase == "probe":
            if self.calls >= record.config.probe_steps:
                self._close_probe_window()
            self.calls += 1
        return self.variants[record.phase](*args)

    def _close_probe_window(self) -> None:
        record = self.record
        keys = [s.key for (phase, _), ctx in record.contexts.items() if phase == "probe" for s in ctx.sites]
        unsafe = probe.unsafe_sites(keys, record.config.max_probe_error)
        # Probe-variant keys name the same nodes as the FP8 variant's (same trace).
        record.unsafe.update(unsafe)
        ops.set_high_precision_sites(unsafe)
        record.phase = "fp8"
        for key, error in unsafe.items():
            log.warning("loka probe: %s keeps high precision (FP8 relative error %.3g > %g)",
                        key, error, record.config.max_probe_error)
        log.info("%s: probe window closed after %d calls; %d of %d observed sites unsafe",
                 record.name, self.calls, len(unsafe), len(keys))


def loka_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode: Optional[str] = None):
    """`torch.compile(model, backend="loka", options={...} | LokaConfig(...))`."""
    config = LokaConfig.from_options(options)
    if mode is not None:
        config = dataclasses.replace(config, mode=mode)
    params = {id(t): weakref.ref(t) for t in [*example_inputs, *gm.parameters()] if isinstance(t, torch.nn.Parameter)}
    record = GraphRecord(name=f"g{next(_graph_ids)}", config=config, params=params,
                         param_shapes=tuple(sorted(tuple(ref().shape) for ref in params.values())))
    compiled = LokaCompiledGraph(gm, example_inputs, record)
    GRAPHS.append(record)  # only once compiled: Dynamo may restart and call again
    return compiled


def reset() -> None:
    """Forget every graph record and probe statistic (Dynamo's caches are separate:
    call torch._dynamo.reset() to recompile)."""
    global _graph_ids
    GRAPHS.clear()
    probe.STORE.clear()
    _graph_ids = itertools.count()
