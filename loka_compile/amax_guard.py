"""The amax guard: tensorwise sites caught at run time, after their probe window.

A tensorwise scale serves a tensor only while its largest value stays near what the Probe
saw: an outlier that first appears after the window (one row of 1e6 in a batch of unit
values) sets a scale that flushes every other row to zero, and nothing measures it then.
An infinity is as bad in e4m3, which has none: the cast writes NaN, so a ReLU or a max
after the GEMM keeps NaN where high precision's -inf would have become 0.

So each tensorwise site of an FP8 variant compiled after a window checks, at every call,
the amax its casts already compute (`scaled_gemm.AmaxGuard`; one `loka::amax_guards` op
per graph, `passes/amax_guard.py`, keeps the running max of each in place on the device,
and the backend reads it between calls, without a sync):

- against `scaled_gemm.amax_jump(format)` times the largest amax of that operand in the
  window (e4m3: 2^14.8, the format's range of normal values: beyond it every value the
  window saw scales below e4m3's normal range, so typical values keep a bit or two or
  flush to zero); the window's statistics are the Probe's (the compile's `ProbeStore`);
- for an e4m3 operand cast outside the graph (a cached weight, refreshed when it
  changes), for any inf or NaN. In a graph that would cost one more pass over each
  operand per call, so there an infinity in an e4m3 tensorwise operand stays NaN (its
  row or column of the product is non-finite in high precision too; only the sign is
  lost).

A site that trips goes rowwise (whose scales follow each row, and keep an infinity's
sign, `kernels/quantize.py`) when the window measured rowwise within the bound, else
high precision: an amendment of the plan's verdicts like a re-check's (`recheck_every`),
logged at WARNING, kept in `Plan.history` and `site.history`, and in the site's detail;
the FP8 variant is switched to a build with the new verdicts. The call that met the
outlier has run already (its outputs are what FP8 made of it): the next call runs rowwise.
On CUDA each call's amaxes are copied back without a sync (`copy_back`) and read at the
first call after the copy landed: the next one where the host waited for the GPU (a loss
read back, say), a later one where it runs ahead (a training step's backward guards, which run
after the forward's copy, show a step later); CPU buffers are read at the next call. Under
torch.distributed the ranks' trips are merged by a collective that waits for the device, so
they are copied and read every RANK_MERGE_EVERY calls (`due`): a trip acts up to that many
calls later than in one process. Graphs with a loaded plan (no window) have no guard.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import torch

from loka_compile import probe, ranks
from loka_compile.kernels import ops as loka_ops
from loka_compile.kernels.quantize import Fp8Format
from loka_compile.kernels.scaled_gemm import amax_jump

_tokens = itertools.count()

# Under torch.distributed, the calls between two merges of the ranks' trips (`AmaxGuards.due`).
# A merge is an object all-gather: a collective round trip, and on CUDA a wait for the work
# queued on the device, which for a host-bound model costs about the lead the host had (up to
# a step); at one per 64 calls of a graph it stays within a few percent of a step, and a trip
# still acts within 64 calls.
RANK_MERGE_EVERY = 64


@dataclasses.dataclass
class AmaxGuards:
    """One graph's guards: the key prefix its guard ops report under (unique to the
    record, so that a graph of another model, or one compiled after `reset()` under the
    same name, never reads its buffers), by site id (A's, B's) window amax and formats, and
    the read-back of CUDA buffers in flight."""

    prefix: str
    window_amax: dict  # site id -> (a_amax, b_amax)
    formats: dict      # site id -> (a_format, b_format)
    _copies: dict = dataclasses.field(default_factory=dict)  # id(buffer) -> _HostCopy

    @classmethod
    def of_window(cls, name: str, observed: dict, decisions: dict, store: probe.ProbeStore) -> Optional["AmaxGuards"]:
        """Guards for the observed sites (probe key -> (site id, own scaling)) that stay
        tensorwise by `decisions` (site id -> (a_format, b_format) of those that do), from
        the window's statistics in `store`."""
        window, formats = {}, {}
        for key, (sid, own) in observed.items():
            if own != "tensorwise" or sid not in decisions:
                continue
            operands = store.summary(key).get("operands", {})
            amax = tuple(_finite(operands.get(op, {}).get("amax")) for op in ("a", "b"))
            if any(a is not None and a > 0 for a in amax):
                window[sid], formats[sid] = amax, decisions[sid]
        return cls(f"{name}#{next(_tokens)}", window, formats) if window else None

    def register(self, graph) -> None:
        """Make the buffers of the guard ops in `graph` (a compiled graph's, before it first
        runs: outside any CUDA-graph memory pool)."""
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.loka.amax_guards.default:
                amaxes, name, keys, operands, limits = node.args
                loka_ops.register_amax_guards(name, tuple(zip(keys, operands, limits)), amaxes.meta["val"].device)

    @staticmethod
    def due(calls: int) -> bool:
        """Whether the guards are copied back after call `calls` and read at the next: always in
        one process; every RANK_MERGE_EVERY calls under torch.distributed, where every rank
        counts the same calls."""
        return calls % RANK_MERGE_EVERY == 0 or not ranks.distributed()

    def trips(self) -> dict:
        """site id -> why its guard tripped, from the buffers as last read: CPU ones now,
        CUDA ones from the copy `copy_back` issued if it has landed (no sync)."""
        tripped = {}
        for buffer in loka_ops.amax_guard_buffers(self.prefix + "/"):
            values = buffer.worst.tolist() if buffer.worst.device.type != "cuda" else self._landed(buffer)
            for (key, operand, limit), value in zip(buffer.entries, values):
                if not value <= limit:  # NaN and inf trip too
                    tripped.setdefault(key[len(self.prefix) + 1:], {})[operand] = value
        return {sid: self._why(sid, operands) for sid, operands in tripped.items()}

    def _landed(self, buffer) -> list:
        copy = self._copies.get(id(buffer))
        if copy is None or not copy.in_flight or not copy.landed():
            return []  # none, or still in flight: read at a later call
        copy.in_flight = False
        return copy.host.tolist()  # a pinned host copy that has landed: no sync

    def copy_back(self) -> None:
        """After a call: copy each CUDA buffer to its pinned host copy (one device-to-host
        copy each, no sync), unless the last one is still in flight (a landed one not read
        yet is replaced: the running max only grows). The next call's `trips` reads it once
        it has landed."""
        for buffer in loka_ops.amax_guard_buffers(self.prefix + "/"):
            if buffer.worst.device.type != "cuda":
                continue
            copy = self._copies.get(id(buffer))
            if copy is None:
                copy = self._copies[id(buffer)] = _HostCopy(buffer.worst)
            elif copy.in_flight and not copy.landed():
                continue
            copy.fill(buffer.worst)

    def _why(self, sid: str, operands: dict) -> str:
        parts = []
        for op, value in sorted(operands.items()):
            window = self.window_amax.get(sid, (None, None))["ab".index(op)]
            fmt = Fp8Format(self.formats.get(sid, ("e4m3", "e4m3"))["ab".index(op)])
            if not math.isfinite(value):
                parts.append(f"operand {op} holds {'NaN' if math.isnan(value) else 'inf'}, which a tensorwise "
                             f"{fmt.value} cast writes as NaN where high precision has +-inf")
            else:
                parts.append(f"operand {op}'s amax {value:.3g} is over {amax_jump(fmt):.0f} x its probe window's "
                             f"{window:.3g}, where every value the window saw falls below {fmt.value}'s normal range")
        return "amax guard: " + "; ".join(parts)

    def forget(self, sids) -> None:
        """Zero the running max of these sites (a build that runs them tensorwise again,
        after a re-check promoted them back, starts afresh); copies in flight are dropped."""
        for buffer in loka_ops.amax_guard_buffers(self.prefix + "/"):
            for i, (key, _, _) in enumerate(buffer.entries):
                if key[len(self.prefix) + 1:] in sids:
                    buffer.worst[i] = 0.0
        for copy in self._copies.values():
            copy.in_flight = False  # what it holds predates the zeroing


class _HostCopy:
    """A CUDA buffer's pinned host copy and the event of the copy in flight, made once.
    `in_flight`: copied and not read yet."""

    def __init__(self, worst: torch.Tensor):
        self.host = torch.empty(worst.shape, dtype=worst.dtype, pin_memory=True)
        self.event = torch.cuda.Event()
        self.in_flight = False

    def fill(self, worst: torch.Tensor) -> None:
        self.host.copy_(worst, non_blocking=True)
        self.event.record()
        self.in_flight = True

    def landed(self) -> bool:
        return self.event.query()


def _finite(value) -> Optional[float]:
    return float(value) if value is not None and math.isfinite(value) else None


def demotion(summary: dict, max_error: float, metric: str, why: str):
    """Where a tripped site goes: ("upgraded", (target, steps, why)) to the first finer
    scaling whose bound the window measured within `max_error`, else ("unsafe", inf)."""
    steps = probe.chain_steps(summary, metric) if summary else [["tensorwise", math.inf]]
    steps = [["tensorwise", math.inf], *steps[1:]]
    passing = [s for s, bound in steps[1:] if bound <= max_error]
    if passing:
        return "upgraded", (passing[0], steps, why)
    return "unsafe", math.inf
