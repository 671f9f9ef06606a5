"""benchmarks/distributed.py: the bytes its hooks count are those the collectives move (two CPU
ranks over gloo, against the parameter sizes and the analytic count), and its derived columns
and merge."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spawn_ranks import run_ranks

WORLD_SIZE = 2
STEPS = 2


class TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(32, 64), nn.Linear(64, 16)  # every dim 0 even: no shard padding

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _steps(model, forward, rank):
    data = torch.Generator().manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(forward(torch.randn(8, 32, generator=data)), torch.randn(8, 16, generator=data)).backward()
        optimizer.step()


def _count(rank):
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    from benchmarks import distributed as bench

    torch.manual_seed(0)
    model = TwoParts()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp_bytes = bench.CommBytes(WORLD_SIZE)
    bench.count_ddp(ddp, ddp_bytes)
    _steps(model, ddp, rank)

    torch.manual_seed(0)
    model = TwoParts()
    parts = [model.first, model.second]
    for part in parts:
        fully_shard(part)
    fully_shard(model)
    counted = bench.CommBytes(WORLD_SIZE)
    bench.count_fsdp2([*parts, model], counted)
    _steps(model, model, rank)
    analytic = bench.CommBytes(WORLD_SIZE)
    config = bench.CONFIGS["fsdp2_bf16"]
    bench.analytic_fsdp2_bytes(SimpleNamespace(model=model, parts=parts), analytic, STEPS,
                               lambda part, p: bench.gathered_bytes(config, torch.device("cpu"), part, p))
    return {"ddp": ddp_bytes.per_step(STEPS), "fsdp2": counted.per_step(STEPS), "analytic": analytic.per_step(STEPS)}


@pytest.mark.slow
def test_counted_bytes_are_what_the_collectives_move(tmp_path):
    fp32_bytes = 4 * sum(p.numel() for p in TwoParts().parameters())
    for r in run_ranks(_count, (), WORLD_SIZE, 180, tmp_path):
        assert r["ddp"]["all_reduce_payload"] == fp32_bytes  # every gradient once per step
        assert r["ddp"]["wire_bytes_per_rank"] == fp32_bytes  # a ring: 2 (N - 1) / N of it
        fsdp2 = r["fsdp2"]
        assert fsdp2["bytes_method"] == "counted"
        # each part gathered for forward and again for backward; every gradient reduce-scattered once
        assert fsdp2["all_gather_payload"] == 2 * fp32_bytes and fsdp2["reduce_scatter_payload"] == fp32_bytes
        assert {k: fsdp2[k] for k in ("all_gather_payload", "reduce_scatter_payload")} == \
            {k: r["analytic"][k] for k in ("all_gather_payload", "reduce_scatter_payload")}


def _row(config, world, step_ms, ne, strategy):
    return {"config": config, "world_size": world, "step_ms": step_ms, "ne": ne, "strategy": strategy}


def test_derived_columns_and_merge(tmp_path):
    from benchmarks import distributed as bench

    one = [_row("ddp_bf16", 1, 10.0, 0.80, "ddp"), _row("ddp_loka", 1, 8.0, 0.802, "ddp")]
    two = [_row("ddp_bf16", 2, 12.5, 0.79, "ddp"), _row("ddp_loka", 2, 9.0, 0.79, "ddp"),
           {"config": "fsdp2_bf16", "world_size": 2, "error": "boom"}]
    env = {"model": "m", "preset": "p", "batch_per_rank": 4, "steps": 3, "device": "H100"}
    for name, rows in (("one", one), ("two", two)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"env": env, "rows": rows}))
    merged = json.loads(bench.merge([str(tmp_path / "one.json"), str(tmp_path / "two.json")], tmp_path, "all")
                        .read_text())["rows"]
    loka2 = next(r for r in merged if r["config"] == "ddp_loka" and r["world_size"] == 2)
    assert loka2["speedup_vs_bf16"] == pytest.approx(12.5 / 9.0)
    assert loka2["scaling_efficiency"] == pytest.approx(8.0 / 9.0)
    assert loka2["ne_rel_change_vs_ddp_bf16"] == pytest.approx(0.0)
    assert next(r for r in merged if r["config"] == "ddp_bf16" and r["world_size"] == 2)["scaling_efficiency"] == \
        pytest.approx(0.8)
    table = (tmp_path / "all.md").read_text()
    assert "| 2 | fsdp2_bf16 | error: boom |" in table and "| 1 | ddp_loka | 8.00 | 1.25 |" in table


def test_plan_reuse_flags_and_rows(capsys):
    """--reuse-plan picks the plans' directory itself; plans act on loka under DDP only; a row that
    ran a plan says whose, and the table says what that means."""
    from benchmarks import distributed as bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--reuse-plan", "--load-plans", "plans"])
    assert "--reuse-plan" in capsys.readouterr().err
    assert [name for name, c in bench.CONFIGS.items() if bench.plans_apply(c)] == ["ddp_loka", "ddp_loka_fp8_comm"]
    args = bench.parse_args(["--load-plans", "plans", "--gpus", "2"])
    assert args.load_plans == "plans" and "--profile" not in args.passthrough
    rows = [_row("ddp_bf16", 2, 12.5, 0.79, "ddp"), {**_row("ddp_loka", 2, 9.0, 0.79, "ddp"), "plan_from_world": 1}]
    bench.fill_derived(rows)
    env = {"model": "m", "preset": "p", "batch_per_rank": 4, "steps": 3, "device": "H100"}
    table = bench.markdown(env, rows)
    assert "| 2 | ddp_loka (plan of the 1-GPU row) | 9.00 | 1.39 |" in table
    assert "no probe window, speed check or output budget of its own" in table
    assert "| 2 | ddp_bf16 (plan" not in table and "of its own" not in bench.markdown(env, rows[:1])


def test_fp8_all_gather_flag_and_column():
    """--fp8-all-gather runs FSDP2 bf16, loka and loka with the FP8 weight all-gather; the row of
    the last says how many parameters went FP8 and one forward's all-gather MB against high
    precision, in a column of its own (every row has the header's cells)."""
    from benchmarks import distributed as bench

    args = bench.parse_args(["--fp8-all-gather", "--gpus", "4"])
    assert args.configs.split(",") == list(bench.FP8_ALL_GATHER_CONFIGS)
    assert f"--configs={args.configs}" in args.passthrough
    assert bench.CONFIGS["fsdp2_loka_fp8_all_gather"].fp8_all_gather
    gathered = {"fp8_all_gather_params": "3/9", "all_gather_bytes_per_forward": 1.25e6,
                "all_gather_high_precision_bytes_per_forward": 2.5e6, "all_gather_bf16_bytes_per_forward": 2.5e6}
    rows = [_row("fsdp2_bf16", 4, 10.0, 0.8, "fsdp2"), {**_row("fsdp2_loka_fp8_all_gather", 4, 8.0, 0.8, "fsdp2"),
                                                        **gathered}]
    bench.fill_derived(rows)
    table = bench.markdown({"model": "m", "preset": "p", "batch_per_rank": 4, "steps": 3, "device": "H100"}, rows)
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in lines}) == 1, lines
    assert "| 3/9 (1.25 vs 2.50) |" in table


