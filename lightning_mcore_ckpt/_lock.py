"""One writer per checkpoint directory: the lock file and its heartbeat."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt import _atomic

__all__ = ["LOCK_FILE", "DirectoryLock"]

log = logging.getLogger(__name__)

LOCK_FILE = ".lightning_mcore_ckpt.lock"
"""The lock file in a checkpoint ``dirpath`` (host, pid and start time of the writing run)."""


class DirectoryLock:
    """One writer per checkpoint directory: ``<dirpath>/.lightning_mcore_ckpt.lock``.

    The lock file holds the owner's host, pid and process start time. A lock whose owner is
    gone is recovered with a warning: on the same host when the process no longer runs, on
    another host when its heartbeat (the file's mtime, refreshed by :meth:`heartbeat`) is older
    than ``stale_after_s``. Anything else is refused, naming the owner.

    Example::

        lock = DirectoryLock("checkpoints/run")
        lock.acquire()  # RuntimeError naming the owner if another run holds it
        try:
            ...
        finally:
            lock.release()
    """

    def __init__(self, dirpath: str | os.PathLike[str], stale_after_s: float = 300.0) -> None:
        self.path = Path(dirpath) / LOCK_FILE
        self.stale_after_s = stale_after_s
        self.owned = False
        self._stop_heartbeat: threading.Event | None = None

    @staticmethod
    def _me() -> dict[str, Any]:
        import psutil

        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "create_time": psutil.Process().create_time(),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }

    def _owner_alive(self, owner: Mapping[str, Any]) -> bool:
        import psutil

        if owner.get("host") == socket.gethostname():
            try:
                proc = psutil.Process(int(owner.get("pid", -1)))
                same = abs(proc.create_time() - float(owner.get("create_time", 0))) < 1.0
            except (psutil.Error, ValueError, TypeError):
                return False
            return same and proc.status() != psutil.STATUS_ZOMBIE
        try:
            return time.time() - self.path.stat().st_mtime < self.stale_after_s
        except OSError:
            return False

    def acquire(self) -> None:
        """Take the lock, or raise ``RuntimeError`` naming the run that holds it."""
        me = self._me()
        text = json.dumps(me, indent=2) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(self.path.read_text())
            except (OSError, ValueError):
                owner = {}
            if isinstance(owner, dict) and self._owner_alive(owner):
                raise RuntimeError(
                    f"{self.path.parent} is in use by another run (pid {owner.get('pid')} on "
                    f"{owner.get('host')}, since {owner.get('started_at')}): two runs writing "
                    "one directory would delete each other's checkpoints. Use another dirpath, "
                    f"or stop that run; if it is dead, delete {self.path}"
                ) from None
            log.warning(
                "recovering the stale lock %s of a run that is gone (pid %s on %s)",
                self.path,
                owner.get("pid") if isinstance(owner, dict) else "?",
                owner.get("host") if isinstance(owner, dict) else "?",
            )
            _atomic.write_text(self.path, text)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            _atomic.fsync_dir(self.path.parent)
        self.owned = True

    def heartbeat(self) -> None:
        """Refresh the lock's mtime (shows other hosts that the owner is alive)."""
        if self.owned:
            try:
                os.utime(self.path)
            except OSError as err:
                log.warning("could not refresh %s: %s", self.path, err)

    def start_heartbeat(self, every_s: float = 60.0) -> None:
        """Refresh the lock every ``every_s`` seconds from a daemon thread until released."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                self.heartbeat()

        threading.Thread(target=beat, name="checkpoint-lock-heartbeat", daemon=True).start()
        self._stop_heartbeat = stop

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if this process holds it."""
        if self._stop_heartbeat is not None:
            self._stop_heartbeat.set()
            self._stop_heartbeat = None
        if not self.owned:
            return
        self.owned = False
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
