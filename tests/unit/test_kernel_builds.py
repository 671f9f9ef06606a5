"""loka's Triton GEMMs built ahead of their first call (`loka_compile/kernel_builds.py`,
`triton_gemm.build_ahead`). The interpreter compiles nothing, so on CPU these check the parts
around the compile: which nodes are handed over, as what, from which compiles, and that a build
compiles the configs the autotuner would time with the arguments it would time them with.
`tests/gpu/test_cuda_kernel_builds.py` checks on the GPU that the first call compiles nothing."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import loka_compile
from loka_compile import kernel_builds
from loka_compile.kernels import triton_gemm as tg
from loka_compile.passes import Phase

E4M3 = torch.float8_e4m3fn


def _gemm_graph(m: int = 96, device: str = "cuda", symbolic_a: bool = False) -> torch.fx.Graph:
    """x_q [M, 64] @ w_q [64, 48] (w column-major) + bias, rowwise, as lowering writes it;
    `symbolic_a`: A's recorded value has a symbolic M (a dynamic batch)."""
    with FakeTensorMode():
        a = torch.empty(m, 64, dtype=E4M3, device=device)
        a_s = torch.empty(m, 1, device=device)
        b = torch.empty_strided((64, 48), (1, 64), dtype=E4M3, device=device)
        b_s = torch.empty(1, 48, device=device)
        bias = torch.empty(48, dtype=torch.bfloat16, device=device)
        out = torch.ops.loka.triton_fp8_gemm(a, a_s, b, b_s, "rowwise", bias, fast_accum=True)
    if symbolic_a:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
        a = mode.from_tensor(torch.empty(m, 64, dtype=E4M3), symbolic_context=context)
        assert not isinstance(a.shape[0], int)
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(name) for name in ("a", "a_s", "b", "b_s", "bias")]
    for node, value in zip(inputs, (a, a_s, b, b_s, bias)):
        node.meta["val"] = value
    node = graph.call_function(torch.ops.loka.triton_fp8_gemm.default, (*inputs[:4], "rowwise", inputs[4]),
                               {"fast_accum": True})
    node.meta["val"] = out
    graph.output(node)
    return graph


def test_gemm_nodes_with_static_sizes_are_handed_over_as_meta_tensors():
    (args, kwargs, device), = kernel_builds.gemm_builds(_gemm_graph())
    assert device == torch.device("cuda", 0) and args[4] == "rowwise" and kwargs == {"fast_accum": True}
    want = [((96, 64), (64, 1), E4M3), ((96, 1), (1, 1), torch.float32), ((64, 48), (1, 64), E4M3),
            ((1, 48), (48, 1), torch.float32), ((48,), (1,), torch.bfloat16)]
    got = [(tuple(t.shape), t.stride(), t.dtype) for t in (*args[:4], args[5])]
    assert got == want and all(t.device.type == "meta" for t in (*args[:4], args[5]))


def test_the_compiles_fake_mode_does_not_make_the_handed_tensors_fake():
    with FakeTensorMode():
        (args, _, _), = kernel_builds.gemm_builds(_gemm_graph())
    assert not any(isinstance(t, torch._subclasses.FakeTensor) for t in args if isinstance(t, torch.Tensor))
    assert args[0].data_ptr() == 0  # a meta tensor: Triton reads it as 16-byte aligned, as real operands are


def test_symbolic_sizes_and_host_outputs_wait_for_the_first_call():
    assert kernel_builds.gemm_builds(_gemm_graph(symbolic_a=True)) == []
    assert kernel_builds.gemm_builds(_gemm_graph(device="cpu")) == []


def test_the_interpreter_builds_nothing():
    assert tg.interpreting()  # CPU tests run the kernels under the interpreter
    assert kernel_builds.start(_gemm_graph()) == 0
    assert kernel_builds.wait(timeout=5) == 0


@pytest.mark.parametrize("impl", ["auto", "pointer"])
def test_a_build_compiles_each_config_the_tuner_would_time_with_its_arguments(monkeypatch, impl):
    """The tuned launch and the build ahead, for the same meta operands on a stood-in sm90
    device: the build warms up every config the tuner's pruning keeps, each with the arguments
    and flags the tuner is called with (so Triton's cache key is the call's)."""
    monkeypatch.setattr(tg, "interpreting", lambda: False)
    monkeypatch.setattr(tg, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(tg, "_sm_count", lambda index: 132)
    monkeypatch.setattr(tg, "_tuned_configs", {})
    tma = impl == "auto"
    jit_fn, tuner = (tg._fp8_gemm_tma_kernel, tg._tma_kernel_tuned) if tma else (tg._ptr_kernel, tg._ptr_kernel_tuned)

    def described(args):
        return [(type(a).__name__, tuple(a.shape), a.dtype) if hasattr(a, "dtype") else
                ("descriptor", tuple(a.shape)) if hasattr(a, "block_shape") else a for a in args]

    built, tuned = [], []
    monkeypatch.setattr(jit_fn, "warmup", lambda *args, grid, **kw: built.append((described(args), kw)), raising=False)
    monkeypatch.setattr(tuner, "run", lambda *args, grid, warmup, **kw: tuned.append((described(args), kw)))
    (args, kwargs, device), = kernel_builds.gemm_builds(_gemm_graph())
    assert tg.build_ahead(*args, **{**kwargs, "impl": impl}, device=device) == len(built) > 0
    meta = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for name, t in zip(("a", "a_s", "b", "b_s", "bias"), (*args[:4], args[5]))}
    plan = tg._check_args(meta["a"], meta["a_s"], meta["b"], meta["b_s"], "rowwise", meta["bias"], None, "none",
                          torch.bfloat16, impl)
    out = torch.empty(plan.out_shape, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(tuner, "best_config", None, raising=False)
    tg._launch(meta["a"], meta["a_s"], meta["b"], meta["b_s"], plan, meta["bias"], None, torch.bfloat16, None, out,
               tma, None, tg.ACCUM_MODES["fast"], device)
    (tuned_args, flags), = tuned
    kept = tg._prune_configs(tuner.configs, dict(zip(tuner.arg_names, tuned_args)), **flags)
    assert [kw for _, kw in built] == [{**flags, **config.all_kwargs()} for config in kept]
    assert all(args == tuned_args for args, _ in built)


def test_only_compiles_of_the_fp8_variant_hand_their_graphs_over(monkeypatch):
    """The probe variant runs as traced (nothing of it is compiled); the FP8 variant's forward and
    backward graphs go to `kernel_builds.start` once loka's passes have lowered them."""
    from loka_compile import inductor_passes

    phases = []
    real_call = inductor_passes.LokaPostGradPass.__call__

    def recording(self, graph):
        real_call(self, graph)
        phases.append((self.phase, started[-1] is graph if started else False))

    started = []
    monkeypatch.setattr(kernel_builds, "start", lambda graph: started.append(graph) or 0)
    monkeypatch.setattr(inductor_passes.LokaPostGradPass, "__call__", recording)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    compiled = torch.compile(model, backend="loka", options={"probe_steps": 1, "max_output_error": None})
    for _ in range(3):
        compiled(torch.randn(16, 32)).square().mean().backward()
    assert len(started) == 2 and [handed for phase, handed in phases if phase is Phase.FP8] == [True, True]
    assert all(not handed for phase, handed in phases if phase is Phase.PROBE)
    assert any(s.fp8 for s in loka_compile.report(compiled).sites)
