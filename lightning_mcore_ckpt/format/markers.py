"""The two markers of a step directory: the start marker (this package began writing it, and
for whom) and the commit marker (``metadata.json``: it is complete). Below ``layout``; imports
nothing from the package but the atomic writes."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = [
    "METADATA_FILE",
    "STARTED_MARKER",
    "is_managed",
    "is_ours",
    "mark_step_started",
    "read_metadata",
]

METADATA_FILE = "metadata.json"
"""A step's commit marker, written last."""
STARTED_MARKER = ".lightning_mcore_ckpt"
"""A step's start marker, written first."""


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A step's ``metadata.json`` as a dict, or ``None`` when missing or unreadable.

    Example::

        read_metadata("checkpoints/run/global_step_100")["total_time_s"]
    """
    try:
        with open(Path(path) / METADATA_FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mark_step_started(path: str | os.PathLike[str], *, managed: bool = True) -> None:
    """Create a step directory with this package's start marker (before anything is written).

    ``managed``: the step belongs to a run's ``MegatronCheckpoint`` (retention and cleanup may
    delete it); ``False`` for a save made by hand (``trainer.save_checkpoint``), never deleted.

    Example::

        mark_step_started("checkpoints/run/global_step_100")  # then write model/, optim/, ...
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    _atomic.write_json(
        p / STARTED_MARKER,
        {
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "managed": managed,
        },
    )


def is_ours(path: str | os.PathLike[str]) -> bool:
    """Whether this package wrote a step directory (start marker, or its commit marker).

    Example::

        is_ours("checkpoints/run/global_step_100")  # False for a directory of another tool
    """
    p = Path(path)
    if (p / STARTED_MARKER).is_file():
        return True
    meta = read_metadata(p)
    return meta is not None and "format_version" in meta and "global_step" in meta


def is_managed(path: str | os.PathLike[str]) -> bool:
    """Whether a run's ``MegatronCheckpoint`` wrote this step, so that its retention and
    cleanup may delete it: a real directory (not a link) with this package's start marker, not
    a save made by hand. Steps written before the marker said so count as managed.

    Example::

        is_managed("checkpoints/run/global_step_100")  # False for trainer.save_checkpoint's
    """
    p = Path(path)
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        marker = json.loads((p / STARTED_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    if isinstance(marker, dict):
        return bool(marker.get("managed", True))
    meta = read_metadata(p)
    return meta is not None and "format_version" in meta and not meta.get("manual", False)
