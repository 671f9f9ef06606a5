"""The LRM zoo and its synthetic data: shapes, dtypes, data statistics, metrics, learning."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.zoo import (MODEL_NAMES, SyntheticRecsysData, auc, build_model, count_parameters,
                            data_spec, logloss, normalized_entropy, quality_metrics, sparse_grad_parameters,
                            to_dense_dtype)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    """One tiny model and a data stream per zoo name, built once."""
    out = {}
    for name in MODEL_NAMES:
        model, spec = build_model(name, "tiny")
        out[name] = (model, spec, SyntheticRecsysData(spec, seed=0))
    return out


# ------------------------------------------------------------------ models


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_backward_shapes(tiny, name):
    model, spec, data = tiny[name]
    batch = data.batch(0, 32)
    logits = model(*batch.model_inputs())
    assert logits.shape == (32,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    model.zero_grad(set_to_none=True)
    # Split path (what the harness compiles) is the same function.
    torch.testing.assert_close(model.dense(*model.sparse(*batch.model_inputs())), logits.detach())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bf16_dense_arch_keeps_fp32_tables(name):
    model, spec = build_model(name, "tiny")
    to_dense_dtype(model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.sparse.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.dense.parameters())
    batch = SyntheticRecsysData(spec, seed=0).batch(0, 16)
    out = model(*batch.model_inputs())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", ["dlrm_dcnv2", "hstu"])
def test_sparse_tables_give_sparse_grads(name):
    """sparse=True: every table's gradient is a sparse tensor over the looked-up rows, the
    same function as dense tables, and SparseAdam takes a finite step with it."""
    model, spec = build_model(name, "tiny", sparse=True)
    dense_model, _ = build_model(name, "tiny", sparse=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), dense_model.parameters()))
    batch = SyntheticRecsysData(spec, seed=0).batch(0, 32)
    loss = F.binary_cross_entropy_with_logits(model(*batch.model_inputs()), batch.labels)
    dense_loss = F.binary_cross_entropy_with_logits(dense_model(*batch.model_inputs()), batch.labels)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(dense_loss.item(), rel=1e-6)
    loss.backward()
    dense_loss.backward()
    tables = [n for n, _ in sparse_grad_parameters(model)]
    assert len(tables) == spec.num_tables + (1 if spec.seq_len else 0)
    params = dict(model.named_parameters())
    dense_params = dict(dense_model.named_parameters())
    for n in tables:
        g = params[n].grad
        assert g.is_sparse, n
        torch.testing.assert_close(g.to_dense(), dense_params[n].grad)
    assert all(not p.grad.is_sparse for _, p in model.dense.named_parameters())
    before = [p.detach().clone() for _, p in sparse_grad_parameters(model)]
    opt = torch.optim.SparseAdam([p for _, p in sparse_grad_parameters(model)], lr=1e-2)
    opt.step()
    after = [p for _, p in sparse_grad_parameters(model)]
    assert all(torch.isfinite(p).all() for p in after)
    touched = batch.ids[0].unique()
    changed = (after[0] != before[0]).any(dim=1)
    assert changed[touched].all() and changed.sum() == touched.numel()  # lazy: only looked-up rows


def test_dlrm_paper_preset_has_sparse_tables():
    dlrm, _ = build_model("dlrm_dcnv2", "paper", device="meta")
    assert all(t.sparse for t in dlrm.sparse.tables)
    dense, _ = build_model("dlrm_dcnv2", "paper", device="meta", sparse=False)
    assert not any(t.sparse for t in dense.sparse.tables)
    wukong, _ = build_model("wukong", "paper", device="meta")
    assert not any(t.sparse for t in wukong.sparse.tables)


def test_init_is_deterministic_and_seeded():
    a, _ = build_model("dlrm_dcnv2", "tiny", seed=3)
    b, _ = build_model("dlrm_dcnv2", "tiny", seed=3)
    c, _ = build_model("dlrm_dcnv2", "tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_head_starts_at_prior_log_odds():
    model, _ = build_model("masknet", "tiny", positive_rate=0.2)
    assert model.dense.top[-1].bias.item() == pytest.approx(math.log(0.2 / 0.8), rel=1e-6)


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="valid: wukong"):
        build_model("dlrm", "tiny")
    with pytest.raises(ValueError, match="valid: paper, tiny"):
        build_model("wukong", "huge")


def test_paper_presets_fit_a_gpu():
    """Shapes only (meta device): paper presets have the documented architecture and tables
    of at most ~1M rows, so fp32 weights + Adam state stay far below 80 GB."""
    wukong, _ = build_model("wukong", "paper", device="meta")
    layer = wukong.dense.layers[0]
    assert len(wukong.dense.layers) == 8
    assert (layer.fm_proj.out_features, layer.lcb.out_features, layer.n_fm, layer.d) == (24, 32, 32, 160)
    assert [m.out_features for m in layer.fm_mlp if isinstance(m, torch.nn.Linear)] == [2048, 2048, 2048, 32 * 160]
    dlrm, _ = build_model("dlrm_dcnv2", "paper", device="meta")
    assert [m.out_features for m in dlrm.dense.bottom if isinstance(m, torch.nn.Linear)] == [512, 256, 128]
    assert [m.out_features for m in dlrm.dense.top if isinstance(m, torch.nn.Linear)] == [1024, 1024, 512, 256, 1]
    assert [(c.v.out_features, c.u.in_features) for c in dlrm.dense.cross] == [(512, 512)] * 3
    assert len(dlrm.sparse.tables) == 26 and {t.embedding_dim for t in dlrm.sparse.tables} == {128}
    for name in MODEL_NAMES:
        model, spec = build_model(name, "paper", device="meta")
        assert sum(spec.table_rows) + spec.item_rows <= 1_000_000
        n = count_parameters(model)
        weights_and_adam_gb = 4 * 4 * (n["dense"] + n["sparse"]) / 1e9  # param, grad, 2 moments
        assert weights_and_adam_gb < 8, (name, n)


# ------------------------------------------------------------------ data


def test_batches_are_deterministic_per_stream_and_index():
    spec = data_spec("dlrm_dcnv2", "tiny")
    a, b = SyntheticRecsysData(spec, seed=0), SyntheticRecsysData(spec, seed=0)
    x, y = a.batch(5, 64), b.batch(5, 64)
    assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
    assert all(torch.equal(i, j) for i, j in zip(x.ids + x.offsets, y.ids + y.offsets))
    other_index = a.batch(6, 64)
    assert not torch.equal(x.ids[0], other_index.ids[0])
    heldout = SyntheticRecsysData(spec, seed=1)
    assert heldout.bias == a.bias  # same teacher
    assert not torch.equal(heldout.batch(5, 64).ids[0], x.ids[0])


@pytest.mark.parametrize("rate", [0.03, 0.1, 0.25])
def test_positive_rate_is_calibrated(rate):
    spec = data_spec("wukong", "tiny", positive_rate=rate)
    data = SyntheticRecsysData(spec, seed=0)
    labels = torch.cat([data.batch(i, 4096).labels for i in range(2)])
    assert abs(labels.mean().item() - rate) < 0.15 * rate + 0.005


def test_ids_are_zipf_skewed_and_in_range():
    spec = data_spec("dlrm_dcnv2", "tiny")
    batch = SyntheticRecsysData(spec, seed=0).batch(0, 4096)
    for t, ids in enumerate(batch.ids):
        assert ids.min() >= 0 and ids.max() < spec.table_rows[t]
    t = max(range(spec.num_tables), key=lambda i: (spec.table_rows[i], spec.mean_pooling[i]))
    counts = torch.bincount(batch.ids[t], minlength=spec.table_rows[t]).sort(descending=True).values
    top1pct = counts[: spec.table_rows[t] // 100].sum() / counts.sum()
    assert top1pct > 0.25, f"top 1% of rows get {top1pct:.2f} of lookups"
    # Power law: log-count falls roughly linearly in log-rank with slope near -alpha.
    ranks = torch.arange(1, 51, dtype=torch.float64)
    slope = torch.linalg.lstsq(torch.stack([ranks.log(), torch.ones(50, dtype=torch.float64)], 1),
                               counts[:50].double().clamp_min(1).log()[:, None]).solution[0].item()
    assert -2.0 < slope < -0.7
    # Hot ids are scattered over the id space (hashed), not the first rows.
    hottest = torch.bincount(batch.ids[t]).topk(10).indices
    assert hottest.max() > spec.table_rows[t] // 10


def test_pooling_varies_across_tables_and_examples():
    spec = data_spec("dlrm_dcnv2", "tiny")
    b = 512
    batch = SyntheticRecsysData(spec, seed=0).batch(0, b)
    assert len(set(spec.mean_pooling)) > 3
    for t, (ids, offsets) in enumerate(zip(batch.ids, batch.offsets)):
        assert offsets.shape == (b,) and offsets[0] == 0
        lengths = torch.diff(offsets, append=torch.tensor([ids.numel()]))
        assert (lengths >= 1).all()
        assert ids.numel() == spec.ids_per_batch(b)[t]
        assert lengths.float().mean().item() == pytest.approx(spec.mean_pooling[t], rel=0.01)
        if spec.mean_pooling[t] >= 3:
            assert lengths.float().std() > 0.3 * spec.mean_pooling[t] ** 0.5
        if spec.mean_pooling[t] == 1:
            assert (lengths == 1).all()
    # Same shapes every batch (no recompiles), different bag boundaries.
    other = SyntheticRecsysData(spec, seed=0).batch(1, b)
    assert [i.shape for i in other.ids] == [i.shape for i in batch.ids]
    assert not torch.equal(other.offsets[4], batch.offsets[4])


def test_dense_features_are_log1p_of_heavy_tailed_counts():
    spec = data_spec("masknet", "tiny")
    dense = SyntheticRecsysData(spec, seed=0).batch(0, 4096).dense
    assert dense.shape == (4096, spec.num_dense) and torch.isfinite(dense).all()
    assert (dense >= 0).all()
    counts = torch.expm1(dense)
    assert torch.allclose(counts, counts.round(), atol=1e-3 * counts.max().item())  # integer counts
    assert ((dense == 0).float().mean(0) > 0.02).any()  # missing / zero values
    assert (counts.mean(0) > counts.median(0).values).all()  # right-skewed


def test_sequence_data_left_pads_history_and_keeps_target():
    spec = data_spec("hstu", "tiny")
    batch = SyntheticRecsysData(spec, seed=0).batch(0, 256)
    seq = batch.seq_ids
    assert seq.shape == (256, spec.seq_len + 1)
    assert (seq[:, -1] > 0).all() and seq.max() < spec.item_rows
    valid = seq[:, :-1] != 0
    # Left padding: once an example's history starts it never has a hole.
    assert (valid.int().diff(dim=1) >= 0).all()
    assert valid.sum(1).float().std() > 0


def test_teacher_has_learnable_signal():
    spec = data_spec("hstu", "tiny")
    data = SyntheticRecsysData(spec, seed=0)
    batch = data.batch(0, 8192)
    z = data.teacher_logit(*batch.model_inputs())
    assert 0.7 < auc(z, batch.labels) < 0.95
    assert normalized_entropy(z, batch.labels) < 0.9


# ------------------------------------------------------------------ metrics


def test_auc_matches_pairwise_definition_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (60,), generator=g).float()  # many ties
    labels = (torch.rand(60, generator=g) < 0.4).float()
    pos, neg = scores[labels > 0], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos.tolist(), neg.tolist())]
    assert auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert math.isnan(auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 1.0])))


def test_logloss_and_ne_of_base_rate_prediction():
    labels = torch.tensor([1.0] * 10 + [0.0] * 90)
    base = torch.full((100,), math.log(0.1 / 0.9))
    assert logloss(base, labels) == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), rel=1e-9)
    assert normalized_entropy(base, labels) == pytest.approx(1.0, rel=1e-9)
    perfect = torch.where(labels > 0, 20.0, -20.0)
    assert normalized_entropy(perfect, labels) < 1e-6


# ------------------------------------------------------------------ learning


@pytest.mark.parametrize("name", ["dlrm_dcnv2", "hstu"])
def test_short_training_improves_heldout_quality(name):
    model, spec = build_model(name, "tiny")
    train, heldout = SyntheticRecsysData(spec, seed=0), SyntheticRecsysData(spec, seed=1)
    evals = [heldout.batch(i, 512) for i in range(4)]

    def evaluate():
        with torch.no_grad():
            logits = torch.cat([model(*b.model_inputs()) for b in evals])
        return quality_metrics(logits, torch.cat([b.labels for b in evals]))

    before = evaluate()
    opt = torch.optim.Adam([{"params": model.dense.parameters(), "lr": 1e-3},
                            {"params": model.sparse.parameters(), "lr": 1e-2}])
    for i in range(150):
        batch = train.batch(i, 256)
        F.binary_cross_entropy_with_logits(model(*batch.model_inputs()), batch.labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = evaluate()
    assert after["logloss"] < before["logloss"] - 0.005
    assert after["ne"] < 0.97
    assert after["auc"] > before["auc"] + 0.05
