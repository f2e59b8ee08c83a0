"""The commit of a step: once its save is durable on every rank, rank 0 writes
``metadata.json`` (the commit marker), points the tracker at it and applies retention, in order,
on one background thread; the figures and the loggers' notification follow on the training
thread.

The :class:`Committer` is the strategy's :class:`~lightning_mcore_ckpt.strategy.SaveListener`
for the steps of one ``dirpath``: it is registered once, told each step's intent before the
save, and hears from the strategy on every rank when the save is durable or has failed.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt import _atomic, _compat, layout, metrics, retention
from lightning_mcore_ckpt.engine import CheckpointSaveError, SaveOptions, SaveRecord

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport

__all__ = ["Committer", "Intent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Intent:
    """What the callback asked of one step's save (the same on every rank)."""

    step: int
    epoch: int
    contents: tuple[str, ...]
    """What the step will hold, ``"hf_model"`` included when it is exported."""
    monitor: dict[str, Any] | None
    """``{"name", "value"}`` of the value Lightning ranked the step by, or ``None``."""
    export: bool


def step_metadata(intent: Intent, record: SaveRecord) -> dict[str, Any]:
    """A step's ``metadata.json`` fields (its size and throughput are added at the commit)."""
    return {
        "format_version": layout.METADATA_FORMAT_VERSION,
        "global_step": intent.step,
        "epoch": intent.epoch,
        "contents": list(intent.contents),
        "monitor": intent.monitor,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "versions": _compat.versions(),
        "writer": record.writer,
        "async": record.asynchronous,
        "parallel_layout": record.parallel_layout,
        "blocking_time_s": record.blocking_time_s,
        "write_time_s": record.write_time_s,
        "hf_export_time_s": None,
    }


