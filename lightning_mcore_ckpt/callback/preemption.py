"""Preemption: SIGTERM / SIGUSR1 (what SLURM and other schedulers send) as a signal every rank
agrees on, so that the run saves the step it is on and ends cleanly; under SLURM with
Lightning's auto-requeue, the job is then requeued, once that step is committed."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "Preemption"]

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

PREEMPTED_EXIT_CODE = 128 + int(signal.SIGTERM)
"""143: how a shell or a scheduler reports a process that SIGTERM ended (128 + 15). Not 0, so
that ``--dependency=afterok`` chains do not take a preempted run for a finished one; in 128-255,
which Kubeflow's ``restartPolicy: ExitCode`` and the usual Kubernetes pod failure policies treat
as retryable. The same code whichever signal it was."""


class Preemption:
    """Catches the preemption signals while installed; :meth:`poll` is collective.

    Install on every rank at the start of training (the main thread only: Python delivers
    signals there), uninstall when training ends. :attr:`signum` is the signal every rank agreed
    on (``None`` until then), so it reads the same on every rank.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._received: set[int] = set()
        self._signals: tuple[int, ...] = PREEMPTION_SIGNALS
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._requeue_signal: int | None = None
        self._requeue: Callable[[int, Any], None] | None = None

    # A pickled copy (of the callback that holds it) keeps what every rank agreed on; the
    # handlers, the signals received and the process group belong to the process that
    # installed them, and are set up again at the start of the next training.

    def __getstate__(self) -> dict[str, Any]:
        return {"signum": self.signum}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.signum = state["signum"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Preemption):
            return NotImplemented
        return self.__getstate__() == other.__getstate__()

    __hash__ = None  # type: ignore[assignment]

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def requeues(self) -> bool:
        """Whether the agreed signal is Lightning's SLURM requeue signal, with its handler on."""
        return self._requeue is not None and self.signum == self._requeue_signal

    def install(self, trainer: pl.Trainer) -> None:
        """Collective when distributed (a CPU group for the flag may be created)."""
        self.signum, self._received, self._requeue = None, set(), None
        if threading.current_thread() is not threading.main_thread():
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The flag travels over a CPU (gloo) group: an all-reduce on the GPU would
            # synchronise the device at every step.
            from lightning_mcore_ckpt.engine import cpu_group

            self._group = cpu_group()
        # Lightning's SLURM auto-requeue listens to SLURMEnvironment.requeue_signal (SIGUSR1
        # unless configured): it is a preemption signal too. It goes first, so that when it
        # and SIGTERM both arrive the job is requeued.
        self._requeue_signal = _requeue_signal(trainer)
        first = () if self._requeue_signal is None else (self._requeue_signal,)
        self._signals = tuple(dict.fromkeys((*first, *PREEMPTION_SIGNALS)))
        # Installed after Lightning's own handlers (which raise at the next step, or save an
        # hpc checkpoint from inside the handler): the run finishes the step, saves, and ends
        # cleanly instead. Lightning's requeue is kept, to run once the save is committed.
        for signum in self._signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        previous = self._previous.get(self._requeue_signal or 0)
        self._requeue = _lightning_requeue(previous)
        if self._requeue_signal is not None and self._requeue is None and trainer.is_global_zero:
            log.warning(
                "SLURMEnvironment(auto_requeue=True), but Lightning's requeue handler is not "
                "installed for %s (another handler was there before fit, so Lightning installed "
                "none): a preempted run will save and stop without requeueing the job",
                signal.Signals(self._requeue_signal).name,
            )

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens on the training loop, at the end of the current step.
        self._received.add(signum)

    def poll(self) -> bool:
        """True at the one step where every rank learns that a rank was signalled, False before
        and after. Collective: every rank calls it at the same step."""
        import torch.distributed as dist

        if not self.installed or self.signum is not None:
            return False
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        flags = torch.tensor([int(s in self._received) for s in self._signals])
        if distributed and self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        agreed = [s for s, flag in zip(self._signals, flags.tolist(), strict=True) if flag]
        if agreed:
            self.signum = agreed[0]
        return bool(agreed)

    @property
    def name(self) -> str | None:
        """The agreed signal's name (``"SIGTERM"``...), or ``None``."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def requeue(self, trainer: pl.Trainer) -> None:
        """Requeue the SLURM job through Lightning, once: call after the preempted step is
        committed and the directory's lock released (the requeue ends the job). Every rank
        calls it; Lightning's handler runs ``scontrol requeue <job id>`` on rank 0 only."""
        handler, self._requeue = self._requeue, None
        signum = self.signum
        if handler is None or signum is None or signum != self._requeue_signal:
            return
        # Lightning's handler finalises the loggers (the requeue ends the job), saves
        # hpc_ckpt_<n>.ckpt with trainer.save_checkpoint, then finds the job id (array jobs
        # too) and runs scontrol on rank 0. Its save would be the step just committed, written
        # again through MegatronStrategy as a second, never committed step directory at the
        # worst moment, which a requeued fit(ckpt_path=None) would then load (Lightning prefers
        # hpc checkpoints on SLURM). So this one call runs with that save skipped (nothing else
        # runs meanwhile); the rest is Lightning's own code, not a copy of it.
        vars(trainer)["save_checkpoint"] = _skip_hpc_save
        try:
            handler(signum, None)
        finally:
            del vars(trainer)["save_checkpoint"]


def _requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal Lightning's SLURM auto-requeue listens to, when it is on."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    return None if environment.requeue_signal is None else int(environment.requeue_signal)


def _lightning_requeue(handler: Any) -> Callable[[int, Any], None] | None:
    """Lightning's SLURM requeue handler, if ``handler`` (what Lightning installed for the
    requeue signal, when auto-requeue is on and no other handler was there) holds it."""
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    lightnings = getattr(_SignalConnector, "_slurm_sigusr_handler_fn", None)
    for fn in getattr(handler, "signal_handlers", ()):  # Lightning's _HandlersCompose
        if lightnings is not None and getattr(fn, "__func__", None) is lightnings:
            return fn  # type: ignore[no-any-return]
    return None


def _skip_hpc_save(*args: Any, **kwargs: Any) -> None:
    log.debug("Lightning's hpc checkpoint skipped: the preempted step is committed")
