"""A step's saved fit-loop counters (Lightning's ``fit_loop`` state, in each rank's ``extra/``
file): a step saved once an epoch is closed, written and recognised as "epoch done, next not
started".

Plain dictionaries, nothing imported: the command line reads a step's loop state
(``lightning-mcore-ckpt inspect``) without Lightning, which the callback's save rewrites it with.
"""

from __future__ import annotations

from typing import Any

__all__ = ["between_epochs", "close_epoch"]


def _zero(progress: dict[str, Any]) -> None:
    for key in progress:
        progress[key] = 0


def close_epoch(fit: dict[str, Any]) -> None:
    """Write a step saved once an epoch is closed as "epoch done, next not started".

    A step saved after the epoch's last batch and its epoch-end work (hooks, per-epoch LR
    schedulers), e.g. at the next epoch's start or at the end of fit, carries the counters of
    that moment: the epoch's batches still counted as current, or the next epoch already
    "ready". Lightning resumes those inside the wrong epoch or at the wrong batch index. The
    counters are rewritten to what they are between two epochs, which Lightning resumes at
    batch 0 of the next epoch; mid-epoch steps are left as they are.
    """
    epochs = fit.get("epoch_progress")
    batches = fit.get("epoch_loop.batch_progress")
    if not epochs or not batches or not batches.get("is_last_batch"):
        return
    current = epochs["current"]
    if current["processed"] != current["started"] or current["completed"] != current["processed"]:
        return  # inside an epoch (its last batch done, its end not yet run)
    for scope in ("current", "total"):
        done = epochs[scope]["completed"]
        for key in ("ready", "started", "processed"):
            epochs[scope][key] = done
    _zero(batches["current"])
    batches["is_last_batch"] = False
    for key in (
        "epoch_loop.scheduler_progress",
        "epoch_loop.manual_optimization.optim_step_progress",
    ):
        if key in fit:
            _zero(fit[key]["current"])
    optim = fit.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    for part in optim.values():
        _zero(part["current"])
    val = fit.get("epoch_loop.val_loop.batch_progress")
    if val is not None:
        _zero(val["current"])
        _zero(val["total"])
        val["is_last_batch"] = False


def between_epochs(fit: dict[str, Any]) -> bool:
    """Whether a saved fit-loop state is the one :func:`close_epoch` writes."""
    batches = fit.get("epoch_loop.batch_progress")
    if not batches or batches.get("is_last_batch") or any(batches["current"].values()):
        return False
    total = batches["total"]
    return bool(total["completed"]) and total["completed"] == total["processed"]
