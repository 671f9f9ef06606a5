"""The Mod registry: every Mod loka knows, one file each in this folder, in one ordered list per
stage (the order they run in where the stage runs them one after another, the Dynamo and joint
graphs; elsewhere the pass named below drives them). `LokaConfig.disabled_mods` names default
Mods, `enabled_mods` opt-in ones that keep the model's math, `arch_mods` opt-in architecture
changes; `report.mods` shows each Mod's counters, stage by stage.

Where each stage runs:
    DYNAMO_GRAPH  `loka_backend`, on the graph Dynamo hands it, before AOTAutograd: the opt-in
                  architecture Mods named in `arch_mods`, then the others that are on, in this order
    JOINT_GRAPH   `LokaJointPass` (Inductor's joint_custom_post_pass), training graphs past
                  their probe window, before the partitioner
    POST_GRAD     Dispatch and `lower`, on every forward, backward and inference ATen graph;
                  `aligned_gemms` as its own pass after `lower`
    INFERENCE     `lower`, on inference ATen graphs
    INDUCTOR      Inductor settings a loka compile patches in
"""

from __future__ import annotations

import torch

from . import (aligned_gemms, batched_matvec, benchmarked_reductions, blocknorm, cached_weights, cat_casts, cat_flatten,
               conv1x1, fused_casts, gemm_epilogue, gemm_norm, hardswish, horizontal, layernorm_backward,
               linear_batchnorm, no_bias, pad, pair_products, saved_fp8, transposed_linear, weight_both_layouts)
from .mod import Evidence, Mod, Stage

STAGES: dict = {
    Stage.POST_GRAD: (fused_casts.MOD, pad.MOD, cat_casts.MOD, aligned_gemms.MOD),
    Stage.INFERENCE: (cached_weights.MOD, gemm_epilogue.MOD, gemm_norm.MOD),
    Stage.JOINT_GRAPH: (pair_products.MOD, weight_both_layouts.MOD, saved_fp8.MOD),
    Stage.DYNAMO_GRAPH: (blocknorm.MOD, no_bias.MOD, hardswish.MOD, linear_batchnorm.MOD, horizontal.MOD, conv1x1.MOD,
                         batched_matvec.MOD, transposed_linear.MOD, cat_flatten.MOD, layernorm_backward.MOD),
    Stage.INDUCTOR: (benchmarked_reductions.MOD,),
}

ALL = tuple(mod for stage in Stage for mod in STAGES[stage])
BY_NAME = {mod.name: mod for mod in ALL}
MODS = tuple(mod.name for mod in ALL if mod.default)                           # valid `disabled_mods`
ARCH_MODS = tuple(mod.name for mod in ALL if not mod.default and mod.arch)      # valid `arch_mods`
OPT_IN_MODS = tuple(mod.name for mod in ALL if not mod.default and not mod.arch)  # valid `enabled_mods`
CUDA_GRAPH_ONLY_MODS = frozenset(mod.name for mod in ALL if mod.cuda_graphs_only)


def _check_registry() -> None:
    """Names are unique and every Mod file's MOD is in exactly one stage list, its own."""
    if len(BY_NAME) != len(ALL):
        raise RuntimeError(f"two Mods share a name in {[m.name for m in ALL]}")
    for stage, mods in STAGES.items():
        wrong = [m.name for m in mods if m.stage is not stage]
        if wrong:
            raise RuntimeError(f"Mods {wrong} are listed under stage {stage.value} but declare another")


_check_registry()


def dynamo_graph_mods() -> tuple:
    """The Mods that rewrite the Dynamo graph after the architecture Mods (the default ones and
    those opt-in by `enabled_mods`), in their order."""
    return tuple(mod for mod in STAGES[Stage.DYNAMO_GRAPH] if not mod.arch)


def inductor_settings(inactive_mods, has_setting) -> dict:
    """The Inductor config patches of the active Inductor-settings Mods; a Mod whose settings
    this Inductor lacks (`has_setting(name)` false for one) patches nothing."""
    patches = {}
    for mod in STAGES[Stage.INDUCTOR]:
        if mod.on(inactive_mods) and all(has_setting(name) for name in mod.inductor_settings):
            patches.update(mod.inductor_settings)
    return patches


def apply_arch_mods(gm: torch.fx.GraphModule, mods) -> dict[str, int]:
    """Rewrite `gm` in place with each opt-in Mod named in `mods` (names in ARCH_MODS), in the
    order named; return the number of rewrites per named Mod. `mods=()` leaves `gm` untouched
    and returns {}."""
    unknown = [m for m in mods if m not in ARCH_MODS]
    if unknown:
        raise ValueError(f"unknown arch_mods {unknown}; valid arch_mods: {list(ARCH_MODS)}")
    if not mods:
        return {}
    counts = {name: BY_NAME[name].run(gm) for name in dict.fromkeys(mods)}
    gm.graph.lint()
    gm.recompile()
    return counts


def counts(evidence: Evidence) -> dict:
    """Every Mod's counters, stage by stage (`report.mods`)."""
    found = {}
    for mod in ALL:
        found.update(mod.counts(evidence))
    return found


__all__ = ["ALL", "ARCH_MODS", "BY_NAME", "CUDA_GRAPH_ONLY_MODS", "MODS", "OPT_IN_MODS", "STAGES", "Evidence", "Mod",
           "Stage", "apply_arch_mods", "counts", "dynamo_graph_mods", "inductor_settings"]
