"""Several simulated nodes on one machine, each with its ranks, as a launcher per node starts them
(``torchrun --nnodes N --node-rank i`` on every node).

The engine behind :func:`lightning_mcore_ckpt.testing.run_nodes`. Each node is one launcher
process, started like :func:`~lightning_mcore_ckpt.launch.local.run_distributed`'s ranks (forked
from a server that imported the libraries once); it leads a process group of its own and forks
its ranks, so everything a node runs (its ranks, their writers and loader workers) dies with one
``killpg``: :func:`kill_node`.

With a ``node_dir``, a node is also a machine of its own where it matters for checkpoints: its
launcher enters a mount and a UTS namespace (:mod:`~lightning_mcore_ckpt.launch.namespaces`,
Linux, as root), mounts the node's own directory (:func:`node_storage`) on ``node_dir``, the same
path on every node as on a cluster, names its host ``node<i>`` and points ``TMPDIR`` at
``<node_dir>/tmp``. Everything else (the process ids, the network, every other path) is shared,
so a directory outside ``node_dir`` is a shared filesystem.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.launch.local import (
    DistributedFailure,
    _context,
    _kill,
    check_launch,
    find_free_port,
    rank_environment,
    rank_value,
    run_rank,
)
from lightning_mcore_ckpt.launch.namespaces import enter_node, node_storage, unavailable

__all__ = [
    "RankOutcome",
    "kill_node",
    "node_storage",
    "nodes_unavailable",
    "run_nodes",
    "stop_node",
]

_NODE_GROUPS_ENV = "LMC_NODE_PROCESS_GROUPS"
"""In every rank: the process group of each node's launcher, by node, comma-separated."""


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_nodes` (``outcomes=True``) ended.

    Attributes:
        rank, node: the rank's global rank and its node.
        value: what ``fn`` returned (``None`` when it did not return).
        error: the traceback of what it raised, or why it has no result (died, killed, timed
            out); ``None`` when it returned.
        exit_code: its process's exit code (negative: the signal that ended it); ``None`` when
            its node was killed before its launcher could see it end.
        killed: it died of a signal (its node killed, or itself) without returning or raising.
        timed_out: it had not ended when ``timeout`` ran out (then ``run_nodes`` killed it),
            also when it had returned or raised but its process did not exit.
        ended: ``time.monotonic()`` (one clock for every process of the machine) when it
            returned or raised; else when its launcher saw it die, or, for a node killed whole,
            when the parent saw the node's launcher gone (within a fraction of a second).

    Example::

        for o in run_nodes(fn, 2, 2, outcomes=True):
            assert o.error is None or o.killed, (o.rank, o.error)
    """

    rank: int
    node: int
    value: Any = None
    error: str | None = None
    exit_code: int | None = None
    killed: bool = False
    timed_out: bool = False
    ended: float | None = None


def nodes_unavailable() -> str | None:
    """Why :func:`run_nodes` cannot be given a ``node_dir`` here (with the fix), or ``None``.

    Example::

        if (why := nodes_unavailable()) is not None:
            pytest.skip(why)
    """
    return unavailable()


def kill_node(node: int) -> None:
    """SIGKILL every process of node ``node`` of this :func:`run_nodes` job: its launcher, its
    ranks and all they started, as when a machine is lost. Call it from any rank (on its own
    node, it does not return).

    Example::

        def body(rank, world_size):
            if rank == 0:
                kill_node(1)
    """
    os.killpg(_node_group(node, "kill_node"), signal.SIGKILL)


_REAPER = """
import os, sys, time

deadline = time.monotonic() + float(sys.argv[1])
group, others = int(sys.argv[2]), {int(g) for g in sys.argv[3].split(",") if g}


def running(groups):
    # Whether a process of ``groups`` runs (a zombie has ended: its parent has not reaped it).
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # not a process, or gone
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if state not in "ZX" and int(pgrp) in groups:
            return True
    return False


if not os.path.isdir("/proc"):
    others = set()
while time.monotonic() < deadline and (not others or running(others)):
    time.sleep(0.2)
os.killpg(group, 9)
"""
"""The reaper of a stopped node: ``python -c _REAPER <kill_after_s> <node's group> <other
nodes' groups, comma-separated or empty>``."""


def stop_node(node: int, kill_after_s: float, *, until_others_end: bool = False) -> None:
    """SIGSTOP every process of node ``node`` of this :func:`run_nodes` job, as a machine that
    dies silently (power lost, a kernel panic, its network cut): its sockets stay open, so its
    peers learn nothing until their own timeouts. ``kill_after_s`` seconds later the node is
    SIGKILLed (as a scheduler reaps a lost machine; then its sockets close), by a process of
    its own outside the node. Call it from any rank (on its own node, it does not return until
    then).

    ``until_others_end``: kill it sooner, as soon as no process of any other node runs (Linux:
    read from ``/proc``), so that a test of the survivors waits only as long as they take;
    none of them can have been ended by the stopped node's sockets closing.

    Example::

        def body(rank, world_size):
            if rank == 2:
                stop_node(1, kill_after_s=120)  # the others must have failed by then
    """
    group = _node_group(node, "stop_node")
    if not kill_after_s > 0:
        raise ValueError(f"stop_node: kill_after_s must be positive seconds, got {kill_after_s!r}")
    others = [g for g in _node_groups("stop_node") if g != group] if until_others_end else []
    # The reaper first, in a session of its own (the stop does not reach it).
    subprocess.Popen(
        [
            sys.executable,
            "-c",
            _REAPER,
            str(float(kill_after_s)),
            str(group),
            ",".join(map(str, others)),
        ],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.killpg(group, signal.SIGSTOP)


def _node_groups(caller: str) -> list[int]:
    """Every node's process group (its launcher's session), by node."""
    groups = os.environ.get(_NODE_GROUPS_ENV)
    if groups is None:
        raise RuntimeError(f"{caller}: call it in a rank started by run_nodes")
    return [int(g) for g in groups.split(",")]


def _node_group(node: int, caller: str) -> int:
    pgids = _node_groups(caller)
    if not isinstance(node, int) or not 0 <= node < len(pgids):
        raise ValueError(f"{caller}: node must be 0..{len(pgids) - 1}, got {node!r}")
    return pgids[node]


@dataclass(frozen=True)
class _Launch:
    """What every node's launcher is given."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nodes: int
    per_node: int
    port: int
    node_dir: Path | None
    env: Mapping[str, str]


def _node_main(
    launch: _Launch, node: int, hostname: str, results: Any, exits: Any, start: Any
) -> None:
    # The node's process group: its ranks and everything they start are in it (kill_node).
    # Said to the parent, which hands every node the groups only once each exists: a rank may
    # stop or kill another node (stop_node, kill_node) as soon as it starts.
    os.setsid()
    start.send(os.getpgrp())
    groups = start.recv()
    start.close()
    node_env = {**launch.env, _NODE_GROUPS_ENV: ",".join(str(g) for g in groups)}
    per_node, world_size = launch.per_node, launch.nodes * launch.per_node
    if launch.node_dir is not None:
        try:
            node_env["TMPDIR"] = str(enter_node(launch.node_dir, node, hostname))
        except OSError:
            why = f"node {node} could not enter its namespaces:\n{traceback.format_exc()}"
            for rank in range(node * per_node, (node + 1) * per_node):
                results.put((rank, False, why, time.monotonic()))
            raise
        tempfile.tempdir = None  # asked again, of TMPDIR
        # The node's host name resolves nowhere: gloo would fall back to loopback with a
        # warning per rank. Every simulated node is on this machine's loopback.
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            node_env["GLOO_SOCKET_IFNAME"] = "lo"
    fork = mp.get_context("fork")  # the ranks: children in this node's namespaces and group
    ranks: dict[Any, tuple[int, Any]] = {}
    for local in range(per_node):
        rank = node * per_node + local
        rendezvous = rank_environment(
            launch.port, rank, world_size, local, per_node, node_rank=node, nodes=launch.nodes
        )
        proc = fork.Process(
            target=run_rank,
            args=(launch.fn, rank, world_size, {**node_env, **rendezvous}, launch.args, results),
            name=f"node{node}-rank{rank}",
        )
        proc.start()
        ranks[proc.sentinel] = (rank, proc)
    while ranks:
        for sentinel in multiprocessing.connection.wait(list(ranks)):
            ended = time.monotonic()
            rank, proc = ranks.pop(sentinel)
            proc.join()
            exits.put((rank, proc.exitcode, ended))


def run_nodes(
    fn: Callable[..., Any],
    nodes: int,
    ranks_per_node: int,
    *args: Any,
    node_dir: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    outcomes: bool = False,
    hostnames: Sequence[str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nodes`` simulated nodes of ``ranks_per_node``
    ranks each (global rank ``node * ranks_per_node + local rank``) and return their results,
    by global rank.

    Every rank has torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` and ``GROUP_RANK`` (its node), ``GROUP_WORLD_SIZE``,
    ``ROLE_*``, ``TORCHELASTIC_RUN_ID`` (``"none"``, torchrun's default), ``MASTER_ADDR`` and
    ``MASTER_PORT``; so ``Trainer(num_nodes=nodes, devices=ranks_per_node)`` joins the group
    (Lightning's ``TorchElasticEnvironment``).
    ``env`` adds variables to every rank.

    ``node_dir``: a path that is each node's own directory (Linux, as root: see
    :func:`nodes_unavailable`): on node ``i`` it is :func:`node_storage` ``(node_dir, i)``
    (created here), no other node sees it, ``TMPDIR`` is ``<node_dir>/tmp`` and the host name is
    ``hostnames[i]`` (default ``node<i>``). Without it, the nodes share every path and the host.

    A rank that raises or dies, or a node killed (:func:`kill_node`), fails the call with
    :class:`~lightning_mcore_ckpt.launch.local.DistributedFailure` naming it, as does the
    ``timeout`` (naming the ranks that had not finished); every process is killed first. With
    ``outcomes=True`` nothing a rank does fails the call: it waits until every rank has ended
    (or the timeout has passed, and kills the rest) and returns each rank's
    :class:`RankOutcome`, so that a test of a fault asserts what every rank did and when.
    Either way, a node's launcher that dies or does not start within the ``timeout`` fails the
    call naming the node: no rank starts before every node's launcher leads its process group.

    Example::

        def where(rank, world_size):
            return socket.gethostname(), os.environ["LOCAL_RANK"]

        assert run_nodes(where, 2, 2, node_dir=tmp / "local")[3] == ("node1", "1")
    """
    check_launch("run_nodes", timeout, nodes=nodes, ranks_per_node=ranks_per_node)
    names = list(hostnames) if hostnames is not None else [f"node{i}" for i in range(nodes)]
    if len(names) != nodes:
        raise ValueError(f"run_nodes: hostnames must name {nodes} nodes, got {hostnames!r}")
    local_dir = None
    if node_dir is not None:
        why = nodes_unavailable()
        if why is not None:
            raise RuntimeError(f"run_nodes(node_dir={str(node_dir)!r}): {why}")
        local_dir = Path(node_dir).absolute()
        local_dir.mkdir(parents=True, exist_ok=True)
        for node in range(nodes):
            node_storage(local_dir, node).mkdir(parents=True, exist_ok=True)
    ctx = _context()
    job = _Job(ctx, nodes, ranks_per_node, outcomes)
    launch = _Launch(fn, args, nodes, ranks_per_node, find_free_port(), local_dir, dict(env or {}))
    procs, starts = _start_launchers(ctx, launch, names, job)
    deadline = time.monotonic() + timeout
    try:
        groups = _groups_once_led(starts, deadline, timeout)
        for start in starts:
            start.send(groups)
            start.close()
        return job.wait(procs, deadline, timeout)
    finally:
        if job.finished:
            for proc in procs:
                proc.join(timeout=30)
        _kill(procs)


def _start_launchers(
    ctx: Any, launch: _Launch, names: Sequence[str], job: _Job
) -> tuple[list[Any], list[Any]]:
    """Start every node's launcher; each one's process and the parent's end of its start pipe."""
    pipes = [ctx.Pipe() for _ in range(launch.nodes)]  # (the parent's end, the launcher's)
    procs = [
        ctx.Process(
            target=_node_main,
            args=(launch, node, names[node], job.results[node], job.exits[node], pipes[node][1]),
            name=f"node{node}",
        )
        for node in range(launch.nodes)
    ]
    for proc in procs:
        proc.start()
    for _, theirs in pipes:
        theirs.close()  # the launcher's alone now: its end closes when it dies
    return procs, [ours for ours, _ in pipes]


def _groups_once_led(starts: list[Any], deadline: float, timeout: float) -> list[int]:
    """Each node's process group, by node, once every node's launcher leads its own (it says so
    on its ``start`` pipe). Handed out before that, a rank of a node that started first could
    stop or kill a group that does not exist yet: a node whose launcher is slow to start."""
    groups = []
    for node, start in enumerate(starts):
        try:
            led = start.poll(max(0.0, deadline - time.monotonic()))
            group = start.recv() if led else None
        except (EOFError, OSError):
            raise DistributedFailure(
                f"node {node}'s launcher ended before it started its ranks; all nodes were killed"
            ) from None
        if group is None:
            raise DistributedFailure(
                f"node {node}'s launcher did not start within {timeout:.0f} s; all nodes were "
                "killed"
            )
        groups.append(int(group))
    return groups


class _Job:
    """What the parent of :func:`run_nodes` knows of each rank: its result, its exit, its node.

    A queue per node for results and one for exits: a node killed while one of its processes
    writes to a queue can leave it unusable, for that node only."""

    def __init__(self, ctx: Any, nodes: int, per_node: int, outcomes: bool) -> None:
        self.per_node, self.world_size, self.outcomes = per_node, nodes * per_node, outcomes
        self.results = [ctx.Queue() for _ in range(nodes)]
        self.exits = [ctx.Queue() for _ in range(nodes)]
        self.result: dict[int, tuple[bool, Any, float]] = {}
        self.exit: dict[int, tuple[int | None, float]] = {}
        self.gone: dict[int, tuple[int | None, float]] = {}  # launcher dead: exit code, seen
        self.finished = False

    def _name(self, rank: int) -> str:
        return f"rank {rank} of {self.world_size} (node {rank // self.per_node})"

    def _read(self) -> None:
        for node, (results, exits) in enumerate(zip(self.results, self.exits, strict=True)):
            if node in self.gone and not self.outcomes:
                continue
            while True:
                try:
                    rank, ok, value, ended = results.get_nowait()
                except queue.Empty:
                    break
                self.result[rank] = (ok, value, ended)
            while True:
                try:
                    rank, code, ended = exits.get_nowait()
                except queue.Empty:
                    break
                self.exit[rank] = (code, ended)

    def _ended(self, rank: int) -> bool:
        return rank in self.exit or rank // self.per_node in self.gone

    def wait(self, procs: list[Any], deadline: float, timeout: float) -> list[Any]:
        while True:
            self._read()
            for node, proc in enumerate(procs):
                if node not in self.gone and not proc.is_alive():
                    self.gone[node] = (proc.exitcode, time.monotonic())
            if not self.outcomes:
                self._raise_for_a_failure()
                if len(self.result) == self.world_size:
                    self.finished = True
                    return [rank_value(self.result[r][1]) for r in range(self.world_size)]
            elif all(self._ended(r) for r in range(self.world_size)):
                time.sleep(0.2)  # what a rank put just before it ended
                self._read()
                self.finished = True
                return [self._outcome(r, timeout=None) for r in range(self.world_size)]
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self._ended(r)]
                if not self.outcomes:
                    raise DistributedFailure(
                        f"ranks {missing} of {self.world_size} did not finish within "
                        f"{timeout:.0f} s; all ranks were killed"
                    )
                return [self._outcome(r, timeout) for r in range(self.world_size)]
            time.sleep(0.1)

    def _raise_for_a_failure(self) -> None:
        for rank, (ok, value, _) in sorted(self.result.items()):
            if not ok:
                raise DistributedFailure(f"{self._name(rank)} failed:\n{value}")
        died = [r for r, (code, _) in self.exit.items() if code != 0 and r not in self.result]
        lost = [n for n, (code, _) in self.gone.items() if code != 0]
        if died or lost:
            time.sleep(0.5)  # a result put just before the process died
            self._read()
        for rank in sorted(died):
            if rank not in self.result:
                code = self.exit[rank][0]
                raise DistributedFailure(
                    f"{self._name(rank)} died with exit code {code} without reporting a result"
                )
        for node in sorted(lost):
            silent = [
                r
                for r in range(node * self.per_node, (node + 1) * self.per_node)
                if r not in self.result
            ]
            if silent:
                raise DistributedFailure(
                    f"node {node} died with exit code {self.gone[node][0]} (its launcher and "
                    f"everything it started); ranks {silent} of {self.world_size} did not report "
                    "a result"
                )

    def _outcome(self, rank: int, timeout: float | None) -> RankOutcome:
        node = rank // self.per_node
        code, ended = self.exit.get(rank) or (None, self.gone.get(node, (None, None))[1])
        hung = not self._ended(rank)  # also a rank that reported, then did not exit
        if rank in self.result:
            ok, value, ended = self.result[rank]
            if ok:
                return RankOutcome(rank, node, rank_value(value), None, code, False, hung, ended)
            return RankOutcome(rank, node, None, value, code, False, hung, ended)
        if hung:
            why = f"did not finish within {timeout:.0f} s; killed by run_nodes"
            return RankOutcome(rank, node, error=why, timed_out=True)
        if code is None:  # the node's launcher was killed with it
            why = f"its node died (launcher exit code {self.gone[node][0]}) before it ended"
            killed = (self.gone[node][0] or 0) < 0
        else:
            why = f"died with exit code {code} without reporting a result"
            killed = code < 0
        return RankOutcome(rank, node, None, why, code, killed, False, ended)
