"""One AOTAutograd trace per Dynamo graph: the later compiles of a graph reuse its first.

A graph under loka is compiled more than once: the probe variant, then the FP8 variant when
the window closes, and the graph speed check's variants and re-check rebuilds after it. Each
compile runs AOTAutograd on the same Dynamo graph, in the same tracing context (fake mode,
shape environment), with the same decompositions: its graph capture (functionalization, the
joint forward-backward trace, decompositions) gives the same joint graph every time. What
differs between the variants comes after it: loka's joint-graph Mods, the partition, the
post-grad passes and Inductor's code. So the first compile keeps its capture
(`aot_stage1_graph_capture`'s result, with a pristine copy of the joint graph, which the
partitioner's joint passes rewrite in place, and the AOT state it updated), and each later
compile starts from a fresh copy of it instead of tracing again.

Reused only where it is the same trace: the fake inputs of the later compile are described
alike (type, sizes and strides with their symbols, dtype, device, whether each takes a
gradient, which ones share storage), autograd is needed or not in both, the Inductor
settings the trace reads are equal, and no tensor subclass is involved. The later compile
then works on the first one's fake inputs throughout, as its trace did. Otherwise, or where
this torch has no such stage to intercept, the graph is traced again, as without this module.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import unittest.mock
from typing import Optional

import torch

log = logging.getLogger("loka")

# The AOT state's fields that the graph capture updates (its deduplicated inputs and their metadata).
_TRACE_UPDATES = ("flat_args", "flat_args_descs", "fw_metadata")

# Inductor settings a loka compile patches that act after the trace: its custom passes
# (other objects per variant) and CUDA graphs (around the compiled code).
_AFTER_TRACE = frozenset({"post_grad_custom_pre_pass", "post_grad_custom_post_pass", "joint_custom_post_pass",
                          "triton.cudagraphs"})


def _stage1_module():
    """The module whose global `aot_stage1_graph_capture` AOTAutograd's Dynamo entry calls, or
    None where this torch has none."""
    try:
        module = importlib.import_module("torch._functorch.aot_autograd")
    except ImportError:
        return None
    return module if callable(getattr(module, "aot_stage1_graph_capture", None)) else None


def trace_settings(patches: dict) -> tuple:
    """The part of a compile's Inductor patches that the trace may read (decompositions)."""
    return tuple(sorted((name, repr(value)) for name, value in patches.items() if name not in _AFTER_TRACE))


def describe_inputs(flat_args) -> tuple:
    """What the trace reads of its fake inputs (module docstring), comparable across compiles."""
    storages, described = {}, []
    for value in flat_args:
        if not isinstance(value, torch.Tensor):
            described.append((type(value).__name__, str(value)))
            continue
        # Sparse tensors have no storage: each its own.
        storage = value.untyped_storage()._cdata if torch._C._has_storage(value) else -len(described) - 1
        shared = storages.setdefault(storage, len(described))
        described.append((type(value).__name__, str(tuple(value.shape)), str(value.stride()),
                          str(value.storage_offset()), value.dtype, value.device, value.requires_grad,
                          value.is_leaf, shared))
    return tuple(described)


@dataclasses.dataclass
class _Kept:
    settings: tuple
    inputs: tuple          # `describe_inputs` of the AOT state's fake inputs before the trace
    needs_autograd: bool
    state_after: dict      # the AOT state's fields the trace updates (_TRACE_UPDATES), as it left them
    capture: object        # its AOTGraphCapture, with a pristine copy of its joint graph


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` whose nodes can be rewritten without touching `gm`'s (each node's meta
    copied, its values and the module's attributes shared). Its code generator is shared
    too: a joint graph's takes its inputs as a pytree, whose spec the copy only reads
    (`Graph.__deepcopy__` would copy it, through a deprecated path of torch's pytree)."""
    graph = torch.fx.Graph(tracer_cls=gm.graph._tracer_cls)
    output, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph._codegen = gm.graph._codegen
    graph.output(output, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta = dict(gm.meta)
    return copied


class AotCapture:
    """A Dynamo graph's kept AOTAutograd capture. `traces` counts the captures that traced,
    `reuses` those that started from the kept one."""

    def __init__(self):
        self._kept: Optional[_Kept] = None
        self.traces = 0
        self.reuses = 0

    def drop(self) -> None:
        self._kept = None

    @contextlib.contextmanager
    def compiling(self, patches: dict):
        """Around one `compile_fx` of the graph with Inductor patches `patches`: its graph
        capture is kept if none is, or reused where it is the same trace (module docstring)."""
        module = _stage1_module()
        if module is None:
            yield
            return
        original = module.aot_stage1_graph_capture
        settings = trace_settings(patches)
        calls = [0]

        def stage1(aot_state, *args, **kwargs):
            calls[0] += 1
            own = calls[0] == 1  # the Dynamo graph's own capture, not a nested compile's
            if own:
                reused = self._reuse(aot_state, settings)
                if reused is not None:
                    return reused
            before = _described_or_none(aot_state)
            capture = original(aot_state, *args, **kwargs)
            self.traces += 1
            if own and self._kept is None and before is not None:
                self._kept = _keep(aot_state, capture, settings, before)
            return capture

        with unittest.mock.patch.object(module, "aot_stage1_graph_capture", stage1):
            yield

    def _reuse(self, aot_state, settings: tuple):
        """The kept capture for `aot_state`, its AOT state updated as the trace would, or None."""
        kept = self._kept
        if kept is None:
            return None
        why = None
        if kept.settings != settings:
            why = "other Inductor settings"
        elif kept.needs_autograd != getattr(aot_state, "needs_autograd", None):
            why = "autograd needed in one compile only"
        elif kept.inputs != _described_or_none(aot_state):
            why = "fake inputs described otherwise"
        if why is not None:
            log.debug("loka: AOTAutograd traces the graph again (%s)", why)
            return None
        for name, value in kept.state_after.items():
            # Stage 2 writes the metadata (what the backward saves): each compile gets its own.
            setattr(aot_state, name, copy.copy(value))
        self.reuses += 1
        return dataclasses.replace(kept.capture, graph_module=_copy_graph_module(kept.capture.graph_module))


def _described_or_none(aot_state) -> Optional[tuple]:
    """`describe_inputs` of the AOT state's fake inputs; None where the state is not as this
    module knows it (another torch), which then neither keeps nor reuses."""
    if not all(hasattr(aot_state, name) for name in (*_TRACE_UPDATES, "needs_autograd")):
        return None
    return describe_inputs(aot_state.flat_args)


def _keep(aot_state, capture, settings: tuple, inputs: tuple) -> Optional[_Kept]:
    """What a later compile reuses of this trace; None where it cannot be reused (a tensor
    subclass among the inputs, a capture of another shape than this module knows)."""
    if not dataclasses.is_dataclass(capture) or not isinstance(getattr(capture, "graph_module", None),
                                                               torch.fx.GraphModule) \
            or getattr(capture, "maybe_subclass_meta", None) is not None:
        return None
    state = {name: copy.copy(getattr(aot_state, name)) for name in _TRACE_UPDATES}
    pristine = dataclasses.replace(capture, graph_module=_copy_graph_module(capture.graph_module))
    return _Kept(settings, inputs, aot_state.needs_autograd, state, pristine)
