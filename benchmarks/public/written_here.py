"""Models written here in the public style: architectures that neither deepctr-torch nor
torch-rechub ships, written the way public repositories write them (from the papers, not
copied from any repository), so the suite also covers their forms. They are not library
models and the registry says so (`Entry.origin`).

- Wukong (Zhang et al. 2024, arXiv 2403.02545): a stack of interaction layers over a
  [B, n, d] tensor of field embeddings. Each layer's factorization machine block computes
  X (X^T Y) with the projection Y a bare `nn.Parameter` applied as `x.permute(0, 2, 1) @ Y`,
  flattens, normalizes and runs an MLP; its linear compression block computes W^T X as
  `(x.permute(0, 2, 1) @ W).permute(0, 2, 1)`; the two blocks are concatenated along the
  field axis, the residual added (itself projected the same way when the widths differ)
  and a LayerNorm taken over the last dim d. MLPs are Linear -> BatchNorm1d -> ReLU ->
  Dropout.
- MaskNet (Wang et al. 2021, arXiv 2102.07619): instance-guided masks (an aggregation
  Linear -> ReLU -> projection Linear of the raw embeddings, `reduction` times wider than
  its input) multiply either the field-wise LayerNorm of the embeddings or a previous
  block's output; each MaskBlock is then Linear (no bias) -> LayerNorm -> ReLU. Serial:
  block on block, the last one feeds the output layer; parallel: blocks side by side on
  the embeddings, concatenated, then an MLP.

Both take torch-rechub's input (a dict: ids long [B] under "C<t>", dense floats [B] under
"I<j>") and return a click probability [B] (sigmoid inside, as the libraries' models do).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["mlp_bn", "FieldEmbeddings", "FactorizationMachineBlock", "LinearCompressionBlock", "WukongLayer",
           "Wukong", "InstanceGuidedMask", "MaskBlock", "MaskNet"]


def mlp_bn(width: int, hidden: tuple, dropout: float = 0.0) -> nn.Sequential:
    """Linear -> BatchNorm1d -> ReLU -> Dropout per hidden width."""
    layers = []
    for out in hidden:
        layers += [nn.Linear(width, out), nn.BatchNorm1d(out), nn.ReLU(), nn.Dropout(dropout)]
        width = out
    return nn.Sequential(*layers)


class FieldEmbeddings(nn.Module):
    """One nn.Embedding per sparse field, and the dense features as one [B, num_dense]
    tensor: returns ([B, fields, dim], [B, num_dense])."""

    def __init__(self, table_rows: list, num_dense: int, dim: int, init_std: float):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for rows in table_rows)
        for table in self.tables:
            nn.init.normal_(table.weight, std=init_std)
        self.num_dense = num_dense

    def forward(self, x: dict) -> tuple:
        sparse = torch.stack([table(x[f"C{t}"]) for t, table in enumerate(self.tables)], dim=1)
        dense = torch.stack([x[f"I{j}"].float() for j in range(self.num_dense)], dim=1)
        return sparse, dense


def _bare_weight(rows: int, cols: int) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(rows, cols))
    nn.init.xavier_uniform_(weight)
    return weight


class FactorizationMachineBlock(nn.Module):
    """X (X^T Y) -> flatten -> LayerNorm -> MLP -> [B, n_out, d]."""

    def __init__(self, n: int, d: int, rank: int, n_out: int, hidden: tuple, dropout: float):
        super().__init__()
        self.n_out, self.d = n_out, d
        self.proj = _bare_weight(n, rank)
        self.norm = nn.LayerNorm(n * rank)
        self.mlp = mlp_bn(n * rank, hidden, dropout)
        self.out = nn.Linear(hidden[-1] if hidden else n * rank, n_out * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, n, d]
        compressed = x.permute(0, 2, 1) @ self.proj  # [B, d, rank]
        interactions = torch.matmul(x, compressed)  # [B, n, rank]
        h = self.mlp(self.norm(interactions.flatten(1)))
        return self.out(h).view(-1, self.n_out, self.d)


class LinearCompressionBlock(nn.Module):
    """W^T X: [B, n, d] -> [B, n_out, d], through the transposed input and back."""

    def __init__(self, n: int, n_out: int):
        super().__init__()
        self.weight = _bare_weight(n, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.permute(0, 2, 1) @ self.weight).permute(0, 2, 1)


class WukongLayer(nn.Module):
    def __init__(self, n: int, d: int, n_fm: int, n_lc: int, rank: int, hidden: tuple, dropout: float):
        super().__init__()
        self.fmb = FactorizationMachineBlock(n, d, rank, n_fm, hidden, dropout)
        self.lcb = LinearCompressionBlock(n, n_lc)
        # The residual needs the output's field count: compressed like the LCB when it differs.
        self.residual = None if n == n_fm + n_lc else LinearCompressionBlock(n, n_fm + n_lc)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([self.fmb(x), self.lcb(x)], dim=1)
        residual = x if self.residual is None else self.residual(x)
        return self.norm(out + residual)


class Wukong(nn.Module):
    """Dense features -> `dense_fields` embeddings by an MLP; with the sparse embeddings they
    form X0 [B, n0, d]; `layers` Wukong layers; flatten -> MLP -> Linear -> sigmoid."""

    def __init__(self, table_rows: list, num_dense: int, dim: int, dense_fields: int, layers: int, n_fm: int,
                 n_lc: int, rank: int, fm_hidden: tuple, top_hidden: tuple, dropout: float = 0.0,
                 init_std: float = 0.05):
        super().__init__()
        self.dim, self.dense_fields = dim, dense_fields
        self.embeddings = FieldEmbeddings(table_rows, num_dense, dim, init_std)
        self.dense = nn.Sequential(mlp_bn(num_dense, fm_hidden[:1], dropout),
                                   nn.Linear(fm_hidden[0], dense_fields * dim))
        n = len(table_rows) + dense_fields
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(WukongLayer(n, dim, n_fm, n_lc, rank, fm_hidden, dropout))
            n = n_fm + n_lc
        self.top = mlp_bn(n * dim, top_hidden, dropout)
        self.logit = nn.Linear(top_hidden[-1], 1)

    def forward(self, x: dict) -> torch.Tensor:
        sparse, dense = self.embeddings(x)
        dense = self.dense(dense).view(-1, self.dense_fields, self.dim)
        h = torch.cat([dense, sparse], dim=1)
        for layer in self.layers:
            h = layer(h)
        return torch.sigmoid(self.logit(self.top(h.flatten(1))).squeeze(-1))


class InstanceGuidedMask(nn.Module):
    """Aggregation Linear (`reduction` x wider) -> ReLU -> projection Linear to `width`."""

    def __init__(self, emb_width: int, width: int, reduction: float):
        super().__init__()
        hidden = int(emb_width * reduction)
        self.aggregate = nn.Linear(emb_width, hidden)
        self.project = nn.Linear(hidden, width)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.project(torch.relu(self.aggregate(emb)))


class MaskBlock(nn.Module):
    """mask(emb) * input -> Linear (no bias) -> LayerNorm -> ReLU."""

    def __init__(self, emb_width: int, in_width: int, out_width: int, reduction: float):
        super().__init__()
        self.mask = InstanceGuidedMask(emb_width, in_width, reduction)
        self.hidden = nn.Linear(in_width, out_width, bias=False)
        self.norm = nn.LayerNorm(out_width)

    def forward(self, emb: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.hidden(self.mask(emb) * inputs)))


class MaskNet(nn.Module):
    """Serial or parallel MaskNet over the field embeddings and one field of dense features
    (a Linear of them); `block_width` each block's output."""

    def __init__(self, table_rows: list, num_dense: int, dim: int, blocks: int, block_width: int, top_hidden: tuple,
                 reduction: float = 2.0, parallel: bool = True, dropout: float = 0.0, init_std: float = 0.05):
        super().__init__()
        self.parallel = parallel
        self.embeddings = FieldEmbeddings(table_rows, num_dense, dim, init_std)
        self.dense = nn.Linear(num_dense, dim)
        self.field_norm = nn.LayerNorm(dim)  # LN_EMB: each field's embedding normalized on its own
        width = (len(table_rows) + 1) * dim
        if parallel:
            self.blocks = nn.ModuleList(MaskBlock(width, width, block_width, reduction) for _ in range(blocks))
            self.top = mlp_bn(blocks * block_width, top_hidden, dropout)
            out_width = top_hidden[-1]
        else:
            self.blocks = nn.ModuleList(MaskBlock(width, width if i == 0 else block_width, block_width, reduction)
                                        for i in range(blocks))
            self.top = nn.Identity()
            out_width = block_width
        self.logit = nn.Linear(out_width, 1)

    def forward(self, x: dict) -> torch.Tensor:
        sparse, dense = self.embeddings(x)
        fields = torch.cat([self.dense(dense).unsqueeze(1), sparse], dim=1)  # [B, f, dim]
        emb = fields.flatten(1)
        normed = self.field_norm(fields).flatten(1)
        if self.parallel:
            h = torch.cat([block(emb, normed) for block in self.blocks], dim=1)
        else:
            h = normed
            for block in self.blocks:
                h = block(emb, h)
        return torch.sigmoid(self.logit(self.top(h)).squeeze(-1))
