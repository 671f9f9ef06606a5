"""gemm_norm: in an inference graph with calibrated activation scales, an FP8 GEMM whose
output is row-normalized (LayerNorm or RMSNorm over its N) before it becomes the next FP8
GEMM's A computes the norm in its own epilogue and writes that FP8 operand directly. A
Mod that is on by default (`disabled_mods=["gemm_norm"]` switches it off); it extends the
chains of `gemm_epilogue` (whose walk, declines and lowering it shares), and `lower` runs
both.

Matches (inference graph; both GEMMs FP8 sites Dispatch sent to FP8, the producer
tensorwise or rowwise):

    C = mm(A, B) | addmm(bias, A, B)      2-D, K and N unpadded, N <= 256
        [views that keep the last dim]
    C = act(C)                            optional
    S = C + R                             optional residual, R of S's shape
    Y = layer_norm(S, [N], w, b, eps)     or rms_norm(S, [N], w, eps); w and b optional;
        | rms_norm(S, [N], w, eps)        decomposed as Inductor decomposes them, or not
    Y = act2(Y)                           optional
        [views]
    D = mm(Y, B2) | addmm(bias2, Y, B2)   Y is A of an FP8 site with a static scale s

becomes

    Q, S' = loka.triton_fp8_gemm_norm(A_q, A_s, B_q, B_s, bias, R, act, norm, w, b, eps, act2,
                                      out_dtype=fp8, out_scale=s, write_pre=<S has other readers>)
    D = the consumer's FP8 GEMM on (Q, s); S's other readers read S'

S may have readers besides the norm: a residual stream (HSTU: `x = out(...) + x`, then the
next block's LayerNorm of x and, later, its residual add of x). The kernel then writes S
as well (S', in S's dtype), and those readers read it; without a residual R, S must be the
GEMM's 2-D output itself for that.

What it saves: Inductor's norm kernel after the GEMM reads C (and R) in bf16 and writes S
(when read again) and the FP8 operand; the fused kernel reads R and writes S and the
operand, so C's write and read (4 bytes per element) are gone, and the norm's reductions
run on the accumulator in registers.

Declines (the chain stays unfused, or fuses without the norm where `gemm_epilogue`
takes it):
    `gemm_norm` disabled; everything `gemm_epilogue` declines;
    N > 256 (`triton_gemm_norm.MAX_N`): rows wider than one tile need split statistics,
        not built;
    a norm over another dim than the last, a LayerNorm with a variance correction, or
        an eps that is not one float constant;
    norm parameters that are not [N] tensors;
    S read elsewhere with no residual and S not the GEMM's 2-D output (the kernel writes
        S' as [M, N]);
    a split of the GEMM's output (the norm needs whole rows of one consumer);
    with the speed check on an FP8 GPU: the fused kernel measured slower than the
        producer's GEMM plus the norm kernel, charged at copy bandwidth for its bytes
        (`speed.epilogue_timing`).

The norms are recognized with Inductor's pattern matcher (each norm traced through the
decompositions Inductor applies, and without them, per dtype; its constants are read and
checked from the matched nodes, since generated patterns ignore them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch._inductor import pattern_matcher

from ..rewrite import users_within
from .mod import Evidence, Mod, Stage

try:  # the kernel needs Triton; without it no chain goes through a norm
    from loka_compile.kernels.triton_gemm_norm import MAX_N
except Exception:  # noqa: BLE001 - a broken Triton must not break the passes
    MAX_N = 0

aten = torch.ops.aten

# gemm_epilogue's too: a chain with a norm is one of its chains
EPILOGUE_CAST = "fused into the epilogue of"  # how a fed A's cast begins in `site.casts` (the report counts them)
NORMALIZED = "normalized"  # how the epilogue's cast description names the norm (the report counts them)
_MAX_NORM_NODES = 24  # the longest decomposition (LayerNorm in bf16 with weight and bias) is 12 nodes
_WIDTH = 16  # the traced example's row length; generated patterns ignore sizes

@dataclasses.dataclass
class NormLink:
    """The norm of a chain: what the fused kernel computes after the residual add."""

    kind: str                              # "layer" or "rms"
    weight: Optional[torch.fx.Node]
    bias: Optional[torch.fx.Node]
    eps: float
    pre: torch.fx.Node                     # S, the value normalized
    pre_readers: list                      # S's readers outside the norm: the kernel writes S for them
    output: torch.fx.Node                  # the norm's output
    post_activation: str = "none"

    @property
    def write_pre(self) -> bool:
        return bool(self.pre_readers)

    def description(self) -> str:
        name = "layer norm" if self.kind == "layer" else "RMS norm"
        act = f", then {self.post_activation}" if self.post_activation != "none" else ""
        return f"{NORMALIZED} ({name}{act})"

def _norm_functions() -> dict:
    """(kind, has weight, has bias) -> the norm as the model calls it."""
    shape = (_WIDTH,)
    return {
        ("layer", True, True): lambda x, weight, bias: F.layer_norm(x, shape, weight, bias, 1e-5),
        ("layer", True, False): lambda x, weight: F.layer_norm(x, shape, weight, None, 1e-5),
        ("layer", False, False): lambda x: F.layer_norm(x, shape, None, None, 1e-5),
        ("rms", True, False): lambda x, weight: F.rms_norm(x, shape, weight, 1e-6),
        ("rms", False, False): lambda x: F.rms_norm(x, shape, None, 1e-6),
    }

def _functional(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """In-place ops on the trace's own temporaries made functional: RMSNorm's decomposition
    adds eps in place (`add_`), where the graphs AOTAutograd hands over hold `add`."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
                and target._opname.endswith("_") and node.args and node.args[0].op != "placeholder":
            node.target = getattr(getattr(aten, target._opname[:-1]), target._overloadname)
    gm.recompile()
    return gm

