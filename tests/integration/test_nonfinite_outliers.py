"""One bad value must not spoil a whole tensor (issue 30).

- An inf or NaN in one weight spoils, under loka, the output rows that it spoils in high
  precision and no others: rowwise casts keep an infinity's sign (a ReLU after the GEMM
  then zeroes -inf as it does in high precision). Tensorwise e4m3 has no inf: a site
  whose cached weight holds one goes rowwise at the next call (the amax guard).
- A finite outlier that first appears after the probe window, where a tensorwise scale
  flushes every other row to zero, is caught at run time: the site goes rowwise from the
  next call, with a warning and the reason in the report.

CPU, emulated FP8, an MLP of nn.Linear layers as public code writes one."""

import logging
import math

import pytest
import torch
import torch.nn as nn

import loka_compile
from loka_compile.kernels.quantize import Fp8Format
from numerics import row_rel_error

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

PROBE_STEPS = 2
# The output budget off: on this tiny MLP it keeps every site in high precision (each moves
# the output by ~0.04 against its default 0.003); the per-site bound is what this tests.
OPTIONS = {"probe_steps": PROBE_STEPS, "max_output_error": None}
BATCH, WIDTH = 32, 64
# Row relative error of the rows without the outlier: the Probe's budget (max_probe_error).
BUDGET = 0.1


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 16))


def spoiled_rows(out: torch.Tensor) -> torch.Tensor:
    return (~torch.isfinite(out)).any(dim=-1)


def compiled_past_the_window(recipe: str, **options):
    """The MLP compiled by loka, run through its probe window on clean batches."""
    model = mlp()
    compiled = torch.compile(model, backend="loka", options={**OPTIONS, "recipe": recipe, **options})
    with torch.no_grad():
        for _ in range(PROBE_STEPS + 1):  # the window, then the first FP8 call
            compiled(torch.randn(BATCH, WIDTH))
    return model, compiled


def standing(compiled) -> list:
    return [site.scaling if site.fp8 else "high precision" for site in loka_compile.report(compiled).sites]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("recipe", ["default", "rowwise"])
def test_a_bad_weight_spoils_the_rows_it_spoils_in_high_precision(recipe, bad):
    model, compiled = compiled_past_the_window(recipe)
    assert standing(compiled) == ["rowwise"] * 3
    with torch.no_grad():
        model[0].weight[3, 5] = bad
        x = torch.randn(BATCH, WIDTH)
        out, eager = compiled(x), model(x)
    assert torch.equal(spoiled_rows(out), spoiled_rows(eager))
    if not math.isnan(bad):  # the ReLU zeroes half the infinities: half the rows stay finite
        assert 0 < spoiled_rows(eager).sum() < BATCH
    finite = ~spoiled_rows(eager)
    assert not finite.any() or row_rel_error(eager[finite].double(), out[finite]) < BUDGET


def test_a_bad_weight_in_training_spoils_the_rows_it_spoils_in_high_precision():
    model = mlp()
    compiled = torch.compile(model, backend="loka", options={**OPTIONS, "recipe": "rowwise"})
    for _ in range(PROBE_STEPS + 1):
        compiled(torch.randn(BATCH, WIDTH)).sum().backward()
    with torch.no_grad():
        model[0].weight[3, 5] = float("inf")
    x = torch.randn(BATCH, WIDTH)
    out = compiled(x)
    with torch.no_grad():
        eager = model(x)
    assert standing(compiled)[:3] == ["rowwise"] * 3
    assert torch.equal(spoiled_rows(out.detach()), spoiled_rows(eager))
    assert 0 < spoiled_rows(eager).sum() < BATCH


def test_a_tensorwise_site_meeting_an_inf_weight_goes_rowwise_at_the_next_call(caplog):
    """e4m3 has no inf: the call that meets it writes NaN where high precision has +-inf
    (non-finite where high precision is, at the GEMM; the ReLU after it keeps the NaN);
    from the next call the site runs rowwise and spoils only high precision's rows."""
    model, compiled = compiled_past_the_window("tensorwise")
    assert standing(compiled) == ["tensorwise"] * 3
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        model[0].weight[3, 5] = float("inf")
        x = torch.randn(BATCH, WIDTH)
        first = compiled(x)
        second, eager = compiled(x), model(x)
    assert (spoiled_rows(first) >= spoiled_rows(eager)).all()
    assert torch.equal(spoiled_rows(second), spoiled_rows(eager))
    # Layer 0's weight holds the inf (its cached FP8 copy is cast eagerly, where the guard
    # sees infinities). The later layers' activations hold +inf too, which their tensorwise
    # casts write as NaN: a row with an infinity is spoiled whole in high precision too.
    assert standing(compiled) == ["rowwise", "tensorwise", "tensorwise"]
    name = loka_compile.report(compiled).graphs[0].name
    assert f"loka amax guard: {name} site inference/0:fwd#1 demoted tensorwise -> rowwise from call 5 (amax guard: " \
           "operand b holds inf" in caplog.text


