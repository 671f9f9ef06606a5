"""The graph speed check (`LokaConfig.graph_speed_check`): the FP8 variant of a graph timed
against a high-precision compile of the same graph (same Mods, no FP8 site), the faster kept.

Why: the per-site speed check (`speed.py`) times each site alone, its casts charged as they
would fuse into their producers. In the compiled graph Inductor fuses them its own way, and
where a graph's predicted gain is thin that difference decides whether FP8 pays at all.

What is timed: one step of each variant on the graph's own call's inputs (clones of those
that are not parameters, so that neither variant writes the model's state or the caller's
tensors), in rounds that alternate the variants' order, to cancel drift; each run computes
fresh outputs, and in training also the gradients of every input that takes one
(`torch.autograd.grad`, which leaves `.grad` alone), with fixed random output gradients.
On CUDA each run is timed with CUDA events; in a CUDA-graph mode each variant is compiled
without Inductor's CUDA graphs for the check and its step is captured in a CUDA graph of
its own, so the timing is the device work a CUDA-graph replay runs. On CPU: wall time (a
CPU timing of emulated FP8 says nothing of an FP8 GPU, so "thin" does not time there).

A verdict is remembered (`verdict_key`): in the performance database, and in a saved plan
(`Plan.graph_speed`), keyed by everything the two variants follow from, so that a warm database
or a plan skips the high-precision compile and the timing (a changed graph, config, verdict,
device or loka version makes another key, and times again).

This module holds the parts that need no compiled graph: which graphs are timed, the
variants' steps, the timing, the verdict (`GraphSpeed`) and its key;
`compiled_graph.LokaCompiledGraph` compiles the variants and keeps the winner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
import time
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree

from loka_compile.config import uses_cuda_graphs
from loka_compile.kernels import providers
from loka_compile.speed import capture_stream

log = logging.getLogger("loka")

# "thin": a graph whose FP8 sites the site timings predict at most this much faster (their
# summed high-precision time over their summed FP8 time, minus 1) is timed whole: below it,
# how the casts fuse in the graph can undo the sites' gain (the measurements behind the value
# are in docs/guide.md, "The graph speed check"; provisional until GPU rows of every graph set it).
THIN_GAIN_MARGIN = 0.35
# Alternating rounds of one step per variant; the first WARMUP_STEPS of each are not timed
# (the backward's lazy compile, autotuning, allocator growth).
ROUNDS = 9
WARMUP_STEPS = 2
# Bump when what a remembered verdict's key holds, or how the check times, changes meaning.
VERDICT_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class GraphSpeed:
    """What the graph speed check did on one graph: the gain the site timings predicted,
    and when it timed, each variant's median step and which it kept."""

    predicted_gain: Optional[float]  # FP8 sites' summed high-precision time / summed FP8 time - 1
    sites: int                       # FP8 sites the prediction is over (forward or inference graph)
    fp8_ms: Optional[float] = None
    hp_ms: Optional[float] = None
    kept: str = ""                   # "fp8" or "high precision"; "" when not timed
    skipped: str = ""                # why it did not time
    training: bool = False           # the timed step ran the backward too
    runs: int = 0                    # timed steps per variant
    remembered: str = ""             # where a verdict timed by an earlier compile came from; "" timed here

    @property
    def timed(self) -> bool:
        return self.fp8_ms is not None and self.hp_ms is not None

    def describe_prediction(self) -> str:
        if self.predicted_gain is None:
            return f"predicted gain unknown ({self.sites} FP8 site(s), not all timed)"
        return f"predicted gain {self.predicted_gain:.1%} over {self.sites} FP8 site(s)"

    def describe_times(self) -> str:
        step = "forward + backward" if self.training else "forward"
        where = f", remembered from {self.remembered}" if self.remembered else ""
        return f"FP8 {self.fp8_ms:.3f} ms vs high precision {self.hp_ms:.3f} ms ({step}, medians of {self.runs}{where})"

    def stored(self) -> dict:
        """What is remembered of a timed verdict (`remember`)."""
        return dict(fp8_ms=self.fp8_ms, hp_ms=self.hp_ms, kept=self.kept, training=self.training, runs=self.runs)

    @classmethod
    def remember(cls, value, gain: Optional[float], sites: int, where: str) -> Optional["GraphSpeed"]:
        """The verdict `stored` kept, with this compile's prediction; None where `value` is not
        one (another layout, a damaged entry: the graph is timed again)."""
        try:
            fp8_ms, hp_ms, kept = float(value["fp8_ms"]), float(value["hp_ms"]), value["kept"]
            training, runs = bool(value["training"]), int(value["runs"])
        except (KeyError, TypeError, ValueError):
            return None
        if kept not in ("fp8", "high precision") or not (fp8_ms > 0 and hp_ms > 0) or runs <= 0:
            return None
        return cls(predicted_gain=gain, sites=sites, fp8_ms=fp8_ms, hp_ms=hp_ms, kept=kept, training=training,
                   runs=runs, remembered=where)


