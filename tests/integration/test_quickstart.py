"""The README's quickstart, shortened: it trains with Inductor and with loka, prints their
quality side by side, and returns loka's report."""

import math
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile_state")]


def test_quickstart_prints_side_by_side_quality_and_the_overview(capsys):
    from examples import quickstart

    report = quickstart.main(["--steps", "4", "--batch", "32", "--eval-batches", "1", "--table"])
    out = capsys.readouterr().out
    rows = {m[1]: [float(v) for v in m[2].split()] for m in
            (re.match(r"^(inductor|loka)((?:\s+-?\d+\.\d+){3,4})$", line) for line in out.splitlines()) if m}
    assert set(rows) == {"inductor", "loka"} and all(math.isfinite(v) for r in rows.values() for v in r)
    assert "loka vs inductor: NE" in out and out.rstrip().endswith(report.table()) \
        and "print(report.table())" not in out
    assert any(s.fp8 for s in report.sites)
    # per graph: the noise floor, the budget, predicted and measured discrepancy, and the click
    # head's predicted NE increase (the quickstart names its head in binary_outputs)
    budgets = [g for g in report.graphs if g.output_budget is not None]
    assert budgets and all(g.output_budget.floor.value > 0 and g.output_budget.measured is not None
                           and g.output_budget.heads for g in budgets)
    for g in budgets:
        line = next(line for line in out.splitlines() if line.startswith(f"output budget {g.name}:"))
        assert "noise floor" in line and "budget 16 x noise floor" in line and "measured" in line, line
        assert "binary head output 0 (logit): predicted relative NE increase" in out
