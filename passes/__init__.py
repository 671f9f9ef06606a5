"""loka's graph passes, in the one order they run.

Each pass is `fn(graph, ctx) -> int` (how many things it found or changed), lives in a
file named after it, and runs under its name: the `loka.passes` logger at DEBUG prints
the graph before and after each pass.
"""

from __future__ import annotations

import logging

import torch

from .amax_guard import amax_guard
from .context import Decision, GraphKind, PassContext, Reason, Role, Site
from .dispatch_sites import dispatch_sites
from .find_sites import find_sites, graph_kind
from .hop_sites import hop_sites
from .lower import lower
from .probe import probe

log = logging.getLogger("loka.passes")

# Mods that are on unless named in `LokaConfig.disabled_mods` (the harness ablates each):
#   fused_casts  FP8 casts as ATen ops Inductor fuses into their producers (off: one
#                opaque cast op per operand, the unfused baseline)
#   pad          K or N padded to a multiple of 16 instead of keeping the site in bf16
#   cached_weights  inference graphs: each weight's FP8 copy, remade when its content changes
#                and read as a constant, instead of cast on every call
#   horizontal   sibling linears that read one input fused into one GEMM (weights
#                concatenated along N, output split), so the input is cast once
#   benchmarked_reductions  Inductor's multi-kernel: each reduction (a rowwise cast fused
#                into its producer is one) gets a persistent and a looped variant, and the
#                faster at the first call runs. Inductor keeps rows over 1024 looped, which
#                recomputes the producer once per pass (H100, MaskNet inference all-FP8,
#                batch 8192: kernel time 3.84 -> 3.23 ms; Inductor bf16 3.25 -> 3.31 ms)
#   cat_casts    an A concatenated along K from pieces whose casts fuse into their
#                producers, with rows longer than one persistent reduction, is cast per
#                piece (each piece's amax in its producer's kernel, one shared row scale,
#                each part cast into its slice) instead of by one kernel that computes
#                every piece, masked, per element (H100, MaskNet inference, 65536 rows:
#                5.4 ms for the cast of cat(8 LayerNorms), K = 8192)
#   conv1x1      a 1x1 convolution that is a linear over channels (nn.Conv1d/Conv2d with kernel
#                size 1, stride 1, no padding, one group: xDeepFM's compressed interaction
#                network) written as a linear of the transposed input, so its GEMMs become
#                FP8-eligible sites (fwd, dgrad, wgrad) instead of an aten.convolution that
#                find_sites does not see; transposed_linear then picks W @ x or a 2-D GEMM
#                (H100, xDeepFM's CIN at batch 8192, forward + backward in bf16: 54.07 ms as
#                cuDNN convolutions, 19.24 ms as linears; 2026-11-26_H100_conv1x1.md)
#   transposed_linear  a linear of x.transpose(1, 2) (3-D x) computed as W @ x, a batched
#                GEMM that reads x as it is and writes its output in x's layout, so no
#                transposed copy or transposed read is left around it, forward or backward
#                (H100, Inductor bf16, 8 Wukong layers at batch 8192: 30.6 -> 26.5 ms)
#   aligned_gemms  every GEMM with an M, K or N off the 16-byte alignment padded by Inductor
#                (its pad_mm, forced; CUDA only), in high precision too: an unaligned cuBLAS
#                kernel is several times slower (H100, HSTU training: 45.16 -> 42.97 ms in bf16)
#   saved_fp8    training graphs: an activation that a backward FP8 GEMM reads (X of an FP8
#                weight gradient, an activation operand of a batched GEMM's dgrad) is cast
#                in the forward, so the partitioner saves its FP8 copy and scales for the
#                backward instead of the activation in high precision (joint graph)
#   gemm_epilogue  inference graphs with calibrated scales: a GEMM whose output reaches the
#                next FP8 GEMM's A through an activation and a residual add writes that FP8
#                operand from its Triton epilogue, so the bf16 output never goes to memory and
#                no pointwise kernel reads it back (H100, CUDA graphs, GEMM + bias + relu:
#                loka's fused Triton GEMM 1.0-2.3x faster than _scaled_mm + Inductor's
#                epilogue kernel at LRM shapes, 2026-11-22_H100_kernels_gemm.md)
#   gemm_norm    the same for a chain through a LayerNorm/RMSNorm over the GEMM's N (N <= 256),
#                after the residual add: the norm runs on the accumulator in the epilogue,
#                which writes the next FP8 operand (and the pre-norm sum where a residual
#                stream reads it again), so Inductor's norm kernel and the bf16 output it
#                reads are gone (timed per chain by the speed check; GPU figures in
#                benchmarks/results/*_gemm_norm.md)
#   weight_both_layouts  training graphs: a weight read by FP8 forward GEMMs and FP8 dgrads
#                (rowwise) is cast once, in the forward, by one kernel pair that writes both
#                layouts (loka.quantize_dual_axis), and the dgrad reads the copy the forward
#                saved, instead of each GEMM casting the weight itself (joint graph)
#   layernorm_backward  training graphs on CUDA: a LayerNorm over a last dim <= 512 with an
#                affine weight and many rows keeps ATen's forward and gets loka's Triton
#                backward (dx, and dw/db as per-program partials summed by a second kernel)
#                instead of Inductor's decomposed backward, whose dw/db column reduction over
#                all rows is the suspect in public Wukong's largest kernel (Dynamo graph).
#                Off unless named in `enabled_mods` (OFF_BY_DEFAULT_MODS) until a GPU run shows
#                it faster: docs/mods/layernorm_backward.md
MODS = ("fused_casts", "pad", "cached_weights", "horizontal", "benchmarked_reductions", "cat_casts",
        "conv1x1", "transposed_linear", "aligned_gemms", "saved_fp8", "gemm_epilogue", "gemm_norm",
        "weight_both_layouts", "layernorm_backward")
# Mods in MODS that run only when named in `LokaConfig.enabled_mods`.
OFF_BY_DEFAULT_MODS = ("layernorm_backward",)

PIPELINE = (
    ("find_sites", find_sites),
    ("dispatch_sites", dispatch_sites),
    ("probe", probe),
    ("lower", lower),
    ("amax_guard", amax_guard),  # after lower: the guards its casts put in the graph, as one op
    ("hop_sites", hop_sites),  # after the rest: no pass sees the sites inside higher-order ops
)


def run_passes(graph: torch.fx.Graph, ctx: PassContext) -> PassContext:
    for name, fn in PIPELINE:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s/%s before %s:\n%s", ctx.graph, ctx.kind.value, name, graph)
        ctx.changes[name] = fn(graph, ctx)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s/%s after %s (%d):\n%s", ctx.graph, ctx.kind.value, name, ctx.changes[name], graph)
    graph.lint()
    return ctx


__all__ = ["MODS", "PIPELINE", "run_passes", "graph_kind", "Decision", "GraphKind", "PassContext", "Reason", "Role", "Site"]
