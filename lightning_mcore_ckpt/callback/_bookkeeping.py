"""Lightning's "which" bookkeeping (``best_k_models``, best and last paths) as it meets steps
that are directories committed later, saves that can fail, and states saved by earlier
versions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["adopt_legacy_state", "forget", "kept_paths", "ranked_mode"]


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


def ranked_mode(state: dict[str, Any]) -> str | None:
    """The ``mode`` a saved state ranked its steps with, where its scores tell (``None`` where
    they do not: one score, or equal ones)."""
    kth = state.get("kth_value")
    if isinstance(kth, torch.Tensor) and kth.numel() == 1 and torch.isinf(kth):
        return "min" if float(kth) > 0 else "max"  # Lightning's start value: top-k not yet full
    values = [float(v) for v in (state.get("best_k_models") or {}).values()]
    best = state.get("best_model_score")
    if best is None or len(set(values)) < 2:
        return None
    if float(best) == min(values):
        return "min"
    return "max" if float(best) == max(values) else None


def adopt_legacy_state(
    callbacks: dict[Any, Any], key: str, legacy_key: str, monitor: str | None, mode: str
) -> None:
    """A step written before the state key named the monitor, mode and cadence holds this
    callback's state under ``legacy_key`` (the dirpath alone). Taken as this callback's state
    when it was ranked by the same monitor (and, where its scores tell, mode); else only what
    does not depend on the metric (the last step saved) is, as for a changed configuration
    Lightning takes none of it."""
    if key in callbacks or legacy_key not in callbacks:
        return
    old = callbacks[legacy_key]
    if not isinstance(old, dict):
        return
    same = old.get("monitor") == monitor and ranked_mode(old) in (None, mode)
    if same:
        callbacks[key] = old
    elif "last_global_step_saved" in old:
        callbacks[key] = {"last_global_step_saved": old["last_global_step_saved"]}