def _weight_gather_rows(rank):
    from benchmarks import weight_gather

    return weight_gather.measure(64, 32, torch.device("cpu"), repeats=1, warmup=0)


# One e4m3 rounding with a scale per row (or per weight) leaves ~0.025 relative error (measured
# 0.025-0.027 on CPU); twice that is the floor.
WEIGHT_GATHER_ERROR_FLOOR = 0.05


def test_weight_gather_benchmark_rows(tmp_path):
    """benchmarks/weight_gather.py on two gloo ranks: the FP8 forms gather fewer bytes than bf16
    (e4m3 plus a scale a row), and what they deliver is the weight within one e4m3 rounding; the
    dequantize + re-cast round trip gives back the gathered FP8 operand bit for bit."""
    from benchmarks import weight_gather

    rows = run_ranks(_weight_gather_rows, (), WORLD_SIZE, 120, tmp_path)[0]
    by_form = {r["form"]: r for r in rows}
    assert by_form["bf16 all-gather"]["gathered_bytes"] == 2 * 64 * 32
    assert by_form["fp8 rowwise: cast, all-gather, dequantize"]["gathered_bytes"] == 64 * 32 + 4 * 64
    for form in ("fp8 rowwise: cast, all-gather, dequantize",
                 "fp8 tensorwise: amax all-reduce, cast, all-gather, dequantize",
                 "fp8 columnwise (a rowwise dgrad's): column amax all-reduce, cast, all-gather, dequantize"):
        assert 0 < by_form[form]["rel_error"] <= WEIGHT_GATHER_ERROR_FLOOR, by_form[form]
    assert all(r["us"] > 0 for r in rows)
    # the round trip a direct feed would skip gives back the gathered bytes and scales, bit for bit
    for trip in ("today's round trip per forward: dequantize, the GEMM's rowwise re-cast",
                 "today's round trip per backward (rowwise dgrad): dequantize, the dgrad's columnwise re-cast"):
        assert by_form[trip]["bit_identical"] is True, by_form[trip]
    # bf16 (2 bytes) written and read once, FP8 bytes read and written once, 64 row scales in and out
    assert by_form["today's round trip per forward: dequantize, the GEMM's rowwise re-cast"]["memory_bytes"] == \
        2 * (64 * 32 + 4 * 64 + 2 * 64 * 32)
    table = weight_gather.markdown({"world_size": WORLD_SIZE, "device": "CPU"}, rows)
    assert table.count("| 64x32 |") == len(rows) == 10 and "| NO |" not in table
