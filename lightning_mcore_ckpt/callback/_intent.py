"""What the callback asks of one step's save, and the metadata its commit records."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_mcore_ckpt.engine import SaveRecord, record_metadata

__all__ = ["Intent", "monitor_entry", "step_metadata"]


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
