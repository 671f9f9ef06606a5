"""The horizontal Mod: sibling linears that share an input fused into one GEMM. The Dynamo
graph pass (positive and negative cases), the report's sites, numerics of the fused
against the unfused compiled model, and tiny MaskNet training with the Mod on."""

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import loka_compile
from loka_compile.passes import MODS
from loka_compile.passes.mods.horizontal import fuse_sibling_linears, joined_module_path
from numerics import rel_error, sqnr_db
from graphs import dynamo_graph, loka_and_eager_grads, rewritten_against_eager

LINEARS = (torch._C._nn.linear, F.linear)


def linear_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEARS]


class Siblings(nn.Module):
    """Three linears on one input (N = 16, 32, 16), used apart; `bias`: all, none or mixed."""

    def __init__(self, bias="all", k=32):
        super().__init__()
        has = {"all": (True, True, True), "none": (False, False, False), "mixed": (True, False, True)}[bias]
        self.a, self.b, self.c = (nn.Linear(k, n, bias=h) for n, h in zip((16, 32, 16), has))

    def forward(self, x):
        return self.a(x).relu() + self.c(x), self.b(x)


class MaskBlock(nn.Module):
    """MaskNet's MaskBlock (benchmarks/zoo/models.py), small."""

    def __init__(self, width, agg, hidden):
        super().__init__()
        self.mask = nn.Sequential(nn.Linear(width, agg), nn.ReLU(), nn.Linear(agg, width))
        self.hidden = nn.Linear(width, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, emb, normed):
        return F.relu(self.norm(self.hidden(self.mask(emb) * normed)))


class ParallelMaskNet(nn.Module):
    def __init__(self, width=64, agg=32, hidden=32, blocks=4):
        super().__init__()
        self.emb_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(MaskBlock(width, agg, hidden) for _ in range(blocks))
        self.head = nn.Linear(blocks * hidden, 1)

    def forward(self, emb):
        normed = self.emb_norm(emb)
        return self.head(torch.cat([blk(emb, normed) for blk in self.blocks], 1)).squeeze(-1)


# ------------------------------------------------------------------ the pass