def predicted_gain(decisions) -> tuple:
    """(gain, FP8 sites) over `decisions`: the FP8 sites' summed high-precision time over their
    summed FP8 time, minus 1, from the site timings; None when a site has no timing."""
    fp8 = [d for d in decisions if d.fp8]
    if not fp8 or any(d.bf16_us is None or not d.fp8_us for d in fp8):
        return None, len(fp8)
    return sum(d.bf16_us for d in fp8) / sum(d.fp8_us for d in fp8) - 1.0, len(fp8)


def skip_reason(setting: str, gain: Optional[float], sites: int, device: torch.device,
                speed_check: bool = True) -> Optional[str]:
    """Why the graph is not timed, or None: "off"; no FP8 site; "thin" where the sites' speed
    check is off (FP8 wherever eligible was asked for), where the graph's FP8 is emulated
    (`providers.has_fp8_hardware`), or where the predicted gain clears THIN_GAIN_MARGIN."""
    if setting == "off":
        return "graph_speed_check is off"
    if not sites:
        return "no FP8 site in the graph"
    if setting == "always":
        return None
    if not speed_check:
        return "speed_check is off: FP8 wherever eligible, untimed"
    if not providers.has_fp8_hardware(device):
        return f"FP8 is emulated on {device.type}: a timing here says nothing of an FP8 GPU"
    if gain is not None and gain >= THIN_GAIN_MARGIN:
        return f"predicted gain {gain:.1%} >= the thin margin {THIN_GAIN_MARGIN:.0%}"
    return None


def verdict_key(device: torch.device, *, code: str, config, captured: bool, source: str, fp8_graph: str) -> dict:
    """The key of a remembered verdict: the device, torch and triton (`perfdb.environment`),
    loka's code, the config (its `plan` option aside: a plan's decisions show in the graph),
    how the check times (`captures`), the Dynamo graph and its inputs (`graph_cache.source_digest`), and the
    FP8 variant's forward (or inference) graph after loka's passes, which holds every decision
    of it. What decides the backward's sites besides is added where the verdict is kept: the
    Probe's verdicts in the database (`LokaCompiledGraph._graph_speed_keys`), the plan's whole
    content in a plan (`Plan.graph_speed`)."""
    from loka_compile import perfdb  # here: `python -m loka_compile.perfdb` must not find it imported

    return dict(perfdb.environment(device), kind="graph_speed", format=VERDICT_FORMAT, code=code,
                config=repr(dataclasses.replace(config, plan=None)), captured=captured, source=source,
                fp8_graph=fp8_graph)


def key_id(key: dict) -> str:
    """A short stable name of a key (a plan keeps its verdicts under it)."""
    return hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()


def captures(mode: str, device: torch.device) -> bool:
    """Whether the check times each variant's step as a CUDA graph of its own: on CUDA in a
    mode with Inductor's CUDA graphs, which the timed variants are compiled without."""
    return uses_cuda_graphs(mode) and device.type == "cuda"


