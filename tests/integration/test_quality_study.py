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


def test_forward_flops_kept_in_high_precision_are_split_by_reason():
    sites = [{"role": "fwd", "fp8": True, "flops": 500, "reason": "fp8_ok"},
             {"role": "fwd", "fp8": False, "flops": 300, "reason": "fp8_slower"},
             {"role": "fwd", "fp8": False, "flops": 200, "reason": "output_budget"},
             {"role": "dgrad", "fp8": False, "flops": 900, "reason": "fp8_slower"},
             {"role": "fwd", "fp8": False, "flops": None, "reason": "output_budget"}]
    assert study.kept_by_reason(sites) == {"fwd_kept_by_reason": {"fp8_slower": 0.3, "output_budget": 0.2}}
    summary = study.site_summary(sites)
    assert summary["fp8_share_fwd"] == 0.5 and summary["fwd_kept_by_reason"]["fp8_slower"] == 0.3
    assert study.site_summary([]) == {}
    rows = [{"model": "m", "config": "bf16", "seed": 0, "ne": 0.8},
            {"model": "m", "config": "loka", "seed": 0, "ne": 0.8, **summary},
            {"model": "m", "config": "loka", "seed": 1, "ne": 0.8, "fwd_kept_by_reason": {"fp8_slower": 0.1}}]
    loka = {e["config"]: e for e in study.summarize(rows)}["loka"]
    assert loka["fwd_kept_by_reason"] == pytest.approx({"fp8_slower": 0.2, "output_budget": 0.1})
    assert "fp8_slower 20%, output_budget 10%" in study.markdown(study.summarize(rows))


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


def test_summary_gives_the_paired_standard_error_and_the_rerun_noise():
    base = {0: 0.80, 1: 0.81, 2: 0.79}
    rows = [{"model": "m", "config": "bf16", "seed": s, "ne": ne} for s, ne in base.items()]
    rows += [{"model": "m", "config": study.REPLICATE, "seed": s, "ne": base[s] * f}
             for s, f in ((0, 1.004), (1, 0.998), (2, 1.003))]
    rows += [{"model": "m", "config": "loka", "seed": s, "ne": base[s] * f} for s, f in ((0, 1.01), (1, 0.99), (2, 1.0))]
    by = {e["config"]: e for e in study.summarize(rows)}
    assert by["loka"]["dne_paired"] == pytest.approx(0.0, abs=1e-12)
    assert by["loka"]["dne_paired_se"] == pytest.approx(0.01 / 3 ** 0.5)
    assert by["loka"]["rerun_noise"] == pytest.approx((0.004 + 0.002 + 0.003) / 3)
    assert by[study.REPLICATE]["dne_paired"] == pytest.approx((0.004 - 0.002 + 0.003) / 3)
    one_seed = study.summarize([r for r in rows if r["seed"] == 0])
    assert all(e["dne_paired_se"] is None for e in one_seed if "dne" in e)
    assert "| m | loka | 3 |" in study.markdown(study.summarize(rows))
    configs = study.study_configs([16], [0.001], "default", (), replicate=True)
    assert list(configs) == ["bf16", study.REPLICATE, "loka_k16_ne0.001"]
    assert configs[study.REPLICATE].kind == configs["bf16"].kind and study.is_bf16(study.REPLICATE)


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
    done = [_row("m", "bf16", 0, wall_s=10.0), _row("m", "loka", 0, wall_s=30.0), _row("m", "loka", 1, wall_s=50.0),
            _row("m", "loka_k16", 1, wall_s=70.0, setup_s=5.0)]
    seconds, basis = study.estimate_seconds([("m", "zoo", "loka", 2), ("m", "zoo", "other", 2),
                                             ("n", "zoo", "bf16", 0)], done)
    # model and config; model and kind (loka); a guess; one setup of m (seed 2), none measured for n
    assert seconds == pytest.approx(40.0 + 50.0 + study.guess_seconds("bf16", "tiny") + 5.0)
    assert "1 from model and config" in basis and "1 from model and kind" in basis and "1 from 20 s guessed" in basis
    seconds, basis = study.estimate_seconds([("m", "zoo", "bf16", 0), ("m", "zoo", "loka", 0)], [], "production")
    assert seconds == study.guess_seconds("bf16", "production") + study.guess_seconds("loka", "production")
    assert seconds > 2 * study.guess_seconds("loka", "tiny") and "150 s guessed" in basis


def test_shards_split_whole_model_and_seed_groups():
    plan = study.planned_rows(["z"], ["p", "q"], {"bf16": None, "loka": None}, seeds=2)
    shards = [study.shard_rows(plan, (i, 3)) for i in range(3)]
    assert sorted(row for shard in shards for row in shard) == sorted(plan)  # every row once
    for shard in shards:
        groups = {(model, seed) for model, _, _, seed in shard}
        assert shard and all(len([r for r in shard if (r[0], r[3]) == g]) == 2 for g in groups)


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


def test_a_row_whose_estimate_does_not_fit_the_time_left_is_left_for_the_next_call(tmp_path, capsys):
    """--total-seconds 5 and a 20 s guess per tiny row: the run prints its estimate (2 calls),
    starts no row and says what is left; --configs picks the rows."""
    path = study.main(["--zoo", "dlrm_dcnv2", "--public", "", "--seeds", "1", "--batch", "64", "--multiples", "16,64",
                       "--ne-increases", "0.001,0.003", "--rules", "loka_mere", "--configs", "bf16,loka_k16_ne0.001",
                       "--device", "cpu", "--total-seconds", "5", "--merge", "", "--out", str(tmp_path),
                       "--name", "cut"])
    out = capsys.readouterr().out
    assert "estimate: 2 of 2 rows to run (0 done earlier), 40 s (2 from 20 s guessed); about 8 call(s)" in out
    assert "stopping: dlrm_dcnv2/bf16/seed 0 would take about 20 s" in out and "2 row(s) left" in out
    assert json.loads(path.read_text())["rows"] == []
    with pytest.raises(SystemExit, match="unknown"):
        study.main(["--configs", "loka_k99_ne0.5", "--device", "cpu", "--out", str(tmp_path)])


def test_bf16_rows_serve_runs_with_the_speed_check_on_and_off(tmp_path, capsys):
    earlier = tmp_path / "earlier.json"
    rows = [_row("dlrm_dcnv2", "bf16", seed, ne=0.8 + 0.01 * seed, batch=64) for seed in range(2)]
    rows += [_row("dlrm_dcnv2", "loka_k16_ne0.001", seed, ne=0.8 + 0.01 * seed, batch=64, speed_check="off")
             for seed in range(2)]
    earlier.write_text(json.dumps({"rows": rows}))
    path = study.main(["--zoo", "dlrm_dcnv2", "--public", "", "--seeds", "2", "--batch", "64", "--multiples", "16",
                       "--ne-increases", "0.001", "--rules", "", "--speed-check", "off", "--device", "cpu",
                       "--merge", str(earlier), "--out", str(tmp_path), "--name", "off"])
    assert "0 of 4 rows to run (4 done earlier)" in capsys.readouterr().out
    by = {e["config"]: e for e in json.loads(path.read_text())["summary"]}
    assert by["bf16"]["seeds"] == 2 and by["loka_k16_ne0.001"]["dne_paired"] == pytest.approx(0.0)
