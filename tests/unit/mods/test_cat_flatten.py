"""The cat_flatten Mod: a cat of cats becomes one cat, a cat of a whole split its source or a
view of it. The Dynamo graph pass on the interaction layers as deepctr-torch writes them
(FiBiNET's nested cat and `combined_dnn_input`), each split form, the cats it must leave alone;
outputs and gradients bit-exact against the graph as written; then compiled under loka with
the Mod on and off."""

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile.passes.mods.cat_flatten import flatten_cats
from graphs import dynamo_graph, rewritten_against_eager

pytestmark = pytest.mark.usefixtures("fresh_compile_state", "one_thread")

needs_deepctr = pytest.mark.skipif(importlib.util.find_spec("deepctr_torch") is None,
                                   reason="the public extra is not installed: pip install -e '.[public]'")


def _cats(gm) -> int:
    return sum(n.op == "call_function" and n.target in (torch.cat, torch.concat) for n in gm.graph.nodes)


def _run(gm, inputs):
    """gm's output and the gradients of a fixed random projection of it by every input that needs one."""
    for t in inputs:
        t.grad = None
    out = gm(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach().clone(), [t.grad.clone() for t in inputs if t.requires_grad]


def _assert_bit_exact(before, after):
    (out_a, grads_a), (out_b, grads_b) = before, after
    assert torch.isfinite(out_a).all() and torch.isfinite(out_b).all()
    assert out_a.shape == out_b.shape and torch.equal(out_a, out_b)
    assert len(grads_a) == len(grads_b) and grads_a
    for a, b in zip(grads_a, grads_b):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def _rewrite_and_compare(model, *inputs):
    """(what the Mod did, cats in the graph before and after), its output and gradients
    asserted bit-exact against the graph as written."""
    gm, example_inputs = dynamo_graph(model, *inputs)
    written = copy.deepcopy(gm)
    before = _cats(gm)
    result = flatten_cats(gm, example_inputs)
    _assert_bit_exact(_run(written, example_inputs), _run(gm, example_inputs))
    return result, before, _cats(gm)


class FiBiNETInteraction(nn.Module):
    """deepctr-torch FiBiNET's forward from its embeddings to the DNN: SENET, the bilinear
    layer on the reweighted and the raw embeddings (each a cat of the pairwise products), their
    cat, split in fields and put back by `combined_dnn_input`, then the DNN's first Linear."""

    def __init__(self, fields=5, dim=8):
        super().__init__()
        from deepctr_torch.layers.interaction import BilinearInteraction, SENETLayer
        self.SE = SENETLayer(fields, 3, seed=0)
        self.Bilinear = BilinearInteraction(fields, dim, "each", seed=0)
        self.dnn = nn.Linear(fields * (fields - 1) * dim, 16)

    def forward(self, embeddings):
        from deepctr_torch.inputs import combined_dnn_input
        x = torch.cat(embeddings, dim=1)
        temp = torch.split(torch.cat((self.Bilinear(self.SE(x)), self.Bilinear(x)), dim=1), 1, dim=1)
        return torch.relu(self.dnn(combined_dnn_input(temp, [])))


def _embeddings(fields=5, batch=6, dim=8):
    return [torch.randn(batch, 1, dim, requires_grad=True) for _ in range(fields)]


@needs_deepctr
def test_fibinet_interaction_becomes_one_cat_and_a_view():
    """The two bilinear cats go into the outer one, the split-and-cat becomes a view: three of
    the graph's five cats (copies of the products) are gone, bit-exact forward and backward."""
    torch.manual_seed(0)
    result, before, after = _rewrite_and_compare(FiBiNETInteraction(), _embeddings())
    assert result.rewritten == 2 and not result.declined
    assert (before, after) == (5, 2)  # left: the embeddings' cat and the one cat of the 20 products


@pytest.mark.parametrize("form", ["split_ones", "split_twos_same_dim", "chunk_method", "tensor_split", "unbind",
                                  "unbind_other_dim", "split_before_cat_dim", "transposed_source_viewed"])
def test_each_whole_split_form_becomes_its_source(form):
    class WholeSplit(nn.Module):
        def forward(self, x):                              # x [4, 6, 8]
            if form == "split_ones":                       # combined_dnn_input's form: a view [4, 1, 48]
                return torch.cat(torch.split(x, 1, dim=1), dim=-1) * 2
            if form == "split_twos_same_dim":              # the source itself
                return torch.cat(x.split(2, 1), 1) * 2
            if form == "chunk_method":                     # pieces [4, 6, 4] side by side along 1
                return torch.cat(x.chunk(2, dim=-1), dim=1) * 2
            if form == "tensor_split":
                return torch.cat(torch.tensor_split(x, 3, dim=1), dim=2) * 2
            if form == "unbind":                           # AutoInt-style heads put back with unsqueeze
                return torch.cat([t.unsqueeze(1) for t in x.unbind(1)], dim=2) * 2
            if form == "unbind_other_dim":
                return torch.cat([t.unsqueeze(0) for t in torch.unbind(x, 2)], dim=1) * 2
            if form == "transposed_source_viewed":        # the cat's result is contiguous, x^T is not
                return torch.cat(torch.split(x.transpose(1, 2), 1, dim=1), dim=1).view(4, -1) * 2
            return torch.cat(torch.split(x, 4, dim=2), dim=0) * 2  # cat before the split's dim

    torch.manual_seed(0)
    result, before, after = _rewrite_and_compare(WholeSplit(), torch.randn(4, 6, 8, requires_grad=True))
    assert result.rewritten == 1 and not result.declined and (before, after) == (1, 0)


def test_cat_of_a_cat_of_a_whole_split_flattens_both():
    """The split goes first: cat(cat(split(x)), y) along the split's dim is cat(x, y)."""
    class Nested(nn.Module):
        def forward(self, x, y, z):
            inner = torch.cat(torch.split(x, 1, dim=1), dim=1)
            return torch.cat([torch.cat([inner, y], 1), torch.cat([z * 2, z * 3], 1)], 1).sum(-1)

    torch.manual_seed(0)
    inputs = [torch.randn(3, n, 5, requires_grad=True) for n in (4, 2, 2)]
    result, before, after = _rewrite_and_compare(Nested(), *inputs)
    assert result.rewritten == 2 and not result.declined and (before, after) == (4, 1)


def test_a_stack_inside_a_cat_becomes_its_pieces():
    """Public Wukong's input: the dense fields, then the embedding lookups stacked along the same dim."""
    class WukongInput(nn.Module):
        def forward(self, dense, *lookups):
            return torch.cat([dense.view(-1, 2, 8), torch.stack(lookups, dim=1)], dim=1) * 2

    torch.manual_seed(0)
    lookups = [torch.randn(5, 8, requires_grad=True) for _ in range(4)]
    gm, example_inputs = dynamo_graph(WukongInput(), torch.randn(5, 16, requires_grad=True), *lookups)
    written = copy.deepcopy(gm)
    result = flatten_cats(gm, example_inputs)
    _assert_bit_exact(_run(written, example_inputs), _run(gm, example_inputs))
    assert result.rewritten == 1 and not result.declined
    assert not any(n.target is torch.stack for n in gm.graph.nodes) and _cats(gm) == 1


def test_an_input_read_three_times_keeps_its_cats():
    """y is read by both inner cats and the outer one: autograd sums its three gradients in the
    order the cats' backward nodes run, which flattening would change (not bit-exact)."""
    class Shared(nn.Module):
        def forward(self, x, y):
            return torch.cat([torch.cat([x, y], 1), torch.cat([y, x * 2], 1), y], 1)

    torch.manual_seed(0)
    result, before, after = _rewrite_and_compare(Shared(), torch.randn(3, 4, 5, requires_grad=True),
                                                 torch.randn(3, 2, 5, requires_grad=True))
    assert result.rewritten == 0 and result.declined == {"shared_input": 1} and before == after == 3


class MustStay(nn.Module):
    """Cats the Mod leaves as they are, one per reason."""

    def __init__(self, case):
        super().__init__()
        self.case = case

    def forward(self, x, y):                               # x [4, 6, 8], y [4, 6, 8]
        case = self.case
        if case == "inner_used_elsewhere":                 # the inner cat's buffer is needed anyway
            inner = torch.cat([x, y], 1)
            return torch.cat([inner, y], 1).sum(1) + inner.sum(1)
        if case == "inner_read_twice":                     # its gradient sums two slices first
            inner = torch.cat([x, y], 1)
            return torch.cat([inner, inner], 1)
        if case == "other_dim":
            return torch.cat([torch.cat([x, y], 2), torch.cat([y, x], 2)], 1)
        if case == "mixed_dtypes":                         # the inner cat rounds to bf16 first
            return torch.cat([torch.cat([x.bfloat16(), y.bfloat16()], 1), y], 1)
        pieces = torch.split(x, 2, dim=1)
        if case == "pieces_out_of_order":
            return torch.cat([pieces[1], pieces[0], pieces[2]], dim=-1)
        if case == "partial_split":
            return torch.cat(pieces[:2], dim=-1)
        if case == "shared_input":                         # a piece also read elsewhere
            return torch.cat(pieces, dim=-1).sum() + pieces[0].sum()
        if case == "aliased_write":                        # a view would carry the write into x
            z = torch.cat(torch.split(x * 1, 1, dim=1), dim=1)
            z.mul_(2)
            return z + x
        raise ValueError(case)


@pytest.mark.parametrize("case", ["inner_used_elsewhere", "inner_read_twice", "other_dim", "mixed_dtypes",
                                  "pieces_out_of_order", "partial_split", "shared_input", "aliased_write"])
def test_leaves_cats_that_must_stay_alone(case):
    torch.manual_seed(0)
    x, y = torch.randn(4, 6, 8, requires_grad=True), torch.randn(4, 6, 8, requires_grad=True)
    gm, example_inputs = dynamo_graph(MustStay(case), x, y)
    before = _cats(gm)
    code = gm.code
    result = flatten_cats(gm, example_inputs)
    reason = "inner_used_elsewhere" if case == "inner_read_twice" else case
    assert result.rewritten == 0 and result.declined == {reason: 1}
    assert _cats(gm) == before and gm.code == code


def test_excluded_module_and_other_cats_are_left_alone():
    class Block(nn.Module):
        def forward(self, x):
            return torch.cat(torch.split(x, 1, dim=1), dim=-1)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x, y):
            return self.block(x).sum() + torch.cat([x, y], 0).sum()  # a plain cat: not a match

    gm, inputs = dynamo_graph(Outer(), torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    result = flatten_cats(gm, inputs, exclude_modules=("block",))
    assert result.rewritten == 0 and result.declined == {"excluded_module": 1} and _cats(gm) == 2


def _train(model, embeddings, disabled):
    """One loka training step (every site FP8, emulated) of a copy of `model`: output, then the
    gradients of the parameters and the embeddings, and the report."""
    loka_compile.reset()
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    inputs = [e.detach().clone().requires_grad_() for e in embeddings]
    compiled = torch.compile(model, backend="loka", options=dict(probe_steps=0, speed_check=False,
                                                                 disabled_mods=disabled))
    out = compiled(inputs)
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None] + [e.grad for e in inputs]
    return out.detach(), grads, loka_compile.report(compiled)


