"""The commit of a step: write, seal, publish. Every rank *writes* its files (through the
strategy); once written everywhere, rank 0 *seals* the step (durable, then ``metadata.json``, the
commit marker: :func:`~lightning_mcore_ckpt.storage.seal.seal_step`) and *publishes* it to each
tier of the ``dirpath`` (:class:`~lightning_mcore_ckpt.storage.tier.Tier`: the local directory's
tracker, then an object store), then exports it to Hugging Face format when asked and applies
retention, in order, on one background thread. How each commit ended is shared with every rank
on the training thread, so that all raise the same error (or none); the figures and the
loggers' notification follow there.

The :class:`Committer` is the strategy's :class:`~lightning_mcore_ckpt.strategy.SaveListener`
for the steps of one ``dirpath``: it is registered once, told each step's intent before the
save, and hears from the strategy on every rank when the save is durable or has failed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lightning_mcore_ckpt.callback._export import export_into_committed, make_uploader
from lightning_mcore_ckpt.callback._intent import Intent, decide, step_metadata
from lightning_mcore_ckpt.callback._tier import retain
from lightning_mcore_ckpt.engine import CheckpointSaveError, SaveOptions, SaveRecord, cpu_group
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.storage.local_tier import LocalTier
from lightning_mcore_ckpt.storage.seal import seal_step

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.engine import Content
    from lightning_mcore_ckpt.hf import HFExport
    from lightning_mcore_ckpt.storage.tier import Tier

__all__ = ["Committer"]

log = logging.getLogger(__name__)


class Committer:
    """Commits the steps of one ``dirpath`` (rank 0) and reports how each save ended.

    Args:
        root: the ``dirpath``.
        is_global_zero: whether this process commits (the others only track intents).
        save_contents: what each step holds (``MegatronCheckpoint(save_contents=...)``).
        overwrite: a step that exists is replaced, not kept (see :meth:`replace_run`).
        hf_export: what to export, or ``None``.
        max_to_keep: keep the newest N complete steps on top of ``keep()``.
        keep: the steps Lightning's bookkeeping keeps (called on the training thread).
        on_committed: training thread, rank 0: a step was committed (its metadata).
        on_failed: every rank: a save, its commit or its export failed.
        check_lock: rank 0: raises ``RuntimeError`` once this run no longer holds the
            directory's lock (:meth:`~lightning_mcore_ckpt.storage.lock.DirectoryLock.check`); no
            step is written, committed or deleted after that.
        tiers: the ``dirpath``'s tiers, innermost first (``root``'s local directory tier; an
            object store's after it); ``()``: the local directory alone. A step is published
            to each, in order: in its commit where the tier is ``awaited``, else by a job of
            its own once the commit is reported.
    """

    def __init__(
        self,
        root: Path,
        *,
        is_global_zero: bool,
        save_contents: tuple[str, ...],
        hf_export: HFExport | None,
        overwrite: bool = False,
        max_to_keep: int | None,
        keep: Callable[[], set[Path]],
        on_committed: Callable[[dict[str, Any]], None],
        on_failed: Callable[[Path, BaseException], None],
        check_lock: Callable[[], None] | None = None,
        tiers: Sequence[Tier] = (),
    ) -> None:
        self.root = root
        self.is_global_zero = is_global_zero
        self.save_contents = save_contents
        self.overwrite = overwrite
        self.hf_export = hf_export
        self.max_to_keep = max_to_keep
        self._keep = keep
        self._on_committed = on_committed
        self._on_failed = on_failed
        self._check_lock = check_lock or (lambda: None)
        self.tiers: tuple[Tier, ...] = tuple(tiers) or (LocalTier(root),)
        self._intents: dict[Path, Intent] = {}
        self._removals: list[tuple[int, Path]] = []
        self._replaced: set[Path] = set()
        self._committed = -1
        self._retain_due = False
        self._executor: ThreadPoolExecutor | None = None
        # Rank 0: the background jobs, in order; whether every rank waits for the outcome.
        self._commits: list[tuple[Path, Future[dict[str, Any]], bool]] = []
        # Every rank: the commits and exports whose outcome is not known yet (the same list).
        self._awaiting: list[Path] = []
        self._uploader = make_uploader(hf_export) if is_global_zero else None  # Hub, rank 0

    # --- writing a step (every rank) -------------------------------------------------------

    def write(
        self,
        trainer: pl.Trainer,
        target: Path,
        *,
        epoch: int,
        monitor: dict[str, Any] | None,
        synchronous: bool,
        export: bool,
        preempted: bool = False,
    ) -> None:
        """Write one step through the strategy. Collective: every rank, in the same order.
        ``epoch``: the epoch it records (Lightning's ``current_epoch`` at its trigger).

        1) finalise the save in flight and report finished commits (one save at a time);
        2) rank 0 decides (:func:`~._intent.decide`); every rank learns it;
        3) the strategy writes the step; its outcome comes back to :meth:`saved` or
           :meth:`failed`, on every rank.

        A preemption save is never exported: the job has seconds left.
        """
        strategy = trainer.strategy
        strategy.finalize_pending_save(blocking=True)  # type: ignore[attr-defined]
        # What Lightning let go for this step (an epoch-end save is written after its
        # bookkeeping) waits for this step's commit.
        self.process(wait=True, upcoming=trainer.global_step)
        started = time.perf_counter()
        decision = None
        if trainer.is_global_zero:
            decision = decide(target, self.overwrite, self.tiers, self._check_lock)
            self._replaced.discard(target)  # replaced now, if it was another run's (overwrite)
        decision = strategy.broadcast(decision)
        if decision == "exists":
            log.info("%s is already complete; not saving it again", target)
            return
        if decision is not None:
            self._on_failed(target, CheckpointSaveError(decision))
            return
        export = (
            self.hf_export is not None
            and not preempted
            and (export or "hf_model" in self.save_contents or self.hf_export.when == "every_save")
        )
        contents = cast(
            "tuple[Content, ...]", tuple(c for c in self.save_contents if c != "hf_model")
        )
        self._intents[target] = Intent(
            step=trainer.global_step,
            epoch=epoch,
            contents=contents,
            monitor=monitor,
            export=export,
        )
        options = SaveOptions(contents=contents, synchronous=synchronous, started_at=started)
        # Lightning's whole state (its default, passed: left unset, Lightning logs it each save).
        trainer.save_checkpoint(target, weights_only=False, storage_options=options)

    # --- the strategy's SaveListener (every rank) ----------------------------------------

    @property
    def committed_step(self) -> int | None:
        """The newest step committed since this committer was made (``None``: none)."""
        return None if self._committed < 0 else self._committed

    def owns(self, path: Path) -> bool:
        return Path(path) in self._intents

    def saved(self, record: SaveRecord) -> None:
        intent = self._intents.pop(record.path)
        # The commit first, then the export: a failed export never costs the step.
        jobs: list[tuple[Any, ...]] = [
            (self._commit, record.path, step_metadata(intent, record), record)
        ]
        if intent.export:
            jobs.append((self._export_into_committed, record.path))
        for tier in self.tiers:
            if not tier.awaited:
                jobs.append((self._publish, tier, record.path))  # reported on its own
            upload = None if self.is_global_zero else tier.part_upload(record.path, record.hashes)
            if upload is not None:  # this node's part, for rank 0's commit to gather
                self._submit_part(record.path, upload)
        for fn, *args in jobs:
            self._awaiting.append(record.path)
            if self.is_global_zero:
                self._submit(record.path, fn, *args)

    def failed(self, path: Path, error: CheckpointSaveError) -> None:
        intent = self._intents.pop(Path(path), None)
        if intent is not None:
            # What this step's save would have replaced stays.
            self._removals = [(tag, p) for tag, p in self._removals if tag != intent.step]
        self._on_failed(Path(path), error)

    # --- requests from the callback -------------------------------------------------------

    def remove_after(self, step: int, path: Path) -> None:
        """Delete ``path`` once the save of ``step`` is committed, unless Lightning's bookkeeping
        names it again by then (rank 0; else a no-op)."""
        if self.is_global_zero:
            self._removals.append((step, path))

    def replace_run(self) -> None:
        """A new run with ``overwrite``: the complete steps already in ``root`` (another run's)
        are deleted once this run has committed its first step (rank 0)."""
        if self.is_global_zero:
            self._replaced = {s.path for s in layout.complete_steps(self.root)}

    def catch_up(self, trainer: pl.Trainer) -> None:
        """Publish the steps a killed run left sealed but unpublished in a tier that is not
        ``awaited`` (durability ``"local"``). Collective."""
        pending = []
        if self.is_global_zero:
            pending = [(i, str(p)) for i, t in enumerate(self.tiers) for p in t.unpublished()]
        for index, target in trainer.strategy.broadcast(pending):
            self._awaiting.append(Path(target))
            if self.is_global_zero:
                self._submit(Path(target), self._publish, self.tiers[index], Path(target))

    def export_committed(self, target: Path) -> None:
        """Add the Hugging Face export to a step that is already committed. Every rank calls
        it (rank 0 exports; every rank learns the outcome from :meth:`process`)."""
        self._awaiting.append(target)
        if self.is_global_zero:
            self._submit(target, self._export_into_committed, target)

    def process(self, wait: bool, *, collective: bool = True, upcoming: int | None = None) -> None:
        """Report the commits and exports that finished, in order, on every rank.

        Collective while any is awaited (every rank calls it at the same point): rank 0, which
        runs them, shares their outcomes, so that a failure raises the same
        :class:`CheckpointSaveError` on every rank (through ``on_failed``) instead of on rank 0
        alone. With ``wait=True``, wait for every one in flight first. ``collective=False``
        (after an error, when the other ranks may be gone): rank 0 waits and logs, raising
        nothing. ``upcoming``: the step about to be written; what Lightning let go for it is
        not deleted before it is committed.
        """
        if not collective:
            self._drain()
            return
        for row in self._uploader.take_outcomes() if self._uploader is not None else ():
            self._on_committed(row)  # rank 0: a Hub upload's figures
        while True:
            outcomes = self._finished(wait) if self.is_global_zero else []
            if self._awaiting:
                outcomes = self._share(outcomes)
            for target, metadata, error in outcomes:
                self._awaiting.remove(Path(target))
                if error is not None:
                    self._on_failed(Path(target), CheckpointSaveError(error))
                elif metadata:
                    self._committed = max(self._committed, metadata["global_step"])
                    self._retain_due = True
                    if self.is_global_zero:
                        self._on_committed(metadata)
            self._schedule_retention(settled=wait and not self._intents, upcoming=upcoming)
            if not (wait and self._commits):
                return

    def _finished(self, wait: bool) -> list[tuple[str, dict[str, Any] | None, str | None]]:
        # Rank 0: the outcomes of the awaited jobs that finished (all, with wait), in order.
        outcomes: list[tuple[str, dict[str, Any] | None, str | None]] = []
        while self._commits and (wait or self._commits[0][1].done()):
            target, future, awaited = self._commits.pop(0)
            try:
                metadata, error = future.result(), None
            except Exception as err:  # noqa: BLE001 - shared, then raised on every rank
                metadata, error = None, str(err)
            if awaited:
                outcomes.append((str(target), metadata, error))
        return outcomes

    def _share(self, outcomes: list[Any]) -> list[Any]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return outcomes
        # Over a CPU (gloo) group: on the GPU it would synchronise the device at every step
        # that a commit is in flight. Created (once per process) at the same call on every rank.
        box = [outcomes]
        dist.broadcast_object_list(box, src=0, group=cpu_group())
        return list(box[0])

    def _drain(self) -> None:
        # After an error: what finished is logged, nothing raised or deleted. A commit that
        # failed goes to on_failed like any other (counted with on_save_error="warn"); what
        # on_failed raises is dropped: the run's own exception is the one raised.
        self._awaiting.clear()
        while self._commits:
            target, future, _ = self._commits.pop(0)
            try:
                metadata = future.result()
            except Exception as err:  # noqa: BLE001 - logged: the original exception propagates
                log.error("%s: %s (while the run was failing)", target, err)
                with contextlib.suppress(Exception):
                    self._on_failed(Path(target), CheckpointSaveError(str(err)))
                continue
            if metadata:
                try:
                    self._on_committed(metadata)
                except Exception as err:  # noqa: BLE001
                    log.error("reporting the commit of %s: %s", target, err)

    def _schedule_retention(self, settled: bool, upcoming: int | None = None) -> None:
        # Retention follows the commits, with the bookkeeping of this moment on the training
        # thread (Lightning has finished the trigger that saved a step: its "last" names it).
        # What Lightning let go is deleted once the step that replaced it is committed; once
        # nothing is in flight (settled), whatever it was let go for, but for the step about
        # to be written (upcoming).
        def due(tag: int) -> bool:
            return tag <= self._committed or (settled and tag != upcoming)

        ready = [p for tag, p in self._removals if due(tag)]
        if not (ready or self._retain_due) or not self.is_global_zero:
            return
        self._removals = [(t, p) for t, p in self._removals if not due(t)]
        self._retain_due = False
        replaced, self._replaced = (
            (self._replaced, set()) if self._committed >= 0 else (set(), self._replaced)
        )
        self._submit(self.root, self._retain, ready, self._keep(), sorted(replaced), awaited=False)

    def finish_uploads(self, wait: bool) -> None:
        """End of ``fit``, collective with ``HFExport(upload_to=...)``: wait for the Hub uploads
        (``upload_timeout_s``); each failure goes to ``on_failed`` on every rank (steps stay)."""
        if not wait or self.hf_export is None or self.hf_export.upload_to is None:
            return  # preempted (not wait): an unfinished upload is logged at close
        timeout = self.hf_export.upload_timeout_s
        found = self._uploader.finish(timeout) if self._uploader is not None else []
        self.process(wait=False)  # rank 0 logs the uploads' figures
        for target, error in self._share(found):
            self._on_failed(Path(target), CheckpointSaveError(error))

    def close(self) -> None:
        if self._uploader is not None:
            self._uploader.close()  # logs an upload left unfinished
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # --- the background thread (rank 0) -----------------------------------------------------

    def _submit(
        self, target: Path, fn: Callable[..., dict[str, Any]], *args: Any, awaited: bool = True
    ) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._commits.append((target, self._executor.submit(fn, *args), awaited))

    def _submit_part(self, target: Path, upload: Callable[[], Any]) -> None:
        # A node's leader (not rank 0): its part of the step, on the background thread; how it
        # ended reaches every rank through rank 0's commit, which waits for its confirmation.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        future = self._executor.submit(upload)
        future.add_done_callback(lambda f: _log_part_failure(target, f))

    def _commit(self, target: Path, metadata: dict[str, Any], record: SaveRecord) -> dict[str, Any]:
        # Sealed (every file and directory of the step durable, then metadata.json), then
        # published to each awaited tier in order (the tracker first): a power cut never
        # leaves "last" naming a step with a file missing.
        started = record.finalized_at - record.total_time_s  # the first rank's start
        try:
            self._check_lock()
            parts: dict[str, tuple[int, str]] = {}
            for tier in self.tiers:  # the files written on other nodes, once they confirm
                parts.update(tier.gather_parts(target, record.hashes) or {})
            metadata = seal_step(target, metadata, started=started, parts=parts or None)
            for tier in self.tiers:
                if tier.awaited:
                    metadata = {**metadata, **tier.publish(target, first=True)}
        except Exception as err:
            raise RuntimeError(f"committing {target} failed: {err}") from err
        gb, blocked, total = (
            metadata[k] for k in ("size_bytes", "blocking_time_s", "total_time_s")
        )
        log.info(
            "committed %s: %.3f GB, blocked %.3fs, %.3fs in all", target, gb / 1e9, blocked, total
        )
        return metadata

    def _publish(self, tier: Tier, target: Path) -> dict[str, Any]:
        # A tier that is not awaited: the publication of a step already reported as committed.
        return {"global_step": layout.step_number(target), **tier.publish(target, first=True)}

    def _retain(
        self,
        removals: list[Path],
        keep: set[Path],
        replaced: list[Path] = (),  # type: ignore[assignment]
    ) -> dict[str, Any]:
        try:
            self._check_lock()
            uploading = self._uploader.steps() if self._uploader else ()
            retain(self.tiers, self.max_to_keep, removals, keep, replaced, uploading)
        except Exception as err:  # noqa: BLE001 - a step is committed: losing none, go on
            where = self.tiers[-1].where
            log.error(
                "a step is committed, but retention failed: %s; training goes on, and the "
                "next commit tries again (free space or fix permissions in %s)",
                err,
                where,
            )
        return {}

    def _export_into_committed(self, target: Path) -> dict[str, Any]:
        assert self.hf_export is not None
        self._check_lock()
        figures = export_into_committed(self.hf_export, target)
        if figures:  # the export joins the published step
            for tier in self.tiers:
                tier.publish(target, first=False)
        if figures and self._uploader is not None:
            self._uploader.submit(target)  # in the background: the export is committed
        return figures


def _log_part_failure(target: Path, future: Future[Any]) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None:
        log.error("uploading this node's part of %s failed: %s", target, error)
