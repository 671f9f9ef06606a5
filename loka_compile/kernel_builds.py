"""loka's own Triton kernels built while Inductor compiles the rest of the graph.

A `loka::triton_fp8_gemm` node is an extern call in Inductor's code: its Triton kernels are
compiled by `triton.jit` at the op's first call (each tile config the autotuner times, ptxas
included), in the model's first step, one after another. Inductor builds its own kernels in
its pool of compile workers while it compiles. So when loka's passes have lowered a graph, each
such node's kernels are built here, in one background thread, from the node's sizes, strides
and dtypes (`triton_gemm.build_ahead`), while Inductor goes on with code generation; the first
call then finds them in Triton's cache. Only compiles run in the thread (meta tensors, nothing
is launched or allocated on the device), so CUDA-graph capture and timings in the main thread
are not disturbed. A node with symbolic sizes is left to its first call; a failed build is
logged at DEBUG and costs the first call nothing but the compile it had before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Optional

import torch

from loka_compile.kernels import triton_gemm

log = logging.getLogger("loka")

_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pending: list = []  # futures of builds submitted and not yet finished or waited for
_built_unwaited = 0  # kernels of finished builds taken off `_pending` since the last `wait`


def gemm_builds(graph: torch.fx.Graph) -> list:
    """(args, kwargs, device) of `triton_gemm.build_ahead` for each `loka::triton_fp8_gemm`
    node of `graph` whose tensor arguments have static sizes and strides (meta tensors of
    them) and whose output is on a CUDA device."""
    found = []
    for node in graph.find_nodes(op="call_function", target=torch.ops.loka.triton_fp8_gemm.default):
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or out.device.type != "cuda":
            continue
        try:
            # Plain meta tensors even where the compile's fake mode is active: the thread reads their layout only.
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta_of)
        except _Symbolic:
            continue
        found.append((args, kwargs, out.device))
    return found


class _Symbolic(Exception):
    """An argument whose size or stride is symbolic (or unknown): its kernel waits for the call."""


def _meta_of(node: torch.fx.Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise _Symbolic(node.name)
    sizes, strides = tuple(value.shape), tuple(value.stride())
    if not all(isinstance(d, int) for d in sizes + strides):
        raise _Symbolic(node.name)
    return torch.empty_strided(sizes, strides, dtype=value.dtype, device="meta")


def start(graph: torch.fx.Graph) -> int:
    """Build, in the background, the kernels of `graph`'s loka Triton GEMMs (outside the
    interpreter); returns how many nodes were handed over."""
    if triton_gemm.interpreting():
        return 0
    builds = gemm_builds(graph)
    if not builds:
        return 0
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="loka-kernel-build")
        _settle_finished()
        _pending.extend(_pool.submit(_build, *build) for build in builds)
    return len(builds)


def _build(args, kwargs, device: torch.device) -> int:
    try:
        with torch.cuda.device(device):
            return triton_gemm.build_ahead(*args, **kwargs, device=device)
    except Exception as error:  # noqa: BLE001  (a build ahead is an optimisation: the first call compiles)
        log.debug("loka: building a Triton GEMM ahead failed (%s: %s); its first call compiles it",
                  type(error).__name__, error)
        return 0


def wait(timeout: Optional[float] = None) -> int:
    """Wait for the builds submitted so far; returns the kernels they built."""
    global _built_unwaited
    with _lock:
        futures, _pending[:] = list(_pending), []
        settled, _built_unwaited = _built_unwaited, 0
    done, _ = concurrent.futures.wait(futures, timeout=timeout)
    return settled + sum(f.result() for f in done)


def _settle_finished() -> None:
    """Finished builds off `_pending` (held under `_lock`), their kernels counted for `wait`:
    a model that never waits does not keep a future per compiled graph."""
    global _built_unwaited
    finished = {id(f): f for f in _pending if f.done()}  # taken once: a build may finish meanwhile
    _built_unwaited += sum(f.result() for f in finished.values())
    _pending[:] = [f for f in _pending if id(f) not in finished]
