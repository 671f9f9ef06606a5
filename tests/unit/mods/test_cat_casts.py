"""The `cat_casts` Mod: an A operand concatenated along K from pieces whose casts fuse into
their producers, with rows longer than one persistent reduction, is cast per piece."""

import copy
import math
import re

import pytest
import torch
from torch import nn

import loka_compile
from loka_compile.kernels.quantize import Fp8Format, Scaling, quantize_along
from loka_compile.kernels.scaled_gemm import GemmSpec, cast_a_pieces
from numerics import sqnr_db

# Every eligible site FP8 (no probe window, no budget): the tests are about the cast's form.
# Without benchmarked_reductions (a GPU setting) rows over 1024 count as long: small shapes.
OPTIONS = {"probe_steps": 0, "max_output_error": None, "recipe": "rowwise",
           "disabled_mods": ["horizontal", "benchmarked_reductions"]}
NO_CAT_CASTS = {**OPTIONS, "disabled_mods": [*OPTIONS["disabled_mods"], "cat_casts"]}
GPU_DEFAULT_MODS = {**OPTIONS, "disabled_mods": ["horizontal"]}
GPU_NO_CAT_CASTS = {**OPTIONS, "disabled_mods": ["horizontal", "cat_casts"]}
PER_PIECE = "per piece of a"


class ParallelTowers(nn.Module):
    """Parallel branches (Linear -> LayerNorm -> ReLU, MaskNet's parallel blocks) whose
    outputs a top Linear reads concatenated; `tokens` keeps a sequence dim, so the top
    Linear reads a 3-D concatenation through its 2-D view."""

    def __init__(self, branches: int = 2, width: int = 768, d_in: int = 64, tokens: int = 0):
        super().__init__()
        self.tokens = tokens
        self.branches = nn.ModuleList(nn.Linear(d_in, width) for _ in range(branches))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(branches))
        self.top = nn.Linear(branches * width, 64)

    def forward(self, x):
        if self.tokens:
            x = x.view(x.shape[0], self.tokens, -1)
        pieces = [torch.relu(norm(branch(x))) for branch, norm in zip(self.branches, self.norms)]
        return self.top(torch.cat(pieces, dim=-1))


def _run(model, x, options, train=False):
    torch._dynamo.reset()
    loka_compile.reset()
    compiled = torch.compile(model, backend="loka", options=options)
    if train:
        out = compiled(x)
        out.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out.detach(), grads, loka_compile.report(compiled)
    with torch.no_grad():
        out = compiled(x)
    return out, None, loka_compile.report(compiled)


def _top(report, role="fwd"):
    return next(s for s in report.sites if s.id.split("/")[-1].startswith(f"top:{role}"))


def _fp32_reference(model, x):
    """The model's output computed in float64, as float32 (the model is left as it is)."""
    return copy.deepcopy(model).double()(x.double()).float()


def test_per_piece_cast_is_bit_identical_to_the_cast_of_the_concatenation():
    pieces = [torch.randn(33, k) * s for k, s in ((100, 1.0), (7, 30.0), (64, 1e-3))]
    pieces[1][3, 2] = float("nan")      # its row's scale is NaN, as for the whole row
    pieces[2][5, 0] = float("inf")      # +inf
    pieces[0][9].zero_(); pieces[1][9].zero_(); pieces[2][9].zero_()  # an all-zero row: scale 1
    for fmt in Fp8Format:
        spec = GemmSpec(Scaling.ROWWISE, fmt, fmt, "emulated", torch.float32)
        q, scale = cast_a_pieces(pieces, spec, torch.float32, flatten=False)
        q_ref, scale_ref = quantize_along(torch.cat(pieces, -1), -1, fmt)
        torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert math.isnan(scale[3].item()) and scale[5].item() == math.inf and scale[9].item() == 1.0


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_long_concatenation_of_norm_outputs_is_cast_per_piece(fresh_compile_state, train):
    model, x = ParallelTowers(), torch.randn(64, 64)
    out, grads, report = _run(model, x, OPTIONS, train)
    top = _top(report)
    assert top.fp8 and top.casts["a"] == "fused into relu (per piece of a 2-way cat)", top.casts
    assert report.mods["cat_casts"] == 1
    # The same quantization as one cast over the concatenation: the same numbers.
    out_off, grads_off, report_off = _run(model, x, NO_CAT_CASTS, train)
    assert _top(report_off).casts["a"] == "fused into cat" and report_off.mods["cat_casts"] == 0
    assert torch.equal(out, out_off)
    for g, g_off in zip(grads or [], grads_off or []):
        assert torch.equal(g, g_off)
    assert sqnr_db(out, _fp32_reference(model, x)) > 20


def test_the_lowered_graph_reduces_each_piece_and_never_the_concatenation(fresh_compile_state):
    """Graph structure (CPU stand-in for Inductor's kernels): each piece's amax reads the
    piece, the row scale is their maximum, and no amax reads the concatenation."""
    model = ParallelTowers(branches=3)
    _, _, report = _run(model, torch.randn(16, 64), OPTIONS)
    (gm,) = [gm for name, gm in report.graph_modules.items() if name.endswith("inference")]
    amaxes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.amax.default]
    maxima = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.maximum.default]
    assert len(maxima) == 2   # three pieces' row amaxes of the top site folded into one
    cats = {n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.cat.default}
    for amax in amaxes:
        source = amax
        while source.all_input_nodes and source.target is not torch.ops.aten.cat.default:
            source = source.all_input_nodes[0]
        assert source not in cats, amax


