"""Who holds a checkpoint directory's lock: the job identity a requeue shares, and the holder
recorded in a lock file (parsed, described, still running here or not). Imports nothing from the
package."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "JOB_ID_ENV",
    "alive_here",
    "describe_holder",
    "displaceable",
    "holder_record",
    "job_identity",
    "parse_holder",
]

JOB_ID_ENV = "LIGHTNING_MCORE_CKPT_JOB_ID"
"""Environment variable naming the job explicitly (it wins over what the scheduler sets)."""


def job_identity(environ: Mapping[str, str] | None = None) -> str | None:
    """The identity of the job this process belongs to, the same after a requeue; ``None``
    outside a scheduler.

    ``$LIGHTNING_MCORE_CKPT_JOB_ID`` when set; else SLURM's job (``slurm:<array job>_<task>`` for
    an array task, ``slurm:<job id>`` otherwise); else TorchElastic's run id
    (``torchelastic:<id>``, unless it is the default ``none``).

    Example::

        job_identity({"SLURM_JOB_ID": "4242"})  # 'slurm:4242'
    """
    env = os.environ if environ is None else environ
    explicit = env.get(JOB_ID_ENV, "").strip()
    if explicit:
        return explicit
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    if array and task:
        return f"slurm:{array}_{task}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run.lower() != "none":
        return f"torchelastic:{run}"
    return None


def parse_holder(data: bytes | None) -> dict[str, Any]:
    try:
        holder = json.loads(data or b"")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: Mapping[str, Any], age: float | None) -> str:
    beat = "unknown" if age is None else f"{max(age, 0.0):.0f}s ago"
    if not holder:
        return f"an unreadable lock file, heartbeat {beat}"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, job {holder.get('job_id')}, "
        f"since {holder.get('started_at')}, heartbeat {beat}"
    )


def alive_here(holder: Mapping[str, Any]) -> bool:
    """Whether the holder, recorded on this host, still runs (the same process, not a reuse)."""
    import psutil

    try:
        proc = psutil.Process(int(holder.get("pid", -1)))
        same = abs(proc.create_time() - float(holder.get("create_time", 0))) < 1.0
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, TypeError):
        return False


def holder_record(job_id: str | None) -> dict[str, Any]:
    """What a lock records of its holder: this process (host, pid, its start time), the job,
    when, and a token of its own."""
    import datetime
    import socket
    import uuid

    import psutil

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
        "job_id": job_id,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "token": uuid.uuid4().hex,
    }


def displaceable(
    holder: Mapping[str, Any], age: float, job_id: str | None, stale_after_s: float
) -> str | None:
    """Why a lock's holder may be displaced ("gone", "requeued", "stale"), or ``None``: on this
    host, when its process no longer runs; held by this job (a requeue); else when its
    heartbeat is ``stale_after_s`` old."""
    import socket

    if holder.get("host") == socket.gethostname():
        return None if alive_here(holder) else "gone"
    if job_id is not None and holder.get("job_id") == job_id:
        return "requeued"
    return "stale" if age >= stale_after_s else None
