"""run_nodes: simulated nodes on one machine, each with its own directory at the same path, its
own TMPDIR and host name, torchrun's environment in every rank; a node killed whole; every
rank's outcome; nothing hangs.

The ranks here do no training (plain processes, files and signals), so that the harness itself
is what is tested; the Trainers on simulated nodes are in test_shared_filesystem.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.launch import nodes as _nodes
from lightning_mcore_ckpt.testing import (
    DistributedFailure,
    kill_node,
    node_storage,
    run_nodes,
    stop_node,
)

pytestmark = pytest.mark.timeout(300)

TORCHRUN = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)


def _wait_for(shared: Path, count: int, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while len(list(shared.glob("ready-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} ranks did not all get ready in {shared}")
        time.sleep(0.05)


def _where_am_i(rank: int, world_size: int, node_dir: str, shared: str) -> dict[str, Any]:
    """Write a file into the node's directory, wait until every rank has, then say what this
    rank sees."""
    Path(node_dir, f"rank{rank}").write_text(str(rank))
    fd, scratch = tempfile.mkstemp(prefix=f"scratch{rank}-")
    os.close(fd)
    Path(shared, f"ready-{rank}").touch()
    _wait_for(Path(shared), world_size)
    return {
        "host": socket.gethostname(),
        "env": {name: os.environ.get(name) for name in TORCHRUN},
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
        "sees": sorted(p.name for p in Path(node_dir).iterdir()),
        "tmpdir": os.environ["TMPDIR"],
        "scratch": scratch,
    }


def test_every_node_sees_only_its_own_directory_at_the_same_path(
    tmp_path: Path, node_dir: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    seen = run_nodes(_where_am_i, 2, 2, str(node_dir), str(shared), node_dir=node_dir, timeout=120)
    for rank, s in enumerate(seen):
        node, local = divmod(rank, 2)
        mine = [f"rank{2 * node}", f"rank{2 * node + 1}", "tmp"]
        # The ranks of a node share its directory; the other node's files are not there.
        assert s["sees"] == mine, rank
        assert s["host"] == f"node{node}"
        expected = [str(rank), str(local), "4", "2", str(node), str(node), "2", "none"]
        assert s["env"] == dict(zip(TORCHRUN, expected, strict=True))
        assert s["master"][0] == "127.0.0.1"
        # TMPDIR is the node's own: what tempfile makes there lands on that node's disk.
        assert s["tmpdir"] == str(node_dir / "tmp")
        assert Path(s["scratch"]).parent == node_dir / "tmp"
        assert (node_storage(node_dir, node) / "tmp" / Path(s["scratch"]).name).exists()
    assert len({s["master"] for s in seen}) == 1  # one rendezvous for the job
    for node in range(2):
        held = sorted(p.name for p in node_storage(node_dir, node).iterdir())
        assert held == [f"rank{2 * node}", f"rank{2 * node + 1}", "tmp"]
    # The machine itself saw none of it: no mount left, its host name unchanged.
    assert list(node_dir.iterdir()) == []
    assert socket.gethostname() not in ("node0", "node1")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, only not yet waited for


def _hold_until_node_1_is_killed(rank: int, world_size: int, shared: str) -> str:
    """Ranks of node 1 start a child process and wait; rank 0 kills node 1 once every rank is
    ready, sees every process of node 1 gone (in the job, before run_nodes cleans up), and
    tells the other ranks."""
    here = Path(shared)
    if rank in (2, 3):
        child = subprocess.Popen(["sleep", "600"])
        Path(shared, f"pids-{rank}").write_text(f"{os.getpid()} {os.getppid()} {child.pid}")
    Path(shared, f"ready-{rank}").touch()
    _wait_for(here, world_size)
    if rank == 0:
        kill_node(1)
        pids = [int(p) for r in (2, 3) for p in (here / f"pids-{r}").read_text().split()]
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        (here / "killed").touch()
        return "killer" if not any(_alive(p) for p in pids) else f"alive: {pids}"
    if rank in (2, 3):
        time.sleep(600)  # killed before
    while not (here / "killed").exists():
        time.sleep(0.05)
    return "survivor"


def test_kill_node_kills_exactly_that_node_with_all_it_started(tmp_path: Path) -> None:
    """Three nodes of two ranks, without node_dir (one host, shared paths): rank 0 kills node
    1; its launcher, its ranks and the processes they started die at once, nodes 0 and 2
    finish."""
    started = time.monotonic()
    outcomes = run_nodes(
        _hold_until_node_1_is_killed, 3, 2, str(tmp_path), timeout=120, outcomes=True
    )
    assert [o.rank for o in outcomes] == list(range(6))
    assert [o.node for o in outcomes] == [0, 0, 1, 1, 2, 2]
    assert [o.value for o in outcomes] == ["killer", "survivor", None, None, "survivor", "survivor"]
    for o in outcomes:
        assert o.ended is not None and started < o.ended < time.monotonic()
        assert not o.timed_out
        if o.node == 1:
            assert o.killed and o.exit_code is None, o
            assert "its node died (launcher exit code -9)" in (o.error or "")
        else:
            assert (o.error, o.exit_code, o.killed) == (None, 0, False), o


def test_a_killed_node_fails_the_job_naming_the_node(tmp_path: Path) -> None:
    with pytest.raises(DistributedFailure, match=r"node 1 died with exit code -9") as failure:
        run_nodes(_hold_until_node_1_is_killed, 2, 2, str(tmp_path), timeout=120)
    assert "ranks [2, 3] of 4 did not report a result" in str(failure.value)


def _fail_in_many_ways(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    if rank == 2:
        os._exit(3)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 5:
        time.sleep(600)
    return rank


def test_every_rank_outcome_is_reported_and_a_hung_rank_is_killed_at_the_timeout() -> None:
    outcomes = run_nodes(_fail_in_many_ways, 3, 2, timeout=6, outcomes=True)
    returned, raised, exited, killed, finished, hung = outcomes
    assert (returned.value, returned.error, returned.exit_code) == (0, None, 0)
    assert raised.value is None and raised.exit_code == 0 and not raised.killed
    assert "ValueError: boom on purpose" in (raised.error or "")
    assert "_fail_in_many_ways" in (raised.error or "")
    assert exited.exit_code == 3 and not exited.killed
    assert "died with exit code 3 without reporting a result" in (exited.error or "")
    assert killed.exit_code == -signal.SIGKILL and killed.killed
    assert (finished.value, finished.node) == (4, 2)
    assert hung.timed_out and hung.node == 2 and hung.ended is None
    assert "did not finish within 6 s" in (hung.error or "")
    assert [o.timed_out for o in outcomes] == [False] * 5 + [True]


@pytest.mark.parametrize(
    ("nodes", "pattern"),
    [
        (1, r"rank 1 of 2 \(node 0\) failed:\n(.|\n)*ValueError: boom on purpose"),
        (2, r"rank 2 of 4 \(node 1\) died with exit code 3 without reporting a result"),
    ],
)
def test_a_failed_rank_fails_the_job_naming_it(nodes: int, pattern: str) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedFailure, match=pattern):
        # Node 1 (when there is one) ends first: rank 2 exits at once, rank 1 raises.
        run_nodes(_fail_in_many_ways if nodes == 1 else _exit_on_rank_2, nodes, 2, timeout=60)
    assert time.monotonic() - started < 55  # the ranks still waiting were killed


def _exit_on_rank_2(rank: int, world_size: int) -> None:
    if rank == 2:
        os._exit(3)
    time.sleep(600)


def _hang_on_rank_3(rank: int, world_size: int) -> int:
    if rank == 3:
        time.sleep(600)
    return rank


def test_a_hung_rank_fails_the_job_at_the_timeout() -> None:
    with pytest.raises(DistributedFailure, match=r"ranks \[3\] of 4 did not finish within 3 s"):
        run_nodes(_hang_on_rank_3, 2, 2, timeout=3)


def test_bad_arguments_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="run_nodes: nodes must be a positive int, got 0"):
        run_nodes(_hang_on_rank_3, 0, 2)
    with pytest.raises(ValueError, match="run_nodes: ranks_per_node must be a positive int"):
        run_nodes(_hang_on_rank_3, 2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run_nodes: hostnames must name 2 nodes"):
        run_nodes(_hang_on_rank_3, 2, 1, hostnames=["a"])
    # Without namespaces, a node_dir is refused naming the fix (no process is started).
    monkeypatch.setattr(_nodes, "unavailable", lambda: "PermissionError: no: run as root")
    with pytest.raises(RuntimeError, match=r"run_nodes\(node_dir='.*local'\): .*run as root"):
        run_nodes(_hang_on_rank_3, 2, 1, node_dir=tmp_path / "local")
    assert not (tmp_path / "local").exists()


def test_kill_node_outside_a_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_nodes._NODE_GROUPS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="kill_node: call it in a rank started by run_nodes"):
        kill_node(0)
    monkeypatch.setenv(_nodes._NODE_GROUPS_ENV, f"{os.getpid()}")
    with pytest.raises(ValueError, match=r"kill_node: node must be 0\.\.0, got 1"):
        kill_node(1)


STOPPED_FOR_S = 60.0
"""``stop_node``'s ``kill_after_s`` in the tests of its reaping: longer than the run."""


