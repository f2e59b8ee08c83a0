"""A lock's heartbeat: a daemon thread that calls ``beat`` every ``every_s`` seconds until
stopped. The local lock (:class:`~lightning_mcore_ckpt.storage.lock.DirectoryLock`) and the
object-store lock (:class:`~lightning_mcore_ckpt.storage.store_lock.StoreLock`) both use it.
Imports nothing from the package.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Heartbeat"]


class Heartbeat:
    """Call ``beat`` every ``every_s`` seconds from a daemon thread named ``name``, until
    :meth:`stop` is called or ``beat`` returns ``False`` (the lock is lost: nothing left to
    refresh).

    Example::

        heartbeat = Heartbeat(lock.heartbeat_once, every_s=60.0, name="checkpoint-lock-heartbeat")
        ...
        heartbeat.stop()
    """

    def __init__(self, beat: Callable[[], bool], every_s: float, name: str) -> None:
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(every_s) and beat():
                pass

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating (returns at once; a beat in progress finishes)."""
        self._stop.set()
