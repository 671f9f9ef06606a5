"""Sizes of symbolic shapes, as the passes and Dispatch read them."""

from __future__ import annotations

from typing import Optional

import torch


def size_hint(dim) -> Optional[int]:
    if not isinstance(dim, torch.SymInt):
        return int(dim)
    node = dim.node
    if node.hint is not None:
        return int(node.hint)
    shape_env = node.shape_env
    if not hasattr(shape_env, "has_guarding_hint"):  # torch < 2.13, before size_hint's deprecation
        hint = shape_env.size_hint(node.expr, allow_none=True)
        return None if hint is None else int(hint)
    return int(shape_env.guarding_hint_or_throw(node.expr)) if shape_env.has_guarding_hint(node.expr) else None
