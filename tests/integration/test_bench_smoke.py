"""Smoke test of the training benchmark: tiny presets of every zoo model, a couple of steps,
eager + Inductor (+ loka when registered), then the JSON it wrote."""

import copy
import json
import math

import pytest
import torch

from benchmarks import train

NUMERIC = ["step_ms", "out_relerr", "grad_relerr", "grad_relerr_first", "out_relerr_init",
           "grad_relerr_init", "grad_relerr_first_init", "final_logloss", "final_ne", "final_auc",
           "train_gflops_per_sample"]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# Two zoo models with the harness's distinct input paths: the sequence one (HSTU) and the
# sparse-table one with bmm interactions (DLRM-DCNv2); the zoo's own tests build every model.
HARNESS_MODELS = ["hstu", "dlrm_dcnv2"]


def test_harness_runs_models_and_records_failures(tmp_path, one_thread, capsys):
    configs = ["eager_bf16", "inductor_bf16"]
    if "loka" in torch._dynamo.list_backends(exclude_tags=()):
        configs.append("loka")
    failing = ["no_such_config"]
    if train._torchao_version() is None:
        failing.append("torchao_rowwise")  # unavailable -> an error row, not a crash
    # The harness, not the Probe: loka rows without the probe window, which --warmup 1 could
    # not hold (the infer smoke below runs loka's default window).
    path = train.main([
        "--preset", "tiny", "--batch", "32", "--warmup", "1", "--steps", "2", "--quality-steps", "3",
        "--eval-batches", "2", "--device", "cpu", "--cpu-threads", "1", "--loka-options", '{"probe_steps": 0}',
        "--models", ",".join([*HARNESS_MODELS, "no_such_model"]),
        "--configs", ",".join(configs + failing), "--out", str(tmp_path), "--name", "smoke",
    ])
    assert path == tmp_path / "smoke.json"
    result = json.loads(path.read_text())
    assert {"device", "torch", "triton", "torchao", "date"} <= set(result["env"])
    rows = {(r["model"], r["config"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in [*HARNESS_MODELS, "no_such_model"] for c in configs + failing}
    assert all(rows["no_such_model", c]["error"].startswith("setup: ValueError") for c in configs)

    for m in HARNESS_MODELS:
        for c in configs:
            r = rows[m, c]
            assert r["error"] is None, (m, c, r["error"])
            assert r["peak_mem_gb"] is None  # CPU
            assert r["train_steps"] == 3
            for key in NUMERIC:
                assert isinstance(r[key], float) and math.isfinite(r[key]), (m, c, key, r[key])
            assert 0.0 <= r["final_auc"] <= 1.0 and r["final_logloss"] > 0
            # bf16 against an fp32 copy: small but not zero error.
            assert 0 < r["out_relerr"] < 0.1 and 0 < r["grad_relerr"] < 0.3
            assert 0 < r["out_relerr_init"] < 0.1 and 0 < r["grad_relerr_init"] < 0.3
            assert isinstance(r["within_quality_target"], bool)
        assert rows[m, "inductor_bf16"]["speedup_vs_inductor_bf16"] == pytest.approx(1.0)
        assert rows[m, "eager_bf16"]["speedup_vs_inductor_bf16"] > 0
        assert rows[m, "eager_bf16"]["quality_ref"] == "inductor_bf16"
        assert rows[m, "inductor_bf16"]["logloss_rel_bf16"] == pytest.approx(0.0)
        # Same initial weights and input: eager and Inductor bf16 land near each other.
        e, i = rows[m, "eager_bf16"]["out_relerr_init"], rows[m, "inductor_bf16"]["out_relerr_init"]
        assert 0.2 < e / i < 5
        for c in failing:
            assert rows[m, c]["error"] and rows[m, c]["step_ms"] is None
        # The FP8 ceiling of the bf16 Inductor step (CPU: op self time stands in for kernels).
        ceil = rows[m, "inductor_bf16"]["ceiling"]
        assert ceil["source"].startswith("CPU") and 0 < ceil["gemm_share"] < 1
        assert 1 < ceil["ceiling_1p6x"] < ceil["ceiling_2x"] < 2
        assert 0 < len(ceil["top_kernels"]) <= 10 and ceil["largest_non_gemm"]["ms"] > 0
        assert rows[m, "eager_bf16"]["ceiling"] is None

    table = capsys.readouterr().out
    assert "| model" in table and "no_such_config" in table and "FP8 ceiling" in table


def _quality_row(config: str, ne: float, model: str = "dlrm_dcnv2") -> dict:
    return {"model": model, "preset": "paper", "batch": 8192, "compile_scope": "dense", "config": config,
            "mode": "reduce-overhead", "step_ms": None, "out_relerr": None,
            "final_logloss": 0.3 * ne, "final_ne": ne, "final_auc": 0.75}


def test_training_quality_is_judged_against_the_bf16_rows_spread():
    """A training row's NE passes at most 0.1% above bf16 Inductor's, or the bf16 rows' own
    spread where that is larger (rounding-level changes move 200-step NE); lower passes."""
    rows = [_quality_row("inductor_bf16_ro", 0.8787), _quality_row("inductor_bf16_mk_ro", 0.8867),
            _quality_row("loka_ro", 0.8799), _quality_row("loka_all_fp8_ro", 0.9175),
            _quality_row("inductor_bf16_ro", 0.8787, model="masknet"),
            _quality_row("loka_ro", 0.8799, model="masknet"), _quality_row("torchao_rowwise_ro", 0.8790, "masknet"),
            _quality_row("loka_all_fp8_ro", 0.8700, model="masknet")]
    train.fill_relative(rows)
    by = {(r["model"], r["config"]): r for r in rows}
    assert by["dlrm_dcnv2", "loka_ro"]["bf16_logloss_spread"] == pytest.approx(0.0080 / 0.8787, rel=1e-3)
    assert by["dlrm_dcnv2", "loka_ro"]["within_quality_target"] is True   # +0.14%, floor 0.91%
    assert by["dlrm_dcnv2", "loka_all_fp8_ro"]["within_quality_target"] is False  # +4.4%
    assert by["masknet", "loka_ro"]["bf16_logloss_spread"] is None  # one bf16 row: no floor
    assert by["masknet", "loka_ro"]["within_quality_target"] is False  # +0.14% > 0.1%
    assert by["masknet", "torchao_rowwise_ro"]["within_quality_target"] is True  # +0.03%
    assert by["masknet", "loka_all_fp8_ro"]["within_quality_target"] is True  # -0.99%: better


def test_speed_check_prediction_sits_beside_the_measured_saving():
    """predicted_saving_ms sums bf16_us - fp8_us over the timed FP8 sites only; a row's
    step_saving_ms is its bf16 reference's step minus its own."""
    from types import SimpleNamespace as Site
    sites = [Site(fp8=True, bf16_us=236.5, fp8_us=211.0), Site(fp8=True, bf16_us=236.5, fp8_us=211.0),
             Site(fp8=False, bf16_us=514.6, fp8_us=552.3), Site(fp8=True, bf16_us=None, fp8_us=None)]
    assert train.predicted_saving_ms(sites) == pytest.approx(0.051)
    assert train.predicted_saving_ms(sites[2:]) is None
    rows = [{**_quality_row("inductor_bf16_ro", 0.8), "step_ms": 45.12},
            {**_quality_row("loka_ro", 0.8), "step_ms": 45.15}]
    train.fill_relative(rows)
    assert rows[1]["step_saving_ms"] == pytest.approx(-0.03) and rows[0]["step_saving_ms"] == 0.0


# --warmup 4: loka's default probe window (2 calls), its close and one more, all untimed.
INFER_TINY = ["--models", "dlrm_dcnv2", "--preset", "tiny", "--iters", "2", "--warmup", "4",
              "--device", "cpu", "--cpu-threads", "1"]


def test_infer_harness_times_each_batch_and_records_errors(tmp_path, one_thread, capsys):
    from benchmarks import infer
    # Off CUDA a reduce-overhead name runs as its default-mode twin.
    assert infer.config_for_device("loka_ro_no_cached_weights", cuda=False) == "loka_no_cached_weights"
    assert infer.config_for_device("torchao_rowwise_ro", cuda=False) == "torchao_rowwise"
    assert infer.config_for_device("loka_calibrated_ro", cuda=False) == "loka_calibrated"
    assert infer.config_for_device("inductor_bf16_ro", cuda=True) == "inductor_bf16_ro"
    # An ablation of a calibrated row is calibrated too; the named no-cached-weights row is not.
    for name, calibrated in (("loka_calibrated_ro_no_gemm_epilogue", True), ("loka_calibrated_no_pad", True),
                             ("loka_ro_no_cached_weights", False), ("loka_ro_no_gemm_epilogue", False)):
        assert infer.calibrated(name, infer.resolve_config(name)) is calibrated, name
    loka = "loka" in torch._dynamo.list_backends(exclude_tags=())
    path = infer.main([
        *INFER_TINY, "--configs", "inductor_bf16,loka_ro,loka_calibrated_ro", "--batches", "1,16",
        "--train-steps", "3", "--eval-batches", "2", "--calibration-batches", "2",
        "--out", str(tmp_path), "--name", "infer_smoke",
    ])
    assert path == tmp_path / "infer_smoke.json"
    result = json.loads(path.read_text())
    assert {"device", "torch", "triton", "torchao", "date"} <= set(result["env"])
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"inductor_bf16", "loka", "loka_calibrated"}
    for c, r in rows.items():
        # Every row starts from the same trained master: bf16 training, train.py's batch.
        assert r["training"]["steps"] == 3 and r["training"]["batch"] == 256
        assert r["training"]["config"] == "eager_bf16" and math.isfinite(r["training"]["last_loss"])
        if c != "inductor_bf16" and not loka:
            assert r["error"] and not r["per_batch"]
            continue
        assert r["error"] is None, (c, r["error"])
        assert r["mode"] == "default" and [e["batch"] for e in r["per_batch"]] == [1, 16]
        for e in r["per_batch"]:
            for key in ("median_ms", "p10_ms", "p90_ms", "rows_per_s", "speedup_vs_inductor_bf16"):
                assert isinstance(e[key], float) and math.isfinite(e[key]) and e[key] > 0, (c, key, e[key])
            assert e["p10_ms"] <= e["median_ms"] <= e["p90_ms"]
        # bf16 (or FP8) against an fp32 copy at the largest batch: small but not zero error.
        assert r["error_batch"] == 16 and 0 < r["out_relerr"] < 0.1
        # Held-out quality at the largest batch, relative to Inductor bf16 (same mode).
        assert r["eval_batch"] == 16 and r["eval_rows"] == 32
        for key in ("logloss", "ne", "auc", "logloss_rel_bf16", "ne_rel_bf16", "auc_rel_bf16"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (c, key, r[key])
        assert r["logloss"] > 0 and r["ne"] > 0 and 0 <= r["auc"] <= 1
        assert isinstance(r["within_quality_target"], bool)
    ref = rows["inductor_bf16"]
    assert all(e["speedup_vs_inductor_bf16"] == pytest.approx(1.0) for e in ref["per_batch"])
    assert ref["ne_rel_bf16"] == ref["auc_rel_bf16"] == ref["logloss_rel_bf16"] == 0.0
    assert ref["within_quality_target"] is True and ref["calibration"] is None
    if loka:
        report = rows["loka"]["loka_report"]
        assert report["summary"].startswith("loka:") and "cached_weights" in report["mods"]
        assert report["static_scale_sites"] == 0 and rows["loka"]["calibration"] is None
        # The calibrated row: per-site calibration errors within loka's error budget, and
        # its FP8 sites cast A with those constant scales.
        cal = rows["loka_calibrated"]["calibration"]
        assert cal["policy"] == "amax" and cal["batch"] == 16 and cal["batches"] == 2
        assert cal["site_errors"] and all(0 < e < 0.1 for e in cal["site_errors"].values())
        assert cal["max_error"] == max(cal["site_errors"].values())
        assert rows["loka_calibrated"]["loka_report"]["static_scale_sites"] > 0

    table = capsys.readouterr().out
    assert "| model" in table and "ms@16" in table and "x@1" in table and "dAUC%" in table
    if loka:
        assert "static-scale sites (amax)" in table


def test_infer_quality_is_measured_on_the_trained_model(tmp_path, one_thread):
    """Quality (and the fp32 reference) come from the trained master: eager bf16 with and
    without 3 training steps gives another held-out logloss and another output."""
    from benchmarks import infer
    rows = {}
    for steps in (0, 3):
        path = infer.main([*INFER_TINY, "--configs", "eager_bf16", "--batches", "16", "--train-steps", str(steps),
                           "--eval-batches", "2", "--out", str(tmp_path), "--name", f"steps{steps}"])
        (rows[steps],) = json.loads(path.read_text())["rows"]
    untrained, trained = rows[0], rows[3]
    assert untrained["training"] is None and trained["training"]["steps"] == 3
    for r in (untrained, trained):
        assert r["error"] is None and math.isfinite(r["logloss"])
        assert r["ne_rel_bf16"] is None  # no inductor_bf16 row to compare with
    assert abs(trained["logloss"] / untrained["logloss"] - 1) > 1e-4, (trained["logloss"], untrained["logloss"])
    assert trained["out_relerr"] != untrained["out_relerr"]


def test_infer_profile_runs_on_cpu(tmp_path, one_thread):
    """The per-kernel inference profile (a GPU tool) still runs its whole path on CPU: it
    builds its setup through the inference harness, so a change there shows here first."""
    from benchmarks import profile_infer
    torch.set_num_threads(1)
    profile_infer.main(["--model", "dlrm_dcnv2", "--preset", "tiny", "--device", "cpu", "--batch", "16",
                        "--configs", "loka", "--top", "5", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "profile_infer_dlrm_dcnv2_16.json").read_text())["loka"]
    assert result["total_ms"] > 0 and math.isfinite(result["total_ms"])
    assert "inference/" in result["sites"]


def test_dgrad_cast_benchmark_measures_each_variant_on_cpu(one_thread):
    """The gradient-cast benchmark (a GPU tool) runs its four compiled backwards on CPU at a
    tiny shape: FP8 variants lose precision against fp64 that bf16 does not, and the delayed
    variant's next-step amax is the gradient's own."""
    from benchmarks import dgrad_cast
    import loka_compile  # noqa: F401  (registers the ops)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = {r["variant"]: r for r in dgrad_cast.measure("tiny", 32, 64, 16, "silu", torch.device("cpu"))}
    assert list(rows) == list(dgrad_cast.VARIANTS)
    assert all(r["us"] > 0 and math.isfinite(r["dx_sqnr_db"]) for r in rows.values())
    assert rows["bf16"]["dx_sqnr_db"] > 45
    for variant in ("rowwise", "static", "delayed"):
        assert 20 < rows[variant]["dx_sqnr_db"] < rows["bf16"]["dx_sqnr_db"] - 10, rows[variant]
    assert rows["delayed"]["next_amax_rel_diff"] < 1e-2


def test_conv1x1_benchmark_runs_each_kind_of_variant_on_cpu(tmp_path, one_thread):
    """The CIN benchmark (a GPU tool) at tiny sizes on CPU: the block as written, a
    Dynamo-graph rewrite before Inductor (conv1x1 and transposed_linear) and loka, each a
    row without error whose output and gradients are those of the fp32 block within bf16's
    error (loka's within FP8's); the JSON and the table written."""
    from benchmarks import conv1x1
    torch.set_num_threads(1)
    variants = ["inductor_conv", "inductor_w_at_x", "loka"]
    # scalar C++ code: on CPU the conv1x1 Mod leaves training graphs alone under vectorized code
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        path = conv1x1.main(["--tiny", "--variants", ",".join(variants), "--out", str(tmp_path), "--name", "cin"])
    assert path == tmp_path / "cin.json" and (tmp_path / "cin.md").read_text().startswith("# conv1x1")
    result = json.loads(path.read_text())
    assert {"device", "torch", "triton", "date"} <= set(result["env"])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants
    for name, r in rows.items():
        assert r["error"] is None, (name, r["error"])
        assert r["ms"] > 0 and math.isfinite(r["ms"]) and r["vs_inductor_conv"] > 0
        # loka's row runs forward and dgrad GEMMs in FP8 (the relative output budget admits
        # them here): its gradient error measured 0.128 (tiny CIN, CPU), bf16 rows' under 0.1.
        grad_bound = 0.2 if name == "loka" else 0.1
        assert 0 < r["out_err_vs_fp32"] < 0.05 and 0 < r["grad_err_vs_fp32"] < grad_bound, r
    assert rows["inductor_conv"]["vs_inductor_conv"] == pytest.approx(1.0)
    assert rows["inductor_conv"]["cin_fp8_sites"] is None
    # loka's CIN GEMMs are sites of every role (the Mod made linears of the convolutions)
    assert all(v.split("/")[1] == "2" for v in rows["loka"]["cin_fp8_sites"].values()), rows["loka"]


def test_batchnorm_mlp_benchmark_runs_the_mod_off_and_on_on_cpu(tmp_path, one_thread):
    """The BatchNorm MLP benchmark (a GPU tool) at a tiny fp32 case on CPU: loka without FP8 and
    the linear_batchnorm Mod on, a row without error whose output and gradients are the fp64
    block's within fp32's error, the Mod having rewritten both BatchNorms."""
    pytest.importorskip("torch_rechub", reason="the public extra")
    from benchmarks import batchnorm_mlp
    path = batchnorm_mlp.main(["--shapes", "32x16x32-16", "--precisions", "fp32", "--variants",
                               "loka_bf16_mod", "--steps", "2", "--warmup", "1", "--out", str(tmp_path),
                               "--name", "bnm"])
    assert (tmp_path / "bnm.md").read_text().startswith("# BatchNorm MLPs")
    [row] = json.loads(path.read_text())["rows"]
    assert row["variant"] == "loka_bf16_mod" and row["error"] is None and row["ms"] > 0, row["error"]
    assert row["out_err"] < 1e-5 and row["dx_err"] < 1e-5 and row["grad_err"] < 1e-5, row
    assert (row["fp8_sites"], row["mod_rewrites"]) == (0, 2)


def test_linear_batchnorm_backward_moves_five_eighths_of_inductors_bytes(one_thread):
    """Inductor's GPU kernel plan read on CPU (benchmarks.inductor_code_on_cpu) for a BatchNorm
    MLP's training step: with linear_batchnorm the backward's kernels move 5/8 of the bytes over
    [B, *] tensors that they move without it (2 + 3 passes per BatchNorm against 3 + 4 + 1)."""
    from benchmarks import inductor_code_on_cpu as code_on_cpu
    torch.manual_seed(0)
    model, x = code_on_cpu.build_mlp(64, (128, 64)).bfloat16(), torch.randn(512, 64, dtype=torch.bfloat16)
    backward_mb = {}
    for mods in ([], ["linear_batchnorm"]):
        torch._dynamo.reset()
        codes = []
        with code_on_cpu.gpu_codegen_on_cpu(codes):
            options = {"probe_steps": 0, "emulate": False, "enabled_mods": mods}
            torch.compile(copy.deepcopy(model), backend="loka", options=options)(x).float().sum().backward()
        _, backward = (code_on_cpu.kernel_traffic(code, 512) for code in codes)
        backward_mb[bool(mods)] = sum(k["read_mb"] + k["written_mb"] for k in backward)
    assert torch._inductor.config.cpu_backend == "cpp"   # Inductor's settings restored
    assert backward_mb[True] == pytest.approx(5 / 8 * backward_mb[False], rel=0.05), backward_mb


def test_kernel_traffic_counts_a_cat_of_a_transpose_as_copies_of_its_bytes(one_thread):
    """A cat of a transposed input and a plain one, read on CPU as Inductor's GPU code: every
    kernel is a copy (benchmarks.interaction_copies.kernel_kind), and together they read each
    input once and write the output once, views into the cat's buffer included."""
    from benchmarks import inductor_code_on_cpu as code_on_cpu
    from benchmarks.interaction_copies import kernel_kind
    a = torch.randn(48, 16, 32, dtype=torch.bfloat16)
    b = torch.randn(48, 8, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    codes = []
    with code_on_cpu.gpu_codegen_on_cpu(codes) as inductor:
        out = torch.compile(lambda a, b: torch.cat([a.transpose(1, 2), b], dim=1), backend=inductor)(a, b)
    assert torch.equal(out, torch.cat([a.transpose(1, 2), b], dim=1))
    [rows] = [code_on_cpu.kernel_traffic(code, 48, batch_anywhere=True) for code in codes]
    assert rows and {kernel_kind(r["kernel"]) for r in rows} == {"copy"}, rows
    expected_mb = 2 * (a.numel() + b.numel()) * 2 / 1e6
    assert sum(r["read_mb"] + r["written_mb"] for r in rows) == pytest.approx(expected_mb), rows
    assert kernel_kind("triton_poi_fused__to_copy_permute_3") == "cast+copy"
    assert kernel_kind("triton_per_fused_cat_mul_sum_view_1") == "compute"


def _public_rows():
    """Four rows of the public suite's runner: one profiled model (A, training) and one not (B)."""
    base = {"preset": "production", "batch": 8192, "compile_mode": "reduce-overhead"}
    return [
        {**base, "model": "lib.A", "mode": "train", "config": "inductor_bf16_ro", "step_ms": 10.0, "ceiling_1p6x": 1.3},
        {**base, "model": "lib.A", "mode": "train", "config": "loka_ro", "step_ms": 8.0, "ceiling_1p6x": 1.1},
        {**base, "model": "lib.B", "mode": "infer", "config": "inductor_bf16_ro", "step_ms": 4.0},
        {**base, "model": "lib.B", "mode": "infer", "config": "loka_ro", "step_ms": 5.0},
    ]


def test_public_suite_ceiling_is_the_profiled_inductor_rows():
    from benchmarks.public import run
    assert run.ceilings(_public_rows()) == {("lib.A", "production", 8192, "train"): 1.3}
    assert run.ceilings(_public_rows()[1:]) == {("lib.A", "production", 8192, "train"): 1.1}  # another row's


def test_public_suite_plots_speedup_against_the_ceiling(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    from benchmarks.public import run
    rows = _public_rows()
    run.fill_relative(rows)
    assert [r.get("speedup_vs_inductor_bf16") for r in rows] == [1.0, 1.25, 1.0, 0.8]
    run.plot_speedups(rows, tmp_path / "suite.png")
    assert (tmp_path / "suite.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_public_suite_results_stand_without_matplotlib(tmp_path, monkeypatch, capsys):
    import sys
    from benchmarks.public import run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, as without the bench extra
    path = tmp_path / "suite.json"
    run.write_outputs(path, {"preset": "production"}, _public_rows())
    assert len(json.loads(path.read_text())["rows"]) == 4
    assert "lib.A" in path.with_suffix(".md").read_text()
    assert not path.with_suffix(".png").exists()
    assert "plot skipped" in capsys.readouterr().out
