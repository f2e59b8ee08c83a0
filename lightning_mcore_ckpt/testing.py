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

import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DistributedFailure",
    "find_free_port",
    "gather_sharded",
    "read_wandb_history",
    "read_wandb_metric_definitions",
    "read_wandb_records",
    "run_distributed",
]

# The ranks are forked from a server process that has already imported these, so a rank starts
# in a fraction of a second instead of re-importing torch, Megatron-Core and Lightning.
_PRELOAD = ["torch", "megatron.core", "lightning.pytorch", "lightning_mcore_ckpt"]


class DistributedFailure(RuntimeError):
    """A rank of :func:`run_distributed` raised, died, or did not finish in time."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    env: Mapping[str, str],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    # A session of its own, so that the parent can kill the rank with everything it started.
    os.setsid()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    try:
        value = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        # Plain bytes: torch would otherwise pass tensors as shared-memory handles that die
        # with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = buffer.getvalue()
    except Exception:  # noqa: BLE001 - an unpicklable result is the caller's bug: report it
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, payload))


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return their results.

    Ranks share nothing but the arguments (pass a directory to share files) and the
    rendezvous address in their environment. ``env`` adds environment variables to every rank.

    Raises :class:`DistributedFailure` naming the rank and carrying its traceback when a rank
    raises or dies, and naming the unfinished ranks when ``timeout`` seconds pass. All ranks are
    killed before it raises.

    Example::

        def show_rank(rank, world_size, tmp):
            return rank

        assert run_distributed(show_rank, 2, "/tmp") == [0, 1]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed: world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"run_distributed: timeout must be positive seconds, got {timeout!r}")
    ctx = _context()
    results: Any = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, dict(env or {}), args, results),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outputs and not p.is_alive() and p.exitcode not in (0, None)
                ]
                if dead:
                    # Give a rank that reported just before it died the chance to be read.
                    time.sleep(0.5)
                    if results.empty():
                        r = dead[0]
                        raise DistributedFailure(
                            f"rank {r} of {world_size} died with exit code {procs[r].exitcode} "
                            "without reporting a result"
                        ) from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outputs]
                    raise DistributedFailure(
                        f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s; "
                        "all ranks were killed"
                    ) from None
                continue
            if not ok:
                raise DistributedFailure(f"rank {rank} of {world_size} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        if len(outputs) == world_size:
            for proc in procs:
                proc.join(timeout=30)
        _kill(procs)
    return [outputs[r] for r in range(world_size)]


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
