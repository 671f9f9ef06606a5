"""Inductor's FX graph cache with loka graphs (`loka_compile/graph_cache.py`): a second
process hits it and reports alike; another plan misses; graphs with cached FP8 weights
bypass it; a hit that cannot be checked, or whose graph loka would now make otherwise,
is compiled again."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import loka_compile
from loka_compile import graph_cache, inductor_passes
from loka_compile.passes import Reason
from numerics import rel_error

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# A probe window of one call: the probe variant, then the FP8 variant, each forward and backward.
OPTIONS = {"probe_steps": 1, "max_output_error": None}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.norm = torch.nn.LayerNorm(128)
        self.fc2 = torch.nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def describe_run(options, device="cpu") -> dict:
    """Compile Net and train two steps (the second closes a one-call probe window): the FX
    graph cache's hits and misses, the report, the outputs and gradients."""
    counters = torch._dynamo.utils.counters  # its "inductor" counter is replaced at times: read it anew
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    torch.manual_seed(0)
    model = Net().to(device)
    compiled = torch.compile(model, backend="loka", options=options)
    x = torch.randn(32, 64, device=device)
    for _ in range(2):
        out = compiled(x)
        out.sum().backward()
    report = loka_compile.report(compiled)
    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"] - hits,
        "misses": counters["inductor"]["fxgraph_cache_miss"] - misses,
        "cache_counters": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "sites": [[s.graph, s.kind, s.id, s.key, s.fp8, s.reason, s.provider, s.scaling, s.formats, s.detail,
                   sorted(s.casts.items()), s.verdicts] for s in report.sites],
        "mods": report.mods,
        "graphs": {name: sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                   for name, gm in report.graph_modules.items()},
        "out": out.detach().flatten().tolist(),
        "grads": [p.grad.flatten().tolist() for p in model.parameters()],
    }


