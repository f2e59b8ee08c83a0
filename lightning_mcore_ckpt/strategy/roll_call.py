"""After a failure, which nodes stopped answering: the roll call that names a silent node.

A node that dies silently (a power loss, a kernel panic, a partition: its sockets stay open) ends
every other rank with the process group's timeout (``MegatronStrategy(timeout=...)``) or, for a
rank waiting in the same collective as one that timed out first, with gloo's "Connection closed
by peer" naming a *survivor*. Neither names the node that went quiet. So every rank that leaves
``fit`` with an error answers a roll call in the job's rendezvous store (the store every launcher
creates: ``torchrun``'s, Lightning's), and a rank whose error is a peer's silence waits a bounded
:data:`ROLL_CALL_S` for the others' answers, then adds a note to its error naming the nodes (with
their host names, recorded at setup) none of whose ranks answered. When the store itself does not
answer (it lives on global rank 0's node), the note says so: then that node is the silent one.
The first rank whose wait runs out closes the roll call in the store: a rank that answers later
(its error came from another collective's timeout) reads the answers at once instead of waiting
again. Global rank 0, whose process serves the store, returns only once every rank of every node
that answered has answered and finished reading it, bounded by ``linger_s`` (the process
group's timeout: every survivor's wait for the silent node ends within it): its exit would
otherwise close the store under a later rank's feet and read to it as a silent node 0.

No collective: a store key per node written at setup, an answer and a count per rank at the
failure, each call bounded (a daemon thread joined with a timeout: a TCPStore client's calls
ignore the store's timeout while its server is stopped). A job whose ranks all
answer (an ordinary error on one rank, the others then waiting on it) ends without waiting out
the bound.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ROLL_CALL_S", "STORE_S", "answer", "is_peer_silence", "register_host"]

ROLL_CALL_S = 15.0
"""How long a rank whose error is a peer's silence waits for the other ranks' answers (they end
within moments of each other: the same timeout, or the closure by the first one), so that a
silent node ends the job within ``MegatronStrategy(timeout=...)`` plus this and
:data:`STORE_S`."""
STORE_S = 5.0
"""How long a call to the store may take beyond the wait (it answers in milliseconds when up)."""
_PREFIX = "lightning_mcore_ckpt/roll_call"
_POLL_S = 0.2

_SILENCE = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
)


def is_peer_silence(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from) is a wait for a peer that ended: a
    collective's or a store's timeout, or a peer's connection closed."""
    seen: BaseException | None = exception
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return True
        text = str(seen).lower()
        if any(s in text for s in _SILENCE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def register_host(store: Any, node: int) -> None:
    """At setup, on each node's first rank: record the node's host name for a later roll call."""
    store.set(f"{_PREFIX}/host/{node}", socket.gethostname())


def answer(
    store: Any,
    *,
    generation: int,
    rank: int,
    world_size: int,
    ranks_per_node: int,
    wait: bool,
    wait_s: float = ROLL_CALL_S,
    linger_s: float | None = None,
) -> str | None:
    """Answer the roll call ``generation`` (one per failure of the job) as ``rank``; with
    ``wait``, wait up to ``wait_s`` for every rank's answer (less once another rank's wait has
    run out) and return what to tell the user: the nodes none of whose ranks answered, or that
    the store did not answer (``None``: every rank answered). Never raises, and returns within
    ``wait_s`` (``0`` without ``wait``) plus :data:`STORE_S`, and on global rank 0 ``linger_s``
    and :data:`STORE_S` more at most (``linger_s`` defaults to ``wait_s``): a roll call adds to
    an error, it does not replace it.

    The store's calls run in a daemon thread joined with that bound: a TCPStore client's
    ``add`` and ``check`` wait for a stopped server without end, whatever its timeout."""
    found: list[str | None] = []
    linger_s = wait_s if linger_s is None else linger_s
    call = functools.partial(
        _answer, store, generation, rank, world_size, ranks_per_node, wait, wait_s, linger_s
    )
    worker = threading.Thread(target=lambda: found.append(call()), name="roll-call", daemon=True)
    worker.start()
    # Global rank 0 may also wait for the others to finish (its process serves the store).
    worker.join((wait_s if wait else 0.0) + STORE_S + (linger_s + STORE_S if rank == 0 else 0.0))
    if not found:
        return _store_silent(f"no reply within {wait_s + STORE_S:.0f} s") if wait else None
    return found[0]


def _answer(
    store: Any,
    generation: int,
    rank: int,
    world_size: int,
    ranks_per_node: int,
    wait: bool,
    wait_s: float,
    linger_s: float,
) -> str | None:
    key = f"{_PREFIX}/{generation}"
    nodes = world_size // ranks_per_node
    finding: str | None = None
    try:
        store.add(f"{key}/node/{rank // ranks_per_node}", 1)
        answered = store.add(f"{key}/count", 1)
        if wait:
            answered = _wait_for_answers(store, key, answered, world_size, wait_s)
            if answered < world_size:
                quiet = [n for n in range(nodes) if not store.check([f"{key}/node/{n}"])]
                hosts = [_host(store, n) for n in quiet]
                finding = _silent_nodes(quiet, hosts, answered, world_size, wait_s)
        done = store.add(f"{key}/done", 1)
        if rank == 0:  # the store lives in this process: it stays until the others are done
            deadline = time.monotonic() + linger_s + STORE_S
            while done < _expected(store, key, nodes, ranks_per_node, wait) and (
                time.monotonic() < deadline
            ):
                time.sleep(_POLL_S)
                done = store.add(f"{key}/done", 0)
    except Exception as err:  # noqa: BLE001 - the store's own failure is the finding
        return _store_silent(f"{type(err).__name__}: {err}") if wait else None
    return finding


def _wait_for_answers(store: Any, key: str, answered: int, world_size: int, wait_s: float) -> int:
    """Wait up to ``wait_s`` for ``world_size`` answers, or until another rank's wait has run
    out (the roll call is closed: its answers are all that will come in time); a wait that runs
    out closes it. Returns the count of answers."""
    closed = f"{key}/closed"
    deadline = time.monotonic() + wait_s
    while answered < world_size and not store.check([closed]):
        if time.monotonic() >= deadline:
            store.set(closed, b"1")
            break
        time.sleep(_POLL_S)
        answered = store.add(f"{key}/count", 0)
    return int(store.add(f"{key}/count", 0))


def _expected(store: Any, key: str, nodes: int, ranks_per_node: int, silence: bool) -> int:
    """The ranks global rank 0 keeps the store up for: those that answered and, after a peer's
    ``silence``, every rank of each node where a rank answered (that node is up: its other
    ranks are coming, perhaps from a later timeout, and the store's closing would read to them
    as a silent node 0)."""
    answered = store.add(f"{key}/count", 0)
    if not silence:
        return answered
    answering = sum(1 for n in range(nodes) if store.check([f"{key}/node/{n}"]))
    return max(answering * ranks_per_node, answered)


def _host(store: Any, node: int) -> str:
    name = f"{_PREFIX}/host/{node}"
    return store.get(name).decode() if store.check([name]) else "?"


def _silent_nodes(
    quiet: Sequence[int], hosts: Sequence[str], answered: int, world_size: int, wait_s: float
) -> str:
    if not quiet:
        return (
            f"{world_size - answered} of {world_size} ranks did not answer the roll call within "
            f"{wait_s:.0f} s, on nodes where other ranks did (a rank stopped or still waiting)"
        )
    named = ", ".join(f"node {n} ({h})" for n, h in zip(quiet, hosts, strict=True))
    return (
        f"no rank of {named} answered the roll call within {wait_s:.0f} s after this error: that "
        "node stopped answering (lost, hung or partitioned); the other ranks answered"
    )


def _store_silent(why: str) -> str:
    where = os.environ.get("MASTER_ADDR", "?")
    return (
        f"the job's rendezvous store (at {where}, on global rank 0's node: node 0) did not "
        f"answer the roll call after this error ({why}): node 0 stopped answering (lost, hung "
        "or partitioned)"
    )
