"""Lock files as other runs leave them, and a process racing for a lock.

No torch here: :func:`race` runs in spawned processes, which import this module.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.storage.lock import LOCK_FILE, DirectoryLock

OTHER_HOST = "another-node"


def write_lock(
    root: Path,
    *,
    pid: int = 4242,
    host: str = OTHER_HOST,
    job_id: str | None = None,
    create_time: float = 0.0,
    heartbeat_age_s: float = 0.0,
) -> bytes:
    """Put the lock of another run in ``root`` as that run writes it (whole, by rename), its
    heartbeat ``heartbeat_age_s`` old. Returns the lock's bytes."""
    record = {
        "host": host,
        "pid": pid,
        "create_time": create_time,
        "job_id": job_id,
        "started_at": "2026-11-22T00:00:00+00:00",
        "token": os.urandom(16).hex(),
    }
    data = (json.dumps(record, indent=2) + "\n").encode()
    incoming = root / f".incoming-lock-{os.getpid()}"
    incoming.write_bytes(data)
    os.replace(incoming, root / LOCK_FILE)
    beat = time.time() - heartbeat_age_s
    os.utime(root / LOCK_FILE, (beat, beat))
    return data


def race(root: str, job_id: str | None, start: Any, done: Any, rounds: int, results: Any) -> None:
    """Each round: wait for the start, try to take the lock, report ``"won"`` or the error."""
    for number in range(rounds):
        start.wait()
        try:
            DirectoryLock(root, job_id=job_id).acquire()
            outcome = "won"
        except RuntimeError as err:
            outcome = str(err)
        results.put((number, os.getpid(), outcome))
        done.wait()