def _stop_node_1(rank: int, world_size: int, until_others_end: bool, kill_after_s: float) -> str:
    """Rank 1 stops its node (1); rank 0 works on for a second and ends."""
    if rank == 1:
        stop_node(1, kill_after_s, until_others_end=until_others_end)
        time.sleep(600)  # stopped, then killed: never reached
    time.sleep(1.0)
    return "survivor"


@pytest.mark.parametrize("until_others_end", [True, False], ids=["until-others-end", "after"])
def test_a_stopped_node_is_killed_after_its_time_or_once_the_others_end(
    until_others_end: bool,
) -> None:
    """Two nodes of one rank: node 1 stopped (its processes there, not running) is SIGKILLed
    ``kill_after_s`` later; with ``until_others_end``, as soon as node 0 has ended instead,
    never before."""
    kill_after_s = STOPPED_FOR_S if until_others_end else 4.0
    started = time.monotonic()
    survivor, stopped = run_nodes(
        _stop_node_1, 2, 1, until_others_end, kill_after_s, timeout=120, outcomes=True
    )
    assert (survivor.value, survivor.error, survivor.exit_code) == ("survivor", None, 0), survivor
    assert stopped.killed and stopped.exit_code is None, stopped
    assert survivor.ended is not None and stopped.ended is not None
    assert stopped.ended > survivor.ended
    if until_others_end:
        assert stopped.ended - survivor.ended < 10.0, (stopped, survivor)
        assert stopped.ended - started < STOPPED_FOR_S / 2, (stopped, started)
    else:
        assert stopped.ended - started >= kill_after_s, (stopped, started)


