"""The roll call that names a silent node (``strategy/roll_call.py``), against a real TCPStore on
loopback (the store a launcher creates), its ranks played by threads.

Axes: who answers (every rank; every rank but one whole node's; every rank but one rank of a
node that otherwise answered) x whether the store answers (served; its server process stopped
with SIGSTOP, its socket open) x which exceptions count as a peer's silence. Each finding is
checked for what it names, and each wait for its bound.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from lightning_mcore_ckpt.strategy import roll_call

WORLD, PER_NODE = 4, 2
WAIT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def store() -> Iterator[TCPStore]:
    server = TCPStore("127.0.0.1", _free_port(), is_master=True, timeout=timedelta(seconds=10))
    yield server


def _client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def _roll_call(
    server: TCPStore, answering: list[int], generation: int = 1
) -> dict[int, str | None]:
    """Each answering rank in its own thread and store client, all waiting (a peer's silence)."""
    for node in range(WORLD // PER_NODE):
        roll_call.register_host(_client(server), node)
    found: dict[int, str | None] = {}

    def one(rank: int) -> None:
        found[rank] = roll_call.answer(
            _client(server),
            generation=generation,
            rank=rank,
            world_size=WORLD,
            ranks_per_node=PER_NODE,
            wait=True,
            wait_s=WAIT_S,
        )

    threads = [threading.Thread(target=one, args=(r,)) for r in answering]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return found


def test_every_rank_answering_finds_nothing_and_ends_at_once(store: TCPStore) -> None:
    started = time.monotonic()
    found = _roll_call(store, list(range(WORLD)))
    assert found == dict.fromkeys(range(WORLD))
    assert time.monotonic() - started < WAIT_S  # nobody waited out the bound


def test_a_silent_node_is_named_with_its_host_by_every_other_rank(store: TCPStore) -> None:
    started = time.monotonic()
    found = _roll_call(store, [0, 1])  # node 1 (ranks 2 and 3) silent
    assert time.monotonic() - started < WAIT_S + 5
    host = socket.gethostname()
    for rank in (0, 1):
        assert f"no rank of node 1 ({host}) answered" in (found[rank] or ""), found
        assert "node 0" not in (found[rank] or "")


def test_one_quiet_rank_of_an_answering_node_is_counted_not_blamed_on_the_node(
    store: TCPStore,
) -> None:
    found = _roll_call(store, [0, 1, 2])
    assert all("1 of 4 ranks did not answer" in (f or "") for f in found.values()), found


def test_each_failure_of_a_job_has_its_own_roll_call(store: TCPStore) -> None:
    assert _roll_call(store, list(range(WORLD)), generation=1) == dict.fromkeys(range(WORLD))
    # A second failure, node 1 silent: the first roll call's answers do not count for it.
    found = _roll_call(store, [0, 1], generation=2)
    assert all("node 1" in (f or "") for f in found.values()), found


def test_a_rank_that_does_not_wait_only_answers(store: TCPStore) -> None:
    started = time.monotonic()
    assert (
        roll_call.answer(
            _client(store),
            generation=1,
            rank=0,
            world_size=WORLD,
            ranks_per_node=PER_NODE,
            wait=False,
        )
        is None
    )
    assert time.monotonic() - started < 1
    assert store.add(f"{roll_call._PREFIX}/1/count", 0) == 1


def test_a_silent_store_is_named_within_the_bound() -> None:
    port = _free_port()
    serve = (
        "import time; from datetime import timedelta; from torch.distributed import TCPStore; "
        f"s = TCPStore('127.0.0.1', {port}, is_master=True, timeout=timedelta(seconds=60)); "
        "print('up', flush=True); time.sleep(120)"
    )
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"up\n"
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        os.kill(server.pid, signal.SIGSTOP)  # its socket stays open: nothing answers
        started = time.monotonic()
        found = roll_call.answer(
            client,
            generation=1,
            rank=2,
            world_size=WORLD,
            ranks_per_node=PER_NODE,
            wait=True,
            wait_s=WAIT_S,
        )
        assert time.monotonic() - started < WAIT_S + roll_call.STORE_S + 2
        assert found is not None and "rendezvous store" in found and "node 0" in found, found
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.parametrize(
    ("error", "silence"),
    [
        (RuntimeError("[gloo] Timed out waiting 30000ms for recv operation to complete"), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:4321"), True),
        (TimeoutError("the nodes of ranks [2] did not confirm their parts"), True),
        (ValueError("loss is NaN"), False),
        (KeyboardInterrupt(), False),
    ],
)
def test_which_errors_are_a_peers_silence(error: BaseException, silence: bool) -> None:
    assert roll_call.is_peer_silence(error) is silence
    try:
        try:
            raise error
        except BaseException as inner:
            raise RuntimeError("the save failed") from inner
    except RuntimeError as outer:
        assert roll_call.is_peer_silence(outer) is silence  # found through the cause


LINGER_S = 2 * WAIT_S + roll_call.STORE_S + 2.0
"""Rank 0's ``linger_s`` here (the strategy passes its process group's timeout): longer than its
wait and the store's bound put together, which was all rank 0 stayed for before."""


@pytest.mark.parametrize(
    "delay",
    [1.0, WAIT_S + 1.0, 2 * WAIT_S + roll_call.STORE_S],
    ids=["a moment later", "after rank 0's whole wait", "after rank 0's wait and more"],
)
def test_global_rank_0_whose_process_serves_the_store_stays_until_the_others_are_done(
    store: TCPStore, delay: float
) -> None:
    """Rank 0 answers first and would exit, closing the store, while rank 1 (its error a moment
    later, or later than rank 0's whole wait: another collective's timeout) still reads it, or
    has not come yet: rank 1 would then blame node 0. Rank 0 waits for every rank of a node
    that answered, up to ``linger_s``; a rank coming after rank 0's wait ran out reads the
    closed roll call at once instead of waiting for node 1 again."""
    roll_call.register_host(_client(store), 1)
    ended: dict[int, float] = {}
    last_use: dict[int, float] = {}

    class Timed:
        """A rank's store client that notes when each of its calls returned."""

        def __init__(self, rank: int) -> None:
            self.rank, self.client = rank, _client(store)

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.client, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                result = method(*args, **kwargs)
                last_use[self.rank] = time.monotonic()
                return result

            return call

    found: dict[int, str | None] = {}

    came: dict[int, float] = {}

    def one(rank: int, delay: float) -> None:
        time.sleep(delay)
        came[rank] = time.monotonic()
        found[rank] = roll_call.answer(
            Timed(rank),
            generation=1,
            rank=rank,
            world_size=WORLD,
            ranks_per_node=PER_NODE,
            wait=True,
            wait_s=WAIT_S,
            linger_s=LINGER_S,
        )
        ended[rank] = time.monotonic()

    threads = [
        threading.Thread(target=one, args=(0, 0.0)),
        threading.Thread(target=one, args=(1, delay)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # Node 1 (ranks 2, 3) silent: both waited; rank 0 returned only once rank 1's last call to
    # the store (its "done") had returned: rank 1 was done with the store rank 0 serves.
    assert ended[0] >= last_use[1], (ended, last_use)
    assert "node 1" in (found[1] or "") and "store" not in (found[1] or ""), found
    assert "node 1" in (found[0] or ""), found
    if delay > WAIT_S:  # rank 0's wait had run out: rank 1 did not wait for node 1 again
        assert ended[1] - came[1] < WAIT_S / 2, (came, ended)
    assert ended[0] - came[0] < WAIT_S + LINGER_S + 2 * roll_call.STORE_S
