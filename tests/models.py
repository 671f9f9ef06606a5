"""Small models for the end-to-end tests."""

import torch
import torch.nn as nn


class MLPWithNorm(nn.Module):
    """Linear -> LayerNorm -> ReLU, twice, then a head."""

    def __init__(self, d_in=64, hidden=128, d_out=16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        x = torch.relu(self.norm1(self.fc1(x)))
        x = torch.relu(self.norm2(self.fc2(x)))
        return self.head(x)


class WukongLikeBlock(nn.Module):
    """One Wukong-style interaction layer over X [B, nF, d]:
    FM: X @ X^T (bmm) -> flatten -> MLP; LCB: a learned [nL, nF] matrix applied over the
    feature axis (a transposed 3-D operand); concat, residual, LayerNorm; then a head."""

    def __init__(self, n_features=16, dim=32, n_lcb=16, hidden=128):
        super().__init__()
        self.n_features, self.dim = n_features, dim
        self.fm_mlp = nn.Sequential(nn.Linear(n_features * n_features, hidden), nn.ReLU(),
                                    nn.Linear(hidden, (n_features - n_lcb) * dim))
        self.fm_norm = nn.LayerNorm((n_features - n_lcb) * dim) if n_features > n_lcb else None
        self.lcb_weight = nn.Parameter(torch.randn(n_lcb, n_features) / n_features ** 0.5)
        self.out_norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(n_features * dim, 1)

    def forward(self, x):
        b = x.shape[0]
        fm = torch.bmm(x, x.transpose(1, 2)).reshape(b, -1)
        fm = self.fm_mlp(fm)
        if self.fm_norm is not None:
            fm = self.fm_norm(fm)
        fm = fm.reshape(b, -1, self.dim)
        lcb = self.lcb_weight @ x                     # [nL, nF] @ [B, nF, d]
        y = torch.cat([fm, lcb], dim=1) + x
        y = self.out_norm(y)
        y = self.proj(y)                              # linear over a 3-D input
        return self.head(y.reshape(b, -1))


class RoutedTowers(nn.Module):
    """Two towers and a shared head: each batch goes through `left` when its mean is
    positive, else through `right` (`torch.cond` on a data-dependent predicate). Returns the
    routed tower's output and the head's."""

    def __init__(self, d_in=32, hidden=64, d_out=16):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_in))
        self.right = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_in))
        self.head = nn.Linear(d_in, d_out)

    def forward(self, x):
        routed = torch.cond(x.mean() > 0, self.left, self.right, (x,))
        return routed, self.head(routed)


class LinearReLU(nn.Module):
    """One Linear and a ReLU: the unit the distributed tests compile, then wrap or shard."""

    def __init__(self, width_in, width_out):
        super().__init__()
        self.fc = nn.Linear(width_in, width_out)

    def forward(self, x):
        return torch.relu(self.fc(x))
