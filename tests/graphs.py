"""Graph helpers for the tests: what a torch.compile backend receives, and the inference
graphs, lowering and calibrated compiles the GEMM-epilogue Mods' tests share, and the count of
the kernels Inductor generated."""

import copy
import functools
import re

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

import loka_compile
from loka_compile import LokaConfig, dispatch
from loka_compile.passes import GraphKind, PassContext, Phase, graph_kind, run_passes
from numerics import sqnr_db


def dynamo_graph(model, *inputs):
    """The GraphModule and example inputs a torch.compile backend receives for `model`."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=record)(*inputs)
    assert len(graphs) == 1
    return graphs[0]


def rewritten_against_eager(model, x, rewrite):
    """`rewrite(gm, example_inputs)` on `model`'s Dynamo graph, the rewritten graph run once with a
    backward of its outputs' sum, and an eager copy the same way: (what `rewrite` returned,
    [(name, the rewritten graph's tensor, eager's)] for each output, x's gradient and each
    parameter's, a gradient None where it is None)."""
    eager, x_eager = copy.deepcopy(model), x.detach().clone().requires_grad_(x.requires_grad)
    gm, example_inputs = dynamo_graph(model, x)
    result = rewrite(gm, example_inputs)

    def step(fn, arguments, x):
        outs = fn(*arguments)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        sum(o.float().sum() for o in outs if o.requires_grad).backward()
        return [(f"output {i}", o.detach()) for i, o in enumerate(outs)] + [("x grad", x.grad)]

    mine = step(gm, example_inputs, x) + [(n, p.grad) for n, p in model.named_parameters()]
    theirs = step(eager, (x_eager,), x_eager) + [(n, p.grad) for n, p in eager.named_parameters()]
    return result, [(name, a, b) for (name, a), (_, b) in zip(mine, theirs)]


def fail_second_call(monkeypatch, module, name: str) -> None:
    """Patch `module.name` so that its second call raises RuntimeError("injected"): a
    rewrite failing part way."""
    real, calls = getattr(module, name), []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, second_fails)


def train_step(model, x, mods=(), recipe="rowwise", **options):
    """One training step of a copy of `model` under loka with no probe window and no speed
    check (every eligible site FP8), `mods` off: (output, parameter gradients, report)."""
    loka_compile.reset()
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="loka", dynamic=options.pop("dynamic", None),
                             options=dict(recipe=recipe, probe_steps=0, speed_check=False, disabled_mods=mods,
                                          **options))
    out = compiled(x)
    out.float().square().mean().backward()
    return out, [p.grad for p in model.parameters()], loka_compile.report(compiled)


def cuda_training_with_and_without(model, x, mod: str, mode: str) -> dict:
    """Three training steps of copies of `model` on `x` under loka (rowwise, every site
    FP8), with `mod` on and off, in `mode` (CUDA graphs record after warm-up calls):
    {"on"|"off": (last output, parameter gradients then x's if it takes one, report)}."""
    runs = {}
    for name, mods in (("on", ()), ("off", (mod,))):
        loka_compile.reset()
        torch._dynamo.reset()
        trained = copy.deepcopy(model)
        compiled = torch.compile(trained, backend="loka", options=dict(
            recipe="rowwise", probe_steps=0, speed_check=False, disabled_mods=mods, mode=mode))
        for _ in range(3):
            trained.zero_grad()
            x.grad = None
            out = compiled(x)
            out.float().square().mean().backward()
        grads = [p.grad.clone() for p in trained.parameters()] + ([x.grad.clone()] if x.requires_grad else [])
        runs[name] = out.detach().clone(), grads, loka_compile.report(compiled)
    return runs


def loka_and_eager_grads(model, x, options):
    """One backward of sum(model(x)) compiled with loka (`options`) and of an eager copy:
    (loka's report, [(parameter name, loka's gradient, eager's gradient)])."""
    eager = copy.deepcopy(model)
    eager(x).sum().backward()
    compiled = torch.compile(model, backend="loka", options=options)
    compiled(x).sum().backward()
    grads = [(name, p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), eager.parameters())]
    return loka_compile.report(compiled), grads


# Emulated rowwise e4m3 with static scales against fp64, these models: 26-32 dB measured.
OUTPUT_SQNR_DB = 20.0
# The fused path casts the fp32 epilogue value, the unfused one (run eagerly) its bf16
# rounding: the fused output may be no further from fp64 than the unfused one, within
# this margin. (Compiled by Inductor, which keeps the unfused chain in fp32, the two
# measured identical on these models.)
NO_LOSS_MARGIN_DB = 0.5


