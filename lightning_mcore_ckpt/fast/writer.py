"""``FastWriter``: a rank's fast saves: staged, then written, sealed, copied and counted in the
background.

A save blocks training only while this rank's state is copied into host buffers (reused from
save to save: :class:`~lightning_mcore_ckpt.engine.StagingCache`). A background thread then:

1. writes ``state_<r>.pt`` and ``extra/rank_<r>.pt`` into the node's directory, hashed on the
   way, and seals them (``seal_<r>.json``);
2. sends them to this rank's peers (:meth:`NodeMap.peers`) and receives the files of the ranks
   it holds copies for, each checked against its sender's seal;
3. agrees with every rank on the outcome (over the fast tier's own process group): the step
   counts only when every rank's files are sealed on 1 + ``replicas`` nodes; then each node's
   first rank marks it complete and deletes the steps ``max_to_keep`` no longer keeps.

A failure anywhere (a disk full, a peer's directory not writable) leaves the step uncounted on
every node, is reported by :meth:`FastWriter.poll` on every rank, and training goes on. One save
is in flight at a time: the next one waits for it.

An unexpected error of one rank (a bug, not a disk's or a peer's failure) stops the fast saves of
every rank, and training goes on with the persistent tier: the rank still takes its part in the
step's copies (sending nothing) and says why in the agreement, so that no rank waits for it in a
later copy. A failure of the fast tier's process group itself (a peer lost) ends each rank's
wait within the group's timeout (``FastTier.timeout_s``, at most the strategy's ``timeout``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_mcore_ckpt.engine import (
    StagingCache,
    TrainingState,
    extra_payload,
    non_finite,
    stage_rank_state,
    write_payload,
)
from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.fast.config import FastTier
from lightning_mcore_ckpt.fast.peers import Bundle, NodeMap, exchange

__all__ = ["FastSave", "FastWriter"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastSave:
    """How one fast save went, the same on every rank: the slowest rank's times, every rank's
    bytes and errors."""

    step: int
    complete: bool
    blocking_time_s: float
    total_time_s: float
    write_time_s: float
    replication_time_s: float
    size_bytes: int
    """Every rank's files (the step's size on one node's worth of copies)."""
    copied_bytes: int
    """The copies of other ranks' files received and written, by every rank."""
    errors: tuple[str, ...] = ()

    def metrics(self) -> dict[str, float]:
        """The save's figures as logged (``checkpoint/fast_*``)."""
        return {
            "checkpoint/fast_blocking_time_s": self.blocking_time_s,
            "checkpoint/fast_total_time_s": self.total_time_s,
            "checkpoint/fast_write_time_s": self.write_time_s,
            "checkpoint/fast_replication_time_s": self.replication_time_s,
            "checkpoint/fast_size_bytes": float(self.size_bytes),
        }


