"""Several ranks of one test, each a spawned process in a process group on a file store:
gloo on CPU, NCCL on CUDA (one GPU per rank). The one setup every distributed test uses.

A rank's work is `target(rank, *args)`, a module-level function (spawn pickles it by name);
what it returns comes back to the test. A rank that raises sends its traceback; a rank
still running at the timeout is killed (a deadlock), and the test fails naming it."""

from __future__ import annotations

import datetime
import os
import pathlib
import time
import traceback

import torch
import torch.multiprocessing as mp

# Shorter than any test's join timeout: a collective that waits on a dead rank raises first.
PROCESS_GROUP_TIMEOUT_S = 60


def run_ranks(target, args: tuple, world_size: int, timeout_s: float, store_dir, *, backend: str = "gloo",
              threads: int = 1) -> list:
    """`target(rank, *args)` on `world_size` spawned ranks in one `backend` process group;
    their return values in rank order. Asserts that every rank finished within `timeout_s`
    (all together) without raising, with each failing rank's traceback in the message."""
    store = pathlib.Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, str(store), backend, threads, target, args),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    exitcodes = [p.exitcode for p in procs]
    errors = {f.name: f.read_text() for f in sorted(store.glob("rank*.err"))}
    assert exitcodes == [0] * world_size and not errors, (exitcodes, errors)  # None: killed at the timeout
    return [torch.load(store / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_main(rank: int, world_size: int, store_dir: str, backend: str, threads: int, target, args) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        init = dict(init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size,
                    timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            init["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, **init)
        try:
            result = target(rank, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(store_dir, f"rank{rank}.pt"))
    except BaseException:
        pathlib.Path(store_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
