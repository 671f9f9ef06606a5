"""The Probe's statistics store: what the observers saw, per site, and the verdicts.

Observers (`torch.ops.loka.observe_gemm`, inserted by the `probe` pass) report device
tensors (`kernels.ops.gemm_statistics`); the store merges them on the device, so
observing never waits for the GPU. Per site it keeps:

- per operand (A's rows; B's columns), over the features K: the amax, Welford's
  per-feature mean and variance (each call's batch moments merged with Chan's parallel
  update; none past `ops.MOMENT_FEATURES` features, as a wgrad site's batch-long rows),
  the counts of values that saturate, flush to zero or go subnormal in e4m3 and e5m2
  (tensorwise, rowwise, unscaled), and a reservoir of real rows (`Reservoir`);
- per FP8 candidate (scaling and formats): the error of each observation (row relative
  error, MERE, SQNR) as running moments, from which `summary` gives the mean and a
  one-sided confidence bound across observations (`upper_bound`).

What syncs: nothing per call. The reservoir's slot choice depends only on row counts, so
it is drawn on the host and its indices copied without waiting. `summary` and `verdicts`
read everything back once, when a probe window closes or a report is made.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from typing import Optional
import weakref

import numpy as np
import torch

from loka_compile.kernels import ops

log = logging.getLogger("loka")

_SUMMED = ("a_rms", "b_rms")
# Error means count only informative observations (`gemm_statistics`' `informative`: no
# all-zero operand); bf16_rel_error: the same product's error in bf16 (the noise floor).
_ERROR_SUMMED = ("rel_error", "mere", "bf16_rel_error")
_MAXED = ("rel_error", "a_amax", "b_amax", "rel_error_rowwise")
_METRICS = ("rel_error", "mere", "sqnr_db")  # sqnr_db: higher is better, bounded below

# Confidence of the bound on a candidate's mean error across observations: a one-sided
# Student-t interval at 95% (1 in 20 sites whose true mean sits at the bound passes).
CONFIDENCE = 0.95
# t quantiles at CONFIDENCE for 1..30 degrees of freedom; above, the Cornish-Fisher
# expansion around the normal quantile (error < 1e-3).
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761,
        1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701,
        1.699, 1.697)
_Z95 = 1.6448536269514722

# Rows kept per site and operand (uniform over every row observed): as many as one
# observation's error sample. Memory: 256 x K in the operand's dtype, K up to 4096.
RESERVOIR_ROWS = 256
# The reservoir keeps at most this many elements per operand: rows longer than 4096 get
# fewer slots (at least one). A wgrad site's rows are as long as the batch (1.3M on Wukong's
# interaction layers): 256 of them held 10.8 GB over Wukong's 45 wgrad sites on the H100.
RESERVOIR_ELEMENTS = RESERVOIR_ROWS * 4096
_RESERVOIR_SEED = 0x10CA


def t_quantile(df: int) -> float:
    """The CONFIDENCE quantile of Student's t with df degrees of freedom."""
    if df <= len(_T95):
        return _T95[df - 1]
    z = _Z95
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def upper_bound(mean: float, std: float, n: int, worst: float) -> float:
    """One-sided upper confidence bound on the mean of n observations: mean + t s / sqrt(n),
    with s the sample standard deviation; the worst observation when n < 2, and +inf when
    any observation was not finite (NaN never passes)."""
    if not math.isfinite(worst) or not math.isfinite(mean):
        return math.inf
    if n < 2:
        return worst
    return mean + t_quantile(n - 1) * std / math.sqrt(n)


