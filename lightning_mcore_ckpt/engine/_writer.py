"""``CheckpointWriter``: writes step directories, synchronously or in the background."""

from __future__ import annotations

import functools
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.engine import _collectives, _extra, _metadata_ahead, _param_groups
from lightning_mcore_ckpt.engine._agreeing_save_strategy import save_strategy
from lightning_mcore_ckpt.engine._collectives import (
    agree_on_failure,
    broadcast,
    distributed,
    first_failure,
    on_every_rank,
)
from lightning_mcore_ckpt.engine._dedup import frozen_storages
from lightning_mcore_ckpt.engine._durable import commit_unowned
from lightning_mcore_ckpt.engine._extra import ExtraFile, RefusalWarnings
from lightning_mcore_ckpt.engine._plans import SavePlans
from lightning_mcore_ckpt.engine._records import (
    BLOCKING_PARTS,
    CheckpointSaveError,
    SaveListener,
    SaveOptions,
    SaveRecord,
)
from lightning_mcore_ckpt.engine._requests import (
    PendingSave,
    clear_unsealed_part,
    combine_async_requests,
    create_step_directories,
    plan_requests,
    stop_writers,
)
from lightning_mcore_ckpt.engine._shards import (
    BackgroundWrites,
    OtherRankFailed,
    ShardWriter,
    default_write_threads,
)
from lightning_mcore_ckpt.engine._state_dicts import (
    TrainingState,
    optimizers_to_save,
    refused_objects,
)
from lightning_mcore_ckpt.engine._worker_watch import (
    WriterProcessEnded,
    close_writer,
    finish_writes,
)
from lightning_mcore_ckpt.format import integrity, retention
from lightning_mcore_ckpt.format.layout import EXTRA_DIR, MODEL_DIR, OPTIM_DIR
from lightning_mcore_ckpt.safety import safe_load as _safe_load

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)


