"""``MegatronCheckpoint``: Lightning's ``ModelCheckpoint``, writing Megatron-Core steps.

Lightning decides *when* (its hooks, triggers and timers) and *which* (top-k, best and last
paths, scores, its ``state_dict``, the loggers' notification). This class overrides only *how*:
a step is a directory written through the strategy and committed by the ``Committer``
(``_save_checkpoint``), named ``global_step_<N>`` (``format_checkpoint_name``), found by the
tracker (``_find_last_checkpoints``) and deleted once its replacement is committed
(``_remove_checkpoint``). What must differ from Lightning is listed in ``docs/checkpoint.md``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any
from weakref import proxy

from typing_extensions import override

from lightning_mcore_ckpt.callback import _bookkeeping, _loops
from lightning_mcore_ckpt.callback._commit import Committer
from lightning_mcore_ckpt.callback._config import CheckpointConfig
from lightning_mcore_ckpt.callback._intent import monitor_entry
from lightning_mcore_ckpt.callback._setup import (
    acquire_lock,
    agree_on_last,
    check_hf_export,
    has_last,
    open_tier,
    refuse_another_runs_steps,
    refuse_uploading_loggers,
)
from lightning_mcore_ckpt.callback._state import CheckpointState
from lightning_mcore_ckpt.callback._tier import StoreTier
from lightning_mcore_ckpt.format import layout, metrics
from lightning_mcore_ckpt.storage.lock import DirectoryLock
from lightning_mcore_ckpt.strategy import MegatronStrategy

if TYPE_CHECKING:
    import datetime
    from collections.abc import Sequence

    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport

__all__ = ["MegatronCheckpoint"]

log = logging.getLogger(__name__)

_NO_LAST = r".*ckpt_path=\"last\"\) is set, but there is no last"


class MegatronCheckpoint(CheckpointState):
    """Save Megatron-Core distributed checkpoints on a cadence, commit them, keep the right ones.

    Each save writes ``<dirpath>/global_step_<N>/`` through
    :class:`~lightning_mcore_ckpt.MegatronStrategy` (``model/``, ``optim/``, ``extra/``), then
    commits it: ``metadata.json`` is written last, atomically, once every rank has finished (for
    an async save: once the background write is finalised); only then is
    ``latest_checkpointed_iteration.txt`` updated, do the loggers hear of it
    (``after_save_checkpoint``) and are the steps Lightning let go deleted.
    ``trainer.fit(ckpt_path="last")`` resumes from the newest complete step, or starts from
    scratch, with one log line, when there is none.

    It is Lightning's ``ModelCheckpoint``: the triggers, ``save_top_k``, ``monitor``/``mode``,
    ``best_model_path``, ``best_model_score``, ``best_k_models``, ``last_model_path``,
    ``ckpt_path="best"`` and the callback's state on resume behave as Lightning documents, with
    a step directory where Lightning has a file. The options are those of
    :class:`~lightning_mcore_ckpt.callback.CheckpointConfig` (documented there, field by field).

    What each save cost is logged to every attached Lightning logger at the step of the save
    (``checkpoint/blocking_time_s``, ``total_time_s``, ``write_time_s``, ``size_bytes``,
    ``throughput_gbps``, ``hf_export_time_s``; see :mod:`lightning_mcore_ckpt.format.metrics`) and
    recorded in the step's ``metadata.json``.

    One run writes a ``dirpath`` at a time (:class:`~lightning_mcore_ckpt.format.layout.DirectoryLock`;
    a requeue of the same job takes over at once). On SIGTERM or SIGUSR1 every rank finishes
    the step, saves it and ``fit`` returns (then, under SLURM with Lightning's auto-requeue, the
    job is requeued); :attr:`preempted` says so on every rank, and
    ``sys.exit(checkpoint.exit_code)`` ends the script with :attr:`PREEMPTED_EXIT_CODE` (143).

    Example::

        checkpoint = MegatronCheckpoint("checkpoints/run", every_n_train_steps=500, max_to_keep=3)
        trainer = L.Trainer(
            strategy=MegatronStrategy(tensor_model_parallel_size=2), callbacks=[checkpoint]
        )
        trainer.fit(module, datamodule=dm, ckpt_path="last")
        sys.exit(checkpoint.exit_code)  # 0, or 143 when preempted
    """

    FILE_EXTENSION = ""

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        every_n_epochs: int | None = None,
        save_contents: Sequence[str] = ("model", "optimizer", "extra"),
        max_to_keep: int | None = None,
        monitor: str | None = None,
        save_top_k: int | None = None,
        mode: str = "min",
        save_last: bool = True,
        hf_export: HFExport | None = None,
        restore_dataloader: bool = True,
        on_save_error: str = "raise",
        save_on_preemption: bool = True,
        save_on_exception: bool = False,
        save_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
        overwrite: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        durability: str = "store",
        upload_concurrency: int = 8,
        upload_part_mb: int = 64,
    ) -> None:
        fields = CheckpointConfig.__dataclass_fields__
        config = CheckpointConfig(**{k: v for k, v in locals().items() if k in fields})
        if train_time_interval is not None and config.interval is None and every_n_epochs is None:
            every_n_epochs = 0  # a disabled interval is still a choice: not "every epoch"
        super().__init__(
            dirpath=str(config.root),
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=config.top_k,
            save_on_exception=save_on_exception,
            mode=mode,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=config.interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=False,
        )
        self.config = config
        self.save_contents = tuple(save_contents)
        self.max_to_keep = max_to_keep
        self.hf_export = hf_export
        self.restore_dataloader = restore_dataloader
        self.on_save_error = on_save_error
        self.save_on_preemption = save_on_preemption
        self.overwrite = overwrite
        self.failed_saves = 0
        # The key of this callback's state in a checkpoint: the dirpath as given.
        self._key = str(dirpath) if config.store else str(Path(os.path.expanduser(str(dirpath))))
        self._tier = StoreTier.of(config)  # an s3:// dirpath, or None
        self._committer: Committer | None = None
        self._lock: DirectoryLock | None = None
        self._filters: list[Any] | None = None
        self._found_last: bool | None = None  # see _find_last_checkpoints
        self._writing: tuple[Path, int] | None = None  # the step being written, its epoch
        self._own_steps: set[int] = set()  # committed by this callback (rank 0), every fit
        self._init_triggers()

    # --- lifecycle ------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Not Lightning's: it resolves dirpath (fixed here at construction) and warns that the
        # directory is not empty, which is how every resumed run starts. The lock is our check.
        if not isinstance(trainer.strategy, MegatronStrategy):
            got = type(trainer.strategy).__name__
            raise TypeError(
                f"MegatronCheckpoint needs Trainer(strategy=MegatronStrategy()), got {got}"
            )
        refuse_uploading_loggers(trainer.loggers, str(self._root))
        if self._filters is not None:  # see _find_last_checkpoints
            warnings.filters[:], self._filters = self._filters, None  # type: ignore[index]
        self._lock = acquire_lock(trainer, self._root, stage)
        open_tier(trainer, self._tier, stage)
        agree_on_last(trainer, self._root, self._found_last)  # only after ckpt_path="last"
        self._found_last = None
        self._resumed_step = None  # set by on_load_checkpoint when this fit resumes
        self._committer = Committer(
            self._root,
            is_global_zero=trainer.is_global_zero,
            save_contents=self.save_contents,
            overwrite=self.overwrite,
            hf_export=self.hf_export,
            max_to_keep=self.max_to_keep,
            keep=lambda: _bookkeeping.kept_paths(self),
            on_committed=lambda metadata: self._on_committed(trainer, metadata),
            on_failed=lambda path, error: self._on_failed(trainer, path, error),
            check_lock=None if self._lock is None else self._lock.check,
            tier=self._tier,
        )
        trainer.strategy.add_save_listener(self._committer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hf_export is not None:
            # A mismatch found at the end of training would waste the run: check it now.
            check_hf_export(self.hf_export, trainer.strategy, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # starts the train_time_interval clock
        # Known only now: whether a checkpoint was loaded (nothing has been written yet).
        assert self._committer is not None
        if self._resumed_step is None and self.overwrite:
            self._committer.replace_run()
        elif self._resumed_step is None:
            # A Trainer fitted again continues its own run (its steps are this callback's).
            refuse_another_runs_steps(trainer, self._root, self._tier, self._own_steps)
        self._committer.catch_up(trainer)  # durability="local": steps not uploaded yet
        if self._resumed_step is not None and self.restore_dataloader:
            _loops.refuse_unresumable_loader(trainer, str(self._root), self._resumed_step)
        if self.save_on_preemption:
            self._preemption.install(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # when="end": the final step's one export, also when the cadence or an earlier run saved
        # it unexported; then the Hub uploads finish. A preempted fit is not the end.
        assert self._committer is not None
        export = self.hf_export is not None and self.hf_export.when == "end" and not self.preempted
        if export and trainer.global_step > 0:
            from lightning_mcore_ckpt import hf

            target = layout.step_dir(self._root, trainer.global_step)
            wanted = layout.is_complete(target) and not hf.is_exported(target)
            # Rank 0 exports; every rank hears how it ended (an error is raised everywhere).
            if trainer.strategy.broadcast(wanted):
                self._committer.export_committed(target)
                self._committer.process(wait=True)
        self._committer.finish_uploads(wait=not self.preempted)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release(trainer)
        # Under SLURM with Lightning's auto-requeue: the preempted step is committed (on_train_end)
        # and the lock released (the requeued job may start at once, elsewhere): requeue now.
        # SLURM then ends this job (Lightning has put back the handlers from before fit).
        self._preemption.requeue(trainer)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Nothing here is collective: the other ranks may have failed, or be waiting elsewhere.
        # A step whose write finished on every rank still commits (rank 0's commit thread);
        # an async save still being written is stopped and left uncommitted (an incomplete
        # step, cleaned up by a later run), before the lock is released. Errors met here are
        # logged; the run's own error is the one raised.
        try:
            super().on_exception(trainer, pl_module, exception)
            if isinstance(trainer.strategy, MegatronStrategy):
                trainer.strategy.abandon_pending_save()
            if self._committer is not None:
                self._committer.process(wait=True, collective=False)
        except Exception as err:  # noqa: BLE001 - reported, the original exception propagates
            log.error("while handling %r: %s", exception, err)
        finally:
            self._release(trainer)

    def _release(self, trainer: pl.Trainer) -> None:
        # After fit, or after an error (Lightning calls on_exception, not teardown, then).
        if self._committer is not None:
            self._committer.close()
            if isinstance(trainer.strategy, MegatronStrategy):
                trainer.strategy.remove_save_listener(self._committer)
            self._committer = None  # the next fit's setup makes its own
        self._preemption.uninstall()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._tier is not None and self._tier.lock is not None:
            self._tier.lock.release()
            self._tier.lock = None

    # --- resume ---------------------------------------------------------------------------

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)  # its state's key
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        current_dp = strategy.parallel_layout()["data_parallel_size"]
        resumed = _loops.on_load(checkpoint, current_dp, self.restore_dataloader)
        self._resumed_step, self._stepped_at_load = resumed

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        self._found_last = has_last(trainer, self.save_contents, self._root, self._tier)
        if self._found_last:
            return {str(self._root)}
        if trainer.is_global_zero:
            log.warning(
                'ckpt_path="last": no complete checkpoint in %s, starting from scratch', self._root
            )
        # Lightning's own warning, which follows, would suggest save_last=True: silenced for
        # this one call (the filters are restored in setup, which comes next).
        self._filters = list(warnings.filters)
        warnings.filterwarnings("ignore", message=_NO_LAST)
        return set()

    # --- how: write, name, keep, remove ---------------------------------------------------

    @override
    def format_checkpoint_name(
        self,
        metrics: dict[str, Any],
        filename: str | None = None,
        ver: int | None = None,
        prefix: str | None = None,
    ) -> str:
        # One name per step, for top-k and for "last" alike: global_step_<N>.
        step = int(metrics["step"]) if self._step_of_save is None else self._step_of_save
        return str(layout.step_dir(self._root, step))

    @override
    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        # "last" is a step here, not a copy: the previous last may still be one Lightning keeps;
        # nor is the step resumed from deleted (trainer.ckpt_path is dirpath, for "last").
        resumed = self._resumed_step
        kept = [*self.best_k_models, self.best_model_path]
        kept += [] if resumed is None else [str(layout.step_dir(self._root, resumed))]
        if previous in kept or (self.monitor is None and self.save_top_k == -1):
            return False
        return super()._should_remove_checkpoint(trainer, previous, current)

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        # Not Lightning's (strategy.remove_checkpoint at once): the step replacing this one may
        # still be in flight. The committer deletes it, through the one safe deletion path, once
        # that step is committed, unless Lightning's bookkeeping names it again by then.
        assert self._committer is not None
        self._committer.remove_after(self._last_global_step_saved, Path(filepath))

    def _write(
        self, trainer: pl.Trainer, target: Path, candidates: dict[str, Any], epoch: int
    ) -> None:
        assert self._committer is not None
        monitor = monitor_entry(self.monitor, candidates.get(self.monitor or ""))
        self._writing = (target, epoch)  # see state_dict, on_save_checkpoint
        try:
            self._committer.write(
                trainer,
                target,
                epoch=epoch,
                monitor=monitor,
                synchronous=self._synchronous,
                export=self._export_next,
                preempted=self.preempted,
            )
        finally:
            self._writing = None

    # --- outcomes -------------------------------------------------------------------------

    def _log_commits(self, trainer: pl.Trainer, wait: bool) -> None:
        """Report the commits that finished (rank 0); ``wait``: every commit in flight."""
        if self._committer is not None:
            self._committer.process(wait)

    def _on_committed(self, trainer: pl.Trainer, metadata: dict[str, Any]) -> None:
        metrics.log_save_metrics(
            trainer.loggers, metadata["global_step"], metrics.save_metrics(metadata)
        )
        if "blocking_time_s" in metadata:  # a save (not an export added to a committed step)
            self._own_steps.add(int(metadata["global_step"]))
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _on_failed(self, trainer: pl.Trainer, path: Path, error: BaseException) -> None:
        """A save, its commit or retention failed (every rank): raise or count it. A step that
        did not commit is dropped from Lightning's bookkeeping."""
        if not layout.is_complete(path):
            _bookkeeping.forget(self, str(path))
        if self.on_save_error == "raise":
            raise error
        self.failed_saves += 1
        step = layout.step_number(path)
        log.error(
            "checkpoint of step %s failed (%d so far); training goes on (on_save_error='warn'): %s",
            step,
            self.failed_saves,
            error,
        )
        if trainer.is_global_zero:
            metrics.log_save_metrics(
                trainer.loggers, step or 0, {"checkpoint/failed": float(self.failed_saves)}
            )
