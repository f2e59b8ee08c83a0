"""What the callback asks of one step's save, whether it is made, and the metadata its commit
records."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.engine import SaveRecord, record_metadata
from lightning_mcore_ckpt.format import layout, retention

if TYPE_CHECKING:
    from lightning_mcore_ckpt.callback._tier import StoreTier

__all__ = ["Intent", "decide", "monitor_entry", "step_metadata"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Intent:
    """What the callback asked of one step's save (the same on every rank)."""

    step: int
    epoch: int
    contents: tuple[str, ...]
    """What the step holds when committed (``"hf_model"`` is added by the export after it)."""
    monitor: dict[str, Any] | None
    """``{"name", "value"}`` of the value Lightning ranked the step by, or ``None``."""
    export: bool


def step_metadata(intent: Intent, record: SaveRecord) -> dict[str, Any]:
    """A step's ``metadata.json`` fields (its size and throughput are added at the commit)."""
    metadata = record_metadata(record, step=intent.step, epoch=intent.epoch)
    metadata["contents"] = list(intent.contents)
    return {**metadata, "monitor": intent.monitor, "hf_export_time_s": None}


def monitor_entry(name: str | None, value: Any) -> dict[str, Any] | None:
    """The ``monitor`` field of a step's metadata (``None`` when there is no value)."""
    if name is None or value is None:
        return None
    number = float(value.item() if hasattr(value, "item") else value)
    return {"name": name, "value": number if math.isfinite(number) else None}


def decide(
    target: Path,
    root: Path,
    overwrite: bool,
    tier: StoreTier | None,
    check_lock: Callable[[], None],
) -> str | None:
    """Rank 0, before ``target`` is written: ``None`` to write it, ``"exists"`` to skip it
    (complete), else why the save fails. A run that lost the directory's lock writes nothing;
    a foreign directory is never touched; an incomplete one of ours (a crashed save) is
    removed, and a complete one too with ``overwrite``."""
    try:
        check_lock()
    except RuntimeError as err:
        return f"not saving {target}: {err}"
    managed = layout.is_managed(target)
    if tier is not None and tier.before_save(target) == "exists":
        return "exists"
    if layout.is_complete(target) and overwrite and managed:
        log.warning("replacing %s (overwrite=True)", target)
        retention.remove_step(target)
    elif layout.is_complete(target):
        return "exists"
    elif target.exists() and not managed:
        return (
            f"{target} exists but was not written by a MegatronCheckpoint run (a link, "
            f"a save by hand or another program's files); move it out of {root} "
            "(it is never deleted)"
        )
    elif target.exists():
        log.warning("removing incomplete %s before saving it again", target)
        retention.remove_step(target)
    return None
