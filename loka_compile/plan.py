"""Plans: what loka decided for each site of a compiled model, saved and loaded.

A Plan maps each site's stable id (`Site.id`, "<kind>/<module>:<role>#<n>") to the
essentials of its decision, holds the Probe's verdicts under the same ids, and carries a
fingerprint of what it is for: the compiled module's parameter names, shapes and dtypes,
the device type, the recipe and the format version. Each compiled graph owns one
(`GraphRecord.plan`): verdicts never outlive their model or a `reset()`.

    loka_compile.save_plan(compiled, "plan.json")
    torch.compile(model, backend="loka", options={"plan": "plan.json"})   # no probe window
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from typing import Callable, Optional

import torch

from loka_compile.config import RECIPES
from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.passes import Decision, Reason
from loka_compile.passes.context import Candidate

log = logging.getLogger("loka")

FORMAT_VERSION = 1

# Reasons that come from a measurement (Probe, speed check, a provider at the site's
# shape): a loaded plan's entry with one of these replaces the measurement. Other reasons
# follow from the model and the config and are decided again.
MEASURED_REASONS = frozenset({Reason.FP8, Reason.PROBE_UNSAFE, Reason.SLOWER_THAN_BF16, Reason.PROVIDER_FAILED,
                              Reason.GRAPH_SLOWER_THAN_BF16})

# A site's decision, as `Plan.diff` compares it (timings and details aside).
DECISION_FIELDS = ("fp8", "reason", "provider", "scaling", "a_format", "b_format", "fast_accum", "pad_k", "pad_n")


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """One site's decision, as saved."""

    fp8: bool
    reason: str
    shape: tuple = ()          # (M, K, N) when decided; M may differ at load (dynamic batch)
    dtype: str = ""
    provider: str = "aten"
    scaling: str = ""
    a_format: str = ""
    b_format: str = ""
    pad_k: int = 0
    pad_n: int = 0
    fast_accum: bool = False
    bf16_us: Optional[float] = None
    fp8_us: Optional[float] = None
    detail: str = ""
    # Optional in the file (plans saved before them load with none)
    candidates: tuple = ()     # Candidate per provider the speed check timed
    m_bucket: Optional[int] = None

    @classmethod
    def from_decision(cls, decision: Decision, shape: tuple, dtype) -> "SitePlan":
        return cls(fp8=decision.fp8, reason=decision.reason.value, shape=tuple(shape),
                   dtype=str(dtype).replace("torch.", ""), provider=decision.provider, scaling=decision.scaling,
                   a_format=decision.a_format, b_format=decision.b_format, pad_k=decision.pad_k,
                   pad_n=decision.pad_n, fast_accum=decision.fast_accum, bf16_us=decision.bf16_us,
                   fp8_us=decision.fp8_us, detail=decision.detail, candidates=decision.candidates,
                   m_bucket=decision.m_bucket)

    @classmethod
    def from_json(cls, entry: dict, where: str = "site: ") -> "SitePlan":
        """A saved entry, every field checked (`_SITE_FIELDS`); otherwise ValueError naming
        `where` ("loka plan p.json is damaged: site 'forward/fc1:fwd#1': ") and the field."""
        fields = _Fields(entry, where)
        unknown = sorted(set(entry) - set(_SITE_FIELDS))
        if unknown:
            raise ValueError(f"{where}unknown field {unknown[0]!r} (a site has {', '.join(_SITE_FIELDS)})")
        values = {name: fields.get(name, *spec) for name, spec in _SITE_FIELDS.items()}
        values["shape"] = tuple(values["shape"])
        values["candidates"] = tuple(_candidate(c, f"{where}candidates[{i}].")
                                     for i, c in enumerate(values["candidates"]))
        if values["fp8"] != (values["reason"] == Reason.FP8.value):
            raise ValueError(f"{where}fp8 is {json.dumps(values['fp8'])} with reason {values['reason']!r}: "
                             f"a site runs FP8 exactly when its reason is 'fp8'")
        if values["fp8"]:
            for name in ("scaling", "a_format", "b_format"):
                if not values[name]:
                    raise ValueError(f"{where}{name} is empty on an FP8 site")
        return cls(**values)

    def decision(self, source: str) -> Decision:
        detail = "; ".join(filter(None, (self.detail, f"from plan {source}")))
        return Decision(fp8=self.fp8, reason=Reason(self.reason), provider=self.provider, scaling=self.scaling,
                        a_format=self.a_format, b_format=self.b_format, detail=detail, bf16_us=self.bf16_us,
                        fp8_us=self.fp8_us, pad_k=self.pad_k, pad_n=self.pad_n, fast_accum=self.fast_accum,
                        candidates=self.candidates, m_bucket=self.m_bucket)


