"""Where the kernel tests run. On a GPU with FP8 tensor cores loka's Triton kernels compile;
elsewhere tests/conftest.py sets TRITON_INTERPRET=1 before any kernel is defined, and they run
under the Triton interpreter at small shapes. Tests marked `interpreter` check CPU-sized shapes
under the interpreter and run only there."""

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def kernels_interpreted() -> bool:
    """Whether loka's Triton kernels were defined under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from loka_compile.kernels import triton_quant
    return isinstance(triton_quant._quantize_rows_kernel, InterpretedFunction)


def _skip_reason(has_fp8_gpu: bool) -> "tuple[str, bool] | None":
    """(reason, every test or only `interpreter` ones) to skip for, or None."""
    try:
        interpreted = kernels_interpreted()
    except ImportError as e:
        return f"triton is not importable: {e}", True
    if interpreted:
        return None
    if has_fp8_gpu:
        return "runs under the Triton interpreter only (CPU, TRITON_INTERPRET=1)", False
    return ("loka's Triton kernels were defined before TRITON_INTERPRET=1 was set; "
            "run with TRITON_INTERPRET=1 in the environment"), True


def pytest_collection_modifyitems(config, items):
    from loka_compile.kernels.providers import has_fp8_hardware

    mine = [item for item in items if _HERE in Path(str(item.path)).parents and "cuda" not in item.keywords]
    found = _skip_reason(has_fp8_hardware("cuda")) if mine else None
    if found is None:
        return
    reason, every = found
    for item in mine:
        if every or "interpreter" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