def _trace_decomposed(fn, args, **_):
    return _functional(pattern_matcher.fwd_only(fn, args))

def _trace_undecomposed(fn, args, **_):
    return _functional(pattern_matcher.fwd_only(fn, args, get_decomp_fn=dict))

@functools.lru_cache(maxsize=None)
def _norm_patterns(dtype: torch.dtype) -> list:
    """((kind, has weight, has bias), pattern) per norm, traced with Inductor's
    decompositions and without, for an input of `dtype`."""
    found = []
    for trace in (_trace_decomposed, _trace_undecomposed):
        for key, fn in _norm_functions().items():
            example = [torch.empty(8, _WIDTH, dtype=dtype)] + [torch.empty(_WIDTH, dtype=dtype) for _ in range(key[1] + key[2])]
            found.append((key, pattern_matcher.gen_pattern(fn, example, trace)))
    return found

_REDUCTIONS = {aten.var_mean.correction, aten.mean.dim, aten.native_layer_norm.default}

def _last_dim_only(node: torch.fx.Node, rank: int) -> bool:
    """The matched reduction normalizes over the last dim only (and, for a variance, with no
    correction): generated patterns ignore the dims and the correction."""
    if node.target is aten.native_layer_norm.default:
        return len(node.args[1]) == 1
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] not in (-1, rank - 1):
        return False
    if node.target is aten.var_mean.correction:
        correction = node.kwargs.get("correction", node.args[2] if len(node.args) > 2 else None)
        return correction == 0
    return True

def _eps_of(nodes: list) -> Optional[float]:
    """The one float constant among the matched nodes' arguments (the norm's eps)."""
    floats = [a for n in nodes for a in (*n.args, *n.kwargs.values())
              if isinstance(a, float) and not isinstance(a, bool)]
    return floats[0] if len(floats) == 1 else None

def norm_of(node: torch.fx.Node, dtype: torch.dtype) -> Optional[tuple]:
    """(NormLink, the nodes it spans) of a LayerNorm or RMSNorm over the last dim of
    `node` (N <= MAX_N, parameters [N]) whose inner nodes nothing else reads; `node` itself
    may have other readers (they become `pre_readers`). None if none starts there."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or val.dtype != dtype:
        return None
    width = val.shape[-1]
    if not isinstance(width, int) or width > MAX_N:
        return None
    for root in reversed(users_within(node, _MAX_NORM_NODES)):  # the outermost match first
        for (kind, has_weight, has_bias), pattern in _norm_patterns(dtype):
            match = pattern.match(root)
            if not match or match.kwargs.get("x") is not node:
                continue
            inner = set(match.nodes)
            if not all(set(n.users) <= inner for n in match.nodes if n is not root):
                continue
            link = _link(kind, match, root, node, val, width, has_weight, has_bias)
            if link is not None:
                return link, [n for n in root.graph.nodes if n in inner]
    return None

def _link(kind, match, root, node, val, width, has_weight, has_bias) -> Optional[NormLink]:
    reductions = [n for n in match.nodes if n.target in _REDUCTIONS]
    if not reductions or not all(_last_dim_only(n, val.dim()) for n in reductions):
        return None
    eps = _eps_of(match.nodes)
    out = root.meta.get("val")
    if eps is None or out is None or out.dtype != val.dtype:
        return None
    params = [match.kwargs.get("weight") if has_weight else None, match.kwargs.get("bias") if has_bias else None]
    for param in params:
        if param is None:
            continue
        p = param.meta.get("val") if isinstance(param, torch.fx.Node) else None
        if p is None or p.dim() != 1 or p.shape[0] != width:
            return None
    inner = set(match.nodes)
    readers = [user for user in node.users if user not in inner]
    return NormLink(kind, params[0], params[1], float(eps), node, readers, root)

def _count(evidence: Evidence) -> dict:
    return {"gemm_norm": sum(s.casts.get("a", "").startswith(EPILOGUE_CAST) and f"{NORMALIZED} (" in s.casts["a"]
                             for s in evidence.sites if s.fp8)}

MOD = Mod("gemm_norm", Stage.INFERENCE, True,
          "the gemm_epilogue chain through a LayerNorm/RMSNorm over N <= 256, computed in the epilogue",
          counters=("gemm_norm",), count=_count)
