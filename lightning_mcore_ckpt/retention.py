"""Which steps to delete, and the one safe way to delete a step."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from lightning_mcore_ckpt import _atomic
from lightning_mcore_ckpt.layout import (
    METADATA_FILE,
    STARTED_MARKER,
    StepDir,
    is_ours,
    step_number,
)

__all__ = ["remove_step", "retention_plan"]


def retention_plan(
    steps: Iterable[StepDir],
    *,
    max_to_keep: int | None,
    remove: Iterable[str | os.PathLike[str]] = (),
    keep: Iterable[str | os.PathLike[str]] = (),
    protect: Iterable[int] = (),
) -> list[StepDir]:
    """Which complete steps to delete, oldest first.

    A step is deleted when it was asked for in ``remove`` (Lightning's top-k and "last"
    bookkeeping let it go) or is older than the newest ``max_to_keep`` (``None``: no limit),
    unless it is kept: among the newest ``max_to_keep``, in ``keep`` (the steps Lightning's
    bookkeeping still names) or its number is in ``protect``.

    Example::

        retention_plan(complete_steps(root), max_to_keep=2)  # all but the newest two
    """
    ordered = sorted(steps)
    kept_paths = {Path(p) for p in keep}
    kept = set(protect)
    if max_to_keep is not None:
        kept |= {s.step for s in ordered[-max_to_keep:]} if max_to_keep > 0 else set()
    asked = {Path(p) for p in remove}
    doomed = []
    for s in ordered:
        if s.step in kept or s.path in kept_paths:
            continue
        beyond = max_to_keep is not None and s.step not in kept
        if beyond or s.path in asked:
            doomed.append(s)
    return doomed


def remove_step(path: str | os.PathLike[str]) -> None:
    """Delete a step directory so that a crash midway leaves it *incomplete*, never damaged.

    The commit marker goes first (atomically), then the rest. Refuses (``ValueError``) a
    directory not named ``global_step_<N>`` or without this package's markers.

    Example::

        remove_step("checkpoints/run/global_step_100")
    """
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"refusing to delete {p}: it is a symbolic link, not a step directory")
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
