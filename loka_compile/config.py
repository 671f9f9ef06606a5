"""LokaConfig: the frozen, validated options of one `torch.compile(..., backend="loka")`, and
the named FP8 recipes.

Gradient formats: forward operands are e4m3. Under `tensorwise`, gradient operands are
e5m2: one scale per tensor leaves the format to cover a gradient's dynamic range, and
e5m2 has 2^15 of range more than e4m3. Under rowwise scaling (`rowwise`, `default`),
each row of the gradient gets its own scale, which removes most of that need, so
gradients use e4m3 and keep its extra mantissa bit (and cuBLASLt's rowwise kernels take
e4m3 operands only).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from typing import Any, Mapping, Optional

from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.passes import mods
from loka_compile.passes.context import Role


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named FP8 recipe: one scaling, operand formats per role (A, B of `a @ b`; for
    backward roles the gradient operand takes `grad_format`), the roles kept in high
    precision, and the roles whose GEMMs accumulate in the tensor cores' fast mode.

    Fast accumulation for the forward only, as torchao's float8 recipes do: gradients, whose
    sums over the batch are longer and hold smaller values, keep precise accumulation
    (docs/guide.md, "Accumulation", has what it gains)."""

    name: str
    scaling: Scaling
    grad_format: Fp8Format
    high_precision_roles: frozenset = frozenset()
    description: str = ""
    fast_accum_roles: frozenset = frozenset({Role.FWD})

    def formats(self, a_is_grad: bool, b_is_grad: bool) -> tuple[Fp8Format, Fp8Format]:
        a = self.grad_format if a_is_grad else Fp8Format.E4M3
        b = self.grad_format if b_is_grad else Fp8Format.E4M3
        return a, b


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("tensorwise", Scaling.TENSORWISE, Fp8Format.E5M2,
               description="one scale per tensor; e4m3 forward, e5m2 gradients"),
        Recipe("rowwise", Scaling.ROWWISE, Fp8Format.E4M3,
               description="one scale per row of A and column of B; e4m3 everywhere"),
        # wgrad reduces over the batch, where gradient outliers gather; it stays in high
        # precision until the Probe shows it safe (the same trade as torchao's
        # rowwise_with_gw_hp). Two of every three GEMM FLOPs still run in FP8.
        Recipe("default", Scaling.ROWWISE, Fp8Format.E4M3, frozenset({Role.WGRAD}),
               description="rowwise e4m3 for fwd and dgrad; wgrad in high precision"),
    )
}


# Probe metrics (`probe_metric`) and the bound each takes when max_probe_error is not given.
PROBE_METRICS = {"row_rel_error": 0.1, "mere": 0.2}

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Which graphs the graph speed check times whole (`LokaConfig.graph_speed_check`)
GRAPH_SPEED_CHECKS = ("thin", "always", "off")


# `max_output_error`'s default: a budget of noise_floor_multiple times the graph's noise floor.
RELATIVE_BUDGET = "relative"


