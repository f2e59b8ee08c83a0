"""Which steps to delete, and the one safe way to delete a step."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt import _atomic
from lightning_mcore_ckpt.layout import (
    METADATA_FILE,
    STARTED_MARKER,
    StepDir,
    is_ours,
    read_metadata,
    step_number,
)

__all__ = ["remove_step", "retention_plan"]


def _monitor_value(meta: Mapping[str, Any] | None, monitor: str) -> float | None:
    if not meta:
        return None
    entry = meta.get("monitor")
    if not isinstance(entry, Mapping) or entry.get("name") != monitor:
        return None
    value = entry.get("value")
    if not isinstance(value, int | float) or value != value:  # NaN never ranks
        return None
    return float(value)


def retention_plan(
    steps: Iterable[StepDir],
    *,
    max_to_keep: int | None,
    monitor: str | None = None,
    save_top_k: int = 1,
    mode: str = "min",
    protect: Iterable[int] = (),
) -> list[StepDir]:
    """Which complete steps to delete: all but the newest ``max_to_keep``, the top-k by
    ``monitor`` (read from each step's metadata) and the ``protect``-ed steps.

    With ``max_to_keep=None`` nothing is deleted. ``save_top_k=-1`` keeps every step that has a
    value for ``monitor``.
    """
    ordered = sorted(steps)
    if max_to_keep is None:
        return []
    keep = {s.step for s in ordered[-max_to_keep:]} if max_to_keep > 0 else set()
    keep |= set(protect)
    if monitor is not None and save_top_k != 0:
        scored = [
            (v, s.step)
            for s in ordered
            if (v := _monitor_value(read_metadata(s.path), monitor)) is not None
        ]
        scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], -vs[1]))
        ranked = scored if save_top_k < 0 else scored[:save_top_k]
        keep |= {step for _, step in ranked}
    return [s for s in ordered if s.step not in keep]


def remove_step(path: str | os.PathLike[str]) -> None:
    """Delete a step directory so that a crash midway leaves it *incomplete*, never damaged.

    The commit marker goes first (atomically), then the rest.
    """
    p = Path(path)
    if step_number(p) is None:
        raise ValueError(f"refusing to delete {p}: not a global_step_<N> directory")
    if not is_ours(p):
        raise ValueError(
            f"refusing to delete {p}: it has no lightning-mcore-ckpt marker ({STARTED_MARKER} "
            f"or {METADATA_FILE}), so this package did not write it"
        )
    (p / METADATA_FILE).unlink(missing_ok=True)
    _atomic.fsync_dir(p)
    shutil.rmtree(p, ignore_errors=False)
