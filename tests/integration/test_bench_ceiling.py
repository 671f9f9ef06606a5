"""The training harness's FP8 ceiling (GEMM-kernel classifier, ceiling formula, profile
summary), its all-FP8 / per-Mod ablation configs, and its sparse-gradient optimizer."""

import json
import math

import pytest
import torch

from benchmarks import ceiling, train
from benchmarks.zoo import build_model

# Kernel names as torch.profiler reports them on H100/H200 (cuBLAS, cuBLASLt, CUTLASS, nvjet,
# Inductor Triton templates, loka's Triton GEMM) and, on CPU, as ATen op names.
GEMM_NAMES = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
    "_kernel__5x_cublas",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
    "cutlass::gemm::collective::CollectiveMma<...> > >(...)",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
    "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const> > >(...)",
    "triton_tem_fused_mm_3",
    "triton_tem_fused_addmm_relu_0",
    "triton_tem_fused_bmm_7",
    "triton_tem_fused__scaled_mm_2",
    "_fp8_gemm_tma_kernel",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
]
NOT_GEMM_NAMES = [
    "triton_poi_fused_addmm_relu_0",  # bias + ReLU after a cuBLAS addmm: named after it, not one
    "triton_per_fused_native_layer_norm_native_layer_norm_backward_5",
    "triton_red_fused__to_copy_sum_3",
    "triton_poi_fused__to_copy_abs_amax_clamp_div_mul_4",
    "triton_tem_fused_flex_attention_0",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
    "void at::native::(anonymous namespace)::EmbeddingBag_updateOutputKernel_sum_mean<float, long>"
    "(long const*, long const*, float const*, float*, long*, long, long, long, long, long, long, float const*, "
    "long)",
    "void at::native::(anonymous namespace)::compute_grad_weight<float, long>(long const*, float const*, long)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor...>(...)",
    "Memcpy DtoD (Device -> Device)",
    "Memset (Device)",
    "_quantize_rows_kernel",
    "aten::native_layer_norm",
    "aten::embedding_bag",
    "aten::mul",
    "Torch-Compiled Region: 0/0",
]


@pytest.mark.parametrize("name", GEMM_NAMES)
def test_gemm_kernels_are_gemms(name):
    assert ceiling.is_gemm_kernel(name)


@pytest.mark.parametrize("name", NOT_GEMM_NAMES)
def test_other_kernels_are_not_gemms(name):
    assert not ceiling.is_gemm_kernel(name)