@dataclasses.dataclass(frozen=True)
class LokaConfig:
    """Options of the loka backend. Pass as `torch.compile(m, backend="loka",
    options={...})` (keys as below) or build one and pass `options=config`.

    recipe: a name in RECIPES.
    emulate: where no FP8 hardware is present (CPU, pre-sm89 GPUs), run FP8 sites with
        the emulated provider (same quantization, fp32 matmul). Off: such sites stay in
        high precision with reason `no_fp8_hardware`.
    min_gemm_dim: a site with M, K or N below this stays in high precision (`too_small`).
    providers: restrict Dispatch to these provider names (empty: all registered).
    exclude_modules: module-path prefixes whose GEMMs stay in high precision.
    probe_steps: calls of each compiled graph that run in high precision with Probe
        observers before FP8 starts. Default 2: the fewest observations that give the
        Probe's bound a sample standard deviation, so a confidence bound
        (`probe.upper_bound`; from one observation the bound is that observation); more
        tighten it (mean + 4.46 s at 2, + 1.69 s at 3, s their standard deviation).
        Cost: the window's calls run the probe variant uncompiled (`compile_probe`) with
        observers (on CPU one observation costs about 10x its GEMM), its close the output
        budget's sensitivity runs, and the FP8 variant compiles then, at call
        probe_steps + 1, the first that runs FP8: one Inductor compile per graph, as
        without loka, later. 0: no probe window (FP8
        from the first call, no per-site error measured, the output budget off): how to
        opt out. A graph compiled with a `plan` has no window.
    compile_probe: compile the probe variant with Inductor too (each graph then compiles
        twice: the probe variant at its first call, the FP8 variant when the window closes).
        Off (default): the probe variant is the graph after Inductor's post-grad passes and
        loka's, run as it is (each ATen op a kernel call): its sites are the ones an
        Inductor compile would lower, and only the FP8 variant pays Inductor's code
        generation. Its calls (the window's, and re-checks') run at about eager speed and
        memory; one that fails at its first run is compiled with Inductor then.
    max_probe_error: a site whose FP8 error bound (in `probe_metric`) exceeds this after
        the probe window goes to a finer scaling whose bound is within it, else stays in
        high precision (`probe_unsafe`). None: the metric's default (PROBE_METRICS).
    speed_check: on FP8 hardware, time each site's high-precision GEMM and loka's FP8 GEMM
        (casts included) at the site's shape and layouts when the graph compiles, and keep
        the site in high precision where FP8 is not faster (`slower_than_bf16`). Sites
        with a symbolic dimension are not timed.
    graph_speed_check: whether the FP8 variant of a graph is timed whole against a
        high-precision compile of the same graph (same Mods, no FP8 site), before its first
        run, and the faster kept (`graph_speed.py`; high precision's sites are amended by
        `graph_speed`, the report shows both times). The site timings do not see how
        Inductor fuses the casts into the graph, which can cost a graph whose gain is thin
        all of it. "thin" (default): graphs whose FP8 sites the site timings predict less
        than `graph_speed.THIN_GAIN_MARGIN` faster, on FP8 hardware (emulated FP8 is not
        timed: a CPU timing says nothing of a GPU), with `speed_check` on. "always": every graph with an FP8
        site, on any device. "off". Costs a timed graph one more Inductor compile (two in
        a CUDA-graph mode, three where high precision wins there) and a few steps of each
        variant on clones of its inputs.
    min_fp8_speedup: the speed FP8 must gain over the high-precision GEMM to be chosen,
        as a ratio of times (1.05: at least 5% faster; FP8 costs accuracy, so a gain
        within timing noise does not buy it).
    fallback: if loka fails on a graph, warn once and run it through Inductor in high
        precision instead of raising.
    mode: Inductor's mode (`reduce-overhead` = CUDA graphs). `torch.compile` refuses
        `mode=` together with `options=`, so it can be given here too.
    disabled_mods: names of default Mods switched off (ablations; `loka_compile.passes.mods.MODS`).
    enabled_mods: names of opt-in Mods that keep the model's math, switched on
        (`loka_compile.passes.mods.OPT_IN_MODS`: `layernorm_backward`, `linear_batchnorm`, off until measured
        faster).
    arch_mods: names of opt-in architecture Mods (`loka_compile.passes.mods.ARCH_MODS`) applied to the Dynamo
        graph (they change the model): `blocknorm` (LayerNorm -> BlockNorm), `no_bias`
        (linears lose their bias, except the heads), `hardswish` (SiLU -> hard-swish).
    plan: path (str or os.PathLike) of a plan written by `loka_compile.save_plan`: its
        sites take the plan's decisions (re-checked where they must still hold) and no
        probe window runs; a plan for other parameters, device type or recipe is refused.
    probe_metric: what the Probe's per-site bound measures: "row_rel_error" (mean over
        sampled output rows of each row's relative error; default bound 0.1) or "mere"
        (LoKA's mean element-wise relative error; LoKA's bound 0.2).
    recheck_every: after the probe window, every this many calls of a compiled graph one
        call runs the probe variant again (observers, high-precision GEMMs), and the next
        call judges each site afresh from that call's observations: a site whose bound
        drifted over max_probe_error is demoted along the upgrade chain (to a finer
        scaling, else high precision), one whose bound recovered is promoted back, and the
        FP8 variant is rebuilt when a verdict changes. 0: off (the window decides once).
        Needs probe_steps > 0. A rebuild compiles from the graph's first call, so with
        re-checks on each compiled graph keeps that call's inputs (off: they are dropped
        after the FP8 variant's first run).
    max_output_error: the output budget, a bound on the graph's output discrepancy D, the
        relative error ||y_fp8 - y|| / ||y|| over its floating outputs between the FP8
        variant and the high-precision one, applied when a probe window closes (with
        probe_steps=0 or a `plan` there is no window and it does nothing). At the window's
        close each forward GEMM's sensitivity s (relative output change per unit of
        relative noise injected at its output) is measured, D is predicted as
        sqrt(sum (s * e)^2) over the forward sites going FP8 (e: the site's measured row
        relative error in the scaling it will run), and while D exceeds the budget the
        site with the largest s * e stays in high precision (`probe_unsafe`, the budget
        named in its detail). "relative" (default): the budget is `noise_floor_multiple`
        times the graph's noise floor F, the discrepancy its own bf16 arithmetic has
        (`output_budget.py`). A number: that absolute budget (0.003 was the default
        before the relative one); below F it is reported as such. None or 0: off
        (per-site bounds only). Costs one extra forward per forward site at the window's
        close (two where a binary head's loss is among the outputs).
    noise_floor_multiple: k of the relative budget: FP8 may add at most k F in quadrature
        (the FP8 model's total sqrt(1 + k^2) F). Provisional (docs/guide.md says why and
        what measurement will set it).
    max_ne_increase: the budget of the graph's binary heads (sigmoid outputs, a
        binary cross-entropy loss among the outputs, `binary_outputs`), as a
        relative increase of their normalized entropy predicted from the FP8 logit noise
        (no labels needed). Other outputs keep the discrepancy budget. Provisional, as
        noise_floor_multiple. None or 0: binary heads are judged by the discrepancy
        budget like other outputs.
    binary_outputs: module-path prefixes of heads whose outputs are logits of binary
        events (CTR, CVR), judged by max_ne_increase besides the heads found in the graph.
    refit_output_budget: when the FP8 variant's measured D exceeds 1.5x max_output_error,
        weigh the sites left in FP8 again with every s * e scaled by measured / predicted D,
        make those that no longer fit safe with a finer scaling where the Probe measured one
        (as at the window's close), keep the rest in high precision, and compile the FP8
        variant once more. Off by default: measured serving graphs exceed their prediction
        (docs/benchmarks.md, "Output budget"), so on, most would give up FP8 sites at a speed
        cost not yet measured; off, the miss is logged as a warning.
    amax_guard: after the probe window, each tensorwise site checks at every call the amax
        its casts compute: one over `scaled_gemm.amax_jump` (2^14.8 for e4m3) times the
        largest the window saw, or an inf or NaN in a cached e4m3 weight (e4m3 has no inf),
        sends the site rowwise (high precision where the window measured no finer scaling
        within max_probe_error) from the next call, logged at WARNING and kept in the
        plan's history (`loka_compile/amax_guard.py`). Costs per graph and call one
        `loka::amax_guards` op (a running max on the device, which CUDA graphs capture)
        and a device-to-host copy read without a sync (on CUDA a trip shows at the first
        call after the copy landed; its measured cost is in docs/guide.md). And, as
        re-checks do, the graph's first inputs are kept for a rebuild. Needs a probe
        window; graphs with a loaded plan have none. Off: the window decides once.

    Every bad value raises ValueError naming the valid ones, here at construction. Given
    as a dict to `torch.compile`, options are parsed at the first call, inside Dynamo,
    which wraps the ValueError in `torch._dynamo.exc.BackendCompilerFailed`.
    """

    recipe: str = "default"
    emulate: bool = True
    min_gemm_dim: int = 16
    providers: tuple = ()
    exclude_modules: tuple = ()
    probe_steps: int = 2  # 0: no probe window
    max_probe_error: Optional[float] = None  # None: PROBE_METRICS[probe_metric]
    speed_check: bool = True
    graph_speed_check: str = "thin"
    min_fp8_speedup: float = 1.05
    fallback: bool = True
    mode: str = "default"
    disabled_mods: tuple = ()
    enabled_mods: tuple = ()
    arch_mods: tuple = ()
    plan: Optional[str] = None
    probe_metric: str = "row_rel_error"
    recheck_every: int = 0
    max_output_error: "Optional[float] | str" = RELATIVE_BUDGET  # a number: absolute; None or 0: off
    noise_floor_multiple: float = 16.0
    max_ne_increase: Optional[float] = 0.001  # None or 0: binary heads take the discrepancy budget
    binary_outputs: tuple = ()
    refit_output_budget: bool = False
    amax_guard: bool = True
    compile_probe: bool = False

    def __post_init__(self):
        from loka_compile.kernels import providers as provider_registry

        check_choice("recipe", self.recipe, sorted(RECIPES))
        check_choice("mode", self.mode, list(MODES))
        check_choice("probe_metric", self.probe_metric, list(PROBE_METRICS))
        check_choice("graph_speed_check", self.graph_speed_check, list(GRAPH_SPEED_CHECKS))
        if self.max_probe_error is None:
            self._set("max_probe_error", PROBE_METRICS[self.probe_metric])
        for name in ("emulate", "fallback", "speed_check", "refit_output_budget", "amax_guard", "compile_probe"):
            check_bool(name, getattr(self, name))
        for name in ("min_gemm_dim", "probe_steps", "recheck_every"):
            self._set(name, check_non_negative_int(name, getattr(self, name)))
        if self.recheck_every and not self.probe_steps:
            raise ValueError(f"recheck_every={self.recheck_every} needs probe_steps > 0: a re-check runs the "
                             "probe variant the window compiled")
        for name in ("max_probe_error", "min_fp8_speedup"):
            self._set(name, check_positive_number(name, getattr(self, name)))
        if self.max_output_error != RELATIVE_BUDGET:
            self._set("max_output_error", _check_off_or_positive("max_output_error", self.max_output_error,
                                                                       f", {RELATIVE_BUDGET!r}"))
        self._set("noise_floor_multiple", check_positive_number("noise_floor_multiple", self.noise_floor_multiple))
        self._set("max_ne_increase", _check_off_or_positive("max_ne_increase", self.max_ne_increase))
        self._set("binary_outputs", _check_names("binary_outputs", self.binary_outputs))
        self._set("providers", _check_names("providers", self.providers, provider_registry.names()))
        self._set("exclude_modules", _check_names("exclude_modules", self.exclude_modules))
        self._set("disabled_mods", _check_names("disabled_mods", self.disabled_mods, mods.MODS))
        self._set("enabled_mods", _check_names("enabled_mods", self.enabled_mods, mods.OPT_IN_MODS))
        self._set("arch_mods", _check_names("arch_mods", self.arch_mods, mods.ARCH_MODS))
        self._set("plan", _check_plan_path(self.plan))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    @property
    def output_budget_on(self) -> bool:
        return bool(self.max_output_error)

    @property
    def relative_budget(self) -> bool:
        return self.max_output_error == RELATIVE_BUDGET

    @property
    def recipe_spec(self) -> Recipe:
        return RECIPES[self.recipe]

    @property
    def inactive_mods(self) -> frozenset:
        """The Mods that do not run in this compile: `disabled_mods`, the opt-in ones not in
        `enabled_mods`, and outside CUDA-graph modes the ones that run only under CUDA graphs
        (`Mod.cuda_graphs_only`)."""
        graph_only = frozenset() if uses_cuda_graphs(self.mode) else mods.CUDA_GRAPH_ONLY_MODS
        not_enabled = frozenset(mods.OPT_IN_MODS) - frozenset(self.enabled_mods)
        return frozenset(self.disabled_mods) | not_enabled | graph_only

    @classmethod
    def from_options(cls, options: "LokaConfig | Mapping[str, Any] | None") -> "LokaConfig":
        if options is None:
            return cls()
        if isinstance(options, LokaConfig):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"loka options must be a dict or a LokaConfig, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in options if key not in valid]
        if unknown:
            raise ValueError(f"unknown loka options {unknown}; valid options: {valid}")
        return cls(**options)


