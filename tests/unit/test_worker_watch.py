"""The blocking wait for writes in a worker process ends when the worker has ended, and so
does closing the writer.

Pure logic against a stand-in for NVRx's ``AsyncCallsQueue`` and its persistent caller (the
members the wait and the close read; the close as NVRx's: told to stop, the worker is waited
on without a bound); the worker is a real process and its queues real ``multiprocessing``
queues. NVRx's own worker is killed in the GPU tier
(``tests/gpu/test_nvrx_writer.py``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.engine import _worker_watch
from lightning_mcore_ckpt.engine._worker_watch import (
    WriterProcessEnded,
    close_writer,
    ended_worker,
    finish_writes,
)

CONTEXT = multiprocessing.get_context("fork")
pytestmark = pytest.mark.timeout(60)  # a wait that does not end fails here, not at 300 s


def _exit_with(code: int) -> None:
    os._exit(code)


def _report_and_exit(comp_q: Any) -> None:
    comp_q.put(0)
    comp_q.close()
    comp_q.join_thread()
    os._exit(0)


class _Caller:
    def __init__(self, process: Any, comp_q: Any) -> None:
        self.process = process
        self.comp_q = comp_q
        self.cur_item = None


class _Queue:
    """One pending call, finalised by the blocking wait once the worker reported it."""

    def __init__(self, process: Any, comp_q: Any, persistent: bool = True) -> None:
        self.persistent = persistent
        self.persistent_caller = _Caller(process, comp_q)
        self.pending = [0]
        self.blocking_waits = 0

    def maybe_finalize_async_calls(self, blocking: bool = False) -> list[int]:
        assert blocking
        self.blocking_waits += 1
        done, self.pending = self.pending, []
        return done

    def get_num_unfinalized_calls(self) -> int:
        return len(self.pending)


@pytest.fixture(autouse=True)
def _fast_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_worker_watch, "POLL_S", 0.001)


def _ended(target: Any, *args: Any) -> Any:
    process = CONTEXT.Process(target=target, args=args)
    process.start()
    process.join(30)
    assert process.exitcode is not None
    return process


def test_a_worker_that_ended_without_reporting_is_named_with_its_exit_code() -> None:
    comp_q = CONTEXT.Queue()
    process = _ended(_exit_with, 3)
    assert ended_worker(_Queue(process, comp_q)) == (
        f"the background writer process (pid {process.pid}) ended with exit code 3 "
        "before it finished the save"
    )
    # A worker per save (Megatron-Core's built-in writer), nothing pending, no worker yet.
    assert ended_worker(_Queue(process, comp_q, persistent=False)) is None
    none_pending = _Queue(process, comp_q)
    none_pending.pending = []
    assert ended_worker(none_pending) is None
    assert ended_worker(_Queue(None, comp_q)) is None


def test_the_wait_fails_when_the_worker_ended_without_reporting() -> None:
    queue = _Queue(_ended(_exit_with, 7), CONTEXT.Queue())
    with pytest.raises(WriterProcessEnded, match="ended with exit code 7"):
        finish_writes(queue, 0, torch.device("cpu"))
    assert queue.blocking_waits == 0  # never handed to a wait that would not end


def test_a_worker_that_reported_and_then_ended_is_no_failure() -> None:
    comp_q = CONTEXT.Queue()
    queue = _Queue(_ended(_report_and_exit, comp_q), comp_q)
    assert finish_writes(queue, 0, torch.device("cpu")) == [0]


def test_the_wait_goes_on_while_the_worker_lives_and_finalises_once_it_reported() -> None:
    comp_q = CONTEXT.Queue()
    gate = CONTEXT.Event()
    process = CONTEXT.Process(target=gate.wait, args=(30,))
    process.start()
    try:
        queue = _Queue(process, comp_q)
        threading.Timer(0.2, comp_q.put, args=(0,)).start()  # the write reported later
        assert finish_writes(queue, 0, torch.device("cpu")) == [0]
        assert queue.blocking_waits == 1
        assert process.is_alive()
    finally:
        gate.set()
        process.join(30)


# --- closing the writer --------------------------------------------------------------------


def _stops_when_told(requests: Any) -> None:
    assert requests.get() == "DONE"
    requests.task_done()
    os._exit(0)


def _never_takes_the_word(requests: Any) -> None:
    time.sleep(60)


class _ClosingCaller(_Caller):
    def __init__(self, process: Any, requests: Any) -> None:
        super().__init__(process, CONTEXT.Queue())
        self.queue = requests


class _ClosingQueue(_Queue):
    """NVRx's close: with ``abort``, SIGTERM and a join; without, the word to stop, then a
    ``join`` of its requests and of the worker, neither bounded."""

    def __init__(self, target: Any, *args: Any, pending: bool = False) -> None:
        requests = CONTEXT.JoinableQueue()
        if target is _exit_with:
            process = _ended(target, *args)
        else:
            process = CONTEXT.Process(target=target, args=(requests,))
            process.start()
        self.persistent = True
        self.persistent_caller = _ClosingCaller(process, requests)
        self.pending = [0] if pending else []
        self.blocking_waits = 0
        self.process = process
        self.closed: list[tuple[bool, bool]] = []  # (abort, the caller still had its worker)

    def close(self, abort: bool = False) -> None:
        caller = self.persistent_caller
        self.closed.append((abort, caller.process is not None))
        if caller.process is not None:
            if abort:
                caller.process.terminate()
            else:
                caller.queue.put("DONE")
                caller.queue.join()
            caller.process.join()
            caller.process = None


def test_a_worker_that_ends_when_told_is_closed_as_nvrx_closes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = _ClosingQueue(_stops_when_told)
    with caplog.at_level(logging.WARNING):
        close_writer(queue, bound_s=30)
    assert queue.closed == [(False, False)]  # told once, by us: nothing left to wait on
    assert queue.process.exitcode == 0
    assert not caplog.records


def test_a_worker_that_does_not_end_when_told_is_stopped_after_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = _ClosingQueue(_never_takes_the_word)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        close_writer(queue, bound_s=0.5)
    assert time.monotonic() - start < 20  # NVRx's own close would wait here for ever
    assert queue.closed == [(True, True)]
    assert queue.process.exitcode is not None and not queue.process.is_alive()
    assert f"(pid {queue.process.pid}) did not end within 0.5 s" in caplog.text


def test_a_worker_that_had_died_is_stopped_not_waited_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = _ClosingQueue(_exit_with, 5)
    with caplog.at_level(logging.WARNING):
        close_writer(queue, bound_s=30)
    assert queue.closed == [(True, True)]
    assert "had ended with exit code 5 before the writer was closed" in caplog.text


def test_a_queue_with_a_save_pending_closes_as_it_would() -> None:
    queue = _ClosingQueue(_stops_when_told, pending=True)
    close_writer(queue, bound_s=30)
    assert queue.closed == [(False, True)]  # NVRx's own close finalises and stops it
    assert queue.process.exitcode == 0
