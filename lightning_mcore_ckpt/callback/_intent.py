"""What the callback asks of one step's save, whether it is made, and the metadata its commit
records."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.engine import SaveRecord, record_metadata

if TYPE_CHECKING:
    from lightning_mcore_ckpt.storage.tier import Tier

__all__ = ["Intent", "decide", "monitor_entry", "step_metadata"]


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
    target: Path, overwrite: bool, tiers: Sequence[Tier], check_lock: Callable[[], None]
) -> str | None:
    """Rank 0, before ``target`` is written: ``None`` to write it, ``"exists"`` to skip it
    (complete), else why the save fails. A run that lost the directory's lock writes nothing;
    each tier, outermost first, may find it complete or refuse it
    (:meth:`~lightning_mcore_ckpt.storage.tier.Tier.before_write`)."""
    try:
        check_lock()
    except RuntimeError as err:
        return f"not saving {target}: {err}"
    for tier in reversed(tiers):
        verdict = tier.before_write(target, overwrite)
        if verdict is not None:
            return verdict
    return None