@dataclasses.dataclass
class Plan:
    """Site id -> SitePlan, the Probe's verdicts by site id, and the fingerprint."""

    params: dict = dataclasses.field(default_factory=dict)    # parameter name -> (shape, dtype)
    device_type: str = ""
    recipe: str = ""
    version: int = FORMAT_VERSION
    sites: dict = dataclasses.field(default_factory=dict)     # site id -> SitePlan
    unsafe: dict = dataclasses.field(default_factory=dict)    # site id -> observed FP8 error
    # site id -> (target scaling, [[scaling, bound], ...]); older plans: (tensorwise, rowwise)
    upgraded: dict = dataclasses.field(default_factory=dict)
    # Inference sites' static activation scales (`loka_compile.calibrate`): site id ->
    # {"scale", "range", "policy", "error"}. Optional in the file: version-1 plans without it load.
    a_scales: dict = dataclasses.field(default_factory=dict)
    # Re-checks' verdict changes (`LokaConfig.recheck_every`): site id -> [{"step", "graph",
    # "from", "to", "change", "detail"}, ...], oldest first. Optional in the file.
    history: dict = dataclasses.field(default_factory=dict)
    # The graph speed check's timed verdicts (`graph_speed.GraphSpeed.stored`) by key id
    # (`graph_speed.key_id`). In the file beside the digest of the rest of the plan; loaded only
    # where that digest matches (a plan edited since decides otherwise). Optional in the file.
    graph_speed: dict = dataclasses.field(default_factory=dict)
    source: str = ""                                          # the file it was loaded from ("": made here)
    # `calibrate`'s task metric before and after backing off sites (not saved in the file)
    task_metric: dict = dataclasses.field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        return {"version": self.version, "device_type": self.device_type, "recipe": self.recipe,
                "params": {name: [list(shape), dtype] for name, (shape, dtype) in sorted(self.params.items())},
                "sites": {sid: dataclasses.asdict(entry) for sid, entry in sorted(self.sites.items())},
                "unsafe": dict(sorted(self.unsafe.items())),
                "upgraded": {sid: list(errors) for sid, errors in sorted(self.upgraded.items())},
                "a_scales": {sid: dict(entry) for sid, entry in sorted(self.a_scales.items())},
                "history": {sid: [dict(event) for event in events] for sid, events in sorted(self.history.items())},
                **({"graph_speed": {"basis": self.decisions_digest(),
                                    "verdicts": {key: dict(v) for key, v in sorted(self.graph_speed.items())}}}
                   if self.graph_speed else {})}

    def decisions_digest(self) -> str:
        """What the plan decides, all of it but the graph speed verdicts: the basis they were
        timed on."""
        data = dataclasses.replace(self, graph_speed={}).to_json()
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "Plan":
        """A plan from its JSON form, every field checked against the values loka knows
        (reasons, scalings, FP8 formats, recipes, ...): a damaged file raises ValueError
        naming the file, the site and the field ("loka plan p.json is damaged: site
        'forward/fc1:fwd#1': fp8 must be true or false, not 'no'"), rather than loading a
        plan whose graphs would fall back to high precision at compile time."""
        name = source or "(in memory)"
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"loka plan {name}: format version {found!r}, this loka reads version {FORMAT_VERSION}")
        where = f"loka plan {name} is damaged: "
        top = _Fields(data, where)
        try:
            device_type, recipe = top.get("device_type", _DEVICE_TYPE), top.get("recipe", _RECIPE)
            params = {p: _param(value, f"{where}parameter {p!r}: ") for p, value in top.get("params", _OBJECT).items()}
            sites = {sid: SitePlan.from_json(entry, f"{where}site {sid!r}: ")
                     for sid, entry in top.get("sites", _OBJECT).items()}
            unsafe = {sid: float(_Fields({"error": e}, f"{where}unsafe {sid!r}: ").get("error", _NUMBER))
                      for sid, e in top.get("unsafe", _OBJECT, {}).items()}
            plan = cls(params=params, device_type=device_type, recipe=recipe, version=data["version"], sites=sites,
                       unsafe=unsafe,
                       upgraded={sid: _upgraded(e, f"{where}upgraded {sid!r}: ")
                                 for sid, e in top.get("upgraded", _OBJECT, {}).items()},
                       a_scales={sid: _static_scale(e, f"{where}a_scales {sid!r}: ")
                                 for sid, e in top.get("a_scales", _OBJECT, {}).items()},
                       history={sid: _history(events, f"{where}history {sid!r}")
                                for sid, events in top.get("history", _OBJECT, {}).items()},
                       source=source)
            timed = _Fields(top.get("graph_speed", _OBJECT, {"basis": "", "verdicts": {}}), f"{where}graph_speed: ")
            basis = timed.get("basis", _STR)
            verdicts = {key: _graph_verdict(v, f"{where}graph_speed verdict {key!r}: ")
                        for key, v in timed.get("verdicts", _OBJECT).items()}
        except (AttributeError, KeyError, TypeError) as error:  # a shape no check above foresaw
            raise ValueError(f"loka plan {name} is damaged: {type(error).__name__}: {error}") from None
        if verdicts and basis != plan.decisions_digest():
            log.info("loka plan %s: its decisions changed since its %d graph speed verdict(s) were timed; they are "
                     "timed again", name, len(verdicts))
        elif verdicts:
            plan.graph_speed = verdicts
        return plan

    def save(self, path) -> "Plan":
        """Write this plan to `path` as JSON (atomically); returns it with `source` set."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        return dataclasses.replace(self, source=path)

    def digest(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    # -- comparing plans (`loka_compile.report` shows one: `plan_summary`, `plan_table`) -----

    def diff(self, other: "Plan") -> list:
        """What differs between this plan (A) and `other` (B), as (what, field, in A, in B)
        rows, None where one plan lacks it: the header (version, recipe, device type),
        parameters, sites only in one, and per site in both its decision (`DECISION_FIELDS`),
        its Probe verdict and its static activation scale. Timings and details are not
        compared. Empty: the plans decide the same."""
        rows = [("plan", name, getattr(self, name), getattr(other, name))
                for name in ("version", "recipe", "device_type") if getattr(self, name) != getattr(other, name)]
        for name in sorted(set(self.params) | set(other.params)):
            a, b = self.params.get(name), other.params.get(name)
            if a != b:
                rows.append((f"parameter {name}", "shape, dtype", _param_text(a), _param_text(b)))
        for sid in sorted(set(self.sites) | set(other.sites)):
            a, b = self.sites.get(sid), other.sites.get(sid)
            if a is None or b is None:
                rows.append((sid, "site", _decision_text(a), _decision_text(b)))
                continue
            rows += [(sid, name, getattr(a, name), getattr(b, name))
                     for name in DECISION_FIELDS if getattr(a, name) != getattr(b, name)]
            verdicts = _verdict_text(self, sid), _verdict_text(other, sid)
            if verdicts[0] != verdicts[1]:
                rows.append((sid, "probe verdict", *verdicts))
            scales = self.a_scales.get(sid), other.a_scales.get(sid)
            for field in ("scale", "policy"):
                a_value, b_value = (None if e is None else e[field] for e in scales)
                if a_value != b_value:
                    rows.append((sid, f"static {field}", a_value, b_value))
        return rows

    def mismatches(self, params: dict, device_type: str, recipe: str) -> list:
        """What differs between this plan and a graph it would serve (empty: none). Every
        parameter the graph reads must be in the plan with the same shape and dtype."""
        found = []
        if self.device_type != device_type:
            found.append(f"device type {self.device_type!r} in the plan, {device_type!r} here")
        if self.recipe != recipe:
            found.append(f"recipe {self.recipe!r} in the plan, {recipe!r} in the config")
        missing = sorted(name for name in params if name not in self.params)
        if missing:
            found.append(f"parameters not in the plan: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        differ = [f"{name}: {self.params[name][0]} {self.params[name][1]} in the plan, {shape} {dtype} here"
                  for name, (shape, dtype) in sorted(params.items())
                  if name in self.params and tuple(self.params[name]) != (shape, dtype)]
        if differ:
            found.append(f"parameters differ: {differ[:5]}{' ...' if len(differ) > 5 else ''}")
        return found

    def check(self, params: dict, device_type: str, recipe: str) -> None:
        found = self.mismatches(params, device_type, recipe)
        if found:
            raise ValueError(f"loka plan {self.source or '(in memory)'} was made for another model or setup: "
                             + "; ".join(found))


def id_parts(sid: str) -> tuple:
    """(kind, module, role) of a site id "<kind>/<module>:<role>[:recomputed]#<n>"; "" for
    a part an id of another form lacks."""
    kind, _, rest = sid.partition("/") if "/" in sid else ("", "", sid)
    base = rest.rsplit("#", 1)[0]
    recomputed = base.endswith(":recomputed")
    module, _, role = base.removesuffix(":recomputed").rpartition(":")
    return kind, module, role + (":recomputed" if recomputed and role else "")


def _decision_text(entry: Optional[SitePlan]) -> Optional[str]:
    if entry is None:
        return None
    if entry.fp8:
        return f"fp8 {entry.scaling} {entry.a_format} x {entry.b_format} on {entry.provider}"
    return entry.reason


def _param_text(param) -> Optional[str]:
    return None if param is None else f"{tuple(param[0])} {param[1]}"


def _verdict_text(plan: Plan, sid: str) -> Optional[str]:
    """Where the Probe's verdicts put a site: unsafe, upgraded to a scaling, or none."""
    if sid in plan.unsafe:
        return "unsafe"
    if sid in plan.upgraded:
        return f"upgraded to {upgrade_target(plan.upgraded[sid])}"
    return None


