"""FP8 all-gather of FSDP2's sharded weights, in the scaling their GEMMs use (opt-in):
`fp8_all_gather(model)` after `fully_shard`.

Which weights. The weight of an `nn.Linear` inside a module compiled with loka, whose forward
site(s) the running plan runs in FP8 with a weight scaling the gather can reproduce (the
backward: below):

- rowwise: FSDP2 shards W [N, K] along N, so each row's scale (its amax along K) is local to
  the shard. Each rank casts its rows to the site's weight format with one fp32 scale per row
  (`triton_quant.quantize_rowwise`, the cast the GEMM's lowering uses) and gathers the FP8
  bytes and the scales: N K + 4 N bytes against bf16's 2 N K.
- tensorwise: one scale over all of W, from its finite values: the shards' amaxes are
  all-reduced (one fp32 per weight and forward), then each rank casts with that scale
  (`quantize.cast_with_scale`, the tensorwise policy) and gathers N K bytes; the scale
  travels in FSDP2's all-gather metadata.

Everything else gathers in high precision (the parameter's FSDP2 `param_dtype`), with the
reason (`GatherReason`): a parameter that is not such a weight, a shard layout the extension
cannot take (uneven shards: FSDP2 requires every all-gather input of a padded shard to have the
padded shard's size, which the scales do not; CPU offload; resharding to a smaller mesh after
the forward), a site the plan keeps in high precision or has not decided yet (no call, probe
window open), another scaling, or an FP8 GEMM that reads the weight fused with others (a Mod's
`a.{b,c}` site, whose scales may span them). The sites of the training forward and of the
inference graphs both count (FSDP2 gathers under no_grad: which runs next is not known there);
one still in its probe window does not, while another is decided.

The backward's re-gather (FSDP2 frees the gathered weight after the forward) feeds the dgrad, the
backward's one reader of W: where the dgrad runs FP8, it is cast as the dgrad casts W:
columnwise for a rowwise dgrad (one scale per column k, the amax along N: K amaxes all-reduced,
NaN-aware; N K bytes, the scales in the metadata), tensorwise for a tensorwise one; otherwise (a
high-precision dgrad, or none: a first layer) high precision. A weight FSDP2 keeps gathered after
the forward (the root's, or `reshard_after_forward=False`) is read by the backward as the forward
gathered it, and so is the dgrad's FP8 copy that weight_both_layouts casts in the forward.

After the gather, the weight is dequantized to the compute dtype (one Triton pass where loka's
Triton kernels run, `triton_dequantize`) and the compiled graph casts it again as it casts any
weight: the row's (tensor's) largest value maps to the format's maximum again and every other
value to the same FP8 value, so the GEMM's FP8 operand has the gathered bits and the gathered
scale (`tests/unit/test_weight_gather_casts.py` proves it for the three casts, non-finite values
and every significand of a scale included).
Feeding the gathered FP8 bytes to the GEMM directly would save that pass and the second cast but
needs the compiled graph to take a quantized weight as its input (docs/weight_gather_feed.md).

How. FSDP2's all-gather extension: the sharded parameter's local tensor becomes a
`_RoutedShard` (a tensor subclass sharing the shard's storage, plain tensor in every op), whose
`fsdp_pre_all_gather` / `fsdp_post_all_gather` FSDP2 calls around each all-gather. The format
is decided at each all-gather from the owner's running plan (`state_of`), the same on every rank
since the plan is. When it changes (the window closes, forward against backward), the FSDPParam's
all-gather buffers are dropped so FSDP2 makes them anew for the new inputs.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Optional

import torch
import torch.distributed as dist
from tabulate import tabulate

from loka_compile.kernels import triton_dequantize, triton_quant
from loka_compile.kernels.quantize import Fp8Format, amax_along, cast_with_scale, dequantize, scale_from_amax
from loka_compile.passes import GraphKind, Reason, Role

log = logging.getLogger("loka")

# Weight scalings the gather reproduces on a shard of rows, and the compute dtypes whose one
# rounding of a dequantized e4m3/e5m2 value the next cast undoes (fp16's subnormal range would not).
GATHER_SCALINGS = ("rowwise", "tensorwise")
# What the dgrad's cast of W [N, K] is, per the site's scaling: a rowwise GEMM scales each column
# of its B = W (the amax along N, across the shards: all-reduced); tensorwise is the forward's.
DGRAD_GATHER = {"rowwise": "columnwise", "tensorwise": "tensorwise"}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
_SCALE_BYTES = 4  # one fp32 scale per row (rowwise) or per weight (tensorwise, all-reduced)


class GatherReason(str, enum.Enum):
    """Why a parameter's forward all-gather moves what it moves. FP8 is the only one that means FP8."""

    FP8 = "fp8"
    NOT_LINEAR_WEIGHT = "not_a_linear_weight"         # a bias, a norm's scale, a table, ...
    NOT_COMPILED = "not_compiled_with_loka"           # no loka-compiled module holds it
    UNSUPPORTED_SHARDING = "unsupported_sharding"     # uneven shards, offload, post-forward mesh, other dim
    UNSUPPORTED_DTYPE = "unsupported_dtype"           # a compute dtype outside COMPUTE_DTYPES
    NO_PLAN = "no_plan_yet"                           # the owner has not run, or its window is open
    NO_SITE = "no_forward_site"                       # no forward GEMM site of this module in the plan
    SITE_HIGH_PRECISION = "site_high_precision"       # the plan runs the site in high precision
    SCALING = "scaling_not_reproduced"                # the sites' weight scalings differ or are not gathered


