"""Where a save that Lightning's triggers ask for may land, so that the step resumes exactly.

:class:`SaveTiming` is the part of :class:`~lightning_mcore_ckpt.MegatronCheckpoint` that
remembers where the training loop is when a trigger fires:

- a save is made only right after an optimizer step (inside a gradient-accumulation window the
  accumulated gradients are in no checkpoint);
- an epoch-end save waits until Lightning has closed the epoch (its end hooks and per-epoch LR
  schedulers done): it is written at the next epoch's start or at the end of ``fit``;
- a monitor logged only by validation is not taken from an earlier validation: the save waits
  for the next one (Lightning's own deferral), so that a step is ranked by its own value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["SaveTiming"]


@dataclass
class SaveTiming:
    """Where the training loop is, as the callback's hooks see it (the same on every rank)."""

    step_at_batch_start: int = -1
    """``global_step`` when the current training batch started."""
    stepped_at_load: int | None = None
    """Lightning's stepped-batch counter to restore at the first batch after a resume (``None``
    when Lightning's own is right)."""
    val_step: int = -1
    """The step the last validation ran at."""
    step_of_save: int | None = None
    """The step every save from the current trigger names."""
    candidates: dict[str, Any] = field(default_factory=dict)
    """The monitor candidates of the current trigger."""
    deferred: tuple[dict[str, Any], int] | None = None
    """A save Lightning asked for while closing an epoch: its candidates and its epoch."""
    in_batch_end: bool = False
    """Lightning's ``on_train_batch_end`` triggers are running."""
    closing_epoch: bool = False
    """Lightning's epoch-end triggers are running (before its per-epoch schedulers step)."""

    def batch_started(self, trainer: pl.Trainer) -> None:
        """At a training batch's start: remember the step; after a resume, put back the
        stepped-batch counter the saved step had."""
        self.step_at_batch_start = trainer.global_step
        if self.stepped_at_load is not None:
            trainer.fit_loop.epoch_loop._batches_that_stepped = self.stepped_at_load
            self.stepped_at_load = None

    def optimizer_stepped(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizer stepped during the current batch (a save may be made now)."""
        return trainer.global_step != self.step_at_batch_start

    @contextlib.contextmanager
    def batch_end(self) -> Iterator[None]:
        """While Lightning's batch-end triggers run."""
        self.in_batch_end = True
        try:
            yield
        finally:
            self.in_batch_end = False

    @contextlib.contextmanager
    def closing(self, closing: bool = True) -> Iterator[None]:
        """While Lightning's epoch-end triggers run (``closing``: whether they end the epoch)."""
        self.closing_epoch = closing
        try:
            yield
        finally:
            self.closing_epoch = False

    def triggered(
        self, trainer: pl.Trainer, candidates: dict[str, Any], monitor: str | None
    ) -> None:
        """A trigger asks for the current step: it names the step; inside a batch end, a
        monitor value from an earlier validation is dropped (see :meth:`drop_stale`)."""
        self.step_of_save = trainer.global_step
        if self.in_batch_end:
            self.drop_stale(trainer, candidates, monitor)
        self.candidates = candidates

    def drop_stale(
        self, trainer: pl.Trainer, candidates: dict[str, Any], monitor: str | None
    ) -> None:
        """Remove the monitor's value when an earlier validation logged it, not this step:
        without it Lightning waits for the next validation to rank (and record) the step by its
        own value. ``"step"`` and ``"epoch"``, unless logged, are Lightning's counters: always
        current."""
        if monitor is None or monitor not in candidates:
            return
        if monitor not in trainer.callback_metrics or self.val_step == trainer.global_step:
            return
        results = trainer.fit_loop.epoch_loop._results
        if not any(result.meta.name == monitor for result in results.values()):
            del candidates[monitor]

    def defer(self, epoch: int) -> None:
        """Keep the current trigger's save for once the epoch is closed (``epoch``: the epoch it
        records, Lightning's ``current_epoch`` now)."""
        self.deferred = (dict(self.candidates), epoch)

    def take_deferred(self) -> tuple[dict[str, Any], int] | None:
        """The deferred save (its candidates and epoch), once; ``None`` when there is none."""
        deferred, self.deferred = self.deferred, None
        return deferred
