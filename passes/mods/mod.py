"""What a Mod declares: its name, the stage it runs at, whether it is on by default, a one-line
summary, and the counters the report shows for it. Each Mod's file holds its `MOD`; the
registry (`passes/mods/__init__.py`) orders them per stage."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Mapping, Optional


class Stage(str, enum.Enum):
    """Where in a compile a Mod acts, in the order the report lists them."""

    POST_GRAD = "post-grad"          # each ATen graph, as `lower` casts and lowers its FP8 sites
    INFERENCE = "inference"          # inference ATen graphs only, in `lower`
    JOINT_GRAPH = "joint graph"      # training: the forward+backward graph, before the partitioner
    DYNAMO_GRAPH = "dynamo graph"    # the torch-level graph Dynamo hands the backend, before AOTAutograd
    INDUCTOR = "inductor settings"   # Inductor's config for the whole compile


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the report hands each Mod's `count`: every site's report row, and per Mod name the
    results its runs returned (one per Dynamo graph it ran on)."""

    sites: tuple
    results: Mapping[str, tuple]

    @property
    def fp8_casts(self) -> list:
        """How each operand of each FP8 site is cast (`site.casts`' descriptions)."""
        return [c for s in self.sites if s.fp8 for c in s.casts.values()]

    def results_of(self, mod: "Mod") -> tuple:
        return tuple(self.results.get(mod.name, ()))


@dataclasses.dataclass(frozen=True)
class Mod:
    """One graph rewrite, as the config, the backend and the report know it.

    run: a Dynamo-graph Mod's rewrite, `(gm, example_inputs, config) -> result` (the result
        goes to `count` through `Evidence.results`); other stages are driven by the pass or
        backend code their docstring names.
    if_failed: a Dynamo-graph Mod: what stays as written when its rewrite fails (the log line).
    inductor_settings: an Inductor-settings Mod's config patches.
    cuda_graphs_only: the Mod runs only in modes that replay CUDA graphs.
    arch: an opt-in Mod that changes the model's architecture (named in `arch_mods`, run first);
        an opt-in Mod that keeps the model's math is named in `enabled_mods` instead.
    """

    name: str
    stage: Stage
    default: bool                    # on unless `disabled_mods` names it; False: opt-in
    summary: str
    counters: tuple = ()
    count: Optional[Callable[[Evidence], dict]] = dataclasses.field(default=None, compare=False, repr=False)
    run: Optional[Callable] = dataclasses.field(default=None, compare=False, repr=False)
    if_failed: str = ""
    inductor_settings: Mapping = dataclasses.field(default_factory=dict, compare=False)
    cuda_graphs_only: bool = False
    arch: bool = False               # an opt-in change of the model (`arch_mods`); else opt-in by `enabled_mods`

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def on(self, inactive_mods) -> bool:
        """Whether the Mod runs, given the names a config switched off (`LokaConfig.inactive_mods`)."""
        return self.name not in inactive_mods

    def counts(self, evidence: Evidence) -> dict:
        """counter -> value, in `counters`' order; a Mod that counts nothing gives {}."""
        found = self.count(evidence) if self.count is not None else {}
        unknown = set(found) - set(self.counters)
        if unknown:
            raise ValueError(f"Mod {self.name} counted {sorted(unknown)}, which it does not declare in {self.counters}")
        return {name: found[name] for name in self.counters if name in found}


def total(results, field: str) -> int:
    """The sum of one field over a Mod's results (one per graph it ran on)."""
    return sum(getattr(r, field) for r in results)


def count_rewritten(mod_name: str) -> Callable[[Evidence], dict]:
    """The `count` of a Dynamo-graph Mod whose one counter, named after it, sums its rewrites."""
    return lambda evidence: {mod_name: total(evidence.results.get(mod_name, ()), "rewritten")}


def total_of_counts(counter: str, mod_name: str) -> Callable[[Evidence], dict]:
    """A `count` for a Mod whose run returns how many rewrites it made: their sum, present only
    where it ran (the opt-in Mods)."""
    def count(evidence: Evidence) -> dict:
        runs = evidence.results.get(mod_name, ())
        return {counter: sum(runs)} if runs else {}
    return count