@dataclasses.dataclass
class ParamGather:
    """One sharded parameter: how its latest forward all-gather went and why (`fp8`, `reason`,
    `detail`, `scaling`, `format`), its latest backward re-gather (`backward`), and what its
    all-gathers moved so far. Bytes are the whole gathered tensor's (every rank's shards); a rank
    sends (W - 1) / W of them in a ring."""

    name: str
    shape: tuple
    high_precision_dtype: str = ""
    fp8: bool = False
    reason: GatherReason = GatherReason.NO_PLAN
    detail: str = ""
    scaling: str = ""
    format: str = ""
    backward: str = ""        # the latest backward re-gather: its form, or why high precision
    fp8_gathers: int = 0      # forward and backward
    backward_fp8_gathers: int = 0
    high_precision_gathers: int = 0
    bytes_gathered: int = 0
    amax_all_reduces: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bytes_per_gather(self, fp8: Optional[bool] = None, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of one all-gather of this parameter: in FP8 (this parameter's scaling), or
        in `dtype` (default its high-precision gather dtype)."""
        if fp8 if fp8 is not None else self.fp8:
            rows = self.shape[0]
            return self.numel + (_SCALE_BYTES * rows if self.scaling == "rowwise" else 0)
        size = torch.empty((), dtype=dtype or getattr(torch, self.high_precision_dtype)).element_size()
        return self.numel * size


class WeightGather:
    """The FP8 all-gather of one FSDP2 model's weights: a `ParamGather` per sharded parameter
    (`params`, by name from the root), `table()`, and the bytes per step. Made by `fp8_all_gather`."""

    def __init__(self):
        self.params: dict = {}

    def bytes_per_forward(self) -> dict:
        """Bytes of one forward's all-gathers of every parameter: as they last went ("plan"),
        all in their high-precision dtype, and all in bf16."""
        return {"plan": sum(p.bytes_per_gather() for p in self.params.values()),
                "high_precision": sum(p.bytes_per_gather(fp8=False) for p in self.params.values()),
                "bf16": sum(p.bytes_per_gather(fp8=False, dtype=torch.bfloat16) for p in self.params.values())}

    def table(self, everything: bool = False) -> str:
        """One row per parameter (without `everything`: not those that are no nn.Linear weight)."""
        shown = [p for p in self.params.values() if everything or p.reason is not GatherReason.NOT_LINEAR_WEIGHT]
        rows = [(p.name, "x".join(map(str, p.shape)), f"fp8 {p.scaling} {p.format}" if p.fp8 else
                 f"high precision ({p.high_precision_dtype})", p.reason.value, p.bytes_per_gather(),
                 p.bytes_per_gather(fp8=False, dtype=torch.bfloat16), p.fp8_gathers, p.high_precision_gathers,
                 p.detail, p.backward) for p in shown]
        hidden = len(self.params) - len(shown)
        note = f"\n({hidden} parameters that are no nn.Linear weight gather in high precision)" if hidden else ""
        return tabulate(rows, headers=["parameter", "shape", "forward all-gather", "reason", "bytes", "bf16 bytes",
                                       "fp8 gathers", "hp gathers", "detail", "backward all-gather"]) + note

    def __str__(self) -> str:
        total = self.bytes_per_forward()
        fp8 = sum(p.fp8 for p in self.params.values())
        ratio = total["plan"] / total["bf16"] if total["bf16"] else 1.0
        return (f"FP8 weight all-gather: {fp8} of {len(self.params)} parameters in FP8; one forward gathers "
                f"{total['plan']} bytes ({ratio:.2f}x bf16's {total['bf16']})\n{self.table()}")


# ------------------------------------------------------------------ the casts


def _all_reduce_max(amax: torch.Tensor, group) -> torch.Tensor:
    """The max over the ranks (when distributed), NaN wherever a rank's is NaN (a collective's max
    need not propagate NaN)."""
    if not (dist.is_available() and dist.is_initialized()):
        return amax
    both = torch.stack([amax.nan_to_num(nan=0.0), amax.isnan().to(amax.dtype)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return torch.where(both[1] > 0, torch.full_like(both[0], float("nan")), both[0])


def quantize_shard(shard: torch.Tensor, scaling: str, fmt: Fp8Format, group=None):
    """(FP8 shard [n, K], fp32 scale) as the GEMM's cast of the whole weight would make these rows:
    rowwise [n, 1] (local); columnwise [1, K] (a rowwise dgrad's cast of W: each column's amax
    all-reduced over `group`, NaN-aware); tensorwise 0-d (the shards' finite amaxes all-reduced)."""
    if scaling == "rowwise":
        return triton_quant.quantize_rowwise(shard, fmt.value)
    if scaling == "columnwise":
        scale = scale_from_amax(_all_reduce_max(amax_along(shard, 0), group), fmt)
        return cast_with_scale(shard, scale, fmt), scale
    amax = _all_reduce_max(amax_along(shard, finite_only=True), group)
    scale = scale_from_amax(amax, fmt)
    return cast_with_scale(shard, scale, fmt, non_finite_to_nan=True, infinities=True), scale


def dequantize_into(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """The gathered weight in the compute dtype (into `out` when given): q x scale in fp32, rounded
    once; in one Triton pass where loka's Triton kernels run (`triton_dequantize`, the same bits)."""
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if dtype in triton_dequantize.OUT_DTYPES and q.dim() == 2:
        return triton_dequantize.dequantize_into(q, scale, out)
    out.copy_(dequantize(q, scale))
    return out


# ------------------------------------------------------------------ the tensor subclass FSDP2 calls


class _RoutedShard(torch.Tensor):
    """The local shard of a sharded parameter whose all-gather `_Route` decides. It shares the
    shard's storage and is a plain tensor in every op (torch function disabled); FSDP2 finds
    its all-gather hooks by name. Pickled (a checkpoint), it is the plain shard."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(local: torch.Tensor, route: "_Route") -> "_RoutedShard":
        shard = torch.Tensor._make_subclass(_RoutedShard, local, local.requires_grad)
        shard._loka_route = route
        return shard

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self._loka_route.pre_all_gather(self.as_subclass(torch.Tensor), mesh, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return self._loka_route.post_all_gather(all_gather_outputs, metadata, param_dtype, out)

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()


def _pass_of(group) -> str:
    """"forward" or "backward": what FSDP2 gathers this parameter group for (its own pass, or a
    prefetch for one); "" otherwise (an explicit unshard)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = getattr(group, "_training_state", None)
    return {TrainingState.FORWARD: "forward", TrainingState.PRE_BACKWARD: "backward"}.get(state, "")


class _Route:
    """One parameter's all-gather: the format of each call, from its owner's running plan."""

    def __init__(self, record: ParamGather, fsdp_param, group, owner: torch.nn.Module, path: str):
        self.record, self.fsdp_param, self.group, self.owner, self.path = record, fsdp_param, group, owner, path
        self._last_inputs = None        # (format, dtype) of the last all-gather's inputs
        self._plan_seen = None          # the owner's records when `_plan` was read
        self._plan = {}                 # "forward" / "backward" -> (scaling, format, reason, detail)

    # -- the decision

    def _read_plan(self, gather_pass: str):
        """(scaling, format, reason, detail) of this weight's gather for `gather_pass` from the
        running plan: the forward's from the forward sites of the training forward graphs and of
        the inference (no grad) graphs (FSDP2 gathers under no_grad, so which of them runs next is
        not known here); the backward's from the dgrad sites, the backward's only reader of W."""
        from loka_compile.state import state_of

        try:
            state = state_of(self.owner)
        except ValueError:
            return None, None, GatherReason.NO_PLAN, "its compiled module has not run yet"
        seen = tuple((id(r), r.phase, len(r.contexts), len(r.verdict_amendments), r.fallback) for r in state.records)
        if seen != self._plan_seen:
            sites = {Role.FWD: [], Role.DGRAD: []}
            for record in state.records:
                for kind, ctx in record.contexts_of().items():
                    role = Role.DGRAD if kind is GraphKind.BACKWARD else Role.FWD
                    sites[role] += [(site, ctx.decisions.get(site.id)) for site in ctx.sites
                                    if site.role is role and self.path in _modules_of(site.module)]
            self._plan_seen = seen
            self._plan = {"forward": _judge(self.path, sites[Role.FWD], Role.FWD),
                          "backward": _judge(self.path, sites[Role.DGRAD], Role.DGRAD)}
        return self._plan[gather_pass]

    def _format(self, gather_pass: str, compute_dtype: torch.dtype):
        """(scaling, Fp8Format) of this gather, or (None, None); the record updated."""
        scaling, fmt, reason, detail = self._read_plan(gather_pass)
        if scaling is not None and compute_dtype not in COMPUTE_DTYPES:
            scaling, fmt, reason = None, None, GatherReason.UNSUPPORTED_DTYPE
            detail = f"compute dtype {compute_dtype} (the FP8 gather takes {[str(d) for d in COMPUTE_DTYPES]})"
        rec = self.record
        if gather_pass == "backward":
            rec.backward = f"fp8 {scaling} {fmt.value}" if scaling is not None else f"high precision: {detail}"
            return scaling, fmt
        rec.fp8, rec.reason, rec.detail = scaling is not None, reason, detail
        if scaling is not None:
            rec.scaling, rec.format = scaling, fmt.value
        return scaling, fmt

    # -- FSDP2's hooks

    def pre_all_gather(self, shard: torch.Tensor, mesh, mp_policy):
        compute_dtype = mp_policy.param_dtype or shard.dtype
        gather_pass = _pass_of(self.group)
        scaling, fmt = self._format(gather_pass, compute_dtype) if gather_pass else (None, None)
        rec = self.record
        rec.high_precision_dtype = str(compute_dtype).replace("torch.", "")
        weight = shard.to(compute_dtype)
        if scaling is None:
            inputs, metadata = (weight,), ("high_precision",)
            rec.high_precision_gathers += 1
        else:
            q, scale = quantize_shard(weight, scaling, fmt, self.fsdp_param.mesh_info.shard_process_group)
            if scaling == "rowwise":
                inputs, metadata = (q.view(torch.uint8), scale), (scaling, fmt, None)
            else:  # the scale is the same on every rank: it rides in the metadata
                inputs, metadata = (q.view(torch.uint8),), (scaling, fmt, scale)
                rec.amax_all_reduces += 1
            rec.fp8_gathers += 1
            rec.backward_fp8_gathers += gather_pass == "backward"
        rec.bytes_gathered += self.fsdp_param.mesh_info.shard_mesh_size * sum(t.numel() * t.element_size()
                                                                              for t in inputs)
        layout = (metadata[0], tuple(t.dtype for t in inputs))
        if layout != self._last_inputs and self.fsdp_param.all_gather_outputs:
            # FSDP2 sizes its all-gather buffers at the first all-gather and reuses them
            self.fsdp_param.all_gather_outputs = []
        self._last_inputs = layout
        return inputs, metadata

    def post_all_gather(self, outputs, metadata, param_dtype, out):
        with torch.no_grad():
            if metadata[0] == "high_precision":
                value = outputs[0]
                if out is None:
                    value = value.clone()  # FSDP2 frees its all-gather buffers; the weight is ours
            else:
                scaling, fmt, scale = metadata
                q, scale = outputs[0].view(fmt.dtype), outputs[1] if scaling == "rowwise" else scale
                if out is not None:  # straight into the unsharded parameter, no temporary
                    with torch.autograd._unsafe_preserve_version_counter(out):
                        dequantize_into(q, scale, param_dtype, out)
                    return None
                value = dequantize_into(q, scale, param_dtype)
            if out is None:
                return value, (value,)
            with torch.autograd._unsafe_preserve_version_counter(out):  # as FSDP2's own copy-out
                out.copy_(value)
            return None


def _modules_of(site_module: str) -> tuple:
    """The module paths a site's GEMM belongs to: one, or those a Mod fused ("a.{b,c}": a.b, a.c)."""
    if not site_module.endswith("}") or "{" not in site_module:
        return (site_module,)
    prefix, names = site_module[:-1].split("{", 1)
    return tuple(prefix + name for name in names.split(","))


def _judge(path: str, decisions: list, role: Role = Role.FWD):
    """(scaling, format, reason, detail) from a weight's forward (or dgrad) sites and their
    decisions: FP8 where every decided site runs FP8 in one scaling the gather reproduces (for a
    dgrad, its cast of W: `DGRAD_GATHER`). A site in its probe window does not count while another
    is decided (an eval graph's window opening after the training forward's closed), and leaves
    no plan when none is."""
    if not decisions:
        return None, None, GatherReason.NO_SITE, f"no {role.value} GEMM site of {path!r} in the compiled graphs"
    decided = [(site, d) for site, d in decisions if d is not None and d.reason is not Reason.PROBING]
    if not decided:
        return None, None, GatherReason.NO_PLAN, f"{decisions[0][0].name}: {Reason.PROBING.value}"
    kinds = set()
    for site, decision in decided:
        if not decision.fp8:
            return None, None, GatherReason.SITE_HIGH_PRECISION, f"{site.name}: {decision.reason.value}"
        if len(_modules_of(site.module)) > 1:  # its scales may span the other weights' rows or columns
            return None, None, GatherReason.SCALING, f"{site.name}: the GEMM reads it fused with other weights"
        if role is Role.FWD and decision.scaling == "tensorwise" and not site.b_is_weight:
            return None, None, GatherReason.SCALING, f"{site.name}: its tensorwise scale is not this weight's alone"
        kinds.add((decision.scaling, decision.b_format))
    if len(kinds) != 1:
        return None, None, GatherReason.SCALING, f"its sites use {sorted(kinds)}"
    scaling, fmt = kinds.pop()
    if scaling not in GATHER_SCALINGS or fmt not in (f.value for f in Fp8Format):
        return None, None, GatherReason.SCALING, f"{scaling} {fmt} (the gather reproduces {list(GATHER_SCALINGS)})"
    names = ", ".join(dict.fromkeys(site.name for site, _ in decided))  # a site of several graphs once
    gathered = scaling if role is Role.FWD else DGRAD_GATHER[scaling]
    return gathered, Fp8Format(fmt), GatherReason.FP8, f"{names}: {scaling} {fmt}"


# ------------------------------------------------------------------ the user's door


def _compiled_owner(root: torch.nn.Module, module_name: str):
    """(the nearest module at or above `module_name` compiled with torch.compile, the path of
    `module_name` below it as loka's sites name it), or (None, "")."""
    parts = module_name.split(".") if module_name else []
    for cut in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:cut]))
        below = [p for p in parts[cut:] if p != "_orig_mod"]
        if "_compiled_call_impl" in owner.__dict__ and owner.__dict__["_compiled_call_impl"] is not None:
            return owner, ".".join(below)
        if isinstance(owner, torch._dynamo.eval_frame.OptimizedModule):
            return owner, ".".join(below)
    return None, ""