def upgrade_target(entry: tuple) -> str:
    """The scaling an upgrade verdict moves its site to (plans from before the chain: rowwise)."""
    return entry[0] if isinstance(entry[0], str) else "rowwise"


# -- what a loaded plan may hold: each field's check, and the messages naming it ------------

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class _Check:
    ok: Callable[[object], bool]
    must: str                 # "must be <must>, not <value>"


# A JSON array: a list in a file, a list or tuple in `Plan.to_json()`'s dict.
_ARRAY = (list, tuple)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """An int or float (not a bool). NaN and infinities pass: an observed error may be either."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_dtype(value) -> bool:
    return isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)


def _is_device_type(value) -> bool:
    if not isinstance(value, str) or not value:
        return False
    try:
        return torch.device(value).type == value
    except (RuntimeError, ValueError):
        return False


def _one_of(values, blank: bool = False) -> _Check:
    values = tuple(values)
    return _Check(lambda v: isinstance(v, str) and (v in values or (blank and v == "")),
                  ("'' or " if blank else "") + "one of " + ", ".join(map(repr, values)))


_BOOL = _Check(lambda v: isinstance(v, bool), "true or false")
_STR = _Check(lambda v: isinstance(v, str), "a string")
_NAME = _Check(lambda v: isinstance(v, str) and v != "", "a non-empty string")
_INT = _Check(_is_int, "an integer")
_OBJECT = _Check(lambda v: isinstance(v, dict), "an object")
_LIST = _Check(lambda v: isinstance(v, _ARRAY), "a list")
_COUNT = _Check(lambda v: _is_int(v) and v >= 0, "a non-negative integer")
_NUMBER = _Check(_is_number, "a number")
_TIME = _Check(lambda v: v is None or (_is_number(v) and v >= 0), "null or a non-negative number (microseconds)")
_DTYPE = _Check(lambda v: v == "" or _is_dtype(v), "'' or a torch dtype name such as 'bfloat16'")
_DEVICE_TYPE = _Check(_is_device_type, "a torch device type such as 'cuda' or 'cpu'")
_RECIPE = _one_of(sorted(RECIPES))
_SHAPE = _Check(lambda v: isinstance(v, _ARRAY) and len(v) in (0, 3)
                and all((_is_int(d) and d >= 0) or (isinstance(d, str) and d != "") for d in v),
                "[M, K, N], each a size or a symbol such as 's0'")
_SCALINGS = tuple(s.value for s in Scaling)
_FORMAT = _one_of((f.value for f in Fp8Format), blank=True)

# SitePlan's fields as a file holds them: name -> (check, default); no default: required.
_SITE_FIELDS = {
    "fp8": (_BOOL,),
    "reason": (_one_of(r.value for r in Reason),),
    "shape": (_SHAPE, []),
    "dtype": (_DTYPE, ""),
    "provider": (_NAME, "aten"),
    "scaling": (_one_of(_SCALINGS, blank=True), ""),
    "a_format": (_FORMAT, ""),
    "b_format": (_FORMAT, ""),
    "pad_k": (_COUNT, 0),
    "pad_n": (_COUNT, 0),
    "fast_accum": (_BOOL, False),
    "bf16_us": (_TIME, None),
    "fp8_us": (_TIME, None),
    "detail": (_STR, ""),
    "candidates": (_LIST, []),
    "m_bucket": (_Check(lambda v: v is None or (_is_int(v) and v > 0), "null or a positive integer"), None),
}
_VERDICT_FIELDS = {"fp8_ms": _NUMBER, "hp_ms": _NUMBER, "kept": _one_of(("fp8", "high precision")), "training": _BOOL,
                   "runs": _COUNT}
_CANDIDATE_FIELDS = {"provider": (_NAME,), "gemm_us": (_TIME,), "chosen": (_BOOL,), "lost": (_STR, "")}


class _Fields:
    """One JSON object of a plan file, read field by field, each checked."""

    def __init__(self, entry, where: str):
        if not isinstance(entry, dict):
            raise ValueError(f"{where}must be an object, not {_show(entry)}")
        self.entry, self.where = entry, where   # "loka plan p.json is damaged: site 'forward/fc1:fwd#1': "

    def get(self, name: str, check: _Check, default=_REQUIRED):
        if name not in self.entry:
            if default is _REQUIRED:
                raise ValueError(f"{self.where}{name} is missing")
            return default
        value = self.entry[name]
        if not check.ok(value):
            raise ValueError(f"{self.where}{name} must be {check.must}, not {_show(value)}")
        return value


def _candidate(entry, where: str) -> Candidate:
    fields = _Fields(entry, where)
    unknown = sorted(set(entry) - set(_CANDIDATE_FIELDS))
    if unknown:
        raise ValueError(f"{where}unknown field {unknown[0]!r} (a candidate has {', '.join(_CANDIDATE_FIELDS)})")
    return Candidate(**{name: fields.get(name, *spec) for name, spec in _CANDIDATE_FIELDS.items()})


def _param(value, where: str) -> tuple:
    """A parameter's fingerprint, [shape, dtype] in the file."""
    if not (isinstance(value, _ARRAY) and len(value) == 2 and isinstance(value[0], _ARRAY)
            and all(_is_int(d) and d >= 0 for d in value[0]) and _is_dtype(value[1])):
        raise ValueError(f"{where}must be [shape, dtype] such as [[64, 32], 'float32'], not {_show(value)}")
    return tuple(value[0]), value[1]


