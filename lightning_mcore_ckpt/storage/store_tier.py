"""The object-store tier of an ``s3://`` ``dirpath`` (:class:`StoreTier`, a
:class:`~lightning_mcore_ckpt.storage.tier.Tier`).

Each step is written and sealed in the local tier as on any local ``dirpath`` (the writer, the
hashes, ``metadata.json`` by rename), then published to the store by the commit thread
(:func:`~lightning_mcore_ckpt.storage.publication.publish_step`: every object, then the
marker, then the tracker). ``durability`` says when the step counts: ``"store"`` (its commit
is reported once published; a failed upload fails the save and the local copy is removed, so
"last" never names it) or ``"local"`` (reported at the local commit; the upload is a job of
its own, whose failure is reported, the step staying in the local tier). Retention runs on the
store's steps, and the local tier follows it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import integrity, layout, markers, retention
from lightning_mcore_ckpt.format.layout import StepDir
from lightning_mcore_ckpt.storage import node_parts, publication, store_views
from lightning_mcore_ckpt.storage.object_store import ObjectStore
from lightning_mcore_ckpt.storage.store_lock import StoreLock

__all__ = ["StoreTier"]

log = logging.getLogger(__name__)


class StoreTier:
    """The store of an ``s3://`` ``dirpath``, behind its local tier ``root``."""

    def __init__(self, store: ObjectStore, root: Path, durability: str, staging: bool) -> None:
        self.store = store
        self.root = root
        self.durability = durability
        """When a step counts as saved ("last" may name it): ``"store"``, once its marker is
        in the store; ``"local"``, once it is committed in the local tier (its upload follows)."""
        self.staging = staging
        """The local tier is a staging directory: a step leaves it once published."""
        self.lock: StoreLock | None = None
        self._sent: dict[str, dict[str, int]] = {}  # per step: the objects this run uploaded
        self.leaders: tuple[int, ...] = (0,)
        """The ranks that upload a step: each local directory's leader (its lowest rank). More
        than one: the local tier is node-local (:meth:`share_nodes`)."""
        self.rank = 0
        self.parts_timeout_s = 1800.0
        self._parts: dict[str, list[dict[str, Any]]] = {}  # per step: each node's upload
        self._parts_started: dict[str, float] = {}  # per step: when rank 0 began gathering

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

    @property
    def where(self) -> str:
        return self.store.url

    @property
    def node_local(self) -> bool:
        """Whether the local tier is node-local: nodes that share no file system each hold
        their part of a step, uploaded by their own leader
        (:mod:`~lightning_mcore_ckpt.storage.node_parts`); whole steps are in the store alone."""
        return len(self.leaders) > 1

    def share_nodes(self, leaders: Sequence[int], rank: int, timeout_s: float) -> None:
        """Every rank, at setup: the leader of each local directory (its lowest rank; one per
        node when the directory is node-local), this rank, and how long rank 0 waits for the
        other nodes' parts of a step (the process group's timeout)."""
        self.leaders = tuple(sorted(set(leaders)))
        self.rank = rank
        self.parts_timeout_s = timeout_s

    @property
    def awaited(self) -> bool:
        return self.durability == "store"

    # --- a run's hold on the store -----------------------------------------------------------

    def acquire(self) -> None:
        lock = StoreLock(self.store)
        lock.acquire()
        lock.start_heartbeat()
        self.lock = lock

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def register(self, sources: dict[str, Any]) -> None:
        """The strategy finds "last" (:meth:`resolve_last`) and a step no longer in the local
        tier (its ``store``) through the tier."""
        sources[str(self.root)] = self

    # --- a step's commit (rank 0, the commit thread) -----------------------------------------

    def before_write(self, target: Path, overwrite: bool) -> str | None:
        """``"exists"`` when ``target`` is published; with durability ``"store"``, a local
        seal that never got published is removed (it was not saved)."""
        if self.is_published(target):
            return "exists"
        if self.durability == "store" and layout.is_complete(target) and markers.is_managed(target):
            retention.remove_step(target)
        if self.node_local:  # the objects of an attempt that never got its marker, before any
            stale = list(self.store.list(target.name))  # node uploads this one's parts
            if stale:
                log.info("removing %d objects of an unpublished %s", len(stale), target.name)
                self.store.delete(stale)
        return None

    def gather_parts(
        self, target: Path, hashes: Mapping[str, str]
    ) -> dict[str, tuple[int, str]] | None:
        """Node-local: rank 0 uploads its node's part of ``target``, waits for every other
        node's confirmation of its own, and checks them against the digests the ranks recorded
        (``hashes``); the files on other nodes, each with its size and digest, for the seal.
        ``None`` when the local tier is shared (the publication uploads the whole step)."""
        if not self.node_local:
            return None
        name = target.name
        self._parts_started[name] = time.perf_counter()
        own = node_parts.upload_part(self.store, target, hashes, self.rank)
        others = node_parts.await_parts(self.store, name, self.leaders[1:], self.parts_timeout_s)
        everything = node_parts.merge_parts(name, [own, *others], hashes)
        missing = sorted(n for n in hashes if n not in everything)
        if missing:
            raise OSError(
                f"{len(missing)} files of {name} that ranks wrote were uploaded by no node "
                f"(e.g. {missing[0]}); the step is not published"
            )
        self._parts[name] = [own, *others]
        here = node_parts.merge_parts(name, [own], hashes)
        return {n: found for n, found in everything.items() if n not in here}

    def part_upload(self, target: Path, hashes: Mapping[str, str]) -> Callable[[], Any] | None:
        """Node-local, on each other node's leader: the job (for a background thread) that
        uploads its node's part of the written step ``target`` and confirms it; ``None`` on
        the other ranks."""
        if not self.node_local or self.rank == 0 or self.rank not in self.leaders:
            return None
        return functools.partial(self._upload_part, target, dict(hashes))

    def _upload_part(self, target: Path, hashes: dict[str, str]) -> None:
        node_parts.upload_part(self.store, target, hashes, self.rank)
        # This node's parts are only read through the store: the older ones go.
        number = layout.step_number(target) or 0
        for old in [*layout.incomplete_steps(self.root), *layout.complete_steps(self.root)]:
            if old.step < number and markers.is_managed(old.path):
                retention.remove_step(old.path)

    def publish(self, target: Path, first: bool) -> dict[str, Any]:
        """Upload a step sealed in the local tier (again: what it gained, e.g. its Hugging
        Face export); its figures. When the ``first`` publication fails with durability
        ``"store"``, the local copy is removed (the save failed: nothing names it)."""
        if self.lock is not None:
            self.lock.check()
        sent = self._sent.setdefault(target.name, {})
        try:
            if self.node_local and not first:
                raise ValueError("a step's parts are published once (no export is added)")
            if self.node_local:  # its parts are uploaded: the marker, once they all are there
                figures = publication.publish_parts(
                    self.store,
                    target,
                    self._parts.pop(target.name),
                    since=self._parts_started.pop(target.name, None),
                )
            else:
                figures = publication.publish_step(self.store, target, sent=sent)
        except Exception as err:
            if first and self.durability == "store" and layout.is_complete(target):
                retention.remove_step(target)
            raise RuntimeError(
                f"uploading {target.name} to {self.store.url} failed: {err}; the store's "
                "steps are unchanged (this one is not published)"
            ) from err
        return figures

    def unpublished(self) -> list[Path]:
        """Durability ``"local"``: the local tier's sealed steps newer than the store's
        newest, to publish (a run killed before their upload)."""
        if self.awaited:
            return []  # an unpublished local seal was not saved: removed before its rewrite
        newest = max(publication.published_steps(self.store), default=-1)
        return [s.path for s in layout.complete_steps(self.root) if s.step > newest]

    def is_published(self, target: Path) -> bool:
        return (
            layout.step_number(target) is not None
            and self.store.head(f"{target.name}/{markers.METADATA_FILE}") is not None
        )

    # --- the steps it holds ------------------------------------------------------------------

    def complete_steps(self) -> list[StepDir]:
        """The store's published steps, named by their local-tier path (Lightning's names)."""
        published = publication.published_steps(self.store)
        return [StepDir(n, layout.step_dir(self.root, n)) for n in sorted(published)]

    def managed_steps(self) -> list[StepDir]:
        return self.complete_steps()  # a store is published to by this package alone

    def has_last(self) -> bool:
        """Whether ``fit(ckpt_path="last")`` finds a step to resume (every rank)."""
        self.root.mkdir(parents=True, exist_ok=True)  # Lightning looks at the path it is given
        if publication.published_steps(self.store):
            return True
        return self.durability == "local" and bool(layout.complete_steps(self.root))

    def resolve_last(self, reading: tuple[str, ...] | None, deep: bool) -> str | None:
        """The step ``fit(ckpt_path="last")`` loads: a local-tier path or a step URL.

        The store's newest published, undamaged step; a local copy of it with the same seal
        is read instead (the fast tier). With durability ``"local"``, the local tier's newest
        undamaged step wins when it is newer.
        """
        found = store_views.newest_intact(self.store, reading, deep)
        if self.node_local:  # a node-local copy is a part of its step: the store's is read
            return None if found is None else self.store.child(found.name).url
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

    # --- retention (rank 0, the commit thread) -----------------------------------------------

    def tidy(self, newest: int) -> None:
        """After a commit: the store's objects of unpublished steps older than ``newest``; in
        a staging local tier, the local copies of published steps but the newest."""
        self.remove_incomplete(newest)
        if self.staging:
            for step in layout.complete_steps(self.root):
                if step.step < newest and markers.is_managed(step.path):
                    retention.remove_step(step.path)

    def remove(self, step: StepDir) -> None:
        """The step leaves the store, marker first (the local tier follows)."""
        publication.remove_published(self.store, step.step)

    def remove_incomplete(self, newest: int) -> None:
        """Objects of steps older than ``newest`` that never got their marker (killed or failed
        uploads)."""
        objects = self.store.list()
        marker = f"/{markers.METADATA_FILE}"
        published = {n.split("/", 1)[0] for n in objects if n.endswith(marker)}
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


def _seal(step: Path) -> Any:
    meta = markers.read_metadata(step) or {}
    return meta.get(integrity.METADATA_HASH) or meta.get("saved_at")
