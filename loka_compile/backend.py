"""The `loka` torch.compile backend: a thin entry that parses options into LokaConfig, finds
or makes the compile's state (`state.py`), runs the Dynamo-graph Mods, and hands each Dynamo
graph to Inductor with loka's passes installed (`compiled_graph.LokaCompiledGraph`,
`inductor_passes`). AOTAutograd, decompositions, `mode=` (CUDA graphs, max-autotune) and dynamic
shapes all stay Inductor's; loka's passes see the forward and backward ATen graphs just before
lowering.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from loka_compile import speed
from loka_compile.compiled_graph import LokaCompiledGraph
from loka_compile.config import LokaConfig
from loka_compile.fallback import is_dynamo_control
from loka_compile.passes import mods
from loka_compile.passes.find_sites import clean_module_path
from loka_compile.plan import load_plan, param_fingerprint, Plan
from loka_compile.state import GraphRecord, next_graph_name, state_for_compile


log = logging.getLogger("loka")


def _graph_fingerprint(gm: torch.fx.GraphModule, example_inputs) -> tuple[dict, str]:
    """(parameter name -> (shape, dtype), device type) of a Dynamo graph: names from
    Dynamo's sources ("L['self']._modules['fc1']._parameters['weight']" -> "fc1.weight"),
    as `named_parameters()` of the compiled module gives them."""
    named = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.nn.Parameter):
            source = getattr(node.meta.get("grapharg"), "source", None)
            named.append((clean_module_path(source.name) if source is not None else node.name, value))
    named += list(gm.named_parameters())
    tensors = [t for _, t in named] or [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return param_fingerprint(named), (tensors[0].device.type if tensors else "cpu")


def _run_dynamo_graph_mod(mod: mods.Mod, gm: torch.fx.GraphModule, example_inputs, record: GraphRecord) -> None:
    """A Mod on the Dynamo graph (which its rewrite restores when it fails): its failure
    is raised without `fallback`, else logged, the graph left as written."""
    try:
        result = mod.run(gm, example_inputs, record.config)
    except Exception as error:
        if not record.config.fallback or is_dynamo_control(error):
            raise
        log.warning("loka: the %s Mod failed on %s (%s: %s); %s", mod, record.name, type(error).__name__, error,
                    mod.if_failed)
        return
    record.mod_results[mod.name] = result
    log.info("%s: %s: %s", record.name, mod, result)


def loka_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode: Optional[str] = None):
    """`torch.compile(model, backend="loka", options={...} | LokaConfig(...))`. The graph's
    record joins the state of the compile it runs for (`state.state_for_compile`)."""
    config = LokaConfig.from_options(options)
    if mode is not None:
        config = dataclasses.replace(config, mode=mode)
    state = state_for_compile()
    fingerprint, device_type = _graph_fingerprint(gm, example_inputs)
    plan = Plan(params=fingerprint, device_type=device_type, recipe=config.recipe)
    if config.plan is not None:
        loaded = load_plan(config.plan)
        loaded.check(fingerprint, device_type, config.recipe)  # ValueError naming what differs
        plan = dataclasses.replace(loaded, params=fingerprint, unsafe=dict(loaded.unsafe),
                                   upgraded=dict(loaded.upgraded), a_scales=dict(loaded.a_scales))
    record = GraphRecord(name=next_graph_name(), config=config, store=state.store, plan=plan)
    if config.arch_mods:
        record.mod_results.update(mods.apply_arch_mods(gm, config.arch_mods))
        log.info("%s: architecture Mods %s", record.name, {name: record.mod_results[name] for name in config.arch_mods})
    for mod in mods.dynamo_graph_mods():
        if mod.on(config.inactive_mods):
            _run_dynamo_graph_mod(mod, gm, example_inputs, record)
    compiled = LokaCompiledGraph(gm, example_inputs, record, state)
    state.add(record)  # only once compiled: Dynamo may restart and call again
    return compiled


def reset() -> None:
    """Nothing process-wide to forget: each compile's records and Probe statistics live in
    its own state and go with the compiled model. Clears the speed check's in-process
    timings (the performance database on disk stays); call torch._dynamo.reset() to
    recompile."""
    speed.clear_cache()
