"""One plan on every rank: decisions that depend on rank-local data or timing, taken once.

Under torch.distributed each rank compiles its own copy of every graph, and several of
loka's decisions read what only that rank has seen: the Probe's verdicts (its window's
statistics), the output budget (sensitivities on its closing call's batch), the speed
check (its own timings), the amax guard (its own amaxes), re-checks. Ranks that decided
alone could compile different plans: different graphs, and under DDP or FSDP different
numerics per replica. So each such decision goes through `decide_once`: rank 0 decides
and broadcasts (or, with `merge`, every rank's view is gathered and merged alike on all).

Every rank calls `decide_once` at the same point of the same call: the decision points
are reached in lockstep because ranks run the same graphs the same number of times (a
window closes at the same call count; a recompile happens on every rank at once when the
inputs change alike). A decision that raises on rank 0 raises on every rank, so the
fallback that follows is the same everywhere and no rank waits on a broadcast alone.
"""

from __future__ import annotations

import pickle
from typing import Callable, Optional

import torch


def distributed() -> bool:
    """True when torch.distributed is initialized with more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class RankDecisionError(RuntimeError):
    """A decision raised on the rank that took it; every rank raises this in its place."""


def decide_once(decide: Callable, merge: Optional[Callable] = None):
    """`decide()` on this process, or, when distributed: `decide()` on rank 0, broadcast to
    every rank; with `merge`, `decide()` on every rank and `merge(list of the ranks'
    results)` on all, the same everywhere. An exception on the deciding rank is raised on
    every rank: the original there, a copy of it elsewhere (`RankDecisionError` with its
    text where it does not pickle), so every rank takes the same `except` branch."""
    if not distributed():
        return decide() if merge is None else merge([decide()])
    # Compile passes run under a fake-tensor mode; the object collectives need real tensors.
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        return _decide_on_ranks(decide, merge)


def _decide_on_ranks(decide: Callable, merge: Optional[Callable]):
    """`decide_once` when distributed."""
    dist = torch.distributed
    error = None
    if merge is not None or dist.get_rank() == 0:
        try:
            outcome = ("ok", decide())
        except Exception as raised:  # noqa: BLE001  (sent to the other ranks, then raised here)
            error, outcome = raised, ("error", _portable(raised))
    if merge is None:
        payload = [outcome if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        outcomes = payload
    else:
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
    failed = [value for status, value in outcomes if status == "error"]
    if failed:
        if error is not None:
            raise error
        raise failed[0]
    values = [value for _, value in outcomes]
    return values[0] if merge is None else merge(values)


def _portable(error: Exception) -> Exception:
    """`error` as another rank can receive it: itself where it survives pickling, else a
    RankDecisionError with its text."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error):
            return copy
    except Exception:  # noqa: BLE001  (an exception that does not pickle goes as text)
        pass
    return RankDecisionError(f"the decision failed on another rank: {type(error).__name__}: {error}")