def uses_cuda_graphs(mode: str) -> bool:
    """Whether Inductor's `mode` replays compiled graphs as CUDA graphs."""
    from torch._inductor import list_mode_options

    return bool(list_mode_options(mode).get("triton.cudagraphs", False))


def _checked_init(init):
    """The dataclass __init__, with unknown or surplus arguments a ValueError naming the
    valid options (the generated one raises TypeError)."""
    valid = [f.name for f in dataclasses.fields(LokaConfig)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [key for key in kwargs if key not in valid]
        if unknown:
            raise ValueError(f"unknown loka options {unknown}; valid options: {valid}")
        if len(args) > len(valid):
            raise ValueError(f"LokaConfig takes at most {len(valid)} options {valid}, got {len(args)} positional")
        given_twice = [key for key in valid[:len(args)] if key in kwargs]
        if given_twice:
            raise ValueError(f"loka options {given_twice} given both by position and by name")
        init(self, *args, **kwargs)

    return __init__


LokaConfig.__init__ = _checked_init(LokaConfig.__init__)


# Validators: each raises ValueError naming the option and its valid values, and returns
# the value normalized (plain int/float, tuple of names) so the config's repr is stable.

def check_choice(name: str, value, valid: list) -> None:
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"{name} must be one of the valid {name}s {valid}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")


def check_non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def check_positive_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _check_off_or_positive(name: str, value, also: str = "") -> Optional[float]:
    """None or 0 (off, normalized to None), else a positive finite number (`also`: other
    valid values, named in the error)."""
    if value is None or (not isinstance(value, bool) and isinstance(value, numbers.Real) and value == 0):
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a positive finite number{also}, or None or 0 for off, got {value!r}")
    return float(value)


def _check_names(name: str, value, valid=None) -> tuple:
    """A list or tuple of strings, each in `valid` when given."""
    what = f"names from {list(valid)}" if valid is not None else "strings"
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list or tuple of {what}, got {value!r}")
    unknown = [v for v in value if valid is not None and v not in valid]
    if unknown:
        raise ValueError(f"unknown {name} {unknown}; valid {name}: {list(valid)}")
    return tuple(value)


def _check_plan_path(value) -> Optional[str]:
    """None, or the path (str or os.PathLike) of an existing plan file, as a str."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"plan must be None or a path (str or os.PathLike) of a file written by "
                         f"loka_compile.save_plan, got {value!r}")
    if not os.path.isfile(path):
        raise ValueError(f"plan must be a path of a file written by loka_compile.save_plan; no such file: {path!r}")
    return path
