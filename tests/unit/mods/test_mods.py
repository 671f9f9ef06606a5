"""The Mod registry (`loka_compile.passes.mods`): one file per Mod, one ordered list per stage,
and the config, the backend and the report reading it rather than Mod names."""

import pathlib
import re

import pytest
import torch

import loka_compile
from loka_compile.passes import mods
from loka_compile.passes.mods.mod import Evidence, Mod, Stage

ROOT = pathlib.Path(__file__).resolve().parents[3]  # tests/unit/mods/ -> the checkout
MOD_FILES = sorted(p.stem for p in (ROOT / "passes" / "mods").glob("*.py") if p.stem not in ("__init__", "mod"))


def test_each_mod_file_declares_one_mod_listed_under_its_own_stage():
    listed = {mod.name: stage for stage, stage_mods in mods.STAGES.items() for mod in stage_mods}
    assert sorted(listed) == MOD_FILES == sorted(mods.BY_NAME)
    for name in MOD_FILES:
        module = __import__(f"loka_compile.passes.mods.{name}", fromlist=["MOD"])
        assert module.MOD is mods.BY_NAME[name] and module.MOD.stage is listed[name]
        assert module.MOD.summary and "\n" not in module.MOD.summary
    assert mods.ALL == tuple(m for stage in Stage for m in mods.STAGES[stage])
    assert set(mods.MODS) | set(mods.ARCH_MODS) | set(mods.OPT_IN_MODS) == set(MOD_FILES)
    assert len(mods.MODS) + len(mods.ARCH_MODS) + len(mods.OPT_IN_MODS) == len(MOD_FILES)


def test_each_mod_has_a_docs_page_listed_in_the_mods_readme():
    readme = (ROOT / "docs" / "mods" / "README.md").read_text()
    for mod in mods.ALL:
        assert (ROOT / "docs" / "mods" / f"{mod.name}.md").is_file(), mod.name
        assert f"[`{mod.name}`]({mod.name}.md)" in readme, mod.name


def test_config_names_come_from_the_registry():
    assert set(loka_compile.LokaConfig(disabled_mods=mods.MODS).disabled_mods) == set(mods.MODS)
    assert loka_compile.LokaConfig(arch_mods=mods.ARCH_MODS).arch_mods == mods.ARCH_MODS
    with pytest.raises(ValueError, match="valid disabled_mods"):
        loka_compile.LokaConfig(disabled_mods=[mods.ARCH_MODS[0]])  # an opt-in Mod is not switched off
    with pytest.raises(ValueError, match="valid arch_mods"):
        loka_compile.LokaConfig(arch_mods=[mods.MODS[0]])
    graph_only = {m.name for m in mods.ALL if m.cuda_graphs_only}
    assert graph_only and loka_compile.LokaConfig().inactive_mods == graph_only | set(mods.OPT_IN_MODS)
    assert loka_compile.LokaConfig(mode="reduce-overhead").inactive_mods == set(mods.OPT_IN_MODS)
    assert loka_compile.LokaConfig(mode="reduce-overhead", enabled_mods=mods.OPT_IN_MODS).inactive_mods == frozenset()
    with pytest.raises(ValueError, match="valid enabled_mods"):
        loka_compile.LokaConfig(enabled_mods=[mods.MODS[0]])


def test_a_mod_may_count_only_the_counters_it_declares():
    evidence = Evidence(sites=(), results={"m": (2, 3)})
    counted = Mod("m", Stage.DYNAMO_GRAPH, True, "a test Mod", counters=("a", "b"),
                  count=lambda e: {"b": sum(e.results["m"]), "a": 1})
    assert list(counted.counts(evidence).items()) == [("a", 1), ("b", 5)]  # in declared order
    rogue = Mod("m", Stage.DYNAMO_GRAPH, True, "a test Mod", counters=("a",), count=lambda e: {"b": 1})
    with pytest.raises(ValueError, match="does not declare"):
        rogue.counts(evidence)
    assert Mod("quiet", Stage.POST_GRAD, True, "counts nothing").counts(evidence) == {}


# `"<mod>" in ...` / `"<mod>" not in ...`: a Mod switched on or off by its name.
NAME_CHECK = re.compile(r"""["'](%s)["']\s+(not\s+)?in\b""" % "|".join(m.name for m in mods.ALL))


def test_no_library_code_checks_a_mod_by_name():
    """Switches read the Mod objects (`MOD.on(inactive_mods)`), never a name string."""
    found = []
    for folder in ("loka_compile", "passes", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if NAME_CHECK.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    assert NAME_CHECK.search('if "pad" in config.inactive_mods:')  # the check would see one


def test_report_mods_are_the_registry_counters(one_thread, fresh_compile_state):
    """A compiled model reports exactly the declared counters of the default Mods (and the
    recipe's fast_accum), each counted by its Mod."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0, "recipe": "rowwise"})
    with torch.no_grad():
        compiled(torch.randn(128, 64))
    report = loka_compile.report(compiled)
    counts = report.mods
    assert set(counts) == {c for m in mods.ALL if not m.arch for c in m.counters} | {"fast_accum"}
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    # the LayerNorm's output is the second linear's A: its cast fuses; the input's cannot
    assert counts["fused_casts"] == 1 and counts["standalone_casts"] >= 1, report.table()
    assert counts["cached_weights"] == 2  # an inference graph reads both weights' FP8 copies


def test_no_mod_imports_another_modules_private_names():
    """What Mods share lives under a public name (`passes/dynamo_graph.py`, `passes/shapes.py`,
    another Mod's public API), never a `_helper` reached into."""
    import ast

    found = []
    for path in sorted((ROOT / "passes" / "mods").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] != "__future__":
                found += [f"{path.name}: from {'.' * node.level}{node.module} import {alias.name}"
                          for alias in node.names if alias.name.startswith("_")]
    assert not found, found
    leak = ast.parse("from .horizontal import _arg")
    assert any(a.name.startswith("_") for n in ast.walk(leak) if isinstance(n, ast.ImportFrom) for a in n.names)