def test_ceiling_formula():
    assert ceiling.fp8_ceiling(0.0) == 1.0
    assert ceiling.fp8_ceiling(1.0, 1.6) == pytest.approx(1.6)
    assert ceiling.fp8_ceiling(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    # ANCHORS.md's ceiling table: 43% -> 1.19x / 1.27x, 65% -> 1.32x / 1.48x.
    assert round(ceiling.fp8_ceiling(0.43, 1.6), 2) == 1.19 and round(ceiling.fp8_ceiling(0.43, 2.0), 2) == 1.27
    assert round(ceiling.fp8_ceiling(0.65, 1.6), 2) == 1.32 and round(ceiling.fp8_ceiling(0.65, 2.0), 2) == 1.48
    shares = [i / 10 for i in range(11)]
    values = [ceiling.fp8_ceiling(g) for g in shares]
    assert values == sorted(values)  # more GEMM time, more to gain
    with pytest.raises(ValueError):
        ceiling.fp8_ceiling(1.5)
    with pytest.raises(ValueError):
        ceiling.fp8_ceiling(0.5, 0.0)


def test_summary_aggregates_by_name_and_ranks():
    times = [("triton_tem_fused_mm_0", 300.0), ("triton_poi_fused_addmm_relu_0", 100.0),
             ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", 200.0),
             ("triton_per_fused_native_layer_norm_backward_1", 250.0),
             ("triton_poi_fused_addmm_relu_0", 100.0), ("Memset (Device)", 50.0)]
    s = ceiling.summarize_kernels(times, "test", top=3)
    assert s["source"] == "test" and s["kernels"] == 5
    assert s["total_ms"] == pytest.approx(1.0) and s["gemm_ms"] == pytest.approx(0.5)
    assert s["gemm_share"] == pytest.approx(0.5)
    assert s["ceiling_1p6x"] == pytest.approx(ceiling.fp8_ceiling(0.5, 1.6))
    assert s["ceiling_2x"] == pytest.approx(ceiling.fp8_ceiling(0.5, 2.0))
    big = s["largest_non_gemm"]
    assert big["name"] == "triton_per_fused_native_layer_norm_backward_1" and big["ms"] == pytest.approx(0.25)
    top = s["top_kernels"]
    assert [k["name"] for k in top] == ["triton_tem_fused_mm_0", "triton_per_fused_native_layer_norm_backward_1",
                                        "triton_poi_fused_addmm_relu_0"]
    assert [k["gemm"] for k in top] == [True, False, False]
    assert top[2]["calls"] == 2 and top[2]["ms"] == pytest.approx(0.2)
    json.dumps(s)  # goes into the JSON as is
    long = ceiling.summarize_kernels([("x" * 500, 1.0)], "test", name_chars=50)
    assert len(long["top_kernels"][0]["name"]) == 50
    with pytest.raises(ValueError):
        ceiling.summarize_kernels([], "test")


def test_cpu_profile_finds_the_matmuls():
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    norm = torch.nn.LayerNorm(256)

    def step():
        norm(a @ b).sum()

    times, source = ceiling.profile_kernels(step, cuda=False)
    assert source == ceiling.CPU_SOURCE
    names = {n for n, _ in times}
    assert "aten::mm" in names and not any(n.startswith("ProfilerStep") for n in names)
    s = ceiling.summarize_kernels(times, source)
    assert 0 < s["gemm_share"] < 1 and 1 < s["ceiling_1p6x"] < s["ceiling_2x"] < 2


# ------------------------------------------------------------------ configs


def test_all_fp8_and_ablation_configs():
    for name, mode in [("loka_all_fp8", "default"), ("loka_all_fp8_ro", "reduce-overhead")]:
        cfg = train.CONFIGS[name]
        assert cfg.kind == "loka" and cfg.mode == mode
        assert dict(cfg.options) == {"speed_check": False, "probe_steps": 0}
    # the row's own options win over --loka-options
    assert train.loka_options_for(train.CONFIGS["loka_all_fp8_ro"], {"speed_check": True, "probe_steps": 3,
                                                                      "recipe": "rowwise"}) == {
        "speed_check": False, "probe_steps": 0, "recipe": "rowwise", "mode": "reduce-overhead"}
    cfg = train.lookup_config("loka_ro_no_fused_casts")
    assert cfg.mode == "reduce-overhead" and cfg.ablated == "fused_casts"
    assert dict(cfg.options) == {"disabled_mods": ("fused_casts",)}
    cfg = train.lookup_config("loka_all_fp8_ro_no_pad")
    assert dict(cfg.options) == {"speed_check": False, "probe_steps": 0, "disabled_mods": ("pad",)}
    assert train.lookup_config("inductor_bf16_no_pad") is None
    assert not any(c.ablated for c in train.CONFIGS.values())  # 'all' runs no ablation


def test_loka_rows_keep_the_probe_window_out_of_the_timed_calls():
    """loka's default window (2 calls), the call that closes it and one more are untimed."""
    if "loka" not in torch._dynamo.list_backends(exclude_tags=()):
        pytest.skip("loka backend not registered")
    assert train.loka_untimed_calls(train.CONFIGS["loka_ro"]) == 4
    assert train.loka_untimed_calls(train.CONFIGS["loka"], {"probe_steps": 5}) == 7
    assert train.loka_untimed_calls(train.CONFIGS["loka"], {"probe_steps": 0}) == 0
    assert train.loka_untimed_calls(train.CONFIGS["inductor_bf16"]) == 0


def test_ablation_rows_follow_their_base():
    try:
        mods = train.loka_mods()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"loka_compile.passes not importable: {e}")
    assert mods and all(isinstance(m, str) for m in mods)
    out = train.ablation_configs(["inductor_bf16_ro", "loka_ro", "loka_all_fp8_ro"], "auto", cuda=True)
    assert out == ["inductor_bf16_ro", "loka_ro", *[f"loka_ro_no_{m}" for m in mods], "loka_all_fp8_ro"]
    assert train.ablation_configs(["loka"], "auto", cuda=True) == ["loka", *[f"loka_no_{m}" for m in mods]]
    assert train.ablation_configs(["eager_bf16"], "auto", cuda=False) == ["eager_bf16", "loka",
                                                                          *[f"loka_no_{m}" for m in mods]]
    assert train.ablation_configs(["loka_all_fp8"], "loka_all_fp8", cuda=False) == [
        "loka_all_fp8", *[f"loka_all_fp8_no_{m}" for m in mods]]
    assert train.resolve_config(f"loka_ro_no_{mods[0]}").ablated == mods[0]
    with pytest.raises(ValueError, match="MODS"):
        train.resolve_config("loka_ro_no_such_mod")
    with pytest.raises(ValueError, match="unknown config"):
        train.resolve_config("nope")