@pytest.mark.parametrize("bias", ["all", "none", "mixed"])
def test_three_siblings_become_one_linear(bias):
    model, x = Siblings(bias), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x)
    assert len(linear_nodes(gm)) == 3

    result = fuse_sibling_linears(gm, example_inputs)

    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 3, {})
    (fused,) = linear_nodes(gm)
    weight, fused_bias = fused.args[1], fused.args[2]
    assert weight.target is torch.cat and len(weight.args[0]) == 3
    assert (fused_bias is None) == (bias == "none")
    if bias == "mixed":
        assert [b.target for b in fused_bias.args[0] if b.op == "call_function"] == [torch.zeros]
    (split,) = [n for n in gm.graph.nodes if n.target is torch.unsafe_split_with_sizes]
    assert split.args[1] == [16, 16, 32] and split.args[0] is fused   # graph order: a, c, b
    assert sum(n.target is operator.getitem for n in gm.graph.nodes) == 3
    assert result.modules == ["{a,c,b}"]
    assert list(fused.meta["nn_module_stack"].values())[-1][0] == "{a,c,b}"
    with torch.no_grad():
        for got, expected in zip(gm(*example_inputs), model(x)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_masknet_blocks_fuse_their_first_mask_linear():
    model, emb = ParallelMaskNet(), torch.randn(64, 64)
    gm, example_inputs = dynamo_graph(model, emb)

    result = fuse_sibling_linears(gm, example_inputs)

    # mask.0 of the 4 blocks read emb; mask.2, hidden and head each read their own input.
    assert (result.rewritten, result.linears) == (1, 4)
    assert result.modules == ["blocks.{0,1,2,3}.mask.0"]
    assert result.declined == {"single_linear": 9}
    assert len(linear_nodes(gm)) == 13 - 4 + 1
    with torch.no_grad():
        torch.testing.assert_close(gm(*example_inputs)[0], model(emb), rtol=1e-5, atol=1e-6)


class InPlace(nn.Module):
    """Consumers that modify the siblings' outputs in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(32, 32), nn.Linear(32, 32), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.a(x)
        y.mul_(2)
        z = self.b(x)
        z.add_(y)
        return self.act(y) * z


def test_outputs_modified_in_place_keep_forward_and_gradients():
    from torch._dynamo.backends.debugging import aot_eager

    model, x = InPlace(), torch.randn(64, 32)
    reference = copy.deepcopy(model)
    results = []

    def backend(gm, example_inputs):
        results.append(fuse_sibling_linears(gm, example_inputs))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(x)
    out.square().mean().backward()
    expected = reference(x)
    expected.square().mean().backward()
    assert [(r.rewritten, r.linears) for r in results] == [(1, 2)]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class CheckpointedMaskNet(ParallelMaskNet):
    """ParallelMaskNet whose blocks run under activation checkpointing, as deep rankers
    train to save memory."""

    def forward(self, emb):
        def blocks(emb):
            normed = self.emb_norm(emb)
            return torch.cat([blk(emb, normed) for blk in self.blocks], 1)

        return self.head(torch.utils.checkpoint.checkpoint(blocks, emb, use_reentrant=False)).squeeze(-1)


def test_siblings_inside_a_checkpointed_region_fuse(fresh_compile_state):
    torch.manual_seed(0)
    model, emb = CheckpointedMaskNet(), torch.randn(64, 64)
    gm, example_inputs = dynamo_graph(model, emb)
    assert len(linear_nodes(gm)) == 1  # the head; the blocks are in the region's body

    result = fuse_sibling_linears(gm, example_inputs)

    assert (result.rewritten, result.linears) == (1, 4)
    assert result.modules == ["blocks.{0,1,2,3}.mask.0"]
    with torch.no_grad():
        torch.testing.assert_close(gm(*example_inputs)[0], model(emb), rtol=1e-5, atol=1e-6)

    report, grads = loka_and_eager_grads(model, emb, {"probe_steps": 0, "min_gemm_dim": 10 ** 6})
    assert report.mods["horizontal_linears"] == 4
    for name, got, expected in grads:
        assert rel_error(expected, got) <= 1e-4, name


def test_joined_module_path():
    assert joined_module_path(["blocks.0.mask.0", "blocks.1.mask.0"]) == "blocks.{0,1}.mask.0"
    assert joined_module_path(["tower.a", "tower.b", "tower.c"]) == "tower.{a,b,c}"
    assert joined_module_path(["experts.0.fc", "gate"]) == "{experts.0.fc,gate}"
    assert joined_module_path(["x.fc", "x.fc"]) == "x.fc"
    assert joined_module_path(["a", "a.b"]) == "a.{,b}"


def test_declines_a_single_linear():
    model, x = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x)
    code = gm.code
    result = fuse_sibling_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"single_linear": 2})
    assert gm.code == code


def hand_built(weights, rows=64):
    """x -> linear(x, w_i) for each weight, outputs returned; weights are graph inputs."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ws = [graph.placeholder(f"w{i}") for i in range(len(weights))]
    graph.output(tuple(graph.call_function(F.linear, (x, w)) for w in ws))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    return gm, [torch.randn(rows, weights[0].shape[1]), *weights]


def test_declines_different_k_and_dtype():
    # Never valid to run (linear needs x's last dim == K); the pass must still say no.
    p = lambda *shape, dtype=torch.float32: nn.Parameter(torch.randn(*shape, dtype=dtype))  # noqa: E731
    gm, inputs = hand_built([p(16, 32), p(16, 48)])
    code = gm.code
    result = fuse_sibling_linears(gm, inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"k_or_dtype_differs": 2})
    assert gm.code == code
    gm, inputs = hand_built([p(16, 32), p(16, 32, dtype=torch.bfloat16), p(16, 32)])
    result = fuse_sibling_linears(gm, inputs)
    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 2, {"k_or_dtype_differs": 1})


def test_declines_weights_that_are_not_parameters_and_small_batches():
    w = [nn.Parameter(torch.randn(16, 32)) for _ in range(3)]
    gm, inputs = hand_built([w[0], w[1].detach(), w[2]])    # a plain tensor input
    result = fuse_sibling_linears(gm, inputs)
    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 2, {"weight_not_parameter": 1})
    gm, inputs = hand_built(w, rows=8)          # (3 - 1) * 8 rows < N_total = 48
    result = fuse_sibling_linears(gm, inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"not_worth_it": 3})


