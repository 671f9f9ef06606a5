"""Inductor's FX graph cache for loka graphs.

A cache hit skips Inductor's post-grad passes, loka's among them, so nothing would record
the graph's sites and decisions for the report. On a hit the backend runs the post-grad
passes again on a copy of the graph (`post_grad_passes`): loka's pass records everything
as on a miss, and the graph it makes is compared with the one the cached code was
compiled from. The key of the cache covers the graph, Inductor's config and loka's pass
`uuid` (loka's code, the config, the phase, the plan's verdicts, a probe graph's name);
what it does not cover (the speed check's timings, a monkeypatched Dispatch or hardware
stood in for in tests) shows in the rewritten graph. So each miss keeps a digest of the
graph after loka's pass under the FX cache key, in `graphs/` under loka's cache directory
(`perfdb.cache_dir`), and a hit is used only when the digest of the graph made again
matches; otherwise the entry is dropped and the graph compiled again.

Not cached (`bypass_reason`): inference graphs that may read cached FP8 weights, whose
constants are made from this process's parameters and refreshed through them
(`passes/mods/cached_weights.py`), and graphs compiled with Inductor's freezing (weights as
constants too). AOTAutograd's cache is off for loka compiles (`autograd_cache_off`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Optional

import torch

from loka_compile.passes import GraphKind, Phase
from loka_compile.passes.mods import cached_weights

log = logging.getLogger("loka")

DIR_NAME = "graphs"
# Bump when the digest changes meaning: entries of another format are not matched.
FORMAT = 1


def bypass_reason(phase: Phase, kind: GraphKind, inactive_mods, param_input_indices) -> Optional[str]:
    """Why a graph must not use the FX graph cache, or None."""
    if torch._inductor.config.freezing:
        return "freezing: its weights are constants taken from this process's parameters"
    if phase is Phase.FP8 and kind is GraphKind.INFERENCE and cached_weights.MOD.on(inactive_mods) \
            and param_input_indices:
        # Its FP8 weight copies are constants taken from this process's parameters, and
        # the compiled graph is wrapped to refresh them; a cached entry holds neither.
        return "inference graph with cached FP8 weights"
    return None


def graph_digest(graph: torch.fx.Graph, values: bool = True) -> str:
    """Each node's op, target and arguments in graph order, nodes referred to by position
    (a copy of a graph names new nodes differently), and the dtype, shape and (`values`)
    values of the tensors it reads as attributes (constants traced into it)."""
    digest = hashlib.sha256()
    position = {}
    module = graph.owning_module
    for i, node in enumerate(graph.nodes):
        position[node] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        digest.update(repr((node.op, _target_name(node.target), args)).encode())
        value = getattr(module, node.target, None) if node.op == "get_attr" and module is not None else None
        if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
            digest.update(f"{value.dtype}:{tuple(value.shape)}:{_tensor_digest(value) if values else ''}".encode())
    return digest.hexdigest()


def source_digest(gm: torch.fx.GraphModule, example_inputs) -> str:
    """The Dynamo graph as compiled (after loka's Dynamo-graph Mods) and how its inputs look:
    each input's kind, size, stride, dtype and whether it takes a gradient (symbolic sizes by
    name). Constants by dtype and shape, not values: what a timing depends on."""
    digest = hashlib.sha256(graph_digest(gm.graph, values=False).encode())
    for arg in example_inputs:
        if isinstance(arg, torch.Tensor):
            digest.update(repr((type(arg).__name__, tuple(map(str, arg.shape)), tuple(map(str, arg.stride())),
                                str(arg.dtype), arg.requires_grad)).encode())
        else:
            digest.update(repr((type(arg).__name__, str(arg))).encode())
    return digest.hexdigest()


def _tensor_digest(value: torch.Tensor) -> str:
    try:
        return hashlib.sha256(_bytes_of(value)).hexdigest()
    except (RuntimeError, NotImplementedError, TypeError):  # no readable storage (packed weights)
        return f"unread {id(value)} {os.getpid()}"  # never matches: the graph is compiled again


def _bytes_of(value: torch.Tensor) -> bytes:
    """The tensor's bytes, read from a copy: NumPy viewing a tensor's own memory marks its
    storage non-resizable for good (FSDP2 frees parameters by resizing storage to 0)."""
    return value.detach().contiguous().view(torch.uint8).cpu().clone().numpy().tobytes()


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(target)  # a repr with an address never matches


def _path(key: str):
    # Imported here: `python -m loka_compile.perfdb` must find perfdb not yet imported.
    from loka_compile.perfdb import cache_dir
    return cache_dir() / DIR_NAME / f"{key}.json"


def save(key: str, digest: str) -> None:
    """Keep the digest of the graph after loka's pass under the FX cache key `key`; a
    directory that cannot be written is logged and the entry is lost (a later hit
    recompiles)."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump({"format": FORMAT, "digest": digest}, f)
        os.replace(f.name, path)
    except OSError as error:
        log.info("loka: could not keep a graph digest in %s (%s); a cache hit of it will recompile", path, error)


def load(key: str) -> Optional[str]:
    try:
        entry = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    return entry.get("digest") if isinstance(entry, dict) and entry.get("format") == FORMAT else None


def drop_inductor_entry(key: str) -> bool:
    """Delete Inductor's local FX cache entry `key`, so that the compile after it saves
    a new one (a stale entry would be hit, checked and compiled again in every process);
    False where it could not."""
    from torch._inductor.codecache import FxGraphCache

    locate = getattr(FxGraphCache, "_get_tmp_dir_for_key", None)
    if locate is None:
        return False
    shutil.rmtree(locate(key), ignore_errors=True)
    return not os.path.exists(locate(key))


def post_grad_passes(gm: torch.fx.GraphModule, example_inputs, is_inference: bool) -> torch.fx.GraphModule:
    """Inductor's post-grad passes (loka's custom passes among them) on a copy of `gm`,
    prepared as Inductor prepares a graph for them before lowering (torch 2.11-2.13
    `_InProcessFxCompile.codegen_and_compile`). Returns the copy."""
    from torch._inductor import compile_fx as inductor
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.virtualized import V

    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    with torch.utils._python_dispatch._disable_current_modes():
        view_to_reshape(copied)
        with torch.no_grad():
            fake_mode = inductor.fake_tensor_prop(copied, example_inputs)
        record_strides = getattr(inductor, "_recursive_record_original_output_strides", None)
        if record_strides is not None:
            record_strides(copied)
        device_context = getattr(inductor, "get_cuda_device_context", lambda _: contextlib.nullcontext())
        with V.set_fake_mode(fake_mode), device_context(copied):
            inductor._recursive_post_grad_passes(copied, is_inference=is_inference)
    return copied


def autograd_cache_off():
    """AOTAutograd's cache off: its hit loads the forward and backward from the FX graph
    cache by key without calling the inner compile, where loka checks and records them."""
    config = torch._functorch.config
    if not hasattr(config, "enable_autograd_cache"):
        return contextlib.nullcontext()
    return config.patch(enable_autograd_cache=False)