class CheckpointWriter:
    """Writes step directories (``model/``, ``optim/``, ``extra/``); owns the one async save,
    the async calls queue and the :class:`SaveListener` s; it alone finalises a pending save.

    Collective methods are called by every rank of the default process group, at the same
    point of the job. A save goes through this sequence of calls:

    1) (all ranks) :meth:`save`: finalise the pending save (blocking, as in 4); rank 0 creates
       the step directory (every rank gets its verdict); every rank takes the bytes of its
       ``extra/rank_<r>.pt`` (and writes it, unless an async save of our writer writes it in
       the background with the shards), agrees on whether any rank failed, plans (collective)
       and stages its shards. Then, synchronously: every rank writes its shards, agrees, runs
       Megatron-Core's finalisers (collective), agrees, and completes (all-reduce of timings;
       ``on_finalized`` and the owning listeners' ``saved``, on every rank). Asynchronously:
       every rank hands its writes to the background thread and returns.
    2) (all ranks, async only) :meth:`finalize` with ``blocking=False``, at each training batch
       start: Megatron-Core's queue agrees over all ranks on whether the writes are done;
       ``False`` until they are done on every rank; then it completes the save as in 1.
    3) (all ranks) :meth:`remove` of a step directory: the pending save first when it is that
       one (as in 4); rank 0 deletes; every rank waits in a barrier.
    4) (all ranks) :meth:`finalize` with ``blocking=True`` (before the next save, at the end of
       training) or :meth:`close` (at teardown, while the process group is up; then it closes
       the queue, locally).

    A failure on any rank becomes the same :class:`CheckpointSaveError` on every rank, given to
    the save's ``on_error`` and to the listeners that own the path, else raised from the call
    that found it (``save`` or ``finalize``). :meth:`add_listener`, :meth:`remove_listener`,
    :meth:`abandon` and :attr:`pending_path` are local.
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        parallel_save: bool = True,
        writer: str = _compat.THREADS,
        write_threads: int | None = None,
        cache_plans: bool = True,
        dedup: bool = False,
        max_staging_bytes: int | None = None,
    ) -> None:
        self.async_save = async_save
        """Write model and optimizer shards in the background (unless a save asks otherwise)."""
        self.parallel_save = parallel_save
        """Spread the writes of replicated tensors across data-parallel ranks."""
        self.writer = writer
        """``"threads"`` (:class:`~._shards.ShardWriter`) or ``"megatron"`` (Megatron-Core's)."""
        self.shards = ShardWriter(
            write_threads or default_write_threads(), dedup, max_staging_bytes
        )
        self.max_staging_bytes = max_staging_bytes
        """Host bytes staged at once by a save (``None``: every tensor at once); see
        :mod:`~lightning_mcore_ckpt.engine._staging`."""
        self.plans = SavePlans(self._strategy, enabled=cache_plans)
        self.planned_ahead_s: float | None = None
        """Seconds :meth:`plan_ahead` took (``0.0`` when it failed; ``None``: not tried)."""
        self._async_queue: Any = None
        self._pending: PendingSave | None = None
        self._listeners: list[SaveListener] = []
        self._refusals = RefusalWarnings()
        self.directory_leader: bool | None = None
        """Whether this rank creates the step directories where its node's ranks write them:
        ``None``, global rank 0 alone (every rank writes to one shared directory). A run whose
        directory is node-local (an object store's local tier on nodes that share no file
        system) has one leader per node (set by ``MegatronCheckpoint`` at setup)."""

    def add_listener(self, listener: SaveListener) -> None:
        """Register ``listener`` to be told how the saves of the paths it owns end."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: SaveListener) -> None:
        """Undo :meth:`add_listener` (a no-op when not registered)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def pending_path(self) -> Path | None:
        """The step directory of the async save in flight, if any."""
        return None if self._pending is None else self._pending.path

    def save(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        options: SaveOptions,
        state: TrainingState,
    ) -> None:
        """Write a step directory from ``state`` (and ``checkpoint`` into ``extra/``).

        Collective: see the class docstring. A failure on any rank becomes the same
        :class:`CheckpointSaveError` on every rank, handled by ``options.on_error`` and the
        listeners that own the path, else raised; a non-empty existing directory is a
        ``FileExistsError`` on every rank.
        """
        self.finalize(blocking=True)
        start = time.perf_counter() if options.started_at is None else options.started_at
        parts = _Parts(start)
        parts.mark("before")
        _compat.drain_write_results()  # what a failed save left would go into this one
        path = Path(broadcast(str(filepath)))
        contents = list(options.contents)
        failure = self._create_step(path, contents, state)
        if failure is not None:
            return self._failed(path, failure, options)
        parts.mark("create_step")

        # Sync and async saves take the same path (plan and stage here, write inline or in the
        # background, then finalise), as dist_checkpointing.save does: the same phases timed.
        async_save = self.async_save and not options.synchronous
        # An async save of our writer writes extra/ in the background too (its bytes taken now).
        defer = async_save and self.writer == _compat.THREADS
        extra_write_s, extra, failure = self._extra_agreed(
            path, contents, checkpoint, state, write=not defer
        )
        if failure is not None:
            return self._failed(path, failure, options)
        parts.mark("extra")
        kept: list[BaseException] = []  # rank 0's finalisation errors, shared after
        request, write_timer, sharding = self._plan_and_stage(
            path, contents, state, async_save, kept, parts, extra if defer else None
        )
        timings = {"start": start, "extra_write_s": extra_write_s}
        base = self._record_base(checkpoint, path, contents, async_save, sharding, state)

        if async_save:  # written in the background; finalize() completes it
            call_id = self._get_async_queue(state.device).schedule_async_request(request)
            parts.mark("schedule")
            timings["call_s"] = time.perf_counter() - start
            timings.update(parts.timings())
            self._pending = PendingSave(
                path, [call_id], timings, base, options, write_timer, state.device, kept
            )
            return None

        failure = self._write_inline(request, path, state, kept)
        if failure is not None:
            return self._failed(path, failure, options)
        parts.mark("write_inline")
        timings["call_s"] = time.perf_counter() - start
        timings.update(parts.timings())
        self._complete(base, timings, write_timer, options, state.device)
        return None

    def _create_step(
        self, path: Path, contents: Sequence[str], state: TrainingState
    ) -> CheckpointSaveError | None:
        """Rank 0 (each node's leader, where the directory is node-local: see
        :attr:`directory_leader`) creates the step directory with its start marker; every rank
        learns how that went. A directory that cannot be created is a save failure; a non-empty
        existing one is a ``FileExistsError``, on every rank."""
        # A save no listener owns (e.g. trainer.save_checkpoint(path) by hand) commits itself
        # and is marked as not a run's own: retention and cleanup never touch it.
        managed = bool(self._owners(path))
        leader = self.directory_leader
        problem = None
        if leader or (leader is None and state.rank == 0):
            if leader and state.rank != 0:
                clear_unsealed_part(path)  # what a killed run left of this step on this node
            problem = create_step_directories(path, contents, managed)
        # Every rank raises the same error (the lowest failing rank's) instead of waiting for a
        # leader in a barrier.
        found = first_failure(problem, state.rank, state.device)
        if found is None:
            return None
        if found[1].startswith("cannot create"):
            return CheckpointSaveError(found[1])
        raise FileExistsError(found[1])

    def _plan_and_stage(
        self,
        path: Path,
        contents: Sequence[str],
        state: TrainingState,
        async_save: bool,
        kept: list[BaseException],
        timed: _Parts,
        extra: ExtraFile | None = None,
    ) -> tuple[Any, torch.Tensor, Any]:
        """Build the sharded state dicts of ``model/`` and ``optim/``, plan and stage their
        shards: the write request (inline or in the background), the tensor its writers time
        themselves into, and the optimizer's sharding. Each phase is marked on ``timed``.
        ``extra``: written by the request too (our writer's), alongside the shards."""
        own = self.writer == _compat.THREADS
        if own and self.shards.dedup is not None:
            self.shards.dedup.frozen = frozen_storages(state.module)
        parts, sharding = _sharded_parts(path, contents, state, timed)
        for ssd, sub in ((ssd, d.name) for ssd, d, _ in parts):
            self._refusals.check(f"{sub}/", functools.partial(refused_objects, ssd, sub))
        strategies = self.plans.strategies([(d.name, ssd) for ssd, d, _ in parts], state.device)
        timed.mark("plans")
        try:
            with _metadata_ahead.collecting() as ahead:  # .metadata written ahead, our writer's
                requests = plan_requests(
                    parts, strategies, kept, self.writer, not self.plans.reused
                )
            timed.mark("planning")
            write_timer = torch.zeros(1, dtype=torch.float64)
            if own:
                request = self.shards.request(
                    requests,
                    write_timer,
                    async_save,
                    _compat.builtin_request_class(),
                    None if extra is None else self._write_extra_later(extra),
                    ahead,
                )
            else:
                write_timer.share_memory_()  # written by Megatron-Core's background process
                request = combine_async_requests([r for _, r in requests], write_timer)
        except BaseException:
            _compat.forget_staged_tensors()  # planned, perhaps, but never staged
            raise
        timed.mark("staging")
        return request, write_timer, sharding

    @property
    def may_plan_ahead(self) -> bool:
        """Whether :meth:`plan_ahead` would plan (local, the same on every rank)."""
        return self.plans.enabled and not self.plans.kept and self.planned_ahead_s is None

    def plan_ahead(self, contents: Sequence[str], state: TrainingState) -> bool:
        """Plan the first save now (after the first optimizer step, at setup in effect), so
        that it costs what the later ones do: Megatron-Core's planning, its check that the
        ranks' shards cover every tensor once, and the fully parallel save's assignment of
        replicated tensors, made and kept as a save would (:class:`~._plans.SavePlans`).

        Collective (every rank, at the same point). Plans twice into a scratch directory of
        this rank's (Megatron-Core keeps a plan once two saves planned it alike) and writes
        nothing else: the requests are dropped unwritten and the directory removed. The first
        save then reuses the plans while every rank's structure is still the one planned (its
        fingerprint is compared, as at every save), else plans afresh. With our writer, the
        host memory the first save would stage into is allocated too (:meth:`ShardWriter.reserve`:
        pinned memory for device tensors, which took the first sync save of 1 GiB on an H200
        0.66 s of staging against 0.02 s for the later ones). Does nothing with plans
        not kept (``cache_plans=False``), once plans are kept, or after a first attempt. A
        failure on any rank is logged on rank 0 and leaves the first save to plan itself.
        Returns whether it planned.
        """
        if not self.may_plan_ahead:
            return False
        start = time.perf_counter()
        self.planned_ahead_s = 0.0
        error: BaseException | None = None
        # Removed whatever happens; a removal that fails is no failure of the planning.
        with tempfile.TemporaryDirectory(
            prefix="lmc-plan-ahead-", ignore_cleanup_errors=True
        ) as scratch:
            try:
                for attempt in ("first", "second"):  # Megatron-Core validates the second
                    parts, _ = _sharded_parts(Path(scratch, attempt), contents, state, None)
                    for _, directory, _ in parts:
                        directory.mkdir(parents=True)
                    named = [(d.name, ssd) for ssd, d, _ in parts]
                    strategies = self.plans.strategies(named, state.device)
                    requests = plan_requests(
                        parts, strategies, [], self.writer, not self.plans.reused
                    )
                if self.writer == _compat.THREADS:  # the first save's staging, allocated now
                    self.shards.reserve(requests, self.async_save)
            except Exception as err:  # noqa: BLE001 - every rank learns of it, then logged
                error = err
            finally:
                _compat.forget_staged_tensors()  # the requests are dropped unstaged
        headline = "planning the first save ahead failed"
        failure = agree_on_failure(error, Path(scratch), "", state.rank, state.device, headline)
        if failure is not None:
            self.plans.forget()
            if state.rank == 0:
                log.warning("%s; the first save plans itself", failure)
            return False
        self.planned_ahead_s = time.perf_counter() - start
        return True

    def _extra_agreed(
        self,
        path: Path,
        contents: Sequence[str],
        checkpoint: dict[str, Any],
        state: TrainingState,
        write: bool,
    ) -> tuple[float, ExtraFile | None, CheckpointSaveError | None]:
        """This rank's ``extra/`` file of the save (when the step holds it), its bytes taken
        now, and written now with ``write`` (else by the background write, which reports its
        failure at the save's finalisation): the seconds this took, the file, and any rank's
        failure, the same on every rank."""
        extra_write_s = 0.0
        extra = None
        error: BaseException | None = None
        if "extra" in contents:
            extra_start = time.perf_counter()
            try:
                extra = ExtraFile.of(path / EXTRA_DIR, checkpoint, state)
                if write:
                    _extra.write_extra_file(extra.target, extra.data)
                    self._check_extra(extra)  # else after its background write
            except Exception as err:  # noqa: BLE001 - e.g. an unpicklable object: shared, raised
                error = err
            extra_write_s = time.perf_counter() - extra_start
        failure = agree_on_failure(error, path, "writing extra/", state.rank, state.device)
        return extra_write_s, extra, failure

    def _record_base(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        contents: Sequence[str],
        async_save: bool,
        sharding: Any,
        state: TrainingState,
    ) -> dict[str, Any]:
        """The fields of the save's :class:`SaveRecord` known before its write ends."""
        own = self.writer == _compat.THREADS
        return {
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "path": path,
            "contents": tuple(contents),
            "asynchronous": async_save,
            "writer": self.writer if own else _compat.async_strategy(),
            "parallel_layout": state.parallel_layout,
            "optimizer_sharding": sharding,
            "distributed_optimizer_parts": (
                _param_groups.inner_counts(state.optimizers) if sharding else None
            ),
            "max_staging_bytes": self.max_staging_bytes if own else None,
        }

    def _write_inline(
        self, request: Any, path: Path, state: TrainingState, kept: list[BaseException]
    ) -> CheckpointSaveError | None:
        """Write ``model/`` and ``optim/`` in this thread and finalise them; any rank's failure
        is every rank's."""
        error: BaseException | None = None
        held = False  # our writer's: whether its records were the kept ones (_metadata_ahead)
        try:
            held = request.async_fn(*request.async_fn_args) is True
        except Exception as err:  # noqa: BLE001 - any write error: shared, then raised
            error = err
        failure = agree_on_failure(
            error, path, "writing model/ and optim/", state.rank, state.device
        )
        if failure is not None:
            return failure
        if self.writer == _compat.THREADS:
            held = on_every_rank(held, state.device)
        # Collective: shard writers report their errors here (the failing rank's names the
        # cause; the others only learn that a rank failed): share the failing rank's.
        try:
            with _metadata_ahead.agreed(held):
                for finalize in request.finalize_fns:
                    finalize()
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - shared, re-raised
            error = err
        return agree_on_failure(
            error or (kept[0] if kept else None),
            path,
            "finishing model/ and optim/",
            state.rank,
            state.device,
        )

    def _write_extra_later(self, extra: ExtraFile) -> Callable[[], None]:
        """The background write of ``extra`` (``_extra.write_extra_file`` looked up when it
        runs), then the scan of its bytes for what a load refuses: a warning, never a failure,
        so it need not block training."""

        def write() -> None:
            _extra.write_extra_file(extra.target, extra.data)
            self._check_extra(extra)

        return write

    def _check_extra(self, extra: ExtraFile) -> None:
        """Warn once when a load will refuse part of ``extra`` (its bytes scanned)."""
        where = f"{EXTRA_DIR}/{extra.target.name}"
        self._refusals.check(
            where, lambda: _safe_load.refused_in_extra(extra.target, extra.payload, extra.data)
        )

    def _owners(self, path: Path) -> list[SaveListener]:
        return [listener for listener in self._listeners if listener.owns(path)]

    def _failed(self, path: Path, failure: CheckpointSaveError, options: SaveOptions) -> None:
        self.shards.forget()
        integrity.take(path)  # the failed save's digests: no commit will take them
        handled = options.on_error is not None
        if options.on_error is not None:
            options.on_error(failure)
        for listener in self._owners(path):
            listener.failed(path, failure)
            handled = True
        if not handled:
            raise failure

    def _complete(
        self,
        base: dict[str, Any],
        timings: dict[str, float],
        write_timer: torch.Tensor,
        options: SaveOptions,
        device: torch.device,
    ) -> None:
        # Collective: blocking, write and total times are the slowest rank's (each rank
        # measures its own elapsed time: clocks of different hosts are not compared).
        now = time.perf_counter()
        step, epoch = base.pop("global_step"), base.pop("epoch")
        timings["part_finalize"] = timings.get("finalize_s", 0.0)
        mine = [
            timings["call_s"] + timings.get("finalize_s", 0.0),
            float(write_timer[0]) + timings["extra_write_s"],
            now - timings["start"],
            *(timings.get(f"part_{name}", 0.0) for name in BLOCKING_PARTS),
        ]
        # The blocking time's parts ride on the same all-reduce: each the slowest rank's.
        slowest = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        blocking, write, elapsed, *by_part = (float(x) for x in slowest.cpu())
        record = SaveRecord(
            blocking_parts_s=dict(zip(BLOCKING_PARTS, by_part, strict=True)),
            **base,
            # On every node's leader too where the directory is node-local (it uploads them).
            hashes=_collectives.gather_hashes(
                base["path"], everywhere=self.directory_leader is not None
            ),
            blocking_time_s=blocking,
            write_time_s=write,
            total_time_s=elapsed,
            finalized_at=now,
        )
        self.shards.saved()
        owners = self._owners(record.path)
        if not owners:
            failure = commit_unowned(record, step, epoch, device)
            if failure is not None:
                return self._failed(record.path, failure, options)
        for fn in options.on_finalized:
            fn(record)
        for listener in owners:
            listener.saved(record)
        return None

    def _strategy(self, cache_plans: bool) -> Any:
        # Each save gives it its own errors list (see save()).
        own = self.writer == _compat.THREADS
        return save_strategy(
            self.parallel_save,
            [],
            thread_count=self.shards.threads if own else None,
            cache_plans=cache_plans,
            own_writer=own,
        )

    def _get_async_queue(self, device: torch.device) -> Any:
        if self._async_queue is None:
            if self.writer == _compat.THREADS:
                self._async_queue = BackgroundWrites(self.shards, device)
            else:
                async_calls_queue, _ = _compat.async_classes()
                self._async_queue = async_calls_queue()
        return self._async_queue

    # --- finalize, remove, close (collective) ---------------------------------------------

    def finalize(self, blocking: bool = False) -> bool:
        """Finalise the async save in flight once its write has finished on every rank.

        Collective (see the class docstring). With ``blocking=True`` it waits for the write.
        Returns ``True`` when no save is in flight afterwards. A failure in the background
        write becomes a :class:`CheckpointSaveError` naming the step, handled like a failed
        :meth:`save` (its ``on_error``, the owning listeners, else raised).
        """
        pending = self._pending
        if pending is None:
            return True
        start = time.perf_counter()

        try:
            if blocking and self.writer != _compat.THREADS and distributed():
                # Bounded by the writer processes: NVRx's own wait never looks at its worker.
                finalized = finish_writes(self._async_queue, dist.get_rank(), pending.device)
            else:
                finalized = self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        # CheckpointException is a BaseException; either is re-raised as CheckpointSaveError.
        except (Exception, CheckpointException) as err:  # noqa: BLE001
            # Every rank raised (Megatron-Core shares the failure); rank 0's names the cause.
            self._pending = None
            if (
                isinstance(err, WriterProcessEnded | OtherRankFailed)
                and self.writer != _compat.THREADS
            ):
                # The next save starts a fresh worker; this one's writes are given up.
                self._async_queue.close(abort=True)
                self._async_queue = None
            headline = f"async checkpoint save to {pending.path} failed in the background write"
            failure = CheckpointSaveError(f"{headline}: {err}")
            if distributed():
                rank, device = dist.get_rank(), pending.device
                mine = None if isinstance(err, OtherRankFailed) else err
                agreed = agree_on_failure(mine, pending.path, "", rank, device, headline)
                failure = agreed or failure
            failure.__cause__ = err
            self._failed(pending.path, failure, pending.options)
            return True
        pending.call_ids = [c for c in pending.call_ids if c not in finalized]
        if pending.call_ids:
            return False
        self._pending = None
        # Every rank finalised this save at this call: share rank 0's kept error, if any.
        kept = pending.kept[0] if pending.kept else None
        agreed = CheckpointSaveError(f"{pending.path}: {kept}") if kept is not None else None
        if distributed():
            phase = "finishing model/ and optim/"
            agreed = agree_on_failure(kept, pending.path, phase, dist.get_rank(), pending.device)
        if agreed is not None:
            self._failed(pending.path, agreed, pending.options)
            return True
        pending.timings["finalize_s"] = time.perf_counter() - start
        self._complete(
            pending.base, pending.timings, pending.write_timer, pending.options, pending.device
        )
        return True

    def abandon(self) -> None:
        """Local: stop this rank's background write, unfinalised (the step stays uncommitted).
        For error paths: see the strategy's ``abandon_pending_save``. Raises nothing."""
        pending, self._pending = self._pending, None
        queue, self._async_queue = self._async_queue, None
        if queue is None:
            return
        if pending is not None:
            log.warning(
                "an error stopped the run while the async save to %s was being written: its "
                "writer is stopped and the step is left uncommitted (the previous committed step "
                "is intact; a later run cleans it up)",
                pending.path,
            )
        stop_writers(queue)

    def remove(self, path: Path, rank: int) -> None:
        """Delete a step directory: rank 0 deletes, every rank waits for it (collective)."""
        if self._pending is not None and self._pending.path == path:
            self.finalize(blocking=True)
        if rank == 0 and path.exists():
            retention.remove_step(path)
        if distributed():
            dist.barrier()

    def close(self) -> None:
        """Finalise the pending save (blocking) while the process group is up; close the queue."""
        if self._pending is not None and distributed():
            self.finalize(blocking=True)
        if self._async_queue is not None:
            if self.writer == _compat.THREADS:
                self._async_queue.close()
            else:  # bounded by NVRx's worker, whose own close waits on it for ever
                close_writer(self._async_queue)
            self._async_queue = None
        self.shards.close()
        _compat.forget_staged_tensors()


def _sharded_parts(
    path: Path, contents: Sequence[str], state: TrainingState, timed: _Parts | None
) -> tuple[list[tuple[dict[str, Any], Path, dict[str, Any] | None]], Any]:
    """The ``(sharded state dict, directory, content metadata)`` of ``model/`` and ``optim/``
    that a step at ``path`` holds, and the optimizer's sharding; each built part is marked on
    ``timed``."""
    parts: list[tuple[dict[str, Any], Path, dict[str, Any] | None]] = []
    model_ssd = None
    if "model" in contents:
        model_ssd = state.model_sharded_state_dict()
        parts.append((model_ssd, path / MODEL_DIR, None))
    if timed is not None:
        timed.mark("model_state_dict")
    sharding = None
    if "optimizer" in contents and state.optimizers:
        # Mapped onto the model's dict before either part is planned (planning changes it).
        optim_ssd, optim_meta, sharding = optimizers_to_save(state, model_ssd)
        parts.append((optim_ssd, path / OPTIM_DIR, optim_meta))
    if timed is not None:
        timed.mark("optimizer_state_dict")
    return parts, sharding


class _Parts:
    """A save's blocking time cut into :data:`BLOCKING_PARTS`: each :meth:`mark` ends the part
    running since the mark before (the first from ``start``)."""

    def __init__(self, start: float) -> None:
        self._last = start
        self._seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        assert name in BLOCKING_PARTS, name
        now = time.perf_counter()
        self._seconds[name] = self._seconds.get(name, 0.0) + now - self._last
        self._last = now

    def timings(self) -> dict[str, float]:
        """The parts as ``timings`` entries (``part_<name>``), for :meth:`_complete`."""
        return {f"part_{name}": seconds for name, seconds in self._seconds.items()}
