"""The Probe's statistics store: what the observers saw, per site, and the verdicts.

Observers (`torch.ops.loka.observe_gemm`, inserted by the `probe` pass) report 0-d
device tensors; the store keeps running sums and maxima on the device, so observing
never waits for the GPU. Summaries and verdicts read them back once, when a graph's
probe window closes or a report is made.
"""

from __future__ import annotations

import threading

import torch

from loka_compile.kernels import ops

_SUMMED = ("rel_error", "mere", "a_rms", "b_rms")
_MAXED = ("rel_error", "a_amax", "b_amax", "rel_error_rowwise")


class ProbeStore:
    def __init__(self):
        self._lock = threading.Lock()
        self._sums: dict = {}
        self._maxes: dict = {}
        self._counts: dict = {}

    def record(self, key: str, stats: dict) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            sums = self._sums.setdefault(key, {})
            maxes = self._maxes.setdefault(key, {})
            for name in _SUMMED:
                sums[name] = stats[name] if name not in sums else sums[name] + stats[name]
            for name in _MAXED:
                if name in stats:  # rel_error_rowwise: tensorwise sites only
                    maxes[name] = stats[name] if name not in maxes else torch.maximum(maxes[name], stats[name])

    def observed(self, key: str) -> int:
        return self._counts.get(key, 0)

    def summary(self, key: str) -> dict:
        """Mean and max of the FP8 relative error, mean MERE, operand amax and rms."""
        count = self._counts.get(key, 0)
        if not count:
            return {}
        sums, maxes = self._sums[key], self._maxes[key]
        out = {"observations": count}
        out.update({f"mean_{n}": float(sums[n]) / count for n in _SUMMED})
        out.update({f"max_{n}": float(maxes[n]) for n in _MAXED if n in maxes})
        return out

    def keys(self):
        return list(self._counts)

    def clear(self) -> None:
        with self._lock:
            self._sums.clear()
            self._maxes.clear()
            self._counts.clear()


STORE = ProbeStore()
ops.set_observer_sink(STORE.record)


def verdicts(keys, max_error: float) -> tuple[dict, dict]:
    """(unsafe, upgraded) among `keys`: a site whose largest observed FP8 relative error
    exceeds max_error (a NaN error counts) is upgraded to rowwise scaling when it was
    tensorwise and its rowwise error is within the bound ({key: (tensorwise error,
    rowwise error)}), else unsafe ({key: its error})."""
    unsafe, upgraded = {}, {}
    for key in keys:
        summary = STORE.summary(key)
        if not summary:
            continue
        worst = summary["max_rel_error"]
        if worst <= max_error:
            continue
        rowwise = summary.get("max_rel_error_rowwise")
        if rowwise is not None and rowwise <= max_error:
            upgraded[key] = (worst, rowwise)
        else:
            unsafe[key] = worst
    return unsafe, upgraded
