"""FP8 gradient communication, decided by measurement (opt-in): `fp8_gradient_comm(model)`.

The exchange. A DDP gradient bucket (flat, n elements) is padded to W chunks of whole blocks
(W ranks, `block` elements a block) and cast to e4m3 with one fp32 scale per block (the
rowwise cast of `kernels/triton_quant.py` on the bucket viewed as [blocks, block]: the Triton
kernel on an FP8 GPU, its reference elsewhere). The FP8 bytes and the scales, packed as one
uint8 tensor per chunk (collectives take no FP8 dtype), go through one all-to-all: rank r
receives chunk r of every rank, dequantizes and sums them in fp32 (a reduce-scatter whose
sum is never rounded to FP8). Each rank's reduced chunk is cast again (`gather="e4m3"`) or
to bf16 (`gather="bf16"`) and all-gathered; every rank dequantizes the same gathered bytes,
its own chunk included, so the replicas stay identical. FSDP2's reduce-scatter is the first
half alone. Wire bytes a rank sends per element of the bucket, against a ring all-reduce
(2 (W-1)/W of the payload) or reduce-scatter ((W-1)/W):

    all-reduce fp32 8 (W-1)/W, bf16 4 (W-1)/W; FP8 exchange (1 + 4/block) (W-1)/W for the
    all-to-all, plus (1 + 4/block) (W-1)/W (gather e4m3) or 2 (W-1)/W (gather bf16);
    reduce-scatter fp32 4 (W-1)/W; FP8 (1 + 4/block) (W-1)/W.

The decision. Each bucket (DDP: by bucket index; FSDP2: by module path) runs its usual
high-precision collective for its first `window_steps` + 1 calls; from its second call on (DDP
rebuilds its buckets after the first step, and the first collectives set up communicators),
each call also runs the FP8 exchange on a copy and measures the relative error of its result
against the high-precision one (`kernels.metrics.rel_error`) and the time of both (CUDA
events on the current stream, wall time on CPU; the ranks are lined up by a one-element
all-reduce first, so neither collective absorbs another rank's lateness, and the order of the
two alternates between calls). When the window closes, every rank's view is gathered
(`ranks.decide_once` with a merge, so the decision is the same on every rank): the error
bound is the largest over ranks of the one-sided 95% bound across calls (`probe.upper_bound`,
the Probe's), the times are rank 0's medians. A bucket goes FP8 where its bound is within
`max_error` and (with `speed_check`) the FP8 exchange was at least `min_speedup` times faster;
otherwise it keeps the high-precision collective, with the reason. The decisions never change
afterwards; `GradientComm.table()` lists them, with the bytes each moves.

A bucket the FP8 exchange cannot take (a sparse gradient, a dtype the cast does not read, an
FSDP2 reduction other than a sum or an average, a bucket whose size changed since its window)
keeps the high-precision collective, logged once with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from tabulate import tabulate

from loka_compile import probe, ranks
from loka_compile.config import PROBE_METRICS, check_bool, check_choice, check_non_negative_int, \
    check_positive_number
from loka_compile.kernels import metrics, triton_quant
from loka_compile.kernels.quantize import Fp8Format, dequantize

log = logging.getLogger("loka")

GATHER_FORMATS = ("e4m3", "bf16")
# Blocks are whole rows of the rowwise cast; powers of two keep every chunk's bytes and its
# scales 4-byte aligned for the uint8 packing.
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
_SCALE_BYTES = 4  # one fp32 scale per block


class CommReason(str, enum.Enum):
    """Why a bucket's gradients travel the way they do. FP8 is the only one that means FP8."""

    FP8 = "fp8"
    WINDOW = "window_open"              # still measuring: high precision
    OVER_BUDGET = "over_error_budget"   # the error bound exceeds max_error (max_error 0: always)
    NOT_FASTER = "not_faster"           # the FP8 exchange was not min_speedup times faster
    UNSUPPORTED = "unsupported"         # sparse, a dtype the cast does not read, another reduce op
    CHANGED = "bucket_changed"          # its size differs from the one its window measured
    SINGLE_RANK = "single_rank"         # nothing to communicate


