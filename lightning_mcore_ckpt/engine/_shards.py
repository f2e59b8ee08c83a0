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
  of CPU tensors copies nothing (training waits for it); or, with ``max_staging_bytes``, through
  one bounded buffer while the files are written (``_staging``);
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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt.engine import _metadata_ahead
from lightning_mcore_ckpt.engine._dedup import Dedup
from lightning_mcore_ckpt.engine._metadata_ahead import SaveAhead, WriteResults
from lightning_mcore_ckpt.engine._staging import (
    BoundedStaging,
    Slot,
    StagingBuffers,
    StagingSession,
    WriteAborted,
)
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.layout import SHARED_DIR

__all__ = [
    "BackgroundWrites",
    "ShardWriter",
    "StagingBuffers",
    "WriteAborted",
    "default_write_threads",
]

log = logging.getLogger(__name__)


def default_write_threads() -> int:
    """Files written in parallel per rank: the cores this rank may use, between 4 and 8 (the
    threads wait on the disk most of the time: more threads than cores keep it busy)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(4, min(8, (cores or 4) // max(1, local)))


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


def _write_file(
    transforms: Sequence[Any],
    bucket: Any,
    abort: threading.Event,
    session: StagingSession | None = None,
) -> list[Any]:
    """One shard file: its byte items, then its tensors, then ``fsync``; the write results.
    With a bounded ``session``, each tensor is written once it is staged, and its staging bytes
    given back at once; a failure here stops the whole session."""
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
                slot = data if isinstance(data, Slot) else None
                if slot is not None:
                    data = slot.wait(abort)
                results.append(
                    filesystem_async._write_item(
                        *transforms, stream, data, item, storage_key, **_item_kwargs()
                    )
                )
                if slot is not None:
                    slot.written()
            stream.flush()
            os.fsync(stream.fileno())
        integrity.record(file_name, stream.digest)
    except BaseException as err:
        if session is not None:
            session.fail(err)
        if isinstance(err, OSError) and err.filename is None:  # a failed write() names no file
            err.filename = str(file_name)
        raise
    return results


# --- the writer ------------------------------------------------------------------------------


class ShardWriter:
    """Writes the shard files of Megatron-Core's save requests with this rank's thread pool."""

    def __init__(
        self, threads: int, dedup: bool = False, max_staging_bytes: int | None = None
    ) -> None:
        self.threads = threads
        self.staging = StagingBuffers()
        """Unbounded staging: a buffer per tensor, reused by every save (the default)."""
        self.bounded = None if max_staging_bytes is None else BoundedStaging(max_staging_bytes)
        """Staging bounded in bytes, when ``max_staging_bytes`` is given (see ``_staging``)."""
        self._in_flight: list[Future[list[Any]]] = []
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
        side_write: Callable[[], None] | None = None,
        ahead: Sequence[SaveAhead] = (),
    ) -> Any:
        """One request that writes every ``(name, Megatron-Core request)`` and finalises them in
        order; staged here, on the calling thread (``snapshot``: see :meth:`StagingBuffers.stage`).
        Bounded staging starts the writes here too, and returns once every tensor is copied.
        ``side_write``: another file of the step (its ``extra/``), written by the pool alongside.
        ``ahead``: the parts' ``.metadata`` written ahead once the files are (``_metadata_ahead``).
        """
        jobs, finalize_fns = [], []
        self._settle()
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
                jobs.append(_Job(name, transforms, buckets, results, count, origin, reused))
            finalize_fns.extend(req.finalize_fns)
        session = None
        if self.bounded is not None:
            session = self.bounded.session([job.buckets for job in jobs], snapshot)
        if session is None:
            for job in jobs:
                job.buckets = self.staging.stage(job.name, job.buckets, snapshot)
        else:
            self._stage_bounded(jobs, session)
        return request_class(self.write, (jobs, write_timer, side_write, ahead), finalize_fns)

    def reserve(self, requests: Sequence[tuple[str, Any]], snapshot: bool) -> None:
        """Allocate the staging that :meth:`request` of ``requests`` would allocate (unbounded:
        a buffer per tensor; bounded: the ring), copying and writing nothing: a save planned
        ahead (``CheckpointWriter.plan_ahead``) has its first save stage into memory that is
        already there. Not with dedup, whose first save stages only the tensors it writes."""
        if self.dedup is not None:
            return
        parts = [(name, req.async_fn_args[1]) for name, req in requests if req.async_fn]
        if self.bounded is not None:
            self.bounded.reserve([buckets for _, buckets in parts], snapshot)
            return
        for name, buckets in parts:
            self.staging.reserve(name, buckets, snapshot)

    def _stage_bounded(self, jobs: Sequence[_Job], session: StagingSession) -> None:
        """Queue every file's write, in order, then copy the tensors in that order (each file
        waits for its tensors; see ``_staging``)."""
        start = time.perf_counter()
        pool = self._threads()
        for job, buckets in zip(jobs, session.parts, strict=True):
            job.buckets = buckets
            job.started = start
            job.futures = [
                pool.submit(_write_file, job.transforms, bucket, self._abort, session)
                if bucket[2][0] or bucket[2][1]
                else None
                for bucket in buckets
            ]
            self._in_flight += [f for f in job.futures if f is not None]
        session.stage(self._abort)

    def _settle(self) -> None:
        """Wait for the writes a bounded staging started for a save whose request never ran
        (a save that failed before its write): the ring is reused next."""
        for future in self._in_flight:
            future.exception()
        self._in_flight = []

    def write(
        self,
        jobs: Sequence[_Job],
        write_timer: torch.Tensor,
        side_write: Callable[[], None] | None = None,
        ahead: Sequence[SaveAhead] = (),
    ) -> bool:
        """Write every file of ``jobs`` in parallel; each job's results (or its first error) go
        to its results queue, where Megatron-Core's finaliser takes them. ``side_write`` runs
        in the pool alongside; its error is raised once the jobs' results are queued (the save
        then fails at its finalisation, on every rank); nothing else is raised. Then each part
        of ``ahead`` compares its results with the kept ones (the coordinator writes its
        ``.metadata``): returns whether every part's were the kept ones."""
        start = min([time.perf_counter(), *(j.started for j in jobs if j.started is not None)])
        pool = self._threads()
        side = None if side_write is None else pool.submit(side_write)
        futures = [
            job.futures
            if job.futures is not None  # started by bounded staging
            else [
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
        if side is not None:
            side.result()
        held = bool(ahead) and all([part.written() for part in ahead])
        write_timer[0] = time.perf_counter() - start
        return held

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
        self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclasses.dataclass
class _Job:
    """The files of one part (``model``, ``optim``) of a save."""

    name: str
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
    futures: list[Future[list[Any]] | None] | None = None
    """Each file's write, when bounded staging started them."""
    started: float | None = None
    """``time.perf_counter()`` when bounded staging started the writes."""


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
            # Done, failed, and whether this rank's write results were the kept ones (its
            # .metadata written ahead: see _metadata_ahead), agreed over every rank at once.
            held = future.done() and error is None and future.result() is True
            flags = torch.tensor(
                [0 if future.done() else 1, 1 if error is not None else 0, 0 if held else 1],
                device=self._device,
            )
            if not no_dist and dist.is_available() and dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            not_done, failed, not_held = (int(x) for x in flags.cpu())
            if failed:
                self._calls.pop(0)
                raise error or OtherRankFailed("the background write failed on another rank")
            if not_done:
                break
            self._calls.pop(0)
            with _metadata_ahead.agreed(not not_held):
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


def results_queue() -> WriteResults:
    """A results queue of this process (our writer runs in it): replaces Megatron-Core's
    ``multiprocessing.Manager`` queue while our strategy plans a save."""
    return WriteResults()
