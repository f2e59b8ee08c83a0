"""Runs of a real Trainer with a fault injected at a chosen point (runs inside each rank).

Faults are injected where they happen in real life: SIGKILL of the rank process from inside
the shard writer (a thread of the rank; with ``writer="megatron"``, Megatron-Core's writer, a
process forked per async save), from the commit thread, or from the middle of a directory
removal; OSErrors raised by the lowest-level file writes; a preemption signal sent to the rank
while its shard writer is held at a chosen point.

What a fault did is appended to ``fault_events.jsonl`` in the run's directory (one JSON object
a line: the event, the wall-clock time, the rank and the process), so that a test can tell
when it struck: ``fired`` (an error raised), and for a signal ``sent``, ``caught`` (by the
rank's preemption handler), ``agreed`` (every rank learnt of it), ``released`` (the writer
goes on) or ``not released`` (it waited in vain, then went on).

A signal held until every rank ``agreed`` is sent from an async save's background write, which
a loaded machine may start only after the next steps have trained (the run would then end at
its last step before any rank learnt of the signal): the signalled rank waits at the end of
the step after the faulted save, before the checkpoint callback polls, until the signal is
sent (:data:`HOLD_S` at most).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import select
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SAVE_EVERY = 2
MAX_STEPS = 6
FAULT_STEP = 4
"""The save that is interrupted (the save at step 2 before it succeeds)."""

HOLD_S = 60.0
"""How long a writer held until every rank ``agreed`` waits before it goes on anyway."""
HOLD_CAUGHT_S = 10.0
"""How long a writer held until the rank ``caught`` its signal waits before it goes on."""
EVENTS_FILE = "fault_events.jsonl"

_RANK_PID = 0
_EVENTS: Path | None = None


def _stop_node(kill_after_s: float) -> None:
    # Every process of the rank's simulated node stopped, its sockets open (a silent node);
    # SIGKILLed ``kill_after_s`` later, or once every other node's processes have ended.
    # Returns (if ever) only in another node's rank.
    from lightning_mcore_ckpt.testing import stop_node

    _record("stopped", int(os.environ["RANK"]))
    stop_node(int(os.environ["GROUP_RANK"]), kill_after_s, until_others_end=True)


def _die(node: bool = False) -> None:
    # The rank process; called from a writer process it forked, that one too (the node died).
    # ``node``: every process of the rank's simulated node (run_nodes), the rank's among them.
    if node:
        from lightning_mcore_ckpt.testing import kill_node

        kill_node(int(os.environ["GROUP_RANK"]))
    os.kill(_RANK_PID, signal.SIGKILL)
    if os.getpid() != _RANK_PID:
        os.kill(os.getpid(), signal.SIGKILL)


def _record(event: str, rank: int) -> None:
    """Append ``event`` to the run's ``fault_events.jsonl`` (any process of the rank)."""
    if _EVENTS is None:
        return
    line = {"event": event, "at": time.time(), "rank": rank, "pid": os.getpid()}
    line["monotonic"] = time.monotonic()  # one clock with run_nodes' outcomes
    _EVENTS.parent.mkdir(parents=True, exist_ok=True)
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(line) + "\n")


def _holds_until_agreed(fault: str | None, rank: int) -> bool:
    """Whether ``fault`` sends this rank a signal from its save and holds until ``agreed``."""
    if not fault:
        return False
    point_action, _, only_rank = fault.partition("@")
    action = point_action.partition(":")[2]
    mine = not only_rank or int(only_rank) == rank
    return mine and action.startswith("SIG") and action.endswith(">agreed")