# The second process: Net and describe_run as above.
SCRIPT = "\n".join([
    "import json, logging, sys", "import torch", "import loka_compile",
    "logging.basicConfig(level=logging.WARNING); logging.getLogger('loka').setLevel(logging.INFO)",
    "torch._dynamo.config.automatic_dynamic_local_pgo = False  # no dynamic dims from the first process",
    inspect.getsource(Net), inspect.getsource(describe_run),
    "print(json.dumps(describe_run(json.loads(sys.argv[1]), sys.argv[2])))"])


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Inductor's and loka's cache directories of this test alone (the second process's too)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path / "loka"))
    return tmp_path


def _fresh_process(options, device) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(options), device], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    result["log"] = [line for line in done.stderr.splitlines() if "cache" in line][-10:]  # why a hit was not used
    return result


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_second_process_hits_the_cache_and_reports_alike(caches, device):
    """Both runs in fresh processes: Inductor's config (part of the cache key), as earlier
    tests of a suite may leave it in this one, is then the same in both."""
    # On a GPU the speed check would keep these tiny sites bf16; the test is about the cache.
    options = OPTIONS if device == "cpu" else {**OPTIONS, "speed_check": False}
    first, second = _fresh_process(options, device), _fresh_process(options, device)
    # the FP8 variant's forward and backward (the probe variant runs as traced, not compiled)
    assert first["hits"] == 0 and first["misses"] == 2, first["cache_counters"]
    assert second["hits"] == 2 and second["misses"] == 0, (first["cache_counters"], second["cache_counters"],
                                                           second["log"])
    assert len(first["sites"]) == 5 and any(site[4] for site in first["sites"])
    for field in ("sites", "mods", "graphs"):
        assert second[field] == first[field], field
    torch.testing.assert_close(second["out"], first["out"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(second["grads"], first["grads"], rtol=1e-6, atol=1e-7)
    assert len(list((caches / "loka" / graph_cache.DIR_NAME).iterdir())) == 2


def _counts():
    counters = torch._dynamo.utils.counters["inductor"]
    return counters["fxgraph_cache_hit"], counters["fxgraph_cache_miss"]


# Inference graphs, one per compile (the quickest); without the cached_weights Mod, which
# bypasses the cache.
CACHED = {"probe_steps": 0, "max_output_error": None, "disabled_mods": ["cached_weights"]}


def _compile_and_run(options, model=None, x=None):
    """A fresh compile (Dynamo and loka reset) and one inference call: (compiled, report
    rows without the graph's name, which counts the process's graphs, cache hits, cache misses)."""
    torch._dynamo.reset()
    loka_compile.reset()
    hits, misses = _counts()
    torch.manual_seed(0)
    compiled = torch.compile(model or Net(), backend="loka", options=options)
    with torch.no_grad():
        compiled(torch.randn(32, 64) if x is None else x)
    sites = [dataclasses.replace(s, graph="", key=s.key.split("/", 1)[1]) for s in loka_compile.report(compiled).sites]
    now = _counts()
    return compiled, sites, now[0] - hits, now[1] - misses


@torch._dynamo.config.patch(automatic_dynamic_local_pgo=False)
def test_another_plan_misses_the_graphs_of_a_plan(caches):
    compiled, _, _, _ = _compile_and_run(CACHED)
    plan_a = loka_compile.save_plan(compiled, caches / "a.json")
    assert plan_a.sites["inference/fc1:fwd#1"].fp8
    data = json.loads((caches / "a.json").read_text())
    data["sites"]["inference/fc1:fwd#1"].update(fp8=False, reason=Reason.SLOWER_THAN_BF16.value)
    (caches / "b.json").write_text(json.dumps(data))

    _, sites_a, hits, misses = _compile_and_run({**CACHED, "plan": str(caches / "a.json")})
    assert (hits, misses) == (0, 1)  # a plan's graph is not the unplanned one
    _, again, hits, misses = _compile_and_run({**CACHED, "plan": str(caches / "a.json")})
    assert (hits, misses) == (1, 0) and again == sites_a
    _, sites_b, hits, misses = _compile_and_run({**CACHED, "plan": str(caches / "b.json")})
    assert (hits, misses) == (0, 1)
    fc1 = {s.id: s for s in sites_b}["inference/fc1:fwd#1"]
    assert not fc1.fp8 and fc1.reason == Reason.SLOWER_THAN_BF16.value


@torch._dynamo.config.patch(automatic_dynamic_local_pgo=False)
def test_graphs_with_cached_fp8_weights_bypass_the_cache(caches):
    model = Net().eval()
    x = torch.randn(32, 64)
    for _ in range(2):
        compiled, sites, hits, misses = _compile_and_run({**CACHED, "disabled_mods": []}, model, x)
        assert (hits, misses) == (0, 0)  # not looked up, not saved
        assert loka_compile.report(compiled).mods["cached_weights"] == 2 and all(s.fp8 for s in sites)
        with torch.no_grad():
            assert rel_error(model(x), compiled(x)) < 0.05
            model.fc1.weight.mul_(1.5)  # the cached FP8 copy follows the weight
            assert rel_error(model(x), compiled(x)) < 0.05
            model.fc1.weight.div_(1.5)
    assert not (caches / "loka" / graph_cache.DIR_NAME).exists()


@torch._dynamo.config.patch(automatic_dynamic_local_pgo=False)
def test_a_hit_without_its_digest_is_compiled_again(caches):
    """The digests lost (Inductor's entries kept): a hit cannot be checked, so the graph
    is compiled again, reported in full, and its digest kept anew."""
    _, first, _, misses = _compile_and_run(CACHED)
    assert misses == 1 and any(s.fp8 for s in first)
    for path in (caches / "loka" / graph_cache.DIR_NAME).iterdir():
        path.unlink()
    _, again, hits, misses = _compile_and_run(CACHED)
    assert (hits, misses) == (1, 1) and again == first
    _, third, hits, misses = _compile_and_run(CACHED)
    assert (hits, misses) == (1, 0) and third == first


@torch._dynamo.config.patch(automatic_dynamic_local_pgo=False)
def test_a_hit_whose_graph_loka_now_makes_otherwise_is_compiled_again(caches, monkeypatch):
    """A decision from process state the cache key does not cover (here Dispatch patched;
    on FP8 GPUs the speed check's timings): the graph made again differs from the cached
    one's, so the entry is dropped and the graph compiled with the decision made now."""
    _, first, _, _ = _compile_and_run(CACHED)
    assert {s.id: s.fp8 for s in first} == {"inference/fc1:fwd#1": True, "inference/fc2:fwd#1": True}
    decide = inductor_passes._decide

    def slower(site, **kwargs):
        decision = decide(site, **kwargs)
        if site.id == "inference/fc2:fwd#1":
            decision = dataclasses.replace(decision, fp8=False, reason=Reason.SLOWER_THAN_BF16)
        return decision

    monkeypatch.setattr(inductor_passes, "_decide", slower)
    _, now, hits, misses = _compile_and_run(CACHED)
    assert (hits, misses) == (1, 1)
    fc2 = {s.id: s for s in now}["inference/fc2:fwd#1"]
    assert not fc2.fp8 and fc2.reason == Reason.SLOWER_THAN_BF16.value
    _, again, hits, misses = _compile_and_run(CACHED)  # the new entry, with the decision made now
    assert (hits, misses) == (1, 0) and again == now


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_graph_modes_compile_without_the_fx_graph_cache(mode):
    """A hit in a CUDA-graph mode raised inside Inductor on the H100 (inductor_passes.py says how);
    loka's compiles in those modes, and their fallbacks, leave the cache off."""
    from loka_compile.inductor_passes import inductor_patches
    config = loka_compile.LokaConfig(mode=mode)
    for custom_pass in (object(), None):
        patches = inductor_patches(config, custom_pass)
        assert patches.get("fx_graph_cache", True) is (mode == "default")
