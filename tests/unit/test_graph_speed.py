"""loka_compile/graph_speed.py: which graphs the graph speed check times, the steps it times,
and its verdict (the compiled-graph side is in tests/integration/test_whole_graph_speed.py)."""

import types

import pytest
import torch

from loka_compile import LokaConfig, graph_speed
from loka_compile.passes import Decision, Reason


def _fp8(bf16_us, fp8_us):
    return Decision(fp8=True, reason=Reason.FP8, bf16_us=bf16_us, fp8_us=fp8_us)


def test_predicted_gain_sums_the_fp8_sites_timings():
    hp = Decision(fp8=False, reason=Reason.SLOWER_THAN_BF16, bf16_us=50.0, fp8_us=60.0)
    gain, sites = graph_speed.predicted_gain([_fp8(47.7, 41.4), _fp8(20.0, 18.0), hp])
    assert sites == 2 and gain == pytest.approx((47.7 + 20.0) / (41.4 + 18.0) - 1)
    untimed = Decision(fp8=True, reason=Reason.FP8)  # a site the speed check could not time
    assert graph_speed.predicted_gain([_fp8(47.7, 41.4), untimed]) == (None, 2)
    assert graph_speed.predicted_gain([hp]) == (None, 0)


def test_thin_times_only_graphs_below_the_margin_on_fp8_hardware(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    thin, wide = graph_speed.THIN_GAIN_MARGIN / 2, graph_speed.THIN_GAIN_MARGIN * 2
    assert "emulated on cpu" in graph_speed.skip_reason("thin", thin, 3, cpu)
    monkeypatch.setattr(graph_speed.providers, "has_fp8_hardware", lambda device: device.type == "cuda")
    assert graph_speed.skip_reason("thin", thin, 3, cuda) is None
    assert graph_speed.skip_reason("thin", None, 3, cuda) is None  # an untimed site: the prediction is unknown
    assert "speed_check is off" in graph_speed.skip_reason("thin", None, 3, cuda, speed_check=False)
    assert graph_speed.skip_reason("always", None, 3, cuda, speed_check=False) is None
    assert "thin margin" in graph_speed.skip_reason("thin", wide, 3, cuda)
    assert graph_speed.skip_reason("always", wide, 3, cpu) is None
    assert graph_speed.skip_reason("always", None, 0, cuda) == "no FP8 site in the graph"
    assert graph_speed.skip_reason("off", thin, 3, cuda) == "graph_speed_check is off"


def _info(**mutation):
    fields = dict(mutates_data=False, mutates_metadata=False, mutation_inductor_storage_resize=False,
                  requires_grad=False)
    return types.SimpleNamespace(**{**fields, **mutation})


def test_input_mutations_clone_buffers_and_skip_the_rest():
    buffer, weight, x = torch.zeros(4), torch.nn.Parameter(torch.randn(4, 4)), torch.randn(2, 4)
    meta = types.SimpleNamespace
    running_stats = meta(input_info=[_info(), _info(mutates_data=True), _info()])
    assert graph_speed.mutation_skip(running_stats, [x, buffer, weight]) is None
    resized = meta(input_info=[_info(mutates_metadata=True)])
    assert "metadata of its input 0" in graph_speed.mutation_skip(resized, [x])
    written = meta(input_info=[_info(), _info(mutates_data=True)])
    assert "input 1 in place" in graph_speed.mutation_skip(written, [x, weight])
    takes_grad = meta(input_info=[_info(mutates_data=True, requires_grad=True)])
    assert "takes a gradient" in graph_speed.mutation_skip(takes_grad, [x])
    assert "unknown" in graph_speed.mutation_skip(None, [x])
    assert "unknown" in graph_speed.mutation_skip(running_stats, [x])  # not the graph's inputs


def test_step_inputs_clone_all_but_parameters_which_are_aliased():
    weight = torch.nn.Parameter(torch.randn(8, 4))
    activation = torch.randn(3, 4, requires_grad=True) * 2  # not a leaf
    buffer, index = torch.randn(8), torch.randint(0, 8, (3,))
    column = torch.randn(3, 13)[:, 2]  # a strided view, as a dense feature sliced from its table
    inputs, leaves = graph_speed.step_inputs([weight, activation, buffer, index, 5, column])
    # The parameter: its storage, not its autograd identity (its own gradient accumulator).
    assert isinstance(inputs[0], torch.nn.Parameter) and inputs[0] is not weight and inputs[4] == 5
    assert inputs[0].data_ptr() == weight.data_ptr() and inputs[0].requires_grad and inputs[0].is_leaf
    for clone, original in zip(inputs[1:4] + inputs[5:], (activation, buffer, index, column)):
        assert clone is not original and clone.data_ptr() != original.data_ptr() and torch.equal(clone, original)
        assert clone.stride() == original.stride()
    assert inputs[1].is_leaf and inputs[1].requires_grad and not inputs[2].requires_grad
    assert leaves == [inputs[0], inputs[1]]


def test_a_training_step_computes_gradients_without_touching_grad():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    inputs, leaves = graph_speed.step_inputs([weight, torch.randn(5, 4, requires_grad=True)])
    seen = []

    def variant(w, x):
        out = torch.nn.functional.linear(x, w)
        seen.append(out)
        return (out,)

    kept_alive = (weight * 2).sum()  # the caller's graph holds the parameter's gradient accumulator
    step = graph_speed.Step(variant, inputs, leaves)
    step()
    step()
    assert step.training and weight.grad is None and inputs[1].grad is None
    leaves_reached, stack = [], [seen[0].grad_fn]
    while stack:  # every gradient accumulator the step's autograd graph reaches
        fn = stack.pop()
        if hasattr(fn, "variable"):
            leaves_reached.append(fn.variable)
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    assert any(v is inputs[0] for v in leaves_reached) and not any(v is weight for v in leaves_reached)
    assert kept_alive.grad_fn.next_functions[0][0].next_functions[0][0].variable is weight
    assert seen[0] is not seen[1]  # fresh outputs each run
    inference = graph_speed.Step(lambda w, x: (x.detach() @ w.detach().t(),), inputs, leaves)
    inference()
    assert not inference.training


def test_timing_alternates_the_variants_order():
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in ("fp8", "hp")}
    times = graph_speed.time_steps(steps, torch.device("cpu"), captured=False)
    assert {name: len(t) for name, t in times.items()} == {"fp8": graph_speed.ROUNDS, "hp": graph_speed.ROUNDS}
    assert all(t >= 0 for run in times.values() for t in run)
    timed = order[2 * graph_speed.WARMUP_STEPS:]
    assert timed[:4] == ["fp8", "hp", "hp", "fp8"]
    assert order[:2 * graph_speed.WARMUP_STEPS] == ["fp8"] * graph_speed.WARMUP_STEPS + \
        ["hp"] * graph_speed.WARMUP_STEPS


def test_verdict_keeps_the_faster_and_high_precision_on_a_tie():
    faster_fp8 = graph_speed.verdict({"fp8": [1.0, 1.1, 0.9], "hp": [1.5, 1.4, 1.6]}, 0.1, 3, True)
    assert faster_fp8.kept == "fp8" and faster_fp8.fp8_ms == 1.0 and faster_fp8.hp_ms == 1.5
    assert "forward + backward, medians of 3" in faster_fp8.describe_times()
    assert graph_speed.verdict({"fp8": [2.0], "hp": [1.0]}, 0.1, 3, False).kept == "high precision"
    assert graph_speed.verdict({"fp8": [1.0], "hp": [1.0]}, 0.1, 3, False).kept == "high precision"


def test_config_option_is_validated():
    assert LokaConfig().graph_speed_check == "thin"
    with pytest.raises(ValueError, match="'thin', 'always', 'off'"):
        LokaConfig(graph_speed_check="sometimes")
