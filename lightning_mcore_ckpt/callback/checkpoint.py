"""``MegatronCheckpoint``: Lightning's ``ModelCheckpoint``, writing Megatron-Core steps.

Lightning decides *when* (its hooks, triggers and timers) and *which* (top-k, best and last
paths, scores, its ``state_dict``, the loggers' notification). This class adapts *when* to
where a step resumes exactly (:class:`~.timing.SaveTiming`) and overrides *how*: a step is a
directory written through the strategy and committed by the ``Committer``
(``_save_checkpoint``), named ``global_step_<N>`` (``format_checkpoint_name``), found by the
tracker (``_find_last_checkpoints``) and deleted once its replacement is committed
(``_remove_checkpoint``). What must differ from Lightning is listed in ``docs/checkpoint.md``.

What it holds: its options (:class:`~.CheckpointConfig`, the one place they are kept), where
the loop is (:class:`~.timing.SaveTiming`), the preemption signals
(:class:`~.preemption.Preemption`) and, during a ``fit``, the ``Committer`` and the directory's
lock.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from weakref import proxy

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_mcore_ckpt._options import field_docs
from lightning_mcore_ckpt.callback import _loops, bookkeeping
from lightning_mcore_ckpt.callback._commit import Committer
from lightning_mcore_ckpt.callback._config import (
    CheckpointConfig,
    Content,
    Durability,
    Mode,
    OnSaveError,
)
from lightning_mcore_ckpt.callback._intent import monitor_entry
from lightning_mcore_ckpt.callback._tier import tiers_of
from lightning_mcore_ckpt.callback.fast_records import FastRecords
from lightning_mcore_ckpt.callback.fast_tier import FastTierRun
from lightning_mcore_ckpt.callback.legacy_state import adopt_legacy_state
from lightning_mcore_ckpt.callback.nodes import share_directory
from lightning_mcore_ckpt.callback.preemption import PREEMPTED_EXIT_CODE, Preemption
from lightning_mcore_ckpt.callback.startup import (
    acquire_lock,
    agree_on_last,
    check_hf_export,
    has_last,
    open_tiers,
    refuse_another_runs_steps,
    refuse_uploading_loggers,
)
from lightning_mcore_ckpt.callback.timing import SaveTiming
from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format import layout, loops, metrics
from lightning_mcore_ckpt.storage.lock import DirectoryLock
from lightning_mcore_ckpt.strategy import MegatronStrategy

if TYPE_CHECKING:
    import datetime
    from collections.abc import Sequence

    import lightning.pytorch as pl

    from lightning_mcore_ckpt.fast import FastTier
    from lightning_mcore_ckpt.hf import HFExport
    from lightning_mcore_ckpt.storage.tier import Tier

__all__ = ["MegatronCheckpoint"]

log = logging.getLogger(__name__)

_NO_LAST = r".*ckpt_path=\"last\"\) is set, but there is no last"
_OPTIONS = frozenset(item.name for item in fields(CheckpointConfig) if item.init)


class MegatronCheckpoint(ModelCheckpoint):
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
    :class:`~lightning_mcore_ckpt.callback.CheckpointConfig` (documented there, field by field),
    kept in :attr:`config`; the callback's own ones are also readable as attributes
    (``checkpoint.save_contents``...).

    What each save cost is logged to every attached Lightning logger at the step of the save
    (``checkpoint/blocking_time_s``, ``total_time_s``, ``write_time_s``, ``size_bytes``,
    ``throughput_gbps``, ``hf_export_time_s``; see :mod:`lightning_mcore_ckpt.format.metrics`) and
    recorded in the step's ``metadata.json``.

    One run writes a ``dirpath`` at a time (:class:`~lightning_mcore_ckpt.storage.lock.DirectoryLock`;
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

    PREEMPTED_EXIT_CODE: ClassVar[int] = PREEMPTED_EXIT_CODE
    """143 (128 + SIGTERM): the :attr:`exit_code` of a preempted run, whichever signal it was."""

    config: CheckpointConfig
    """The options, checked (:class:`~lightning_mcore_ckpt.callback.CheckpointConfig`)."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        every_n_epochs: int | None = None,
        save_contents: Sequence[Content] = ("model", "optimizer", "extra"),
        max_to_keep: int | None = None,
        monitor: str | None = None,
        save_top_k: int | None = None,
        mode: Mode = "min",
        save_last: bool = True,
        hf_export: HFExport | None = None,
        restore_dataloader: bool = True,
        on_save_error: OnSaveError = "raise",
        save_on_preemption: bool = True,
        save_on_exception: bool = False,
        save_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
        overwrite: bool = False,
        local_dir: str | os.PathLike[str] | None = None,
        durability: Durability = "store",
        upload_concurrency: int = 8,
        upload_part_mb: int = 64,
        fast_tier: FastTier | None = None,
    ) -> None:
        # The arguments are the config's fields, one for one, spelled out so that a type checker
        # checks a call (the Literal options); each one's documentation is the field's (below).
        self.config = config = CheckpointConfig(
            **{name: value for name, value in locals().items() if name in _OPTIONS}
        )
        # Lightning's ModelCheckpoint keeps the options it shares in its own attributes, which
        # its code reads (monitor, mode, save_top_k...): it is given them as it takes them.
        super().__init__(
            dirpath=str(config.root),
            monitor=config.monitor,
            verbose=config.verbose,
            save_last=config.save_last,
            save_top_k=config.top_k,
            save_on_exception=config.save_on_exception,
            mode=config.mode,
            every_n_train_steps=config.every_n_train_steps,
            train_time_interval=config.interval,
            every_n_epochs=config.epochs,
            save_on_train_epoch_end=config.save_on_train_epoch_end,
            enable_version_counter=False,
        )
        self.failed_saves = 0
        # The key of this callback's state in a checkpoint: the dirpath as given.
        self._key = str(dirpath) if config.store else str(Path(os.path.expanduser(str(dirpath))))
        self._tiers_of: tuple[Path, tuple[Tier, ...]] | None = None  # see _tiers
        self._timing = SaveTiming()
        self._preemption = Preemption()
        self._committer: Committer | None = None
        self._lock: DirectoryLock | None = None
        self._filters: list[Any] | None = None
        self._found_last: bool | None = None  # see _find_last_checkpoints
        self._resumed_step: int | None = None  # set by on_load_checkpoint when a fit resumes
        self._writing: tuple[Path, int] | None = None  # the step being written, its epoch
        self._synchronous = False  # how the next step is written (see _save_final)
        self._export_next = False
        self._own_steps: set[int] = set()  # committed by this callback (rank 0), every fit
        self._fast: FastTierRun | None = None  # the fast tier, during a fit

    # --- the options and the outcome ------------------------------------------------------

    @property
    def save_contents(self) -> tuple[Content, ...]:
        """What each step holds (:attr:`CheckpointConfig.save_contents`)."""
        return tuple(self.config.save_contents)

    @property
    def max_to_keep(self) -> int | None:
        """The newest steps kept on top of Lightning's (:attr:`CheckpointConfig.max_to_keep`)."""
        return self.config.max_to_keep

    @property
    def hf_export(self) -> HFExport | None:
        """The Hugging Face export (:attr:`CheckpointConfig.hf_export`)."""
        return self.config.hf_export

    @property
    def restore_dataloader(self) -> bool:
        """:attr:`CheckpointConfig.restore_dataloader`."""
        return self.config.restore_dataloader

    @property
    def on_save_error(self) -> OnSaveError:
        """:attr:`CheckpointConfig.on_save_error`."""
        return self.config.on_save_error

    @property
    def save_on_preemption(self) -> bool:
        """:attr:`CheckpointConfig.save_on_preemption`."""
        return self.config.save_on_preemption

    @property
    def overwrite(self) -> bool:
        """:attr:`CheckpointConfig.overwrite`."""
        return self.config.overwrite

    @property
    def preempted(self) -> bool:
        """Whether the last ``fit`` stopped because a preemption signal reached a rank (the
        same on every rank). ``fit`` returns normally either way, as Lightning's does."""
        return self._preemption.signum is not None

    @property
    def preemption_signal(self) -> str | None:
        """The signal that stopped the last ``fit`` (``"SIGTERM"``, ``"SIGUSR1"``), or ``None``."""
        return self._preemption.name

    @property
    def exit_code(self) -> int:
        """What the script should exit with after ``fit``: :attr:`PREEMPTED_EXIT_CODE` when it
        was preempted, else 0. ``sys.exit(checkpoint.exit_code)``."""
        return self.PREEMPTED_EXIT_CODE if self.preempted else 0

    def wait_for_commits(self, trainer: pl.Trainer) -> int | None:
        """Wait until every save started so far is committed: its background write finished,
        its commit marker and the tracker written (on rank 0, by the commit thread), its
        retention and an export it carries done. Returns the newest step committed in this
        ``fit`` (``None``: none yet). A failed save raises
        :class:`~lightning_mcore_ckpt.CheckpointSaveError` here (or is counted, with
        ``on_save_error="warn"``).

        Collective: every rank calls it at the same point, e.g. in a callback's
        ``on_train_batch_end`` placed after this one, or after a ``trainer.save_checkpoint``.
        ``strategy.finalize_pending_save(blocking=True)`` alone returns once the files are
        written, before the step is committed.

        Example::

            step = checkpoint.wait_for_commits(trainer)
            assert layout.read_tracker(checkpoint.dirpath) == step  # on rank 0
        """
        finalize = getattr(trainer.strategy, "finalize_pending_save", None)
        if finalize is not None:
            finalize(blocking=True)
        if self._committer is None:
            return None
        self._committer.process(wait=True)
        return self._committer.committed_step

    @property
    def _root(self) -> Path:
        """``dirpath`` as a resolved path (also after a reassignment of ``dirpath``)."""
        return Path(os.path.realpath(os.path.expanduser(str(self.dirpath))))

    @property
    def _tiers(self) -> tuple[Tier, ...]:
        """The tiers of ``dirpath`` as it is now, innermost first: the local directory, then an
        s3:// dirpath's store. Lightning lets ``dirpath`` be reassigned after construction (the
        resume check does): the local tier follows it, and stays the same object while it
        does not change (a tier holds its lock)."""
        root = self._root
        if self._tiers_of is None or self._tiers_of[0] != root:
            self._tiers_of = (root, tiers_of(self.config, root))
        return self._tiers_of[1]

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
        share_directory(trainer, self._root, self.config, self._tiers, stage)  # one, or per node
        open_tiers(trainer, self._tiers, stage)
        agree_on_last(trainer, self._root, self._found_last)  # only after ckpt_path="last"
        if self._found_last is False and trainer.is_global_zero:
            log.warning(
                'ckpt_path="last": no complete checkpoint in %s, starting from scratch', self._root
            )
        self._found_last = None
        if self.config.fast_tier is not None and stage == "fit":
            strategy = trainer.strategy
            self._fast = FastTierRun.setup(
                trainer,
                self.config.fast_tier,
                persistent_last=lambda: strategy.newest_step(str(self._root)),
                records=FastRecords(self._root, self.config.store),
                persistent=str(self._root),
            )
        self._resumed_step = None  # set by on_load_checkpoint when this fit resumes
        self._committer = Committer(
            self._root,
            is_global_zero=trainer.is_global_zero,
            save_contents=self.save_contents,
            overwrite=self.overwrite,
            hf_export=self.hf_export,
            max_to_keep=self.max_to_keep,
            keep=lambda: bookkeeping.kept_paths(self),
            on_committed=lambda metadata: self._on_committed(trainer, metadata),
            on_failed=lambda path, error: self._on_failed(trainer, path, error),
            check_lock=None if self._lock is None else self._lock.check,
            tiers=self._tiers,
        )
        trainer.strategy.add_save_listener(self._committer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
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
            refuse_another_runs_steps(trainer, self._tiers, self._own_steps)
        self._committer.catch_up(trainer)  # durability="local": steps not uploaded yet
        if self._resumed_step is not None and self.restore_dataloader:
            _loops.refuse_unresumable_loader(trainer, str(self._root), self._resumed_step)
        if self.save_on_preemption:
            self._preemption.install(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # when="end": the final step's one export, also when the cadence or an earlier run saved
        # it unexported; then the Hub uploads finish. A preempted fit is not the end.
        super().on_fit_end(trainer, pl_module)
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
        super().teardown(trainer, pl_module, stage)
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
            self._release(trainer, failed=True)

    def _release(self, trainer: pl.Trainer, failed: bool = False) -> None:
        # After fit, or after an error (Lightning calls on_exception, not teardown, then).
        if self._fast is not None:
            self._fast.close(wait=not failed)
            self._fast = None
        if self._committer is not None:
            self._committer.close()
            if isinstance(trainer.strategy, MegatronStrategy):
                trainer.strategy.remove_save_listener(self._committer)
            self._committer = None  # the next fit's setup makes its own
        self._preemption.uninstall()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        for tier in self._tiers:
            tier.release()

    # --- when: Lightning's triggers, at optimizer steps only ------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._timing.batch_started(trainer)
        if self._fast is not None:
            self._fast.log_recovery()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._log_commits(trainer, wait=False)
        # Saves happen only where the optimizer has just stepped: inside a gradient-accumulation
        # window the accumulated gradients are in no checkpoint.
        if not self._timing.optimizer_stepped(trainer):
            return
        # The epoch's last batch: a step saved now would resume without the epoch-end hooks and
        # per-epoch LR schedulers; such saves wait until Lightning has closed the epoch.
        epoch_ends = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if self._preemption.poll():
            if trainer.is_global_zero:
                log.warning(
                    "%s received: saving step %d synchronously and stopping%s",
                    self._preemption.name,
                    trainer.global_step,
                    ", then requeueing the SLURM job" if self._preemption.requeues else "",
                )
            # The handlers stay installed until fit ends: a second signal during the save (the
            # time limit's SIGTERM after SLURM's --signal warning) must not reach Lightning's
            # SIGTERM handler, which runs a collective from inside the handler, on the
            # signalled ranks alone.
            trainer.should_stop = True
            if not epoch_ends:
                self._save_final(trainer, synchronous=True)
            return  # else on_train_end saves it, synchronously
        with self._timing.batch_end():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._defer_save_until_validation and not _loops.validation_enabled(trainer):
            raise ConfigurationError(
                f"MegatronCheckpoint(monitor={self.monitor!r}): no such metric was logged, and "
                "no validation runs to log it; logged metrics are "
                f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, "
                "value) in the LightningModule, or fix the name"
            )
        ends_here = trainer.should_stop or _loops.max_steps_reached(trainer)
        # A save waiting for this step's validation (a validation-only monitor) is made there.
        waits = self._defer_save_until_validation and _loops.validation_due(trainer)
        if self.save_last and not epoch_ends and ends_here and not waits:
            # The run ends inside an epoch: save now, while the loops still say so (once fit
            # ends Lightning has closed the epoch and the step would resume at the next one).
            self._save_final(trainer)
        elif not (epoch_ends or ends_here):
            self._fast_save(trainer)
        if not ends_here:
            # Once, after the first optimizer step (its state exists): the first save's plans
            # made now, as the later saves' are kept (a no-op once any save planned).
            strategy = trainer.strategy
            assert isinstance(strategy, MegatronStrategy)
            strategy.plan_saves_ahead(self.save_contents)

    def _fast_save(self, trainer: pl.Trainer) -> None:
        """The fast tier's save of this step, when it is due and the persistent tier did not
        just save it (inside an epoch, right after an optimizer step: where steps resume)."""
        fast = self._fast
        if fast is None:
            return
        fast.report()
        step = trainer.global_step
        if fast.due(step) and self._last_global_step_saved != step:
            fast.save(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._timing.closing():
            super().on_train_epoch_end(trainer, pl_module)
            if self._defer_save_until_validation and self._timing.val_step == trainer.global_step:
                # Lightning waits for the validation only when it saves after it; saving at
                # the training epoch end, it would drop the step: make it with that value.
                self._defer_save_until_validation = False
                candidates = self._monitor_candidates(trainer)
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timing.val_step = trainer.global_step
        with self._timing.closing(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch):
            super().on_validation_end(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The previous epoch is closed (hooks, per-epoch schedulers, counters), the next one's
        # data not yet drawn: Lightning resumes a step saved here at the start of this epoch.
        super().on_train_epoch_start(trainer, pl_module)
        self._write_deferred(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not Lightning's, which saves "last" only when nothing was saved during the run: the
        # step the run ends at is saved (as "last") unless it was, and commits before fit ends.
        preempted = self.preempted  # agreed: the same on every rank
        self._write_deferred(trainer, synchronous=preempted)
        export = self.hf_export is not None and self.hf_export.when == "end" and not preempted
        done = trainer.global_step == 0 or bool(getattr(trainer, "fast_dev_run", False))
        if not done and self._last_global_step_saved != trainer.global_step:
            if self.save_last or export:
                self._save_final(trainer, synchronous=preempted, export_hf=export)
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        strategy.finalize_pending_save(blocking=True)
        self._log_commits(trainer, wait=True)
        if self._fast is not None:
            self._fast.report(wait=True)
        # Rank 0 commits; every rank leaves fit once it has, so that a next fit in the same
        # processes finds "last" the same on every rank.
        strategy.barrier("megatron-checkpoint-committed")

    @override
    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Any]:
        candidates = super()._monitor_candidates(trainer)
        self._timing.triggered(trainer, candidates, self.monitor)
        return candidates

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        # Replaces Lightning's, which writes with trainer.save_checkpoint and notifies the
        # loggers at once: a step is written through the strategy, committed later (async),
        # and the loggers hear of it once it is committed. Top-k and "last" name the same step.
        step = trainer.global_step
        if filepath == self._last_checkpoint_saved and step == self._last_global_step_saved:
            return
        self._last_global_step_saved = step
        self._last_checkpoint_saved = filepath
        if self._timing.closing_epoch:
            # Lightning's epoch-end triggers fire before its per-epoch LR schedulers step and
            # before the epoch counts as done: the step is written once the epoch is closed.
            self._timing.defer(trainer.current_epoch)
            return
        self._write(trainer, Path(filepath), self._timing.candidates, trainer.current_epoch)

    def _save_final(
        self, trainer: pl.Trainer, synchronous: bool = False, export_hf: bool = False
    ) -> None:
        """Save the step the run ends (or is preempted) at, as "last"."""
        self._synchronous, self._export_next = synchronous, export_hf
        try:
            candidates = self._monitor_candidates(trainer)
            self._timing.drop_stale(trainer, candidates, self.monitor)
            if self.save_last:
                self._save_last_checkpoint(trainer, candidates)
            if self._last_global_step_saved != trainer.global_step:
                self._save_checkpoint(
                    trainer, str(layout.step_dir(self._root, trainer.global_step))
                )
        finally:
            self._synchronous = self._export_next = False
        if synchronous:
            strategy = trainer.strategy
            assert isinstance(strategy, MegatronStrategy)
            strategy.finalize_pending_save(blocking=True)
            self._log_commits(trainer, wait=True)

    def _write_deferred(self, trainer: pl.Trainer, synchronous: bool = False) -> None:
        """Write the epoch-end save that waited for the epoch to close, if any."""
        deferred = self._timing.take_deferred()
        if deferred is None:
            return
        candidates, epoch = deferred
        self._synchronous = synchronous
        target = layout.step_dir(self._root, trainer.global_step)
        try:
            self._write(trainer, target, candidates, epoch)
        finally:
            self._synchronous = False

    # --- the callback's state, resume ---------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        # Lightning's key (monitor, mode, cadence: a run resumed with other ones starts its
        # bookkeeping afresh), and the dirpath (two callbacks alike but for it, in one Trainer).
        return self._generate_state_key(
            dirpath=self._key,
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    @property
    def _legacy_key(self) -> str:
        """The key of this callback's state in steps saved before :attr:`state_key` named the
        configuration: the dirpath alone."""
        return self._generate_state_key(dirpath=self._key)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "last_global_step_saved": self._last_global_step_saved}
        if self._writing is not None and self.save_last:
            # Lightning's trigger names this step "last" right after its top-k save (here one
            # step, not a copy): the state it carries says so, as Lightning's last.ckpt does.
            state["last_model_path"] = str(self._writing[0])
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_global_step_saved = int(state_dict.get("last_global_step_saved", 0))
        if "best_model_path" in state_dict:  # steps written before 0.2 carry only the above
            super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy equals the original (as Lightning's ModelCheckpoint does: the same
        # attributes), also after a fit: what belongs to a fit in progress (the committer,
        # the directory's lock) is not carried; the next fit's setup creates its own.
        return {**vars(self), "_committer": None, "_lock": None, "_filters": None, "_fast": None}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is not None:
            loops.close_epoch(fit)
        if self._writing is not None:
            # A step written once Lightning has closed its epoch records the epoch of its
            # trigger (Lightning's checkpoint would have been written there), not the next.
            checkpoint["epoch"] = self._writing[1]

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        callbacks = checkpoint.get("callbacks")
        if isinstance(callbacks, dict):  # before Lightning's load_state_dict looks it up
            key, legacy = self.state_key, self._legacy_key
            adopt_legacy_state(callbacks, key, legacy, self.monitor, self.mode)
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        current_dp = strategy.parallel_layout()["data_parallel_size"]
        resumed = _loops.on_load(checkpoint, current_dp, self.restore_dataloader)
        self._resumed_step, self._timing.stepped_at_load = resumed

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        from lightning.pytorch.trainer.states import TrainerFn

        fast = self.config.fast_tier
        if fast is not None and trainer.state.fn == TrainerFn.FITTING:
            # Which tier, which step: decided by every rank together when the strategy loads
            # (FastTierRun.recover): a node that lost its directory sees nothing here.
            fast.root.mkdir(parents=True, exist_ok=True)  # Lightning looks at the path
            self._found_last = True
            return {str(fast.root)}
        self._found_last = has_last(trainer, self.save_contents, self._tiers)
        if self._found_last:
            return {str(self._root)}
        # Said in setup, by rank 0: the ranks are not known yet (each believes it is rank 0).
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
        step = self._timing.step_of_save
        step = int(metrics["step"]) if step is None else step
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
            bookkeeping.forget(self, str(path))
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


# LightningCLI's --help shows each argument's text from an ``Args:`` section: the config's field
# docstrings (the one documentation of each option) are given to it as one.
_DOCS = field_docs(CheckpointConfig)
_ARGS = "".join(f"\n    {name}: {_DOCS[name]}" for name in _DOCS if name in _OPTIONS)
MegatronCheckpoint.__init__.__doc__ = f"Takes the fields of ``CheckpointConfig``.\n\nArgs:{_ARGS}"
