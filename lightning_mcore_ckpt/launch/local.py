"""Start a function on N local processes that form a gloo process group, as a launcher would.

The engine behind :func:`lightning_mcore_ckpt.testing.run_distributed` (the public name) and
:func:`lightning_mcore_ckpt.check_resume`. Each rank is forked from a server process that has
already imported torch, Megatron-Core and Lightning, so it starts in a fraction of a second.

CPU and CUDA ranks alike: the server never initialises CUDA (it imports the libraries through
:mod:`lightning_mcore_ckpt.launch.forkserver`, which says how), so a rank forked from it can train on
a GPU. Should anything initialise CUDA there all the same, a rank that fails to use CUDA names
what did.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["DistributedFailure", "find_free_port", "run_distributed"]

# The ranks are forked from a server process that has already imported torch, Lightning and
# Megatron-Core (through this module, which never initialises CUDA there), so a rank starts in a
# fraction of a second instead of re-importing them.
_PRELOAD = ["lightning_mcore_ckpt.launch.forkserver"]
_BAD_FORK = "Cannot re-initialize CUDA in forked subprocess"


class DistributedFailure(RuntimeError):
    """A rank of :func:`run_distributed` raised, died, or did not finish in time.

    Its message names the rank and carries its traceback (or its exit code, or the ranks that
    did not finish).

    Example::

        with pytest.raises(DistributedFailure, match="rank 1 of 2 failed"):
            run_distributed(fails_on_rank_1, 2)
    """


_LOWEST_PORT = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes a connection's local port from (Linux; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free at the time of the call.

    Taken below the kernel's ephemeral range when there is room: a port the kernel hands out
    (``bind`` to port 0) is also what it gives the local end of the next outgoing connection,
    and with other jobs on the machine connecting (their ranks' gloo pairs, their stores) one
    of them could take it between this call and the rendezvous store's ``bind``, which then
    fails with ``EADDRINUSE``. Below that range only a process that asks for the port by number
    gets it, and the pick is random, so that jobs started at once do not pick the same.

    Example::

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    """
    low, _ = _ephemeral_ports()
    if low - 1 > _LOWEST_PORT:
        picks = random.Random()  # not the global generator: a job's RNG is not touched
        for _ in range(200):
            port = picks.randint(_LOWEST_PORT, low - 1)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def rank_environment(
    port: int,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    *,
    node_rank: int,
    nodes: int | None = None,
) -> dict[str, str]:
    """The variables a launcher sets for a rank. With ``nodes``, all of torchrun's (the node's
    rank as ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``...: Lightning then sees torchelastic)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
    }
    if nodes is not None:
        env.update(
            GROUP_RANK=str(node_rank),
            GROUP_WORLD_SIZE=str(nodes),
            ROLE_NAME="default",
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world_size),
            TORCHELASTIC_RUN_ID="none",  # torchrun's default --rdzv-id
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
        )
    return env


def run_rank(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    env: Mapping[str, str],
    args: tuple[Any, ...],
    results: Any,
    session: bool = False,
) -> None:
    """In a rank's process: ``fn(rank, world_size, *args)`` with ``env`` set; put
    ``(rank, ok, result bytes or traceback, time.monotonic() when it ended)`` on ``results``.
    ``session``: the rank leads a session of its own, so that the parent can kill it with
    everything it started."""
    if session:
        os.setsid()
    # A rank started by the forkserver inherits its start method; a rank a launcher starts as a
    # fresh process has the platform's default (fork on Linux before Python 3.14), which is what
    # its DataLoader workers and checkpoint writers then use.
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    os.environ.update(env)
    try:
        value = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - everything a rank raises is reported to the parent
        trace = traceback.format_exc()
        results.put((rank, False, trace + _why_no_cuda(trace), time.monotonic()))
        return
    try:
        # Plain bytes: torch would otherwise pass tensors as shared-memory handles that die
        # with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = buffer.getvalue()
    except Exception:  # noqa: BLE001 - an unpicklable result is the caller's bug: report it
        results.put((rank, False, traceback.format_exc(), time.monotonic()))
        return
    results.put((rank, True, payload, time.monotonic()))


def rank_value(payload: bytes) -> Any:
    """What :func:`run_rank` put as a rank's result, read back."""
    return torch.load(io.BytesIO(payload), weights_only=False)