def _upgraded(entry, where: str) -> tuple:
    """An upgrade verdict: (target scaling, [[scaling, bound], ...][, why]), or
    (tensorwise bound, rowwise bound) in plans from before the chain."""
    if isinstance(entry, _ARRAY) and len(entry) == 2 and all(map(_is_number, entry)):
        return tuple(entry)
    if not (isinstance(entry, _ARRAY) and len(entry) in (2, 3) and entry[0] in _SCALINGS
            and isinstance(entry[1], _ARRAY)
            and all(isinstance(step, _ARRAY) and len(step) == 2 and isinstance(step[0], str) and _is_number(step[1])
                    for step in entry[1])
            and (len(entry) == 2 or isinstance(entry[2], str))):
        raise ValueError(f"{where}must be [target scaling, [[scaling, bound], ...]] with the target one of "
                         f"{', '.join(map(repr, _SCALINGS))}, not {_show(entry)}")
    return tuple(entry)


def _static_scale(entry, where: str) -> dict:
    """A saved static activation scale: a finite positive scale, its range, policy and error."""
    fields = _Fields(entry, where)
    scale = fields.get("scale", _NUMBER)
    if not 0 < scale < math.inf:
        raise ValueError(f"{where}scale {scale!r} is not finite and positive")
    return {"scale": float(scale), "range": float(fields.get("range", _NUMBER)),
            "policy": fields.get("policy", _NAME), "error": float(fields.get("error", _NUMBER))}


