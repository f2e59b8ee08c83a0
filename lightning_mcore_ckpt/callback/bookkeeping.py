"""Lightning's "which" bookkeeping (``best_k_models``, best and last paths) as it meets steps
that are directories committed later, and saves that can fail."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["forget", "kept_paths"]


def kept_paths(callback: ModelCheckpoint) -> set[Path]:
    """The steps Lightning's bookkeeping still names (retention never deletes them)."""
    named = [*callback.best_k_models, callback.best_model_path, callback.last_model_path]
    return {Path(p) for p in named if p}


def forget(callback: ModelCheckpoint, path: str) -> None:
    """Drop a step whose save failed, so that the bookkeeping names committed steps only
    (``ckpt_path="best"`` loads ``best_model_path``)."""
    scores = callback.best_k_models
    if scores.pop(path, None) is not None and scores:
        best, worst = (min, max) if callback.mode == "min" else (max, min)
        callback.best_model_path = best(scores, key=scores.__getitem__)
        callback.best_model_score = scores[callback.best_model_path]
        callback.kth_best_model_path = worst(scores, key=scores.__getitem__)
        callback.kth_value = scores[callback.kth_best_model_path]
    if callback.best_model_path == path:
        callback.best_model_path, callback.best_model_score = "", None
    if callback.last_model_path == path:
        callback.last_model_path = ""