def test_opt_in_mod_rows_switch_one_mod_on():
    from loka_compile.passes.mods import OPT_IN_MODS
    cfg = train.resolve_config(f"loka_all_fp8_ro_with_{OPT_IN_MODS[0]}")
    assert cfg.enabled == OPT_IN_MODS[0] and cfg.mode == "reduce-overhead"
    assert dict(cfg.options) == {**dict(train.CONFIGS["loka_all_fp8_ro"].options), "enabled_mods": (OPT_IN_MODS[0],)}
    with pytest.raises(ValueError, match="OPT_IN_MODS"):
        train.resolve_config("loka_ro_with_no_such_mod")
    assert train.lookup_config("inductor_bf16_with_linear_batchnorm") is None


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _tiny_run(tmp_path, *extra):
    return json.loads(train.main([
        "--preset", "tiny", "--batch", "32", "--warmup", "1", "--steps", "1", "--quality-steps", "0",
        "--eval-batches", "1", "--device", "cpu", "--cpu-threads", "1", "--out", str(tmp_path),
        "--name", "t", *extra]).read_text())["rows"]


def test_unknown_loka_option_is_an_error_row(tmp_path, one_thread, monkeypatch):
    """A loka row whose option the installed loka does not know (as disabled_mods was before
    LokaConfig had it) records the error; the run goes on."""
    if "loka" not in torch._dynamo.list_backends(exclude_tags=()):
        pytest.skip("loka backend not registered")
    monkeypatch.setitem(train.CONFIGS, "loka_bogus",
                        train.Config("loka_bogus", "loka", "default", options=(("no_such_option", 1),)))
    rows = _tiny_run(tmp_path, "--models", "dlrm_dcnv2", "--configs", "loka_bogus,loka,eager_bf16",
                     "--ceiling-configs", "none")
    by = {r["config"]: r for r in rows}
    assert "no_such_option" in by["loka_bogus"]["error"] and by["loka_bogus"]["step_ms"] is None
    # --warmup 1 would time loka's default probe window: an error row too
    assert "--warmup 1 would time the probe window" in by["loka"]["error"] and by["loka"]["step_ms"] is None
    assert by["loka_bogus"]["loka_options"] == {"no_such_option": 1, "mode": "default"}
    assert by["eager_bf16"]["error"] is None


# ------------------------------------------------------------------ sparse embeddings


def test_sparse_tables_train_with_sparse_adam(tmp_path, one_thread):
    model, _ = build_model("hstu", "tiny", sparse=True)
    args = train.parse_args(["--lr", "1e-3", "--sparse-lr", "1e-2"])
    opt, sched = train._make_optimizer(model, args, torch.device("cpu"))
    kinds = [type(o).__name__ for o in opt.items]
    assert kinds == ["Adam", "SparseAdam"] and len(sched.items) == 2
    n_sparse = sum(p.numel() for g in opt.items[1].param_groups for p in g["params"])
    assert n_sparse == sum(p.numel() for p in model.sparse.parameters())
    dense_model, _ = build_model("hstu", "tiny")
    opt, _ = train._make_optimizer(dense_model, args, torch.device("cpu"))
    assert [type(o).__name__ for o in opt.items] == ["Adam"]

    rows = _tiny_run(tmp_path, "--models", "dlrm_dcnv2,hstu", "--configs", "eager_bf16",
                     "--sparse-embeddings", "on", "--ceiling-configs", "none")
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["sparse_embeddings"] is True and r["train_steps"] == 2
        assert math.isfinite(r["out_relerr"]) and math.isfinite(r["grad_relerr"])
