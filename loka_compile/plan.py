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
import json
import os
from typing import Optional

import torch

from loka_compile.passes import Decision, Reason
from loka_compile.passes.context import Candidate

FORMAT_VERSION = 1

# Reasons that come from a measurement (Probe, speed check, a provider at the site's
# shape): a loaded plan's entry with one of these replaces the measurement. Other reasons
# follow from the model and the config and are decided again.
MEASURED_REASONS = frozenset({Reason.FP8, Reason.PROBE_UNSAFE, Reason.SLOWER_THAN_BF16, Reason.PROVIDER_FAILED})


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
    def from_json(cls, entry: dict) -> "SitePlan":
        return cls(**{**entry, "shape": tuple(entry.get("shape", ())),
                      "candidates": tuple(Candidate(**c) for c in entry.get("candidates", ()))})

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
    source: str = ""                                          # the file it was loaded from ("": made here)

    def to_json(self) -> dict:
        return {"version": self.version, "device_type": self.device_type, "recipe": self.recipe,
                "params": {name: [list(shape), dtype] for name, (shape, dtype) in sorted(self.params.items())},
                "sites": {sid: dataclasses.asdict(entry) for sid, entry in sorted(self.sites.items())},
                "unsafe": dict(sorted(self.unsafe.items())),
                "upgraded": {sid: list(errors) for sid, errors in sorted(self.upgraded.items())},
                "a_scales": {sid: dict(entry) for sid, entry in sorted(self.a_scales.items())},
                "history": {sid: [dict(event) for event in events] for sid, events in sorted(self.history.items())}}

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "Plan":
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"loka plan {source}: format version {found!r}, this loka reads version {FORMAT_VERSION}")
        try:
            sites = {sid: SitePlan.from_json(entry) for sid, entry in data["sites"].items()}
            return cls(params={name: (tuple(shape), dtype) for name, (shape, dtype) in data["params"].items()},
                       device_type=data["device_type"], recipe=data["recipe"], version=data["version"], sites=sites,
                       unsafe={sid: float(e) for sid, e in data.get("unsafe", {}).items()},
                       upgraded={sid: tuple(e) for sid, e in data.get("upgraded", {}).items()},
                       a_scales={sid: _static_scale(e) for sid, e in data.get("a_scales", {}).items()},
                       history={sid: [dict(e) for e in events] for sid, events in data.get("history", {}).items()},
                       source=source)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"loka plan {source} is damaged: {type(error).__name__}: {error}") from None

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


def _static_scale(entry: dict) -> dict:
    """A saved static activation scale, checked: a finite positive scale, its policy."""
    scale = float(entry["scale"])
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"static scale {scale!r} is not finite and positive")
    return {"scale": scale, "range": float(entry["range"]), "policy": str(entry["policy"]),
            "error": float(entry["error"])}


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
    return Plan.from_json(data, source=path)


def plan_of(compiled) -> Plan:
    """The plan of a compiled model (or function): every graph `loka_compile.report`
    finds for it, each site's decision in its active phase under the site's id. Raises
    ValueError while a graph is still in its probe window, or when it has none."""
    from loka_compile.report import records_for

    records = records_for(compiled)
    if not records:
        raise ValueError("loka has compiled no graph for this model: run it once before saving its plan")
    probing = [r.name for r in records if r.phase == "probe"]
    if probing:
        raise ValueError(f"graphs {probing} are still in their probe window: save the plan after it closes")
    plan = Plan(device_type=records[0].plan.device_type, recipe=records[0].config.recipe)
    module = getattr(compiled, "_orig_mod", compiled)
    if isinstance(module, torch.nn.Module):
        plan.params = param_fingerprint(module.named_parameters())
    # A recompile (another batch size) has the sites of the graph it recompiles, under the
    # same ids: the later graph, the more general one, wins. Graphs with other site sets
    # (graph breaks) that share an id but not its decision leave it to be decided at load.
    owner, conflicts = {}, set()
    for record in records:
        if not isinstance(module, torch.nn.Module):
            plan.params.update(record.plan.params)
        plan.unsafe.update(record.plan.unsafe)
        plan.upgraded.update(record.plan.upgraded)
        plan.a_scales.update(record.plan.a_scales)
        for sid, events in record.plan.history.items():
            plan.history.setdefault(sid, []).extend(events)
        ids = frozenset(s.id for (phase, _), ctx in record.contexts.items() if phase == record.phase
                        for s in ctx.sites)
        for (phase, kind), ctx in record.contexts.items():
            if phase != record.phase or record.fallback or record.fallen_back.get(kind):
                continue
            for site in ctx.sites:
                decision = ctx.decisions.get(site.key)
                if decision is None or decision.reason in (Reason.GRAPH_FALLBACK, Reason.PROBING):
                    continue
                entry = SitePlan.from_decision(decision, site.shape, site.dtype)
                if site.id in plan.sites and owner[site.id] != ids and plan.sites[site.id] != entry:
                    conflicts.add(site.id)
                plan.sites[site.id], owner[site.id] = entry, ids
    for sid in conflicts:
        plan.sites.pop(sid)
    return plan


def save_plan(compiled, path) -> Plan:
    """Write the plan of `compiled` (see `plan_of`) to `path` as JSON; returns it. Load it
    with `torch.compile(model, backend="loka", options={"plan": path})`."""
    return plan_of(compiled).save(path)
