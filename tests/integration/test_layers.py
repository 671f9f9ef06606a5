"""The import contract (pyproject.toml, [tool.importlinter]): kernels <- passes <- decisions <-
runtime <- backend <- public API, and no cycle between sibling modules, lazy imports included.

grimp, import-linter's graph builder, finds a package's modules under its own folder, and in
this checkout passes/ and kernels/ sit beside loka_compile/. So each check lints a copy of the
tree laid out as a wheel installs it, in a fresh interpreter that imports that copy.
"""

import pathlib
import shutil
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/integration/ -> the checkout
# Where each installed package's files come from (pyproject.toml's package-dir).
LAYOUT = {"loka_compile": "loka_compile", "loka_compile/passes": "passes", "loka_compile/kernels": "kernels"}
LINT = ("import sys\n"
        "from importlinter import configuration\n"
        "from importlinter.application.use_cases import lint_imports\n"
        "configuration.configure()\n"
        "sys.exit(0 if lint_imports(config_filename='pyproject.toml', cache_dir=None, no_logo=True) else 1)\n")


def installed_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    for target, source in LAYOUT.items():
        shutil.copytree(ROOT / source, tmp_path / target, ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)})


def test_the_import_contract_holds(tmp_path):
    result = lint(installed_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout
    # The copy, not the checkout, was linted: every module of the three packages was seen.
    modules = sum(1 for folder in LAYOUT.values() for _ in (ROOT / folder).rglob("*.py"))
    seen = int(result.stdout.split("Analyzed ")[1].split(" files")[0])
    assert seen == modules, result.stdout


def test_an_upward_or_circular_import_breaks_it(tmp_path):
    """A kernel that imports a pass inside a function, and a pass helper that imports `lower`
    (which imports it), each break the contract by name."""
    tree = installed_copy(tmp_path)
    metrics = tree / "loka_compile/kernels/metrics.py"
    metrics.write_text(metrics.read_text() + "\n\ndef _upward():\n    from loka_compile.passes import lower\n"
                       "    return lower\n")
    rewrite = tree / "loka_compile/passes/rewrite.py"
    rewrite.write_text(rewrite.read_text() + "\n\ndef _circular():\n    from . import lower\n    return lower\n")
    result = lint(tree)
    assert result.returncode == 1
    assert "loka_compile.kernels is not allowed to import loka_compile.passes" in result.stdout, result.stdout
    assert "loka_compile.kernels.metrics -> loka_compile.passes" in result.stdout
    assert "No cycles are allowed in loka_compile.passes" in result.stdout, result.stdout
    assert "0 kept, 2 broken" in result.stdout