def check_launch(caller: str, timeout: float, **counts: int) -> None:
    """Refuse a count that is not a positive int or a timeout that is not positive."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{caller}: {name} must be a positive int, got {value!r}")
    if timeout <= 0:
        raise ValueError(f"{caller}: timeout must be positive seconds, got {timeout!r}")


def _why_no_cuda(trace: str) -> str:
    """What initialised CUDA in the process this rank was forked from, when the rank failed
    because of it (else nothing)."""
    if _BAD_FORK not in trace:
        return ""
    server = sys.modules.get(_PRELOAD[0])
    if server is None:
        return (
            "\nThis rank was forked from a forkserver started in this process before "
            "run_distributed set its preload (another use of multiprocessing's forkserver): that "
            "server initialised CUDA. Start run_distributed's ranks before any other forkserver."
        )
    stacks = getattr(server, "CUDA_INITIALISED_BY", [])
    if stacks:
        where = "\n".join(stacks)
        return f"\nThe forkserver this rank was forked from initialised CUDA here:\n{where}"
    return (
        "\nThe forkserver this rank was forked from initialised CUDA after it imported torch, "
        "Lightning and Megatron-Core without doing so: another module preloaded into it "
        f"(multiprocessing's set_forkserver_preload; run_distributed preloads {_PRELOAD}) did."
    )


def _kill(procs: list[Any]) -> None:
    # Each rank leads a session of its own: kill the whole group, also when the rank itself has
    # already died (a killed rank leaves the processes it started, e.g. checkpoint writers).
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if proc.is_alive():
                proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return their results.

    Ranks share nothing but the arguments (pass a directory to share files) and the
    rendezvous address in their environment. ``env`` adds environment variables to every rank.

    Raises :class:`DistributedFailure` naming the rank and carrying its traceback when a rank
    raises or dies, and naming the unfinished ranks when ``timeout`` seconds pass. All ranks are
    killed before it raises.

    Example::

        def show_rank(rank, world_size, tmp):
            return rank

        assert run_distributed(show_rank, 2, "/tmp") == [0, 1]
    """
    check_launch("run_distributed", timeout, world_size=world_size)
    ctx = _context()
    results: Any = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=run_rank,
            args=(
                fn,
                rank,
                world_size,
                {
                    **(env or {}),
                    **rank_environment(port, rank, world_size, rank, world_size, node_rank=0),
                },
                args,
                results,
                True,
            ),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    try:
        _collect(procs, results, outputs, timeout)
    finally:
        if len(outputs) == world_size:
            for proc in procs:
                proc.join(timeout=30)
        _kill(procs)
    return [outputs[r] for r in range(world_size)]


def _collect(procs: list[Any], results: Any, outputs: dict[int, Any], timeout: float) -> None:
    """Wait for every rank's result into ``outputs``; raise :class:`DistributedFailure` naming
    the rank that failed or died, or the ranks unfinished after ``timeout`` seconds."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        try:
            rank, ok, value, _ = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r
                for r, p in enumerate(procs)
                if r not in outputs and not p.is_alive() and p.exitcode not in (0, None)
            ]
            if dead:
                # Give a rank that reported just before it died the chance to be read.
                time.sleep(0.5)
                if results.empty():
                    r = dead[0]
                    raise DistributedFailure(
                        f"rank {r} of {world_size} died with exit code {procs[r].exitcode} "
                        "without reporting a result"
                    ) from None
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outputs]
                raise DistributedFailure(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s; "
                    "all ranks were killed"
                ) from None
            continue
        if not ok:
            raise DistributedFailure(f"rank {rank} of {world_size} failed:\n{value}")
        outputs[rank] = rank_value(value)