def _static_reason(fsdp_param, module: torch.nn.Module, param_name: str, owner) -> tuple:
    """(reason, detail) that keeps a parameter out of the FP8 gather for good, or (None, "")."""
    if not (isinstance(module, torch.nn.Linear) and param_name == "weight"):
        return GatherReason.NOT_LINEAR_WEIGHT, f"{type(module).__name__}.{param_name}"
    if owner is None:
        return GatherReason.NOT_COMPILED, "no torch.compile'd module holds it"
    orig = tuple(fsdp_param._orig_size)
    world = fsdp_param.mesh_info.shard_mesh_size
    if fsdp_param.fsdp_placement.dim != 0:
        return GatherReason.UNSUPPORTED_SHARDING, f"sharded along dim {fsdp_param.fsdp_placement.dim}, not 0"
    if orig[0] % world:
        return GatherReason.UNSUPPORTED_SHARDING, f"{orig[0]} rows do not split evenly over {world} ranks"
    if fsdp_param.offload_to_cpu:
        return GatherReason.UNSUPPORTED_SHARDING, "offloaded to CPU"
    if fsdp_param.post_forward_mesh_info not in (None, fsdp_param.mesh_info):  # reshard_after_forward=int
        return GatherReason.UNSUPPORTED_SHARDING, "resharded to a smaller mesh after the forward"
    if hasattr(fsdp_param, "_unsharded_param"):
        return GatherReason.UNSUPPORTED_SHARDING, "gathered before fp8_all_gather (call it before the first step)"
    return None, ""