@dataclasses.dataclass(frozen=True)
class CommOptions:
    """`fp8_gradient_comm`'s options, validated (a bad one raises ValueError naming the valid ones).

    max_error: budget on the relative error the FP8 exchange adds to a reduced bucket (its
        one-sided 95% bound over the window's calls); the Probe's per-site default. 0: every
        bucket keeps high precision (`over_error_budget`), the window still measuring.
    window_steps: calls measured per bucket (after its first, unmeasured one) before it is decided.
    block: elements per FP8 scale along the flat bucket.
    gather: the format of the all-gathered result: "e4m3" (fewest bytes) or "bf16" (less error).
    speed_check: require the FP8 exchange to be measured faster; off: error alone decides.
    min_speedup: how much faster, as a ratio of times (a gain within noise buys no error).
    """

    max_error: float = PROBE_METRICS["row_rel_error"]
    window_steps: int = 4
    block: int = 128
    gather: str = "e4m3"
    speed_check: bool = True
    min_speedup: float = 1.05

    def __post_init__(self):
        if isinstance(self.max_error, bool) or not isinstance(self.max_error, (int, float)) or \
                not (0 <= self.max_error < math.inf):
            raise ValueError(f"max_error must be a finite number >= 0 (0: keep high precision), got {self.max_error!r}")
        object.__setattr__(self, "max_error", float(self.max_error))
        window = check_non_negative_int("window_steps", self.window_steps)
        if window < 2:
            raise ValueError(f"window_steps must be at least 2 (a confidence bound needs two calls), got {window}")
        object.__setattr__(self, "window_steps", window)
        if self.block not in BLOCK_SIZES or isinstance(self.block, bool):
            raise ValueError(f"block must be one of the valid blocks {list(BLOCK_SIZES)}, got {self.block!r}")
        check_choice("gather", self.gather, list(GATHER_FORMATS))
        check_bool("speed_check", self.speed_check)
        object.__setattr__(self, "min_speedup", check_positive_number("min_speedup", self.min_speedup))


@dataclasses.dataclass(frozen=True)
class CommDecision:
    """One bucket's decision and what it rests on. Times in microseconds (rank 0's medians);
    wire bytes: what one rank sends per call, high precision and FP8."""

    key: str
    collective: str                 # "all_reduce" (DDP) | "reduce_scatter" (FSDP2)
    numel: int
    dtype: str
    fp8: bool
    reason: CommReason
    detail: str = ""
    error_mean: Optional[float] = None
    error_bound: Optional[float] = None
    calls: int = 0
    high_precision_us: Optional[float] = None
    fp8_us: Optional[float] = None
    high_precision_wire_bytes: int = 0
    fp8_wire_bytes: int = 0

    @property
    def wire_bytes(self) -> int:
        return self.fp8_wire_bytes if self.fp8 else self.high_precision_wire_bytes


# ------------------------------------------------------------------ the exchange


def _all_gather(output: torch.Tensor, data: torch.Tensor, group) -> None:
    """The flat all-gather under its current name (torch 2.13 renamed all_gather_into_tensor)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, data, group=group)


def _reduce_scatter(output: torch.Tensor, data: torch.Tensor, op, group, async_op: bool = False):
    """The flat reduce-scatter under its current name (torch 2.13 renamed reduce_scatter_tensor)."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output=output, input=data, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, data, op=op, group=group, async_op=async_op)


def chunk_elements(numel: int, world: int, block: int) -> int:
    """Elements of each rank's chunk: numel split W ways, rounded up to whole blocks."""
    return -(-numel // (world * block)) * block


def _pack(chunks: torch.Tensor, block: int) -> torch.Tensor:
    """[C, chunk] float -> [C, (chunk / block) (block + 4)] uint8: each block's e4m3 bytes then
    its fp32 scale, so that `_unpack` reads both as views, without copies."""
    count = chunks.shape[0]
    q, scale = triton_quant.quantize_rowwise(chunks.reshape(-1, block), Fp8Format.E4M3.value)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1).view(count, -1)


