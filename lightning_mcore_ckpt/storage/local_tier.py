"""The local directory tier: where every step is written and sealed, and published by the
tracker (:class:`LocalTier`, a :class:`~lightning_mcore_ckpt.storage.tier.Tier`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import layout, markers, retention
from lightning_mcore_ckpt.format.layout import StepDir
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = ["LocalTier"]

log = logging.getLogger(__name__)


@dataclass(eq=True)
class LocalTier:
    """The ``dirpath`` on a local (or shared) file system, or an object store's local tier.

    A step is published here when the tracker names it. The directory's lock is the
    callback's (:class:`~lightning_mcore_ckpt.storage.lock.DirectoryLock`).
    """

    root: Path

    @property
    def where(self) -> str:
        return str(self.root)

    @property
    def awaited(self) -> bool:
        return True  # the tracker is written in the commit

    def acquire(self) -> None:
        """The directory's lock is taken by the callback (every run has one)."""

    def release(self) -> None:
        """See :meth:`acquire`."""

    def register(self, sources: dict[str, Any]) -> None:
        """Nothing: a local step is found by its path."""

    def before_write(self, target: Path, overwrite: bool) -> str | None:
        """A foreign directory is never touched; an incomplete one of ours (a crashed save) is
        removed, and a complete one too with ``overwrite``."""
        managed = markers.is_managed(target)
        if layout.is_complete(target) and overwrite and managed:
            log.warning("replacing %s (overwrite=True)", target)
            retention.remove_step(target)
        elif layout.is_complete(target):
            return "exists"
        elif target.exists() and not managed:
            return (
                f"{target} exists but was not written by a MegatronCheckpoint run (a link, "
                f"a save by hand or another program's files); move it out of {self.root} "
                "(it is never deleted)"
            )
        elif target.exists():
            log.warning("removing incomplete %s before saving it again", target)
            retention.remove_step(target)
        return None

    def gather_parts(
        self, target: Path, hashes: Mapping[str, str]
    ) -> dict[str, tuple[int, str]] | None:
        """Nothing: every file of a step is in this directory (a local ``dirpath`` is shared
        by every rank: checked at setup)."""
        return None

    def part_upload(self, target: Path, hashes: Mapping[str, str]) -> Callable[[], Any] | None:
        """Nothing: see :meth:`gather_parts`."""
        return None

    def publish(self, target: Path, first: bool) -> dict[str, Any]:
        """The tracker names the step, at its commit (never again: an older step's export
        does not move it back)."""
        if first:
            sealed = markers.read_metadata(target) or {}
            layout.write_tracker(self.root, int(sealed["global_step"]))
        return {}

    def unpublished(self) -> list[Path]:
        return []  # sealed and published at once, on the commit thread

    def complete_steps(self) -> list[StepDir]:
        return layout.complete_steps(self.root)

    def managed_steps(self) -> list[StepDir]:
        # Only what this package's runs wrote: never a link, a save by hand, a user's file.
        return [s for s in layout.complete_steps(self.root) if markers.is_managed(s.path)]

    def has_last(self) -> bool:
        return bool(layout.complete_steps(self.root))

    def tidy(self, newest: int) -> None:
        for stale in layout.incomplete_steps(self.root):
            if stale.step < newest and markers.is_managed(stale.path):
                log.info("removing incomplete %s (a newer step is committed)", stale.path)
                retention.remove_step(stale.path)
        # Only this thread writes the tracker, and the directory's lock keeps other runs out:
        # a temporary tracker file here was left by a run killed between its write and rename.
        for leftover in _atomic.leftovers(self.root / layout.TRACKER_FILE):
            log.info("removing %s (left by a run killed while it wrote the tracker)", leftover)
            leftover.unlink(missing_ok=True)

    def remove(self, step: StepDir) -> None:
        if step.path.is_dir() and markers.is_managed(step.path):
            retention.remove_step(step.path)
