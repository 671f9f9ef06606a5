import importlib.metadata

import pytest
import torch

import loka_compile
from loka_compile import LokaConfig, RECIPES, Role


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


@pytest.mark.parametrize("options, message", [
    ({"recipie": "rowwise"}, "valid options"),
    ({"recipe": "blocky"}, "valid recipes"),
    ({"min_gemm_dim": -1}, "non-negative int"),
    ({"probe_steps": 1.5}, "non-negative int"),
    ({"emulate": "yes"}, "bool"),
    ({"providers": ["no_such_kernel"]}, "registered"),
    ({"exclude_modules": "fc1"}, "sequence of strings"),
    ({"max_probe_error": 0}, "positive"),
    ({"mode": "turbo"}, "valid modes"),
])
def test_bad_options_raise_naming_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        LokaConfig.from_options(options)


def test_bad_options_raise_through_torch_compile():
    compiled = torch.compile(torch.nn.Linear(16, 16), backend="loka", options={"recipe": "nope"})
    with pytest.raises(Exception, match="valid recipes"):
        compiled(torch.randn(16, 16))


def test_config_is_frozen_and_accepts_itself():
    config = LokaConfig(recipe="rowwise", exclude_modules=["head"])
    assert config.exclude_modules == ("head",)
    with pytest.raises(Exception):
        config.recipe = "tensorwise"
    assert LokaConfig.from_options(config) is config
    with pytest.raises(ValueError, match="dict or a LokaConfig"):
        LokaConfig.from_options(["rowwise"])


def test_public_names():
    for name in ("report", "LokaConfig", "reset", "Reason"):
        assert hasattr(loka_compile, name)
