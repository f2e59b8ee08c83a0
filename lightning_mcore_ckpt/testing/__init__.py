"""Run a function on N real processes with a gloo process group, as a test would.

:func:`run_distributed` is how this package's distributed tests run, and it is public so that
users can test their own LightningModules the same way::

    from lightning_mcore_ckpt.testing import run_distributed

    def body(rank: int, world_size: int, out_dir: str) -> float:
        ...                       # real torch.distributed / Megatron-Core / Lightning code
        return loss

    losses = run_distributed(body, 2, "/tmp/out", timeout=120)   # [loss of rank 0, of rank 1]

The function must be importable (defined at module level) because each rank is a fresh process.
Every rank gets the environment a launcher such as ``torchrun`` would set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a Lightning ``Trainer``
inside it joins the group instead of launching processes of its own.

A failure on any rank fails the call with that rank's traceback, and the other ranks, which
would otherwise wait forever in a collective, are killed. So is every rank when ``timeout``
runs out: a distributed test never hangs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.launch.local import DistributedFailure, find_free_port, run_distributed

__all__ = [
    "DistributedFailure",
    "find_free_port",
    "gather_sharded",
    "read_wandb_history",
    "read_wandb_metric_definitions",
    "read_wandb_records",
    "run_distributed",
]


def gather_sharded(sharded_state_dict: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """Assemble the full (global) tensors of a Megatron-Core sharded state dict on every rank.

    Collective: every rank of ``group`` (default: the world) calls it with its own shards. Each
    ``ShardedTensor`` is placed at its global offset; replicas simply overwrite each other, so the
    result is the same whatever the parallel layout that produced it. Flattened optimizer shards
    (``flattened_range``) are placed into the flattened global tensor. Used to prove that a
    resharded load restored exactly the tensors that were saved.

    Example::

        full = gather_sharded(trainer.strategy.model_sharded_state_dict())
        torch.equal(full["gpt.embedding.word_embeddings.weight"], expected)
    """
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    local = []
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        data = sh.data.detach().to("cpu", copy=True)
        local.append(
            (
                sh.key,
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                sh.prepend_axis_num,
                sh.flattened_range,
                tuple(sh.local_shape),
                data,
            )
        )
        assert len(sh.local_shape) + sh.prepend_axis_num == len(sh.global_shape), sh.key
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    full: dict[str, Any] = {}
    for shards in gathered:
        for key, gshape, goffset, prepend, frange, lshape, data in shards:
            if key not in full:
                full[key] = torch.zeros(gshape, dtype=data.dtype)
            target = full[key]
            index = tuple(slice(o, o + n) for o, n in zip(goffset[prepend:], lshape, strict=True))
            index = tuple(slice(o, o + 1) for o in goffset[:prepend]) + index
            if frange is None:
                target[index] = data.reshape(target[index].shape)
            else:
                region = target[index].clone().flatten()
                region[frange.start : frange.stop] = data.flatten()
                target[index] = region.reshape(target[index].shape)
    return full


_WANDB_BLOCK = 32 * 1024
_WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a 1-byte version
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: str | os.PathLike[str]) -> list[Any]:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``), in order.

    The file is a LevelDB-style log: 32 KiB blocks of records, each a 7-byte header (crc32,
    length, type: full, first, middle or last chunk) and its payload, after a 7-byte file
    header. Each whole payload is a ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a W&B run file (no ':W&B' header)")
    records: list[Any] = []
    pos = _WANDB_HEADER
    chunks: list[bytes] = []
    while pos + 7 <= len(data):
        left_in_block = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left_in_block < 7:
            pos += left_in_block  # block trailer: padding
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue  # zero padding
        if kind == _FULL:
            chunks = [payload]
        elif kind == _FIRST:
            chunks = [payload]
            continue
        elif kind == _MIDDLE:
            chunks.append(payload)
            continue
        elif kind == _LAST:
            chunks.append(payload)
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {pos}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(chunks))
        records.append(record)
        chunks = []
    return records


def read_wandb_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The history rows (what ``run.log`` logged) of an offline W&B run file, in order.

    Example::

        (run_file,) = Path("wandb").glob("offline-run-*/run-*.wandb")
        rows = [r for r in read_wandb_history(run_file) if "checkpoint/size_bytes" in r]
    """
    import json

    rows = []
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json) if item.value_json else None
        rows.append(row)
    return rows


def read_wandb_metric_definitions(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The ``define_metric`` declarations of an offline W&B run file: name or glob, step metric.

    Example::

        assert {"name": "", "glob_name": "checkpoint/*", "step_metric": "trainer/global_step"} in (
            read_wandb_metric_definitions(run_file)
        )
    """
    out = []
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "metric":
            out.append(
                {
                    "name": record.metric.name,
                    "glob_name": record.metric.glob_name,
                    "step_metric": record.metric.step_metric,
                }
            )
    return out
