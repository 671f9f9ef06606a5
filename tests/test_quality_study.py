"""The quality study's arithmetic (benchmarks/quality_study.py): FP8 FLOP shares per
direction, dNE against the bf16 seeds' spread, the table; and a CPU smoke run at tiny sizes."""

import json

import pytest

from benchmarks import quality_study as study


def test_fp8_shares_split_forward_and_backward():
    sites = [{"role": "fwd", "fp8": True, "flops": 300}, {"role": "fwd", "fp8": False, "flops": 100},
             {"role": "dgrad", "fp8": True, "flops": 100}, {"role": "wgrad", "fp8": False, "flops": 300},
             {"role": "fwd", "fp8": True, "flops": None}]
    assert study.fp8_shares(sites) == {"fp8_share_fwd": 0.75, "fp8_share_bwd": 0.25}
    assert study.fp8_shares([])["fp8_share_fwd"] is None


def test_summary_judges_dne_against_the_bf16_seed_spread():
    rows = [{"model": "m", "config": "bf16", "seed": s, "ne": ne, "step_ms": 10.0} for s, ne in enumerate((0.80, 0.804))]
    rows += [{"model": "m", "config": "loka_k16_ne0.001", "seed": s, "ne": ne, "step_ms": 8.0, "fp8_share_fwd": 0.6}
             for s, ne in enumerate((0.801, 0.805))]
    rows += [{"model": "m", "config": "loka_all_fp8", "seed": s, "ne": ne, "step_ms": 7.0} for s, ne in
             enumerate((0.83, 0.84))]
    rows.append({"model": "m", "config": "loka_mere", "seed": 0, "ne": None, "step_ms": None, "error": "boom"})
    by = {e["config"]: e for e in study.summarize(rows)}
    assert by["bf16"]["bf16_spread"] == pytest.approx(0.004 / 0.80)
    loka = by["loka_k16_ne0.001"]
    assert loka["dne"] == pytest.approx(0.803 / 0.802 - 1) and loka["within"] and loka["speedup"] == 1.25
    assert loka["dne_paired"] == pytest.approx((0.801 / 0.80 + 0.805 / 0.804) / 2 - 1)
    assert not by["loka_all_fp8"]["within"] and by["loka_mere"]["seeds"] == 0 and "dne" not in by["loka_mere"]
    table = study.markdown(study.summarize(rows))
    assert "| m | loka_k16_ne0.001 | 2 |" in table and "60%" in table


def test_study_configs_name_each_budget_level():
    configs = study.study_configs([4, 16], [0.0003, 0.001], "default")
    assert list(configs) == ["bf16", "loka_k4_ne0.0003", "loka_k16_ne0.001", "loka_mere", "loka_per_site",
                             "loka_all_fp8"]
    assert dict(configs["loka_k16_ne0.001"].options) == {"noise_floor_multiple": 16, "max_ne_increase": 0.001}
    assert configs["bf16"].kind == "inductor"
    with pytest.raises(SystemExit):
        study.parse_args(["--multiples", "4,16", "--ne-increases", "0.001"])
