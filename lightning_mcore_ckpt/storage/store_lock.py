"""One writer per ``dirpath`` in an object store: a lock object, created and renewed with
conditional writes (see :class:`StoreLock`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from lightning_mcore_ckpt.storage import object_store
from lightning_mcore_ckpt.storage.heartbeat import Heartbeat
from lightning_mcore_ckpt.storage.holders import (
    describe_holder,
    displaceable,
    holder_record,
    job_identity,
    parse_holder,
)
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = ["StoreLock"]

log = logging.getLogger(__name__)


class StoreLock:
    """One writer per ``dirpath`` in an object store: the object ``.lightning_mcore_ckpt.lock``.

    Created with a conditional write (``If-None-Match: *``), so that of runs racing for it
    exactly one gets it; its heartbeat is a conditional rewrite (``If-Match``), so that a holder
    whose lock was taken over notices (:meth:`check`). Taken over as a local lock is (see
    :class:`~lightning_mcore_ckpt.storage.lock.DirectoryLock`): at once from a process of this host
    that no longer runs or from the same job (a requeue), otherwise once the heartbeat is
    ``stale_after_s`` old.

    Example::

        lock = StoreLock(ObjectStore.from_url("s3://ckpts/run1"))
        lock.acquire()
        lock.release()
    """

    def __init__(self, store: ObjectStore, stale_after_s: float = 300.0) -> None:
        self.store = store
        self.stale_after_s = stale_after_s
        self.job_id = job_identity()
        self.lost: str | None = None
        self._etag: str | None = None
        self._record: dict[str, Any] = {}
        self._heartbeat: Heartbeat | None = None

    def acquire(self) -> None:
        self._record = holder_record(self.job_id)
        data = json.dumps(self._record).encode()
        for _ in range(5):
            try:
                self._etag = self.store.put_bytes(LOCK_FILE, data, if_none_match=True)
                return
            except Exception as err:
                if not object_store.is_precondition_failed(err):
                    raise
            found = self.store.head(LOCK_FILE)
            if found is None:
                continue  # released meanwhile
            holder = parse_holder(self.store.get_bytes(LOCK_FILE))
            age = time.time() - found[2]
            why = self._displaceable(holder, age)
            if why is None:
                raise RuntimeError(
                    f"{self.store.url} is in use by another run ({describe_holder(holder, age)}): "
                    "two runs writing one dirpath would delete each other's checkpoints. Use "
                    f"another dirpath, or stop that run; if it is dead, delete "
                    f"{self.store.child(LOCK_FILE).url}, or wait until its heartbeat is "
                    f"{self.stale_after_s:.0f}s old"
                )
            try:
                self._etag = self.store.put_bytes(LOCK_FILE, data, if_match=found[1])
            except Exception as err:
                if not object_store.is_precondition_failed(err):
                    raise
                continue
            log.warning(
                "took over the lock of %s (%s): %s",
                self.store.url,
                why,
                describe_holder(holder, age),
            )
            return
        raise RuntimeError(f"{self.store.child(LOCK_FILE).url} keeps changing hands; try again")

    def _displaceable(self, holder: Mapping[str, Any], age: float) -> str | None:
        return displaceable(holder, age, self.job_id, self.stale_after_s)

    def heartbeat(self) -> None:
        if self._etag is None or self.lost is not None:
            return
        try:
            self._etag = self.store.put_bytes(
                LOCK_FILE, json.dumps(self._record).encode(), if_match=self._etag
            )
        except Exception as err:  # noqa: BLE001 - a lost lock, or a heartbeat to retry
            if object_store.is_precondition_failed(err):
                self.lost = f"another run took over {self.store.child(LOCK_FILE).url}"
                log.error("%s: this run no longer saves there", self.lost)
            else:
                log.warning("heartbeat of %s failed: %s", self.store.url, err)

    def start_heartbeat(self, every_s: float = 60.0) -> None:
        """Rewrite the lock every ``every_s`` seconds from a daemon thread until released (or
        until the lock is lost)."""
        self._heartbeat = Heartbeat(self._beat, every_s, name="lmc-store-lock")

    def _beat(self) -> bool:
        self.heartbeat()
        return self.lost is None

    def check(self) -> None:
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._etag is None or self.lost is not None:
            return
        try:
            current = parse_holder(self.store.get_bytes(LOCK_FILE))
            if current.get("token") == self._record.get("token"):
                self.store.delete([LOCK_FILE])
        except Exception as err:  # noqa: BLE001 - the run is over: logged
            log.warning("releasing the lock of %s: %s", self.store.url, err)
        self._etag = None
