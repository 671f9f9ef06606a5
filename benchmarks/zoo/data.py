"""Synthetic recommendation data with the statistics that matter for LRM numerics.

What is realistic here, and why it matters for FP8:

- sparse ids follow a per-table power law (Zipf) over a hashed id space, so a few rows are
  hot (their embeddings train fast and grow large) and most are cold;
- every table is multi-hot with its own mean pooling factor and a per-example variable
  bag length (Dirichlet-multinomial, so lengths are over-dispersed), fed to
  `nn.EmbeddingBag` as flat ids plus offsets. The total ids per table and batch is fixed,
  so every batch has the same tensor shapes (no recompiles, CUDA-graph friendly);
- dense features are log-normal counts with a share of zeros, then `log1p` (the Criteo
  preprocessing), so activations entering the dense arch are skewed and heavy-tailed;
- labels come from a fixed hidden teacher (a seeded random function of the dense
  features, of hashed id effects, of one id-id and one dense-id interaction and, for
  sequence data, of target/history similarity), passed through a logistic and
  calibrated to a chosen positive rate. A model that learns lowers logloss and NE and
  raises AUC on a held-out stream (other seed, same teacher).

Batches are a deterministic function of (stream seed, batch index, batch size): any
config that asks for batch i of a stream gets the same tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

# The task metrics live with `loka_compile.calibrate`, which measures them too.
from loka_compile.task_metrics import auc, logloss, normalized_entropy

__all__ = [
    "DataSpec",
    "Batch",
    "SyntheticRecsysData",
    "criteo_like_spec",
    "logloss",
    "normalized_entropy",
    "auc",
    "quality_metrics",
]

# MLPerf DLRMv2 (Criteo 1TB) table cardinalities and multi-hot sizes, used as the shape of a
# realistic 26-table sparse input. Rows are capped per preset to keep memory modest.
CRITEO_ROWS = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
CRITEO_POOLING = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
CRITEO_NUM_DENSE = 13

_MASK62 = (1 << 62) - 1
# splitmix64 multipliers, reduced to 62 bits so they fit int64 scalars.
_K0, _K1, _K2 = (c & _MASK62 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@dataclass(frozen=True)
class DataSpec:
    """Shapes and statistics of one synthetic data set (what a model's inputs look like).

    table_rows[t] rows in sparse table t; mean_pooling[t] is its mean ids per example
    (1.0 = one-hot); zipf_alpha[t] its power-law exponent. seq_len > 0 adds a history of
    item ids (left-padded with id 0) plus a target item, drawn from item_rows items.
    """

    num_dense: int
    table_rows: tuple[int, ...]
    mean_pooling: tuple[float, ...]
    zipf_alpha: tuple[float, ...]
    seq_len: int = 0
    item_rows: int = 0
    item_zipf_alpha: float = 1.1
    positive_rate: float = 0.1
    teacher_seed: int = 1234
    # Gamma shape of per-example bag-length weights: smaller = more varied lengths.
    length_dispersion: float = 2.0
    # Teacher logit scale before calibration; ~2 gives a best-possible AUC near 0.8.
    teacher_scale: float = 2.0
    informative_tables: tuple[int, ...] = field(default=())

    def __post_init__(self):
        n = len(self.table_rows)
        if not (len(self.mean_pooling) == len(self.zipf_alpha) == n):
            raise ValueError("table_rows, mean_pooling and zipf_alpha must have the same length")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(f"positive_rate must be in (0, 1), got {self.positive_rate}")
        if any(p < 1.0 for p in self.mean_pooling):
            raise ValueError("mean_pooling must be >= 1 (every bag holds at least one id)")
        if any(a <= 1.0 for a in self.zipf_alpha) or self.item_zipf_alpha <= 1.0:
            raise ValueError("zipf exponents must be > 1")
        if self.seq_len > 0 and self.item_rows < 2:
            raise ValueError("sequence data needs item_rows >= 2 (id 0 is padding)")

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def ids_per_batch(self, batch_size: int) -> tuple[int, ...]:
        """Fixed number of ids per table in a batch (so shapes never change)."""
        return tuple(max(batch_size, round(batch_size * p)) for p in self.mean_pooling)

    def with_positive_rate(self, rate: float) -> "DataSpec":
        return dataclasses.replace(self, positive_rate=rate)


def criteo_like_spec(
    max_rows: int, pooling_cap: float, *, num_tables: int = 26, seq_len: int = 0,
    item_rows: int = 0, positive_rate: float = 0.1,
) -> DataSpec:
    """A Criteo/MLPerf-shaped spec: first `num_tables` MLPerf tables, rows capped at
    max_rows, pooling factors capped at pooling_cap; Zipf exponents spread in [1.05, 1.3]."""
    rows = tuple(min(r, max_rows) for r in CRITEO_ROWS[:num_tables])
    pooling = tuple(float(min(p, pooling_cap)) for p in CRITEO_POOLING[:num_tables])
    gen = torch.Generator().manual_seed(7)
    alpha = tuple(round(1.05 + 0.25 * float(u), 3) for u in torch.rand(num_tables, generator=gen))
    # The teacher reads tables that have enough rows for id effects to mean something.
    informative = tuple(t for t, r in enumerate(rows) if r >= 100)[:8]
    return DataSpec(
        num_dense=CRITEO_NUM_DENSE, table_rows=rows, mean_pooling=pooling, zipf_alpha=alpha,
        seq_len=seq_len, item_rows=item_rows, positive_rate=positive_rate,
        informative_tables=informative,
    )


@dataclass
class Batch:
    """One batch. ids[t] is flat [ids_per_batch[t]] int64, offsets[t] is [B] int64 (start
    of each example's bag, EmbeddingBag convention). seq_ids is [B, seq_len + 1] with the
    target item last and the history left-padded with 0; None without sequence data."""

    dense: torch.Tensor
    ids: list[torch.Tensor]
    offsets: list[torch.Tensor]
    labels: torch.Tensor
    seq_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.labels.shape[0]

    def model_inputs(self) -> tuple:
        return (self.dense, self.ids, self.offsets, self.seq_ids)

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        return Batch(move(self.dense), [move(t) for t in self.ids], [move(t) for t in self.offsets],
                     move(self.labels), move(self.seq_ids))


def _mix(x: torch.Tensor, salt: int) -> torch.Tensor:
    """Deterministic 62-bit integer hash (splitmix-style) of an int64 tensor, same on every
    device: int64 products wrap, and masking keeps shifts logical."""
    x = (x * _K0 + salt) & _MASK62
    x = ((x ^ (x >> 29)) * _K1) & _MASK62
    x = ((x ^ (x >> 31)) * _K2) & _MASK62
    return x ^ (x >> 30)


def _hash_unit(x: torch.Tensor, salt: int) -> torch.Tensor:
    """Hash ids to floats uniform in [-sqrt(3), sqrt(3)) (zero mean, unit variance)."""
    u = (_mix(x, salt) & ((1 << 24) - 1)).to(torch.float32) / float(1 << 24)
    return (2.0 * u - 1.0) * math.sqrt(3.0)


def _coprime_multiplier(n: int, seed: int) -> int:
    m = (0x9E3779B1 + 2 * seed + 1) % n if n > 1 else 1
    m = max(m, 1)
    while math.gcd(m, n) != 1:
        m += 1
    return m


class SyntheticRecsysData:
    """A deterministic stream of batches for one DataSpec.

    seed picks the stream (train 0, held-out 1, ...); the hidden teacher depends only on
    spec.teacher_seed, so every stream of one spec shares it.
    """

    def __init__(self, spec: DataSpec, seed: int = 0):
        self.spec = spec
        self.seed = seed
        g = torch.Generator().manual_seed(spec.teacher_seed)
        nd = spec.num_dense
        # Dense feature distribution: log-normal counts, some features often zero.
        self.dense_mu = torch.rand(nd, generator=g) * 4.0 - 1.0
        self.dense_sigma = 0.5 + torch.rand(nd, generator=g) * 1.5
        self.dense_zero_p = torch.rand(nd, generator=g) * 0.4
        # Id permutation per table: hot ranks land on scattered ids, as with hashed ids.
        self.id_mult = [_coprime_multiplier(r, spec.teacher_seed + t) for t, r in enumerate(spec.table_rows)]
        self.id_add = [int(torch.randint(0, max(r, 1), (1,), generator=g)) for r in spec.table_rows]
        if spec.seq_len:
            self.item_mult = _coprime_multiplier(spec.item_rows - 1, spec.teacher_seed + 999)
            self.item_add = int(torch.randint(0, spec.item_rows - 1, (1,), generator=g))
        # Teacher: small tanh MLP on standardized dense features + id effects + interactions.
        self.t_w1 = torch.randn(nd, 16, generator=g) / math.sqrt(nd)
        self.t_b1 = torch.randn(16, generator=g) * 0.5
        self.t_w2 = torch.randn(16, generator=g) / 4.0
        informative = spec.informative_tables or tuple(range(min(8, spec.num_tables)))
        self.informative = informative
        self.t_table_w = (torch.rand(len(informative), generator=g) * 0.8 + 0.4) * torch.where(
            torch.rand(len(informative), generator=g) < 0.5, -1.0, 1.0)
        self.t_dense_pick = int(torch.randint(0, nd, (1,), generator=g))
        self._dense_mean, self._dense_std = self._dense_moments()
        self.bias = 0.0
        self.bias = self._calibrate_bias()

    # ---------------------------------------------------------------- generation

    def _dense_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.spec.teacher_seed + 1)
        x = self._gen_dense(4096, g, torch.device("cpu"))
        return x.mean(0), x.std(0).clamp_min(1e-3)

    def _gen_dense(self, b: int, g: torch.Generator, device) -> torch.Tensor:
        nd = self.spec.num_dense
        z = torch.randn(b, nd, generator=g, device=device)
        counts = torch.floor(torch.exp(self.dense_mu.to(device) + self.dense_sigma.to(device) * z))
        zero = torch.rand(b, nd, generator=g, device=device) < self.dense_zero_p.to(device)
        return torch.log1p(torch.where(zero, torch.zeros_like(counts), counts))

    @staticmethod
    def _zipf_ranks(n: int, alpha: float, size: int, g, device) -> torch.Tensor:
        """Ranks in [0, n) with P(rank r) ~ (r + 1)^-alpha (inverse CDF of the continuous
        power law on [1, n + 1), floored)."""
        u = torch.rand(size, generator=g, device=device, dtype=torch.float64)
        one_minus_a = 1.0 - alpha
        top = (n + 1.0) ** one_minus_a
        x = (1.0 + u * (top - 1.0)) ** (1.0 / one_minus_a)
        return (x.floor().long() - 1).clamp_(0, n - 1)

    def _bag_lengths(self, b: int, total: int, g, device) -> torch.Tensor:
        """Per-example lengths >= 1 summing exactly to `total` (Dirichlet-multinomial-like:
        gamma weights, floor, remainder to the largest fractional parts)."""
        if total == b:
            return torch.ones(b, dtype=torch.long, device=device)
        shape = torch.full((b,), self.spec.length_dispersion, device=device)
        w = torch._standard_gamma(shape, generator=g)
        share = w / w.sum() * (total - b)
        base = share.floor()
        rem = total - b - int(base.sum().item())
        frac = share - base
        lengths = base.long() + 1
        if rem > 0:
            lengths[torch.topk(frac, rem).indices] += 1
        return lengths

    def _gen_sparse(self, b: int, g, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ids, offsets = [], []
        for t, (rows, alpha) in enumerate(zip(self.spec.table_rows, self.spec.zipf_alpha)):
            total = self.spec.ids_per_batch(b)[t]
            lengths = self._bag_lengths(b, total, g, device)
            offs = torch.zeros(b, dtype=torch.long, device=device)
            offs[1:] = torch.cumsum(lengths, 0)[:-1]
            ranks = self._zipf_ranks(rows, alpha, total, g, device)
            ids.append((ranks * self.id_mult[t] + self.id_add[t]) % rows)
            offsets.append(offs)
        return ids, offsets

    def _gen_sequence(self, b: int, g, device) -> torch.Tensor:
        s = self.spec
        n_items = s.item_rows - 1  # id 0 is padding
        ranks = self._zipf_ranks(n_items, s.item_zipf_alpha, b * (s.seq_len + 1), g, device)
        items = 1 + (ranks * self.item_mult + self.item_add) % n_items
        items = items.view(b, s.seq_len + 1)
        # History lengths uniform in [seq_len // 4, seq_len]; left-pad so the target is last.
        lo = max(1, s.seq_len // 4)
        hist_len = torch.randint(lo, s.seq_len + 1, (b,), generator=g, device=device)
        pos = torch.arange(s.seq_len, device=device)
        pad = pos[None, :] < (s.seq_len - hist_len)[:, None]
        items[:, : s.seq_len] = items[:, : s.seq_len].masked_fill(pad, 0)
        return items

    # ---------------------------------------------------------------- teacher

    def _pooled_effect(self, ids: torch.Tensor, offsets: torch.Tensor, t: int, b: int) -> torch.Tensor:
        """Mean over each bag of a hashed per-id effect (what the teacher reads from table t)."""
        # Segment sums as differences of one float64 prefix sum: deterministic on GPU too
        # (index_add_ would add in a racy order and could flip borderline labels).
        effect = _hash_unit(ids, salt=1000 + t).double()
        prefix = torch.cat([effect.new_zeros(1), torch.cumsum(effect, 0)])
        ends = torch.cat([offsets[1:], offsets.new_tensor([ids.shape[0]])])
        return ((prefix[ends] - prefix[offsets]) / (ends - offsets).double()).float()

    def teacher_logit(self, dense, ids, offsets, seq_ids) -> torch.Tensor:
        """Calibrated hidden logit of P(click) for each example."""
        dev = dense.device
        b = dense.shape[0]
        xs = (dense - self._dense_mean.to(dev)) / self._dense_std.to(dev)
        z = torch.tanh(xs @ self.t_w1.to(dev) + self.t_b1.to(dev)) @ self.t_w2.to(dev)
        effects = [self._pooled_effect(ids[t], offsets[t], t, b) for t in self.informative]
        w = self.t_table_w.to(dev)
        for i, e in enumerate(effects):
            z = z + w[i] * e * 0.5
        if len(effects) >= 2:  # one id-id and one dense-id interaction
            z = z + 0.4 * effects[0] * effects[1]
            z = z + 0.3 * effects[-1] * xs[:, self.t_dense_pick].clamp(-3, 3)
        if seq_ids is not None:
            target = seq_ids[:, -1]
            hist = seq_ids[:, :-1]
            valid = hist != 0
            t_cluster = _mix(target, 77) % 16
            h_cluster = _mix(hist, 77) % 16
            same = ((h_cluster == t_cluster[:, None]) & valid).float().sum(1)
            share = same / valid.float().sum(1).clamp_min(1.0)
            # Share of history in the target's cluster (1/16 by chance) drives interest.
            z = z + 3.0 * (share - 1.0 / 16.0) + 0.5 * _hash_unit(target, salt=555)
        return self.spec.teacher_scale * z / math.sqrt(1.0 + 0.25 * len(effects)) + self.bias

    def _calibrate_bias(self) -> float:
        """Bias so that the mean click probability equals spec.positive_rate (bisection on a
        fixed CPU calibration sample, so the bias is the same on every device)."""
        g = torch.Generator().manual_seed(self.spec.teacher_seed + 2)
        b = 8192
        dev = torch.device("cpu")
        dense = self._gen_dense(b, g, dev)
        ids, offsets = self._gen_sparse(b, g, dev)
        seq = self._gen_sequence(b, g, dev) if self.spec.seq_len else None
        z = self.teacher_logit(dense, ids, offsets, seq).double()
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if torch.sigmoid(z + mid).mean().item() > self.spec.positive_rate:
                hi = mid
            else:
                lo = mid
        return 0.5 * (lo + hi)

    # ---------------------------------------------------------------- public

    def batch(self, index: int, batch_size: int, device="cpu") -> Batch:
        """Batch `index` of this stream: same tensors for the same (seed, index, size)."""
        device = torch.device(device)
        g = torch.Generator(device=device)
        g.manual_seed(int(_mix(torch.tensor([self.seed * 1_000_003 + index]), 4242).item()))
        dense = self._gen_dense(batch_size, g, device)
        ids, offsets = self._gen_sparse(batch_size, g, device)
        seq = self._gen_sequence(batch_size, g, device) if self.spec.seq_len else None
        p = torch.sigmoid(self.teacher_logit(dense, ids, offsets, seq))
        labels = (torch.rand(batch_size, generator=g, device=device) < p).float()
        return Batch(dense, ids, offsets, labels, seq)

    def stream(self, batch_size: int, device="cpu", start: int = 0) -> Iterator[Batch]:
        i = start
        while True:
            yield self.batch(i, batch_size, device)
            i += 1


# -------------------------------------------------------------------- metrics


def quality_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    return {
        "logloss": logloss(logits, labels),
        "ne": normalized_entropy(logits, labels),
        "auc": auc(logits, labels),
    }
