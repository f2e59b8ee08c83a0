"""A blocking wait for writes in another process that ends when that process has ended.

Megatron-Core's writer through NVIDIA's resiliency extension (``ckpt_writer="megatron"`` on a
GPU) writes each save in one persistent worker process per rank. Its blocking wait
(``maybe_finalize_async_calls(blocking=True)``) polls a queue for the worker's word that the
write is done, and never looks at the worker: a worker that died (killed for memory, a crash in
its CUDA IPC) leaves every rank waiting for ever. :func:`finish_writes` first waits on this rank
alone until its worker has reported the write or has ended without reporting it; then one
agreement tells every rank whether any rank's worker ended, and every rank gives up on the save
together, the failure naming the rank, the process and its exit code; otherwise the queue's own
blocking wait finalises the save (the worker has reported: it returns once the other ranks'
have). One collective more per blocking wait, the same at every save.

Closing the queue at teardown has the same hole: NVRx's close tells the worker to stop, then
waits for it to take that word (a queue ``join``) and to end, without a bound, and a worker that
died never takes it. :func:`close_writer` gives a live worker :data:`CLOSE_BOUND_S` to end once
told, and stops one that has not ended by then, or had ended already, as NVRx's abort does
(SIGTERM, then SIGKILL), with a warning naming the process.

Megatron-Core's built-in writer forks a process per save and reports one that died itself: its
wait is the queue's own. So is any queue whose worker this module cannot see (another NVRx
version): the wait is then what it was.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from lightning_mcore_ckpt.engine._collectives import first_failure
from lightning_mcore_ckpt.engine._shards import OtherRankFailed

__all__ = ["WriterProcessEnded", "close_writer", "ended_worker", "finish_writes"]

log = logging.getLogger(__name__)

POLL_S = 0.02
"""Seconds between two looks at this rank's worker (no collective; NVRx's own wait looks
every 0.1 s)."""

CLOSE_BOUND_S = 60.0
"""Seconds a persistent worker with nothing pending has to end once told to stop (it frees its
cache and exits: well under a second on an H200)."""


class WriterProcessEnded(RuntimeError):
    """This rank's background writer process ended before it finished the save."""


def _worker(queue: Any) -> Any:
    """``queue``'s persistent worker caller (its ``process``, ``comp_q`` and ``cur_item``), or
    ``None``: no persistent worker, nothing pending, or not one this module can see."""
    if not getattr(queue, "persistent", False) or not queue.get_num_unfinalized_calls():
        return None
    caller = getattr(queue, "persistent_caller", None)
    if getattr(caller, "process", None) is None or not hasattr(caller, "comp_q"):
        return None
    return caller


def _reported(caller: Any) -> bool:
    """Whether the worker has reported a finished write (read by the queue, or waiting in its
    completion queue: a worker that reported and then ended is no failure)."""
    return getattr(caller, "cur_item", None) is not None or not caller.comp_q.empty()


def ended_worker(queue: Any) -> str | None:
    """This rank's persistent writer process, described, when it has ended with a write
    pending that it never reported; ``None`` otherwise."""
    caller = _worker(queue)
    if caller is None or caller.process.exitcode is None or _reported(caller):
        return None
    return (
        f"the background writer process (pid {caller.process.pid}) ended with exit code "
        f"{caller.process.exitcode} before it finished the save"
    )


def finish_writes(queue: Any, rank: int, device: torch.device) -> list[int]:
    """Collective: ``queue.maybe_finalize_async_calls(blocking=True)``, bounded by the workers.

    Returns the ids of the calls finalised. Raises :class:`WriterProcessEnded` on a rank whose
    worker ended without reporting its write, and :class:`OtherRankFailed` on every other rank.
    """
    caller = _worker(queue)
    ended = None
    while caller is not None and not _reported(caller):
        ended = ended_worker(queue)
        if ended is not None:
            break
        time.sleep(POLL_S)
    found = first_failure(ended, rank, device)
    if found is not None:
        failed_rank, why = found
        if failed_rank == rank:
            raise WriterProcessEnded(why)
        raise OtherRankFailed(f"rank {failed_rank}: {why}")
    finalized: list[int] = queue.maybe_finalize_async_calls(blocking=True)
    return finalized


def close_writer(queue: Any, bound_s: float = CLOSE_BOUND_S) -> None:
    """Local: ``queue.close()``, bounded by its persistent worker (see the module docstring).

    With nothing pending, a live worker is told to stop and has ``bound_s`` to end; one that
    ended as told leaves NVRx's close nothing to wait for. One that had ended already, did not
    end in time or ended with an error is stopped by NVRx's abort, and a warning names it. A
    queue with saves pending, or without a worker this module can see, closes as it would.
    """
    caller: Any = getattr(queue, "persistent_caller", None)
    process = getattr(caller, "process", None)
    if (
        not getattr(queue, "persistent", False)
        or process is None
        or not hasattr(caller, "queue")
        or queue.get_num_unfinalized_calls()
    ):
        queue.close()
        return
    alive = process.is_alive()
    if alive:
        caller.queue.put("DONE")  # NVRx's word to its worker to stop
        process.join(bound_s)
    if process.exitcode == 0:
        caller.process = None  # ended as told: nothing left for NVRx's close to wait on
        queue.close()
        return
    if process.exitcode is None:
        why = f"did not end within {bound_s:g} s of being told to stop"
    elif alive:
        why = f"ended with exit code {process.exitcode} when told to stop"
    else:
        why = f"had ended with exit code {process.exitcode} before the writer was closed"
    log.warning(
        "the background checkpoint writer process (pid %s) %s: stopping it (every save it "
        "held was finalised before)",
        process.pid,
        why,
    )
    queue.close(abort=True)
