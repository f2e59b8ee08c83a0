"""When a step is saved: Lightning's triggers, moved to where a step can be resumed exactly.

Lightning's ``ModelCheckpoint`` fires its triggers (steps, time, epochs, validation) from its
hooks. :class:`StepTriggers` keeps them and adapts where they may land:

- only right after an optimizer step (inside a gradient-accumulation window the accumulated
  gradients are in no checkpoint);
- an epoch-end save is written once Lightning has closed the epoch (its end hooks and
  per-epoch LR schedulers done), at the next epoch's start or the end of fit;
- a monitor logged only by validation is not taken from an earlier validation: the save waits
  for the next one (Lightning's own deferral), so a step is ranked by its own value;
- the step a run ends or is preempted at is saved, as "last".

How a step is written is the subclass's :meth:`_write`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_mcore_ckpt.callback import _loops
from lightning_mcore_ckpt.callback._preemption import PREEMPTED_EXIT_CODE, Preemption
from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.strategy import MegatronStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport

__all__ = ["StepTriggers"]

log = logging.getLogger(__name__)


class StepTriggers(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose saves land where a resume is exact."""

    save_last: bool
    hf_export: HFExport | None

    PREEMPTED_EXIT_CODE: ClassVar[int] = PREEMPTED_EXIT_CODE
    """143 (128 + SIGTERM): the :attr:`exit_code` of a preempted run, whichever signal it was."""

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

    @property
    def _root(self) -> Path:
        """``dirpath`` as a resolved path (also after a reassignment of ``dirpath``)."""
        return Path(os.path.realpath(os.path.expanduser(str(self.dirpath))))

    def _init_triggers(self) -> None:
        self._preemption = Preemption()
        self._resumed_step: int | None = None
        self._step_at_batch_start = -1
        self._stepped_at_load: int | None = None
        self._candidates: dict[str, Any] = {}
        self._in_batch_end = False
        self._closing_epoch = False
        self._deferred: dict[str, Any] | None = None
        self._synchronous = False
        self._export_next = False
        self._val_step = -1
        self._step_of_save: int | None = None
        self._deferred_epoch = 0

    def _write(
        self, trainer: pl.Trainer, target: Path, candidates: dict[str, Any], epoch: int
    ) -> None:
        """Write the step ``target`` (collective), with the monitor candidates of its trigger
        and the epoch it records: Lightning's ``current_epoch`` when the trigger fired, as
        Lightning's checkpoint records it (also for a step written once the epoch is closed)."""
        raise NotImplementedError

    def _log_commits(self, trainer: pl.Trainer, wait: bool) -> None:
        """Report the commits that finished; ``wait``: every commit in flight."""
        raise NotImplementedError

    # --- when: Lightning's triggers, at optimizer steps only ------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._stepped_at_load is not None:
            trainer.fit_loop.epoch_loop._batches_that_stepped = self._stepped_at_load
            self._stepped_at_load = None

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
        if trainer.global_step == self._step_at_batch_start:
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
        self._in_batch_end = True
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._in_batch_end = False
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

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._closing_epoch = True
        try:
            super().on_train_epoch_end(trainer, pl_module)
            if self._defer_save_until_validation and self._val_step == trainer.global_step:
                # Lightning waits for the validation only when it saves after it; saving at
                # the training epoch end, it would drop the step: make it with that value.
                self._defer_save_until_validation = False
                candidates = self._monitor_candidates(trainer)
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)
        finally:
            self._closing_epoch = False

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_step = trainer.global_step
        self._closing_epoch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        try:
            super().on_validation_end(trainer, pl_module)
        finally:
            self._closing_epoch = False

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The previous epoch is closed (hooks, per-epoch schedulers, counters), the next one's
        # data not yet drawn: Lightning resumes a step saved here at the start of this epoch.
        self._write_deferred(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        # Rank 0 commits; every rank leaves fit once it has, so that a next fit in the same
        # processes finds "last" the same on every rank.
        strategy.barrier("megatron-checkpoint-committed")

    @override
    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Any]:
        candidates = super()._monitor_candidates(trainer)
        self._step_of_save = trainer.global_step  # the step every save from here names
        if self._in_batch_end:
            # Logged by an earlier validation, not by this step: without it Lightning waits for
            # the next validation to rank (and record) the step by its own value.
            self._drop_stale(trainer, candidates)
        self._candidates = candidates
        return candidates

    def _drop_stale(self, trainer: pl.Trainer, candidates: dict[str, Any]) -> None:
        """Remove the monitor's value when an earlier validation logged it, not this step.
        ``"step"`` and ``"epoch"``, unless logged, are Lightning's counters: always current."""
        monitor = self.monitor
        if monitor is None or monitor not in candidates:
            return
        if monitor not in trainer.callback_metrics or self._val_step == trainer.global_step:
            return
        results = trainer.fit_loop.epoch_loop._results
        if not any(result.meta.name == monitor for result in results.values()):
            del candidates[monitor]

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
        if self._closing_epoch:
            # Lightning's epoch-end triggers fire before its per-epoch LR schedulers step and
            # before the epoch counts as done: the step is written once the epoch is closed.
            self._deferred = dict(self._candidates)
            self._deferred_epoch = trainer.current_epoch
            return
        self._write(trainer, Path(filepath), self._candidates, trainer.current_epoch)

    def _save_final(
        self, trainer: pl.Trainer, synchronous: bool = False, export_hf: bool = False
    ) -> None:
        """Save the step the run ends (or is preempted) at, as "last"."""
        self._synchronous, self._export_next = synchronous, export_hf
        try:
            candidates = self._monitor_candidates(trainer)
            self._drop_stale(trainer, candidates)
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
        if self._deferred is None:
            return
        candidates, self._deferred = self._deferred, None
        self._synchronous = synchronous
        target = layout.step_dir(self._root, trainer.global_step)
        try:
            self._write(trainer, target, candidates, self._deferred_epoch)
        finally:
            self._synchronous = False
