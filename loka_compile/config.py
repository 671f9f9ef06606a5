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
from typing import Any, Mapping

from loka_compile.kernels.quantize import Fp8Format, Scaling
from loka_compile.passes.context import Role


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named FP8 recipe: one scaling, operand formats per role (A, B of `a @ b`; for
    backward roles the gradient operand takes `grad_format`), and the roles kept in high
    precision."""

    name: str
    scaling: Scaling
    grad_format: Fp8Format
    high_precision_roles: frozenset = frozenset()
    description: str = ""

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


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


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
        observers before FP8 starts (0: no probe window).
    max_probe_error: a site whose observed FP8 relative error exceeds this after the
        probe window stays in high precision (`probe_unsafe`).
    speed_check: on FP8 hardware, time each site's high-precision GEMM and loka's FP8 GEMM
        (casts included) at the site's shape and layouts when the graph compiles, and keep
        the site in high precision where FP8 is not faster (`slower_than_bf16`). Sites
        with a symbolic dimension are not timed.
    min_fp8_speedup: the speed FP8 must gain over the high-precision GEMM to be chosen,
        as a ratio of times (1.05: at least 5% faster; FP8 costs accuracy, so a gain
        within timing noise does not buy it).
    fallback: if loka fails on a graph, warn once and run it through Inductor in high
        precision instead of raising.
    mode: Inductor's mode (`reduce-overhead` = CUDA graphs). `torch.compile` refuses
        `mode=` together with `options=`, so it can be given here too.
    """

    recipe: str = "default"
    emulate: bool = True
    min_gemm_dim: int = 16
    providers: tuple = ()
    exclude_modules: tuple = ()
    probe_steps: int = 0
    max_probe_error: float = 0.1
    speed_check: bool = True
    min_fp8_speedup: float = 1.05
    fallback: bool = True
    mode: str = "default"

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; valid recipes: {sorted(RECIPES)}")
        for name in ("emulate", "fallback", "speed_check"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("min_gemm_dim", "probe_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if isinstance(self.max_probe_error, bool) or not isinstance(self.max_probe_error, (int, float)) \
                or not 0 < self.max_probe_error:
            raise ValueError(f"max_probe_error must be a positive number, got {self.max_probe_error!r}")
        if isinstance(self.min_fp8_speedup, bool) or not isinstance(self.min_fp8_speedup, (int, float)) \
                or not self.min_fp8_speedup > 0:
            raise ValueError(f"min_fp8_speedup must be a positive number, got {self.min_fp8_speedup!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid modes: {list(MODES)}")
        for name in ("providers", "exclude_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        from loka_compile.kernels import providers as provider_registry

        unknown = [p for p in self.providers if p not in provider_registry.names()]
        if unknown:
            raise ValueError(f"unknown providers {unknown}; registered: {provider_registry.names()}")

    @property
    def recipe_spec(self) -> Recipe:
        return RECIPES[self.recipe]

    @classmethod
    def from_options(cls, options: "LokaConfig | Mapping[str, Any] | None") -> "LokaConfig":
        if options is None:
            return cls()
        if isinstance(options, LokaConfig):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(f"loka options must be a dict or a LokaConfig, got {type(options).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown loka options {unknown}; valid options: {valid}")
        return cls(**options)
