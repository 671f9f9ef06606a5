"""LRM model zoo (Wukong, DLRM-DCNv2, MaskNet, HSTU) and realistic synthetic recsys data."""

from .data import (Batch, DataSpec, SyntheticRecsysData, auc, criteo_like_spec, logloss,
                   normalized_entropy, quality_metrics)
from .models import (MODEL_NAMES, PRESETS, RecModel, build_model, data_spec, count_parameters,
                     dense_parameters, sparse_grad_parameters, sparse_parameters, to_dense_dtype)

__all__ = [
    "Batch", "DataSpec", "SyntheticRecsysData", "auc", "criteo_like_spec", "logloss",
    "normalized_entropy", "quality_metrics", "MODEL_NAMES", "PRESETS", "RecModel", "build_model", "data_spec",
    "count_parameters", "dense_parameters", "sparse_grad_parameters", "sparse_parameters", "to_dense_dtype",
]