class RepeatedCalls(nn.Module):
    """One Linear applied to the same input three times (DeepCTR's per-field bilinear
    layer), a sibling beside it, and the same Linear on another input."""

    def __init__(self):
        super().__init__()
        self.field = nn.Linear(32, 32)
        self.other = nn.Linear(32, 32)

    def forward(self, x, y):
        return self.field(x) * x, self.field(x) + self.other(x), torch.relu(self.field(x)), self.field(y)


def test_repeated_calls_of_one_linear_are_computed_once():
    model, x, y = RepeatedCalls(), torch.randn(64, 32), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x, y)
    assert len(linear_nodes(gm)) == 5
    result = fuse_sibling_linears(gm, example_inputs)
    # the two repeats read the first call; the first call and its sibling fuse; y's call stays
    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 2, {"repeated_call": 2, "single_linear": 1})
    assert len(linear_nodes(gm)) == 2
    (fused,) = [n for n in linear_nodes(gm) if n.args[1].op == "call_function"]
    assert list(fused.meta["nn_module_stack"].values())[-1][0] == "{field,other}"
    with torch.no_grad():
        for got, expected in zip(gm(*example_inputs), model(x, y)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class SiblingsAcrossStates(nn.Module):
    """Linears of one input, some under `with torch.no_grad()` or `torch.autocast(...)`: a sibling
    and a repeat of the first linear there (the fuzz, tests/fuzz_forms.py, found them fused across:
    x's gradient doubled, b's weight given a gradient eager does not have, b's output in fp32)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        y = self.a(x)
        region = torch.no_grad() if self.state == "no_grad" else torch.autocast("cpu", dtype=torch.bfloat16)
        with region:
            t, again = self.b(x), self.a(x)
        return y * t.float(), t, again


@pytest.mark.parametrize("state", ["no_grad", "autocast"])
def test_linears_under_another_grad_mode_or_autocast_stay_apart(state):
    x = torch.randn(64, 32, requires_grad=True)
    result, pairs = rewritten_against_eager(SiblingsAcrossStates(state), x, fuse_sibling_linears)
    # the two linears inside the region fuse with each other (a repeat there is a sibling: its own
    # weight's call is outside), never with the one outside
    assert (result.rewritten, dict(result.declined)) == (1, {"other_state_region": 1}), result.declined
    # the fused pair in the autocast region sums its bf16 GEMM in another order: a bf16 ulp (2^-8)
    floor = 1e-5 if state == "no_grad" else 1e-2
    for name, got, expected in pairs:
        assert (got is None) == (expected is None), name
        if expected is not None:
            assert got.dtype == expected.dtype, name
            assert rel_error(expected.float(), got.float()) <= floor, (name, rel_error(expected.float(), got.float()))


def test_only_repeats_leave_the_linear_unfused_and_named():
    """A Linear whose only siblings are its own repeats: nothing is fused, its one call
    keeps its module path."""
    class TwiceApplied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(32, 32, bias=False)

        def forward(self, x):
            return self.inner(x) * self.inner(x)

    gm, example_inputs = dynamo_graph(TwiceApplied(), torch.randn(64, 32))
    result = fuse_sibling_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"repeated_call": 1, "single_linear": 1})
    (only,) = linear_nodes(gm)
    assert list(only.meta["nn_module_stack"].values())[-1][0].endswith("inner")


class RepeatWrittenInPlace(nn.Module):
    """One Linear applied to x twice, the first output then modified in place: the two
    calls' outputs are different tensors."""

    def __init__(self):
        super().__init__()
        self.field = nn.Linear(32, 32)

    def forward(self, x):
        first = self.field(x)
        first.view(-1).mul_(2)
        return first + self.field(x)


class RepeatReturned(nn.Module):
    """One Linear applied to x twice, both outputs returned: the caller may write either."""

    def __init__(self):
        super().__init__()
        self.field = nn.Linear(32, 32)

    def forward(self, x):
        return self.field(x), self.field(x).relu()


@pytest.mark.parametrize("model", [RepeatWrittenInPlace, RepeatReturned])
def test_a_repeat_whose_output_may_be_written_is_not_merged(model):
    model, x = model(), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x)
    result = fuse_sibling_linears(gm, example_inputs)
    assert (result.rewritten, dict(result.declined)) == (0, {"repeated_call": 1, "single_linear": 1})
    assert len(linear_nodes(gm)) == 2
    with torch.no_grad():
        expected = model(x)
        for got, want in zip(gm(*example_inputs), expected if isinstance(expected, tuple) else (expected,)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class Dependent(nn.Module):
    """b's weight is computed from a's output: a and b cannot be one GEMM; a and c can."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 16)

    def forward(self, x):
        y = self.a(x)
        w = self.b.weight * y.mean()
        return y, F.linear(x, w, self.b.bias), self.c(x)


def test_declines_a_sibling_whose_weight_depends_on_another():
    model, x = Dependent(), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x)
    result = fuse_sibling_linears(gm, example_inputs)
    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 2, {"depends_on_sibling": 1})
    assert result.modules == ["{a,c}"]
    fused = [n for n in linear_nodes(gm) if n.args[1].target is torch.cat]
    assert len(fused) == 1 and len(linear_nodes(gm)) == 2
    with torch.no_grad():
        for got, expected in zip(gm(*example_inputs), model(x)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_declines_excluded_modules():
    model, x = Siblings(), torch.randn(64, 32)
    gm, example_inputs = dynamo_graph(model, x)
    result = fuse_sibling_linears(gm, example_inputs, exclude_modules=("b",))
    assert (result.rewritten, result.linears, dict(result.declined)) == (1, 2, {"excluded_module": 1})
    assert result.modules == ["{a,c}"]


def test_mod_is_on_by_default_and_can_be_disabled():
    assert "horizontal" in MODS
    assert loka_compile.LokaConfig(disabled_mods=["horizontal"]).disabled_mods == ("horizontal",)


# ------------------------------------------------------------------ compiled, end to end

# Fused against unfused loka (default recipe, emulated FP8, fp32) on the zoo's tiny MaskNet,
# batch 64, first step, CPU, model seeds 0-2: logits bit-equal (rel. error 0: the rowwise
# scales of the shared input and of each weight row do not change); every parameter's
# gradient within 2.6e-2 relative, SQNR >= 31.8 dB (the fused dgrad scales the incoming
# gradient per row across both blocks' gradients). Against eager fp32 the fused gradients'
# error is at most 1.02x the unfused ones' (FP8's own error). Floors with margin:
FORWARD_REL_ERROR_FLOOR = 1e-6
GRAD_REL_ERROR_FLOOR = 5e-2
GRAD_SQNR_FLOOR_DB = 25.0
FP32_ERROR_RATIO_FLOOR = 1.25
STEPS = 3
# Inference, Siblings fused and cached, emulated e4m3 rowwise vs eager fp32, seeds 0-2: 29.3-30.0 dB.
OUTPUT_SQNR_FLOOR_DB = 20.0


@pytest.fixture(scope="module")
def masknet_runs():
    """Tiny MaskNet's dense arch compiled with loka, the Mod on ("fused") and off
    ("unfused"), trained STEPS steps from one start; and one eager step ("eager")."""
    from benchmarks.zoo import SyntheticRecsysData, build_model

    start, spec = build_model("masknet", "tiny")
    data = SyntheticRecsysData(spec, seed=0)
    batches = [data.batch(i, 64) for i in range(STEPS)]
    runs = {}
    no_probe = {"probe_steps": 0}
    for name, options in (("fused", no_probe), ("unfused", {**no_probe, "disabled_mods": ["horizontal"]}),
                          ("eager", None)):
        torch._dynamo.reset()
        loka_compile.reset()
        model = copy.deepcopy(start)
        dense = model.dense if options is None else torch.compile(model.dense, backend="loka", options=options)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        run = {"losses": []}
        for step, batch in enumerate(batches[:1] if options is None else batches):
            logits = dense(*model.sparse(*batch.model_inputs()))
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            if step == 0:
                run["logits"] = logits.detach()
                run["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run["losses"].append(loss.item())
        run["moved"] = [n for n, p in model.dense.named_parameters()
                        if not torch.equal(p, dict(start.dense.named_parameters())[n])]
        if options is not None:
            run["report"], run["records"] = loka_compile.report(dense), list(loka_compile.state_of(dense).records)
        runs[name] = run
    torch._dynamo.reset()
    loka_compile.reset()
    return runs


def test_fused_numerics_match_unfused(masknet_runs):
    fused, unfused, eager = masknet_runs["fused"], masknet_runs["unfused"], masknet_runs["eager"]
    assert rel_error(unfused["logits"], fused["logits"]) <= FORWARD_REL_ERROR_FLOOR
    assert fused["grads"].keys() == unfused["grads"].keys()
    for name, grad in unfused["grads"].items():
        assert rel_error(grad, fused["grads"][name]) <= GRAD_REL_ERROR_FLOOR, name
        assert sqnr_db(grad, fused["grads"][name]) >= GRAD_SQNR_FLOOR_DB, name
        # No worse against fp32 than the unfused path (FP8's own error), with margin.
        reference = eager["grads"][name]
        assert rel_error(reference, fused["grads"][name]) <= FP32_ERROR_RATIO_FLOOR * rel_error(reference, grad) + 1e-3, name


def _sites(report, module_part, role):
    return [s for s in report.sites if module_part in s.module and s.role == role]


def test_sites_of_the_fused_gemm(masknet_runs):
    fused, unfused = masknet_runs["fused"]["report"], masknet_runs["unfused"]["report"]
    # Tiny MaskNet: 2 blocks, each mask.0 = Linear(432 -> 32) on the same embeddings.
    assert [s.module for s in _sites(unfused, "mask.0", "fwd")] == ["blocks.0.mask.0", "blocks.1.mask.0"]
    (site,) = _sites(fused, "mask.0", "fwd")
    assert site.module == "blocks.{0,1}.mask.0" and site.name == "blocks.{0,1}.mask.0:fwd"
    assert site.shape == (64, 432, 64) and site.fp8
    # The shared input is cast once, not once per block.
    assert [s.casts["a"] for s in _sites(unfused, "mask.0", "fwd")] == [site.casts["a"]] * 2
    assert len(fused.sites) == len(unfused.sites) - 3     # one fwd, one dgrad, one wgrad fewer
    assert fused.mods["horizontal"] == 1 and fused.mods["horizontal_linears"] == 2
    assert unfused.mods["horizontal"] == 0 and unfused.mods["horizontal_linears"] == 0
    assert "horizontal 1" in fused.summary() and "blocks.{0,1}.mask.0:fwd" in fused.table()
    (record,) = masknet_runs["fused"]["records"]
    assert record.mod_results["horizontal"].declined == {"single_linear": 7}
    assert "horizontal" not in masknet_runs["unfused"]["records"][0].mod_results


def test_fused_weight_gradient_is_wgrad(masknet_runs):
    fused, unfused = masknet_runs["fused"]["report"], masknet_runs["unfused"]["report"]
    assert len(_sites(unfused, "mask.0", "wgrad")) == 2
    (wgrad,) = _sites(fused, "mask.0", "wgrad")
    assert wgrad.module == "blocks.{0,1}.mask.0" and wgrad.shape == (64, 64, 432)
    assert not wgrad.fp8 and wgrad.reason == "recipe_high_precision"
    assert sum(s.role == "wgrad" for s in fused.sites) == sum(s.role == "wgrad" for s in unfused.sites) - 1


def test_tiny_masknet_trains_with_the_mod(masknet_runs):
    from benchmarks.zoo import build_model

    fused = masknet_runs["fused"]
    assert len(fused["losses"]) == STEPS and all(torch.isfinite(torch.tensor(fused["losses"])))
    dense_names = [n for n, _ in build_model("masknet", "tiny")[0].dense.named_parameters()]
    assert sorted(fused["moved"]) == sorted(dense_names)     # every weight trains, both fused ones too
    # Same data, same start: the losses follow the unfused run's closely.
    for got, expected in zip(fused["losses"], masknet_runs["unfused"]["losses"]):
        assert abs(got - expected) <= 1e-2 * abs(expected)


def test_inference_graphs_cache_the_concatenated_weight(fresh_compile_state):
    """In an inference graph the fused GEMM's B is cat([W_a, W_b, W_c]): the cached_weights
    Mod keeps its FP8 copy, made from the three weights, and makes it again when any of
    them changes."""
    from loka_compile.passes.lower import CACHED_WEIGHT

    model, x = Siblings().eval(), torch.randn(64, 32)
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 0})
    with torch.no_grad():
        out = compiled(x)
        for got, expected in zip(out, model(x)):
            assert sqnr_db(expected, got) > OUTPUT_SQNR_FLOOR_DB
        (record,) = loka_compile.state_of(compiled).records
        fusion = record.mod_results["horizontal"]
        assert fusion.rewritten == 1 and fusion.linears == 3
        report = loka_compile.report(compiled)
        (site,) = report.sites
        assert site.fp8 and site.casts["b"] == CACHED_WEIGHT
        (cached,) = report.cached_weights
        assert len(cached.input_indices) == 3 and cached.refreshes == 1
        model.b.weight.mul_(-2.0)  # the middle sibling only
        out = compiled(x)
        assert cached.refreshes == 2
        for got, expected in zip(out, model(x)):
            assert sqnr_db(expected, got) > OUTPUT_SQNR_FLOOR_DB
        compiled(x)
        assert cached.refreshes == 2


class MultiTaskRanker(nn.Module):
    """Sparse features pooled by EmbeddingBags, a shared bottom, and three task towers
    (click, like, share) whose first layers read the shared output: the siblings."""

    def __init__(self, tables=3, rows=50, dim=16, hidden=64):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(tables * dim, hidden), nn.LayerNorm(hidden), nn.ReLU())
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 32), nn.ReLU(), nn.Linear(32, 1))
                                    for _ in range(3))

    def forward(self, ids, offsets):
        pooled = torch.cat([bag(ids[i], offsets[i]) for i, bag in enumerate(self.bags)], 1)
        shared = self.bottom(pooled)
        return torch.cat([tower(shared) for tower in self.towers], 1)


def test_served_multitask_towers_fuse_follow_dynamic_batches_and_a_new_state_dict(fresh_compile_state):
    """Served the way ranking code is (eval, no_grad, dynamic batch): the towers' first
    layers fuse and their concatenated weight is cached in FP8; a checkpoint loaded later
    is served, not the stale copy."""
    from loka_compile.passes.lower import CACHED_WEIGHT

    def batch(b, rows=50, per_bag=3):
        ids = [torch.randint(0, rows, (b * per_bag,)) for _ in range(3)]
        return ids, [torch.arange(0, b * per_bag, per_bag) for _ in range(3)]

    model = MultiTaskRanker().eval()
    compiled = torch.compile(model, backend="loka", dynamic=True, options={"probe_steps": 0})
    with torch.no_grad():
        for b in (64, 96, 160):
            ids, offsets = batch(b)
            assert sqnr_db(model(ids, offsets), compiled(ids, offsets)) > OUTPUT_SQNR_FLOOR_DB
        report = loka_compile.report(compiled)
        assert report.mods["horizontal"] == 1 and report.mods["horizontal_linears"] == 3
        fused = [w for w in report.cached_weights if len(w.input_indices) == 3]
        assert len(fused) == 1 and fused[0].refreshes == 1
        assert any(s.casts.get("b") == CACHED_WEIGHT and "towers" in s.module for s in report.sites)
        trained = MultiTaskRanker()
        model.load_state_dict(trained.state_dict())
        ids, offsets = batch(96)
        assert sqnr_db(trained.eval()(ids, offsets), compiled(ids, offsets)) > OUTPUT_SQNR_FLOOR_DB
        assert fused[0].refreshes == 2


def test_weight_source_follows_concatenations_of_weights_only():
    from loka_compile.passes.find_sites import weight_source

    graph = torch.fx.Graph()
    w0, w1, x = graph.placeholder("w0"), graph.placeholder("w1"), graph.placeholder("x")
    aten = torch.ops.aten
    both = graph.call_function(aten.t.default, (graph.call_function(aten.cat.default, ([w0, w1], 0)),))
    mixed = graph.call_function(aten.cat.default, ([w0, x], 0))
    graph.output((both, mixed))
    weights = {w0: 0, w1: 1}
    source = weight_source(both, weights)
    assert source.indices == (0, 1) and [n.target for n in source.nodes] == [aten.cat.default, aten.t.default]
    assert weight_source(mixed, weights) is None  # x is not a weight