def _first_to_unpickle_sleeps(marker: str, seconds: float) -> None:
    """Unpickles :class:`_SlowToStart`: in the launcher that gets there first, sleep ``seconds``."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    time.sleep(seconds)
    return None


class _SlowToStart:
    """An argument of the ranks, unpickled by every node's launcher before the launcher runs:
    the first launcher to unpickle it starts ``seconds`` late (a node slow to start); the ranks
    receive ``None``."""

    def __init__(self, marker: Path, seconds: float) -> None:
        self.marker, self.seconds = str(marker), seconds

    def __reduce__(self) -> tuple[Any, ...]:
        return (_first_to_unpickle_sleeps, (self.marker, self.seconds))


def _every_node_group_exists(rank: int, world_size: int, _slow: None, done: str) -> list[int]:
    """At the rank's start, signal 0 to every node's process group: what stop_node and
    kill_node would signal. ``ProcessLookupError`` where a group does not exist yet. Then it
    stays until every rank has signalled (a node whose ranks all ended has no group left: on a
    loaded machine, one node's rank could end before the other's started)."""
    groups = _nodes._node_groups("test")
    for group in groups:
        os.killpg(group, 0)
    Path(done, str(rank)).touch()
    deadline = time.monotonic() + 60.0
    while len(list(Path(done).iterdir())) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return groups


def test_every_node_leads_its_group_before_any_rank_starts(tmp_path: Path) -> None:
    """One node's launcher starts 3 s after the other's: the other node's rank, started as
    soon as it can, finds both nodes' process groups there, so stop_node or kill_node at a
    rank's start reaches the whole node (the groups were handed out before the slow launcher
    led its own: the signal found no such group)."""
    slow = _SlowToStart(tmp_path / "slow", 3.0)
    done = tmp_path / "signalled"
    done.mkdir()
    started = time.monotonic()
    groups = run_nodes(_every_node_group_exists, 2, 1, slow, str(done), timeout=120)
    assert (tmp_path / "slow").exists()  # a launcher did start late
    assert time.monotonic() - started >= 3.0
    assert groups[0] == groups[1] and len(set(groups[0])) == 2, groups


def _exits_when_unpickled() -> None:
    os._exit(7)


class _DiesAtStart:
    """An argument whose unpickling, in each node's launcher before it runs, ends the launcher."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_exits_when_unpickled, ())


@pytest.mark.parametrize(
    "start, pattern",
    [
        ("dies", r"node 0's launcher ended before it started its ranks"),
        ("slow", r"node \d's launcher did not start within 2 s"),
    ],
)
def test_a_launcher_that_does_not_start_fails_the_job_in_time_naming_its_node(
    start: str, pattern: str, tmp_path: Path
) -> None:
    arg = _DiesAtStart() if start == "dies" else _SlowToStart(tmp_path / "slow", 30.0)
    started = time.monotonic()
    with pytest.raises(DistributedFailure, match=pattern):
        run_nodes(_every_node_group_exists, 2, 1, arg, timeout=2)
    assert time.monotonic() - started < 20


def test_stop_node_refuses_a_time_that_is_not_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_nodes._NODE_GROUPS_ENV, f"{os.getpid()}")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="stop_node: kill_after_s must be positive seconds"):
            stop_node(0, bad)
