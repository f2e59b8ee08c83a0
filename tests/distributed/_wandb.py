"""Read an offline W&B run file (``run-<id>.wandb``) back: what a test asserts logged metrics
with (test support, not the package's API)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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
