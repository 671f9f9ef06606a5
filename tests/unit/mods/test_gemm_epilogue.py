"""The `gemm_epilogue` Mod: a GEMM whose output reaches the next FP8 GEMM's A (static
scale) through an activation and a residual add writes that FP8 operand from its epilogue.

Hand-built inference graphs (positive and negative), the fused path's numerics against the
unfused path's, and calibrated end-to-end compiles written as recsys code is (an
EmbeddingBag feeding an MLP tower, a 3-D interaction input, `dynamic=True`).
"""

import dataclasses
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loka_compile
from graphs import (OUTPUT_SQNR_DB, assert_no_loss, calibrated_plan, compile_with, inference_graph,
                    run_lowering, with_and_without)
from loka_compile import LokaConfig, dispatch
from loka_compile.passes import PIPELINE, GraphKind, PassContext, Phase
from loka_compile.passes.mods.gemm_epilogue import EPILOGUE_CAST
from numerics import sqnr_db

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

TRITON_GEMM = torch.ops.loka.triton_fp8_gemm.default
def fused_gemms(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TRITON_GEMM]


def mlp(x, w1, b1, w2, b2, w3, activation=torch.relu):
    h = activation(F.linear(x, w1, b1))
    return F.linear(F.linear(h, w2, b2), w3)