class FastWriter:
    """This rank's fast saves (see the module). :meth:`save` is collective (every rank, the
    same steps in the same order); :meth:`poll`, :meth:`wait` and :meth:`close` are local."""

    def __init__(
        self, config: FastTier, nodes: NodeMap, rank: int, world_size: int, group: Any
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.root = config.root
        self.cache = StagingCache()
        self._future: Future[FastSave] | None = None
        self._finished: list[FastSave] = []
        self._broken: str | None = None
        self._fatal: str | None = None
        """This rank's unexpected error, told to every rank at the next agreement (then every
        rank's fast saves stop)."""

    # --- the training thread --------------------------------------------------------------

    def save(self, step: int, state: TrainingState, checkpoint: dict[str, Any]) -> None:
        """Stage this rank's state for fast step ``step`` and write it in the background.
        ``checkpoint``: Lightning's checkpoint dict of this step (its loops, callbacks...)."""
        started = time.perf_counter()  # waiting for the previous save is blocking too
        self.wait()
        if self._broken is not None:
            return
        if self.nodes.leader(self.rank):  # a step of that number left by an earlier attempt
            (files.step_dir(self.root, step) / files.COMPLETE).unlink(missing_ok=True)
        payload = stage_rank_state(state, self.cache)
        extra = extra_payload(checkpoint, state)
        layout = dict(state.parallel_layout)
        blocking = time.perf_counter() - started
        future: Future[FastSave] = Future()

        def run() -> None:
            try:
                future.set_result(self._write(step, payload, extra, layout, started, blocking))
            except Exception as err:  # the step fails, training goes on
                # Out of step with the other ranks' collectives: no more fast saves.
                self._broken = f"rank {self.rank}: fast step {step} failed unexpectedly: {err!r}"
                log.exception("%s; fast saves stop for this run", self._broken)
                future.set_result(FastSave(step, False, blocking, 0, 0, 0, 0, 0, (self._broken,)))

        # A daemon thread: a process that fails while its peers are gone is not kept alive by
        # a copy waiting for them (up to timeout_s).
        threading.Thread(target=run, name="lmc-fast-tier", daemon=True).start()
        self._future = future

    def wait(self) -> None:
        """Wait for the save in flight, if any (its outcome goes to :meth:`poll`)."""
        future, self._future = self._future, None
        if future is not None:
            self._finished.append(future.result())

    def poll(self) -> list[FastSave]:
        """The saves finished since the last call (without waiting)."""
        if self._future is not None and self._future.done():
            self.wait()
        finished, self._finished = self._finished, []
        return finished

    def close(self, wait: bool = True) -> None:
        """Wait for the save in flight (``wait=False``, after an error: leave it; it never
        counts unless every rank finishes it)."""
        if wait:
            self.wait()
        self._future = None

    # --- the background thread ------------------------------------------------------------

    def _write(
        self,
        step: int,
        payload: dict[str, Any],
        extra: dict[str, Any],
        layout: dict[str, int],
        started: float,
        blocking: float,
    ) -> FastSave:
        directory = files.step_dir(self.root, step)
        bad = non_finite(payload) if self.config.check_finite else []
        if bad:  # nothing written: the step cannot count on any node
            bundle, size = None, 0
            error: str | None = (
                f"rank {self.rank} ({socket.gethostname()}): non-finite values in "
                f"{', '.join(bad)} (FastTier(check_finite=True)): not saved"
            )
        else:
            bundle, size, error = self._write_own(directory, payload, extra, layout)
        written = time.perf_counter()
        try:
            copied, copy_error = self._copy(directory, bundle)
            replicated = time.perf_counter()
            mine = (
                error or copy_error,
                (
                    blocking,
                    replicated - started,
                    written - started - blocking,
                    replicated - written,
                ),
                (size, copied),
                self._fatal,
            )
            everyone = self._agree(mine)
        except Exception as err:  # noqa: BLE001 - the process group failed: no more fast saves
            self._broken = f"the fast tier's copies between nodes failed: {err}"
            log.error("%s; fast saves stop for this run (the persistent tier goes on)", err)
            return FastSave(step, False, blocking, 0.0, 0.0, 0.0, size, 0, (self._broken,))
        errors = [e for e, *_ in everyone if e is not None]
        fatal = [f for *_, f in everyone if f is not None]
        if fatal:  # on every rank at once: no rank waits for another in a later copy
            self._broken = f"fast saves stopped on every rank: {fatal[0]}"
            log.error("%s (the persistent tier goes on)", self._broken)
        if not errors and self.nodes.leader(self.rank):
            self._mark(directory, step)
        # The slowest rank's times (the step is saved when the last rank is done); the bytes of
        # every rank.
        blocked, total, write, copy = (
            max(t) for t in zip(*(t for _, t, *_ in everyone), strict=True)
        )
        size, copied = (sum(b) for b in zip(*(b for _, _, b, *_ in everyone), strict=True))
        return FastSave(step, not errors, blocked, total, write, copy, size, copied, tuple(errors))

    def _write_own(
        self,
        directory: Path,
        payload: dict[str, Any],
        extra: dict[str, Any],
        layout: dict[str, int],
    ) -> tuple[Bundle | None, int, str | None]:
        if self._fatal is not None:  # not told yet: nothing written, the others hear why
            return None, 0, self._fatal
        try:
            state_name, extra_name = files.files_of(self.rank)
            (directory / extra_name).parent.mkdir(parents=True, exist_ok=True)
            (directory / files.seal_name(self.rank)).unlink(missing_ok=True)
            written = {
                state_name: write_payload(directory / state_name, payload),
                extra_name: write_payload(directory / extra_name, extra),
            }
            files.write_seal(directory, self.rank, self.world_size, written, layout)
            bundle = Bundle.read(directory, self.rank) if self.config.replicas else None
            return bundle, sum(size for size, _ in written.values()), None
        except (OSError, ValueError, RuntimeError) as err:
            return None, 0, f"rank {self.rank} ({socket.gethostname()}): writing {directory}: {err}"
        except Exception as err:  # noqa: BLE001 - told to every rank, which all stop
            return None, 0, self._unexpected(f"writing {directory}", err)

    def _unexpected(self, doing: str, err: Exception) -> str:
        """Keep ``err`` as this rank's unexpected error (every rank's fast saves stop once it is
        agreed on); what the step's outcome says of it."""
        self._fatal = f"rank {self.rank} ({socket.gethostname()}): {doing}: {err!r}"
        log.error("fast tier: unexpected error, %s", self._fatal, exc_info=err)
        return self._fatal

    def _copy(self, directory: Path, bundle: Bundle | None) -> tuple[int, str | None]:
        """Send this rank's files to its peers; keep the copies sent to it."""
        replicas = self.config.replicas
        if not replicas:
            return 0, None
        outgoing = [(peer, bundle) for peer in self.nodes.peers(self.rank, replicas)]
        received = exchange(self.group, outgoing, self.nodes.sources(self.rank, replicas))
        copied, error = 0, None
        for source, copy in received.items():
            if copy is None:
                error = error or f"rank {source} had no files to copy to rank {self.rank}"
                continue
            try:
                copied += copy.write(directory, source)
            except (OSError, ValueError) as err:
                error = error or (
                    f"rank {self.rank} ({socket.gethostname()}): keeping rank {source}'s copy "
                    f"in {directory}: {err}"
                )
            except Exception as err:  # noqa: BLE001 - told to every rank, which all stop
                error = error or self._unexpected(f"keeping rank {source}'s copy", err)
        return copied, error

    def _agree(self, mine: Any) -> list[Any]:
        """Every rank's outcome (its error, its times, its bytes), on every rank."""
        if self.world_size == 1:
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def _mark(self, directory: Path, step: int) -> None:
        """Mark the step complete on this node and prune; a failure here is said, not raised
        (every rank has counted the step; the other nodes' marks stand for it)."""
        try:
            files.mark_complete(directory, {"step": step, "world_size": self.world_size})
            self._prune()
        except OSError as err:
            log.warning("fast step %d: marking or pruning %s failed: %s", step, self.root, err)
        except Exception as err:  # noqa: BLE001 - told at the next save, when every rank stops
            self._unexpected(f"marking fast step {step} complete", err)

    def _prune(self) -> None:
        """Keep the newest ``max_to_keep`` complete steps on this node, and nothing older."""
        complete = [
            s for s in files.steps(self.root) if files.is_complete(files.step_dir(self.root, s))
        ]
        kept = complete[-self.config.max_to_keep :]
        for step in files.steps(self.root):
            if kept and step < kept[0]:
                files.remove_step(files.step_dir(self.root, step))
