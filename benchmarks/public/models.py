"""Registry of public recommendation models, built with the published libraries' own model
classes as they ship (nothing copied or edited), at a size preset, with synthetic batches
in each library's input format and the loss each library trains them with; and, marked
apart (origin WRITTEN_HERE, library "written-here"), models in no library that
written_here.py writes in the public style.

Libraries (the `public` extra):
- deepctr-torch 0.3.0: a model takes one float tensor X [B, columns], the feature columns
  concatenated in the order of `model.feature_index` (ids stored as floats, so tables stay
  well below 2**24 rows); its outputs are probabilities (sigmoid inside the model). Models
  carry `device` (built on it here) and L2 regularization weights (0 here: `fit` would add
  `get_regularization_loss()`, an L2 over every embedding table, no GEMM). `init_std`
  initializes the embeddings and the DNN weights; its default 1e-4 makes every tower
  output ~0 at init (the FP8 error of a zero is no test), so each preset sets one that
  keeps activations O(1) through its towers. Importing deepctr_torch starts a thread that
  asks PyPI for a newer version (and needs `requests`, which it does not declare): the
  import here answers that check offline and waits for it (`import_deepctr`).
- torch-rechub 0.9.0: a model takes a dict {feature name: tensor} (ids long [B], dense
  float [B], sequences long [B, L]); its MLPs put BatchNorm after each Linear; embeddings
  are initialized by the features' initializer (RandomNormal at the preset's
  `embed_std`).
- torchrec: not usable against torch 2.13 CPU (its fbgemm-gpu needs libtorch_cuda.so, and
  fbgemm-gpu-cpu 1.9.0 was built against another torch: undefined symbol
  torch::autograd::_wrap_outputs), so no entry uses it.

MaskNet and Wukong are in neither library: `written_here.py` writes them in the public style
(registry origin WRITTEN_HERE, names `public_style.*`), independently from their papers.

Under torch.compile every model but three traces into one graph (Dynamo counts the same
graph breaks under any backend): deepctr-torch's DIN and DIEN slice X with bounds read
through np.array(feature_index[name]) (inputs.embedding_lookup, get_dense_input,
maxlen_lookup), which Dynamo turns into data-dependent .item() calls, and its DIEN packs
sequences (pack_padded_sequence, masked_select, boolean-mask indexing, a Python loop over
the packed batch sizes); torch-rechub's DIEN branches on `.any()` of masks and indexes
the rows that have a history. BaseModel's `self.device` and `.to(device)` (constructor
only) break nothing.

Data: benchmarks.zoo's SyntheticRecsysData with one-hot tables (pooling 1), Criteo-shaped
(criteo_like_spec: 13 log1p dense features, Zipf ids), sequence models with an item
history; labels from the zoo's fixed hidden teacher, so a model that learns improves.
Multi-task labels are (click, click * conversion), the conversion from a second teacher
(teacher_seed + 1) on the same features; retrieval: DSSM point-wise on the teacher's
click, YoutubeDNN list-wise (softmax over the positive item, column 0, and sampled
negatives), the positive item a fixed hash of two user fields.

Losses: BCE on the model's probabilities (as deepctr-torch's `fit` and torch-rechub's
CTRTrainer / MTLTrainer use them, mean over the batch); multi-task sums its heads
(torch-rechub's ESMM: the CTR and CTCVR heads, as MTLTrainer does); rechub DIEN adds its
auxiliary loss, deepctr DIEN its `aux_loss` (negative sampling on); YoutubeDNN
cross-entropy with target 0 (MatchTrainer's list-wise mode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.zoo import Batch, DataSpec, SyntheticRecsysData, criteo_like_spec

__all__ = ["Preset", "PRESETS", "Entry", "REGISTRY", "MODEL_NAMES", "LIBRARY", "WRITTEN_HERE", "PublicBench",
           "PublicData", "build",
           "MissingLibrary", "import_deepctr", "library_versions", "clone_model", "count_parameters",
           "gemm_flops_per_sample", "prediction", "LOSSES"]


class MissingLibrary(ImportError):
    """The library an entry needs is not installed (the `public` extra)."""


# ------------------------------------------------------------------ presets


@dataclass(frozen=True)
class Preset:
    """Sizes shared by every model at one preset. `tower`: the main DNN (deepctr
    dnn_hidden_units, rechub mlp dims, two-tower towers before their `embed_dim` output);
    `expert`: multi-task experts; `head`: task towers, gate hidden layers, attention MLPs;
    `init_std`: deepctr-torch's init_std (embeddings and DNN weights), `embed_std`:
    torch-rechub's embedding RandomNormal std. Models written here (written_here.py):
    Wukong's `wukong_layers`, `wukong_fields` (its factorization machine and linear
    compression blocks each output that many fields), `fm_rank` (the FM projection's rank k), `dense_fields`
    (embeddings made of the dense features); MaskNet's `mask_blocks` blocks of
    `mask_width`."""

    name: str
    num_sparse: int
    max_rows: int
    embed_dim: int
    tower: tuple
    expert: tuple
    head: tuple
    batch: int
    seq_len: int
    item_rows: int
    cross_layers: int
    attn_layers: int
    heads: int
    experts: int
    low_rank: int
    cin: tuple
    afn_ltl: int
    negatives: int
    init_std: float
    embed_std: float
    wukong_layers: int
    wukong_fields: int
    fm_rank: int
    dense_fields: int
    mask_blocks: int
    mask_width: int


PRESETS: dict[str, Preset] = {
    # CPU tests: 4 fields of 16 (every GEMM dim >= 16, loka's min_gemm_dim), histories of 4,
    # batch 32: small enough that all models compile under loka in about 2 minutes on a core.
    "tiny": Preset("tiny", num_sparse=4, max_rows=1000, embed_dim=16, tower=(64, 32), expert=(32,), head=(16,),
                   batch=32, seq_len=4, item_rows=500, cross_layers=1, attn_layers=1, heads=2, experts=2,
                   low_rank=16, cin=(32, 32), afn_ltl=16, negatives=4, init_std=0.1, embed_std=0.1,
                   wukong_layers=2, wukong_fields=16, fm_rank=16, dense_fields=12, mask_blocks=2, mask_width=32),
    # Criteo-shaped: 26 one-hot tables of 128 (rows capped at 20k each: these libraries train
    # dense embedding gradients with dense Adam over every row, the same cost in every config,
    # so larger tables only dilute the GEMMs), 13 dense, towers 4096-2048-1024, batch 8192.
    # Wukong as its paper's Table 5 row (8 layers, nF = nL = 32, k = 24: [B, 64, 128] between layers),
    # MaskNet 4 parallel blocks of 1024.
    "production": Preset("production", num_sparse=26, max_rows=20_000, embed_dim=128, tower=(4096, 2048, 1024),
                         expert=(2048, 1024), head=(1024,), batch=8192, seq_len=32, item_rows=100_000,
                         cross_layers=3, attn_layers=3, heads=2, experts=4, low_rank=256, cin=(256, 256),
                         afn_ltl=256, negatives=32, init_std=0.02, embed_std=0.05,
                         wukong_layers=8, wukong_fields=32, fm_rank=24, dense_fields=6, mask_blocks=4, mask_width=1024),
}


# ------------------------------------------------------------------ library imports


def import_deepctr():
    """deepctr_torch, imported without its background PyPI version check reaching the
    network: `requests.get` answers it offline while the check's thread runs, its message
    is swallowed, and the thread is joined before returning."""
    try:
        import requests
    except ImportError as e:  # deepctr_torch imports it without declaring it
        raise MissingLibrary(f"deepctr-torch needs requests, which it does not declare: {e}") from e
    import sys
    if "deepctr_torch" in sys.modules:
        return sys.modules["deepctr_torch"]

    def offline(*args, **kwargs):
        raise requests.ConnectionError("benchmarks.public: no version check")

    before = set(threading.enumerate())
    real_get, requests.get = requests.get, offline
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                deepctr = importlib.import_module("deepctr_torch")
            except ImportError as e:
                raise MissingLibrary(f"deepctr-torch is not installed ({e}): pip install -e '.[public]'") from e
            for t in set(threading.enumerate()) - before:
                t.join(timeout=10)
    finally:
        requests.get = real_get
    return deepctr


def _import_rechub():
    try:
        return importlib.import_module("torch_rechub")
    except ImportError as e:
        raise MissingLibrary(f"torch-rechub is not installed ({e}): pip install -e '.[public]'") from e


def library_versions() -> dict:
    """Installed version (or why not) of each library of the suite."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for dist in ("deepctr-torch", "torch-rechub", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


# ------------------------------------------------------------------ data


SPARSE, DENSE = "C{}", "I{}"
ITEM, HIST, NEG_HIST, LENGTH, NEGATIVES = "item_id", "hist_item_id", "neg_hist_item_id", "seq_length", "neg_items"


def data_spec(preset: Preset, sequence: bool, positive_rate: float = 0.1) -> DataSpec:
    """One-hot Criteo-shaped tables (benchmarks.zoo.criteo_like_spec with pooling 1), an item
    history for sequence models."""
    return criteo_like_spec(preset.max_rows, 1, num_tables=preset.num_sparse,
                            seq_len=preset.seq_len if sequence else 0,
                            item_rows=preset.item_rows if sequence else 0, positive_rate=positive_rate)


def _generator(seed: int, index: int, salt: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + index * 7919 + salt) % (2**63 - 1))
    return g


