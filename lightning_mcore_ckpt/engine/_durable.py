"""The commit of a written step: everything in it made durable, then its commit marker.

A power cut at any point leaves either no ``metadata.json`` (the step is incomplete: ``"last"``
never names it) or a step whose every file and directory entry survived: each file is fsynced,
then each directory (deepest first, then the step's own entry in the run directory), and only
then is ``metadata.json`` written (durably and atomically), listing every file and its size so
that a later check (:func:`lightning_mcore_ckpt.format.layout.verify_step`) finds any that went
missing or short.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.engine._collectives import agree_on_failure, distributed
from lightning_mcore_ckpt.engine._records import CheckpointSaveError, SaveRecord
from lightning_mcore_ckpt.format import integrity, layout, metrics
from lightning_mcore_ckpt.format.layout import METADATA_FILE
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = ["commit_step", "commit_unowned", "record_metadata"]


def commit_step(
    path: str | Path, metadata: dict[str, Any], *, started: float | None = None
) -> dict[str, Any]:
    """Make the step at ``path`` durable, then write its ``metadata.json`` (the commit).

    ``metadata`` gets ``files`` (every file's size, by path relative to the step),
    ``hashes`` (each file's digest: ``metadata["hashes"]``, hashed while written, completed by
    :func:`lightning_mcore_ckpt.format.integrity.complete`), ``size_bytes``, ``throughput_gbps``
    and, when ``started`` (a ``time.perf_counter()`` value)
    is given, ``total_time_s``. Returns the metadata as written. Call it on one rank, off the
    training thread: it walks and fsyncs the whole step.

    Example::

        commit_step("checkpoints/run/global_step_100", {"format_version": 2, "global_step": 100})
    """
    step = Path(path)
    sizes = _atomic.fsync_tree(step)
    sizes.pop(METADATA_FILE, None)  # a previous commit's, replaced below (an export added)
    # Files outside the step it points at (tensors written once: ../shared/...), fsynced by
    # their writer; their directory entries here.
    shared = {n: (step / n).stat().st_size for n in metadata.get("hashes") or {} if n[:3] == "../"}
    if shared:
        _atomic.fsync_dir(step.parent / layout.SHARED_DIR)
    sizes.update(shared)
    _atomic.fsync_dir(step.parent)  # the step's own entry in the run directory
    filled = dict(metadata)
    filled["files"] = dict(sorted(sizes.items()))
    # Digests: those hashed while written (on every rank), the rest read now if small.
    filled["hashes"] = integrity.complete(step, sizes, filled.get("hashes") or {})
    if started is not None:
        filled["total_time_s"] = time.perf_counter() - started
    filled[integrity.METADATA_HASH] = integrity.PLACEHOLDER
    text, filled = metrics.encode_metadata(filled, sum(sizes.values()))
    text = integrity.seal(text)  # the marker's own digest: a changed byte in it is caught too
    _atomic.write_text(step / METADATA_FILE, text)
    return json.loads(text)  # type: ignore[no-any-return]


def record_metadata(record: SaveRecord, *, step: Any, epoch: Any) -> dict[str, Any]:
    """The ``metadata.json`` fields of a save, from its record (the commit adds the rest)."""
    return {
        "format_version": layout.METADATA_FORMAT_VERSION,
        "global_step": step,
        "epoch": epoch,
        "contents": list(record.contents),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "versions": _compat.versions(),
        "writer": record.writer,
        "async": record.asynchronous,
        "parallel_layout": record.parallel_layout,
        "blocking_time_s": record.blocking_time_s,
        "write_time_s": record.write_time_s,
        **({"optimizer_sharding": record.optimizer_sharding} if record.optimizer_sharding else {}),
        **(
            {"max_staging_bytes": record.max_staging_bytes}
            if record.max_staging_bytes is not None
            else {}
        ),
        "hashes": dict(record.hashes),
    }


def commit_unowned(
    record: SaveRecord, step: Any, epoch: Any, device: torch.device
) -> CheckpointSaveError | None:
    """Collective: rank 0 commits a step no listener commits (a save made by hand, e.g.
    ``trainer.save_checkpoint(path)``); every rank learns how it went."""
    error: BaseException | None = None
    rank = dist.get_rank() if distributed() else 0
    if rank == 0:
        try:
            metadata = record_metadata(record, step=step, epoch=epoch)
            commit_step(record.path, {**metadata, "manual": True})
        except Exception as err:  # noqa: BLE001 - shared, then raised on every rank
            error = err
    if distributed():
        return agree_on_failure(error, record.path, "committing", rank, device)
    if error is None:
        return None
    failure = CheckpointSaveError(f"committing {record.path} failed: {error}")
    failure.__cause__ = error
    return failure