_ATTRIBUTE = "_loka_weight_gather"


def weight_gather_of(model) -> Optional[WeightGather]:
    """The WeightGather `fp8_all_gather` gave `model` (an FSDP2 root), else None."""
    return getattr(model, _ATTRIBUTE, None)


def fp8_all_gather(model: torch.nn.Module) -> WeightGather:
    """Opt in to FP8 all-gathers of the weights the plan runs in FP8 (module docstring):
    `model` is sharded with FSDP2's `fully_shard` (call this after every `fully_shard` and
    before the first step). Returns the `WeightGather` whose `params`, `table()` and `str()` say,
    per parameter, what its forward all-gather moves and why."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ExtensionsData

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(f"fp8_all_gather takes a model sharded with fully_shard; got {type(model).__name__} with "
                         "no FSDPModule in it")
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    gather = WeightGather()
    for fsdp_module in sharded:
        group = fsdp_module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in (group.fsdp_params if group is not None else ()):
            info = fsdp_param._module_info
            module_name = names.get(id(info.module), "")
            name = f"{module_name}.{info.param_name}" if module_name else info.param_name
            owner, path = _compiled_owner(model, module_name)
            gather_dtype = fsdp_param.mp_policy.param_dtype or fsdp_param.sharded_param.dtype
            record = ParamGather(name, tuple(fsdp_param._orig_size), str(gather_dtype).replace("torch.", ""))
            gather.params[name] = record
            reason, detail = _static_reason(fsdp_param, info.module, info.param_name, owner)
            if reason is not None:
                record.reason, record.detail = reason, detail
                log.info("loka: %s gathers in high precision: %s (%s)", name, reason.value, detail)
                continue
            route = _Route(record, fsdp_param, group, owner, path)
            local = fsdp_param.sharded_param._local_tensor
            fsdp_param.sharded_param._local_tensor = _RoutedShard.of(local, route)
            fsdp_param._extensions_data = ExtensionsData()
            record.detail = "decided at each forward all-gather from the running plan"
    setattr(model, _ATTRIBUTE, gather)
    return gather