class PublicData:
    """Batches of one stream (seed) for one model: the zoo's batch (features, click label)
    turned into named feature tensors, plus the extra labels and ids a model needs."""

    def __init__(self, spec: DataSpec, seed: int, extras: frozenset, preset: Preset):
        self.spec, self.seed, self.extras, self.preset = spec, seed, extras, preset
        self.stream = SyntheticRecsysData(spec, seed=seed)
        # A second teacher on the same features: conversions (multi-task).
        self.conversion = (SyntheticRecsysData(dataclasses.replace(spec, teacher_seed=spec.teacher_seed + 1,
                                                                   positive_rate=0.3), seed=seed)
                           if "conversion" in extras else None)

    def features(self, i: int, batch_size: int, device="cpu") -> tuple[dict, Batch]:
        """{name: tensor} for batch i of this stream, and the zoo batch it came from."""
        device = torch.device(device)
        b = self.stream.batch(i, batch_size, device)
        feats = {SPARSE.format(t): ids for t, ids in enumerate(b.ids)}  # one-hot: offsets are arange(B)
        feats.update({DENSE.format(j): b.dense[:, j] for j in range(self.spec.num_dense)})
        if b.seq_ids is not None:
            hist, target = b.seq_ids[:, :-1], b.seq_ids[:, -1]
            length = (hist != 0).sum(1)
            steps = hist.shape[1]
            pos = torch.arange(steps, device=device)
            # The zoo left-pads; these libraries read the first `length` positions (packed
            # sequences, length masks): move each history to the front, zeros after it.
            hist = hist.gather(1, (pos[None, :] + (steps - length)[:, None]) % steps)
            valid = pos[None, :] < length[:, None]
            hist = torch.where(valid, hist, torch.zeros_like(hist))
            feats.update({ITEM: target, HIST: hist, LENGTH: length})
            if "neg_history" in self.extras:
                g = _generator(self.seed, i, 11, device)
                neg = torch.randint(1, self.spec.item_rows, hist.shape, generator=g, device=device)
                feats[NEG_HIST] = torch.where(valid, neg, torch.zeros_like(neg))
        if "retrieval_items" in self.extras:
            rows = self.preset.item_rows
            # The positive item: a fixed hash of two user fields (learnable from the user tower).
            a, c = b.ids[self.user_fields()[0]], b.ids[self.user_fields()[1]]
            feats[ITEM] = (a * 1_000_003 + c * 7919) % (rows - 1) + 1
            g = _generator(self.seed, i, 13, device)
            feats[NEGATIVES] = torch.randint(1, rows, (batch_size, self.preset.negatives), generator=g, device=device)
        return feats, b

    def user_fields(self) -> tuple[int, int]:
        """Two user-side tables (the first half of the fields), those of >= 100 rows first."""
        half = range(max(2, self.spec.num_tables // 2))
        fields = [t for t in half if self.spec.table_rows[t] >= 100] + list(half)
        return fields[0], next(t for t in fields if t != fields[0])

    def labels(self, i: int, b: Batch, device="cpu") -> torch.Tensor:
        """Click labels [B]; with conversions [B, 2] = (click, click * conversion)."""
        if self.conversion is None:
            return b.labels
        z = self.conversion.teacher_logit(*b.model_inputs())
        g = _generator(self.seed, i, 17, torch.device(device))
        conv = (torch.rand(z.shape, generator=g, device=z.device) < torch.sigmoid(z)).float()
        return torch.stack([b.labels, b.labels * conv], 1)


# ------------------------------------------------------------------ losses


def _bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Outside autocast and in fp32: BCE on probabilities is unsafe to autocast.
    return F.binary_cross_entropy(p.float().reshape(y.shape), y.float())


LOSSES: dict[str, Callable] = {
    # one probability per example
    "ctr": lambda out, y: _bce(out, y),
    # (probability, auxiliary loss): torch-rechub DIEN, as CTRTrainer(loss_mode=False) trains it
    "ctr_aux": lambda out, y: _bce(out[0], y) + out[1],
    # [B, tasks] probabilities, one BCE per head, summed
    "multi_task": lambda out, y: sum(_bce(out[:, t], y[:, t]) for t in range(y.shape[1])),
    # torch-rechub ESMM: [cvr, ctr, ctcvr]; MTLTrainer trains the CTR and CTCVR heads
    "esmm_rechub": lambda out, y: _bce(out[:, 1], y[:, 0]) + _bce(out[:, 2], y[:, 1]),
    # logits over [positive, negatives...]: softmax cross-entropy with target 0
    "listwise": lambda out, y: F.cross_entropy(out.float(), y),
}


def prediction(out) -> torch.Tensor:
    """The tensor a model predicts (its first output when it returns a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


# ------------------------------------------------------------------ builders: deepctr-torch


def _dc_columns(p: Preset, spec: DataSpec, sequence: bool = False, neg: bool = False):
    import_deepctr()
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat
    cols = [SparseFeat(SPARSE.format(t), spec.table_rows[t], embedding_dim=p.embed_dim)
            for t in range(spec.num_tables)]
    cols += [DenseFeat(DENSE.format(j), 1) for j in range(spec.num_dense)]
    if sequence:
        cols.append(SparseFeat(ITEM, spec.item_rows, embedding_dim=p.embed_dim))
        cols.append(VarLenSparseFeat(SparseFeat(HIST, spec.item_rows, embedding_dim=p.embed_dim, embedding_name=ITEM),
                                     maxlen=spec.seq_len, length_name=LENGTH))
        if neg:
            cols.append(VarLenSparseFeat(SparseFeat(NEG_HIST, spec.item_rows, embedding_dim=p.embed_dim,
                                                    embedding_name=ITEM), maxlen=spec.seq_len, length_name=LENGTH))
    return cols


def _dc_common(p: Preset, device, seed: int) -> dict:
    return dict(init_std=p.init_std, seed=seed, device=str(device), l2_reg_embedding=0.0)


def _dc(cls: str, p: Preset, spec: DataSpec, device, seed: int, linear: bool = True, sequence=False, neg=False,
        **kw) -> nn.Module:
    import_deepctr()
    model_cls = getattr(importlib.import_module("deepctr_torch.models"), cls)
    cols = _dc_columns(p, spec, sequence, neg)
    common = _dc_common(p, device, seed)
    accepted = inspect.signature(model_cls).parameters
    common.update({k: 0.0 for k in ("l2_reg_linear", "l2_reg_dnn") if k in accepted})
    if linear:
        return model_cls(cols, cols, **common, **kw)
    return model_cls(cols, **common, **kw)


def _dc_din(p, spec, device, seed):
    return _dc("DIN", p, spec, device, seed, linear=False, sequence=True, history_feature_list=[ITEM],
               dnn_hidden_units=p.tower, att_hidden_size=(p.head[0], p.head[0]))


def _dc_dien(p, spec, device, seed):
    return _dc("DIEN", p, spec, device, seed, linear=False, sequence=True, neg=True, history_feature_list=[ITEM],
               gru_type="AUGRU", use_negsampling=True, dnn_hidden_units=p.tower,
               att_hidden_units=(p.head[0], p.head[0]))


def _dc_mmoe(p, spec, device, seed):
    return _dc("MMOE", p, spec, device, seed, linear=False, num_experts=p.experts, expert_dnn_hidden_units=p.expert,
               gate_dnn_hidden_units=p.head, tower_dnn_hidden_units=p.head)


def _dc_ple(p, spec, device, seed):
    return _dc("PLE", p, spec, device, seed, linear=False, shared_expert_num=1, specific_expert_num=1, num_levels=2,
               expert_dnn_hidden_units=p.expert, gate_dnn_hidden_units=p.head, tower_dnn_hidden_units=p.head)


def _dc_esmm(p, spec, device, seed):
    return _dc("ESMM", p, spec, device, seed, linear=False, tower_dnn_hidden_units=p.tower)


# ------------------------------------------------------------------ builders: torch-rechub


def _rh_features(p: Preset, spec: DataSpec, fields=None, dense: bool = True):
    _import_rechub()
    from torch_rechub.basic.features import DenseFeature, SparseFeature
    from torch_rechub.basic.initializers import RandomNormal
    init = RandomNormal(0.0, p.embed_std)
    fields = range(spec.num_tables) if fields is None else fields
    feats = [SparseFeature(SPARSE.format(t), spec.table_rows[t], embed_dim=p.embed_dim, initializer=init)
             for t in fields]
    if dense:
        feats += [DenseFeature(DENSE.format(j)) for j in range(spec.num_dense)]
    return feats


def _rh_sequence(p: Preset, spec: DataSpec, padding: bool = False, names=(HIST,)):
    from torch_rechub.basic.features import SequenceFeature, SparseFeature
    from torch_rechub.basic.initializers import RandomNormal
    init = RandomNormal(0.0, p.embed_std)
    pad = {"padding_idx": 0} if padding else {}
    target = [SparseFeature(ITEM, spec.item_rows, embed_dim=p.embed_dim, initializer=init, **pad)]
    history = [[SequenceFeature(n, spec.item_rows, embed_dim=p.embed_dim, pooling="concat", shared_with=ITEM,
                                initializer=init, **pad)] for n in names]
    return target, history


def _rh_model(module: str, cls: str):
    _import_rechub()
    return getattr(importlib.import_module(f"torch_rechub.models.{module}"), cls)


def _rh_dcnv2(p, spec, device, seed):
    return _rh_model("ranking", "DCNv2")(_rh_features(p, spec), n_cross_layers=p.cross_layers,
                                         mlp_params={"dims": list(p.tower)}, model_structure="parallel",
                                         use_low_rank_mixture=False)


def _rh_din(p, spec, device, seed):
    target, (history,) = _rh_sequence(p, spec)
    # DIN's MLP input counts every feature's embed_dim but reads sparse embeddings only: no dense features.
    return _rh_model("ranking", "DIN")(_rh_features(p, spec, dense=False), history, target,
                                       mlp_params={"dims": list(p.tower)},
                                       attention_mlp_params={"dims": [p.head[0], p.head[0]]})


def _rh_dien(p, spec, device, seed):
    target, (history, negative) = _rh_sequence(p, spec, padding=True, names=(HIST, NEG_HIST))
    return _rh_model("ranking", "DIEN")(_rh_features(p, spec), history, negative, target,
                                        mlp_params={"dims": list(p.tower)})


def _rh_bst(p, spec, device, seed):
    target, (history,) = _rh_sequence(p, spec, padding=True)
    return _rh_model("ranking", "BST")(_rh_features(p, spec), history, target, mlp_params={"dims": list(p.tower)},
                                       nhead=p.heads, dropout=0.0, num_layers=p.attn_layers,
                                       max_seq_len=spec.seq_len + 1)


def _rh_mmoe(p, spec, device, seed):
    return _rh_model("multi_task", "MMOE")(_rh_features(p, spec), ["classification"] * 2, n_expert=p.experts,
                                           expert_params={"dims": list(p.expert)},
                                           tower_params_list=[{"dims": list(p.head)}] * 2)


def _rh_ple(p, spec, device, seed):
    return _rh_model("multi_task", "PLE")(_rh_features(p, spec), ["classification"] * 2, n_level=2,
                                          n_expert_specific=1, n_expert_shared=1,
                                          expert_params={"dims": list(p.expert)},
                                          tower_params_list=[{"dims": list(p.head)}] * 2)


def _split(spec: DataSpec) -> tuple[range, range]:
    half = spec.num_tables // 2
    return range(half), range(half, spec.num_tables)


def _rh_esmm(p, spec, device, seed):
    # ESMM's tower width counts len(features) * embed_dim: sparse features only.
    user, item = _split(spec)
    return _rh_model("multi_task", "ESMM")(_rh_features(p, spec, user, dense=False),
                                           _rh_features(p, spec, item, dense=False),
                                           cvr_params={"dims": list(p.tower)}, ctr_params={"dims": list(p.tower)})


def _rh_dssm(p, spec, device, seed):
    user, item = _split(spec)
    tower = {"dims": list(p.tower) + [p.embed_dim]}
    return _rh_model("matching", "DSSM")(_rh_features(p, spec, user), _rh_features(p, spec, item, dense=False),
                                         user_params=tower, item_params=dict(tower))


def _rh_youtube(p, spec, device, seed):
    from torch_rechub.basic.features import SequenceFeature, SparseFeature
    from torch_rechub.basic.initializers import RandomNormal
    user, _ = _split(spec)
    init = RandomNormal(0.0, p.embed_std)
    item = [SparseFeature(ITEM, p.item_rows, embed_dim=p.embed_dim, initializer=init)]
    negatives = [SequenceFeature(NEGATIVES, p.item_rows, embed_dim=p.embed_dim, pooling="concat", shared_with=ITEM,
                                 initializer=init)]
    # temperature 0.02 as torch-rechub's YoutubeDNN example trains it (cosine scores / 0.02)
    return _rh_model("matching", "YoutubeDNN")(_rh_features(p, spec, user), item, negatives,
                                               user_params={"dims": list(p.tower) + [p.embed_dim]},
                                               temperature=0.02)


# ------------------------------------------------------------------ builders: written here in the public style


def _wh_wukong(p, spec, device, seed):
    from .written_here import Wukong
    return Wukong(list(spec.table_rows), spec.num_dense, p.embed_dim, p.dense_fields, p.wukong_layers,
                  p.wukong_fields, p.wukong_fields, p.fm_rank, fm_hidden=p.expert, top_hidden=p.tower,
                  init_std=p.embed_std)


def _wh_masknet(p, spec, device, seed, parallel=True):
    from .written_here import MaskNet
    return MaskNet(list(spec.table_rows), spec.num_dense, p.embed_dim, p.mask_blocks, p.mask_width,
                   top_hidden=p.tower, parallel=parallel, init_std=p.embed_std)


# ------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Entry:
    """One model: `library` (distribution), `cls` (the class as imported), `family`
    (interaction | multi_task | sequence | retrieval), `api` (deepctr: one tensor X; rechub:
    a dict), `loss` (a key of LOSSES), `builder(preset, spec, device, seed)`, what its data
    needs beyond the zoo's (`extras`: sequence, neg_history, conversion, retrieval_items),
    a note on how it is configured, and `origin`: LIBRARY for a published library's own
    class, WRITTEN_HERE for a model written here in the public style (written_here.py)."""

    name: str
    library: str
    cls: str
    family: str
    api: str
    loss: str
    builder: Callable
    extras: frozenset = frozenset()
    note: str = ""
    origin: str = "library"

    @property
    def sequence(self) -> bool:
        return "sequence" in self.extras


def _deepctr(name, family="interaction", loss="ctr", extras=(), note="", builder=None, **kw) -> Entry:
    cls = kw.pop("cls", name)
    if builder is None:
        def builder(p, spec, device, seed, _cls=cls, _kw=kw):
            return _dc(_cls, p, spec, device, seed, **{k: (v(p) if callable(v) else v) for k, v in _kw.items()})
    return Entry(f"deepctr_torch.{name}", "deepctr-torch", f"deepctr_torch.models.{cls}", family, "deepctr", loss,
                 builder, frozenset(extras), note)


def _rechub(module, name, builder, family, loss="ctr", extras=(), note="") -> Entry:
    return Entry(f"torch_rechub.{name}", "torch-rechub", f"torch_rechub.models.{module}.{name}", family, "rechub",
                 loss, builder, frozenset(extras), note)


LIBRARY, WRITTEN_HERE = "library", "written here in the public style"


def _written_here(name, builder, note) -> Entry:
    return Entry(f"public_style.{name}", "written-here", f"benchmarks.public.written_here.{name.split('_')[0]}",
                 "interaction", "rechub", "ctr", builder, frozenset(), note, WRITTEN_HERE)


_ENTRIES = [
    # ---- feature interaction (deepctr-torch)
    _deepctr("DeepFM", dnn_hidden_units=lambda p: p.tower),
    _deepctr("DCN", cross_num=lambda p: p.cross_layers, cross_parameterization="vector",
             dnn_hidden_units=lambda p: p.tower, l2_reg_cross=0.0, note="DCN v1, vector cross kernels"),
    _deepctr("DCNMix", cross_num=lambda p: p.cross_layers, low_rank=lambda p: p.low_rank,
             num_experts=lambda p: p.experts, dnn_hidden_units=lambda p: p.tower, l2_reg_cross=0.0,
             note="DCN-Mix: mixture of low-rank cross experts"),
    _deepctr("xDeepFM", dnn_hidden_units=lambda p: p.tower, cin_layer_size=lambda p: p.cin),
    _deepctr("AutoInt", att_layer_num=lambda p: p.attn_layers, att_head_num=lambda p: p.heads,
             dnn_hidden_units=lambda p: p.tower),
    _deepctr("FiBiNET", bilinear_type="each", dnn_hidden_units=lambda p: p.tower,
             note="bilinear_type='each': one Linear per field, called once per pair it leads"),
    _deepctr("PNN", builder=lambda p, spec, device, seed: _dc("PNN", p, spec, device, seed, linear=False,
                                                             dnn_hidden_units=p.tower, use_inner=True,
                                                             use_outter=False),
             note="inner product (IPNN)"),
    _deepctr("AFN", ltl_hidden_size=lambda p: p.afn_ltl, afn_dnn_hidden_units=lambda p: p.tower[-2:]),
    # ---- feature interaction (torch-rechub)
    _rechub("ranking", "DCNv2", _rh_dcnv2, "interaction", note="DCN-V2: full-rank cross matrices, parallel DNN"),
    # ---- sequence
    _deepctr("DIN", family="sequence", builder=_dc_din, extras=("sequence",),
             note="DIN builds its DNN without init_std (deepctr's default 1e-4): its output is ~constant at init"),
    _deepctr("DIEN", family="sequence", builder=_dc_dien, extras=("sequence", "neg_history"),
             note="AUGRU, negative sampling with the auxiliary loss"),
    _rechub("ranking", "DIN", _rh_din, "sequence", extras=("sequence",)),
    _rechub("ranking", "DIEN", _rh_dien, "sequence", loss="ctr_aux", extras=("sequence", "neg_history"),
            note="GRU + AUGRU, auxiliary loss on negative histories"),
    _rechub("ranking", "BST", _rh_bst, "sequence", extras=("sequence",), note="dropout 0"),
    # ---- multi-task
    _deepctr("MMOE", family="multi_task", loss="multi_task", builder=_dc_mmoe, extras=("conversion",)),
    _deepctr("PLE", family="multi_task", loss="multi_task", builder=_dc_ple, extras=("conversion",)),
    _deepctr("ESMM", family="multi_task", loss="multi_task", builder=_dc_esmm, extras=("conversion",),
             note="outputs (ctr, ctcvr)"),
    _rechub("multi_task", "MMOE", _rh_mmoe, "multi_task", loss="multi_task", extras=("conversion",)),
    _rechub("multi_task", "PLE", _rh_ple, "multi_task", loss="multi_task", extras=("conversion",)),
    _rechub("multi_task", "ESMM", _rh_esmm, "multi_task", loss="esmm_rechub", extras=("conversion",),
            note="user / item halves of the fields, sparse only"),
    # ---- two-tower retrieval
    _rechub("matching", "DSSM", _rh_dssm, "retrieval", note="point-wise BCE on the towers' cosine"),
    _rechub("matching", "YoutubeDNN", _rh_youtube, "retrieval", loss="listwise", extras=("retrieval_items",),
            note="list-wise softmax over the positive and sampled negatives, temperature 0.02"),
    # ---- written here in the public style (in no library)
    _written_here("Wukong", _wh_wukong, "x.permute(0, 2, 1) @ W projections (bare Parameters), LayerNorm over d of "
                                        "cat(FMB, LCB) + residual, Linear-BatchNorm1d-ReLU-Dropout MLPs"),
    _written_here("MaskNet", _wh_masknet, "parallel MaskBlocks on field-wise LayerNormed embeddings, then an MLP"),
    _written_here("MaskNet_serial", lambda p, spec, device, seed: _wh_masknet(p, spec, device, seed, parallel=False),
                  "serial MaskBlocks, block on block"),
]

REGISTRY: dict[str, Entry] = {e.name: e for e in _ENTRIES}
MODEL_NAMES: tuple[str, ...] = tuple(REGISTRY)


# ------------------------------------------------------------------ one model, built


class PublicBench:
    """A built model (fp32, on `device`) with its data streams, input format and loss.

    `batch(i)` -> (inputs, labels) of the training stream (seed); `stream(seed)` another
    stream of the same teacher (held-out: seed + 1000); `loss(out, labels)`;
    `prediction(out)` the tensor compared across configs."""

    def __init__(self, entry: Entry, preset: Preset, model: nn.Module, spec: DataSpec, device: torch.device,
                 seed: int):
        self.entry, self.preset, self.model, self.spec = entry, preset, model, spec
        self.device, self.seed = device, seed
        self._streams: dict[int, PublicData] = {}
        self.loss_fn = LOSSES[entry.loss]

    @property
    def name(self) -> str:
        return self.entry.name

    def data(self, seed: int | None = None) -> PublicData:
        seed = self.seed if seed is None else seed
        if seed not in self._streams:
            self._streams[seed] = PublicData(self.spec, seed, self.entry.extras, self.preset)
        return self._streams[seed]

    def inputs(self, feats: dict[str, torch.Tensor]):
        """The model's input: deepctr-torch one float tensor in `feature_index` order, torch-rechub the dict."""
        if self.entry.api == "deepctr":
            b = next(iter(feats.values())).shape[0]
            return torch.cat([feats[name].float().reshape(b, -1) for name in self.model.feature_index], 1)
        return dict(feats)

    def batch(self, i: int, batch_size: int | None = None, device=None, seed: int | None = None):
        """(inputs, labels) of batch i of stream `seed` (default: the training stream)."""
        device = self.device if device is None else torch.device(device)
        batch_size = self.preset.batch if batch_size is None else batch_size
        data = self.data(seed)
        feats, b = data.features(i, batch_size, device)
        if self.entry.loss == "listwise":
            labels = torch.zeros(batch_size, dtype=torch.long, device=device)
        else:
            labels = data.labels(i, b, device)
        return self.inputs(feats), labels

    def loss(self, out, labels, model: nn.Module | None = None) -> torch.Tensor:
        """The training loss of `out` (the output of `model`, default this bench's model: a
        deepctr-torch DIEN leaves its auxiliary loss on the model, as `fit` reads it)."""
        loss = self.loss_fn(out, labels)
        if self.entry.api == "deepctr" and self.entry.name.endswith("DIEN"):
            loss = loss + (self.model if model is None else model).aux_loss.float().sum()
        return loss

    @staticmethod
    def prediction(out) -> torch.Tensor:
        return prediction(out)


def build(name: str, preset: str | Preset = "tiny", device="cpu", seed: int = 0) -> PublicBench:
    """Model `name` of REGISTRY, freshly initialized in fp32 from `seed` on `device`
    (torch's global RNG state is restored after building: deepctr-torch's constructors
    call torch.manual_seed)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    p = PRESETS[preset] if isinstance(preset, str) else preset
    entry = REGISTRY[name]
    device = torch.device(device)
    spec = data_spec(p, entry.sequence)
    forked = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked, device_type=device.type if forked else "cuda"):
        torch.manual_seed(seed)
        model = entry.builder(p, spec, device, seed).to(device)
    model.train()
    return PublicBench(entry, p, model, spec, device, seed)


def clone_model(model: nn.Module) -> nn.Module:
    """copy.deepcopy of `model` after it has run: some library modules keep a tensor of the
    last forward as an attribute (deepctr-torch's InteractingLayer its attention scores,
    BaseModel the DIEN auxiliary loss), which deepcopy refuses; those are copied detached."""
    import copy
    memo = {}
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and not v.is_leaf:
                memo[id(v)] = v.detach().clone()
    return copy.deepcopy(model, memo)


def count_parameters(model: nn.Module) -> dict:
    """Embedding-table parameters and the rest."""
    tables = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for p in m.parameters()}
    sparse = sum(p.numel() for p in model.parameters() if id(p) in tables)
    return {"sparse": sparse, "dense": sum(p.numel() for p in model.parameters()) - sparse}


def gemm_flops_per_sample(bench: PublicBench, batch: int = 16, forward_only: bool = False) -> float:
    """GEMM GFLOPs per sample of one fp32 forward + backward (training) or one forward in
    eval mode (`forward_only`), by torch's FlopCounterMode on a copy of the model (its
    BatchNorm statistics untouched)."""
    from torch.utils.flop_counter import FlopCounterMode
    model = clone_model(bench.model)
    inputs, labels = bench.batch(10**6, batch, seed=bench.seed + 7)
    with FlopCounterMode(display=False) as counter:
        if forward_only:
            with torch.no_grad():
                model.eval()(inputs)
        else:
            bench.loss(model(inputs), labels, model).backward()
    del model
    return counter.get_total_flops() / batch / 1e9