class Moments:
    """Welford's streaming mean and variance, on the device, of tensors of one shape; a
    batch enters with its own (count, mean, m2) and merges by Chan's parallel update:
        n = na + nb, d = mean_b - mean_a,
        mean = mean_a + d nb / n,  m2 = m2_a + m2_b + d^2 na nb / n.
    Counts may be tensors (per-feature counts of finite values)."""

    def __init__(self):
        self.count = None
        self.mean = None
        self.m2 = None

    def merge(self, count, mean, m2) -> None:
        if self.count is None:
            self.count, self.mean, self.m2 = count, mean, m2
            return
        n = self.count + count
        safe_n = n.clamp_min(1) if isinstance(n, torch.Tensor) else max(n, 1)
        delta = mean - self.mean
        self.mean = self.mean + delta * count / safe_n
        self.m2 = self.m2 + m2 + delta * delta * self.count * count / safe_n
        self.count = n

    def add(self, value) -> None:
        """One observation (a tensor of the tracked shape)."""
        self.merge(1, value, torch.zeros_like(value))

    def variance(self, ddof: int = 0):
        """m2 / (count - ddof): ddof 0 as numpy's var, 1 for the sample variance."""
        n = self.count
        return self.m2 / (n - ddof).clamp_min(1) if isinstance(n, torch.Tensor) else self.m2 / max(n - ddof, 1)


