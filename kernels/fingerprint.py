"""Content fingerprints of tensors: a 64-bit hash of every byte, for many tensors at once.

The cached-weights Mod keeps FP8 copies of weights across calls and must know, before each
call, whether any weight's values changed. Version counters miss writes made through
`.data`, fused optimizers and other out-of-autograd paths; the bytes do not.

The hash: each 16-bit word w_i of a tensor's bytes (i its position) is mixed into a 64-bit
value, h_i = mix(w_i * K_WORD + (i + 1) * K_POS), and the fingerprint is the sum of the h_i
modulo 2^64. Any change of the bytes moves the sum by a difference of well-mixed 64-bit
values, so a changed tensor keeps its fingerprint with probability about 2^-64. A sum is
order-free, so blocks of words are hashed in parallel and added atomically, and the result
is the same however the work is split.

- `fingerprints(tensors)`: one fingerprint per tensor, as Python ints. On CUDA one Triton
  launch covers every tensor (a table of their addresses); elsewhere the NumPy reference
  runs, in bounded chunks.
- `kernel_fingerprints(tensors)`: the kernel alone (on CPU under TRITON_INTERPRET=1).
- `reference_fingerprint(tensor)`: the NumPy reference the kernel is tested against.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

K_WORD = 0x9E3779B97F4A7C15
K_POS = 0xC2B2AE3D27D4EB4F
K_MIX = 0xBF58476D1CE4E5B9
# Compiled Triton reads module globals only as constexprs (the interpreter reads any).
_K_WORD, _K_POS, _K_MIX = tl.constexpr(K_WORD), tl.constexpr(K_POS), tl.constexpr(K_MIX)
WORDS_PER_PROGRAM = 4096
# The reference hashes this many words at a time, bounding its uint64 temporaries (8 MiB).
REFERENCE_CHUNK_WORDS = 1 << 20


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 16-bit words (a one-byte dtype of odd size gets a zero byte)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.element_size() == 1:
        raw = flat.view(torch.uint8)
        if raw.numel() % 2:
            raw = torch.cat([raw, raw.new_zeros(1)])
        return raw.view(torch.int16)
    return flat.view(torch.int16)


def reference_fingerprint(tensor: torch.Tensor) -> int:
    """The fingerprint computed with NumPy's wrapping uint64 arithmetic."""
    words = _words(tensor).cpu().numpy().view(np.uint16)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, REFERENCE_CHUNK_WORDS):
            w = words[start:start + REFERENCE_CHUNK_WORDS].astype(np.uint64)
            position = np.arange(start + 1, start + 1 + w.size, dtype=np.uint64)
            h = w * np.uint64(K_WORD) + position * np.uint64(K_POS)
            h ^= h >> np.uint64(31)
            h *= np.uint64(K_MIX)
            h ^= h >> np.uint64(29)
            total += h.sum(dtype=np.uint64)
    return int(total)


@triton.jit
def _fingerprint_kernel(addresses_ptr, words_ptr, chunk_tensor_ptr, chunk_start_ptr, out_ptr,
                        BLOCK: tl.constexpr):
    # one program: BLOCK words of one tensor, from chunk_start; its partial sum is added to out[tensor]
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    n = tl.load(words_ptr + t)
    base = tl.load(addresses_ptr + t).to(tl.pointer_type(tl.uint16))
    position = start + tl.arange(0, BLOCK).to(tl.int64)
    in_bounds = position < n
    w = tl.load(base + position, mask=in_bounds, other=0).to(tl.uint64)
    h = w * _K_WORD + (position + 1).to(tl.uint64) * _K_POS
    h = h ^ (h >> 31)
    h = h * _K_MIX
    h = h ^ (h >> 29)
    h = tl.where(in_bounds, h, 0)
    tl.atomic_add(out_ptr + t, tl.sum(h, axis=0).to(tl.int64, bitcast=True), sem="relaxed")


@functools.lru_cache(maxsize=64)
def _chunk_table(word_counts: tuple, device: torch.device) -> tuple:
    """(chunk's tensor index, chunk's first word) for every program, on the device."""
    tensor_index, start = [], []
    for t, n in enumerate(word_counts):
        for first in range(0, n, WORDS_PER_PROGRAM):
            tensor_index.append(t)
            start.append(first)
    return (torch.tensor(tensor_index, dtype=torch.int32, device=device),
            torch.tensor(start, dtype=torch.int64, device=device))


def fingerprints(tensors: list) -> list:
    """One fingerprint per tensor, as Python ints: on CUDA one launch for all and one sync,
    elsewhere the reference."""
    if tensors and all(t.is_cuda and t.device == tensors[0].device for t in tensors):
        return kernel_fingerprints(tensors)
    return [reference_fingerprint(t) for t in tensors]


def kernel_fingerprints(tensors: list) -> list:
    """The Triton kernel over all of `tensors` (one device; CPU under TRITON_INTERPRET=1)."""
    if not tensors:
        return []
    device = tensors[0].device
    words = [_words(t) for t in tensors]  # views, unless a tensor is not contiguous
    counts = tuple(w.numel() for w in words)
    if not sum(counts):
        return [0] * len(tensors)
    chunk_tensor, chunk_start = _chunk_table(counts, device)
    addresses = torch.tensor([w.data_ptr() for w in words], dtype=torch.int64).to(device)
    word_counts = torch.tensor(counts, dtype=torch.int64).to(device)
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    _fingerprint_kernel[(chunk_tensor.numel(),)](addresses, word_counts, chunk_tensor, chunk_start, out,
                                                 BLOCK=WORDS_PER_PROGRAM)
    return [v & (2**64 - 1) for v in out.tolist()]
