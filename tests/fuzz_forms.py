"""The differential fuzz of loka's graph rewrites: small random modules written the ways public
recsys code writes its GEMMs and their neighbours, one per seed, each run under loka and
compared with eager (tests/integration/test_fuzz_rewrites.py; `python tests/fuzz_forms.py
--cases 500` runs many and lists the failures).

A case is drawn from its seed alone (Python's `random` for the structure, a seeded torch
generator for values), so a failing seed is its own reproduction: `describe(seed)` prints it.

Each case runs three times from copies of one model and one input:
    eager          the reference
    high precision loka with every site kept in high precision (`min_gemm_dim` above every dim:
                   each site `too_small`) and every Mod on, the opt-in ones that keep the
                   model's math included: what the rewrites do to the math alone. The Mods
                   claim bit-exactness or a GEMM's reassociation, so the floor is tight.
    fp8            loka with every site it can put in FP8 there (`rowwise`, wgrad included,
                   `min_gemm_dim` 1, no probe window; emulated on CPU): the floor is FP8's
                   error. Folding (find_sites.batch_fold), lowering and the FP8-only Mods
                   (saved_fp8, weight_both_layouts, cached_weights, gemm_epilogue) act here only.
Checked against eager: every output's and every gradient's shape and dtype, the running
statistics of BatchNorms, and values within the floors below. A site loka declines (a logged
fallback, a site left in high precision) passes; loka failing on a graph does not (`fallback`
off: the error is raised).

The FP8 variant runs as traced by default (the graph after Inductor's post-grad passes and loka's,
each ATen op a kernel call, as loka runs its probe variant), which is what loka's rewrites made and
ten times faster on CPU than Inductor's C++ code generation; LOKA_FUZZ_CODEGEN=1 compiles it too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import random
import sys
import unittest.mock

import torch
import torch.nn.functional as F
from torch import nn

import loka_compile
from loka_compile import compiled_graph
from loka_compile.kernels.metrics import rel_error, sqnr_db
from loka_compile.passes import mods

# Floors. High precision: the Mods change at most a GEMM's or a reduction's summation order;
# in fp32 that moves a result by ~1e-7 relative at these K (<= 96), so 1e-5 is 100x margin
# and a transposed or misplaced operand (relative error ~1) fails by five orders of magnitude.
# A case that computes in bf16 anywhere is judged against the same function in fp32: loka's
# error may be LOW_PRECISION_FACTOR times eager's own (a rounding landing elsewhere, compounded
# through a few layers), or LOW_PRECISION_FLOOR where eager's is smaller: the traced graph's own
# bf16 arithmetic (decomposed ops rounding where eager's kernels do not) reached 0.037 on a
# gradient with every Mod off, against eager's 0.010.
HIGH_PRECISION_FLOOR = 1e-5
LOW_PRECISION_FLOOR = 5e-2
LOW_PRECISION_FACTOR = 2.0
# FP8, by kind of tensor: emulated rowwise e4m3 is ~30 dB per GEMM against its input precision;
# a chain of up to three GEMM blocks and bf16 rounding on top lose a few dB more (outputs and
# BatchNorm running statistics). Gradients also pass ReLU masks, and where the FP8 forward moved
# a pre-activation across zero the mask differs from eager's: each flipped element carries a whole
# gradient value, which alone costs 13-15 dB for one GEMM -> ReLU. A transposed or misplaced
# operand gives about -3 dB, a dropped or doubled term 0 dB; NaN gives -inf.
FP8_SQNR_FLOOR_DB = {"output": 15.0, "buffer": 15.0, "grad": 8.0}

FORMS_ANY_RANK = ("nn_linear", "f_linear", "matmul_wt", "matmul_transpose", "matmul_w", "einsum", "mm_flat",
                  "addmm_flat", "matvec", "matvec_t", "horizontal", "repeated_linear", "tied_weight", "conv1d",
                  "split_cat", "split_regroup", "linear_bn_relu", "sibling_no_grad", "sibling_autocast",
                  "split_no_grad", "shared_twice")
FORMS_RANK3 = ("bmm_expand", "bmm_expand_transpose", "bmm_expand_permute", "baddbmm", "matmul_broadcast",
               "token_mix", "token_mix_permute", "token_mix_siblings", "field_mix", "interaction", "conv2d",
               "fields_flat", "unbind_stack", "pair_products")
# Forms whose output width is their input's (a weight over another axis, or one used both ways)
SQUARE_FORMS = ("token_mix", "token_mix_permute", "token_mix_siblings", "field_mix", "interaction", "pair_products",
                "tied_weight", "shared_twice")
FORMS = FORMS_ANY_RANK + FORMS_RANK3
NORMS = ("none", "none", "layernorm", "batchnorm", "keepdim_center", "keepdim_gate")
ACTIVATIONS = ("relu", "gelu", "none")
WIDTHS = (16, 24, 32, 48)
DTYPES = ("fp32", "fp32", "autocast", "bf16")


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    form: str
    d_in: int
    d_out: int
    bias: str          # "none", "vector" ([N]) or "broadcast" ([1, N] / [1, 1, N])
    norm: str
    activation: str
    residual: bool


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    rank: int            # 2: x [rows, d]; 3: x [batch, seq, d]
    rows: int            # rank 2
    batch: int           # rank 3 (at least 4: a BatchNorm over fewer rows turns FP8 noise into noise of its own)
    seq: int             # rank 3
    dtype: str           # fp32, autocast (fp32 weights, bf16 autocast), bf16 (bf16 weights and input)
    training: bool       # forward + backward; else no_grad in eval mode
    input_grad: bool     # training: x requires grad (first block's dgrad)
    blocks: tuple
    aux_output: bool     # also return a keepdim reduction of the last block's output
    strided_input: bool = False  # x a transposed view of a contiguous tensor (its last dim strided)

    def shape(self, width: int) -> tuple:
        return (self.rows, width) if self.rank == 2 else (self.batch, self.seq, width)


def draw_case(seed: int, blocks: int = 0, forms: tuple = ()) -> Case:
    """The case of `seed`: `blocks` GEMM blocks (0: one to three, drawn), or one block of each
    of `forms` in order (rank 3 where one needs it)."""
    rng = random.Random(seed if not (blocks or forms) else f"{seed}/{blocks}/{','.join(forms)}")
    rank = rng.choice((2, 3))
    if any(form in FORMS_RANK3 for form in forms):
        rank = 3
    choices = FORMS_ANY_RANK + (FORMS_RANK3 if rank == 3 else ())
    width = rng.choice(WIDTHS)
    specs = []
    for i in range(len(forms) or blocks or rng.choice((1, 1, 2, 2, 3))):
        form = forms[i] if forms else rng.choice(choices)
        # Square weights half the time: a transposed square weight has the right shape and wrong values.
        same = form in SQUARE_FORMS or rng.random() < 0.5
        d_out = width if same else rng.choice(WIDTHS)
        specs.append(BlockSpec(form=form, d_in=width, d_out=d_out, bias=rng.choice(("none", "vector", "broadcast")),
                               norm=rng.choice(NORMS), activation=rng.choice(ACTIVATIONS),
                               residual=d_out == width and rng.random() < 0.5))
        width = d_out
    training = rng.random() < 0.6
    return Case(seed=seed, rank=rank, rows=rng.choice((32, 64)), batch=rng.choice((4, 8)), seq=rng.choice((4, 8, 16)),
                dtype=rng.choice(DTYPES), training=training, input_grad=training and rng.random() < 0.5,
                blocks=tuple(specs), aux_output=rng.random() < 0.3, strided_input=rng.random() < 0.3)


def _weight(*shape):
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[-1]))


class Block(nn.Module):
    """One GEMM form over x [..., d_in] -> [..., d_out] (the rank kept), then its norm,
    activation and residual."""

    def __init__(self, spec: BlockSpec, case: Case):
        super().__init__()
        self.spec, self.rank = spec, case.rank
        self.batch, self.seq = case.batch, case.seq
        k, n, form = spec.d_in, spec.d_out, spec.form
        if form in ("nn_linear", "linear_bn_relu", "repeated_linear", "split_cat", "split_regroup", "unbind_stack",
                    "split_no_grad", "shared_twice"):
            self.linear = nn.Linear(k, n, bias=spec.bias != "none")
        elif form in ("sibling_no_grad", "sibling_autocast"):
            self.linear, self.other = nn.Linear(k, n, bias=spec.bias != "none"), nn.Linear(k, n)
            self.autocast = True  # sibling_autocast's region (off in the fp32 reference)
        elif form in ("f_linear", "matmul_wt", "matmul_transpose", "mm_flat", "matvec", "bmm_expand_transpose",
                      "bmm_expand_permute", "tied_weight"):
            self.w = _weight(n, k)                           # [N, K], read transposed
        elif form in ("matmul_w", "einsum", "addmm_flat", "bmm_expand", "baddbmm", "matvec_t"):
            self.w = nn.Parameter(torch.randn(k, n) / math.sqrt(k))  # [K, N], read as it is
        elif form == "matmul_broadcast":
            self.w = nn.Parameter(torch.randn(1, k, n) / math.sqrt(k))
        elif form == "horizontal":
            parts = 2 if n < 32 else 3
            sizes = [n // parts] * (parts - 1)
            self.sizes = sizes + [n - sum(sizes)]
            self.siblings = nn.ModuleList(nn.Linear(k, size, bias=spec.bias != "none") for size in self.sizes)
            self.gate = nn.Linear(k, n, bias=spec.bias != "none")
        elif form == "conv1d":
            self.conv = nn.Conv1d(k, n, 1, bias=spec.bias != "none")
        elif form == "conv2d":
            self.conv = nn.Conv2d(k, n, 1, bias=spec.bias != "none")
        elif form in ("token_mix", "token_mix_permute"):
            self.w = _weight(case.seq, case.seq)             # over the seq axis, square
        elif form == "field_mix":
            self.w = _weight(case.seq, case.seq)
        elif form == "token_mix_siblings":
            self.w, self.w2 = _weight(case.seq, case.seq), _weight(case.seq, case.seq)
        elif form == "interaction":
            self.w = _weight(n, k)
        elif form == "fields_flat":
            self.linear = nn.Linear(case.seq * k, case.seq * n, bias=spec.bias != "none")
        elif form == "pair_products":
            pairs = case.seq * (case.seq - 1) // 2
            self.linear = nn.Linear(pairs, n, bias=spec.bias != "none")
        else:
            raise ValueError(form)
        if spec.bias != "none" and form not in ("nn_linear", "linear_bn_relu", "horizontal", "conv1d", "conv2d",
                                                "sibling_no_grad", "sibling_autocast", "split_no_grad", "shared_twice",
                                                "split_cat", "split_regroup", "unbind_stack", "repeated_linear",
                                                "fields_flat", "pair_products", "token_mix", "token_mix_permute",
                                                "token_mix_siblings", "field_mix", "interaction"):
            self.b = nn.Parameter(torch.randn(n) / 4)
        if form == "linear_bn_relu":
            self.bn = nn.BatchNorm1d(n)
        elif spec.norm == "layernorm":
            self.norm = nn.LayerNorm(n)
        elif spec.norm == "batchnorm":
            self.norm = nn.BatchNorm1d(n)

    def _bias(self):
        b = getattr(self, "b", None)
        if b is None or self.spec.bias == "vector":
            return b
        return b.view(1, -1) if self.rank == 2 else b.view(1, 1, -1)

    def _plus_bias(self, y):
        b = self._bias()
        return y if b is None else y + b

    def gemm(self, x):
        form, k, n = self.spec.form, self.spec.d_in, self.spec.d_out
        if form in ("nn_linear", "linear_bn_relu"):
            return self.linear(x)
        if form == "f_linear":
            return F.linear(x, self.w, getattr(self, "b", None))
        if form == "matmul_wt":
            return self._plus_bias(x @ self.w.t())
        if form == "matmul_transpose":
            return self._plus_bias(torch.matmul(x, self.w.transpose(0, 1)))
        if form == "matmul_w":
            return self._plus_bias(x @ self.w)
        if form == "einsum":
            return self._plus_bias(torch.einsum("...k,kn->...n", x, self.w))
        if form == "mm_flat":
            return self._plus_bias(torch.mm(x.reshape(-1, k), self.w.t()).view(*x.shape[:-1], n))
        if form == "addmm_flat":
            b = self.b if hasattr(self, "b") else torch.zeros(n, dtype=x.dtype)
            b = b if self.spec.bias != "broadcast" else b.view(1, n)
            return torch.addmm(b, x.reshape(-1, k), self.w).view(*x.shape[:-1], n)
        if form == "matvec":  # W @ x of columns x [..., K, 1]
            return self._plus_bias((self.w @ x.unsqueeze(-1)).squeeze(-1))
        if form == "matvec_t":  # W^T @ x of a weight stored [K, N]
            return self._plus_bias((self.w.t() @ x.unsqueeze(-1)).squeeze(-1))
        if form == "shared_twice":  # one linear applied to its own output: two GEMMs on one weight
            return self.linear(torch.relu(self.linear(x)))
        if form == "repeated_linear":  # one linear applied to x twice
            return self.linear(x) * torch.sigmoid(self.linear(x))
        if form == "tied_weight":  # one square weight read both ways: x W^T, then (.) W
            h = torch.relu(F.linear(x, self.w, getattr(self, "b", None)))
            return h @ self.w
        if form == "split_regroup":  # a cat along another dim than the split's: the halves stacked as rows
            y = self.linear(x)
            regrouped = torch.cat(y.split(n // 2, -1)[:2], 0 if self.rank == 2 else 1)
            return torch.cat([regrouped.reshape(*y.shape[:-1], 2 * (n // 2)), y[..., 2 * (n // 2):]], -1)
        if form == "unbind_stack":  # the fields unbound and stacked back in two groups: x itself
            fields = x.unbind(1)
            half = len(fields) // 2
            x = torch.cat([torch.stack(fields[:half], 1), torch.stack(fields[half:], 1)], 1)
            return self.linear(x)
        if form in ("sibling_no_grad", "sibling_autocast"):  # a gate computed under another state
            region = torch.no_grad() if form == "sibling_no_grad" \
                else torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast)
            y = self.linear(x)
            with region:
                gate, again = torch.sigmoid(self.other(x)), self.linear(x)
            return y * gate.to(y.dtype) + again.to(y.dtype)
        if form == "split_no_grad":  # pieces of a split made without grad, concatenated with it
            y = self.linear(x)
            with torch.no_grad():
                pieces = y.split(max(1, n // 2), -1)
            return y * torch.cat(pieces, -1)
        if form == "horizontal":
            pieces = torch.cat([sibling(x) for sibling in self.siblings], -1)
            return pieces * torch.sigmoid(self.gate(x))
        if form == "conv1d":
            if self.rank == 2:
                return self.conv(x.unsqueeze(-1)).squeeze(-1)
            return self.conv(x.transpose(1, 2)).transpose(1, 2)
        if form == "conv2d":
            return self.conv(x.permute(0, 2, 1).unsqueeze(-1)).squeeze(-1).permute(0, 2, 1)
        if form == "split_cat":
            y = self.linear(x)
            half = n // 2
            left, right = y.chunk(2, -1) if n % 2 == 0 else y.split([half, n - half], -1)
            inner = torch.cat([left, right], -1)                              # a whole split: y itself
            return torch.cat([inner[..., :half], torch.cat([inner[..., half:]], -1)], -1)  # a cat of a cat
        if form == "bmm_expand":
            return self._plus_bias(torch.bmm(x, self.w.unsqueeze(0).expand(x.shape[0], k, n)))
        if form == "bmm_expand_transpose":
            return self._plus_bias(torch.bmm(x, self.w.expand(x.shape[0], n, k).transpose(1, 2)))
        if form == "bmm_expand_permute":
            return self._plus_bias(torch.bmm(x, self.w.unsqueeze(0).expand(x.shape[0], n, k).permute(0, 2, 1)))
        if form == "baddbmm":
            bias = self._bias() if hasattr(self, "b") else torch.zeros(n, dtype=x.dtype)
            return torch.baddbmm(bias, x, self.w.expand(x.shape[0], k, n))
        if form == "matmul_broadcast":
            return self._plus_bias(x @ self.w)
        if form == "token_mix":  # a linear over the seq axis, written on the transposed input
            return F.linear(x.transpose(1, 2), self.w, None).transpose(1, 2)
        if form == "token_mix_permute":
            return (x.permute(0, 2, 1) @ self.w).permute(0, 2, 1)
        if form == "token_mix_siblings":  # two linears of one transposed input
            xt = x.transpose(1, 2)
            return (F.linear(xt, self.w) * torch.sigmoid(F.linear(xt, self.w2))).transpose(1, 2)
        if form == "field_mix":  # W @ x with W [S, S] and x [B, S, d]
            return self.w @ x
        if form == "interaction":
            h = x @ self.w.t()
            scores = torch.bmm(h, h.transpose(1, 2)) / n
            return h + torch.bmm(scores.softmax(-1), h)
        if form == "fields_flat":  # the fields side by side for a DNN, the fields cut back out
            flat = torch.cat(torch.split(x, 1, 1), -1).squeeze(1)           # [B, S * d]
            return self.linear(flat).view(x.shape[0], self.seq, n)
        if form == "pair_products":
            fields = [x[:, i:i + 1] for i in range(self.seq)]
            p = torch.cat([fields[i] for i in range(self.seq) for j in range(i + 1, self.seq)], 1)
            q = torch.cat([fields[j] for i in range(self.seq) for j in range(i + 1, self.seq)], 1)
            products = torch.sum(p * q, 2, keepdim=True).squeeze(-1)          # [B, pairs]
            return x + self.linear(products).unsqueeze(1)
        raise ValueError(form)

    def forward(self, x):
        spec = self.spec
        y = self.gemm(x)
        if spec.form == "linear_bn_relu":
            return torch.relu(self.bn(y if self.rank == 2 else y.reshape(-1, spec.d_out)).view(y.shape))
        if spec.norm == "layernorm":
            y = self.norm(y)
        elif spec.norm == "batchnorm":
            y = self.norm(y) if self.rank == 2 else self.norm(y.transpose(1, 2)).transpose(1, 2)
        elif spec.norm == "keepdim_center":
            y = y - y.mean(-1, keepdim=True)
        elif spec.norm == "keepdim_gate":
            y = y * torch.sigmoid(y.sum(dim=0 if self.rank == 2 else 1, keepdim=True) / y.shape[0])
        if spec.activation == "relu":
            y = torch.relu(y)
        elif spec.activation == "gelu":
            y = F.gelu(y)
        return x + y if spec.residual else y


class FuzzModel(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.aux_output = case.aux_output
        self.blocks = nn.ModuleList(Block(spec, case) for spec in case.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.aux_output:  # smooth: in bf16 an amax's gradient goes to whichever of tied maxima rounding made
            return x, x.pow(2).mean(-1, keepdim=True) + x.mean(0, keepdim=True)[..., :1]
        return x


def build(case: Case):
    """(model, input) of a case, from its seed alone."""
    torch.manual_seed(case.seed)
    model = FuzzModel(case)
    shape = case.shape(case.blocks[0].d_in)
    if case.strided_input:
        shape = (*shape[:-2], shape[-1], shape[-2])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(case.seed + 1))
    if case.strided_input:
        x = x.transpose(-1, -2)
    if case.dtype == "bf16":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    if not case.training:
        model.eval()
    return model, x


def describe(seed: int, blocks: int = 0) -> str:
    case = draw_case(seed, blocks)
    head = {f.name: getattr(case, f.name) for f in dataclasses.fields(case) if f.name != "blocks"}
    return "\n".join([f"case {head}"] + [f"  {block}" for block in case.blocks])


HIGH_PRECISION_OPTIONS = {"min_gemm_dim": 2 ** 31}  # every site too_small, every Mod on
FP8_OPTIONS = {"recipe": "rowwise", "min_gemm_dim": 1}  # every site FP8 that loka can run there
COMMON_OPTIONS = {"probe_steps": 0, "fallback": False, "enabled_mods": mods.OPT_IN_MODS + ("pair_products",),
                  "graph_speed_check": "off"}


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@contextlib.contextmanager
def _traced_fp8_variant():
    """The FP8 variant run as traced, as loka runs its probe variant (`inductor_compile._as_traced`)."""
    if os.environ.get("LOKA_FUZZ_CODEGEN") == "1":
        yield
        return
    inner = compiled_graph.inner_compile
    with unittest.mock.patch.object(compiled_graph, "inner_compile", functools.partial(inner, codegen=False)):
        yield


def run(case: Case, model: nn.Module, x: torch.Tensor, backend_options=None) -> dict:
    """One training step or inference call of a copy of `model` (eager when `backend_options` is
    None): outputs, input and parameter gradients, buffers, and the loka report."""
    model = copy.deepcopy(model)
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(case.input_grad)
    fn = model
    if backend_options is not None:
        torch._dynamo.reset()
        loka_compile.reset()
        fn = torch.compile(model, backend="loka", options={**COMMON_OPTIONS, **backend_options})
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.dtype == "autocast")
    grad_mode = torch.enable_grad() if case.training else torch.no_grad()
    with grad_mode, autocast, _traced_fp8_variant():
        outs = _outputs(fn(x))
    result = {"outputs": [o.detach() for o in outs], "report": None}
    if case.training:
        cotangents = torch.Generator().manual_seed(case.seed + 2)
        loss = sum((o.float() * torch.randn(o.shape, generator=cotangents)).sum() for o in outs)
        loss.backward()
        result["grads"] = {name: p.grad for name, p in model.named_parameters()}
        if case.input_grad:
            result["grads"]["<input>"] = x.grad
    result["buffers"] = {name: b.detach().clone() for name, b in model.named_buffers() if b.is_floating_point()}
    if backend_options is not None:
        result["report"] = loka_compile.report(fn)
    return result


def _pairs(reference: dict, result: dict, exact: "dict | None" = None):
    """(name, eager's tensor, loka's, the fp32 reference's or None) of every output, gradient and
    floating buffer."""
    names = [f"output {i}" for i in range(len(reference["outputs"]))] + \
        [f"grad {name}" for name in reference.get("grads", {})] + [f"buffer {name}" for name in reference["buffers"]]

    def tensors(run):
        if run is None:
            return [None] * len(names)
        return list(run["outputs"]) + list(run.get("grads", {}).values()) + list(run["buffers"].values())

    yield from zip(names, tensors(reference), tensors(result), tensors(exact))


# A gradient whose norm is below this fraction of a typical gradient of its size, in an fp32
# computation, is rounding noise of a value zero in exact arithmetic (~1e-7 of it: a bias before a
# BatchNorm in training). loka's must be as small in high precision (NOISE_FRACTION_BF16 where the
# case computes in bf16); in FP8 the terms that cancel carry FP8's error, so it may be as large as
# the gradient floor allows a typical gradient's error.
NOISE_FRACTION = 1e-4
NOISE_FRACTION_BF16 = 1e-2


def _typical_magnitude(run: dict) -> float:
    """The RMS of every gradient element of a run (0 for inference)."""
    grads = [g.detach().double().flatten() for g in run.get("grads", {}).values() if g is not None]
    return float(torch.cat(grads).pow(2).mean().sqrt()) if grads else 0.0


def _rounding_noise(tensor: torch.Tensor, typical: float, fraction: float) -> bool:
    return float(tensor.double().norm()) <= fraction * typical * math.sqrt(tensor.numel())


def low_precision(case: Case) -> bool:
    """Whether the case computes in bf16 anywhere (its dtype, or a form's own autocast region)."""
    return case.dtype != "fp32" or any(block.form == "sibling_autocast" for block in case.blocks)


def fp32_reference(case: Case, model: nn.Module, x: torch.Tensor) -> dict:
    """The case's function computed in fp32 (bf16 weights and input upcast, autocast off, the
    forms' own autocast regions too): the reference of a case that computes in bf16 anywhere,
    where eager's own bf16 rounding, compounded through norms, reaches 10% of a gradient."""
    exact = copy.deepcopy(model).float()
    for block in exact.blocks:
        block.autocast = False
    return run(dataclasses.replace(case, dtype="fp32"), exact, x.float())


def compare(case: Case, reference: dict, result: dict, variant: str, exact: "dict | None" = None) -> list:
    """The failures of `result` against eager's `reference` (and, for a case in bf16, the fp32
    reference `exact`): shape, dtype and None against eager's; NaN; a value past the floor."""
    failures = []
    typical = _typical_magnitude(exact or reference)
    if len(reference["outputs"]) != len(result["outputs"]):
        return [f"{variant}: {len(result['outputs'])} outputs, eager has {len(reference['outputs'])}"]
    for name, ref, out, ref32 in _pairs(reference, result, exact):
        if (ref is None) != (out is None):
            failures.append(f"{variant}: {name} is {'None' if out is None else 'set'}, eager's is not")
            continue
        if ref is None:
            continue
        if out.shape != ref.shape or out.dtype != ref.dtype:
            failures.append(f"{variant}: {name} {tuple(out.shape)} {out.dtype}, eager {tuple(ref.shape)} {ref.dtype}")
            continue
        if not torch.isfinite(out).all():
            failures.append(f"{variant}: {name} is not finite")
            continue
        base = ref if ref32 is None else ref32
        if _rounding_noise(base, typical, NOISE_FRACTION):
            # zero in exact arithmetic: the reference is rounding noise, so no ratio to it means anything
            allowed = (NOISE_FRACTION if ref32 is None else NOISE_FRACTION_BF16) if variant == "high precision" \
                else 10 ** (-FP8_SQNR_FLOOR_DB["grad"] / 20)
            if not _rounding_noise(out, typical, allowed):
                failures.append(f"{variant}: {name} is {float(out.double().norm()):.3g} where the reference is "
                                f"rounding noise, {float(base.double().norm()):.3g}")
            continue
        if variant == "high precision":
            err, floor = rel_error(base, out), HIGH_PRECISION_FLOOR
            if ref32 is not None:
                floor = max(LOW_PRECISION_FLOOR, LOW_PRECISION_FACTOR * rel_error(ref32, ref))
            if not err <= floor:
                failures.append(f"{variant}: {name} relative error {err:.3g} > {floor:.3g}")
        else:
            db, floor = sqnr_db(base, out), FP8_SQNR_FLOOR_DB[name.split()[0]]
            if not db >= floor:
                failures.append(f"{variant}: {name} SQNR {db:.1f} dB < {floor} dB")
    return failures


def _worst(case: Case, reference: dict, result: dict, variant: str, exact: "dict | None" = None) -> dict:
    """The worst error per kind of tensor (outputs, grads, buffers): the largest relative
    error in high precision, the lowest SQNR in FP8 (for choosing and watching the floors)."""
    worst, typical = {}, _typical_magnitude(exact or reference)
    for name, ref, out, ref32 in _pairs(reference, result, exact):
        base = ref if ref32 is None else ref32
        if base is None or out is None or out.shape != base.shape or _rounding_noise(base, typical, NOISE_FRACTION):
            continue
        kind = name.split()[0]
        if variant == "high precision":
            worst[kind] = max(worst.get(kind, 0.0), rel_error(base, out))
        else:
            worst[kind] = min(worst.get(kind, math.inf), sqnr_db(base, out))
    return {kind: float(f"{value:.3g}") for kind, value in worst.items()}


def check(seed: int, blocks: int = 0) -> tuple:
    return check_case(draw_case(seed, blocks))


def check_case(case: Case) -> tuple:
    """(failures, notes) of one case: what differs from eager beyond the floors, and how many
    sites went FP8 and what the Mods did (for the log)."""
    model, x = build(case)
    reference = run(case, model, x)
    exact = fp32_reference(case, model, x) if low_precision(case) else None
    failures = []
    notes = {}
    for variant, options in (("high precision", HIGH_PRECISION_OPTIONS), ("fp8", FP8_OPTIONS)):
        try:
            result = run(case, model, x, options)
        except Exception as error:  # noqa: BLE001  (loka failing on a graph is a finding, reported with the case)
            failures.append(f"{variant}: raised {type(error).__name__}: {error}")
            continue
        failures += compare(case, reference, result, variant, exact)
        report = result["report"]
        notes[variant] = {"sites": len(report.sites), "fp8": sum(s.fp8 for s in report.sites),
                          "mods": {k: v for k, v in report.mods.items() if v and isinstance(v, int)},
                          "worst": _worst(case, reference, result, variant, exact)}
    return failures, notes


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--cases", type=int, default=100, help="number of seeds from --start")
    parser.add_argument("--blocks", type=int, default=0, help="GEMM blocks per case (0: one to three, drawn)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    failed = 0
    for seed in range(args.start, args.start + args.cases):
        try:
            failures, notes = check(seed, args.blocks)
        except Exception as error:  # noqa: BLE001  (eager itself failed: the generator's bug, listed)
            failures, notes = [f"eager raised {type(error).__name__}: {error}"], {}
        status = "FAIL" if failures else "ok"
        print(f"seed {seed}: {status} {notes}", flush=True)
        if failures:
            failed += 1
            print(describe(seed, args.blocks))
            for failure in failures:
                print("   ", failure[:2000])
    print(f"{failed} of {args.cases} cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
