"""loka's kernels and the providers that wrap every GEMM loka can call. Knows nothing of FX."""

from . import providers, quantize  # noqa: F401  (registers the built-in providers)
from . import ops  # noqa: F401  (registers torch.ops.loka.*)
