"""One writer per checkpoint directory: the lock file, its heartbeat, and how it changes hands.

The lock is ``<dirpath>/.lightning_mcore_ckpt.lock``, a small JSON file naming its holder (host,
pid, process start time, job identity) with a random token; its mtime is the heartbeat.

Every change of the file is atomic, and at most one process can make it:

- A free directory is taken by ``os.link`` of a complete, fsynced file to the lock's name, which
  fails when a lock exists: of runs starting together, exactly one creates it, and no reader
  ever sees a half-written lock.
- A lock is replaced (taken over) or removed (released) only by the process holding its *claim*,
  ``<lock>.claim-<digest of the lock's bytes>``, itself created by ``os.link``. Of the processes
  that find the same stale lock, exactly one creates its claim; it re-reads the lock and, only
  if the bytes are still those it judged, replaces them (``os.replace``). Nobody else can change
  them meanwhile: that needs the same claim.
- The heartbeat refreshes the mtime through a file descriptor on which it has just read its own
  token, so it never refreshes a lock that another run took over: it records the loss instead,
  and :meth:`DirectoryLock.check` raises from then on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.storage import atomic as _atomic
from lightning_mcore_ckpt.storage.heartbeat import Heartbeat
from lightning_mcore_ckpt.storage.holders import (
    JOB_ID_ENV,
    alive_here,
    describe_holder,
    displaceable,
    holder_record,
    job_identity,
    parse_holder,
)

__all__ = ["JOB_ID_ENV", "LOCK_FILE", "DirectoryLock", "job_identity"]

log = logging.getLogger(__name__)

LOCK_FILE = ".lightning_mcore_ckpt.lock"
"""The lock file in a checkpoint ``dirpath`` (host, pid, job and start time of the writing run)."""

_CLAIM_WAIT_S = 10.0
"""How long to wait for another process that is taking over the same lock."""

_MAX_BYTES = 1 << 16
"""More than a lock file holds (read in one call)."""

_CLAIM_ORPHAN_S = 60.0
"""Age of a claim left by a process that died while taking over a lock (claims last ms)."""


class DirectoryLock:
    """One writer per checkpoint directory: ``<dirpath>/.lightning_mcore_ckpt.lock``.

    The lock file holds the owner's host, pid, process start time and job identity
    (:func:`job_identity`). :meth:`acquire` takes a lock whose owner is gone, with a warning:

    - on the same host, at once when that process no longer runs;
    - held by the same job (a requeue: the scheduler ended the previous incarnation), at once,
      unless it is a process on this host that still runs;
    - on another host, when its heartbeat (the file's mtime, refreshed by :meth:`heartbeat`) is
      older than ``stale_after_s``.

    Anything else is refused, naming the owner. Of processes racing for the same lock, exactly
    one gets it. A holder whose lock was taken over notices it (:meth:`check`, :attr:`lost`)
    and never touches the new holder's file.

    Args:
        dirpath: the checkpoint directory (it must exist).
        stale_after_s: how old the heartbeat of a lock from another host must be to recover it.
        job_id: this run's job identity; ``None``: :func:`job_identity` of the environment.

    Example::

        lock = DirectoryLock("checkpoints/run")
        lock.acquire()  # RuntimeError naming the owner if another run holds it
        try:
            ...
            lock.check()  # RuntimeError if another run took the lock over meanwhile
        finally:
            lock.release()
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        stale_after_s: float = 300.0,
        job_id: str | None = None,
    ) -> None:
        self.path = Path(dirpath) / LOCK_FILE
        self.stale_after_s = stale_after_s
        self.job_id = job_id if job_id is not None else job_identity()
        self.owned = False
        self.lost: str | None = None
        """Why this process no longer holds the lock it took, or ``None``."""
        self._data = b""
        self._heartbeat: Heartbeat | None = None

    # --- taking the lock ------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock, or raise ``RuntimeError`` naming the run that holds it."""

        record = holder_record(self.job_id)
        data = (json.dumps(record, indent=2) + "\n").encode()
        deadline = time.monotonic() + 2 * _CLAIM_WAIT_S
        while not self._create(self.path, data):
            current = self._read()
            if current is None:
                continue  # released meanwhile: create it
            holder, age = parse_holder(current[0]), time.time() - current[1]
            why = self._displaceable(holder, age)
            if why is None:
                raise RuntimeError(self._refusal(holder, age))
            if self._replace(current[0], data):
                self._warn_taken_over(why, holder, age)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.path} keeps changing hands; try again")
        _atomic.fsync_dir(self.path.parent)
        self.owned, self.lost, self._data = True, None, data
        self._remove_old_claims()

    def _displaceable(self, holder: Mapping[str, Any], age: float) -> str | None:
        """Why the holder may be displaced ("gone", "requeued", "stale"), or ``None``."""
        return displaceable(holder, age, self.job_id, self.stale_after_s)

    def _refusal(self, holder: Mapping[str, Any], age: float) -> str:
        return (
            f"{self.path.parent} is in use by another run ({describe_holder(holder, age)}): two runs "
            "writing one directory would delete each other's checkpoints. Use another dirpath, "
            f"or stop that run; if it is dead, delete {self.path}. A lock from another host is "
            f"recovered once its heartbeat is {self.stale_after_s:.0f}s old, and at once by a "
            f"requeue of the same job (this run's job: {self.job_id}; ${JOB_ID_ENV} names it "
            "where no scheduler does)"
        )

    def _warn_taken_over(self, why: str, holder: Mapping[str, Any], age: float) -> None:
        reason = {
            "gone": "its process no longer runs",
            "requeued": f"the scheduler requeued its job ({self.job_id}), which is this one",
            "stale": f"its heartbeat is older than {self.stale_after_s:.0f}s",
        }[why]
        log.warning(
            "taking over the lock %s from a run that is gone (%s): %s",
            self.path,
            describe_holder(holder, age),
            reason,
        )

    def _replace(self, judged: bytes, data: bytes) -> bool:
        """Replace the lock by ``data`` if it still holds ``judged``: True when done, False
        when it changed meanwhile (the caller looks again)."""
        claim = self._claim_path(judged)
        if not self._create(claim, data):
            return self._wait_for_change(claim, judged)
        try:
            current = self._read()
            if current is None or current[0] != judged:
                return False
            _atomic.write_bytes(self.path, data)  # fsynced, os.replace, directory fsynced
            return True
        finally:
            claim.unlink(missing_ok=True)

    def _wait_for_change(self, claim: Path, judged: bytes) -> bool:
        # Another process holds the claim: it replaces the lock within milliseconds. A claim
        # whose process died holding it (killed in mid-release or mid-takeover) is removed,
        # and the caller looks again: a process here that no longer runs, or an old claim.
        deadline = time.monotonic() + _CLAIM_WAIT_S
        while time.monotonic() < deadline:
            current = self._read()
            if current is None or current[0] != judged:
                return False
            try:
                raw = claim.read_bytes()
                age = time.time() - claim.stat().st_mtime
            except OSError:
                return False  # released meanwhile
            claimant = parse_holder(raw)
            here = claimant.get("host") == socket.gethostname()
            if (here and not alive_here(claimant)) or age > _CLAIM_ORPHAN_S:
                self._remove_dead_claim(claim, raw)
                return False
            time.sleep(0.01)
        try:
            claimant = parse_holder(claim.read_bytes())
        except OSError:
            claimant = {}
        raise RuntimeError(
            f"{self.path.parent}: the stale lock {self.path} is being taken over by another run "
            f"(pid {claimant.get('pid')} on {claimant.get('host')}), which has not finished in "
            f"{_CLAIM_WAIT_S:.0f}s. If no run is starting there, delete {claim}"
        )

    def _remove_dead_claim(self, claim: Path, raw: bytes) -> None:
        # Of the processes that found the same dead claim, the one that creates its tombstone
        # (os.link: one winner) removes it. Nobody else can have re-created the claim before:
        # its name is taken until then.
        tombstone = claim.with_name(f"{claim.name}.dead-{hashlib.sha256(raw).hexdigest()[:16]}")
        if not self._create(tombstone, raw):
            return
        try:
            if claim.read_bytes() == raw:
                log.warning("removing %s, left by a process that died holding it", claim)
                claim.unlink()
        except OSError:
            pass
        finally:
            tombstone.unlink(missing_ok=True)

    # --- holding it -----------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``RuntimeError`` unless this process still holds the lock (another run may
        have taken it over, or the file was deleted). Reads the lock file."""
        if not self.owned:
            raise RuntimeError(f"{self.path} is not held by this process")
        if self.lost is None:
            current = self._read()
            if current is None or current[0] != self._data:
                self._lose(current)
        if self.lost is not None:
            raise RuntimeError(self.lost)

    def heartbeat(self) -> None:
        """Refresh the lock's mtime (shows other hosts that the owner is alive), only while the
        file is still this process's; else record the loss (:attr:`lost`) and log an error."""
        if not self.owned or self.lost is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._lose(None)
            return
        except OSError as err:
            log.warning("could not refresh %s: %s", self.path, err)
            return
        try:
            data = os.read(fd, _MAX_BYTES)
            if data != self._data:
                self._lose((data, os.fstat(fd).st_mtime))
            else:
                os.utime(fd)  # this inode: the one just read, never a successor's
        except OSError as err:
            log.warning("could not refresh %s: %s", self.path, err)
        finally:
            os.close(fd)

    def start_heartbeat(self, every_s: float = 60.0) -> None:
        """Refresh the lock every ``every_s`` seconds from a daemon thread until released (or
        until the lock is lost)."""
        self._heartbeat = Heartbeat(self._beat, every_s, name="checkpoint-lock-heartbeat")

    def _beat(self) -> bool:
        self.heartbeat()
        return self.lost is None

    def _lose(self, current: tuple[bytes, float] | None) -> None:
        if current is None:
            now = f"{self.path} was deleted"
        else:
            holder, age = parse_holder(current[0]), time.time() - current[1]
            now = f"another run holds it now ({describe_holder(holder, age)})"
        self.lost = (
            f"this run lost the lock of {self.path.parent}: {now}. It writes no more "
            "checkpoints there; two runs writing one directory would delete each other's "
            "checkpoints. Stop one of them"
        )
        log.error("%s", self.lost)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if this process still holds it."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if not self.owned:
            return
        self.owned = False
        if self.lost is not None:
            return
        claim = self._claim_path(self._data)
        if not self._create(claim, self._data):
            return  # another run is taking it over: the file is theirs to replace
        try:
            current = self._read()
            if current is not None and current[0] == self._data:
                self.path.unlink()
                _atomic.fsync_dir(self.path.parent)
        finally:
            claim.unlink(missing_ok=True)

    # --- files ----------------------------------------------------------------------------

    def _read(self) -> tuple[bytes, float] | None:
        """The lock's bytes and mtime, read through one descriptor; ``None`` when absent."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, _MAX_BYTES), os.fstat(fd).st_mtime
        finally:
            os.close(fd)

    def _claim_path(self, data: bytes) -> Path:
        return self.path.with_name(f"{LOCK_FILE}.claim-{hashlib.sha256(data).hexdigest()[:16]}")

    def _remove_old_claims(self) -> None:
        # A claim left by a process that died in mid-takeover names a lock that no longer
        # exists (every lock has its own token). The claim on this lock's bytes, or a young
        # one, may be a live process's: kept. So are the temporary files of _create: one a
        # process killed between writing and removing it left behind is old; a live one's
        # lasts a moment.
        mine = self._claim_path(self._data)
        parent = self.path.parent
        for old in [*parent.glob(f"{LOCK_FILE}.claim-*"), *parent.glob(f"{LOCK_FILE}.tmp.*")]:
            try:
                orphan = time.time() - old.stat().st_mtime > _CLAIM_ORPHAN_S
            except OSError:
                continue
            if old != mine and orphan:
                old.unlink(missing_ok=True)

    def _create(self, dst: Path, data: bytes) -> bool:
        """Create ``dst`` holding ``data`` unless it exists: True when created. Atomic (local
        filesystems, NFS, Lustre, GPFS): a complete, fsynced file is hard-linked to the name."""
        tmp = self.path.with_name(f"{LOCK_FILE}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        _write_new(tmp, data)
        try:
            os.link(tmp, dst)
        except FileExistsError:
            # NFS: a link retried after a lost reply reports EEXIST although it was made.
            return os.stat(tmp).st_nlink == 2
        except OSError:  # no hard links on this filesystem: create it exclusively, then write
            try:
                _write_new(dst, data)
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)
        return True


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