def _graph_verdict(entry, where: str) -> dict:
    """A remembered graph speed verdict: both medians (ms), the variant kept, whether the step
    trained, the timed runs."""
    fields = _Fields(entry, where)
    verdict = {name: fields.get(name, check) for name, check in _VERDICT_FIELDS.items()}
    if not (verdict["fp8_ms"] > 0 and verdict["hp_ms"] > 0 and verdict["runs"] > 0):
        raise ValueError(f"{where}times and runs must be positive, not {_show(entry)}")
    return verdict


def _history(events, where: str) -> list:
    """A site's re-check verdict changes: objects with at least step, from, to and change."""
    if not isinstance(events, _ARRAY):
        raise ValueError(f"{where}: must be a list, not {_show(events)}")
    for i, event in enumerate(events):
        fields = _Fields(event, f"{where}[{i}]: ")
        fields.get("step", _INT)
        for name in ("from", "to", "change"):
            fields.get(name, _STR)
    return [dict(event) for event in events]


def param_fingerprint(named_params) -> dict:
    """name -> (shape, dtype) of (name, tensor) pairs."""
    return {name: (tuple(int(d) for d in p.shape), str(p.dtype).replace("torch.", "")) for name, p in named_params}


def load_plan(path) -> Plan:
    """The plan saved at `path`; ValueError if it is not a readable loka plan."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"loka plan {path} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"loka plan {path} is not JSON: {error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"loka plan {path} is not JSON: not UTF-8 text") from None
    return Plan.from_json(data, source=path)
