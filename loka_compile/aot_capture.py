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
import logging
import unittest.mock
from typing import Optional

import torch

log = logging.getLogger("loka")

# Inductor settings a loka compile patches that act after the trace: its custom passes
# (other objects per variant) and CUDA graphs (around the compiled code).
_AFTER_TRACE = frozenset({"post_grad_custom_pre_pass", "post_grad_custom_post_pass", "joint_custom_post_pass",
                          "triton.cudagraphs"})


def _stage1_module():
    """The module whose global `aot_stage1_graph_capture` AOTAutograd's Dynamo entry calls, or
    None where this torch has none."""
    module = getattr(torch._functorch, "aot_autograd", None)
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
    state_after: tuple     # (flat_args, flat_args_descs, fw_metadata) as the trace left them
    capture: object        # its AOTGraphCapture
    joint: torch.fx.GraphModule  # pristine copy of capture.graph_module


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

        def stage1(aot_state, flat_fn):
            calls[0] += 1
            if calls[0] == 1:  # the Dynamo graph's own capture, not a nested one
                reused = self._reuse(aot_state, settings)
                if reused is not None:
                    return reused
            before = describe_inputs(aot_state.flat_args)
            capture = original(aot_state, flat_fn)
            self.traces += 1
            if calls[0] == 1 and self._kept is None and capture.maybe_subclass_meta is None:
                self._kept = _Kept(settings, before, aot_state.needs_autograd,
                                   (list(aot_state.flat_args), list(aot_state.flat_args_descs),
                                    copy.copy(aot_state.fw_metadata)),
                                   capture, _copy_graph_module(capture.graph_module))
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
        elif kept.needs_autograd != aot_state.needs_autograd:
            why = "autograd needed in one compile only"
        elif kept.inputs != describe_inputs(aot_state.flat_args):
            why = "fake inputs described otherwise"
        if why is not None:
            log.debug("loka: AOTAutograd traces the graph again (%s)", why)
            return None
        flat_args, descs, fw_metadata = kept.state_after
        # Stage 2 writes the metadata (what the backward saves): each compile gets its own.
        aot_state.flat_args, aot_state.flat_args_descs, aot_state.fw_metadata = \
            list(flat_args), list(descs), copy.copy(fw_metadata)
        self.reuses += 1
        return dataclasses.replace(kept.capture, graph_module=_copy_graph_module(kept.joint))