def weights(k=64, n=64, dtype=torch.bfloat16, layers=3):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(layers):
        out.append((torch.randn(n, k, generator=g) * k ** -0.5).to(dtype))
        if i < layers - 1:
            out.append((torch.randn(n, generator=g) * 0.1).to(dtype))
    return out


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu", "gelu_tanh", "hardswish"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_activation_then_next_gemm_is_one_fused_gemm(activation, dtype):
    act = {"relu": torch.relu, "silu": F.silu, "gelu": F.gelu, "hardswish": F.hardswish,
           "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}[activation]
    fn = functools.partial(mlp, activation=act)
    x = torch.randn(32, 64, dtype=dtype)
    gm = inference_graph(fn, x, *weights(dtype=dtype))
    ctx = run_lowering(gm)
    fused = fused_gemms(gm)
    # fc1 -> act -> fc2 and fc2 -> fc3: two producers, each writing the next A in FP8
    assert [(n.args[7], n.args[8]) for n in fused] == [(activation, torch.float8_e4m3fn),
                                                       ("none", torch.float8_e4m3fn)]
    assert ctx.casts["inference/<root>:fwd#2"]["a"] == \
        f"{EPILOGUE_CAST} <root>:fwd's GEMM ({activation})"
    assert ctx.casts["inference/<root>:fwd#3"]["a"].startswith(EPILOGUE_CAST)
    assert ctx.decisions["inference/<root>:fwd#1"].provider == "triton"
    # no bf16 activation is left between the GEMMs: every pointwise op of the activation is gone
    assert not any(n.target in (torch.ops.aten.relu.default, torch.ops.aten.exp.default, torch.ops.aten.erf.default,
                                torch.ops.aten.tanh.default) for n in gm.graph.nodes if n.op == "call_function")


def test_residual_add_joins_the_epilogue():
    def block(x, w1, b1, w2, b2, w3):
        h = F.silu(F.linear(x, w1, b1)) + x
        return F.linear(F.linear(h, w2, b2), w3)

    gm = inference_graph(block, torch.randn(4, 8, 64, dtype=torch.bfloat16), *weights())  # 3-D input: views
    run_lowering(gm)
    first = fused_gemms(gm)[0]
    residual = first.args[6]
    assert first.args[7] == "silu" and residual is not None and residual.meta["val"].shape[-1] == 64


@pytest.mark.parametrize("case", ["output_also_returned", "activation_read_twice", "no_static_scale",
                                  "mod_disabled", "consumer_reads_it_as_b", "broadcast_add", "triton_not_allowed"])
def test_declines(case):
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    w1, b1, w2, b2, w3 = weights()
    static_sites, disabled, allowed = None, (), ()
    if case == "output_also_returned":
        def fn(x, w1, b1, w2):
            y = F.linear(x, w1, b1)
            return F.linear(torch.relu(y), w2), y
        args = (x, w1, b1, w2)
    elif case == "activation_read_twice":
        def fn(x, w1, b1, w2):
            h = torch.relu(F.linear(x, w1, b1))
            return F.linear(h, w2) + h
        args = (x, w1, b1, w2)
    elif case == "no_static_scale":  # the consumer's cast needs its row's amax first
        fn, args, static_sites = mlp, (x, w1, b1, w2, b2, w3), [1]
    elif case == "mod_disabled":
        fn, args, disabled = mlp, (x, w1, b1, w2, b2, w3), ("gemm_epilogue",)
    elif case == "triton_not_allowed":  # as an AOTInductor export configures it: ATen providers only
        fn, args, allowed = mlp, (x, w1, b1, w2, b2, w3), ("emulated",)
    elif case == "consumer_reads_it_as_b":
        def fn(x, w1, b1, w2):
            h = torch.relu(F.linear(x, w1, b1))  # [32, 64]
            return x.t() @ h  # h is B of the next GEMM
        args = (x, w1, b1, w2)
    else:
        def fn(x, w1, b1, w2, b2):
            h = torch.relu(F.linear(x, w1, b1)) + b2  # a [64] addend broadcast over rows
            return F.linear(h, w2)
        args = (x, w1, b1, w2, b2)
    gm = inference_graph(fn, *args)
    ctx = run_lowering(gm, static_sites=static_sites, disabled=disabled, providers=allowed)
    assert not fused_gemms(gm)
    assert not any(ctx.casts.get(s.id, {}).get("a", "").startswith(EPILOGUE_CAST) for s in ctx.sites)


def dispatched_mlp() -> PassContext:
    """The context of the 3-linear MLP's inference graph after find_sites and dispatch_sites,
    every A with a static scale: what plan_chains reads."""
    gm = inference_graph(mlp, torch.randn(32, 64, dtype=torch.bfloat16), *weights())
    config = LokaConfig(recipe="rowwise")
    ctx = PassContext(graph="t", kind=GraphKind.INFERENCE, phase=Phase.FP8, param_input_indices=frozenset(),
                      decide=functools.partial(dispatch.decide, config=config, phase=Phase.FP8, unsafe_sites={}),
                      inactive_mods=config.inactive_mods, providers=config.providers,
                      static_a_scales={f"inference/<root>:fwd#{i}": {"scale": 0.01, "policy": "amax"}
                                       for i in (1, 2, 3)})
    for _, run in PIPELINE[:2]:  # find_sites, dispatch_sites
        run(gm.graph, ctx)
    return ctx


def test_a_link_whose_timing_fails_is_left_unfused(caplog):
    """The speed check's timing of a fused GEMM raising (a kernel that cannot build at this
    shape on this GPU) declines that link, with a warning; the graph lowers as usual."""
    from loka_compile.passes.mods import gemm_epilogue

    ctx = dispatched_mlp()

    def failing(chain):
        raise RuntimeError("out of resources: shared memory\nmore detail")

    assert len(gemm_epilogue.plan_chains(ctx)) == 2  # untimed: fc1 -> fc2 and fc2 -> fc3 fuse
    with caplog.at_level("WARNING", logger="loka"):
        assert gemm_epilogue.plan_chains(ctx, failing) == []
    assert "timing the fused GEMM failed (RuntimeError: out of resources: shared memory); not fused" in caplog.text


@pytest.mark.parametrize("scale,fused_total,upgraded", [(10.0, 200.0, True), (10.0, 240.0, False),
                                                        (1.0, 20.0, False)])
def test_a_site_slower_alone_goes_fp8_where_its_chain_pays(scale, fused_total, upgraded):
    """fc2, kept in high precision because its FP8 GEMM was slower alone (12 vs 10 units),
    is taken into fc1's fused chain where the chain beats the sites as decided: fc1 FP8 (8)
    + the pointwise kernel (5) + fc2 bf16 (10) = 23 units, against the fused GEMM + fc1's
    casts (1) + fc2's GEMM (11: its FP8 time less its A cast, which the epilogue writes).
    `fused_total` is the fused GEMM + 13 units, so the fused chain costs it less 1. A unit is
    `scale` us: at 1 us the chain (23 us) is under MIN_CHAIN_US and is left as decided
    however it compares."""
    from loka_compile.passes.mods import gemm_epilogue
    from loka_compile.passes.context import Candidate, Reason
    from loka_compile.speed import EpilogueTiming

    ctx = dispatched_mlp()
    fc1, fc2, fc3 = ctx.sites
    for site, (fp8, bf16_us, fp8_us) in ((fc1, (True, 10.0, 8.0)), (fc2, (False, 10.0, 12.0)),
                                         (fc3, (False, 10.0, 30.0))):
        decision = ctx.decisions[site.id]
        ctx.decisions[site.id] = dataclasses.replace(
            decision, fp8=fp8, reason=Reason.FP8 if fp8 else Reason.SLOWER_THAN_BF16, bf16_us=bf16_us * scale,
            fp8_us=fp8_us * scale, candidates=(Candidate(decision.provider, (fp8_us - 1.0) * scale, fp8),))

    def timing(chain):  # fc2 -> fc3 never pays (fc3 alone is 3x slower in FP8)
        if chain.producer is fc1:
            return EpilogueTiming(fused_us=fused_total - 13.0 * scale, unfused_us=13.0 * scale,
                                  pointwise_us=5.0 * scale)
        return EpilogueTiming(fused_us=40.0 * scale, unfused_us=10.0 * scale, pointwise_us=5.0 * scale)

    chains = gemm_epilogue.plan_chains(ctx, timing)
    assert [(c.producer, [p.consumer for p in c.pieces]) for c in chains] == ([(fc1, [fc2])] if upgraded else [])
    assert ctx.decisions[fc2.id].fp8 is upgraded and not ctx.decisions[fc3.id].fp8
    # the Mod's change is an amendment of fc2's decision, by the Mod, with why; nothing else changed
    assert [(a.site_id, a.by) for a in ctx.amendments] == ([(fc2.id, "gemm_epilogue")] if upgraded else [])
    if upgraded:
        assert ctx.decisions[fc2.id].detail.startswith(
            "FP8 in the fused chain <root>:fwd -> <root>:fwd#2: 190.0 us vs 230.0 us")
        (amendment,) = ctx.amendments
        assert ("fp8", False, True) in amendment.changes and ("reason", "slower_than_bf16", "fp8") in amendment.changes
        assert amendment.why.startswith("FP8 in the fused chain")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fused_numerics_match_the_unfused_path(recipe):
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    args = (x, *weights())
    fused, unfused = inference_graph(mlp, *args), inference_graph(mlp, *args)
    # calibrated: each GEMM's A range over this batch
    x, w1, b1, w2, b2, _ = args
    h = torch.relu(F.linear(x, w1, b1))
    scales = [float(a.abs().max()) / 448.0 for a in (x, h, F.linear(h, w2, b2))]
    run_lowering(fused, scale=scales, recipe=recipe)
    run_lowering(unfused, scale=scales, disabled=("gemm_epilogue",), recipe=recipe)
    assert [n.args[4] for n in fused_gemms(fused)] == [recipe, recipe] and not fused_gemms(unfused)
    # the consumers' scales are constants of the graph module, not fills in the graph
    assert sum(n.op == "get_attr" and "_loka_epilogue" in n.target for n in fused.graph.nodes) == 4
    exact = mlp(*(t.double() for t in args))
    out, ref = fused(*args), unfused(*args)
    out, ref = (t[0] if isinstance(t, (tuple, list)) else t for t in (out, ref))
    assert_no_loss(exact, out, ref)


def split_blocks(x, w1, b1, w2, w3, w4, activations=("relu", "relu", "relu")):
    """One wide GEMM split into three pieces, each through an activation into its own GEMM
    (MaskNet's mask layers after the horizontal Mod fused their first linears)."""
    acts = {"relu": torch.relu, "silu": F.silu}
    pieces = torch.split(F.linear(x, w1, b1), [32, 64, 32], dim=-1)
    return sum(F.linear(acts[a](p), w) for a, p, w in zip(activations, pieces, (w2, w3, w4)))


def split_weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    w1, b1 = torch.randn(128, 64, generator=g) * 0.125, torch.randn(128, generator=g) * 0.1
    w2, w3, w4 = (torch.randn(16, k, generator=g) * k ** -0.5 for k in (32, 64, 32))
    return [t.to(dtype) for t in (w1, b1, w2, w3, w4)]


def test_split_pieces_each_feed_their_gemm_with_their_own_scale():
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    args = (x, *split_weights())
    fused, unfused = inference_graph(split_blocks, *args), inference_graph(split_blocks, *args)
    # calibrated: each consumer's A range (the pieces differ), the producer's input
    x_, w1, b1, *_ = args
    pieces = torch.split(torch.relu(F.linear(x_, w1, b1)), [32, 64, 32], dim=-1)
    scales = [float(x_.abs().max()) / 448.0, *(float(p.abs().max()) / 448.0 for p in pieces)]
    ctx = run_lowering(fused, scale=scales)
    run_lowering(unfused, scale=scales, disabled=("gemm_epilogue",))
    (gemm,) = fused_gemms(fused)
    out_scale = getattr(fused, gemm.args[11].target)
    assert gemm.args[7] == "relu" and out_scale.shape == (128,)
    assert torch.equal(out_scale, torch.cat([torch.full((w,), s) for w, s in zip((32, 64, 32), scales[1:])]))
    fed = [s for s in ctx.sites if ctx.casts[s.id]["a"].startswith(EPILOGUE_CAST)]
    assert len(fed) == 3 and not any(n.target in (torch.ops.aten.split_with_sizes.default, torch.ops.aten.relu.default)
                                     for n in fused.graph.nodes if n.op == "call_function")
    exact = split_blocks(*(t.double() for t in args))
    out, ref = (t[0] if isinstance(t, (tuple, list)) else t for t in (fused(*args), unfused(*args)))
    assert_no_loss(exact, out, ref)


@pytest.mark.parametrize("case", ["different_activations", "piece_also_returned"])
def test_split_declines(case):
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    if case == "different_activations":
        fn = functools.partial(split_blocks, activations=("relu", "silu", "relu"))
    else:
        def fn(x, w1, b1, w2, w3, w4):
            a, b, c = torch.split(F.linear(x, w1, b1), [32, 64, 32], dim=-1)
            return F.linear(torch.relu(a), w2) + F.linear(torch.relu(b), w3) + F.linear(torch.relu(c), w4), c
    gm = inference_graph(fn, x, *split_weights())
    ctx = run_lowering(gm)
    assert not fused_gemms(gm)
    assert not any(ctx.casts.get(s.id, {}).get("a", "").startswith(EPILOGUE_CAST) for s in ctx.sites)


def test_epilogue_timing_times_both_forms_once_per_shape(cache_dir, monkeypatch):
    """The speed check's comparison runs anywhere (wall time on CPU), once per shape: the
    process cache, then the performance database (a later process reuses it), which lists
    it; the pass only asks for it on FP8 GPUs (`time_chain`)."""
    from loka_compile import perfdb, speed

    measured = []
    measure = speed._measure_epilogue
    monkeypatch.setattr(speed, "_measure_epilogue", lambda *a: measured.append(a) or measure(*a))
    monkeypatch.setattr(perfdb, "_default", None)
    speed.clear_cache()
    shape = speed.SiteShape(64, 64, 32, "row", "column", True, torch.bfloat16, torch.device("cpu"))
    args = ("rowwise", "e4m3", "e4m3", "emulated", False, "relu", True, "e4m3")
    timing = speed.epilogue_timing(shape, *args)
    assert timing.fused_us > 0 and timing.unfused_us > 0 and timing.pays == (timing.fused_us < timing.unfused_us)
    assert speed.epilogue_timing(shape, *args) is timing
    speed.clear_cache()
    monkeypatch.setattr(perfdb, "_default", None)  # a fresh process: read from disk
    assert speed.epilogue_timing(shape, *args) == timing and len(measured) == 1
    speed.epilogue_timing(shape, *args[:5], "silu", *args[6:])  # another epilogue is timed
    assert len(measured) == 2
    (entry, _) = sorted(perfdb.default_db().entries(), key=lambda e: e["key"]["activation"])
    assert entry["key"]["kind"] == "epilogue" and entry["key"]["residual"] and entry["key"]["providers"] == ["emulated"]
    listed = perfdb._table(perfdb.default_db().entries())
    assert "gemm_epilogue links:" in listed and "relu + residual" in listed and "silu + residual" in listed
    speed.clear_cache()


# ---------------------------------------------------------------------------------------
# end to end: calibrate, then compile with the plan
# ---------------------------------------------------------------------------------------

class SparseTower(nn.Module):
    """Sparse features pooled by an EmbeddingBag, concatenated with dense ones, through an
    MLP tower shared by two heads, as recsys models are written."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 32, mode="sum")
        self.dense = nn.Linear(32, 32)
        self.tower = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.SiLU(), nn.Linear(64, 64))
        self.click, self.like = nn.Linear(64, 16), nn.Linear(64, 16)

    def forward(self, ids, offsets, dense):
        x = torch.cat([self.bag(ids, offsets), torch.relu(self.dense(dense))], dim=-1)
        h = self.tower(x)
        return self.click(h), self.like(h)


def sparse_batch(rows=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (rows,), generator=g)
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets, torch.randn(rows, 32, generator=g)


def test_sparse_tower_end_to_end(tmp_path):
    torch.manual_seed(0)
    model = SparseTower().eval()
    path = calibrated_plan(model, [sparse_batch(seed=s) for s in range(3)], tmp_path)
    batch = sparse_batch(seed=7)
    with torch.no_grad():
        exact = [t.double() for t in model(*batch)]
        compiled = compile_with(model, path)
        fused = compiled(*batch)
        report = loka_compile.report(compiled)
        torch._dynamo.reset()
        loka_compile.reset()
        unfused = compile_with(model, path, disabled=("gemm_epilogue",))(*batch)
    # dense -> relu -> cat is not a chain (the cat reads it); tower.0 -> relu -> tower.2 -> silu
    # -> tower.4 -> the two heads (one GEMM, the horizontal Mod's) is
    fed = {s.module: s.casts["a"] for s in report.sites if s.casts.get("a", "").startswith(EPILOGUE_CAST)}
    assert sorted(fed) == ["tower.2", "tower.4", "{click,like}"]
    assert fed["tower.4"] == f"{EPILOGUE_CAST} tower.2:fwd's GEMM (silu)"
    assert report.mods["gemm_epilogue"] == 3 and "gemm_epilogue 3" in str(report)
    for got, ref, want in zip(fused, unfused, exact):
        assert_no_loss(want, got, ref)


class MaskBlocks(nn.Module):
    """MaskNet's mask layers: each block's Linear-ReLU-Linear on the same embeddings, whose
    first linears the horizontal Mod fuses into one GEMM split by block."""

    def __init__(self, width=64, hidden=(32, 64, 48)):
        super().__init__()
        self.masks = nn.ModuleList(nn.Sequential(nn.Linear(width, h), nn.ReLU(), nn.Linear(h, width)) for h in hidden)

    def forward(self, emb):
        return torch.cat([mask(emb) * emb for mask in self.masks], dim=-1)


def test_horizontally_fused_siblings_feed_each_block_from_one_epilogue(tmp_path):
    torch.manual_seed(0)
    model = MaskBlocks().to(torch.bfloat16).eval()
    # 256 rows: enough for the horizontal Mod to fuse the siblings (its not_worth_it rule)
    path = calibrated_plan(model, [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(3)], tmp_path)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    exact, fused, report, unfused, _ = with_and_without(model, path, x, "gemm_epilogue")
    fed = sorted(s.module for s in report.sites if s.casts.get("a", "").startswith(EPILOGUE_CAST))
    assert fed == ["masks.0.2", "masks.1.2", "masks.2.2"]
    (producer,) = [s for s in report.sites if "gemm_epilogue writes" in s.detail]
    assert producer.module == "masks.{0,1,2}.0" and producer.provider == "triton"
    assert_no_loss(exact, fused, unfused)


def test_dynamic_batch_recompile_free(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Hardswish(), nn.Linear(64, 16))
    model = model.to(torch.bfloat16).eval()
    batches = [torch.randn(48, 64, dtype=torch.bfloat16) for _ in range(3)]
    path = calibrated_plan(model, batches, tmp_path)
    compiled = compile_with(model, path, dynamic=True)
    with torch.no_grad():
        for rows in (48, 80, 17):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            out = compiled(x)
            assert out.shape == (rows, 16) and not torch.isnan(out).any()
            assert sqnr_db(model(x).double(), out.double()) >= OUTPUT_SQNR_DB
    assert loka_compile.report(compiled).mods["gemm_epilogue"] == 2


@pytest.mark.cuda
@pytest.mark.parametrize("speed_check", [False, True], ids=["forced", "speed-checked"])
def test_cuda_tower_writes_fp8_operands_from_gemm_epilogues(tmp_path, speed_check):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.SiLU(), nn.Linear(1024, 256))
    model = model.to("cuda", torch.bfloat16).eval()
    path = calibrated_plan(model, [torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)],
                           tmp_path)
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    # the whole-graph speed check off: it compiles a second variant, and this test reads the FP8 one's code
    exact, fused, report, unfused, ((fused_code,), (unfused_code,)) = with_and_without(
        model, path, x, "gemm_epilogue", {"speed_check": speed_check, "graph_speed_check": "off"})
    fed = [s for s in report.sites if s.casts.get("a", "").startswith(EPILOGUE_CAST)]
    producers = [s for s in report.sites if "gemm_epilogue writes" in s.detail]
    assert len(producers) == len(fed) == report.mods["gemm_epilogue"]
    if speed_check:
        # fused only where measured faster, and the producer's detail says by how much
        for site in producers:
            fused_us, unfused_us = map(float, re.search(r"([\d.]+) us vs ([\d.]+) us", site.detail).groups())
            assert fused_us < unfused_us
    else:
        assert [s.module for s in fed] == ["2", "4"] and report.mods["gemm_epilogue"] == 2
        assert [s.provider for s in report.sites] == ["triton", "triton", report.sites[2].provider]
    # the relu and silu kernels that cast the next A are gone: one kernel fewer per fused link
    kernels = [re.findall(r"^def (triton_\w+)\(", code, re.M) for code in (fused_code, unfused_code)]
    assert len(kernels[1]) - len(kernels[0]) == len(fed), kernels
    assert fused_code.count("loka.triton_fp8_gemm") >= len(fed)
    assert_no_loss(exact, fused, unfused)
