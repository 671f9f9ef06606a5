"""LRM model zoo: Wukong, DLRM-DCNv2, MaskNet and an HSTU-style sequential model.

Every model is `RecModel(sparse, dense)`:

- `sparse` (SparseArch): the embedding lookups, `nn.EmbeddingBag` tables (sum pooling over
  flat ids + offsets) and, for sequence models, an item `nn.Embedding`. Always fp32: this
  is the part production keeps in high precision (and in TorchRec/FBGEMM, outside the
  compiled region).
- `dense` (the dense arch): everything after the lookups, where the GEMMs are. It casts
  its inputs to its own parameter dtype, so `to_dense_dtype(model, torch.bfloat16)` makes
  a bf16 dense arch over fp32 tables.

`model(dense, ids, offsets, seq_ids)` runs both; `model.dense(*model.sparse(...))` is
the same thing split, which lets a harness compile the dense arch alone. The output is
one logit per example (train with BCEWithLogits).

Presets: `tiny` runs on CPU in seconds; `paper` is sized for one 80 GB GPU at batch 8192
(tables capped near 1M rows in total per model).

Sparse gradients: `build_model(..., sparse=True)` (or a preset with `sparse=True`, as the
DLRM-DCNv2 paper preset has) builds the tables with `sparse=True`, so their backward
yields sparse COO gradients holding only the looked-up rows, as DLRM trains them; the
optimizer must then accept sparse gradients (`torch.optim.SparseAdam`, `Adagrad`, `SGD`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .data import DataSpec, criteo_like_spec

__all__ = [
    "RecModel",
    "SparseArch",
    "WukongDense",
    "DlrmDcnV2Dense",
    "MaskNetDense",
    "HstuDense",
    "MODEL_NAMES",
    "PRESETS",
    "build_model",
    "data_spec",
    "to_dense_dtype",
    "dense_parameters",
    "sparse_parameters",
    "sparse_grad_parameters",
    "count_parameters",
]


# ------------------------------------------------------------------ building blocks


def mlp(dims: list[int], *, final_activation: bool, bias: bool = True) -> nn.Sequential:
    """Linear layers dims[0] -> ... -> dims[-1] with ReLU between (and after the last one
    when final_activation)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if final_activation or i < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SparseArch(nn.Module):
    """fp32 embedding lookups. Returns (dense_features, pooled [B, T, d], seq [B, L+1, d] or
    None, seq_valid [B, L+1] bool or None). With `sparse`, every table (and the item table)
    produces sparse gradients."""

    def __init__(self, spec: DataSpec, dim: int, item_dim: int = 0, sparse: bool = False):
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for rows in spec.table_rows)
        self.items = (nn.Embedding(spec.item_rows, item_dim, padding_idx=0, sparse=sparse)
                      if spec.seq_len else None)
        # DLRM-style init: uniform(+-1/sqrt(rows)) so pooled sums start small for any table size.
        for t in self.tables:
            nn.init.uniform_(t.weight, -1.0 / math.sqrt(t.num_embeddings), 1.0 / math.sqrt(t.num_embeddings))
        if self.items is not None:
            nn.init.normal_(self.items.weight, std=0.02)
            with torch.no_grad():
                self.items.weight[0].zero_()

    def forward(self, dense, ids, offsets, seq_ids=None):
        pooled = torch.stack([t(i, o) for t, i, o in zip(self.tables, ids, offsets)], dim=1)
        if self.items is None or seq_ids is None:
            return dense, pooled, None, None
        return dense, pooled, self.items(seq_ids), seq_ids != 0


class RecModel(nn.Module):
    """Sparse arch (fp32 tables) followed by a dense arch; one logit per example."""

    def __init__(self, sparse: SparseArch, dense: nn.Module):
        super().__init__()
        self.sparse = sparse
        self.dense = dense

    def forward(self, dense, ids, offsets, seq_ids=None):
        return self.dense(*self.sparse(dense, ids, offsets, seq_ids))


# ------------------------------------------------------------------ Wukong