@pytest.mark.slow
@needs_deepctr
def test_fibinet_under_loka_is_bit_exact_with_the_mod_on_and_off():
    torch.manual_seed(0)
    model, embeddings = FiBiNETInteraction(fields=4, dim=16), _embeddings(fields=4, batch=32, dim=16)
    out_on, grads_on, report = _train(model, embeddings, ())
    out_off, grads_off, report_off = _train(model, embeddings, ("cat_flatten",))
    assert report.mods["cat_flatten"] == 2 and report_off.mods.get("cat_flatten", 0) == 0
    assert any(s.fp8 for s in report.sites), report.table()
    _assert_bit_exact((out_off, grads_off), (out_on, grads_on))


@needs_deepctr
def test_fibinet_copy_kernels_of_inductors_gpu_plan_are_gone():
    """Inductor's GPU kernel plan for the interaction's training step, read on CPU
    (benchmarks.interaction_copies' harness): with the Mod, the only copy kernels left are the
    embeddings' own cat (one per field: they are graph inputs here); without it, the products are
    copied into the outer cat and again by the split-and-cat."""
    from benchmarks import inductor_code_on_cpu as code_on_cpu
    from benchmarks.interaction_copies import kernel_kind, with_mods
    torch.manual_seed(0)
    fields, batch = 4, 24                                   # no other dim of the graph is 24
    model, embeddings = FiBiNETInteraction(fields=fields, dim=16), _embeddings(fields=fields, batch=batch, dim=16)
    copies = {}
    for mods in ((), ("cat_flatten",)):
        torch._dynamo.reset()
        codes = []
        with code_on_cpu.gpu_codegen_on_cpu(codes) as inductor:
            out = torch.compile(copy.deepcopy(model), backend=with_mods(inductor, mods))(embeddings)
            out.sum().backward()
        rows = [r for code in codes for r in code_on_cpu.kernel_traffic(code, batch, batch_anywhere=True)]
        copies[mods] = [r for r in rows if kernel_kind(r["kernel"]) in ("copy", "cast+copy")]
    kept = copies[("cat_flatten",)]
    assert len(kept) == fields and all(r["kernel"].startswith("triton_poi_fused_cat_") for r in kept), kept
    mb = {mods: sum(r["read_mb"] + r["written_mb"] for r in rows) for mods, rows in copies.items()}
    assert len(copies[()]) > 4 * fields and mb[()] > 10 * mb[("cat_flatten",)], mb


