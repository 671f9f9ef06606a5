"""Task metrics of binary heads (CTR, CVR): log loss, normalized entropy (NE) and ROC AUC,
on logits and 0/1 labels. `loka_compile.calibrate` measures them for a plan against high
precision; the benchmarks report them.
"""

from __future__ import annotations

import torch


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits.double(), labels.double()).item()


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Logloss divided by the entropy of the empirical positive rate (He et al. 2014):
    1.0 = no better than predicting the base rate; lower is better."""
    p = labels.double().mean().clamp(1e-12, 1 - 1e-12)
    base = -(p * p.log() + (1 - p) * (1 - p).log())
    return logloss(logits, labels) / base.item()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC via ranks (Mann-Whitney U), ties get their average rank."""
    scores = scores.double().flatten()
    labels = labels.flatten() > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last item
    avg_rank = ends - (counts.double() - 1.0) / 2.0
    ranks = torch.empty_like(scores)
    ranks[order] = torch.repeat_interleave(avg_rank, counts)
    u = ranks[labels].sum().item() - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)
