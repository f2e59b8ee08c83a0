"""What a save cost: the figures recorded in ``metadata.json`` and logged to Lightning loggers.

Every save committed by :class:`~lightning_mcore_ckpt.MegatronCheckpoint` logs, at the step of
the save (an async save's figures arrive when it is finalised, still at its own step):

``checkpoint/blocking_time_s``
    wall time the training loop was blocked by the save, on its slowest rank: planning,
    staging, extra state, waiting for and finalising the background write (async), Hugging Face
    export when it runs inline.
``checkpoint/total_time_s``
    from the start of the save until the step was committed (``metadata.json`` in place).
``checkpoint/write_time_s``
    how long the writes lasted, on the slowest rank (in the background for an async save).
``checkpoint/size_bytes``
    bytes of the step directory on disk (apparent size, ``metadata.json`` included).
``checkpoint/throughput_gbps``
    ``size_bytes / write_time_s`` in GB/s (10^9 bytes per second).
``checkpoint/hf_export_time_s``
    how long a Hugging Face export took, when one ran.
``checkpoint/hf_upload_time_s``, ``checkpoint/hf_upload_failed``
    with ``HFExport(upload_to=...)``: how long a Hub upload of the step's export took (checked,
    sent, retries included), or ``1.0`` when it failed for good; logged when it ends.
``checkpoint/upload_bytes``, ``checkpoint/upload_time_s``, ``checkpoint/upload_throughput_gbps``
    with an ``s3://`` ``dirpath``: the step's publication to the store.
``checkpoint/upload_nodes``
    with a node-local ``local_dir`` on several nodes: how many nodes uploaded their parts of
    the step at once (``upload_time_s`` then runs from rank 0's first upload to the tracker:
    every node's upload, the wait for their confirmations, the seal, the marker).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "METRIC_KEYS",
    "METRIC_PREFIX",
    "define_wandb_metrics",
    "encode_metadata",
    "log_save_metrics",
    "save_metrics",
    "tree_bytes",
]

METRIC_PREFIX = "checkpoint/"
METRIC_KEYS = (
    "blocking_time_s",
    "total_time_s",
    "write_time_s",
    "size_bytes",
    "throughput_gbps",
    "hf_export_time_s",
    "hf_upload_time_s",
    "hf_upload_failed",
    "upload_bytes",
    "upload_time_s",
    "upload_throughput_gbps",
    "upload_nodes",
)
"""Figures of a save, as named in ``metadata.json``; logged as ``checkpoint/<name>``."""

STEP_METRIC = "trainer/global_step"
"""The x-axis of the W&B charts: Lightning's ``WandbLogger`` logs the trainer's global step
under this name with every row."""


def tree_bytes(path: str | os.PathLike[str], exclude: Iterable[str] = ()) -> int:
    """Apparent size in bytes of the files under ``path`` (``du --apparent-size -b``).

    Top-level entries named in ``exclude`` are skipped. Walks the tree: call it off the training
    thread.

    Example::

        tree_bytes("checkpoints/run/global_step_100", exclude=["metadata.json"])
    """
    skip = set(exclude)
    total = 0
    stack = [Path(path)]
    top = True
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if top and entry.name in skip:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
        top = False
    return total


def _throughput_gbps(size_bytes: int, write_time_s: float | None) -> float | None:
    if not write_time_s or write_time_s <= 0:
        return None
    return float(f"{size_bytes / write_time_s / 1e9:.6g}")


def encode_metadata(metadata: Mapping[str, Any], data_bytes: int) -> tuple[str, dict[str, Any]]:
    """The JSON text of a step's ``metadata.json`` whose ``size_bytes`` counts itself.

    ``data_bytes`` is the size of everything else in the step directory. Returns the text and
    the metadata it encodes (with ``size_bytes`` and ``throughput_gbps`` filled in), so that
    ``size_bytes`` equals the bytes of the committed directory exactly.

    Example::

        text, filled = encode_metadata({"global_step": 100, "write_time_s": 2.0}, 10**9)
        assert filled["size_bytes"] == 10**9 + len(text)
    """
    data = dict(metadata)

    def render(size: int) -> str:
        data["size_bytes"] = size
        data["throughput_gbps"] = _throughput_gbps(size, data.get("write_time_s"))
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    size = data_bytes
    for _ in range(8):
        text = render(size)
        needed = data_bytes + len(text.encode("utf-8"))
        if needed == size:
            return text, data
        size = needed
    # No fixed point (a digit rolled over back and forth): claim a few bytes more and pad the
    # JSON with trailing blanks up to exactly that size.
    size = needed + 16
    text = render(size)
    text = text[:-1] + " " * (size - data_bytes - len(text.encode("utf-8"))) + "\n"
    return text, data


def save_metrics(metadata: Mapping[str, Any]) -> dict[str, float]:
    """The ``checkpoint/*`` metrics of one committed step, from its metadata.

    Example::

        >>> save_metrics({"blocking_time_s": 0.25, "size_bytes": 100, "hf_export_time_s": None})
        {'checkpoint/blocking_time_s': 0.25, 'checkpoint/size_bytes': 100.0}
    """
    out = {}
    for key in METRIC_KEYS:
        value = metadata.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[METRIC_PREFIX + key] = float(value)
    return out


def log_save_metrics(loggers: Iterable[Any], step: int, metrics: Mapping[str, float]) -> None:
    """Log ``metrics`` to every Lightning logger at ``step`` (call on global rank 0).

    Example::

        log_save_metrics(trainer.loggers, 100, {"checkpoint/total_time_s": 3.2})
    """
    for logger in loggers:
        logger.log_metrics(dict(metrics), step=step)


def define_wandb_metrics(loggers: Iterable[Any]) -> None:
    """Chart ``checkpoint/*`` against the trainer's global step in every attached W&B run.

    Lightning's ``WandbLogger`` sends ``trainer/global_step`` with every row it logs at a step;
    declaring it the step metric of ``checkpoint/*`` puts an async save's figures, which arrive
    later, at the step of the save. Call on global rank 0.

    Example::

        define_wandb_metrics(trainer.loggers)  # MegatronCheckpoint does this at setup
    """
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover - Lightning without its wandb module
        return
    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            continue
        run = logger.experiment
        if not hasattr(run, "define_metric"):
            continue
        prefix = f"{logger._prefix}{logger.LOGGER_JOIN_CHAR}" if logger._prefix else ""
        run.define_metric(STEP_METRIC)
        run.define_metric(f"{prefix}{METRIC_PREFIX}*", step_metric=STEP_METRIC)