class Reservoir:
    """A uniform sample of at most `capacity` rows (and RESERVOIR_ELEMENTS elements) from
    every row offered (reservoir sampling, Vitter's algorithm R): row t (0-based, over all
    calls) takes a slot when t < capacity, else replaces slot j for j uniform in [0, t]
    when j < capacity. Which
    rows enter depends on counts only, so slots are drawn on the host (seeded) and the
    rows copied on the device without a sync."""

    def __init__(self, capacity: int = RESERVOIR_ROWS, seed: int = _RESERVOIR_SEED):
        self.requested = capacity
        self.capacity = capacity  # lowered at the first offer for rows over 4096 elements
        self.seen = 0
        self.rows = None
        self._rng = np.random.default_rng(seed)

    def offer(self, rows: torch.Tensor) -> None:
        m = rows.shape[0]
        if self.rows is not None and (self.rows.shape[1:] != rows.shape[1:] or self.rows.device != rows.device):
            self.__init__(self.requested)  # a different operand shape: start over
        if self.rows is None:
            row_elements = max(1, math.prod(rows.shape[1:]))
            self.capacity = max(1, min(self.requested, RESERVOIR_ELEMENTS // row_elements))
            self.rows = rows.new_zeros((self.capacity, *rows.shape[1:]))
        t = self.seen + np.arange(m)
        slots = np.where(t < self.capacity, t, np.floor(self._rng.random(m) * (t + 1)).astype(np.int64))
        take = slots < self.capacity
        # Within one call a later row wins a slot over an earlier one (sequential order).
        slot_of, last = np.unique(slots[take][::-1], return_index=True)
        source = np.nonzero(take)[0][::-1][last]
        self.seen += m
        if len(slot_of):
            to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(rows.device, non_blocking=True)  # noqa: E731
            self.rows.index_copy_(0, to(slot_of), rows.detach().index_select(0, to(source)))

    def sample(self) -> torch.Tensor:
        """The rows held: min(seen, capacity) of them (none once released)."""
        if self.rows is None:
            return torch.empty(0)
        return self.rows[: self.held]

    @property
    def held(self) -> int:
        return 0 if self.rows is None else min(self.seen, self.capacity)

    def release(self) -> None:
        """Drop the rows (device memory: up to RESERVOIR_ELEMENTS per operand), keep the counts."""
        self.rows = None


class _OperandStats:
    def __init__(self):
        self.amax = None
        self.moments = Moments()
        self.counts: dict = {}
        self.nonfinite = None
        self.numel = 0
        self.reservoir = Reservoir()

    def record(self, stats: dict) -> None:
        self.amax = stats["amax"] if self.amax is None else torch.maximum(self.amax, stats["amax"])
        if stats["mean"] is None:  # too many features to keep moments of (ops.MOMENT_FEATURES)
            self.moments = Moments()
        else:
            if self.moments.count is not None and self.moments.mean.shape != stats["mean"].shape:
                self.moments = Moments()
            self.moments.merge(stats["count"], stats["mean"], stats["m2"])
        for name, c in stats["fractions"].items():
            self.counts[name] = c if name not in self.counts else self.counts[name] + c
        self.nonfinite = stats["nonfinite"] if self.nonfinite is None else self.nonfinite + stats["nonfinite"]
        self.numel += stats["numel"]
        self.reservoir.offer(stats["rows"])

    def summary(self) -> dict:
        numel = max(self.numel, 1)
        return {
            "amax": float(self.amax),
            "mean": None if self.moments.count is None else self.moments.mean.cpu(),
            "var": None if self.moments.count is None else self.moments.variance().cpu(),
            "count": None if self.moments.count is None else self.moments.count.cpu(),
            "nonfinite": float(self.nonfinite) / numel,
            "fractions": {name: float(c) / numel for name, c in self.counts.items()},
            "reservoir_rows": self.reservoir.held,  # ProbeStore.reservoir() has them; 0 once released
            "rows_seen": self.reservoir.seen,
        }


class _CandidateStats:
    """A candidate's error across observations; an uninformative one (an all-zero operand,
    `informative` False) enters with weight 0, on the device, so it moves neither the mean,
    the spread, the worst nor the count n that the confidence bound takes."""

    def __init__(self):
        self.count = None  # informative observations, a device scalar
        self.moments = {m: Moments() for m in _METRICS}
        self.worst = {}

    def record(self, stats: dict, informative) -> None:
        weight = informative.double() if isinstance(informative, torch.Tensor) else float(bool(informative))
        self.count = weight if self.count is None else self.count + weight
        for m in _METRICS:
            value = stats[m].double()
            value = torch.where(informative, value, torch.zeros_like(value)) if isinstance(weight, torch.Tensor) \
                else value
            self.moments[m].merge(weight, value, torch.zeros_like(value))
            pick = torch.minimum if m == "sqnr_db" else torch.maximum
            sentinel = math.inf if m == "sqnr_db" else -math.inf
            seen = torch.where(informative, value, torch.full_like(value, sentinel)) \
                if isinstance(weight, torch.Tensor) else (value if weight else torch.full_like(value, sentinel))
            self.worst[m] = seen if m not in self.worst else pick(self.worst[m], seen)

    @property
    def n(self) -> int:
        return 0 if self.count is None else int(round(float(self.count)))

    def summary(self) -> dict:
        n = self.n
        if n == 0:  # every observation had an all-zero operand: the error was never measured
            out = {"n": 0, "uninformative": True}
            for m in _METRICS:
                far = -math.inf if m == "sqnr_db" else math.inf
                out[m] = {"mean": far, "bound": far, ("min" if m == "sqnr_db" else "max"): far}
            out.update(mean=math.inf, bound=math.inf)
            return out
        out = {"n": n}
        for m in _METRICS:
            mean = float(self.moments[m].mean)
            std = math.sqrt(max(float(self.moments[m].variance(ddof=1)), 0.0)) if n > 1 else 0.0
            worst = float(self.worst[m])
            if m == "sqnr_db":  # a lower bound: negate, bound, negate back
                bound = -upper_bound(-mean, std, n, -worst) if math.isfinite(worst) else -math.inf
                out[m] = {"mean": mean if math.isfinite(worst) else -math.inf, "bound": bound, "min": worst}
            else:
                bound = upper_bound(mean, std, n, worst)
                out[m] = {"mean": mean if math.isfinite(worst) else math.inf, "bound": bound, "max": worst}
        # The verdict metric at the top: row relative error.
        out.update(mean=out["rel_error"]["mean"], bound=out["rel_error"]["bound"])
        return out


class ProbeStore:
    def __init__(self):
        self._lock = threading.Lock()
        self._sums: dict = {}
        self._maxes: dict = {}
        self._counts: dict = {}
        self._operands: dict = {}    # key -> {"a": _OperandStats, "b": ...}
        self._candidates: dict = {}  # key -> {name: _CandidateStats}
        self._chosen: dict = {}      # key -> the site's own candidate name
        self._failed: dict = {}      # key -> why the last failed observation failed
        self._keeping = 0            # open `keeping_samples` blocks

    def record(self, key: str, stats: dict) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            if "failed" in stats:  # unmeasured, so unsafe (`verdicts`)
                self._failed[key] = stats["failed"]
                return
            sums = self._sums.setdefault(key, {})
            maxes = self._maxes.setdefault(key, {})
            informative = stats.get("informative", True)
            weight = informative.double() if isinstance(informative, torch.Tensor) else float(bool(informative))
            values = {name: stats[name] for name in _SUMMED}
            values.update({name: torch.where(informative, stats[name].double(), 0.0) * weight
                           if isinstance(weight, torch.Tensor) else stats[name] * weight
                           for name in _ERROR_SUMMED if name in stats})
            values["informative"] = weight
            for name, value in values.items():
                sums[name] = value if name not in sums else sums[name] + value
            for name in _MAXED:
                if name in stats:  # rel_error_rowwise: tensorwise sites only
                    maxes[name] = stats[name] if name not in maxes else torch.maximum(maxes[name], stats[name])
            for operand, s in stats.get("operands", {}).items():
                self._operands.setdefault(key, {}).setdefault(operand, _OperandStats()).record(s)
            for name, s in stats.get("candidates", {}).items():
                self._candidates.setdefault(key, {}).setdefault(name, _CandidateStats()).record(s, informative)
            if "chosen" in stats:
                self._chosen[key] = stats["chosen"]

    def observed(self, key: str) -> int:
        return self._counts.get(key, 0)

    def summary(self, key: str) -> dict:
        """Mean and max of the FP8 relative error, mean MERE, operand amax and rms; with
        the observers' full statistics also `operands` ({"a", "b"}: amax, per-feature
        mean/var/count, non-finite and FP8 range fractions, rows held by the reservoir),
        `candidates` ({name: n, mean, bound, and per metric mean/bound/max; sqnr_db's
        bound is a lower one, with its min}), `chosen` and `bound_rel_error` (the chosen
        candidate's bound)."""
        with self._lock:
            count = self._counts.get(key, 0)
            if not count:
                return {}
            if key in self._failed:
                return {"observations": count, "failed": self._failed[key]}
            sums, maxes = self._sums[key], self._maxes[key]
            informative = int(round(float(sums.get("informative", count))))
            out = {"observations": count, "informative": informative}
            out.update({f"mean_{n}": float(sums[n]) / count for n in _SUMMED})
            out.update({f"mean_{n}": float(sums[n]) / informative if informative else math.inf
                        for n in _ERROR_SUMMED if n in sums})
            out.update({f"max_{n}": float(maxes[n]) for n in _MAXED if n in maxes})
            if key in self._operands:
                out["operands"] = {op: s.summary() for op, s in self._operands[key].items()}
            if key in self._candidates:
                out["candidates"] = {name: s.summary() for name, s in self._candidates[key].items()}
            if key in self._chosen and self._chosen[key] in out.get("candidates", {}):
                out["chosen"] = self._chosen[key]
                out["bound_rel_error"] = out["candidates"][out["chosen"]]["bound"]
            return out

    def reservoir(self, key: str, operand: str) -> torch.Tensor:
        """The real rows kept for a site's operand ("a": rows of A, "b": columns of B)."""
        with self._lock:
            return self._operands[key][operand].reservoir.sample()

    def keys(self):
        return list(self._counts)

    def release_samples(self, keys) -> None:
        """Drop the reservoirs' rows of these sites once nothing will read them (a graph
        whose FP8 variant runs, without re-checks): on the device they are up to
        2 x RESERVOIR_ELEMENTS values per site (H100, MaskNet training: 76 MB held for the
        model's life before this). Statistics, verdicts and counts stay. Not while `keeping_samples`."""
        with self._lock:
            if self._keeping:
                return
            for key in keys:
                for stats in self._operands.get(key, {}).values():
                    stats.reservoir.release()

    @contextlib.contextmanager
    def keeping_samples(self):
        """Reservoirs are kept inside this block (calibration reads them after the windows close)."""
        with self._lock:
            self._keeping += 1
        try:
            yield
        finally:
            with self._lock:
                self._keeping -= 1

    def forget(self, keys) -> None:
        """Drop what the observers saw at these sites: a re-check judges each site from
        its own observations only, so statistics from before a drift cannot mask it."""
        with self._lock:
            for key in keys:
                for table in (self._sums, self._maxes, self._counts, self._operands, self._candidates, self._chosen,
                              self._failed):
                    table.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._sums.clear()
            self._maxes.clear()
            self._counts.clear()
            self._operands.clear()
            self._candidates.clear()
            self._chosen.clear()
            self._failed.clear()


# graph name -> the ProbeStore of the compile that owns the graph (`LokaState`).
_STORES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def route_observations(graph: str, store: ProbeStore) -> None:
    """Observations of the sites of `graph` (Probe keys "<graph>/<kind>/<node>") go to `store`."""
    _STORES[graph] = store


def deliver(key: str, stats: dict) -> None:
    """The observers' sink: each observation to the store of the graph its key names; one of
    a graph whose compile is gone is dropped."""
    store = _STORES.get(key.split("/", 1)[0])
    if store is not None:
        store.record(key, stats)


ops.set_observer_sink(deliver)

# The metrics a site may be judged by (`LokaConfig.probe_metric`): the summary's key for each.
METRICS = {"row_rel_error": "rel_error", "mere": "mere"}
# Finer scalings, in order: a site unsafe in its own scaling tries each later one.
SCALING_CHAIN = ("tensorwise", "rowwise", "blockwise")
# Then, for a site with a gradient operand, the same scalings with that operand in e5m2 (wider
# range, coarser steps: better where a gradient's rows span more than e4m3's range), as steps
# named "<scaling> e5m2". Every step in order, for ranking verdicts:
E5M2_GRADIENTS = " e5m2"
CHAIN_ORDER = (*SCALING_CHAIN, *(s + E5M2_GRADIENTS for s in SCALING_CHAIN))


def upgrade_candidate_name(scaling: str) -> str:
    """The candidate an upgrade to `scaling` runs: e4m3 on both operands (the rowwise recipe's formats)."""
    return ops.candidate_name(scaling, "e4m3", "e4m3")


def chain_steps(summary: dict, metric: str = "row_rel_error") -> list:
    """[[scaling, bound], ...]: the site's own candidate, then each finer scaling measured
    (e4m3), by `metric`'s bound. Sites without candidate statistics: the largest
    observed error, and the rowwise one for a tensorwise site (row relative error)."""
    if "chosen" not in summary:
        steps = [["own", summary["max_rel_error"]]]
        if "max_rel_error_rowwise" in summary:
            steps = [["tensorwise", summary["max_rel_error"]], ["rowwise", summary["max_rel_error_rowwise"]]]
        return steps
    field = METRICS[metric]
    candidates, chosen = summary["candidates"], summary["chosen"]
    own = chosen.split("/")[0]
    steps = [[own, float(candidates[chosen][field]["bound"])]]
    finer = SCALING_CHAIN[SCALING_CHAIN.index(own) + 1:] if own in SCALING_CHAIN else ()
    for scaling in finer:
        cand = candidates.get(upgrade_candidate_name(scaling))
        if cand is not None:
            steps.append([scaling, float(cand[field]["bound"])])
    for scaling in (own, *finer) if own in SCALING_CHAIN else ():
        name = e5m2_gradient_candidate(candidates, scaling)
        if name is not None and name != chosen:
            steps.append([scaling + E5M2_GRADIENTS, float(candidates[name][field]["bound"])])
    return steps


def e5m2_gradient_candidate(candidates: dict, scaling: str) -> Optional[str]:
    """The candidate of `scaling` with every gradient operand in e5m2 (the operands the
    observers measured in e5m2 too, `ops.candidate_recipes`), the others e4m3; None for a
    site without a gradient operand."""
    a = any(name.startswith(f"{scaling}/e5m2/") for name in candidates)
    b = any(name.startswith(f"{scaling}/") and name.endswith("/e5m2") for name in candidates)
    name = ops.candidate_name(scaling, "e5m2" if a else "e4m3", "e5m2" if b else "e4m3")
    return name if (a or b) and name in candidates else None


LABELS = {"row_rel_error": "rel. error", "mere": "MERE"}
UNINFORMATIVE = "every observation had an all-zero operand, so its FP8 error was never measured"


def describe_steps(steps, max_error: float, metric: str = "row_rel_error") -> str:
    """"tensorwise rel. error 0.31 > 0.1, rowwise rel. error 0.04 <= 0.1": each step's bound."""
    return ", ".join(f"{s} {LABELS[metric]} {b:.3g} {'>' if not b <= max_error else '<='} {max_error:g}"
                     for s, b in steps)


def describe_summary(summary: dict, max_error: float, metric: str = "row_rel_error") -> str:
    """What a site's verdict rests on: each chain step's bound, or why it was not measured."""
    if "failed" in summary:
        return f"an observation failed: {summary['failed']}"
    if summary.get("informative") == 0:
        return UNINFORMATIVE
    return describe_steps(chain_steps(summary, metric), max_error, metric)


def verdicts(store: ProbeStore, keys, max_error: float, metric=None, chain: bool = False,
             log_level: int = logging.WARNING) -> tuple[dict, dict]:
    """(unsafe, upgraded) among `keys` of `store`, by the confidence bound (`upper_bound`) across
    observations of `metric` ("row_rel_error" or "mere"; None: row relative error; the
    backend passes the config's `probe_metric`): a site whose bound for its own candidate
    exceeds max_error (a NaN counts) goes to the first finer scaling (tensorwise ->
    rowwise -> blockwise, e4m3), then, with a gradient operand, the first of its own and the
    finer scalings with that operand in e5m2 ("rowwise e5m2"), whose bound is within it, else
    it is unsafe ({key: its bound}).

    chain=True: upgraded = {key: (target scaling, [[scaling, bound], ...])}, the site's
    own bound first, then every finer scaling measured (Dispatch takes the first within
    the bound that a provider runs); each verdict is logged; the backend asks for this.
    chain=False (the format of plans written before the chain): only tensorwise ->
    rowwise, {key: (tensorwise bound, rowwise bound)}; a site that only blockwise would
    save is unsafe. Sites without candidate statistics fall back to the
    largest observed error (row relative error). A site with a failed observation is
    unsafe (+inf): it was not measured. `log_level`: of the chain's verdict lines
    (re-checks log only the verdicts that change, so they pass DEBUG)."""
    unsafe, upgraded = {}, {}
    for key in keys:
        summary = store.summary(key)
        if not summary:
            continue
        site_metric = metric or "row_rel_error"
        if site_metric not in METRICS:
            raise ValueError(f"probe metric must be one of {sorted(METRICS)}, got {site_metric!r}")
        if "failed" in summary:
            unsafe[key] = math.inf
            log.warning("loka probe: %s keeps high precision: an observation failed (%s)", key, summary["failed"])
            continue
        if summary.get("informative") == 0:
            unsafe[key] = math.inf
            log.warning("loka probe: %s keeps high precision: %s", key, UNINFORMATIVE)
            continue
        steps = chain_steps(summary, site_metric)
        own_bound = steps[0][1]
        if own_bound <= max_error:
            continue
        passing = [s for s, bound in steps[1:] if bound <= max_error
                   and (chain or (steps[0][0] == "tensorwise" and s == "rowwise"))]
        if not passing:
            unsafe[key] = own_bound
            if chain:
                log.log(log_level, "loka probe: %s keeps high precision (%s)", key,
                        describe_steps(steps, max_error, site_metric))
        elif chain:
            upgraded[key] = (passing[0], steps)
            log.log(log_level, "loka probe: %s goes %s (%s)", key, passing[0],
                    describe_steps(steps, max_error, site_metric))
        else:
            upgraded[key] = (own_bound, dict(steps)["rowwise"])
    return unsafe, upgraded