def _unpack(packed: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """The fp32 values of `_pack`'s bytes: [C, length]."""
    blocks = packed.view(-1, block + _SCALE_BYTES)
    q = blocks[:, :block].view(Fp8Format.E4M3.dtype)
    scale = blocks[:, block:].view(torch.float32)  # rows of block + 4 bytes keep each scale 4-byte aligned
    return dequantize(q, scale).view(packed.shape[0], length)


def _padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    """flat with zeros appended up to numel elements (flat itself when it has them)."""
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def fp8_all_reduce(buffer: torch.Tensor, group, block: int, gather: str, average: bool = True) -> torch.Tensor:
    """The all-reduce (mean by default, as DDP's) of a flat buffer through the FP8 exchange: a new
    tensor of buffer's dtype and shape, the same on every rank."""
    world = dist.get_world_size(group)
    numel = buffer.numel()
    chunk = chunk_elements(numel, world, block)
    packed = _pack(_padded(buffer.reshape(-1), world * chunk).view(world, chunk), block)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    reduced = _unpack(received, chunk, block).sum(dim=0)
    if average:
        reduced = reduced / world
    if gather == "e4m3":
        mine = _pack(reduced.view(1, chunk), block)
        gathered = torch.empty((world, mine.shape[1]), dtype=torch.uint8, device=buffer.device)
        _all_gather(gathered, mine, group)
        values = _unpack(gathered, chunk, block)
    else:
        values = torch.empty((world, chunk), dtype=torch.bfloat16, device=buffer.device)
        _all_gather(values, reduced.to(torch.bfloat16).view(1, chunk), group)
    return values.reshape(-1)[:numel].to(buffer.dtype).view_as(buffer)


def fp8_reduce_scatter(output: torch.Tensor, data: torch.Tensor, group, block: int, average: bool) -> torch.Tensor:
    """FSDP2's reduce-scatter through the FP8 exchange: data [W n] flat, output [n] gets the sum
    (or mean) over ranks of their data[rank n:(rank + 1) n]."""
    world = dist.get_world_size(group)
    numel = output.numel()
    chunk = chunk_elements(numel * world, world, block)
    chunks = data.reshape(world, numel)
    packed = _pack(chunks if chunk == numel else torch.nn.functional.pad(chunks, (0, chunk - numel)), block)
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    reduced = _unpack(received, chunk, block).sum(dim=0)
    output.copy_((reduced / world if average else reduced)[:numel].view_as(output))
    return output


def wire_bytes(collective: str, numel: int, element_size: int, world: int, block: int, gather: str) -> tuple:
    """(high precision, FP8) bytes one rank sends for one call (ring algorithms; module docstring)."""
    share = (world - 1) / world
    chunk = chunk_elements(numel, world, block)
    fp8_chunk = chunk + _SCALE_BYTES * chunk // block
    if collective == "reduce_scatter":
        return round(share * numel * element_size), round(share * world * fp8_chunk)
    gathered = fp8_chunk if gather == "e4m3" else 2 * chunk
    return round(2 * share * numel * element_size), round(share * world * (fp8_chunk + gathered))


# ------------------------------------------------------------------ the window and the decision


@contextlib.contextmanager
def _timed(device: torch.device, into: list):
    """Append the block's time in microseconds to `into`: CUDA events on the current stream
    (synchronized at the end), wall time elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        end.synchronize()
        into.append(start.elapsed_time(end) * 1e3)
    else:
        began = time.perf_counter()
        yield
        into.append((time.perf_counter() - began) * 1e6)


@dataclasses.dataclass
class _Bucket:
    """One bucket's window: its size, the calls seen, each measured call's error and times."""

    numel: int
    dtype: torch.dtype
    calls: int = 0
    errors: list = dataclasses.field(default_factory=list)   # 0-d tensors, read at the close
    # per call, whether the high-precision result was finite (a loss-scaling overflow's is not:
    # it says nothing of FP8's error, and counts as a call all the same, so windows close alike)
    informative: list = dataclasses.field(default_factory=list)
    high_precision_us: list = dataclasses.field(default_factory=list)
    fp8_us: list = dataclasses.field(default_factory=list)


def _supported(tensor: torch.Tensor) -> str:
    """Why the FP8 exchange cannot take `tensor` ("" when it can)."""
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} gradient"
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {tensor.dtype} (the cast reads float32, bfloat16 and float16)"
    return ""


class GradientComm:
    """The FP8 gradient communication of one model: its options, each bucket's window and
    decision, and the bytes its collectives sent (`sent`: payload bytes per collective, window
    included). Made by `fp8_gradient_comm`."""

    def __init__(self, options: CommOptions, collective: str):
        self.options = options
        self.collective = collective
        self.group = None  # DDP's process group (FSDP2 passes its own to each call)
        self.buckets: dict = {}
        self.decisions: dict = {}
        self.sent: dict = {"all_reduce": 0, "reduce_scatter": 0, "all_to_all": 0, "all_gather": 0}
        self._logged: set = set()

    # -- what a user reads

    @property
    def deciding(self) -> bool:
        """Whether some bucket seen so far is still in its window."""
        return any(key not in self.decisions for key in self.buckets)

    def wire_bytes_per_step(self) -> dict:
        """Bytes one rank sends per step under the decisions: {"fp8_plan", "high_precision"}."""
        return {"fp8_plan": sum(d.wire_bytes for d in self.decisions.values()),
                "high_precision": sum(d.high_precision_wire_bytes for d in self.decisions.values())}

    def table(self) -> str:
        rows = [(d.key, d.numel, d.dtype, "fp8" if d.fp8 else "high precision", d.reason.value,
                 _fmt(d.error_bound), _fmt(d.high_precision_us), _fmt(d.fp8_us),
                 d.high_precision_wire_bytes, d.fp8_wire_bytes, d.detail) for d in self.decisions.values()]
        return tabulate(rows, headers=["bucket", "elements", "dtype", "runs", "reason", "error bound", "hp us",
                                       "fp8 us", "hp bytes", "fp8 bytes", "detail"])

    def __str__(self) -> str:
        fp8 = sum(d.fp8 for d in self.decisions.values())
        step = self.wire_bytes_per_step()
        head = (f"FP8 gradient {self.collective.replace('_', '-')}: {fp8} of {len(self.decisions)} bucket(s) in FP8 "
                f"(max_error {self.options.max_error:g}); bytes sent per rank and step {step['fp8_plan']:,} "
                f"(high precision {step['high_precision']:,})")
        if self.deciding:
            head += f"; {sum(k not in self.decisions for k in self.buckets)} bucket(s) still measuring"
        return head + ("\n" + self.table() if self.decisions else "")

    # -- one call of one bucket's collective

    def route(self, key: str, tensor: torch.Tensor, world: int, why_not: str = "") -> str:
        """How this call of bucket `key` runs: "high_precision", "fp8", or "measure" (both, in
        its window). Counts the call; logs once why a bucket cannot go FP8 (`why_not`, or
        what `_supported` finds)."""
        if world < 2:
            if key not in self.decisions:
                self.decisions[key] = self._decision(key, tensor, world, False, CommReason.SINGLE_RANK, "one rank")
            return "high_precision"
        why_not = why_not or _supported(tensor)
        if why_not:
            self._log_once(key, f"gradient bucket {key} keeps its high-precision collective: {why_not}")
            if key not in self.decisions:
                self.decisions[key] = self._decision(key, tensor, world, False, CommReason.UNSUPPORTED, why_not)
            return "high_precision"
        decision = self.decisions.get(key)
        if decision is not None:
            if decision.fp8 and decision.numel != tensor.numel():
                self._log_once(key, f"gradient bucket {key} changed size ({decision.numel} -> {tensor.numel()} "
                               "elements) after its window: high precision from now on")
                decision = self.decisions[key] = dataclasses.replace(decision, fp8=False, reason=CommReason.CHANGED)
            return "fp8" if decision.fp8 else "high_precision"
        bucket = self.buckets.setdefault(key, _Bucket(tensor.numel(), tensor.dtype))
        bucket.calls += 1
        if bucket.calls == 1 or bucket.numel != tensor.numel():  # warm-up, or DDP's rebuilt buckets
            self.buckets[key] = dataclasses.replace(_Bucket(tensor.numel(), tensor.dtype), calls=bucket.calls)
            return "high_precision"
        return "measure"

    def count(self, how: str, tensor: torch.Tensor, world: int) -> None:
        """Add one call's payload bytes to `sent`: its high-precision collective or the FP8 exchange."""
        if world < 2:
            return
        if how == "high_precision":
            self.sent[self.collective] += tensor.numel() * tensor.element_size()
            return
        chunk = chunk_elements(tensor.numel(), world, self.options.block)
        packed = chunk + _SCALE_BYTES * chunk // self.options.block
        self.sent["all_to_all"] += world * packed
        if self.collective == "all_reduce":
            self.sent["all_gather"] += world * (packed if self.options.gather == "e4m3" else 2 * chunk)

    def measure(self, key: str, tensor: torch.Tensor, group, high_precision, fp8) -> torch.Tensor:
        """One window call: `high_precision(tensor)` (in place or not; its result returned, the
        one training uses) and `fp8(a copy)`, each timed, the error of the second against the
        first kept; the bucket is decided after its last window call."""
        bucket, world = self.buckets[key], dist.get_world_size(group)
        dist.all_reduce(torch.zeros(1, device=tensor.device), group=group)  # line the ranks up
        copy = tensor.clone()
        results = {}
        order = ("high_precision", "fp8") if len(bucket.errors) % 2 == 0 else ("fp8", "high_precision")
        for how in order:
            with _timed(tensor.device, bucket.high_precision_us if how == "high_precision" else bucket.fp8_us):
                results[how] = high_precision(tensor) if how == "high_precision" else fp8(copy)
            self.count(how, tensor, world)
        bucket.errors.append(metrics.rel_error_tensor(results["high_precision"], results["fp8"]))
        bucket.informative.append(torch.isfinite(results["high_precision"]).all())
        if len(bucket.errors) >= self.options.window_steps:
            self.decisions[key] = self._close(key, bucket, tensor, world)
        return results["high_precision"]

    def _close(self, key: str, bucket: _Bucket, tensor, world: int) -> CommDecision:
        """Every rank's window of this bucket, merged alike on all (`ranks.decide_once`)."""
        errors = [float(e) for e, finite in zip(bucket.errors, bucket.informative) if bool(finite)]
        view = {"errors": errors, "hp_us": statistics.median(bucket.high_precision_us),
                "fp8_us": statistics.median(bucket.fp8_us)}

        def merge(views):
            bounds = [_bound(v["errors"]) for v in views]
            worst = max(range(len(views)), key=lambda i: bounds[i])
            worst_errors = views[worst]["errors"]
            return {"bound": bounds[worst], "mean": statistics.fmean(worst_errors) if worst_errors else math.inf,
                    "hp_us": views[0]["hp_us"], "fp8_us": views[0]["fp8_us"], "calls": len(worst_errors)}

        seen = ranks.decide_once(lambda: view, merge=merge)
        opts = self.options
        speedup = seen["hp_us"] / seen["fp8_us"] if seen["fp8_us"] > 0 else math.inf
        if seen["bound"] > opts.max_error:
            fp8, reason = False, CommReason.OVER_BUDGET
            detail = f"error bound {seen['bound']:.3g} > max_error {opts.max_error:g}"
            if not seen["calls"]:
                detail += " (no window call had a finite high-precision result)"
        elif opts.speed_check and speedup < opts.min_speedup:
            fp8, reason = False, CommReason.NOT_FASTER
            detail = (f"FP8 {seen['fp8_us']:.0f} us vs high precision {seen['hp_us']:.0f} us "
                      f"({speedup:.2f}x < {opts.min_speedup:g}x)")
        else:
            fp8, reason = True, CommReason.FP8
            detail = (f"error bound {seen['bound']:.3g} <= {opts.max_error:g}; {speedup:.2f}x"
                      + ("" if opts.speed_check else " (speed not required)"))
        decision = self._decision(key, tensor, world, fp8, reason, detail, seen)
        log.info("loka: gradient bucket %s (%d elements) %s: %s", key, decision.numel,
                 "goes FP8" if fp8 else "keeps high precision", detail)
        return decision

    def _decision(self, key, tensor, world, fp8, reason, detail, seen=None) -> CommDecision:
        hp_bytes, fp8_bytes = wire_bytes(self.collective, tensor.numel(), tensor.element_size(), max(world, 1),
                                         self.options.block, self.options.gather)
        seen = seen or {}
        return CommDecision(key, self.collective, tensor.numel(), str(tensor.dtype).replace("torch.", ""), fp8,
                            reason, detail, seen.get("mean"), seen.get("bound"), seen.get("calls", 0),
                            seen.get("hp_us"), seen.get("fp8_us"), hp_bytes, fp8_bytes)

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("loka: %s", message)


def _bound(errors: list) -> float:
    """The Probe's one-sided 95% bound on the mean error across calls (NaN or inf, or no call: +inf)."""
    if not errors:
        return math.inf
    finite = all(math.isfinite(e) for e in errors)
    mean = statistics.fmean(errors) if finite else math.inf
    std = statistics.stdev(errors) if finite and len(errors) > 1 else 0.0
    return probe.upper_bound(mean, std, len(errors), max(errors) if finite else math.inf)


def _fmt(value) -> str:
    return "" if value is None else f"{value:.3g}"


# ------------------------------------------------------------------ DDP and FSDP2


def _ddp_hook(comm: GradientComm, bucket):  # DDP checks annotations by value: none on the return
    """DDP's comm hook: a Future of the bucket averaged over the ranks, as `comm` routes it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group, buffer, opts = comm.group, bucket.buffer(), comm.options
    world = dist.get_world_size(group)
    key = f"bucket{bucket.index()}"
    how = comm.route(key, buffer, world)
    if how == "high_precision":
        comm.count(how, buffer, world)
        return allreduce_hook(group, bucket)
    if how == "fp8":
        comm.count(how, buffer, world)
        return _fp8_all_reduce_future(buffer, group, opts.block, opts.gather)

    def high_precision(tensor):
        tensor.div_(world)
        dist.all_reduce(tensor, group=group)
        return tensor

    reduced = comm.measure(key, buffer, group, high_precision,
                           lambda tensor: fp8_all_reduce(tensor, group, opts.block, opts.gather))
    done = torch.futures.Future()
    done.set_result(reduced)
    return done


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream FP8 gradient exchanges run on, one per device, so that they overlap the backward."""
    return torch.cuda.Stream(device)


def _fp8_all_reduce_future(buffer: torch.Tensor, group, block: int, gather: str) -> torch.futures.Future:
    """A Future of `buffer` averaged through the FP8 exchange. On CUDA the exchange runs on a side
    stream (its collectives block no host thread), and the Future is CUDA-aware: whoever reads it
    waits for that stream. Elsewhere it runs here, and the Future is complete. (Chaining the
    all-gather in a callback of the all-to-all's Future, as DDP's own hooks chain, deadlocks on
    gloo, whose callbacks run on its worker threads.)"""
    if buffer.device.type != "cuda":
        done = torch.futures.Future()
        done.set_result(buffer.copy_(fp8_all_reduce(buffer, group, block, gather)))
        return done
    stream = _side_stream(buffer.device)
    stream.wait_stream(torch.cuda.current_stream(buffer.device))
    with torch.cuda.stream(stream):
        buffer.copy_(fp8_all_reduce(buffer, group, block, gather))
        done = torch.futures.Future(devices=[buffer.device])
        done.set_result(buffer)
    return done


def _fp8_reduce_scatter_class():
    """FSDP2's custom reduce-scatter (`FSDPModule.set_custom_reduce_scatter`) that routes through
    a GradientComm; made on first use (the interface lives in FSDP2's private module)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Fp8ReduceScatter(ReduceScatter):
        def __init__(self, comm: GradientComm, key: str):
            self.comm, self.key = comm, key

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            world = dist.get_world_size(group)
            summed = op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            average = op == dist.ReduceOp.AVG
            how = self.comm.route(self.key, input_tensor, world,
                                  "" if summed else f"FSDP2 reduces with {op}, not a sum or an average")
            block = self.comm.options.block
            if how == "high_precision":
                self.comm.count(how, input_tensor, world)
                return _reduce_scatter(output_tensor, input_tensor, op, group, async_op)
            if how == "fp8":
                self.comm.count(how, input_tensor, world)
                fp8_reduce_scatter(output_tensor, input_tensor, group, block, average)
                return None

            def high_precision(data):
                out = torch.empty_like(output_tensor)
                _reduce_scatter(out, data, op, group)
                return out

            reduced = self.comm.measure(self.key, input_tensor, group, high_precision,
                                        lambda data: fp8_reduce_scatter(torch.empty_like(output_tensor), data,
                                                                        group, block, average))
            output_tensor.copy_(reduced)
            return None

    return Fp8ReduceScatter


# The attribute of the DDP (or FSDP2 root) module that holds its GradientComm, for the report.
_ATTRIBUTE = "_loka_gradient_comm"


def gradient_comm_of(model) -> Optional[GradientComm]:
    """The GradientComm `fp8_gradient_comm` gave `model` (a DDP, torch.compile of one, or an
    FSDP2 root), else None."""
    return getattr(getattr(model, "_orig_mod", model), _ATTRIBUTE, None)


def fp8_gradient_comm(model: torch.nn.Module, **options) -> GradientComm:
    """Opt in to FP8 gradient communication, decided bucket by bucket by measurement (module
    docstring): `model` is a DistributedDataParallel (or `torch.compile` of one: a comm hook is
    registered, so no other may be) or a model sharded with FSDP2's `fully_shard` (every
    FSDPModule in it gets the FP8 reduce-scatter). `options`: `CommOptions`. Returns the
    `GradientComm` whose `decisions`, `table()` and `str()` say what each bucket runs and why
    (`loka_compile.report(model)` holds it as `report.communication`)."""
    valid = [f.name for f in dataclasses.fields(CommOptions)]
    unknown = [key for key in options if key not in valid]
    if unknown:
        raise ValueError(f"unknown fp8_gradient_comm options {unknown}; valid options: {valid}")
    opts = CommOptions(**options)
    inner = getattr(model, "_orig_mod", model)  # torch.compile(DDP(model))
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        comm = GradientComm(opts, "all_reduce")
        comm.group = inner.process_group
        inner.register_comm_hook(comm, _ddp_hook)
        setattr(inner, _ATTRIBUTE, comm)
        return comm
    from torch.distributed.fsdp import FSDPModule

    sharded = [(name, m) for name, m in inner.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(f"fp8_gradient_comm takes a DistributedDataParallel model (or torch.compile of one) or a "
                         f"model sharded with fully_shard; got {type(model).__name__} with no FSDPModule in it")
    if not all(hasattr(m, "set_custom_reduce_scatter") for _, m in sharded):
        raise ValueError(f"this torch ({torch.__version__}) has no FSDPModule.set_custom_reduce_scatter, through "
                         "which FSDP2's gradients would go FP8")
    comm = GradientComm(opts, "reduce_scatter")
    cls = _fp8_reduce_scatter_class()
    for name, module in sharded:
        module.set_custom_reduce_scatter(cls(comm, name or "root"))
    setattr(inner, _ATTRIBUTE, comm)
    return comm
