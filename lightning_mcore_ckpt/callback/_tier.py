"""An object-store ``dirpath``: the local tier and the store behind it.

Each step is written and committed in the local tier as on any local ``dirpath`` (the writer,
the hashes, ``metadata.json`` by rename), then published to the store by the commit thread
(:func:`~lightning_mcore_ckpt.storage.publication.publish_step`: every object, then the marker, then the
tracker). ``durability`` says when the step counts: ``"store"`` (its commit is reported once
published; a failed upload fails the save and the local copy is removed, so "last" never names
it) or ``"local"`` (reported at the local commit; the upload is a job of its own, whose failure
is reported, the step staying in the local tier). Retention runs on the store's steps, and the
local tier follows it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.callback._config import CheckpointConfig
from lightning_mcore_ckpt.format import layout, retention
from lightning_mcore_ckpt.format.layout import StepDir
from lightning_mcore_ckpt.storage import publication as replica
from lightning_mcore_ckpt.storage.object_store import ObjectStore
from lightning_mcore_ckpt.storage.store_lock import StoreLock

__all__ = ["StoreTier", "retain"]

log = logging.getLogger(__name__)


class StoreTier:
    """The store of an ``s3://`` ``dirpath`` and its local tier ``root``."""

    def __init__(self, store: ObjectStore, root: Path, durability: str, staging: bool) -> None:
        self.store = store
        self.root = root
        self.durability = durability
        self.staging = staging
        """The local tier is a staging directory: a step leaves it once published."""
        self.lock: StoreLock | None = None
        self._sent: dict[str, dict[str, int]] = {}  # per step: the objects this run uploaded

    # A pickled copy (of the callback) is the same store and tier; the lock and the record of
    # uploads belong to the run in progress, and start afresh at the next fit's setup.

    def __getstate__(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "root": self.root,
            "durability": self.durability,
            "staging": self.staging,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoreTier):
            return NotImplemented
        return self.__getstate__() == other.__getstate__()

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def of(cls, config: CheckpointConfig) -> StoreTier | None:
        """The tier of a checked config's ``s3://`` ``dirpath``, or ``None``."""
        if config.store is None:
            return None
        return cls(config.store, config.root, config.durability, config.local_dir is None)

    def before_save(self, target: Path) -> str | None:
        """Rank 0, before ``target`` is written: ``"exists"`` when it is published; with
        durability ``"store"``, a local commit that never got published is removed (it was
        not saved)."""
        if self.is_published(target):
            return "exists"
        if self.durability == "store" and layout.is_complete(target) and layout.is_managed(target):
            retention.remove_step(target)
        return None

    # --- the commit thread (rank 0) ----------------------------------------------------------

    def publish(self, target: Path, first: bool = False) -> dict[str, Any]:
        """Upload a step committed in the local tier (again: what it gained, e.g. its Hugging
        Face export); its figures. When the ``first`` publication fails with durability
        ``"store"``, the local copy is removed (the save failed: nothing names it)."""
        if self.lock is not None:
            self.lock.check()
        sent = self._sent.setdefault(target.name, {})
        try:
            figures = replica.publish_step(self.store, target, sent=sent)
        except Exception as err:
            if first and self.durability == "store" and layout.is_complete(target):
                retention.remove_step(target)
            raise RuntimeError(
                f"uploading {target.name} to {self.store.url} failed: {err}; the store's "
                "steps are unchanged (this one is not published)"
            ) from err
        return figures

    def tidy(self, newest: int) -> None:
        """After a commit: the store's objects of unpublished steps older than ``newest``; in
        a staging local tier, the local copies of published steps but the newest."""
        self.remove_incomplete(newest)
        if self.staging:
            for step in layout.complete_steps(self.root):
                if step.step < newest and layout.is_managed(step.path):
                    retention.remove_step(step.path)

    def publish_job(self, target: Path) -> dict[str, Any]:
        """Durability ``"local"``: the upload of a step already reported as committed."""
        step = layout.step_number(target)
        return {"global_step": step, **self.publish(target)}

    def complete_steps(self) -> list[StepDir]:
        """The store's published steps, named by their local-tier path (Lightning's names)."""
        published = replica.published_steps(self.store)
        return [StepDir(n, layout.step_dir(self.root, n)) for n in sorted(published)]

    def is_published(self, target: Path) -> bool:
        step = layout.step_number(target)
        return (
            step is not None
            and self.store.head(f"{target.name}/{layout.METADATA_FILE}") is not None
        )

    def remove(self, step: StepDir) -> None:
        """Retention: the step leaves the store (marker first), then the local tier."""
        replica.remove_published(self.store, step.step)
        if step.path.is_dir() and layout.is_managed(step.path):
            retention.remove_step(step.path)

    def remove_incomplete(self, newest: int) -> None:
        """Objects of steps older than ``newest`` that never got their marker (killed or failed
        uploads)."""
        objects = self.store.list()
        published = {n.split("/", 1)[0] for n in objects if n.endswith(f"/{layout.METADATA_FILE}")}
        stale = [
            n
            for n in objects
            if (number := layout.step_number(n.split("/", 1)[0])) is not None
            and number < newest
            and n.split("/", 1)[0] not in published
        ]
        if stale:
            log.info("removing %d objects of unpublished steps from %s", len(stale), self.store.url)
            self.store.delete(stale)

    def catch_up(self) -> list[Path]:
        """Durability ``"local"``: the local tier's committed steps newer than the store's
        newest, to publish (a run killed before their upload)."""
        published = replica.published_steps(self.store)
        newest = max(published, default=-1)
        return [s.path for s in layout.complete_steps(self.root) if s.step > newest]

    # --- "last" (rank 0, when the strategy loads) ---------------------------------------------

    def has_last(self) -> bool:
        """Whether ``fit(ckpt_path="last")`` finds a step to resume (every rank)."""
        if replica.published_steps(self.store):
            return True
        return self.durability == "local" and bool(layout.complete_steps(self.root))

    def resolve_last(self, reading: tuple[str, ...] | None, deep: bool) -> str | None:
        """The step ``fit(ckpt_path="last")`` loads: a local-tier path or a step URL.

        The store's newest published, undamaged step; a local copy of it with the same seal
        is read instead (the fast tier). With durability ``"local"``, the local tier's newest
        undamaged step wins when it is newer.
        """
        found = replica.newest_intact(self.store, reading, deep)
        local = None
        if self.durability == "local":  # the local tier's own "last" counts too
            local = layout.resolve_last(self.root, reading=reading, deep=deep)
        if local is not None:
            if found is None or (layout.step_number(local) or 0) > (layout.step_number(found) or 0):
                return str(local)
        if found is None:
            return None
        mine = self.root / found.name
        if (
            layout.is_complete(mine)
            and _seal(mine) == _seal(found)
            and not layout.verify_step(mine, reading, deep)
        ):
            return str(mine)
        return self.store.child(found.name).url


