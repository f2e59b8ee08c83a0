"""The preemption handlers on one process: which signals they catch, what they report, and when
Lightning's SLURM requeue is not there to run (the distributed behaviour is in
faults/test_preemption.py)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_mcore_ckpt import MegatronCheckpoint
from lightning_mcore_ckpt.callback.preemption import Preemption


def _trainer(environment: Any) -> Any:
    return SimpleNamespace(
        strategy=SimpleNamespace(cluster_environment=environment), is_global_zero=True
    )


@pytest.fixture
def preemption() -> Iterator[Preemption]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    caught = Preemption()
    yield caught
    caught.uninstall()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_is_reported_once_by_name(preemption: Preemption, signum: int) -> None:
    preemption.install(_trainer(LightningEnvironment()))
    assert preemption.poll() is False and preemption.name is None
    os.kill(os.getpid(), signum)
    assert preemption.poll() is True  # the step that saves and stops
    assert preemption.poll() is False  # not again, also on a later step
    assert preemption.name == signal.Signals(signum).name
    assert preemption.requeues is False  # not under SLURM


def test_slurm_requeue_signal_is_caught_and_a_handler_before_fit_is_reported(
    preemption: Preemption, caplog: pytest.LogCaptureFixture
) -> None:
    # A handler of the user's: Lightning installs no requeue handler over it.
    signal.signal(signal.SIGUSR2, lambda *args: None)
    with caplog.at_level(logging.WARNING):
        preemption.install(_trainer(SLURMEnvironment(requeue_signal=signal.SIGUSR2)))
    assert "Lightning's requeue handler is not installed for SIGUSR2" in caplog.text
    os.kill(os.getpid(), signal.SIGUSR2)
    assert preemption.poll() is True and preemption.name == "SIGUSR2"
    assert preemption.requeues is False
    preemption.requeue(_trainer(None))  # nothing to run, nothing raised


def test_a_callback_that_was_not_preempted_exits_with_zero(tmp_path: Path) -> None:
    checkpoint = MegatronCheckpoint(tmp_path)
    assert checkpoint.preempted is False and checkpoint.preemption_signal is None
    assert checkpoint.exit_code == 0
    assert MegatronCheckpoint.PREEMPTED_EXIT_CODE == 128 + signal.SIGTERM == 143