def test_an_outlier_after_the_window_sends_its_tensorwise_site_rowwise(caplog):
    model, compiled = compiled_past_the_window("tensorwise")
    x = torch.randn(BATCH, WIDTH)
    x[0] = 1e6  # one outlier row, first seen after the window
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        eager = model(x)
        spoiled = compiled(x)   # the call that meets it: tensorwise flushes the other rows
        caught = compiled(x)    # the next: its site runs rowwise
    assert row_rel_error(eager[1:].double(), spoiled[1:]) > 0.5
    assert row_rel_error(eager[1:].double(), caught[1:]) < BUDGET
    assert standing(compiled) == ["rowwise"] * 3  # the outlier row is as large in the later layers
    site = loka_compile.report(compiled).sites[0]
    assert site.detail.startswith("rowwise: amax guard: operand a's amax 1e+06 is over 28672 x its probe window's")
    history = [(e["step"], e["from"], e["to"], e["by"]) for e in site.history]
    assert history == [(5, "tensorwise", "rowwise", "amax_guard")]
    (amendment,) = site.amendments  # the verdict change is an amendment too, in the report and the state
    assert (amendment.by, amendment.changes) == ("amax_guard", (("verdict", "tensorwise", "rowwise"),))
    assert amendment in loka_compile.state_of(compiled).amendments and amendment.why in site.history[0]["detail"]
    assert "demoted tensorwise -> rowwise at call 5 by the amax guard" in loka_compile.report(compiled).summary()
    assert f"{site.id}: amax_guard: verdict 'tensorwise' -> 'rowwise'" in loka_compile.report(compiled).summary()
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "amax guard" in r.getMessage()]
    assert len(warnings) == 3 and "inference/0:fwd#1 demoted tensorwise -> rowwise from call 5" in warnings[0]


def test_growth_within_the_formats_range_keeps_tensorwise(caplog):
    """An amax 100x the window's (well inside e4m3's 2^14.8 of normal range) is no trip,
    nor is a batch scaled up as a whole: tensorwise serves both."""
    model, compiled = compiled_past_the_window("tensorwise")
    x = torch.randn(BATCH, WIDTH)
    x[0] *= 100
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        for batch in (x, x, torch.randn(BATCH, WIDTH) * 1000, torch.randn(BATCH, WIDTH)):
            compiled(batch)
    assert standing(compiled) == ["tensorwise"] * 3
    assert "amax guard" not in caplog.text
    from loka_compile.kernels.scaled_gemm import amax_jump
    assert amax_jump(Fp8Format.E4M3) == 448 * 64 and amax_jump(Fp8Format.E5M2) == 57344 * 2 ** 14


def test_an_outlier_in_training_sends_forward_and_gradient_sites_rowwise(caplog):
    model = mlp()
    compiled = torch.compile(model, backend="loka", options={**OPTIONS, "recipe": "tensorwise"})
    for _ in range(PROBE_STEPS + 1):
        compiled(torch.randn(BATCH, WIDTH)).sum().backward()
    x = torch.randn(BATCH, WIDTH)
    x[0] = 1e6
    with caplog.at_level(logging.WARNING, logger="loka"):
        compiled(x).sum().backward()
        out = compiled(x)
        out.sum().backward()  # the backward graph of the new build compiles at its first backward
    moved = {s.id: s.scaling for s in loka_compile.report(compiled).sites if s.history}
    # the forward GEMMs read the outlier row (as large in every layer), and so do the weight
    # gradients (their B: the layer input, which the saved_fp8 Mod casts in the forward)
    assert moved == {f"{role}/{layer}:{r}#1": "rowwise" for layer in (0, 2, 4)
                     for role, r in (("forward", "fwd"), ("backward", "wgrad"))}, moved
    with torch.no_grad():
        eager = model(x)
    assert row_rel_error(eager[1:].double(), out.detach()[1:]) < BUDGET


def test_the_guard_and_re_checks_compose(caplog):
    """With re-checks on (tests/integration/test_recheck.py's planted outlier feature, in every row of
    calls 6-9), the guard sends the site rowwise at call 7; the re-check of call 8 finds
    rowwise over the budget too and moves it to blockwise; the one of call 11, on clean
    data again, promotes it back to tensorwise."""
    from test_recheck import OPTIONS as RECHECK, PlantedLinear, _batch

    compiled = torch.compile(PlantedLinear(), backend="loka", options={**RECHECK, "amax_guard": True})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="loka"):
        for call in range(1, 14):
            compiled(_batch(call))
    site = loka_compile.report(compiled).sites[0]
    assert [(e["step"], e["from"], e["to"], e.get("by", "re-check")) for e in site.history] == [
        (7, "tensorwise", "rowwise", "amax_guard"), (9, "rowwise", "blockwise", "re-check"),
        (12, "blockwise", "tensorwise", "re-check")]
    assert site.fp8 and site.scaling == "tensorwise"
