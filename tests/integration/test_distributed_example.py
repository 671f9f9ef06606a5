"""examples/distributed.py on two CPU ranks over gloo, at tiny sizes: a zoo model under FSDP2
(with the FP8 all-gather of its weights) and a public-suite model under DDP train with loka
(FP8 emulated), and every rank reports the same held-out NE (the ranks' held-out logits are
gathered)."""

import math

import pytest
import torch

from spawn_ranks import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 400
RUNS = (("fsdp2", "dlrm_dcnv2"), ("ddp", "torch_rechub.DCNv2"))


def _rank(rank):
    from examples import distributed as example

    rows = []
    for strategy, model in RUNS:
        args = example.parse_args(["--device", "cpu", "--models", model, "--strategy", strategy, "--steps", "3",
                                   "--batch", "32", "--eval-batches", "1", "--probe-steps", "0",
                                   *(["--fp8-all-gather"] if strategy == "fsdp2" else [])])
        rows += example.run_models(args, torch.device("cpu"))
    return rows


def test_example_trains_a_zoo_and_a_public_model_on_two_ranks(tmp_path):
    per_rank = run_ranks(_rank, (), WORLD_SIZE, JOIN_TIMEOUT_S, tmp_path)
    for rows in per_rank:
        assert [(r["strategy"], r["model"]) for r in rows] == list(RUNS)
        for r in rows:
            assert r["world_size"] == WORLD_SIZE and r["backend"] == "loka"
            assert all(math.isfinite(r[k]) for k in ("loss_first", "loss_last", "ne", "auc")), r
            assert r["step_ms"] > 0 and r["timed_steps"] >= 1
            assert 0 < r["fp8_sites"] <= r["sites"], r  # loka ran FP8 GEMMs under both strategies
            if r["strategy"] == "fsdp2":  # some weights gathered in FP8: fewer bytes than their fp32 gather
                gathered = r["all_gather_bytes_per_forward"]
                assert gathered["plan"] < gathered["high_precision"] and "fp8 rowwise" in r["weight_gather"], r
    for mine, theirs in zip(*per_rank):
        assert mine["ne"] == theirs["ne"] and mine["auc"] == theirs["auc"]  # one gathered held-out set