class CatsAcrossNoGrad(nn.Module):
    """A cat of a whole split, and a cat of a cat, with `torch.no_grad()` between the pieces and the
    cat (the fuzz, tests/fuzz_forms.py, found them flattened across it: the cat's source then passed
    gradients that eager's pieces, made without grad, do not)."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        if self.form == "split_in_no_grad":
            with torch.no_grad():
                parts = h.split(8, -1)
            return torch.cat(parts, -1) * h
        if self.form == "cat_in_no_grad":
            parts = h.split(8, -1)
            with torch.no_grad():
                whole = torch.cat(parts, -1)
            return whole * h
        left, right = h[:, :8], h[:, 8:]
        with torch.no_grad():
            inner = torch.cat([left, right], -1)
        return torch.cat([inner, h], -1) * h.sum(-1, keepdim=True)


@pytest.mark.parametrize("form", ["split_in_no_grad", "cat_in_no_grad", "inner_cat_in_no_grad"])
def test_cats_across_a_grad_mode_change_stay(form):
    x = torch.randn(16, 32, requires_grad=True)
    result, pairs = rewritten_against_eager(CatsAcrossNoGrad(form), x, flatten_cats)
    assert (result.rewritten, dict(result.declined)) == (0, {"other_state_region": 1}), result.declined
    for name, got, expected in pairs:
        assert (got is None) == (expected is None), name
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
