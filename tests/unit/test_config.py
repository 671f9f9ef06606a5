import dataclasses
import importlib.metadata

import pytest
import torch

import loka_compile
from loka_compile import LokaConfig, RECIPES, Role
from loka_compile.passes.mods import OPT_IN_MODS


def test_backend_registered_through_entry_point():
    names = [ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")]
    assert "loka" in names
    assert "loka" in torch._dynamo.list_backends()


def test_named_recipes():
    assert {"tensorwise", "rowwise", "default"} <= set(RECIPES)
    assert LokaConfig().recipe == "default"
    assert Role.WGRAD in RECIPES["default"].high_precision_roles
    assert RECIPES["tensorwise"].grad_format.value == "e5m2"
    assert RECIPES["rowwise"].grad_format.value == "e4m3"


def test_probing_is_on_by_default():
    """A probe window of 2 calls (the fewest that bound a site's error with a standard
    deviation) and with it the output budget; probe_steps=0 opts out of both."""
    config = LokaConfig()
    assert config.probe_steps == 2 and config.max_output_error == "relative" and config.recheck_every == 0
    assert config.noise_floor_multiple == 16 and config.max_ne_increase == 0.001 and config.output_budget_on
    assert LokaConfig(recheck_every=100).recheck_every == 100  # the default window allows re-checks
    assert LokaConfig(probe_steps=0).probe_steps == 0


FIELDS = [f.name for f in dataclasses.fields(LokaConfig)]

# One or more bad values for every option; each error names the option or its valid values.
BAD_OPTIONS = [
    ({"recipie": "rowwise"}, "valid options"),
    ({1: "rowwise"}, "valid options"),
    ({"recipe": "blocky"}, r"valid recipes \['default', 'rowwise', 'tensorwise'\]"),
    ({"recipe": ["rowwise"]}, "valid recipes"),
    ({"recipe": None}, "valid recipes"),
    ({"emulate": "yes"}, r"emulate must be a bool \(True or False\)"),
    ({"emulate": 1}, "emulate must be a bool"),
    ({"min_gemm_dim": -1}, "min_gemm_dim must be a non-negative int"),
    ({"min_gemm_dim": True}, "min_gemm_dim must be a non-negative int"),
    ({"min_gemm_dim": "16"}, "min_gemm_dim must be a non-negative int"),
    ({"providers": ["no_such_kernel"]}, r"unknown providers \['no_such_kernel'\]; valid providers: \[.*'emulated'"),
    ({"providers": None}, r"providers must be a list or tuple of names from \[.*'emulated'"),
    ({"providers": "emulated"}, "providers must be a list or tuple"),
    ({"providers": [["emulated"]]}, "providers must be a list or tuple"),
    ({"exclude_modules": "fc1"}, "exclude_modules must be a list or tuple of strings"),
    ({"exclude_modules": None}, "exclude_modules must be a list or tuple of strings"),
    ({"exclude_modules": [1]}, "exclude_modules must be a list or tuple of strings"),
    ({"probe_steps": 1.5}, "probe_steps must be a non-negative int"),
    ({"probe_steps": None}, "probe_steps must be a non-negative int"),
    ({"max_probe_error": 0}, "max_probe_error must be a positive finite number"),
    ({"max_probe_error": float("nan")}, "max_probe_error must be a positive finite number"),
    ({"max_probe_error": "0.1"}, "max_probe_error must be a positive finite number"),
    ({"speed_check": None}, "speed_check must be a bool"),
    ({"refit_output_budget": 1}, "refit_output_budget must be a bool"),
    ({"amax_guard": "yes"}, "amax_guard must be a bool"),
    ({"compile_probe": None}, "compile_probe must be a bool"),
    ({"min_fp8_speedup": float("inf")}, "min_fp8_speedup must be a positive finite number"),
    ({"min_fp8_speedup": True}, "min_fp8_speedup must be a positive finite number"),
    ({"fallback": "no"}, "fallback must be a bool"),
    ({"mode": "turbo"}, "valid modes"),
    ({"mode": None}, "valid modes"),
    ({"disabled_mods": ["fusion"]}, r"valid disabled_mods: \['fused_casts', 'pad', 'cat_casts', 'aligned_gemms', 'cached_weights', 'gemm_epilogue', 'gemm_norm', 'weight_both_layouts', 'saved_fp8', 'horizontal', 'conv1x1', 'batched_matvec', 'transposed_linear', 'cat_flatten', 'benchmarked_reductions'\]"),
    ({"disabled_mods": "pad"}, r"disabled_mods must be a list or tuple of names from \['fused_casts'"),
    ({"disabled_mods": None}, "disabled_mods must be a list or tuple"),
    ({"enabled_mods": ["pad"]}, r"valid enabled_mods: \['pair_products', 'linear_batchnorm', 'layernorm_backward'\]"),
    ({"enabled_mods": "layernorm_backward"}, "enabled_mods must be a list or tuple"),
    ({"enabled_mods": ["layernorm_backward"], "disabled_mods": ["layernorm_backward"]},
     r"valid disabled_mods"),  # an opt-in Mod is switched off by leaving it out of enabled_mods
    ({"arch_mods": ["layernorm"]}, r"valid arch_mods: \['blocknorm', 'no_bias', 'hardswish'\]"),
    ({"arch_mods": "blocknorm"}, r"arch_mods must be a list or tuple of names from \['blocknorm'"),
    ({"arch_mods": {"blocknorm"}}, "arch_mods must be a list or tuple"),
    ({"plan": 3}, r"plan must be None or a path \(str or os.PathLike\) of a file written by loka_compile.save_plan"),
    ({"plan": ""}, "plan must be None or a path"),
    ({"plan": "/no/such/plan.json"}, "plan must be a path of a file written by loka_compile.save_plan; no such file"),
    ({"probe_metric": "sqnr"}, r"valid probe_metrics \['row_rel_error', 'mere'\]"),
    ({"probe_metric": None}, "valid probe_metrics"),
    ({"graph_speed_check": "sometimes"}, r"valid graph_speed_checks \['thin', 'always', 'off'\]"),
    ({"graph_speed_check": True}, "valid graph_speed_checks"),
    ({"recheck_every": -1, "probe_steps": 1}, "recheck_every must be a non-negative int"),
    ({"recheck_every": 100, "probe_steps": 0}, "recheck_every=100 needs probe_steps > 0"),
    ({"max_output_error": -0.1}, r"max_output_error must be a positive finite number, 'relative', or None or 0 for off"),
    ({"noise_floor_multiple": 0}, "noise_floor_multiple must be a positive finite number"),
    ({"max_ne_increase": -1e-3}, "max_ne_increase must be a positive finite number, or None or 0 for off"),
    ({"binary_outputs": "head"}, "binary_outputs must be a list or tuple of strings"),
    ({"max_output_error": "0.003"}, "max_output_error must be a positive finite number"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_options_raise_naming_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        LokaConfig.from_options(options)
    if all(isinstance(key, str) and key in FIELDS for key in options):
        with pytest.raises(ValueError, match=message):
            LokaConfig(**options)


def test_every_option_has_a_bad_value_case():
    assert set(FIELDS) <= {key for options, _ in BAD_OPTIONS for key in options}


def test_good_values_are_normalized():
    config = LokaConfig(providers=["emulated"], exclude_modules=["head"], disabled_mods=["pad"],
                        arch_mods=["blocknorm", "hardswish"], max_probe_error=1, min_fp8_speedup=2)
    assert config.providers == ("emulated",) and config.exclude_modules == ("head",)
    assert config.disabled_mods == ("pad",) and config.arch_mods == ("blocknorm", "hardswish")
    assert config.max_probe_error == 1.0 and isinstance(config.max_probe_error, float)
    assert LokaConfig().disabled_mods == () and LokaConfig().arch_mods == ()
    assert set(LokaConfig(disabled_mods=loka_compile.passes.MODS).disabled_mods) == \
        {"fused_casts", "pad", "cached_weights", "horizontal", "benchmarked_reductions", "cat_casts",
         "conv1x1", "batched_matvec", "transposed_linear", "aligned_gemms", "saved_fp8", "gemm_epilogue", "gemm_norm",
         "weight_both_layouts", "cat_flatten"}


@pytest.mark.usefixtures("fresh_compile_state")
def test_bad_options_through_torch_compile_raise_at_first_call():
    """A dict reaches the backend only at the first call, inside Dynamo, which wraps the
    ValueError (torch 2.13: raised `from None`, the ValueError kept as inner_exception)."""
    compiled = torch.compile(torch.nn.Linear(16, 16), backend="loka", options={"recipe": "nope"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as caught:
        compiled(torch.randn(16, 16))
    inner = caught.value.inner_exception
    assert isinstance(inner, ValueError) and "valid recipes" in str(inner)
    assert f"ValueError: {inner}" in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__context__ is inner


def test_config_is_frozen_and_accepts_itself():
    config = LokaConfig(recipe="rowwise", exclude_modules=["head"])
    assert config.exclude_modules == ("head",)
    with pytest.raises(Exception):
        config.recipe = "tensorwise"
    assert LokaConfig.from_options(config) is config
    with pytest.raises(ValueError, match="dict or a LokaConfig"):
        LokaConfig.from_options(["rowwise"])


def test_public_names():
    for name in ("report", "LokaConfig", "reset", "Reason", "BlockNorm", "apply_arch_mods"):
        assert hasattr(loka_compile, name)


def test_benchmarked_reductions_mod_sets_inductor_multi_kernel_for_loka_cuda_graph_graphs_only():
    from loka_compile.inductor_passes import inductor_patches

    marker = object()  # stands for loka's custom pass
    graphed = LokaConfig(mode="reduce-overhead")
    patches = inductor_patches(graphed, marker)
    # with CUDA graphs, unpartitioned: multi-kernel in a partition raised TypeError on the H100
    assert patches["triton.multi_kernel"] == 1 and patches["graph_partition"] is False
    assert "benchmarked_reductions" not in graphed.inactive_mods
    off = LokaConfig(mode="reduce-overhead", disabled_mods=["benchmarked_reductions"])
    assert not {"triton.multi_kernel", "graph_partition"} & set(inductor_patches(off, marker))
    assert "triton.multi_kernel" not in inductor_patches(graphed, None)  # a fallback compile is Inductor's own
    # without CUDA graphs its per-call kernel choice is host work in every step: not run
    for mode in ("default", "max-autotune-no-cudagraphs"):
        config = LokaConfig(mode=mode)
        assert "triton.multi_kernel" not in inductor_patches(config, marker)
        assert config.inactive_mods == {"benchmarked_reductions", *OPT_IN_MODS} and config.disabled_mods == ()


def test_aligned_gemms_mod_leaves_inductor_shape_padding_to_its_benchmark():
    """The Mod pads high-precision sites itself, one by one (tests/unit/mods/test_aligned_gemms.py):
    Inductor's force_shape_pad, which pads mat-vec products too, is never patched in."""
    from loka_compile.inductor_passes import inductor_patches

    marker = object()  # stands for loka's custom pass
    for mode in ("default", "reduce-overhead"):
        for config in (LokaConfig(mode=mode), LokaConfig(mode=mode, disabled_mods=["aligned_gemms"])):
            assert "force_shape_pad" not in inductor_patches(config, marker)
        assert "force_shape_pad" not in inductor_patches(LokaConfig(mode=mode), None)  # a fallback is Inductor's own
