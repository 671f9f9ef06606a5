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
    unchecked = study.study_configs([16], [0.001], "default", ("loka_all_fp8",), speed_check=False)
    assert dict(unchecked["loka_k16_ne0.001"].options)["speed_check"] is False
    assert unchecked["loka_all_fp8"].options.count(("speed_check", False)) == 1 and unchecked["bf16"].options == ()
    with pytest.raises(SystemExit):
        study.parse_args(["--multiples", "4,16", "--ne-increases", "0.001"])


def _row(model, config, seed, ne=0.8, error=None, wall_s=10.0, **setting):
    return {"model": model, "config": config, "seed": seed, "ne": ne, "error": error, "wall_s": wall_s,
            **{"preset": "tiny", "steps": 500, "batch": None, "mode": "default", "speed_check": "on", **setting}}


def test_rows_merge_across_calls_and_finished_rows_are_not_run_again(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": [_row("m", "bf16", 0), _row("m", "bf16", 1, ne=None,
                                                                      error="BudgetExceeded: skipped")]}))
    second.write_text(json.dumps({"rows": [_row("m", "bf16", 1, ne=0.81), _row("m", "bf16", 0, ne=None,
                                                                             error="BudgetExceeded: skipped")]}))
    rows = study.load_rows([first, second, tmp_path / "missing.json"])
    # a finished row is never replaced by an unfinished one; an unfinished one is by a finished one
    assert sorted((r["seed"], r["ne"]) for r in rows) == [(0, 0.8), (1, 0.81)]
    assert study.finished(_row("m", "c", 0, ne=None, error="RuntimeError: boom"))
    assert not study.finished(_row("m", "c", 0, ne=None, error="BudgetExceeded: --max-seconds 60 spent"))
    plan = study.planned_rows(["z"], ["p"], {"bf16": None, "loka": None}, seeds=2)
    assert plan[:4] == [("z", "zoo", "bf16", 0), ("z", "zoo", "loka", 0), ("p", "public", "bf16", 0),
                        ("p", "public", "loka", 0)] and len(plan) == 8


def test_the_estimate_uses_the_closest_measured_rows_and_guesses_the_rest():
    done = [_row("m", "bf16", 0, wall_s=10.0), _row("m", "loka", 0, wall_s=30.0), _row("m", "loka", 1, wall_s=50.0)]
    seconds, basis = study.estimate_seconds([("m", "zoo", "loka", 2), ("m", "zoo", "other", 0),
                                             ("n", "zoo", "bf16", 0)], done)
    assert seconds == pytest.approx(40.0 + 30.0 + 30.0)  # model and config; model; any row
    assert "1 from model and config" in basis and "1 from model" in basis and "1 from any row" in basis
    seconds, basis = study.estimate_seconds([("m", "zoo", "bf16", 0)], [])
    assert seconds == study.GUESS_ROW_SECONDS and "guessed" in basis


def test_a_run_whose_rows_are_all_done_writes_the_merged_study_without_training(tmp_path, capsys):
    earlier = tmp_path / "earlier.json"
    rows = [_row("dlrm_dcnv2", config, seed, ne=0.80 + 0.001 * seed + (config != "bf16") * 0.0005, batch=64)
            for seed in range(2) for config in ("bf16", "loka_k16_ne0.001")]
    rows.append(_row("dlrm_dcnv2", "bf16", 0, ne=0.5, steps=6, batch=64))  # another setting: kept, not summarized
    earlier.write_text(json.dumps({"rows": rows}))
    path = study.main(["--zoo", "dlrm_dcnv2", "--public", "", "--seeds", "2", "--batch", "64", "--multiples", "16",
                       "--ne-increases", "0.001", "--rules", "", "--device", "cpu", "--merge", str(earlier),
                       "--out", str(tmp_path), "--name", "merged"])
    data = json.loads(path.read_text())
    assert len(data["rows"]) == 5
    by = {e["config"]: e for e in data["summary"]}
    assert by["bf16"]["seeds"] == 2 and by["loka_k16_ne0.001"]["dne"] == pytest.approx(0.0005 / 0.8005)
    assert "0 of 4 rows to run (4 done earlier)" in capsys.readouterr().out