def test_a_sequence_concatenation_read_through_its_2d_view(fresh_compile_state):
    model, x = ParallelTowers(d_in=16, tokens=4), torch.randn(8, 64)
    out, _, report = _run(model, x, OPTIONS)
    assert _top(report).casts["a"] == "fused into relu (per piece of a 2-way cat)"
    out_off, _, _ = _run(model, x, NO_CAT_CASTS)
    assert torch.equal(out, out_off)


def test_dynamic_batch(fresh_compile_state):
    model = ParallelTowers()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="loka", options=OPTIONS, dynamic=True)
    with torch.no_grad():
        for rows in (24, 40):
            x = torch.randn(rows, 64)
            assert sqnr_db(compiled(x), _fp32_reference(model, x)) > 20
    top = _top(loka_compile.report(compiled))
    assert top.fp8 and PER_PIECE in top.casts["a"]


@pytest.mark.parametrize("case", ["short_row", "piece_is_an_input", "transposed_piece", "tensorwise",
                                  "cat_along_batch", "mod_off"])
def test_declines(fresh_compile_state, case):
    """Negatives: rows within one persistent reduction (K = 512 <= 1024), a piece that
    is a graph input (its cast cannot fuse), a piece whose rows are its producer's
    columns (a transposed view: its amax cannot run along the producer's rows), tensorwise scaling (one global amax first), a
    concatenation along the rows, the Mod switched off."""
    options = OPTIONS
    if case == "short_row":
        model, x = ParallelTowers(width=256), torch.randn(16, 64)
    elif case == "piece_is_an_input":
        model, x = _InputPiece(), torch.randn(16, 1024)
    elif case == "transposed_piece":
        model, x = _TransposedPiece(), torch.randn(16, 64)
    elif case == "tensorwise":
        model, x = ParallelTowers(), torch.randn(16, 64)
        options = {**OPTIONS, "recipe": "tensorwise"}
    elif case == "cat_along_batch":
        model, x = _CatRows(), torch.randn(16, 64)
    else:
        model, x = ParallelTowers(), torch.randn(16, 64)
        options = NO_CAT_CASTS
    _, _, report = _run(model, x, options)
    top = _top(report)
    assert top.fp8 and PER_PIECE not in top.casts["a"], top.casts
    assert report.mods["cat_casts"] == 0


class _InputPiece(nn.Module):
    def __init__(self):
        super().__init__()
        self.branch, self.norm = nn.Linear(1024, 256), nn.LayerNorm(256)
        self.top = nn.Linear(1280, 64)

    def forward(self, x):
        return self.top(torch.cat([x, torch.relu(self.norm(self.branch(x)))], -1))


class _TransposedPiece(nn.Module):
    """The second piece is a [16, 768] view of a [768, 16] ReLU output: its rows are the
    producer's columns."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 768), nn.Linear(64, 16)
        self.basis = nn.Parameter(torch.randn(768, 64))
        self.top = nn.Linear(1536, 64)

    def forward(self, x):
        cols = torch.relu(self.b(self.basis + x[:1]))  # [768, 16]
        return self.top(torch.cat([torch.relu(self.a(x)), cols.t()], -1))


class _CatRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 2048), nn.Linear(64, 2048)
        self.top = nn.Linear(2048, 64)

    def forward(self, x):
        return self.top(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 0))


@pytest.mark.cuda
def test_cuda_no_kernel_reduces_the_whole_concatenated_row(fresh_compile_state):
    """MaskNet's shape: 8 LayerNorm outputs of 1024 concatenated (K = 8192), 8192 rows.
    Inductor's generated code: with the Mod no reduction runs over 8192 elements (each
    piece's amax reduces 1024 in its LayerNorm's kernel); without it one does (the cast
    over the concatenation). Inductor keeps a fused producer's value in fp32 where it
    feeds the cast in the same kernel, so the two forms round a few FP8 values apart: both
    are held to the fp32 reference. (Speed: the MaskNet benchmark's
    `loka_all_fp8_ro_no_cat_casts` row.)"""
    from torch._inductor.utils import run_and_get_code
    model = ParallelTowers(branches=8, width=1024, d_in=256).cuda().to(torch.bfloat16)
    x = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16)
    outs, whole_row_reductions = {}, {}
    for name, options in (("per_piece", GPU_DEFAULT_MODS), ("whole_row", GPU_NO_CAT_CASTS)):
        torch._dynamo.reset()
        loka_compile.reset()
        compiled = torch.compile(model, backend="loka", options={**options, "speed_check": False})
        with torch.no_grad():
            outs[name], code = run_and_get_code(compiled, x)
        source = "\n".join(code)
        whole_row_reductions[name] = len(re.findall(r"r0?_?numel = 8192\b", source))
        assert (PER_PIECE in _top(loka_compile.report(compiled)).casts["a"]) == (name == "per_piece")
    reference = _fp32_reference(model, x)
    quality = {name: sqnr_db(out.float(), reference) for name, out in outs.items()}
    assert quality["per_piece"] > 20 and quality["per_piece"] > quality["whole_row"] - 1, quality
    assert whole_row_reductions["per_piece"] == 0 and whole_row_reductions["whole_row"] >= 1, whole_row_reductions