class WukongLayer(nn.Module):
    """One Wukong interaction layer (Zhang et al. 2024, arXiv 2403.02545):

        FMB(X) = MLP(LN(flatten(X (X^T Y))))  -> [B, nF, d]   optimized FM, Y: [n, k]
        LCB(X) = W_L X                        -> [B, nL, d]   W_L: [nL, n]
        X'     = LN(concat(FMB, LCB) + residual(X))

    Both X^T Y and W_L X are Linears over the feature axis of X^T (the transposed 3-D
    input case). The residual is X itself, or a learned feature-axis projection when
    n != nF + nL.
    """

    def __init__(self, n_in: int, d: int, n_fm: int, n_lc: int, k: int, mlp_dims: list[int]):
        super().__init__()
        self.n_fm, self.d = n_fm, d
        self.fm_proj = nn.Linear(n_in, k, bias=False)
        self.fm_norm = nn.LayerNorm(n_in * k)
        self.fm_mlp = mlp([n_in * k, *mlp_dims, n_fm * d], final_activation=False)
        self.lcb = nn.Linear(n_in, n_lc, bias=False)
        self.residual = nn.Linear(n_in, n_fm + n_lc, bias=False) if n_in != n_fm + n_lc else None
        self.norm = nn.LayerNorm(d)

    def forward(self, x):  # x: [B, n, d]
        b = x.shape[0]
        xt = x.transpose(1, 2)  # [B, d, n]
        fm = torch.bmm(x, self.fm_proj(xt))  # [B, n, d] @ [B, d, k] -> [B, n, k]
        fmb = self.fm_mlp(self.fm_norm(fm.flatten(1))).view(b, self.n_fm, self.d)
        lcb = self.lcb(xt).transpose(1, 2)  # [B, nL, d]
        res = x if self.residual is None else self.residual(xt).transpose(1, 2)
        return self.norm(torch.cat([fmb, lcb], dim=1) + res)


class WukongDense(nn.Module):
    """Dense features -> n_dense_emb embeddings by an MLP; with the sparse embeddings they
    form X0 [B, n0, d]; l interaction layers; flatten -> top MLP -> logit."""

    def __init__(self, num_dense: int, num_sparse: int, d: int, n_dense_emb: int, layers: int,
                 n_fm: int, n_lc: int, k: int, fmb_mlp: list[int], dense_mlp: list[int],
                 top_mlp: list[int]):
        super().__init__()
        self.d, self.n_dense_emb = d, n_dense_emb
        self.dense_mlp = mlp([num_dense, *dense_mlp, n_dense_emb * d], final_activation=False)
        n = num_sparse + n_dense_emb
        blocks = []
        for _ in range(layers):
            blocks.append(WukongLayer(n, d, n_fm, n_lc, k, fmb_mlp))
            n = n_fm + n_lc
        self.layers = nn.Sequential(*blocks)
        self.top = mlp([n * d, *top_mlp, 1], final_activation=False)

    def forward(self, dense, pooled, seq=None, seq_valid=None):
        dt = self.top[-1].weight.dtype
        b = dense.shape[0]
        x_dense = self.dense_mlp(dense.to(dt)).view(b, self.n_dense_emb, self.d)
        x = torch.cat([x_dense, pooled.to(dt)], dim=1)
        x = self.layers(x)
        return self.top(x.flatten(1)).squeeze(-1)


# ------------------------------------------------------------------ DLRM-DCNv2


