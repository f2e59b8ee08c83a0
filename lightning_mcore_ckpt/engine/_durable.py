"""The metadata a save records, and the seal of a step no listener commits (a save by hand).

A step is written (every rank), sealed (:func:`lightning_mcore_ckpt.storage.seal.seal_step`:
durable, then its commit marker) and published (the tracker). A save made through the
callback is sealed and published by its ``Committer``; one made by hand is sealed here.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.engine._collectives import agree_on_failure, distributed
from lightning_mcore_ckpt.engine._records import CheckpointSaveError, SaveRecord
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.storage.seal import seal_step

__all__ = ["commit_unowned", "record_metadata"]


def record_metadata(record: SaveRecord, *, step: Any, epoch: Any) -> dict[str, Any]:
    """The ``metadata.json`` fields of a save, from its record (its seal adds the rest)."""
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
        **({"blocking_parts_s": dict(record.blocking_parts_s)} if record.blocking_parts_s else {}),
        **({"optimizer_sharding": record.optimizer_sharding} if record.optimizer_sharding else {}),
        **(
            {"distributed_optimizer_parts": record.distributed_optimizer_parts}
            if record.distributed_optimizer_parts
            else {}
        ),
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
    """Collective: rank 0 seals a step no listener commits (a save made by hand, e.g.
    ``trainer.save_checkpoint(path)``); every rank learns how it went. Nothing publishes it:
    the tracker is the callback's."""
    error: BaseException | None = None
    rank = dist.get_rank() if distributed() else 0
    if rank == 0:
        try:
            metadata = record_metadata(record, step=step, epoch=epoch)
            seal_step(record.path, {**metadata, "manual": True})
        except Exception as err:  # noqa: BLE001 - shared, then raised on every rank
            error = err
    if distributed():
        return agree_on_failure(error, record.path, "committing", rank, device)
    if error is None:
        return None
    failure = CheckpointSaveError(f"committing {record.path} failed: {error}")
    failure.__cause__ = error
    return failure
