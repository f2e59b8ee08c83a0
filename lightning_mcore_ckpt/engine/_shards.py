"""Our shard writer: Megatron-Core's plans and files, written by threads of the training process.

Megatron-Core plans each save (which tensor goes into which file, at which offset: the
``torch_dist`` format every Megatron-Core reader understands) and finalises it (``.metadata``).
Between the two, its own writers fork a process per save (0.16: a process per file), report
through a ``multiprocessing.Manager`` queue, and serialise with ``torch.save``'s CRC32 of every
record, which nothing ever checks and which costs more than the disk on CPU machines.

:class:`ShardWriter` writes the same files, the same way (``torch.save`` records through torch
DCP's ``_write_item``, then ``fsync``), with:

- a thread pool started once per rank and reused by every save (``write_threads`` files per
  rank are written in parallel);
- staging into buffers allocated at the first save and reused (pinned host memory for CUDA
  tensors): an async save's snapshot is one copy into memory that is already there; a sync save
  of CPU tensors copies nothing (training waits for it);
- no CRC32 of the records its threads write (``torch.load`` never reads it).

:class:`BackgroundWrites` runs async writes on one persistent thread of the training process
and finalises them once every rank's write is done: Megatron-Core's ``AsyncCallsQueue``
interface, without a process per save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import integrity
from lightning_mcore_ckpt.engine._dedup import Dedup
from lightning_mcore_ckpt.layout import SHARED_DIR

__all__ = ["BackgroundWrites", "ShardWriter", "StagingBuffers", "default_write_threads"]

log = logging.getLogger(__name__)


def default_write_threads() -> int:
    """Files written in parallel per rank: the cores this rank may use, between 4 and 8 (the
    threads wait on the disk most of the time: more threads than cores keep it busy)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(4, min(8, (cores or 4) // max(1, local)))


class WriteAborted(RuntimeError):
    """The run stopped while this write was in flight (see :meth:`ShardWriter.abort`)."""


# --- torch.save without its CRC32 ----------------------------------------------------------


def _without_crc32() -> None:
    """``torch.save`` skips the CRC32 of its records in this thread (torch's serialization
    config is per thread: only our writer threads are affected)."""
    from torch.utils.serialization import config

    config.save.compute_crc32 = False


@functools.cache
def _item_kwargs() -> dict[str, Any]:
    from torch.distributed.checkpoint import filesystem

    if "serialization_format" in inspect.signature(filesystem._write_item).parameters:
        return {"serialization_format": filesystem.SerializationFormat.TORCH_SAVE}
    return {}


def _write_file(transforms: Sequence[Any], bucket: Any, abort: threading.Event) -> list[Any]:
    """One shard file: its byte items, then its tensors, then ``fsync``; the write results."""
    # Looked up at each call, as Megatron-Core's own writer does (it is the fault tests' hook).
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    file_name, storage_key, (bytes_data, tensor_data) = bucket
    _without_crc32()
    results = []
    try:
        with open(file_name, "wb") as file:
            # Hashed on the way to the file: the manifest's digest, without reading it back.
            stream = integrity.HashingWriter(file)
            for item, data in (*bytes_data, *tensor_data):
                if abort.is_set():
                    raise WriteAborted(f"the run stopped while {file_name} was being written")
                results.append(
                    filesystem_async._write_item(
                        *transforms, stream, data, item, storage_key, **_item_kwargs()
                    )
                )
            stream.flush()
            os.fsync(stream.fileno())
        integrity.record(file_name, stream.digest)
    except OSError as err:
        if err.filename is None:  # a failed write() names no file
            err.filename = str(file_name)
        raise
    return results


# --- staging ---------------------------------------------------------------------------------


class StagingBuffers:
    """Host buffers the tensors of a save are copied into, allocated once and reused.

    Keyed by the shard's place in the checkpoint (directory and index); a tensor whose shape or
    dtype changed gets a new buffer, and buffers no save used any more are freed.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}
        self.allocations = 0
        """Buffers allocated so far (a reused buffer is not counted again)."""
        self.allocated_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, name: str, buckets: Sequence[Any], snapshot: bool) -> list[Any]:
        """``buckets`` with every tensor on the host: copied into this rank's buffers when
        ``snapshot`` (training goes on while they are written) or when not on the CPU; else the
        tensors themselves (a sync save of CPU tensors: nothing changes them meanwhile)."""
        staged, used, cuda = [], set(), False
        for file_name, storage_key, (bytes_data, tensor_data) in buckets:
            tensors = []
            for item, tensor in tensor_data:
                tensor = tensor.detach()
                if snapshot or tensor.device.type != "cpu":
                    key = (name, item.index)
                    used.add(key)
                    tensor = self._copy(key, tensor)
                    cuda = cuda or tensor.is_pinned()
                tensors.append((item, tensor))
            staged.append((file_name, storage_key, (bytes_data, tensors)))
        if cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        for key in [k for k in self._buffers if k[0] == name and k not in used]:
            del self._buffers[key]
        return staged

    def _copy(self, key: tuple[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
            self.allocations += 1
            self.allocated_bytes += buffer.numel() * buffer.element_size()
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        return buffer


# --- the writer ------------------------------------------------------------------------------


class ShardWriter:
    """Writes the shard files of Megatron-Core's save requests with this rank's thread pool."""

    def __init__(self, threads: int, dedup: bool = False) -> None:
        self.threads = threads
        self.staging = StagingBuffers()
        self.dedup = Dedup() if dedup else None
        """Frozen tensors written once and referenced by later saves (see ``_dedup``)."""
        self.pools_started = 0
        """Thread pools started so far (one per rank for the whole run)."""
        self._pool: ThreadPoolExecutor | None = None
        self._abort = threading.Event()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmc-shard-writer")
            self.pools_started += 1
        return self._pool

    def request(
        self,
        requests: Sequence[tuple[str, Any]],
        write_timer: torch.Tensor,
        snapshot: bool,
        request_class: type,
    ) -> Any:
        """One request that writes every ``(name, Megatron-Core request)`` and finalises them in
        order; staged here, on the calling thread (``snapshot``: see :meth:`StagingBuffers.stage`).
        """
        jobs, finalize_fns = [], []
        if self.dedup is not None:
            self.dedup.begin()
        for name, req in requests:
            if req.async_fn is not None:
                transforms = req.async_fn.args[0]  # partial(write_fn, transform_list, use_msc)
                _rank, buckets, results = req.async_fn_args
                count, origin = len(buckets), list(range(len(buckets)))
                reused: dict[int, list[Any]] = {}
                if self.dedup is not None and buckets:
                    step = Path(buckets[0][0]).parent.parent
                    split = self.dedup.split(name, step, buckets, self._threads())
                    buckets, origin, reused = split
                staged = self.staging.stage(name, buckets, snapshot)
                jobs.append(_Job(transforms, staged, results, count, origin, reused))
            finalize_fns.extend(req.finalize_fns)
        return request_class(self.write, (jobs, write_timer), finalize_fns)

    def write(self, jobs: Sequence[_Job], write_timer: torch.Tensor) -> None:
        """Write every file of ``jobs`` in parallel; each job's results (or its first error) go
        to its results queue, where Megatron-Core's finaliser takes them. Raises nothing."""
        start = time.perf_counter()
        pool = self._threads()
        futures = [
            [
                pool.submit(_write_file, job.transforms, bucket, self._abort)
                if bucket[2][0] or bucket[2][1]
                else None
                for bucket in job.buckets
            ]
            for job in jobs
        ]
        for job, files in zip(jobs, futures, strict=True):
            collected = _collect(files, job)
            if self.dedup is not None and not isinstance(collected, Exception) and job.buckets:
                step = Path(job.buckets[0][0]).parent.parent
                written = [r for part in collected.values() for r in part]
                self.dedup.written(written, step.parent / SHARED_DIR)
                integrity.record_references(step, self.dedup.references())
            job.results.put(collected)
        write_timer[0] = time.perf_counter() - start

    def abort(self) -> None:
        """Stop writing: files in flight stop at their next record (their step stays
        uncommitted). Later saves write again."""
        self._abort.set()

    def resume(self) -> None:
        self._abort.clear()

    def saved(self) -> None:
        """The save committed on every rank (the shared tensors it references are kept)."""
        if self.dedup is not None:
            self.dedup.saved()

    def forget(self) -> None:
        """The save failed: what it wrote into ``shared/`` is not reused."""
        if self.dedup is not None:
            self.dedup.forget()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclasses.dataclass
class _Job:
    """The files of one part (``model``, ``optim``) of a save."""

    transforms: Any
    buckets: list[Any]
    """What each file holds (after dedup: the step's own files, then new shared ones)."""
    results: Any
    """Megatron-Core's queue for this part's write results."""
    count: int
    """The files Megatron-Core planned (its finaliser expects results for each)."""
    origin: list[int]
    """The planned file each of ``buckets`` comes from."""
    reused: dict[int, list[Any]]
    """Write results of tensors not written (in ``shared/`` already), by planned file."""


def _collect(
    files: Sequence[Future[list[Any]] | None], job: _Job
) -> dict[int, list[Any]] | Exception:
    """Megatron-Core's results format: ``{planned file index: write results}``, or the first
    error."""
    results: dict[int, list[Any]] = {i: list(job.reused.get(i, [])) for i in range(job.count)}
    error: Exception | None = None
    for index, future in enumerate(files):
        try:
            results[job.origin[index]] += [] if future is None else future.result()
        except Exception as err:  # noqa: BLE001 - reported through the results queue
            error = error or err
    return error if error is not None else results


# --- async: one persistent background thread -------------------------------------------------


class OtherRankFailed(RuntimeError):
    """The background write failed on another rank (that rank's error names the cause)."""


class BackgroundWrites:
    """Megatron-Core's ``AsyncCallsQueue`` interface, run by one thread of this process.

    ``schedule_async_request`` hands the request's write to the thread and returns;
    ``maybe_finalize_async_calls`` agrees over every rank (one all-reduce) on whether the writes
    are done, then runs the finalisers (collective) in order. The thread is started at the first
    save and reused until :meth:`close`.
    """

    def __init__(self, shard_writer: ShardWriter, device: torch.device) -> None:
        self._shards = shard_writer
        self._device = device
        self._thread: ThreadPoolExecutor | None = None
        self._calls: list[tuple[int, Future[None], Any]] = []
        self._next_id = 0
        self.threads_started = 0
        """Background threads started so far (one per rank for the whole run)."""

    def schedule_async_request(self, request: Any) -> int:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="lmc-background-save")
            self.threads_started += 1
        future = self._thread.submit(
            request.async_fn, *request.async_fn_args, **dict(request.async_fn_kwargs or {})
        )
        call_id, self._next_id = self._next_id, self._next_id + 1
        self._calls.append((call_id, future, request))
        return call_id

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        finalized = []
        while self._calls:
            call_id, future, request = self._calls[0]
            if blocking:
                future.exception()  # waits
            error = future.exception() if future.done() else None
            flags = torch.tensor(
                [0 if future.done() else 1, 1 if error is not None else 0], device=self._device
            )
            if not no_dist and dist.is_available() and dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            not_done, failed = (int(x) for x in flags.cpu())
            if failed:
                self._calls.pop(0)
                raise error or OtherRankFailed("the background write failed on another rank")
            if not_done:
                break
            self._calls.pop(0)
            for fn in request.finalize_fns:
                fn()
            finalized.append(call_id)
        return finalized

    def close(self, abort: bool = False) -> None:
        """Wait for the write in flight (``abort``: stop it at its next record first); stop the
        thread. Finalises nothing."""
        if abort:
            self._shards.abort()
        for _id, future, _request in self._calls:
            with contextlib.suppress(Exception):
                future.result()
        self._calls.clear()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._shards.resume()


def results_queue() -> queue.Queue[Any]:
    """A results queue of this process (our writer runs in it): replaces Megatron-Core's
    ``multiprocessing.Manager`` queue while our strategy plans a save."""
    return queue.Queue()