def _seal(step: Path) -> Any:
    meta = layout.read_metadata(step) or {}
    return meta.get("metadata_hash") or meta.get("saved_at")


def retain(
    root: Path,
    tier: StoreTier | None,
    max_to_keep: int | None,
    removals: list[Path],
    keep: set[Path],
    replaced: Iterable[Path],
    uploading: Iterable[int],
) -> None:
    """Retention after a commit (rank 0, commit thread). Scans the directory (or the store):
    nothing is kept only in memory. Never deletes the newest committed step (also when it is
    the one this run resumed from), nor one being uploaded to the Hub."""
    for other in replaced:  # another run's steps, replaced by this one (overwrite=True)
        if layout.is_complete(other) and layout.is_managed(other):
            log.info("overwrite: removing %s of the replaced run", other)
            retention.remove_step(other)
    # Only what this package's runs wrote: never a link, a save by hand, a user's file.
    complete = [s for s in layout.complete_steps(root) if layout.is_managed(s.path)]
    if tier is not None:  # the store's steps; the local tier follows
        complete = tier.complete_steps()
    if not complete:
        return
    newest = complete[-1].step
    if tier is not None:
        tier.tidy(newest)
    for stale in layout.incomplete_steps(root):
        if stale.step < newest and layout.is_managed(stale.path):
            log.info("removing incomplete %s (a newer step is committed)", stale.path)
            retention.remove_step(stale.path)
    doomed = retention.retention_plan(
        complete, max_to_keep=max_to_keep, remove=removals, keep=keep, protect={newest, *uploading}
    )
    for old in doomed:
        log.info("retention: removing %s", old.path)
        if tier is not None:
            tier.remove(old)
        else:
            retention.remove_step(old.path)