def mutation_skip(fw_metadata, args) -> Optional[str]:
    """Why the graph's input mutations forbid the check, or None. A graph that writes the data
    of inputs that take no gradient (BatchNorm's running statistics) is timed on clones of
    them; one that changes an input's metadata, or writes a parameter or an input that takes a
    gradient, is not."""
    infos = getattr(fw_metadata, "input_info", None)
    if infos is None or len(infos) != len(args):
        return "its input mutations are unknown (no AOTAutograd metadata for its inputs)"
    for i, (info, arg) in enumerate(zip(infos, args)):
        if info.mutates_metadata or info.mutation_inductor_storage_resize:
            return f"it changes the metadata of its input {i} in place"
        if info.mutates_data and (isinstance(arg, torch.nn.Parameter) or info.requires_grad):
            return f"it writes its input {i} in place, which is a parameter or takes a gradient"
    return None


def step_inputs(args) -> tuple:
    """(inputs, the leaves whose gradients a training step computes): each parameter a new
    Parameter on the same storage (no variant writes it: `mutation_skip`), every other tensor
    a detached copy with the original's strides (compiled code checks them), a leaf that takes
    a gradient where the original did.

    A parameter is not passed as it is: its gradient accumulator is kept alive by the caller's
    autograd graph, on the stream that graph ran on, and the engine's wait on that stream
    breaks the capture of the step on the capture stream."""
    inputs, leaves = [], []
    for arg in args:
        if isinstance(arg, torch.nn.Parameter):
            arg = torch.nn.Parameter(arg.detach(), requires_grad=arg.requires_grad)
        elif isinstance(arg, torch.Tensor):
            copy = torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device)
            arg = copy.copy_(arg.detach()).requires_grad_(arg.requires_grad and arg.is_floating_point())
        inputs.append(arg)
        if isinstance(arg, torch.Tensor) and arg.requires_grad:
            leaves.append(arg)
    return inputs, leaves


class Step:
    """One step of a variant on the check's inputs: its forward and, when its outputs take a
    gradient, the gradients of `leaves` (fixed random output gradients, made at the first run)."""

    def __init__(self, variant: Callable, inputs: list, leaves: list):
        self.variant, self.inputs, self.leaves = variant, inputs, leaves
        self.grads = None
        self.training = False

    def __call__(self) -> None:
        outputs = self.variant(*self.inputs)
        flat = [o for o in pytree.tree_leaves(outputs)
                if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if not flat or not self.leaves:
            return
        self.training = True
        if self.grads is None:
            self.grads = [torch.randn_like(o) for o in flat]
        torch.autograd.grad(flat, self.leaves, self.grads, allow_unused=True)


def time_steps(steps: dict, device: torch.device, captured: bool) -> dict:
    """name -> times in ms of each step's timed runs: WARMUP_STEPS untimed, then ROUNDS rounds
    of one run per step, the order reversed every other round. On CUDA with `captured` each
    step is captured in a CUDA graph and its replays timed (device work); else CUDA events
    around each call, or wall time on CPU."""
    for step in steps.values():
        for _ in range(WARMUP_STEPS):
            step()
    runs = {name: _timed_run(step, device, captured) for name, step in steps.items()}
    times = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(ROUNDS):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            times[name].append(runs[name]())
    return times


def _timed_run(step: Callable, device: torch.device, captured: bool) -> Callable[[], float]:
    """A callable that runs `step` once and returns its time in ms."""
    if device.type != "cuda":
        def wall() -> float:
            start = time.perf_counter()
            step()
            return (time.perf_counter() - start) * 1e3
        return wall
    run = step
    if captured:
        graph = torch.cuda.CUDAGraph()
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            step()  # warm up on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        run = graph.replay

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    timed.graph = run  # keeps the CUDA graph alive as long as its timed run
    return timed


def verdict(times: dict, gain: Optional[float], sites: int, training: bool) -> GraphSpeed:
    """The faster variant by median step time (high precision on a tie: FP8 costs accuracy)."""
    fp8_ms, hp_ms = statistics.median(times["fp8"]), statistics.median(times["hp"])
    return GraphSpeed(predicted_gain=gain, sites=sites, fp8_ms=fp8_ms, hp_ms=hp_ms,
                      kept="fp8" if fp8_ms < hp_ms else "high precision", training=training,
                      runs=len(times["fp8"]))