class LowRankCross(nn.Module):
    """DCNv2 cross layer, low-rank: x_{l+1} = x0 * (U (V x_l) + b) + x_l."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.v = nn.Linear(dim, rank, bias=False)
        self.u = nn.Linear(rank, dim, bias=True)

    def forward(self, x0, x):
        return x0 * self.u(self.v(x)) + x


class DlrmDcnV2Dense(nn.Module):
    """MLPerf DLRMv2 dense arch: bottom MLP (ReLU after every layer), concat with the table
    embeddings, low-rank DCNv2 cross layers, top MLP to one logit."""

    def __init__(self, num_dense: int, num_sparse: int, d: int, bottom: list[int],
                 cross_layers: int, cross_rank: int, top: list[int]):
        super().__init__()
        if bottom[-1] != d:
            raise ValueError("bottom MLP must end at the embedding dim")
        self.bottom = mlp([num_dense, *bottom], final_activation=True)
        width = (num_sparse + 1) * d
        self.cross = nn.ModuleList(LowRankCross(width, cross_rank) for _ in range(cross_layers))
        self.top = mlp([width, *top, 1], final_activation=False)

    def forward(self, dense, pooled, seq=None, seq_valid=None):
        dt = self.top[-1].weight.dtype
        x0 = torch.cat([self.bottom(dense.to(dt)), pooled.to(dt).flatten(1)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.top(x).squeeze(-1)


# ------------------------------------------------------------------ MaskNet


class MaskBlock(nn.Module):
    """MaskNet MaskBlock on feature embeddings (Wang et al. 2021, arXiv 2102.07619):
    instance-guided mask = Linear-ReLU-Linear of the raw embeddings, multiplied into the
    layer-normed embeddings, then Linear (no bias) -> LayerNorm -> ReLU."""

    def __init__(self, emb_width: int, agg_width: int, hidden: int):
        super().__init__()
        self.mask = nn.Sequential(nn.Linear(emb_width, agg_width), nn.ReLU(),
                                  nn.Linear(agg_width, emb_width))
        self.hidden = nn.Linear(emb_width, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, emb, emb_normed):
        return F.relu(self.norm(self.hidden(self.mask(emb) * emb_normed)))


class MaskNetDense(nn.Module):
    """Parallel MaskNet: dense features -> one extra field embedding; all fields
    concatenated; `blocks` MaskBlocks side by side; concat -> top MLP -> logit."""

    def __init__(self, num_dense: int, num_sparse: int, d: int, blocks: int, agg_width: int,
                 hidden: int, top: list[int]):
        super().__init__()
        self.dense_proj = nn.Linear(num_dense, d)
        width = (num_sparse + 1) * d
        self.emb_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(MaskBlock(width, agg_width, hidden) for _ in range(blocks))
        self.top = mlp([blocks * hidden, *top, 1], final_activation=False)

    def forward(self, dense, pooled, seq=None, seq_valid=None):
        dt = self.top[-1].weight.dtype
        emb = torch.cat([self.dense_proj(dense.to(dt)), pooled.to(dt).flatten(1)], dim=1)
        normed = self.emb_norm(emb)
        return self.top(torch.cat([blk(emb, normed) for blk in self.blocks], dim=1)).squeeze(-1)


# ------------------------------------------------------------------ HSTU


class HstuBlock(nn.Module):
    """HSTU layer (Zhai et al. 2024, arXiv 2402.17152), pre-norm:

        u, v, q, k = split(SiLU(Linear(LN(x))))
        A          = SiLU(q k^T / sqrt(dqk)) * mask / L       pointwise, not softmax
        y          = Linear(LN(A v) * u) + x
    """

    def __init__(self, d: int, heads: int, dqk: int, dv: int):
        super().__init__()
        self.heads, self.dqk, self.dv = heads, dqk, dv
        self.norm = nn.LayerNorm(d)
        self.uvqk = nn.Linear(d, heads * (2 * dv + 2 * dqk))
        self.attn_norm = nn.LayerNorm(heads * dv)
        self.out = nn.Linear(heads * dv, d)

    def forward(self, x, mask):  # x [B, L, d]; mask [B, 1, L, L] in x.dtype (1 = attend)
        b, n, _ = x.shape
        h, dqk, dv = self.heads, self.dqk, self.dv
        u, v, q, k = torch.split(F.silu(self.uvqk(self.norm(x))), [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        q = q.view(b, n, h, dqk).transpose(1, 2)
        k = k.view(b, n, h, dqk).transpose(1, 2)
        v = v.view(b, n, h, dv).transpose(1, 2)
        attn = F.silu(q @ k.transpose(-1, -2) * (dqk ** -0.5)) * mask / n
        av = (attn @ v).transpose(1, 2).reshape(b, n, h * dv)
        return self.out(self.attn_norm(av) * u) + x


class HstuDense(nn.Module):
    """Item-history sequence (target item last) + learned positions -> HSTU blocks with a
    causal, padding-aware mask; the target position's output, the pooled context
    embeddings and projected dense features -> top MLP -> logit."""

    def __init__(self, num_dense: int, num_sparse: int, d: int, ctx_dim: int, seq_len: int,
                 layers: int, heads: int, dqk: int, dv: int, top: list[int]):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(seq_len + 1, d) * 0.02)
        self.blocks = nn.ModuleList(HstuBlock(d, heads, dqk, dv) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d)
        self.dense_proj = nn.Linear(num_dense, ctx_dim)
        self.top = mlp([d + (num_sparse + 1) * ctx_dim, *top, 1], final_activation=False)

    def forward(self, dense, pooled, seq, seq_valid):
        dt = self.top[-1].weight.dtype
        n = seq.shape[1]
        x = seq.to(dt) + self.pos.to(dt)
        causal = torch.ones(n, n, dtype=torch.bool, device=seq.device).tril()
        mask = (causal[None, None] & seq_valid[:, None, None, :]).to(dt)
        for blk in self.blocks:
            x = blk(x, mask)
        target = self.final_norm(x[:, -1])
        ctx = torch.cat([target, self.dense_proj(dense.to(dt)), pooled.to(dt).flatten(1)], dim=1)
        return self.top(ctx).squeeze(-1)


# ------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Preset:
    """Data spec (max rows per table, pooling cap, tables, sequence) + model sizes; `sparse`:
    the embedding tables produce sparse gradients (build_model's default for the preset)."""

    max_rows: int
    pooling_cap: float
    arch: dict
    num_tables: int = 26
    seq_len: int = 0
    item_rows: int = 0
    sparse: bool = False


PRESETS: dict[str, dict[str, Preset]] = {
    "wukong": {
        # Wukong paper Table 5 row: l=8, nF=nL=32, k=24, FMB MLP 3x2048, d=160.
        "paper": Preset(100_000, 100, dict(d=160, n_dense_emb=6, layers=8, n_fm=32, n_lc=32, k=24,
                                           fmb_mlp=[2048, 2048, 2048], dense_mlp=[512],
                                           top_mlp=[1024, 256])),
        "tiny": Preset(1000, 8, dict(d=16, n_dense_emb=2, layers=2, n_fm=8, n_lc=8, k=4,
                                      fmb_mlp=[64, 64], dense_mlp=[32], top_mlp=[32])),
    },
    "dlrm_dcnv2": {
        # MLPerf DLRMv2: bottom 13-512-256-128, 3 low-rank (512) cross layers,
        # top 1024-1024-512-256-1, 26 tables of dim 128 (rows capped at 100k each).
        # Sparse table gradients, as DLRM trains: dense ones would mean a gradient and an
        # Adam update over all 26 x 100k x 128 = 333M table values every step (about 9 GB
        # of memory traffic, ~3 ms at H100 bandwidth), more than the dense arch's ~2 ms.
        "paper": Preset(100_000, 100, dict(d=128, bottom=[512, 256, 128], cross_layers=3,
                                           cross_rank=512, top=[1024, 1024, 512, 256]), sparse=True),
        "tiny": Preset(1000, 8, dict(d=16, bottom=[32, 16], cross_layers=2, cross_rank=16,
                                      top=[64, 32])),
    },
    "masknet": {
        # Parallel MaskNet at LRM width: 27 fields x 64 = 1728 wide, mask aggregation layer
        # twice as wide (reduction ratio 2), 8 MaskBlocks of 1024.
        "paper": Preset(100_000, 100, dict(d=64, blocks=8, agg_width=3456, hidden=1024,
                                           top=[1024, 512])),
        "tiny": Preset(1000, 8, dict(d=16, blocks=2, agg_width=32, hidden=32, top=[32])),
    },
    "hstu": {
        # 64-item history + target, d=256, 3 blocks of 4 heads; 8 context tables.
        # Attention is [B, 4, 65, 65] per block: sized to fit batch 8192 with an fp32 copy.
        "paper": Preset(50_000, 20, dict(d=256, ctx_dim=64, layers=3, heads=4, dqk=64, dv=64,
                                          top=[512, 256]),
                        num_tables=8, seq_len=64, item_rows=500_000),
        "tiny": Preset(1000, 8, dict(d=16, ctx_dim=8, layers=2, heads=2, dqk=8, dv=8, top=[32]),
                       num_tables=8, seq_len=12, item_rows=2000),
    },
}

MODEL_NAMES = tuple(PRESETS)


def _build_wukong(spec: DataSpec, a: dict, sparse: bool) -> RecModel:
    return RecModel(SparseArch(spec, a["d"], sparse=sparse), WukongDense(spec.num_dense, spec.num_tables, **a))


def _build_dlrm(spec: DataSpec, a: dict, sparse: bool) -> RecModel:
    return RecModel(SparseArch(spec, a["d"], sparse=sparse), DlrmDcnV2Dense(spec.num_dense, spec.num_tables, **a))


def _build_masknet(spec: DataSpec, a: dict, sparse: bool) -> RecModel:
    return RecModel(SparseArch(spec, a["d"], sparse=sparse), MaskNetDense(spec.num_dense, spec.num_tables, **a))


def _build_hstu(spec: DataSpec, a: dict, sparse: bool) -> RecModel:
    return RecModel(SparseArch(spec, a["ctx_dim"], item_dim=a["d"], sparse=sparse),
                    HstuDense(spec.num_dense, spec.num_tables, seq_len=spec.seq_len, **a))


_BUILDERS: dict[str, Callable[[DataSpec, dict, bool], RecModel]] = {
    "wukong": _build_wukong, "dlrm_dcnv2": _build_dlrm, "masknet": _build_masknet, "hstu": _build_hstu,
}


def data_spec(name: str, preset: str = "tiny", *, positive_rate: float = 0.1,
              max_rows: int | None = None) -> DataSpec:
    """The DataSpec of the inputs model `name` expects at `preset` (no model is built);
    `max_rows` caps every table below the preset's cap (smaller tables, same dense arch)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    if preset not in PRESETS[name]:
        raise ValueError(f"unknown preset {preset!r} for {name}; valid: {', '.join(PRESETS[name])}")
    p = PRESETS[name][preset]
    rows = p.max_rows if max_rows is None else min(p.max_rows, max_rows)
    return criteo_like_spec(rows, p.pooling_cap, num_tables=p.num_tables, seq_len=p.seq_len,
                            item_rows=p.item_rows, positive_rate=positive_rate)


def build_model(name: str, preset: str = "tiny", *, positive_rate: float = 0.1, seed: int = 0,
                device=None, sparse: bool | None = None, max_rows: int | None = None) -> tuple[RecModel, DataSpec]:
    """A freshly initialized fp32 model and the DataSpec of the inputs it expects.

    Initialization is deterministic for (seed, device), and the same with or without
    sparse gradients; device="meta" builds the shapes only (parameter counts of `paper`
    presets without allocating them). `sparse`: embedding tables with sparse gradients
    (None: the preset's choice, see `Preset.sparse`); `max_rows`: see `data_spec`.
    """
    spec = data_spec(name, preset, positive_rate=positive_rate, max_rows=max_rows)
    if sparse is None:
        sparse = PRESETS[name][preset].sparse
    device = torch.device(device) if device is not None else torch.device("cpu")
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type if forked else "cuda"):
        torch.manual_seed(seed)
        with device:
            model = _BUILDERS[name](spec, dict(PRESETS[name][preset].arch), bool(sparse))
    # Start the head at the prior log-odds so training spends no steps learning the base rate.
    head = model.dense.top[-1]
    with torch.no_grad():
        head.bias.fill_(math.log(positive_rate / (1.0 - positive_rate)))
    return model, spec


# ------------------------------------------------------------------ helpers


def to_dense_dtype(model: RecModel, dtype: torch.dtype) -> RecModel:
    """Cast the dense arch (parameters and buffers) to dtype; embedding tables stay fp32."""
    model.dense.to(dtype)
    return model


def dense_parameters(model: RecModel) -> list[tuple[str, nn.Parameter]]:
    return [(f"dense.{n}", p) for n, p in model.dense.named_parameters()]


def sparse_parameters(model: RecModel) -> list[tuple[str, nn.Parameter]]:
    return [(f"sparse.{n}", p) for n, p in model.sparse.named_parameters()]


def sparse_grad_parameters(model: RecModel) -> list[tuple[str, nn.Parameter]]:
    """The embedding-table parameters whose gradients are sparse (tables built with
    `sparse=True`)."""
    return [(f"sparse.{mn}.{pn}" if mn else f"sparse.{pn}", p)
            for mn, mod in model.sparse.named_modules()
            if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse
            for pn, p in mod.named_parameters(recurse=False)]


def count_parameters(model: RecModel) -> dict[str, int]:
    return {
        "dense": sum(p.numel() for _, p in dense_parameters(model)),
        "sparse": sum(p.numel() for _, p in sparse_parameters(model)),
    }
