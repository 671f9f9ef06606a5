import atexit
import os
import shutil
import tempfile

import torch

# loka's performance database goes to a directory of this session, never the user's cache.
os.environ["LOKA_CACHE_DIR"] = tempfile.mkdtemp(prefix="loka-test-cache-")
atexit.register(shutil.rmtree, os.environ["LOKA_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


def _has_fp8_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


# Triton kernels run without an FP8 GPU only under the interpreter, and triton.jit reads this
# when a kernel is defined: set it before any test module imports loka's kernels.
if not _has_fp8_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _has_fp8_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a shared CI box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_compile_state():
    """Forget Dynamo's compiled code (and the speed check's in-process timings) before a test."""
    import loka_compile

    torch._dynamo.reset()
    loka_compile.reset()
    yield


@pytest.fixture
def inductor_compiles(monkeypatch):
    """Inductor compiles of ATen graphs by kind ("forward" or "backward"), counted where loka
    calls Inductor; the FX graph cache off, so that none is a cache entry dropped and compiled again."""
    import collections

    from torch._inductor import config as inductor_config

    from loka_compile import inductor_compile

    compiles = collections.Counter()
    real = inductor_compile.compile_fx_inner

    def counting(gm, example_inputs, **kwargs):
        compiles["backward" if kwargs.get("is_backward") else "forward"] += 1
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor_compile, "compile_fx_inner", counting)
    with inductor_config.patch(fx_graph_cache=False):
        yield compiles


@pytest.fixture
def store():
    """A fresh Probe store as the sink of observers called directly (no compile); the routing
    of compiled graphs' observations to their compile's store restored after."""
    from loka_compile import probe
    from loka_compile.kernels import ops

    fresh = probe.ProbeStore()
    ops.set_observer_sink(fresh.record)
    try:
        yield fresh
    finally:
        ops.set_observer_sink(probe.deliver)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """loka's cache directory (the performance database) of this test alone."""
    monkeypatch.setenv("LOKA_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def fp8_hardware(monkeypatch):
    """FP8 hardware stood in for on CPU: Dispatch sees an FP8 device whose one provider is
    the emulated GEMM marked as a hardware kernel (so the speed check runs)."""
    import dataclasses

    from loka_compile import dispatch
    from loka_compile.kernels import providers

    as_hardware = dataclasses.replace(providers.get("emulated"), emulated=False)
    monkeypatch.setattr(dispatch.providers, "has_fp8_hardware", lambda device: True)
    monkeypatch.setattr(dispatch.providers, "select", lambda request: [as_hardware])


@pytest.fixture
def understate_sensitivities(monkeypatch):
    """Call with a factor: every output-budget sensitivity measured from then on is divided
    by it, so the window's prediction falls short and the FP8 variant measures more."""
    from loka_compile import compiled_graph

    measure = compiled_graph.LokaCompiledGraph._measure_sensitivities

    def plant(factor):
        def understated(self, *args):
            measured = measure(self, *args)
            measured["sensitivity"] = {sid: s / factor for sid, s in measured["sensitivity"].items()}
            return measured

        monkeypatch.setattr(compiled_graph.LokaCompiledGraph, "_measure_sensitivities", understated)

    return plant


@pytest.fixture
def mlp_graphs():
    """Forward and backward ATen graphs of linear -> relu -> linear on fresh random values."""
    from graphs import aot_graphs, linear_relu_linear

    x = torch.randn(32, 64)
    w1, b1, w2 = (torch.randn(128, 64, requires_grad=True), torch.randn(128, requires_grad=True),
                  torch.randn(48, 128, requires_grad=True))
    return aot_graphs(linear_relu_linear, x, w1, b1, w2)
