"""Content fingerprints of tensors: a 64-bit hash of every byte, for many tensors at once.

The cached-weights Mod keeps FP8 copies of weights across calls and must know, before each
call, whether any weight's values changed. Version counters miss writes made through
`.data`, fused optimizers and other out-of-autograd paths; the bytes do not.

The hash: each 16-bit word w_i of a tensor's bytes (i its position) is mixed into two
32-bit lanes with independent constants, lane(w_i, i) = mix32(w_i * K_WORD + (i + 1) * K_POS),
and each lane of the fingerprint is the sum of its values modulo 2^32; the fingerprint is
the two lanes side by side, 64 bits. A change of the bytes moves each lane by a difference
of mixed values, so a changed tensor keeps its fingerprint with probability about 2^-64.
32-bit arithmetic, since GPUs emulate 64-bit integer multiplies with several instructions.
A sum is order-free, so blocks of words are hashed in parallel and added atomically, and
the result is the same however the work is split.

- `fingerprints(tensors)`: one fingerprint per tensor, as Python ints. On CUDA one Triton
  launch covers every tensor (a table of their addresses, kept while they stay put);
  elsewhere the NumPy reference runs, in bounded chunks.
- `lane_sums(tensors)`: the same as an int32 tensor of lanes [2 * len(tensors)] on the
  tensors' device, without waiting for the device: what a check that must not stall the
  host compares on the device.
- `kernel_fingerprints(tensors)`: the kernel alone (on CPU under TRITON_INTERPRET=1).
- `reference_fingerprint(tensor)`: the NumPy reference the kernel is tested against.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import triton
import triton.language as tl

# (word, position, mix) multipliers of each lane: odd 32-bit constants from the fractional
# parts of the golden ratio and of sqrt(2), sqrt(3), sqrt(5), sqrt(7).
LANES = ((0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D), (0x6A09E667, 0xBB67AE85, 0x3C6EF373))
# Compiled Triton reads module globals only as constexprs (the interpreter reads any).
_A_WORD, _A_POS, _A_MIX = (tl.constexpr(k) for k in LANES[0])
_B_WORD, _B_POS, _B_MIX = (tl.constexpr(k) for k in LANES[1])
WORDS_PER_PROGRAM = 4096
# The reference hashes this many words at a time, bounding its temporaries (a few MiB).
REFERENCE_CHUNK_WORDS = 1 << 20
_MASK32 = 0xFFFFFFFF

log = logging.getLogger("loka")
_kernel_failed: list = []  # the kernel's error, once it failed in this process


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 16-bit words (a one-byte dtype of odd size gets a zero byte)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.element_size() == 1:
        raw = flat.view(torch.uint8)
        if raw.numel() % 2:
            raw = torch.cat([raw, raw.new_zeros(1)])
        return raw.view(torch.int16)
    return flat.view(torch.int16)


def _reference_lane(words: np.ndarray, position: np.ndarray, word_k: int, pos_k: int, mix_k: int) -> int:
    h = words * np.uint32(word_k) + position * np.uint32(pos_k)
    h ^= h >> np.uint32(15)
    h *= np.uint32(mix_k)
    h ^= h >> np.uint32(13)
    return int(h.sum(dtype=np.uint64)) & _MASK32


def reference_fingerprint(tensor: torch.Tensor) -> int:
    """The fingerprint computed with NumPy's wrapping uint32 arithmetic."""
    words = _words(tensor)
    # A copy: NumPy viewing the tensor's own memory would mark its storage non-resizable
    # for good, and FSDP2 frees an all-gathered parameter by resizing its storage to 0.
    words = (words.clone() if words.device.type == "cpu" else words.cpu()).numpy().view(np.uint16)
    lanes = [0, 0]
    with np.errstate(over="ignore"):
        for start in range(0, words.size, REFERENCE_CHUNK_WORDS):
            w = words[start:start + REFERENCE_CHUNK_WORDS].astype(np.uint32)
            position = np.arange(start + 1, start + 1 + w.size, dtype=np.uint64).astype(np.uint32)
            for i, constants in enumerate(LANES):
                lanes[i] = (lanes[i] + _reference_lane(w, position, *constants)) & _MASK32
    return lanes[1] << 32 | lanes[0]


@triton.jit
def _mix32(w, position, WORD: tl.constexpr, POS: tl.constexpr, MIX: tl.constexpr):
    h = w * WORD + position * POS
    h = h ^ (h >> 15)
    h = h * MIX
    return h ^ (h >> 13)


