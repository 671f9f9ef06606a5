"""Shared GEMM shape lists (M, K, N) for kernel and provider tests.

Small shapes run on CPU (emulation, Triton interpreter); misaligned ones check masking
and the fallbacks. Real shapes come from ANCHORS.md and run only under `-m cuda`.
"""

SMALL_SHAPES = [
    (16, 32, 16),
    (13, 96, 48),     # M not a multiple of 16
    (67, 272, 144),   # M odd, K and N multiples of 16 but not of 64/128
    (128, 128, 128),
    (33, 256, 80),
]

MISALIGNED_KN = [
    (32, 24, 16),     # K not a multiple of 16
    (32, 32, 40),     # N not a multiple of 16
]

CUDA_SHAPES = [
    (2048, 256, 256),
    (2048, 1024, 1024),
    (8192, 512, 512),
    (8192, 1024, 4096),
    (8192, 4096, 1024),
    (32768, 2048, 2048),
]