def assert_no_loss(exact, fused, unfused):
    assert not torch.isnan(fused).any()
    fused_db, unfused_db = sqnr_db(exact, fused.double()), sqnr_db(exact, unfused.double())
    assert fused_db >= OUTPUT_SQNR_DB and fused_db >= unfused_db - NO_LOSS_MARGIN_DB, (fused_db, unfused_db)


def inference_graph(fn, *args):
    """The ATen inference graph AOTAutograd hands a compiler for fn (no input needs a grad)."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    with torch.no_grad():
        aot_function(fn, fw_compiler=keep)(*args)
    (gm,) = graphs
    assert graph_kind(gm.graph) is GraphKind.INFERENCE
    return gm


def run_lowering(gm, scale=0.01, disabled=(), static_sites=None, recipe="rowwise", providers=()):
    """find_sites .. lower on gm's graph, every site's A with a static scale (or those
    numbered in `static_sites`, 1-based); `scale`: one for all, or a list by site."""
    config = LokaConfig(recipe=recipe, disabled_mods=list(disabled), providers=list(providers))
    decide = functools.partial(dispatch.decide, config=config, phase=Phase.FP8, unsafe_sites={})
    count = sum(n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                for n in gm.graph.nodes)
    numbers = range(1, count + 1) if static_sites is None else static_sites
    scales = scale if isinstance(scale, list) else [scale] * count
    static = {f"inference/<root>:fwd#{i}": {"scale": scales[i - 1], "policy": "amax"} for i in numbers}
    ctx = PassContext(graph="t", kind=GraphKind.INFERENCE, phase=Phase.FP8, param_input_indices=frozenset(),
                      decide=decide, inactive_mods=config.inactive_mods, static_a_scales=static,
                      providers=config.providers)
    run_passes(gm.graph, ctx)
    gm.recompile()
    return ctx


def calibrated_plan(model, batches, tmp_path):
    plan = loka_compile.calibrate(model, batches, options={"max_output_error": None})
    path = tmp_path / "plan.json"
    plan.save(path)
    return str(path)


def compile_with(model, path, *, disabled=(), options=None, **kwargs):
    return torch.compile(copy.deepcopy(model), backend="loka",
                         options={"plan": path, "disabled_mods": list(disabled), **(options or {})}, **kwargs)


def with_and_without(model, path, x, mod: str, options=None) -> tuple:
    """(the fp64 model's output, the output compiled with the plan at `path`, its report,
    the output with `mod` disabled, and each compile's Inductor code): the two forms a
    Mod's end-to-end tests compare. `model` is a bf16 module; it is bf16 again after."""
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        exact = model.double()(x.double())
        model.to(torch.bfloat16)
        compiled = compile_with(model, path, options=options)
        fused, fused_code = run_and_get_code(compiled, x)
        report = loka_compile.report(compiled)
        torch._dynamo.reset()
        loka_compile.reset()
        unfused, unfused_code = run_and_get_code(compile_with(model, path, disabled=(mod,), options=options), x)
    return exact, fused, report, unfused, (fused_code, unfused_code)


def aot_graphs(fn, *args):
    """Forward and backward ATen graphs of fn, as AOTAutograd hands them to a compiler."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep)(*args)
    out.sum().backward()
    return graphs


def linear_relu_linear(x, w1, b1, w2):
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2)


def make_ctx(graph, phase=Phase.FP8, params=frozenset(), config=None, unsafe=None):
    config = config or LokaConfig(recipe="rowwise")
    decide = functools.partial(dispatch.decide, config=config, phase=phase, unsafe_sites=unsafe or {})
    return PassContext(graph="t", kind=graph_kind(graph), phase=phase, param_input_indices=params, decide=decide,
                       inactive_mods=config.inactive_mods)


def targets(graph):
    """The call targets of an FX graph, in order."""
    return [n.target for n in graph.nodes if n.op == "call_function"]


def fp8_casts(graph):
    """The casts to an FP8 dtype in an ATen graph."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.prims.convert_element_type.default
            and n.args[1] in (torch.float8_e4m3fn, torch.float8_e5m2)]


def generated_kernels(code: list) -> int:
    """Pointwise and reduction kernels Inductor generated (GEMM templates excluded: a
    template may win the FP8 GEMM's autotuning where bf16 calls cuBLAS)."""
    return sum(len(re.findall(r"def triton_(?:poi|red|per)_", src)) for src in code)