@triton.jit
def _fingerprint_kernel(addresses_ptr, words_ptr, chunk_tensor_ptr, chunk_start_ptr, out_ptr,
                        BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    # one program: BLOCK words of one tensor from chunk_start; its two lane sums are added
    # to out[2 * tensor] and out[2 * tensor + 1] (int32 atomics wrap like uint32 sums)
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    n = tl.load(words_ptr + t)
    base = tl.load(addresses_ptr + t).to(tl.pointer_type(tl.uint16))
    if ALIGNED:  # a pointer read from memory has no known alignment: without it, loads are 2 bytes wide
        base = tl.multiple_of(base, 16)
    position = start + tl.arange(0, BLOCK).to(tl.int64)
    in_bounds = position < n
    w = tl.load(base + position, mask=in_bounds, other=0).to(tl.uint32)
    p = (position + 1).to(tl.uint32)
    a = tl.where(in_bounds, _mix32(w, p, _A_WORD, _A_POS, _A_MIX), 0)
    b = tl.where(in_bounds, _mix32(w, p, _B_WORD, _B_POS, _B_MIX), 0)
    tl.atomic_add(out_ptr + 2 * t, tl.sum(a, axis=0).to(tl.int32, bitcast=True), sem="relaxed")
    tl.atomic_add(out_ptr + 2 * t + 1, tl.sum(b, axis=0).to(tl.int32, bitcast=True), sem="relaxed")


@functools.lru_cache(maxsize=64)
def _tables(addresses: tuple, word_counts: tuple, device: torch.device) -> tuple:
    """(addresses, word counts, each program's tensor index and first word) on the device,
    kept while the tensors stay at these addresses: a host-to-device copy each call would
    wait for the stream to drain."""
    tensor_index, start = [], []
    for t, n in enumerate(word_counts):
        for first in range(0, n, WORDS_PER_PROGRAM):
            tensor_index.append(t)
            start.append(first)
    return tuple(torch.tensor(values, dtype=dtype, device=device) for values, dtype in
                 ((addresses, torch.int64), (word_counts, torch.int64), (tensor_index, torch.int32),
                  (start, torch.int64)))


def _on_one_cuda_device(tensors: list) -> bool:
    return bool(tensors) and all(t.is_cuda and t.device == tensors[0].device for t in tensors)


def _kernel_usable(tensors: list) -> bool:
    return _on_one_cuda_device(tensors) and not _kernel_failed


def _kernel_failure(error: Exception) -> None:
    _kernel_failed.append(error)
    log.warning("loka: the fingerprint kernel failed (%s: %s); weights are fingerprinted on the host, "
                "which copies them there at every call", type(error).__name__, error)


def _as_int(lanes: list) -> list:
    lanes = [v & _MASK32 for v in lanes]
    return [lanes[2 * i + 1] << 32 | lanes[2 * i] for i in range(len(lanes) // 2)]


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def _reference_lanes(tensors: list, device: torch.device) -> torch.Tensor:
    values = []
    for t in tensors:
        value = reference_fingerprint(t)
        values += [_signed32(value & _MASK32), _signed32(value >> 32)]
    return torch.tensor(values, dtype=torch.int32, device=device)


def fingerprints(tensors: list) -> list:
    """One fingerprint per tensor, as Python ints: on CUDA one launch for all and one sync,
    elsewhere the reference."""
    if _kernel_usable(tensors):
        try:
            return kernel_fingerprints(tensors)
        except Exception as error:  # noqa: BLE001 - a broken Triton must cost speed, not the model
            _kernel_failure(error)
    return [reference_fingerprint(t) for t in tensors]


def lane_sums(tensors: list) -> torch.Tensor:
    """Each tensor's two 32-bit lanes as int32 [2 * len(tensors)] on the tensors' device.
    On CUDA the kernel is only enqueued: nothing waits for the device."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if _kernel_usable(tensors):
        try:
            return kernel_lane_sums(tensors)
        except Exception as error:  # noqa: BLE001 - a broken Triton must cost speed, not the model
            _kernel_failure(error)
    return _reference_lanes(tensors, device)


def kernel_lane_sums(tensors: list) -> torch.Tensor:
    """The Triton kernel over all of `tensors` (one device; CPU under TRITON_INTERPRET=1),
    as int32 lanes on that device."""
    device = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(2 * len(tensors), dtype=torch.int32, device=device)
    words = [_words(t) for t in tensors]  # views, unless a tensor is not contiguous
    counts = tuple(w.numel() for w in words)
    if not sum(counts):
        return out
    pointers = tuple(w.data_ptr() for w in words)
    addresses, word_counts, chunk_tensor, chunk_start = _tables(pointers, counts, device)
    _fingerprint_kernel[(chunk_tensor.numel(),)](addresses, word_counts, chunk_tensor, chunk_start, out,
                                                 BLOCK=WORDS_PER_PROGRAM,
                                                 ALIGNED=all(ptr % 16 == 0 for ptr in pointers))
    return out


def kernel_fingerprints(tensors: list) -> list:
    """`kernel_lane_sums` as Python ints (waits for the device)."""
    return _as_int(kernel_lane_sums(tensors).tolist()) if tensors else []
