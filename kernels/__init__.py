"""loka's kernels and the providers that wrap every GEMM loka can call. Knows nothing of FX."""

from . import providers, quantize  # noqa: F401  (registers the built-in providers)
from . import ops  # noqa: F401  (registers torch.ops.loka.*)

try:  # loka's Triton GEMM as the `triton` provider; a model must not fail on a broken Triton
    from . import triton_gemm  # noqa: F401
    from . import triton_gemm_norm  # noqa: F401  (the gemm_norm Mod's kernel)
except Exception as _e:  # noqa: BLE001
    import logging as _logging
    _logging.getLogger("loka").warning("loka: Triton GEMM provider unavailable (%s: %s)", type(_e).__name__, _e)
