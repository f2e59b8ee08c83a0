"""Preemption: SIGTERM / SIGUSR1 (what SLURM and other schedulers send) as a flag every rank
agrees on, so that the run saves the step it is on and ends cleanly."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch

__all__ = ["PREEMPTION_SIGNALS", "Preemption"]

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Catches the preemption signals while installed; :meth:`requested` is collective.

    Install on every rank at the start of training (the main thread only: Python delivers
    signals there), uninstall when training ends.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Collective when distributed (a CPU group for the flag may be created)."""
        if threading.current_thread() is not threading.main_thread():
            return
        import torch.distributed as dist

        self.signum = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The flag travels over a CPU (gloo) group: an all-reduce on the GPU would
            # synchronise the device at every step. The default group when it is gloo.
            cpu = dist.get_backend() == "gloo"
            self._group = dist.group.WORLD if cpu else dist.new_group(backend="gloo")
        # Installed after Lightning's own handlers (which raise at the next step): the run
        # finishes the step, saves, and ends cleanly instead.
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens on the training loop, at the end of the current step.
        self.signum = signum

    def requested(self) -> bool:
        """Whether any rank was signalled. Collective: every rank calls it at the same step."""
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed or self._group is None:
            return self.signum is not None
        flag = torch.tensor([0 if self.signum is None else self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        signum = int(flag.item())
        if signum and self.signum is None:
            self.signum = signum
        return bool(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name