def monitor_entry(name: str | None, value: Any) -> dict[str, Any] | None:
    """The ``monitor`` field of a step's metadata (``None`` when there is no value)."""
    if name is None or value is None:
        return None
    number = float(value.item() if hasattr(value, "item") else value)
    return {"name": name, "value": number if math.isfinite(number) else None}


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
        on_failed: every rank: a save or its commit failed.
        check_lock: rank 0: raises ``RuntimeError`` once this run no longer holds the
            directory's lock (:meth:`~lightning_mcore_ckpt.layout.DirectoryLock.check`); no
            step is written, committed or deleted after that.
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
        self._intents: dict[Path, Intent] = {}
        self._removals: list[tuple[int, Path]] = []
        self._replaced: set[Path] = set()
        self._committed = -1
        self._retain_due = False
        self._executor: ThreadPoolExecutor | None = None
        self._commits: list[tuple[Path, Future[dict[str, Any]]]] = []

    # --- writing a step (every rank) -------------------------------------------------------

    def write(
        self,
        trainer: pl.Trainer,
        target: Path,
        *,
        monitor: dict[str, Any] | None,
        synchronous: bool,
        export: bool,
    ) -> None:
        """Write one step through the strategy. Collective: every rank, in the same order.

        1) finalise the save in flight and report finished commits (one save at a time);
        2) rank 0 decides (:meth:`_decide`); every rank learns it;
        3) the strategy writes the step; its outcome comes back to :meth:`saved` or
           :meth:`failed`, on every rank.
        """
        strategy = trainer.strategy
        strategy.finalize_pending_save(blocking=True)  # type: ignore[attr-defined]
        self.process(wait=True)
        started = time.perf_counter()
        decision = self._decide(target) if trainer.is_global_zero else None
        decision = strategy.broadcast(decision)
        if decision == "exists":
            log.info("%s is already complete; not saving it again", target)
            return
        if decision is not None:
            self._on_failed(target, CheckpointSaveError(decision))
            return
        export = self.hf_export is not None and (
            export or "hf_model" in self.save_contents or self.hf_export.when == "every_save"
        )
        contents = tuple(c for c in self.save_contents if c != "hf_model")
        self._intents[target] = Intent(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            contents=(*contents, "hf_model") if export else contents,
            monitor=monitor,
            export=export,
        )
        options = SaveOptions(contents=contents, synchronous=synchronous, started_at=started)
        trainer.save_checkpoint(target, storage_options=options)

    def _decide(self, target: Path) -> str | None:
        """Rank 0, before ``target`` is written: ``None`` to write it, ``"exists"`` to skip it
        (complete), else why the save fails. A run that lost the directory's lock writes
        nothing; a foreign directory is never touched; an incomplete one of ours (a crashed
        save) is removed, and a complete one too with ``overwrite``."""
        try:
            self._check_lock()
        except RuntimeError as err:
            return f"not saving {target}: {err}"
        if layout.is_complete(target) and self.overwrite:
            log.warning("replacing %s (overwrite=True)", target)
            retention.remove_step(target)
            self._replaced.discard(target)
        elif layout.is_complete(target):
            return "exists"
        elif target.exists() and not layout.is_ours(target):
            return (
                f"{target} exists but was not written by lightning-mcore-ckpt; move it out "
                f"of {self.root} (it is never deleted)"
            )
        elif target.exists():
            log.warning("removing incomplete %s before saving it again", target)
            retention.remove_step(target)
        return None

    # --- the strategy's SaveListener (every rank) ----------------------------------------

    def owns(self, path: Path) -> bool:
        return Path(path) in self._intents

    def saved(self, record: SaveRecord) -> None:
        intent = self._intents.pop(record.path)
        if not self.is_global_zero:
            return
        # Total time: until durable on every rank, then until committed here.
        started = record.finalized_at - record.total_time_s
        metadata = step_metadata(intent, record)
        self._submit(record.path, self._commit, record.path, metadata, started, intent.export)

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

    def export_committed(self, target: Path) -> None:
        """Add the Hugging Face export to a step that is already committed (rank 0)."""
        self._submit(target, self._export_into_committed, target)

    def process(self, wait: bool) -> None:
        """Report the commits that finished, in order (training thread; rank 0 has them).

        With ``wait=True``, wait for every commit in flight first. A commit that failed is
        reported to ``on_failed`` as :class:`CheckpointSaveError`.
        """
        while True:
            while self._commits and (wait or self._commits[0][1].done()):
                target, future = self._commits.pop(0)
                try:
                    metadata = future.result()
                except Exception as err:  # noqa: BLE001 - reported through on_failed
                    failure = CheckpointSaveError(f"committing {target} failed: {err}")
                    failure.__cause__ = err
                    self._on_failed(target, failure)
                    continue
                if metadata:
                    self._committed = max(self._committed, metadata["global_step"])
                    self._retain_due = True
                    self._on_committed(metadata)
            self._schedule_retention(settled=wait and not self._intents)
            if not (wait and self._commits):
                return

    def _schedule_retention(self, settled: bool) -> None:
        # Retention follows the commits, with the bookkeeping of this moment on the training
        # thread (Lightning has finished the trigger that saved a step: its "last" names it).
        # What Lightning let go is deleted once the step that replaced it is committed.
        ready = [p for tag, p in self._removals if settled or tag <= self._committed]
        if not (ready or self._retain_due) or not self.is_global_zero:
            return
        self._removals = [
            (t, p) for t, p in self._removals if not (settled or t <= self._committed)
        ]
        self._retain_due = False
        replaced, self._replaced = (
            (self._replaced, set()) if self._committed >= 0 else (set(), self._replaced)
        )
        self._submit(self.root, self._retain, ready, self._keep(), sorted(replaced))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # --- the background thread (rank 0) -----------------------------------------------------

    def _submit(self, target: Path, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._commits.append((target, self._executor.submit(fn, *args)))

    def _export(self, target: Path) -> float:
        from lightning_mcore_ckpt import hf

        assert self.hf_export is not None
        start = time.perf_counter()
        log.info("exporting %s to Hugging Face format", target)
        hf.export_checkpoint(
            target,
            self.hf_export.path,
            target / layout.HF_DIR,
            dtype=self.hf_export.dtype,
            require_complete=False,
            overwrite=True,
            progress=False,
        )
        return time.perf_counter() - start

    def _commit(
        self, target: Path, metadata: dict[str, Any], started: float, export: bool
    ) -> dict[str, Any]:
        # Export, measure, then write metadata.json (the commit) and the tracker.
        if export:
            metadata["hf_export_time_s"] = self._export(target)
        data_bytes = metrics.tree_bytes(target, exclude=[layout.METADATA_FILE])
        metadata["total_time_s"] = time.perf_counter() - started
        text, metadata = metrics.encode_metadata(metadata, data_bytes)
        self._check_lock()
        _atomic.write_text(target / layout.METADATA_FILE, text)
        layout.write_tracker(self.root, metadata["global_step"])
        log.info(
            "committed %s: %.3f GB, blocked training %.3fs, %.3fs in all",
            target,
            metadata["size_bytes"] / 1e9,
            metadata["blocking_time_s"],
            metadata["total_time_s"],
        )
        return metadata

    def _retain(
        self,
        removals: list[Path],
        keep: set[Path],
        replaced: list[Path] = (),  # type: ignore[assignment]
    ) -> dict[str, Any]:
        # Scans the directory: nothing is kept only in memory. Never deletes the newest
        # committed step (also when it is the one this run resumed from).
        self._check_lock()
        for other in replaced:  # another run's steps, replaced by this one (overwrite=True)
            if layout.is_complete(other) and layout.is_ours(other):
                log.info("overwrite: removing %s of the replaced run", other)
                retention.remove_step(other)
        complete = layout.complete_steps(self.root)
        if not complete:
            return {}
        newest = complete[-1].step
        protect = {newest}
        try:
            for stale in layout.incomplete_steps(self.root):
                if stale.step < newest and layout.is_ours(stale.path):
                    log.info("removing incomplete %s (a newer step is committed)", stale.path)
                    retention.remove_step(stale.path)
            doomed = retention.retention_plan(
                complete, max_to_keep=self.max_to_keep, remove=removals, keep=keep, protect=protect
            )
            for old in doomed:
                log.info("retention: removing %s", old.path)
                retention.remove_step(old.path)
        except Exception as err:
            raise RuntimeError(
                f"{complete[-1].path} is committed, but retention failed: {err}"
            ) from err
        return {}

    def _export_into_committed(self, target: Path) -> dict[str, Any]:
        # A committed step stays complete throughout: huggingface/ appears by rename, then the
        # metadata is replaced atomically with the export's figures.
        self._check_lock()
        seconds = self._export(target)
        metadata = layout.read_metadata(target) or {}
        metadata["hf_export_time_s"] = seconds
        contents = list(metadata.get("contents") or [])
        if "hf_model" not in contents:
            contents.append("hf_model")
        metadata["contents"] = contents
        data_bytes = metrics.tree_bytes(target, exclude=[layout.METADATA_FILE])
        text, metadata = metrics.encode_metadata(metadata, data_bytes)
        _atomic.write_text(target / layout.METADATA_FILE, text)
        log.info("exported %s/%s in %.1fs", target, layout.HF_DIR, seconds)
        # Only the export's figure: the save's own were logged at its commit.
        return {"global_step": metadata["global_step"], "hf_export_time_s": seconds}
