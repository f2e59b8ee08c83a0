"""The callback's state in a step of the previous release: keyed by the ``dirpath`` alone,
taken as this callback's state where it was ranked the same way."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["adopt_legacy_state", "ranked_mode"]


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