def _wait_until_sent(limit: float) -> None:
    """Wait until this rank's fault has sent its signal (``sent`` in the events), ``limit`` s
    at most."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if _EVENTS is not None and _EVENTS.exists() and '"sent"' in _EVENTS.read_text():
            return
        time.sleep(0.01)


def events(run_dir: str | Path) -> list[dict[str, Any]]:
    """What the faults of the run in ``run_dir`` did, in order (see the module docstring)."""
    path = Path(run_dir, EVENTS_FILE)
    if not path.exists():
        return []
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda e: e["at"])


def _target(path: Any, sub: str = "") -> bool:
    return f"global_step_{FAULT_STEP}/{sub}" in str(path)


def inject(fault: str | None, rank: int, events_to: Path | None = None) -> Callable[[], None]:
    """Arm ``fault`` (``"<point>:<action>@<rank>"``, rank optional) in this rank's process.

    Returns what disarms it. Actions: ``kill`` (SIGKILL of the rank), ``kill_node`` (SIGKILL of
    every process of the rank's simulated node: ``run_nodes``), ``stop_node<S>`` (SIGSTOP of
    every process of that node, its sockets open, then SIGKILL ``S`` seconds later), ``unpicklable``, ``slow``
    (a 4 s pause, then the real call), ``once-<ERRNO>`` (that error the first time only), an
    errno name (that ``OSError`` every time), or ``<SIGNAL>><until>`` (``SIGTERM>caught``: the
    first time, send that signal to the rank process, then hold there until the rank's
    preemption handler has ``caught`` it, or until every rank ``agreed`` to stop; at most
    :data:`HOLD_CAUGHT_S` or :data:`HOLD_S`). ``events_to``: where the events go (see the
    module docstring).
    """
    global _RANK_PID, _EVENTS
    _RANK_PID = os.getpid()
    _EVENTS = events_to
    patched: list[tuple[Any, str, Any]] = []
    closing: list[int] = []

    def undo() -> None:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        for fd in closing:
            os.close(fd)

    def patch(owner: Any, name: str, replacement: Any) -> None:
        patched.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    if not fault:
        return undo
    point_action, _, only_rank = fault.partition("@")
    if only_rank and int(only_rank) != rank:
        return undo
    point, _, action = point_action.partition(":")
    fired: list[bool] = []
    hold = _signal_and_hold(action, rank, patch, closing) if action.startswith("SIG") else None

    def act() -> None:
        if action.startswith("stop_node"):
            # The stop reaches the node's threads a moment after the call returns: this one
            # goes on no further (it would fall through to an errno lookup and raise).
            _stop_node(float(action.removeprefix("stop_node")))
            return
        if action in ("kill", "kill_node"):
            _die(node=action == "kill_node")
        if action == "slow":
            time.sleep(4)
            return
        if hold is not None:
            hold()
            return
        if action.startswith("once-"):
            if fired:
                return
            fired.append(True)
        _record("fired", rank)
        if action == "unpicklable":
            import pickle

            raise pickle.PicklingError(f"cannot pickle a generator (injected at {point})")
        code = getattr(errno, action.removeprefix("once-"))
        raise OSError(code, f"{os.strerror(code)} (injected at {point})")

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt.format import layout, markers
    from lightning_mcore_ckpt.storage import atomic as _atomic

    if point in ("model_shards", "optim_shards"):
        sub = "model/" if point == "model_shards" else "optim/"
        original = filesystem_async._write_item

        @functools.wraps(original)
        def write_item(*args: Any, **kwargs: Any) -> Any:
            stream = args[1]
            if _target(getattr(stream, "name", ""), sub):
                if action in ("kill", "kill_node") or action.startswith("stop_node"):
                    out = original(*args, **kwargs)  # this item is on disk, the rest is not
                    stream.flush()
                    act()
                    return out
                act()
            return original(*args, **kwargs)

        patch(filesystem_async, "_write_item", write_item)
    elif point == "extra":  # inline (sync), or in the background (async, our writer)
        from lightning_mcore_ckpt.engine import _extra

        original_extra = _extra.write_extra_file

        def write_extra_file(target: Path, data: bytes) -> None:
            if _target(target):
                act()
            original_extra(target, data)

        patch(_extra, "write_extra_file", write_extra_file)
    elif point == "dcp_metadata":  # rank 0 writes each dist-checkpoint's .metadata
        writer = filesystem_async.FileSystemWriterAsync
        original_finish = writer.finish

        def finish(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _target(f"{self.checkpoint_id}/"):
                act()
            return original_finish(self, *args, **kwargs)

        patch(writer, "finish", finish)
    elif point == "mcore_config":  # rank 0 writes each dist-checkpoint's metadata.json
        from megatron.core.dist_checkpointing import core

        original_config = core.save_config

        def save_config(config: Any, checkpoint_dir: Any) -> None:
            if _target(f"{checkpoint_dir}/"):
                act()
            original_config(config, checkpoint_dir)

        patch(core, "save_config", save_config)
    elif point == "before_commit":
        original_write = _atomic.write_text

        def write_text_atomic(path: Any, text: str) -> None:
            if Path(path).name == markers.METADATA_FILE and _target(path):
                act()
            original_write(path, text)

        patch(_atomic, "write_text", write_text_atomic)
    elif point == "before_tracker":
        original_tracker = layout.write_tracker

        def write_tracker(dirpath: Any, step: int) -> None:
            if step == FAULT_STEP:
                act()
            original_tracker(dirpath, step)

        patch(layout, "write_tracker", write_tracker)
    elif point == "in_tracker":  # step 4's tracker file written, not yet renamed into place
        original_tracker = layout.write_tracker
        original_with = _atomic.write_with

        def write_and_act(path: Any, write: Callable[[Any], Any]) -> None:
            def then_act(f: Any) -> None:
                write(f)
                f.flush()
                os.fsync(f.fileno())
                act()

            original_with(path, then_act)

        def write_tracker(dirpath: Any, step: int) -> None:
            if step != FAULT_STEP:
                return original_tracker(dirpath, step)
            _atomic.write_with = write_and_act
            try:
                original_tracker(dirpath, step)
            finally:
                _atomic.write_with = original_with

        patch(layout, "write_tracker", write_tracker)
    elif point == "retention":
        original_rmtree = shutil.rmtree

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).name.startswith("global_step_") and (Path(path) / "model").exists():
                original_rmtree(Path(path) / "model")  # halfway through the removal
                act()
            original_rmtree(path, *args, **kwargs)

        patch(shutil, "rmtree", rmtree)
    else:
        raise ValueError(f"unknown fault point {point!r}")
    return undo


def _signal_and_hold(
    action: str, rank: int, patch: Callable[[Any, str, Any], None], closing: list[int]
) -> Callable[[], None]:
    """For ``<SIGNAL>><until>``: what sends the signal and holds the caller until released.

    The first caller only, in whichever thread or process: it takes the one token of a pipe.
    The token and the release travel through pipes made here, before any writer process is
    forked, so that they reach a writer thread of the rank and a writer process it forked alike
    (``fd``s are closed by ``closing``'s owner).
    """
    name, _, until = action.partition(">")
    signum = signal.Signals[name]
    if until not in ("caught", "agreed"):
        raise ValueError(f"{action!r}: hold until 'caught' or 'agreed', not {until!r}")
    from lightning_mcore_ckpt.callback import preemption as _preemption

    # The kernel may hand a process's signal to any of its threads: to the writer thread that
    # sent it, while the main thread waits for that writer's file (a sync save), Python runs the
    # handler only once the wait ends. So a hold until "caught" ends after a few seconds anyway.
    limit = HOLD_CAUGHT_S if until == "caught" else HOLD_S
    release_r, release_w = os.pipe()
    token_r, token_w = os.pipe()
    os.write(token_w, b"t")
    os.set_blocking(token_r, False)
    closing += [release_r, release_w, token_r, token_w]
    preemption = _preemption.Preemption
    original_on_signal = preemption.__dict__["_on_signal"]
    original_poll = preemption.__dict__["poll"]

    def on_signal(self: Any, caught: int, frame: Any) -> None:
        original_on_signal(self, caught, frame)
        _record("caught", rank)
        if until == "caught":
            os.write(release_w, b"x")

    def poll(self: Any) -> bool:
        agreed = bool(original_poll(self))
        if agreed:
            _record("agreed", rank)
            if until == "agreed":
                os.write(release_w, b"x")
        return agreed

    # Installed as the handler at fit's start (a bound method of the patched class).
    patch(preemption, "_on_signal", on_signal)
    patch(preemption, "poll", poll)

    def hold() -> None:
        try:
            os.read(token_r, 1)
        except BlockingIOError:  # another thread or process took it
            return
        _record("sent", rank)
        os.kill(_RANK_PID, signum)  # a real signal to the rank process, as a scheduler sends
        ready, _, _ = select.select([release_r], [], [], limit)
        _record("released" if ready else "not released", rank)

    return hold


def train(
    rank: int, world_size: int, tmp: str, fault: str | None = None, options: Any = None
) -> dict[str, Any]:
    """:func:`run` with its keyword options passed as a dict (ranks take positional args)."""
    return run(rank, world_size, tmp, fault, **(options or {}))


def run(
    rank: int,
    world_size: int,
    tmp: str,
    fault: str | None = None,
    *,
    tp: int = 1,
    async_save: bool = False,
    max_to_keep: int | None = 1,
    on_save_error: str = "raise",
    signal_at: tuple[int, int, int] | None = None,
    stop_node_at: tuple[int, int, float] | None = None,
    max_steps: int = MAX_STEPS,
    ckpt_path: str | None = "last",
    num_layers: int = 2,
    raise_at: tuple[int, int | None] | None = None,
    group_timeout_s: float | None = None,
    steal_lock_at: int | None = None,
    slurm_job: str | None = None,
    auto_requeue: bool | None = None,
    writer: str = "threads",
    num_nodes: int = 1,
    gather_optimizer: bool = False,
) -> dict[str, Any]:
    """One run; returns where it started and ended, its losses and its gathered weights.

    ``num_nodes``: ``Trainer(num_nodes=...)``, the ranks of ``run_nodes`` (``world_size //
    num_nodes`` devices each); ``"where"`` in the result: the rank's node rank, local rank,
    global rank and host name as Lightning sees them. ``gather_optimizer``: ``"optim"`` in the
    result holds the optimizer state's full tensors (else ``None``).
    ``writer``: ``MegatronStrategy(ckpt_writer=...)``, our shard writer (``"threads"``) or
    Megatron-Core's (``"megatron"``).
    ``raise_at=(step, rank)``: a training error after that step on that rank (``None``: every
    rank). ``stop_node_at=(step, rank, kill_after_s)``: after that step, that rank stops its
    whole simulated node (``stop_node``: SIGSTOP, sockets open; SIGKILL ``kill_after_s`` later). ``group_timeout_s``: the process group's timeout (a hang becomes an error then).
    ``slurm_job``: run as task ``rank`` of that SLURM job (srun's variables), so that Lightning
    detects SLURM; ``auto_requeue``: pass ``SLURMEnvironment(auto_requeue=...)`` explicitly.
    """
    options = dict(locals())
    undo = inject(fault, rank, Path(tmp, EVENTS_FILE))
    try:
        return _run(**options)
    finally:
        undo()


def _run(
    rank: int,
    world_size: int,
    tmp: str,
    tp: int,
    async_save: bool,
    max_to_keep: int | None,
    on_save_error: str,
    signal_at: tuple[int, int, int] | None,
    stop_node_at: tuple[int, int, float] | None,
    max_steps: int,
    ckpt_path: str | None,
    num_layers: int,
    raise_at: tuple[int, int | None] | None,
    group_timeout_s: float | None,
    steal_lock_at: int | None,
    slurm_job: str | None,
    auto_requeue: bool | None,
    writer: str,
    num_nodes: int,
    gather_optimizer: bool,
    fault: str | None,
    **_: Any,
) -> dict[str, Any]:
    import datetime

    import lightning.pytorch as pl
    from _trainer import gathered_optimizer, gathered_weights, make_trainer
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if slurm_job is not None:
        os.environ.update(_srun_variables(slurm_job, rank, world_size))
    seen: dict[str, int] = {}
    holds_until_agreed = _holds_until_agreed(fault, rank)

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            seen["start"] = trainer.global_step

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            # Before the checkpoint callback's poll (Lightning runs checkpoint callbacks last).
            if holds_until_agreed and trainer.global_step == FAULT_STEP + 1:
                _wait_until_sent(HOLD_S)
            if signal_at is not None:
                step, signum, only_rank = signal_at
                if trainer.global_step == step and rank == only_rank:
                    os.kill(os.getpid(), signum)  # a real signal, as a scheduler sends it
            if stop_node_at is not None and trainer.global_step == stop_node_at[0]:
                if rank == stop_node_at[1]:
                    _stop_node(stop_node_at[2])
            if raise_at is not None and trainer.global_step == raise_at[0]:
                if raise_at[1] is None or raise_at[1] == rank:
                    raise RuntimeError(f"training failed at step {raise_at[0]} (injected)")
            if trainer.global_step == steal_lock_at and rank == 0:
                take_lock_as_a_requeue(Path(tmp, "ckpt"))

    plugins = []
    if auto_requeue is not None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=auto_requeue))
    torch.manual_seed(0)  # the shuffling loader's order
    module = TinyGPTModule(num_layers=num_layers)
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(
            tensor_model_parallel_size=tp,
            ckpt_async_save=async_save,
            ckpt_writer=writer,
            **({"timeout": datetime.timedelta(seconds=group_timeout_s)} if group_timeout_s else {}),
        ),
        world_size // num_nodes,
        num_nodes=num_nodes,
        callbacks=[
            MegatronCheckpoint(
                Path(tmp, "ckpt"),
                every_n_train_steps=SAVE_EVERY,
                max_to_keep=max_to_keep,
                on_save_error=on_save_error,
            ),
            Watch(),
        ],
        enable_checkpointing=True,
        logger=CSVLogger(tmp, name="csv", version=f"run{os.getpid()}"),
        log_every_n_steps=1,
        default_root_dir=tmp,  # where Lightning's SLURM handler would put its hpc checkpoint
        plugins=plugins,
    )
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_mcore_ckpt.tiny import TokenDataset

    data = StatefulDataLoader(TokenDataset(64), batch_size=2, shuffle=True)
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    callback = next(c for c in trainer.callbacks if isinstance(c, MegatronCheckpoint))
    return {
        "start": seen.get("start"),
        "end": trainer.global_step,
        "losses": [x.clone() for x in module.step_losses],
        "weights": gathered_weights(trainer),
        "failed_saves": callback.failed_saves,
        "preempted": callback.preempted,
        "preemption_signal": callback.preemption_signal,
        "exit_code": callback.exit_code,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "optim": gathered_optimizer(trainer) if gather_optimizer else None,
        "where": (trainer.node_rank, trainer.local_rank, trainer.global_rank, socket.gethostname()),
        "csv": str(Path(trainer.logger.log_dir) / "metrics.csv") if trainer.logger else None,
    }


def take_lock_as_a_requeue(root: Path) -> None:
    """Once a step is committed, a requeue of job 4242 on another node takes the lock over."""
    from _locks import write_lock

    from lightning_mcore_ckpt.format import layout

    deadline = time.monotonic() + 60
    while layout.read_tracker(root) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    write_lock(root, job_id="slurm:4242")


def _srun_variables(job_id: str, rank: int, world_size: int) -> dict[str, str]:
    """What ``srun --ntasks-per-node=<world_size>`` sets for task ``rank`` on one node."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "train",  # not "bash"/"interactive", which Lightning ignores
        "SLURM_NTASKS": str(world_size),
        "SLURM_NTASKS_PER_NODE": str(world_size),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
    }


def same_run(resumed: dict[str, Any], reference: dict[str, Any], start: int) -> None:
    """``resumed`` started at step ``start`` and continued bit for bit like ``reference``."""
    assert resumed["start"] == start
    assert resumed["end"] == MAX_STEPS
    expected = reference["losses"][start:]
    assert len(resumed["losses"]) == len(expected)
    for got, want in zip(resumed["losses"], expected, strict=True):
        assert torch.equal(got, want)
    for key, tensor in reference["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key


def listing(tmp: str | Path) -> list[str]:
    """What is in the checkpoint directory, marked: complete steps plain, others with '?'."""
    from lightning_mcore_ckpt.format import layout

    root = Path(tmp, "ckpt")
    out = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("global_step_"):
            out.append(entry.name if layout.is_complete(entry) else entry.name + "?")
        else:
            out.append(entry.name)
    return out


def run_cases(
    rank: int, world_size: int, tmp: str, cases: list[tuple[str, str | None, dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Several runs in the same processes, one per ``(case id, fault, options)``, each in its own
    directory: what each raised (type, message, seconds from the fault's save step) or how it
    ended. ``raised_at``: the wall-clock time it raised (compare with :func:`events`). A case
    that hangs on any rank fails them all (the launcher's timeout)."""
    outcomes: dict[str, dict[str, Any]] = {}
    for case, fault, options in cases:
        started = time.monotonic()
        try:
            result = run(rank, world_size, str(Path(tmp, case)), fault, **options)
        except Exception as err:  # noqa: BLE001 - what each rank raised is the test's subject
            outcomes[case] = {
                "raised": type(err).__name__,
                "message": str(err),
                "seconds": time.monotonic() - started,
                "raised_at": time.time(),
            }
        else:
            outcomes[case] = {"raised": None, "end": result["end"]}
    return outcomes
