"""The fast tier next to the persistent tier, on simulated nodes:
``python -m benchmarks --only-fast-tier [--sizes 1G] [--repeats 3] [--quick]
[--optimizers adamw]``.

One job of 2 simulated nodes x 1 rank (``testing.run_nodes`` with a ``node_dir``: each node
its own directory at the same path; the model split over both ranks by tensor parallelism, so
the state in total is the size asked for: weights and AdamW's two moments, fp32,
``workloads.SIZES``; ``--optimizers distributed`` or ``distributed-bf16`` trains it with
Megatron-Core's distributed optimizer instead, over fp32 or bf16 weights) trains with ``MegatronCheckpoint(every_n_train_steps=PERSIST)``, its saves
async (``MegatronStrategy(ckpt_async_save=True)``), and ``FastTier(every_n_train_steps=FAST,
replicas=1, max_to_keep=2)``. It is killed (every rank, ``os._exit``) once fast step
``KILLED_AT`` is complete, the persistent tier's last step being ``PERSISTED``. Measured:

1. **Blocking per save, side by side in that one run.** Before each step that ends with a
   save, every save still in flight is waited for (outside the figures), so each save's
   blocking is its own. Per save: the library's figures (``fast_blocking_time_s`` of rank 0
   from ``fast_tier.jsonl``; the persistent step's ``blocking_time_s``, its slowest rank's,
   from its ``metadata.json``) and the wall time of the callback's ``on_train_batch_end`` at
   that step on every rank (the training loop's own view: everything the save did on the
   training thread).
2. **Recovery, launch -> first resumed step.** The killed job's directories are kept as a
   snapshot; each launch gets a copy (large files hard-linked, so a copy costs nothing and
   the snapshot is never changed: every write of a load is a new file), damaged as the row
   says, its files dropped from the page cache, then ``fit(ckpt_path="last")`` on 2 new
   simulated nodes:

   - **fast tier, own copies**: every node's directory intact;
   - **fast tier, peer copies**: node 0's directory wiped (a replaced node): its rank fetches
     its files from node 1;
   - **fast tier on /dev/shm, own copies** (where ``/dev/shm`` is there, writable, with
     :data:`SHM_MARGIN` x the nodes' directories + :data:`SHM_SPARE` free; else not measured,
     saying why): the own copies' launch (a process crash on the same hosts, what ``/dev/shm``
     serves: every node's directory intact) with each node's directory on ``/dev/shm``
     (:class:`ShmDir`: a fresh ``/dev/shm/lmc-bench-fast-tier-<pid>-<random>``, removed
     afterwards, on failure too). A hard link cannot cross file systems: the snapshot's
     nodes' directories are copied there before each launch and removed after it (a launch
     may write to them), the snapshot unchanged; the launch's ``node_dir`` is that directory's
     ``local``, the same path on every node, each node seeing its own there (``run_nodes``).
     Nothing there is dropped from the page cache: a tmpfs's files are the page cache, the
     read is from memory;
   - **persistent tier**: both nodes' directories wiped: no fast step newer than the
     persistent tier's last one; that step is loaded from the shared directory;
   - **persistent tier, shared dir throttled** (where the kernel lets it be set up: root, a
     loop device, a block I/O controller): the same, the shared directory moved onto a file
     system whose reads the kernel caps at :data:`THROTTLE_MIB_S` a node (:class:`ThrottledDir`);
   - **persistent tier, S3 on loopback** (where boto3 and moto are installed): the same, the
     persistent tier an ``s3://`` ``dirpath`` (its default staging ``local_dir``, node-local)
     on an S3 server on 127.0.0.1 (:class:`S3Stand`: moto, the tests' and ``--only-s3``'s
     server), not throttled. The training run saves to the shared directory; its persistent
     step :data:`PERSISTED` is published into the bucket once, after it, by the library's own
     uploader (``publication.publish_step``, what a commit to an ``s3://`` ``dirpath`` runs),
     so every row loads the same committed step. Before each launch the server's spooled
     objects are dropped from the page cache; after it, what the launch added to the bucket
     (its lock, its ``fast_tier.jsonl``) is deleted.

   Each fast-tier row (``/dev/shm``'s too) is judged against each persistent stand-in (:func:`targets`): MET when
   its recovery + load is at most :data:`RECOVERY_TARGET` x the stand-in's.

   The time runs from just before ``run_nodes`` (``time.monotonic()``: one clock for every
   process of the machine) to the first ``on_train_batch_start`` after the load; the phases on
   the way are recorded, and the recovery's own ``time_s`` (``fast_tier.jsonl``: finding the
   step together, checking the copies against their seals, fetching the missing ones; not the
   load itself). Where the recovery and the load went: the wall time of named functions in each
   rank (:data:`RECOVERY_PARTS`, :data:`LOAD_PARTS`), the slower rank's, medians of the
   launches. The rows are interleaved, each leading a round in turn, the others after it
   forward and in reverse in alternate rounds (:func:`round_order`).
3. **Steps lost at a failure**: arithmetic from the cadences (see :func:`steps_lost`), with
   the save times of item 1 in steps of this run.
4. **The fast tier against its own bounds** (:func:`bounds`): own copies, recovery + load at
   most :data:`BOUND_SLACK` x (bytes per rank / the medium's read speed) + the fixed costs;
   peer copies, at most :data:`BOUND_SLACK` x (bytes per rank / min(link, read speed)) + the
   fixed costs; own copies on ``/dev/shm``, at most :data:`BOUND_SLACK` x (bytes per rank /
   ``/dev/shm``'s read speed) + the fixed costs. A read speed is the medium's over
   :data:`NODES`: the simulated nodes share one disk and one memory, and all read at once. The
   speeds are measured in the same run, in each round, interleaved with the recovery launches
   (:func:`round_order`: each right after the row it bounds, :data:`SPEED_AFTER`), and their
   medians used:

   - **the medium's cold read speed** (:func:`read_cold`): the copies of fast step
     ``KILLED_AT`` that the rank serving the peer row reads (node 1's: its own rank's and its
     peer's), dropped from the page cache, read once with one thread per copy, as the
     recovery reads a rank's copies (``fast.recovery._check_all``), not hashed;
   - **``/dev/shm``'s read speed** (:func:`read_shm`, where its row is launched): the same
     method as the cold read, on the copies that row's ranks read (each node's own copy of
     fast step ``KILLED_AT``, copied onto ``/dev/shm`` first), one thread per copy, not hashed,
     nothing dropped (tmpfs: from memory);
   - **the link between the simulated nodes** (:func:`link_speed`): gloo on loopback, a
     ``uint8`` tensor the size of one rank's copy sent from node 1 to node 0 (the peer row's
     direction) by a job of its own on :data:`NODES` simulated nodes, :data:`LINK_TRANSFERS`
     timed transfers after one that warms the connection;
   - **the fixed costs** (:func:`fixed_costs`): of the row's recovery + load, what is not
     reading, checking or fetching bytes (:data:`BYTE_PARTS`): the parts named in
     :data:`FIXED_PARTS`, the rest ``other``.

   A bound whose speed could not be measured, or whose row was not launched, is ``MISSED``,
   with why (``not measured: ...``).

The node processes are forked from a server that imported the libraries (as ``run_nodes``
always does): interpreter start and imports are not in the launch figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import stat
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.report import machine_line

HERE = Path(__file__).resolve().parent
MiB = 2**20

NODES = 2
PER_NODE = 1
FAST = 2
"""The fast tier's cadence in the measured run (steps)."""
PERSIST = 4
"""The persistent tier's (async) cadence in the measured run (steps)."""
KILLED_AT = 22
"""The job is killed once this fast step is complete."""
PERSISTED = 20
"""The persistent tier's last step then."""

ROWS = ("fast tier, own copies", "fast tier, peer copies", "persistent tier")
THROTTLED = "persistent tier, shared dir throttled"
"""The persistent tier read from a shared directory throttled to :data:`THROTTLE_MIB_S` a node
(:class:`ThrottledDir`), when the kernel lets this process set it up."""
THROTTLE_MIB_S = 100
"""The throttled shared directory's read bandwidth per node, MiB/s (a node's share of a
shared file system or of its network link: 100 MiB/s is a 1 Gbit/s link)."""
S3_ROW = "persistent tier, S3 on loopback"
"""The persistent tier an ``s3://`` ``dirpath`` on an S3 server on loopback (:class:`S3Stand`),
when boto3 and moto are installed."""
SHM_ROW = "fast tier on /dev/shm, own copies"
"""The own-copies row with each simulated node's fast-tier directory on ``/dev/shm`` (a
tmpfs: :class:`ShmDir`), when it is there and has room."""
SHM = Path("/dev/shm")
SHM_MARGIN = 2
"""``/dev/shm`` must have this x the bytes a launch places there free (the copy, and as much
again for what a launch writes and for the ranks' memory, which a tmpfs shares), plus
:data:`SHM_SPARE`."""
SHM_SPARE = 256 * 2**20
RECOVERY_TARGET = 0.5
"""The target: the fast tier's recovery + load at most this share of a persistent tier's."""
PHASES = ("rank started", "model set up", "state loaded", "first step starts")
BOUND_SLACK = 1.2
"""The fast tier's own bounds: recovery + load at most this x (bytes per rank / the speed the
bytes can move at) + the named fixed costs (:func:`bounds`)."""
GB = 1e9
"""The bounds' speeds are in GB/s (10^9 bytes a second)."""
MEDIUM = "cold read of the fast-tier copies"
"""A round's measurement of the medium's read speed (:func:`read_cold`)."""
LINK = "link between the simulated nodes"
"""A round's measurement of the link's speed (:func:`link_speed`)."""
SHM_MEDIUM = "read of the fast-tier copies on /dev/shm"
"""A round's measurement of ``/dev/shm``'s read speed (:func:`read_shm`)."""
SPEED_AFTER = {ROWS[0]: MEDIUM, ROWS[1]: LINK, SHM_ROW: SHM_MEDIUM}
"""Each speed measured right after the row it bounds, in :func:`round_order`."""
LINK_TRANSFERS = 3
"""Timed transfers of a rank's copy over the link per measurement (after one to warm it)."""
BYTE_PARTS = ("check the copies", "fetch, in all")
"""The parts of a fast-tier recovery + load that read, check or fetch the copies' bytes: what
a bound's first term stands for (labels of :data:`RECOVERY_PARTS`)."""
FIXED_PARTS = (
    "inventory",
    "unpickle it (in memory)",
    "into model and optimizer",
    "optimizer state made",
    "extra/ checked",
    "extra/ loaded",
)
"""The fixed costs named in a bound (labels of :data:`ALL_PARTS`, none inside another); the
rest of recovery + load, once these and :data:`BYTE_PARTS` are taken off, is ``other``."""
OTHER = "other"

# (fast, persistent) cadences of the steps-lost table.
CADENCES = ((10, 200), (20, 500), (50, 1000), (100, 2000))


# --- inside every rank ------------------------------------------------------------------------


def _callbacks(cfg: dict[str, Any], marks: dict[str, Any], prepare: bool) -> list[Any]:
    """The checkpoint callback (timing its ``on_train_batch_end`` per step) and the clock."""
    import lightning.pytorch as pl

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint

    launched_at = cfg["launched_at"]
    steps: dict[int, dict[str, Any]] = marks.setdefault("steps", {})
    hook = {"in": False}  # inside the checkpoint's on_train_batch_end

    class Timed(MegatronCheckpoint):  # type: ignore[misc]
        """``on_train_batch_end``'s wall time per step: every save's blocking, as the training
        loop sees it."""

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            started = time.perf_counter()
            hook["in"] = True
            try:
                super().on_train_batch_end(trainer, *args)
            finally:
                hook["in"] = False
            ended = time.perf_counter()
            row = steps.setdefault(trainer.global_step, {})
            row["hook_s"] = ended - started
            if "returned" in row:  # the hook's time after writer.save returned
                row.setdefault("parts", {})["after writer.save"] = ended - row.pop("returned")
            if "started" in row:
                row["step_s"] = started - row.pop("started")

    checkpoint = Timed(
        cfg.get("store") or Path(cfg["shared"]) / "ckpt",  # an s3:// URL: the S3 stand-in
        every_n_train_steps=PERSIST,
        fast_tier=FastTier(
            Path(cfg["node_dir"]) / "fast",
            every_n_train_steps=FAST,
            replicas=1,
            max_to_keep=2,
        ),
    )

    def saves_after(step: int) -> bool:
        return step % FAST == 0 or step % PERSIST == 0

    class Clock(pl.Callback):  # type: ignore[misc]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            marks["model set up"] = time.monotonic() - launched_at
            marks["rss at set up"] = _reset_peak_rss()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            marks["state loaded"] = time.monotonic() - launched_at
            marks["resumed_step"] = trainer.global_step
            marks["load peak extra MiB"] = _peak_extra_mib(marks.get("rss at set up"))
            if prepare:  # where a fast save's time on the training thread goes
                fast: Any = checkpoint._fast
                for name, owner, attr in (
                    ("fast save, in all", checkpoint, "_fast_save"),
                    ("dump_checkpoint", trainer._checkpoint_connector, "dump_checkpoint"),
                    ("training_state", trainer.strategy, "_training_state"),
                    ("writer.save", fast.writer, "save"),
                    ("report", fast, "report"),
                ):
                    timed = _timed_part(trainer, steps, hook, name, getattr(owner, attr))
                    setattr(owner, attr, timed)

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            step = trainer.global_step
            if not prepare:  # the first step after the load: the figure, then gone
                marks["first step starts"] = time.monotonic() - launched_at
                _write_marks(cfg, trainer.global_rank, marks)
                os._exit(0)
            fast: Any = checkpoint._fast
            if step == KILLED_AT:  # fast step KILLED_AT and every persistent save done: killed
                fast.report(wait=True)
                self._wait_persistent(trainer)
                checkpoint._log_commits(trainer, wait=True)
                _write_marks(cfg, trainer.global_rank, marks)
                os._exit(0)
            if saves_after(step + 1):
                # Every save in flight finished first, outside the figures (as
                # workloads' SavesApart does): each save's blocking is its own.
                waited = time.perf_counter()
                fast.report(wait=True)
                self._wait_persistent(trainer)
                marks.setdefault("waits_s", []).append(time.perf_counter() - waited)
            steps.setdefault(step + 1, {})["started"] = time.perf_counter()

        @staticmethod
        def _wait_persistent(trainer: Any) -> None:
            while not trainer.strategy.finalize_pending_save(blocking=False):
                time.sleep(0.002)

    marks["rank started"] = time.monotonic() - launched_at
    return [Clock(), checkpoint]


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), or ``None``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """Restart this process's peak resident memory (``VmHWM``) from now (``/proc/self/
    clear_refs``); its resident memory now, KiB, or ``None`` where the peak cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def _peak_extra_mib(at_start_kib: int | None) -> float | None:
    """The peak resident memory since :func:`_reset_peak_rss` above what it returned, MiB."""
    peak = _status_kib("VmHWM")
    if at_start_kib is None or peak is None:
        return None
    return max(0, peak - at_start_kib) / 1024


def _timed_part(
    trainer: Any, steps: dict[int, dict[str, Any]], hook: dict[str, bool], name: str, fn: Any
) -> Any:
    """``fn``, its wall time inside the checkpoint's ``on_train_batch_end`` added to
    ``steps[<the step>]["parts"][name]`` per call (when ``writer.save`` returned, too)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not hook["in"]:
            return fn(*args, **kwargs)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            row = steps.setdefault(trainer.global_step, {})
            parts = row.setdefault("parts", {})
            parts[name] = parts.get(name, 0.0) + ended - started
            if name == "writer.save":
                row["returned"] = ended

    return timed


# Where a resume's time goes: (label, module, attribute) of the functions timed, each one's
# wall time summed per rank. Private names of the fast tier: one that is gone is left out.
RECOVERY_PARTS = (
    ("inventory", "lightning_mcore_ckpt.fast.recovery", "_inventory"),
    ("check the copies", "lightning_mcore_ckpt.fast.recovery", "_checked_sources"),
    ("fetch, in all", "lightning_mcore_ckpt.fast.recovery", "_fetch"),
    ("read and check a copy (in memory)", "lightning_mcore_ckpt.fast.files", "read_checked"),
    ("read and check a copy (streamed)", "lightning_mcore_ckpt.fast.files", "verify"),
    (
        "read, check and send a copy (streamed)",
        "lightning_mcore_ckpt.fast.files",
        "stream_checked",
    ),
    (
        "receive a fetched copy, hashed as it comes",
        "lightning_mcore_ckpt.fast.peers",
        "Incoming.take",
    ),
    (
        "check it against its seal, queue its write",
        "lightning_mcore_ckpt.fast.peers",
        "Incoming.arrive",
    ),
    ("recovery, in all", "lightning_mcore_ckpt.callback.fast_tier", "FastTierRun.recover"),
    ("load, in all", "lightning_mcore_ckpt.strategy.strategy", "MegatronStrategy.load_checkpoint"),
)
# Where the load after the recovery went, the same way: the fast tier's rank state (unpickled
# from the bytes the recovery checked, then each tensor into the model's or the optimizer's),
# the persistent tier's Megatron-Core loads, and what both do (the optimizer's state made to be
# loaded into, the extra/ files).
LOAD_PARTS = (
    (
        "rank state, in all",
        "lightning_mcore_ckpt.engine._reader",
        "CheckpointReader.load_rank_state",
    ),
    ("unpickle it (in memory)", "lightning_mcore_ckpt.engine._rank_state", "read"),
    ("into model and optimizer", "lightning_mcore_ckpt.engine._rank_state", "_restore"),
    ("persistent: weights", "lightning_mcore_ckpt.engine._reader", "CheckpointReader.load_weights"),
    (
        "persistent: optimizer",
        "lightning_mcore_ckpt.engine._reader",
        "CheckpointReader.load_optimizers",
    ),
    ("optimizer state made", "lightning_mcore_ckpt.training.optim", "init_state"),
    ("extra/ checked", "lightning_mcore_ckpt.engine._reader", "CheckpointReader.check_extra"),
    ("extra/ loaded", "lightning_mcore_ckpt.engine._reader", "CheckpointReader.load_extra"),
)
ALL_PARTS = RECOVERY_PARTS + LOAD_PARTS


def _time_recovery(parts: dict[str, float]) -> None:
    """Wrap each function of :data:`ALL_PARTS` in this rank: its time summed in ``parts``."""
    import importlib

    for label, module_name, name in ALL_PARTS:
        owner: Any = importlib.import_module(module_name)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def timed(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                parts[_label] = parts.get(_label, 0.0) + time.perf_counter() - started

        setattr(owner, attr, timed)


def _write_marks(cfg: dict[str, Any], rank: int, marks: dict[str, Any]) -> None:
    path = Path(cfg["shared"]) / f"marks_{rank}.json"
    path.write_text(json.dumps(marks, default=str))


def job(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """One rank: ``cfg["mode"]`` ``"prepare"`` (train, save both tiers, killed after fast step
    :data:`KILLED_AT`) or ``"resume"`` (``ckpt_path="last"``, gone at its first step). Its
    figures go to ``<shared>/marks_<rank>.json``; it never returns."""
    import lightning.pytorch as pl

    from benchmarks import workloads
    from lightning_mcore_ckpt import MegatronStrategy

    marks: dict[str, Any] = {}
    prepare = cfg["mode"] == "prepare"
    callbacks = _callbacks(cfg, marks, prepare)
    if not prepare:
        _time_recovery(marks.setdefault("recovery_parts", {}))
    trainer = pl.Trainer(
        strategy=MegatronStrategy(tensor_model_parallel_size=world, ckpt_async_save=True),
        accelerator="cpu",
        devices=PER_NODE,
        num_nodes=world // PER_NODE,
        max_steps=KILLED_AT + 2,
        logger=False,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(
        workloads._module(cfg["size"], optimizer=cfg.get("optimizer", "adamw")),
        train_dataloaders=workloads._loader(stateful=True),
        ckpt_path=None if prepare else "last",
    )
    raise RuntimeError(f"rank {rank}: fit returned before step {KILLED_AT} (not killed)")


def link_job(rank: int, world: int, cfg: dict[str, Any]) -> list[float]:
    """One rank of the link's measurement (:func:`link_speed`): ``cfg["bytes"]`` sent from the
    last node's rank to rank 0 over gloo, once to warm the connection, then
    :data:`LINK_TRANSFERS` times, each after a barrier; rank 0's seconds per timed transfer (the
    receiver's: from the barrier to the last byte in), the others' ``[]``."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Every page touched first: the figure is the link's, not the kernel's page faults.
        payload = torch.empty(int(cfg["bytes"]), dtype=torch.uint8).fill_(rank + 1)
        sender = world - 1
        seconds = []
        for _ in range(LINK_TRANSFERS + 1):
            dist.barrier()
            started = time.perf_counter()
            if rank == sender:
                dist.send(payload, 0)
            elif rank == 0:
                dist.recv(payload, sender)
            seconds.append(time.perf_counter() - started)
        dist.barrier()
        if rank == 0 and int(payload[-1]) != sender + 1:
            raise RuntimeError("the link's payload arrived altered")
        return seconds[1:] if rank == 0 else []
    finally:
        dist.destroy_process_group()


# --- the parent -------------------------------------------------------------------------------


def _launch(
    root: Path,
    cfg: dict[str, Any],
    timeout: float,
    env: dict[str, str] | None = None,
    node_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """The job on :data:`NODES` simulated nodes under ``root`` (``env`` added to every rank's
    environment; ``node_dir``: the nodes' own directory, by default ``<root>/local``: the same
    path for every node, each node seeing its own there); each rank's marks."""
    from lightning_mcore_ckpt.testing import run_nodes

    shared = root / "shared"
    node_dir = root / "local" if node_dir is None else node_dir
    shared.mkdir(parents=True, exist_ok=True)
    for old in shared.glob("marks_*.json"):
        old.unlink()
    cfg = {**cfg, "shared": str(shared), "node_dir": str(node_dir)}
    cfg["launched_at"] = time.monotonic()
    outcomes = run_nodes(
        job, NODES, PER_NODE, cfg, node_dir=node_dir, timeout=timeout, env=env, outcomes=True
    )
    # Every rank leaves by os._exit(0) once its figures are written ("died with exit code 0
    # without reporting a result"): anything else failed.
    bad = [
        o for o in outcomes if o.exit_code != 0 or not (shared / f"marks_{o.rank}.json").exists()
    ]
    if bad:
        from lightning_mcore_ckpt.testing import DistributedFailure

        raise DistributedFailure(
            "\n".join(f"rank {o.rank}: exit {o.exit_code}\n{o.error}" for o in bad)
        )
    return [json.loads((shared / f"marks_{r}.json").read_text()) for r in range(len(outcomes))]


def _records(root: Path) -> list[dict[str, Any]]:
    from lightning_mcore_ckpt.callback.fast_tier import RECORDS

    path = root / "shared" / "ckpt" / RECORDS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _copy(snapshot: Path, target: Path) -> None:
    """``snapshot`` at ``target``: files over 1 MiB hard-linked (a load only reads them, and
    every file it writes is a new one), the rest copied (appended to: the records)."""

    def link_or_copy(src: str, dst: str) -> None:
        if os.path.getsize(src) > MiB:
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(snapshot, target, copy_function=link_or_copy, symlinks=True)


def node_storage_root(node_dir: Path) -> Path:
    """The directory holding every simulated node's own directory for ``node_dir``
    (``<node_dir>.nodes``: ``launch.namespaces.node_storage``'s parent)."""
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    return node_storage(node_dir, 0).parent


def _wipe(root: Path, node: int) -> None:
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    fast = node_storage(root / "local", node) / "fast"
    shutil.rmtree(fast, ignore_errors=True)
    fast.mkdir(parents=True)


def _max(ranks: list[dict[str, Any]], step: int, key: str) -> float | None:
    values = [r["steps"].get(str(step), {}).get(key) for r in ranks]
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _parts(ranks: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The slowest rank's time in each timed part of the hook at ``step``."""
    out: dict[str, float] = {}
    for r in ranks:
        for name, seconds in r["steps"].get(str(step), {}).get("parts", {}).items():
            out[name] = max(out.get(name, 0.0), seconds)
    return out


def prepare(scratch: Path, size: str, timeout: float, optimizer: str = "adamw") -> dict[str, Any]:
    """The measured training run (see the module, item 1); its directories become the
    snapshot every recovery starts from. ``optimizer``: the workload's (``--optimizers``)."""
    from lightning_mcore_ckpt.format import layout, markers

    run = scratch / "run"
    shutil.rmtree(run, ignore_errors=True)
    ranks = _launch(run, {"mode": "prepare", "size": size, "optimizer": optimizer}, timeout)
    # fast_tier.jsonl's names, fast_ taken off (blocking_time_s...), as the persistent tier's
    fast_saves = [
        {k.removeprefix("fast_"): v for k, v in r.items()}
        for r in _records(run)
        if r.get("kind") == "fast_save"
    ]
    persisted = []
    for step in layout.complete_steps(run / "shared" / "ckpt"):
        meta = markers.read_metadata(step.path) or {}
        persisted.append(
            {
                "step": step.step,
                "blocking_time_s": meta.get("blocking_time_s"),
                "total_time_s": meta.get("total_time_s"),
                "write_time_s": meta.get("write_time_s"),
                "size_bytes": meta.get("size_bytes"),
                "hook_s": _max(ranks, step.step, "hook_s"),
            }
        )
    for save in fast_saves:
        save["hook_s"] = _max(ranks, save["step"], "hook_s")
        save["parts"] = _parts(ranks, save["step"])
    quiet = [
        s
        for s in range(1, KILLED_AT + 1)
        if s % FAST and s % PERSIST  # steps that end without a save
    ]
    step_s = [v for s in quiet if (v := _max(ranks, s, "step_s")) is not None]
    idle_hook = [v for s in quiet if (v := _max(ranks, s, "hook_s")) is not None]
    snapshot = scratch / "snapshot"
    shutil.rmtree(snapshot, ignore_errors=True)
    run.rename(snapshot)
    from benchmarks import workloads

    return {
        "fast_saves": fast_saves,
        "persistent_saves": persisted,
        "step_s": statistics.median(step_s) if step_s else None,
        "hook_without_save_s": statistics.median(idle_hook) if idle_hook else None,
        "waits_s": [r.get("waits_s", []) for r in ranks],
        "persistent_step_bytes": workloads.tree_bytes(
            snapshot / "shared" / "ckpt" / f"global_step_{PERSISTED}"
        ),
        "snapshot_bytes": workloads.tree_bytes(snapshot),
    }


def rows_measured(throttled: bool, s3: bool, shm: bool = False) -> list[str]:
    """The recovery rows of a run: the fast tier's (:data:`SHM_ROW` where ``/dev/shm`` could
    be set up), the persistent tier, then each stand-in that could be set up."""
    return [
        *ROWS[:2],
        *([SHM_ROW] if shm else []),
        ROWS[2],
        *([THROTTLED] if throttled else []),
        *([S3_ROW] if s3 else []),
    ]


def recover_once(
    scratch: Path,
    row: str,
    size: str,
    timeout: float,
    throttled: ThrottledDir | None = None,
    s3: S3Stand | None = None,
    shm: ShmDir | None = None,
    optimizer: str = "adamw",
) -> dict[str, Any]:
    """One launch of ``row`` from a fresh copy of the snapshot (see the module, item 2)."""
    from benchmarks import workloads

    run = scratch / "run"
    shutil.rmtree(run, ignore_errors=True)
    _copy(scratch / "snapshot", run)
    node_dir = None
    if row == SHM_ROW:  # the nodes' directories copied onto /dev/shm; the disk's copy unused
        assert shm is not None
        shutil.rmtree(node_storage_root(run / "local"))
        node_dir = shm.place(scratch / "snapshot")
    elif row != ROWS[0]:
        _wipe(run, 0)
    if row in (ROWS[2], THROTTLED, S3_ROW):
        _wipe(run, 1)
    if row == THROTTLED:
        assert throttled is not None
        throttled.take(run / "shared")
    cfg: dict[str, Any] = {"mode": "resume", "size": size, "optimizer": optimizer}
    env = None
    if row == S3_ROW:  # the persistent tier is the bucket's: nothing else can be read
        assert s3 is not None
        shutil.rmtree(run / "shared" / "ckpt")
        cfg["store"], env = s3.url, s3.env()
    os.sync()  # a dirty page is not dropped: the copy just written must reach the disk first
    workloads.drop_cache(run)
    if throttled is not None:
        workloads.drop_cache(throttled.mount)
    throttled_before = throttled.read_bytes() if throttled is not None else 0
    workloads.drop_cache(scratch / "snapshot")
    server_cpu, server_dropped = None, None
    if s3 is not None:
        server_dropped = s3.drop_cache()
        server_cpu = s3.cpu_s()
    try:
        ranks = _launch(run, cfg, timeout, env=env, node_dir=node_dir)
    finally:
        if row == SHM_ROW:
            assert shm is not None
            shm.clear()
    if row == S3_ROW:
        assert s3 is not None and server_cpu is not None
        server_cpu = s3.cpu_s() - server_cpu
        records = s3.records()
        s3.reset()
    else:
        server_cpu, server_dropped, records = None, None, _records(run)
    recoveries = [r for r in records if r.get("kind") == "recovery"]
    shutil.rmtree(run, ignore_errors=True)
    through_throttle = None
    if throttled is not None:
        through_throttle = throttled.read_bytes() - throttled_before
        throttled.clear()
    return {
        "phases": {p: max(r[p] for r in ranks) for p in PHASES},
        "peak_extra_mib": [r.get("load peak extra MiB") for r in ranks],
        "resumed_step": ranks[0]["resumed_step"],
        "recovery": recoveries[-1] if recoveries else None,
        "throttled_read_bytes": through_throttle,
        "server_cpu_s": server_cpu,
        "server_dropped_bytes": server_dropped,
        "parts": {
            label: max(r.get("recovery_parts", {}).get(label, 0.0) for r in ranks)
            for label, _, _ in ALL_PARTS
        },
    }


def _copy_paths(step: Path, owner: int) -> list[Path]:
    """Rank ``owner``'s copy in the fast step ``step``: its seal and files, as the recovery
    reads them."""
    from lightning_mcore_ckpt.fast import files

    return [step / files.seal_name(owner), *(step / name for name in files.files_of(owner))]


def fast_copies(snapshot: Path) -> tuple[Path, dict[int, list[Path]]] | str:
    """The copies of fast step :data:`KILLED_AT` in ``snapshot`` that the rank serving the peer
    row reads (the last node's: its own rank's and the copies it holds for its peers), by owner
    rank: each one's seal and files, as the recovery reads them; or why there are none."""
    from lightning_mcore_ckpt.fast import files
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    step = files.step_dir(node_storage(snapshot / "local", NODES - 1) / "fast", KILLED_AT)
    owners = [r for r in range(NODES * PER_NODE) if files.present(step, r)]
    if not owners:
        return f"no sealed fast-tier copy of step {KILLED_AT} in {step}"
    return step, {o: _copy_paths(step, o) for o in owners}


def own_copies(node_dir: Path) -> dict[int, list[Path]] | str:
    """The copies of fast step :data:`KILLED_AT` that the ranks of the own-copies rows read,
    each in its own node's directory under ``node_dir`` (:func:`node_storage_root`), by rank;
    or why one is missing."""
    from lightning_mcore_ckpt.fast import files
    from lightning_mcore_ckpt.launch.namespaces import node_storage

    out: dict[int, list[Path]] = {}
    for rank in range(NODES * PER_NODE):
        step = files.step_dir(node_storage(node_dir, rank // PER_NODE) / "fast", KILLED_AT)
        if not files.present(step, rank):
            return f"no sealed fast-tier copy of rank {rank}'s step {KILLED_AT} in {step}"
        out[rank] = _copy_paths(step, rank)
    return out


def _read_all(paths: list[Path]) -> int:
    """``paths`` read once, in order, in chunks of 8 MiB into one buffer; the bytes read."""
    chunk = bytearray(8 * MiB)
    view = memoryview(chunk)
    done = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while read := f.readinto(view):
                done += read
    return done


def read_cold(scratch: Path) -> dict[str, Any]:
    """The medium's cold read speed (see the module, item 4): the snapshot's copies of
    :func:`fast_copies` synced, dropped from the page cache, then read with one thread per copy
    (the recovery's ``_check_all``), not hashed. Bytes, streams, seconds, GB/s and the largest
    copy's bytes (``bytes_per_rank``); or ``{"why": ...}``."""
    from benchmarks import workloads

    try:
        found = fast_copies(scratch / "snapshot")
        if isinstance(found, str):
            return {"why": found}
        step, copies = found
        os.sync()  # a dirty page is not dropped
        workloads.drop_cache(step)
        return _read_copies(copies)
    except Exception as err:  # noqa: BLE001 - reported as the figure's why
        return {"why": f"the copies could not be read: {err}"}


def read_shm(scratch: Path, shm: ShmDir) -> dict[str, Any]:
    """``/dev/shm``'s read speed (see the module, item 4): the snapshot's nodes' directories
    placed on ``/dev/shm`` (:meth:`ShmDir.place`), then the copies the ranks of
    :data:`SHM_ROW` read (:func:`own_copies`: each node's own rank's) read at once, one thread
    per copy, not hashed; nothing dropped from the page cache (a tmpfs's files are the page
    cache: the read is from memory). Figures as :func:`read_cold`'s; or ``{"why": ...}``."""
    try:
        copies = own_copies(shm.place(scratch / "snapshot"))
        if isinstance(copies, str):
            return {"why": copies}
        return _read_copies(copies)
    except Exception as err:  # noqa: BLE001 - reported as the figure's why
        return {"why": f"the copies on {shm.root} could not be read: {err}"}
    finally:
        shm.clear()


def _read_copies(copies: dict[int, list[Path]]) -> dict[str, Any]:
    """``copies`` (by owner: paths) read once each, at once, one thread per copy; the figures
    of :func:`read_cold`."""
    from concurrent.futures import ThreadPoolExecutor

    per_copy = {o: sum(p.stat().st_size for p in paths) for o, paths in copies.items()}
    with ThreadPoolExecutor(len(copies), thread_name_prefix="bench-read") as pool:
        started = time.perf_counter()
        read = sum(pool.map(_read_all, copies.values()))
        seconds = time.perf_counter() - started
    if read != sum(per_copy.values()) or seconds <= 0:
        return {"why": f"read {read} bytes of {sum(per_copy.values())} in {seconds:.3f} s"}
    return {
        "bytes": read,
        "streams": len(copies),
        "seconds": seconds,
        "gbps": read / seconds / GB,
        "bytes_per_rank": max(per_copy.values()),
    }


def link_speed(scratch: Path, timeout: float) -> dict[str, Any]:
    """The link's speed between the simulated nodes (see the module, item 4): :func:`link_job`
    on :data:`NODES` simulated nodes, a payload the size of the largest copy of
    :func:`fast_copies`. Bytes, seconds per transfer, GB/s (their median); or ``{"why": ...}``."""
    from lightning_mcore_ckpt.testing import run_nodes

    root = scratch / "link"
    try:
        found = fast_copies(scratch / "snapshot")
        if isinstance(found, str):
            return {"why": f"no payload to size it by: {found}"}
        size = max(sum(p.stat().st_size for p in paths) for paths in found[1].values())
        shutil.rmtree(root, ignore_errors=True)
        seconds = run_nodes(
            link_job,
            NODES,
            PER_NODE,
            {"bytes": size},
            node_dir=root / "local",
            timeout=min(timeout, 300.0),
        )[0]
    except Exception as err:  # noqa: BLE001 - a failed job: reported as the figure's why
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        return {"why": f"the link job failed: {last}"}
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the nodes' directories too (local.nodes)
    median = statistics.median(seconds) if seconds else 0.0
    if median <= 0:
        return {"why": f"no timed transfer ({seconds})"}
    return {"bytes": size, "transfers_s": seconds, "seconds": median, "gbps": size / median / GB}


def round_order(rows: list[str], r: int) -> list[str]:
    """Round ``r``'s order (from 1): the recovery rows in the loads' order
    (``load_rounds.order_of``: each row leads a round in turn, the others after it forward
    in odd rounds and in reverse in even ones), each speed measured right after the row it
    bounds (:data:`SPEED_AFTER`: the medium's read after the own copies, the link after the
    peer copies, ``/dev/shm``'s read after :data:`SHM_ROW`)."""
    from benchmarks.load_rounds import order_of

    ordered = order_of(tuple(rows), r - 1)
    return [item for row in ordered for item in (row, SPEED_AFTER.get(row)) if item is not None]


def _speed_line(got: dict[str, Any]) -> str:
    if got.get("gbps") is None:
        return f"not measured: {got.get('why')}"
    streams = f", {got['streams']} stream(s)" if got.get("streams") else ""
    return (
        f"{got['gbps']:.2f} GB/s ({got['bytes'] / MiB:.0f} MiB in {got['seconds']:.3f} s{streams})"
    )


def measure(
    scratch: Path,
    size: str,
    repeats: int,
    timeout: float,
    throttled: ThrottledDir | None = None,
    s3: S3Stand | None = None,
    shm_root: Path | None = None,
    optimizer: str = "adamw",
) -> dict[str, Any]:
    """The training run, then ``repeats`` rounds of the recovery rows and the speeds (see the
    module). ``shm_root``: where :data:`SHM_ROW`'s nodes' directories go (``/dev/shm``;
    ``None``: the row is not asked for). ``optimizer``: the workload's (``load_rounds``'
    ``OPTIMIZER_NAMES``)."""
    print(f"== fast tier, state {size}: the training run", flush=True)
    started = time.perf_counter()
    saves = prepare(scratch, size, timeout, optimizer)
    print(f"   {time.perf_counter() - started:.0f} s", flush=True)
    published = None
    if s3 is not None:  # the step the job left, into the bucket: the S3 row's persistent tier
        published = s3.publish(scratch / "snapshot" / "shared" / "ckpt", PERSISTED)
        print(
            f"   step {PERSISTED} published to {s3.url}: {published['objects']} objects, "
            f"{published['upload_bytes'] / MiB:.0f} MiB in {published['upload_time_s']:.2f} s",
            flush=True,
        )
    shm, shm_why = (None, "not asked") if shm_root is None else ShmDir.open(scratch, shm_root)
    if shm is None:
        print(f"   {SHM_ROW}: not measured: {shm_why}", flush=True)
    try:
        rows = rows_measured(throttled is not None, s3 is not None, shm is not None)
        launches: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
        speeds: dict[str, list[dict[str, Any]]] = {MEDIUM: [], LINK: [], SHM_MEDIUM: []}
        for r in range(1, repeats + 1):
            for row in round_order(rows, r):
                if row in speeds:  # the speeds of the fast tier's own bounds (item 4)
                    if row == MEDIUM:
                        figure = read_cold(scratch)
                    elif row == LINK:
                        figure = link_speed(scratch, timeout)
                    else:
                        assert shm is not None
                        figure = read_shm(scratch, shm)
                    speeds[row].append(figure)
                    print(f"round {r}, {row}: {_speed_line(figure)}", flush=True)
                    continue
                got = recover_once(
                    scratch, row, size, timeout, throttled, s3, shm, optimizer=optimizer
                )
                launches[row].append(got)
                _print_launch(r, row, got)
    finally:
        if shm is not None:
            shm.close()
    return {
        "size": size,
        "optimizer": optimizer,
        "saves": saves,
        "launches": launches,
        "throttle": throttled.describe() if throttled is not None else None,
        "s3": s3.describe() if s3 is not None else None,
        "s3_published": published,
        "shm": shm.describe() if shm is not None else None,
        "shm_why": shm_why or None,
        "medium_reads": speeds[MEDIUM],
        "link_transfers": speeds[LINK],
        "shm_reads": speeds[SHM_MEDIUM],
    }


def _print_launch(r: int, row: str, got: dict[str, Any]) -> None:
    """A launch's line in the log."""
    rec = got["recovery"] or {}
    print(
        f"round {r}, {row}: first step at {got['phases']['first step starts']:.2f} s, "
        f"step {got['resumed_step']} from the {rec.get('tier')} tier "
        f"({rec.get('ranks_from_peers')} rank(s) from peers), recovery "
        f"{rec.get('time_s', float('nan')):.2f} s"
        + (
            f", {got['throttled_read_bytes'] / MiB:.0f} MiB read through the throttle"
            if got.get("throttled_read_bytes") is not None
            else ""
        )
        + (
            f", S3 server CPU {got['server_cpu_s']:.2f} s, "
            f"{got['server_dropped_bytes'] / MiB:.0f} MiB of its files dropped from the "
            "page cache first"
            if got.get("server_cpu_s") is not None
            else ""
        ),
        flush=True,
    )


class ShmDir:
    """Each simulated node's fast-tier directory on ``/dev/shm`` (a tmpfs: files in memory,
    kept while the host runs; the medium of a process crash's recovery): a fresh
    ``<root>/lmc-bench-fast-tier-<pid>-<random>`` made by :meth:`open`, under it the launch's
    ``node_dir`` (``local``) and every node's own directory (``local.nodes/node<i>``, as
    ``run_nodes`` lays them out: the same path on every node, each node seeing its own there).
    A hard link cannot cross file systems: before each launch (and each read of
    :func:`read_shm`) :meth:`place` copies the snapshot's nodes' directories there afresh, and
    :meth:`clear` removes them after it, so the snapshot is never changed and every launch
    finds what the killed job left. :meth:`close` removes the directory, on failure too.

    :meth:`open` returns ``None`` and why where ``root`` is absent, not writable, or without
    :data:`SHM_MARGIN` x the bytes placed + :data:`SHM_SPARE` free."""

    def __init__(self, root: Path, base: Path, needed: int) -> None:
        self.root, self.base, self.needed = root, base, needed

    @classmethod
    def open(cls, scratch: Path, root: Path = SHM) -> tuple[ShmDir | None, str]:
        """Set it up under ``root`` for the snapshot in ``scratch`` (its nodes' directories:
        what each launch places there)."""
        import tempfile

        from benchmarks import workloads

        source = node_storage_root(scratch / "snapshot" / "local")
        if not root.is_dir():
            return None, f"{root} is absent"
        if not os.access(root, os.W_OK | os.X_OK):
            return None, f"{root} is not writable"
        needed = workloads.tree_bytes(source) if source.is_dir() else 0
        wanted = SHM_MARGIN * needed + SHM_SPARE
        free = shutil.disk_usage(root).free
        if free < wanted:
            return None, (
                f"{root} has {free / MiB:.0f} MiB free, {wanted / MiB:.0f} MiB needed "
                f"({SHM_MARGIN} x the nodes' directories, {needed / MiB:.0f} MiB, + "
                f"{SHM_SPARE / MiB:.0f} MiB)"
            )
        try:
            base = Path(tempfile.mkdtemp(prefix=f"lmc-bench-fast-tier-{os.getpid()}-", dir=root))
        except OSError as err:
            return None, f"no directory can be made in {root}: {err}"
        return cls(root, base, needed), ""

    @property
    def node_dir(self) -> Path:
        """The launch's ``node_dir``: the same path on every node."""
        return self.base / "local"

    def place(self, snapshot: Path) -> Path:
        """``snapshot``'s nodes' directories copied under :attr:`node_dir` (any earlier copy
        removed first); :attr:`node_dir`."""
        self.clear()
        shutil.copytree(
            node_storage_root(snapshot / "local"), node_storage_root(self.node_dir), symlinks=True
        )
        return self.node_dir

    def clear(self) -> None:
        """The nodes' directories and ``node_dir`` removed (the base stays)."""
        shutil.rmtree(node_storage_root(self.node_dir), ignore_errors=True)
        shutil.rmtree(self.node_dir, ignore_errors=True)

    def describe(self) -> str:
        from lightning_mcore_ckpt.fast import media

        kind = media.file_system(self.root) or "?"
        return (
            f"each node's directory under `{self.root}` ({kind}: read from memory, "
            "so nothing is dropped from the page cache before its launches), copied there from "
            f"the snapshot before each launch ({self.needed / MiB:.0f} MiB, both nodes), removed "
            "after it"
        )

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


class ThrottledDir:
    """A shared directory whose reads are throttled by the kernel: an ext4 file system on a
    loop device (``losetup --direct-io=on``: no second page cache under it), its reads capped
    at ``NODES x THROTTLE_MIB_S`` by the block I/O controller (cgroup v1
    ``blkio.throttle.read_bps_device``, or v2 ``io.max``'s ``rbps``) of a cgroup this process
    joins before the simulated nodes are forked, so that every rank is in it. The cap is on the
    device: other disks, and the nodes' own directories, are not throttled. The simulated nodes
    share the one cap, so a node gets ``THROTTLE_MIB_S`` while both read (the persistent row:
    both ranks load at once).

    :meth:`open` returns ``None`` and why where it cannot be set up (not root, no loop device,
    no block I/O controller)."""

    def __init__(self, image: Path, mount: Path, device: str, cgroup: Path, rate: int) -> None:
        self.image, self.mount, self.device, self.cgroup, self.rate = (
            image,
            mount,
            device,
            cgroup,
            rate,
        )

    @classmethod
    def open(cls, scratch: Path, size_bytes: int) -> tuple[ThrottledDir | None, str]:
        """Set it up under ``scratch`` for a state of ``size_bytes`` (the shared directory
        holds several persistent steps of it)."""
        import subprocess

        rate = NODES * THROTTLE_MIB_S * MiB
        image, mount = scratch / "throttled.img", scratch / "throttled"
        v1 = Path("/sys/fs/cgroup/blkio")
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v1.is_dir():
            cgroup = v1 / f"lmc-bench-{os.getpid()}"
        elif v2.exists() and "io" in v2.read_text().split():
            cgroup = Path("/sys/fs/cgroup") / f"lmc-bench-{os.getpid()}"
        else:
            return None, "no block I/O controller (cgroup v1 blkio or v2 io)"
        device = ""
        try:
            with open(image, "wb") as f:  # sparse: blocks are taken as they are written
                f.truncate(size_bytes * 8 + 1024 * MiB)
            subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
            device = subprocess.run(
                ["losetup", "--find", "--show", "--direct-io=on", str(image)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            mount.mkdir()
            subprocess.run(["mount", device, str(mount)], check=True)
            numbers = subprocess.run(
                ["lsblk", "-dno", "MAJ:MIN", device], check=True, capture_output=True, text=True
            ).stdout.strip()
            cgroup.mkdir()
            if cgroup.parent == v1:
                (cgroup / "blkio.throttle.read_bps_device").write_text(f"{numbers} {rate}")
            else:
                (cgroup / "io.max").write_text(f"{numbers} rbps={rate}")
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        except (OSError, subprocess.CalledProcessError) as err:
            made = cls(image, mount, device, cgroup, rate)
            made.close()
            return None, f"the throttled directory cannot be set up here: {err}"
        return cls(image, mount, device, cgroup, rate), ""

    def describe(self) -> str:
        controller = "blkio.throttle.read_bps_device (cgroup v1)"
        if self.cgroup.parent != Path("/sys/fs/cgroup/blkio"):
            controller = "io.max rbps (cgroup v2)"
        return (
            f"ext4 on {self.device} (a loop device, direct I/O), reads capped at "
            f"{self.rate // MiB} MiB/s by {controller}: {THROTTLE_MIB_S} MiB/s per node, "
            f"{NODES} nodes"
        )

    def take(self, shared: Path) -> None:
        """Move the run's shared directory onto the throttled file system (a link stays)."""
        target = self.mount / "shared"
        shutil.copytree(shared, target, symlinks=True)
        shutil.rmtree(shared)
        shared.symlink_to(target)

    def read_bytes(self) -> int:
        """Bytes read from the throttled device by the processes of the cgroup so far (the
        check that the ranks' reads went through the cap)."""
        major_minor = subprocess_output(["lsblk", "-dno", "MAJ:MIN", self.device])
        if self.cgroup.parent == Path("/sys/fs/cgroup/blkio"):
            for line in (self.cgroup / "blkio.throttle.io_service_bytes").read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == major_minor and parts[1] == "Read":
                    return int(parts[2])
            return 0
        for line in (self.cgroup / "io.stat").read_text().splitlines():
            if line.startswith(major_minor + " "):
                fields = dict(f.split("=", 1) for f in line.split()[1:])
                return int(fields.get("rbytes", 0))
        return 0

    def clear(self) -> None:
        shutil.rmtree(self.mount / "shared", ignore_errors=True)

    def close(self) -> None:
        import subprocess

        parent = self.cgroup.parent
        if self.cgroup.is_dir():
            try:  # every process still in it (this one, the nodes' fork server) to the parent
                for pid in (self.cgroup / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):  # gone meanwhile
                        (parent / "cgroup.procs").write_text(pid)
                self.cgroup.rmdir()
            except OSError as err:
                print(f"   {self.cgroup} is left behind: {err}", file=sys.stderr)
        if self.mount.is_dir():
            subprocess.run(["umount", str(self.mount)], check=False)
        if self.device:
            subprocess.run(["losetup", "-d", self.device], check=False)
        self.image.unlink(missing_ok=True)


class S3Stand:
    """The persistent tier in an S3 bucket served on loopback: moto's S3 server
    (``tests/storage/_s3server.py``, as the tests' ``s3`` fixture and ``--only-s3`` run it), in a
    child process on 127.0.0.1, one bucket, the run under the prefix ``run``. Not throttled: the
    server shares this machine's CPUs with the ranks. It keeps an object of up to 8 MiB in
    memory and spools a larger one to an unlinked temporary file, which :meth:`drop_cache` drops
    from the page cache through the server's open files, so that a load reads the disk as the
    other rows do.

    :meth:`open` returns ``None`` and why where it cannot be set up (no boto3 or moto)."""

    PREFIX = "run"

    def __init__(self, server: Any, bucket: str) -> None:
        self.server, self.bucket = server, bucket
        self.baseline: dict[str, int] = {}
        """The bucket's objects once the step is published (name -> size), as each launch
        finds it."""

    @classmethod
    def open(cls, scratch: Path) -> tuple[S3Stand | None, str]:
        import importlib.util
        import uuid

        missing = [m for m in ("boto3", "moto") if importlib.util.find_spec(m) is None]
        if missing:
            return None, f"{' and '.join(missing)} not installed"
        sys.path.insert(0, str(HERE.parent / "tests" / "storage"))
        from _s3server import S3Server  # type: ignore[import-not-found]

        server = S3Server(scratch / "s3server")
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        try:
            server.start()
            server.create_bucket(bucket)
        except Exception as err:  # noqa: BLE001 - the server's or the client's, reported
            server.stop()
            return None, f"the S3 server cannot be started here: {err}"
        return cls(server, bucket), ""

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.PREFIX}"

    def env(self) -> dict[str, str]:
        """The variables that point a rank's client at the server."""
        return dict(self.server.env())

    @contextlib.contextmanager
    def _environ(self) -> Any:
        saved = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _store(self) -> Any:
        from lightning_mcore_ckpt.storage.object_store import ObjectStore

        return ObjectStore.from_url(self.url)

    def publish(self, ckpt: Path, step: int) -> dict[str, Any]:
        """Publish the committed ``global_step_<step>`` of the local ``dirpath`` ``ckpt`` into
        the bucket with the library's own uploader (``publication.publish_step``: every object,
        the listing checked against the seal, the marker, the tracker, as a commit to an
        ``s3://`` ``dirpath`` does); its figures and the bucket's object count."""
        from lightning_mcore_ckpt.format import layout
        from lightning_mcore_ckpt.storage import publication

        with self._environ():
            store = self._store()
            figures = publication.publish_step(store, layout.step_dir(ckpt, step))
            if step not in publication.published_steps(store):
                raise RuntimeError(f"step {step} is not published in {self.url}")
            self.baseline = store.list()
        return {**figures, "objects": len(self.baseline)}

    def records(self) -> list[dict[str, Any]]:
        """The bucket's ``fast_tier.jsonl`` (what a launch recorded), its lines parsed."""
        from lightning_mcore_ckpt.callback.fast_tier import RECORDS

        with self._environ():
            data = self._store().get_bytes(RECORDS)
        text = "" if data is None else data.decode("utf-8", errors="replace")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def reset(self) -> None:
        """The bucket as the next launch must find it: what a launch added (its lock, its
        records) deleted; an object of the published step changed or gone fails the run."""
        with self._environ():
            store = self._store()
            now = store.list()
            store.delete([k for k in now if k not in self.baseline])
            lost = [k for k, size in self.baseline.items() if now.get(k) != size]
        if lost:
            raise RuntimeError(f"a launch changed {len(lost)} objects of {self.url}: {lost[:3]}")

    def drop_cache(self) -> int:
        """The server's open regular files (its spooled objects) synced and dropped from the
        page cache; their bytes."""
        proc = self.server._proc
        if proc is None:
            return 0
        dropped = 0
        for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
            try:
                if not os.readlink(fd).startswith("/"):  # a socket, a pipe
                    continue
                with open(fd, "rb") as f:
                    info = os.fstat(f.fileno())
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    os.fsync(f.fileno())  # a dirty page is not dropped
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    dropped += info.st_size
            except OSError:  # closed meanwhile
                continue
        return dropped

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (user and system, every thread)."""
        from benchmarks.s3_nodes import process_cpu_s

        proc = self.server._proc
        return process_cpu_s(proc.pid) if proc is not None else 0.0

    def describe(self) -> str:
        import importlib.metadata

        return (
            f"moto {importlib.metadata.version('moto')}'s S3 server (`tests/storage/_s3server.py`"
            ", as the tests and `--only-s3` run it) on 127.0.0.1, in a process of its own "
            "sharing the machine's CPUs (it serves a ranged GET from the whole object, read "
            "from its spooled file); not throttled; the run's `dirpath` "
            f"`s3://<bucket>/{self.PREFIX}` with its default staging `local_dir` (node-local)"
        )

    def close(self) -> None:
        self.server.stop()


def subprocess_output(command: list[str]) -> str:
    import subprocess

    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def judge(fast_s: float | None, persistent_s: float | None, limit: float = RECOVERY_TARGET) -> str:
    """``MET`` when the fast tier's time is at most ``limit`` x the persistent tier's; ``MISSED``
    otherwise; ``—`` without both figures."""
    if fast_s is None or not persistent_s:
        return "—"
    return "MET" if fast_s <= limit * persistent_s else "MISSED"


def targets(rows: dict[str, dict[str, Any]]) -> list[tuple[str, str, float, float, str]]:
    """Each fast-tier row against each persistent stand-in measured: (fast row, persistent
    row, fast recovery + load s, persistent s, verdict), judged on recovery + load (from the
    model set up to the state loaded: what the tier changes)."""
    fast_rows = [r for r in rows if r.startswith("fast tier")]
    stand_ins = [r for r in rows if r.startswith("persistent tier")]
    return [
        (f, p, rows[f]["load_s"], rows[p]["load_s"], judge(rows[f]["load_s"], rows[p]["load_s"]))
        for p in stand_ins
        for f in fast_rows
    ]


def bound_s(
    bytes_per_rank: float, gbps: float, fixed_s: float, slack: float = BOUND_SLACK
) -> float:
    """A bound of the fast tier's recovery + load: ``slack`` x (``bytes_per_rank`` / the speed,
    ``gbps`` GB/s) + ``fixed_s``."""
    return slack * bytes_per_rank / (gbps * GB) + fixed_s


def judge_bound(measured_s: float | None, bound: float | None) -> str:
    """``MET`` when the measured time is at most the bound; ``MISSED`` otherwise, and without
    both figures (a bound not measured is not met)."""
    if measured_s is None or bound is None:
        return "MISSED"
    return "MET" if measured_s <= bound else "MISSED"


def fixed_costs(row: dict[str, Any]) -> tuple[dict[str, float], float]:
    """A fast-tier row's fixed costs (its summary's medians, s): each part of
    :data:`FIXED_PARTS` timed, and :data:`OTHER`, the rest of recovery + load once those and
    the parts that move bytes (:data:`BYTE_PARTS`) are taken off (not below 0); and the time
    in those parts that move bytes."""
    parts = row.get("parts", {})
    moving = sum(parts.get(label) or 0.0 for label in BYTE_PARTS)
    named = {label: parts[label] for label in FIXED_PARTS if parts.get(label) is not None}
    named[OTHER] = max(0.0, row["load_s"] - moving - sum(named.values()))
    return named, moving


def speed(runs: list[dict[str, Any]] | None, what: str) -> dict[str, Any]:
    """The median of a speed's measurements (one per round; ``gbps`` ``None`` with ``why``
    when none was made)."""
    got = [g for g in runs or [] if g.get("gbps")]
    if not got:
        why = next((g["why"] for g in runs or [] if g.get("why")), "not measured in this run")
        return {"gbps": None, "n": 0, "why": f"{what}: {why}"}
    values = [g["gbps"] for g in got]
    out = {
        "gbps": statistics.median(values),
        "min_gbps": min(values),
        "max_gbps": max(values),
        "n": len(got),
        "bytes": got[0]["bytes"],
    }
    for key in ("streams", "bytes_per_rank"):
        if key in got[0]:
            out[key] = got[0][key]
    return out


def bounds(
    rows: dict[str, dict[str, Any]],
    read: dict[str, Any],
    link: dict[str, Any],
    shm: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """The fast tier against its own bounds (see the module, item 4), by fast-tier row: own
    copies at :data:`BOUND_SLACK` x (bytes per rank / a node's share of ``read``) + fixed costs,
    peer copies at :data:`BOUND_SLACK` x (bytes per rank / min(``link``, that share)) + fixed
    costs, own copies on ``/dev/shm`` (:data:`SHM_ROW`) at :data:`BOUND_SLACK` x (bytes per
    rank / a node's share of ``shm``, ``/dev/shm``'s read speed) + fixed costs (:func:`speed`'s
    figures; the :data:`NODES` simulated nodes share one disk and one memory); each with its
    figures, its verdict (:func:`judge_bound`) and, where a figure is missing, ``why`` (``not
    measured: ...``)."""
    if shm is None:
        shm = {"gbps": None, "n": 0, "why": "/dev/shm's read speed: not measured in this run"}
    per_rank = read.get("bytes_per_rank") or shm.get("bytes_per_rank") or link.get("bytes")

    # The simulated nodes share one disk and one memory (a cluster's nodes each have their
    # own): a node's share of a medium is its read speed over the nodes, as all read at once.
    def share(got: dict[str, Any]) -> dict[str, Any]:
        return dict(got, gbps=None if got.get("gbps") is None else got["gbps"] / NODES)

    each = f"/ {NODES} nodes"
    specs = (
        (ROWS[0], [share(read)], f"read {each}", per_rank),
        (ROWS[1], [share(read), link], f"min(link, read {each})", per_rank),
        (SHM_ROW, [share(shm)], f"/dev/shm read {each}", shm.get("bytes_per_rank") or per_rank),
    )
    out: dict[str, dict[str, Any]] = {}
    for row, speeds, label, row_bytes in specs:
        got: dict[str, Any] = {
            "speed": label,
            "bytes_per_rank": row_bytes,
            "speed_gbps": None,
            "transfer_s": None,
            "fixed": {},
            "fixed_s": None,
            "bound_s": None,
            "measured_s": None,
            "bytes_s": None,
            "why": None,
        }
        missing = [g["why"] for g in speeds if g.get("gbps") is None]
        if row not in rows:
            missing.insert(0, "the row was not launched")
        else:
            fixed, moving = fixed_costs(rows[row])
            got.update(
                fixed=fixed,
                fixed_s=sum(fixed.values()),
                measured_s=rows[row]["load_s"],
                bytes_s=moving,
            )
        if not missing and row_bytes:
            got["speed_gbps"] = min(g["gbps"] for g in speeds)
            got["transfer_s"] = bound_s(row_bytes, got["speed_gbps"], 0.0)
            got["bound_s"] = got["transfer_s"] + got["fixed_s"]
        elif not missing:
            missing.append("the bytes per rank are not known")
        if missing:
            got["why"] = "not measured: " + "; ".join(missing)
        got["verdict"] = judge_bound(got["measured_s"], got["bound_s"])
        out[row] = got
    return out


# --- the figures ------------------------------------------------------------------------------


def steps_lost(
    fast: int, persistent: int, fast_in_flight: float, persistent_in_flight: float
) -> tuple[float, float]:
    """Mean steps lost at a failure at a uniformly random step, each tier alone.

    A save started at step ``kC`` counts ``d`` steps later (its time in flight, in steps). A
    failure ``t`` steps after ``kC`` (``t`` uniform on ``[0, C)``) loses ``t`` steps when
    ``t >= d``, else ``C + t`` (the step before counts): the mean is
    ``(1/C)(int_0^d (C + t) dt + int_d^C t dt) = C/2 + d`` for ``d <= C``. With both tiers, the
    newest counted step of either is resumed: the fast tier's figure (it saves the steps the
    persistent tier does, or more often)."""
    return fast / 2 + fast_in_flight, persistent / 2 + persistent_in_flight


def _med(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _parts_table(rows: dict[str, dict[str, Any]], parts: Any) -> list[str]:
    """A table of the rows' median seconds in each of ``parts`` (``(label, ..., ...)``)."""
    labels = [label for label, _, _ in parts]
    return [
        "| resumed from | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
        *(
            f"| {row} | " + " | ".join(_f(rows[row]["parts"].get(label)) for label in labels) + " |"
            for row in rows
        ),
    ]


def _per_rank_medians(launches: list[list[float | None] | None]) -> list[float | None]:
    """Per rank, the median of the launches' figures (each launch's list in rank order;
    ``None`` or short where it was not measured)."""
    figures = [launch or [] for launch in launches]
    return [_med([f[k] if k < len(f) else None for f in figures]) for k in range(NODES * PER_NODE)]


def _memory_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each rank's peak resident memory during the recovery and load, above its level once
    the model was set up (medians of the launches); nothing where it was not measured."""
    if not any(v is not None for row in rows.values() for v in row.get("peak_extra_mib", [])):
        return []
    ranks = range(NODES * PER_NODE)
    return [
        "Memory during the recovery and load (each rank's peak resident memory from the model "
        "set up to the state loaded, above its level at the start, MiB: `VmHWM`, reset through "
        f"`/proc/self/clear_refs`; medians of the launches; in the peer rows rank {NODES - 1}'s "
        "node holds rank 0's copy and serves it):",
        "",
        "| resumed from | " + " | ".join(f"rank {k}" for k in ranks) + " |",
        "| --- |" + " --- |" * len(ranks),
        *(
            f"| {name} | "
            + " | ".join(_f(v, 0) for v in (row.get("peak_extra_mib") or [None] * len(ranks)))
            + " |"
            for name, row in rows.items()
        ),
        "",
    ]


def _f(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    saves = result["saves"]
    fast = saves["fast_saves"][1:] or saves["fast_saves"]  # the first allocates the buffers
    persistent = saves["persistent_saves"][1:] or saves["persistent_saves"]
    out: dict[str, Any] = {
        "fast": {
            k: _med([s.get(k) for s in fast])
            for k in (
                "blocking_time_s",
                "hook_s",
                "total_time_s",
                "write_time_s",
                "replication_time_s",
                "size_bytes",
                "copied_bytes",
            )
        },
        "persistent": {
            k: _med([s.get(k) for s in persistent])
            for k in ("blocking_time_s", "hook_s", "total_time_s", "write_time_s", "size_bytes")
        },
        "fast_parts": {
            name: _med([s.get("parts", {}).get(name) for s in fast])
            for name in (
                "fast save, in all",
                "report",
                "dump_checkpoint",
                "training_state",
                "writer.save",
                "after writer.save",
            )
        },
        "first_fast": saves["fast_saves"][0] if saves["fast_saves"] else None,
        "first_persistent": saves["persistent_saves"][0] if saves["persistent_saves"] else None,
        "n_fast": len(fast),
        "n_persistent": len(persistent),
        "step_s": saves["step_s"],
        "hook_without_save_s": saves["hook_without_save_s"],
    }
    rows = {}
    for row, launches in result["launches"].items():
        firsts = [g["phases"]["first step starts"] for g in launches]
        recs = [g["recovery"] or {} for g in launches]
        rows[row] = {
            "first_step_s": statistics.median(firsts),
            "min_s": min(firsts),
            "max_s": max(firsts),
            "n": len(firsts),
            "phases": {p: statistics.median(g["phases"][p] for g in launches) for p in PHASES},
            "load_s": statistics.median(
                g["phases"]["state loaded"] - g["phases"]["model set up"] for g in launches
            ),
            "recovery_time_s": _med([r.get("time_s") for r in recs]),
            "server_cpu_s": _med([g.get("server_cpu_s") for g in launches]),
            "server_dropped_bytes": _med([g.get("server_dropped_bytes") for g in launches]),
            "parts": {
                label: _med([g.get("parts", {}).get(label) for g in launches])
                for label, _, _ in ALL_PARTS
            },
            "peak_extra_mib": _per_rank_medians([g.get("peak_extra_mib") for g in launches]),
            "tier": sorted({str(r.get("tier")) for r in recs}),
            "ranks_from_peers": sorted({r.get("ranks_from_peers") for r in recs}, key=str),
            "resumed_step": sorted({g["resumed_step"] for g in launches}),
        }
    out["rows"] = rows
    read = speed(result.get("medium_reads"), "the medium's read speed")
    link = speed(result.get("link_transfers"), "the link")
    shm_runs = result.get("shm_reads") or (
        [{"why": result["shm_why"]}] if result.get("shm_why") else None
    )
    shm = speed(shm_runs, "/dev/shm's read speed")
    out["bounds"] = {"read": read, "link": link, "shm": shm, "rows": bounds(rows, read, link, shm)}
    return out


def _s3_stand_in(result: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """The S3 stand-in's line under the comparison: what served it, how the step got there."""
    if not result.get("s3"):
        return f"`{S3_ROW}`: not measured ({result.get('s3_why') or 'not asked'})."
    text = f"`{S3_ROW}`: {result['s3']}."
    published = result.get("s3_published")
    if published:
        text += (
            f" The training run saved to the shared directory; its committed step {PERSISTED} "
            "was published into the bucket once, after it, by the library's uploader "
            f"(`publication.publish_step`, as a commit to an `s3://` `dirpath` does: "
            f"{published['objects']} objects, {published['upload_bytes'] / MiB:.0f} MiB, "
            f"{published['upload_time_s']:.2f} s), so every row loads the same step."
        )
    dropped = rows.get(S3_ROW, {}).get("server_dropped_bytes")
    text += (
        " Before each launch the server's spooled objects"
        + ("" if dropped is None else f" ({dropped / MiB:.0f} MiB)")
        + " were dropped from the page cache; after it, the objects the launch added (its "
        "lock, `fast_tier.jsonl`) were deleted."
    )
    cpu = rows.get(S3_ROW, {}).get("server_cpu_s")
    if cpu is not None:
        text += f" The S3 server's CPU time per launch: {cpu:.2f} s (median)."
    return text


def _verdict(got: dict[str, Any]) -> str:
    return got["verdict"] + (f" ({got['why']})" if got.get("why") else "")


def bounds_table(figures: dict[str, Any]) -> list[str]:
    """The report's section "The fast tier against its own bounds" (:func:`bounds`'s figures,
    as :func:`summarise` stores them)."""
    read, link, rows = figures["read"], figures["link"], figures["rows"]
    shm = figures.get("shm") or {"gbps": None, "why": "not measured in this run"}

    def measured(got: dict[str, Any], what: str) -> str:
        if got.get("gbps") is None:
            return f"{what}: not measured ({got['why']})"
        return (
            f"{what}: {got['gbps']:.2f} GB/s (median of {got['n']}; "
            f"{got['min_gbps']:.2f}\u2013{got['max_gbps']:.2f})"
        )

    per_rank = next((g["bytes_per_rank"] for g in rows.values() if g["bytes_per_rank"]), None)
    lines = [
        "#### The fast tier against its own bounds",
        "",
        f"Targets: own copies, recovery + load at most {BOUND_SLACK} x (bytes per rank / the "
        f"medium's read speed) + the fixed costs; peer copies, at most {BOUND_SLACK} x (bytes "
        "per rank / min(link, read speed)) + the fixed costs; own copies on `/dev/shm`, at "
        f"most {BOUND_SLACK} x (bytes per rank / `/dev/shm`'s read speed) + the fixed costs; "
        "the speeds measured in this run, once a round, interleaved with the launches above. "
        f"The simulated nodes share one disk and one memory, which all read at once: a node's "
        f"read speed is the medium's over {NODES}.",
        "",
        "| fast tier | bytes per rank, MiB | speed, GB/s | "
        f"{BOUND_SLACK} x bytes / speed, s | fixed costs, s | bound, s | recovery + load, s "
        "(median) | of which reading, checking, fetching, s | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {row} | {_f(None if g['bytes_per_rank'] is None else g['bytes_per_rank'] / MiB, 0)}"
            f" | {_f(g['speed_gbps'])} ({g['speed']}) | {_f(g['transfer_s'])} | "
            f"{_f(g['fixed_s'])} | {_f(g['bound_s'])} | {_f(g['measured_s'])} | "
            f"{_f(g['bytes_s'])} | {_verdict(g)} |"
            for row, g in rows.items()
        ),
        "",
        "The medium: "
        + measured(read, "its cold read speed")
        + (
            f", reading node {NODES - 1}'s copies of fast step {KILLED_AT} (its own rank's and "
            f"its peer's: what the rank serving the peer copies reads; {read['streams']} "
            f"copies, one thread each, as the recovery reads a rank's copies; "
            f"{read['bytes'] / MiB:.0f} MiB, not hashed), synced and dropped from the page "
            "cache first"
            if read.get("gbps") is not None
            else ""
        )
        + ". The link: "
        + measured(link, "gloo on loopback between the simulated nodes")
        + (
            f", a uint8 tensor of one rank's copy ({link['bytes'] / MiB:.0f} MiB) sent from "
            f"node {NODES - 1} to node 0, {LINK_TRANSFERS} timed transfers a round after one "
            "that warms the connection, each round's median"
            if link.get("gbps") is not None
            else ""
        )
        + ". `/dev/shm`: "
        + measured(shm, "its read speed")
        + (
            f", reading each node's own copy of fast step {KILLED_AT} (what the ranks of "
            f"`{SHM_ROW}` read; {shm['streams']} copies, one thread each; "
            f"{shm['bytes'] / MiB:.0f} MiB, not hashed), copied onto `/dev/shm` from the "
            "snapshot first; nothing dropped from the page cache: a tmpfs's files are the page "
            "cache, the read is from memory"
            if shm.get("gbps") is not None
            else ""
        )
        + "."
        + (
            f" Bytes per rank: one rank's copy (seal, state and `extra/` file), "
            f"{per_rank / MiB:.0f} MiB."
            if per_rank
            else ""
        ),
        "",
        "Fixed costs in each bound (medians of the slower rank's seconds, as in the tables "
        f"above): {', '.join(f'`{p}`' for p in FIXED_PARTS)} where timed, and `{OTHER}`: the rest "
        f"of recovery + load once those and the reading, checking and fetching "
        f"({', '.join(f'`{p}`' for p in BYTE_PARTS)}) are taken off.",
        "",
    ]
    for row, g in rows.items():
        if not g["fixed"]:
            lines.append(f"- {row}: none (the row was not launched).")
            continue
        named = ", ".join(f"`{k}` {v:.3f}" for k, v in g["fixed"].items())
        left = [p for p in FIXED_PARTS if p not in g["fixed"]]
        lines.append(
            f"- {row}: {named}; {g['fixed_s']:.3f} s in all"
            + (f" (not timed: {', '.join(f'`{p}`' for p in left)})" if left else "")
            + "."
        )
    lines += [
        "",
        f"The simulated nodes share one disk: in the own copies' launches the {NODES} ranks "
        f"read their copies at once ({NODES} streams, {NODES} copies' bytes on it), as the read "
        "measured here does; on machines of their own each disk would serve one. The nodes' "
        f"directories are on that disk, but for `{SHM_ROW}`'s: those are on `/dev/shm`, in the "
        "memory the ranks share (a process crash's recovery on the same hosts: every node's "
        "directory intact).",
    ]
    return lines


def report(result: dict[str, Any], summary: dict[str, Any], machine: str, command: str) -> str:
    fast, pers = summary["fast"], summary["persistent"]
    size = result["size"]
    rows = summary["rows"]
    base = rows[ROWS[2]]["first_step_s"]
    lines = [
        f"### Fast tier: state {size} on {NODES} simulated nodes x {PER_NODE} rank (TP={NODES})",
        "",
        machine,
        "",
        f"Command: `{command}`. One training run (fast tier every {FAST} steps, R = 1, "
        f"max_to_keep 2; persistent tier every {PERSIST} steps, async), killed once fast step "
        f"{KILLED_AT} was complete (persistent step {PERSISTED}); then every recovery row "
        f"launched {rows[ROWS[0]]['n']} time(s), interleaved, from a copy of what the killed "
        "job left, its files dropped from the page cache.",
        "",
        "#### Recovery: launch -> first resumed step",
        "",
        "| resumed from | launch -> first step, s (median) | min\u2013max s | persistent / this | "
        "model set up, s | state loaded, s | recovery + load, s | persistent / this | "
        "recovery `time_s` | step | ranks from peers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_load = rows[ROWS[2]]["load_s"]
    for row in rows:
        got = rows[row]
        ratio = "—" if row == ROWS[2] else f"{base / got['first_step_s']:.2f}"
        load_ratio = "—" if row == ROWS[2] else f"{base_load / got['load_s']:.2f}"
        lines.append(
            f"| {row} | {got['first_step_s']:.2f} | {got['min_s']:.2f}\u2013{got['max_s']:.2f} | "
            f"{ratio} | {got['phases']['model set up']:.2f} | "
            f"{got['phases']['state loaded']:.2f} | {got['load_s']:.2f} | {load_ratio} | "
            f"{_f(got['recovery_time_s'])} | "
            f"{','.join(map(str, got['resumed_step']))} "
            f"({'/'.join(got['tier'])}) | {','.join(map(str, got['ranks_from_peers']))} |"
        )
    lines += [
        "",
        "Phases are seconds since the launch, the slowest rank's: the model set up "
        "(`on_fit_start`: process group, model, optimizer), the state loaded "
        "(`on_train_start`: the recovery and the load), the first step starting "
        "(`on_train_batch_start`); recovery + load: from the model set up to the state "
        "loaded, per launch; `persistent / this`: above 1, this row is faster. `time_s`: the "
        "recovery's own record in `fast_tier.jsonl` "
        "(finding the step together, checking the copies to be read against their seals, "
        "fetching the missing ones): not the load.",
        "",
        "Where the recovery and load went (medians of the slower rank's seconds in each "
        "function, nested ones inside the others; `load, in all` contains the recovery):",
        "",
        *_parts_table(rows, RECOVERY_PARTS),
        "",
        "Where the load went once the recovery had chosen (the same medians; `rank state, in "
        "all`: the fast tier's `state_<r>.pt` loaded from the bytes the recovery checked, of "
        "which `unpickle it` and `into model and optimizer` are parts; `persistent: ...`: "
        "Megatron-Core's loads of the persistent tier; `optimizer state made`: the state a load "
        "fills, made before it, in both tiers):",
        "",
        *_parts_table(rows, LOAD_PARTS),
        "",
        *_memory_table(rows),
        "#### The fast tier against each persistent stand-in",
        "",
        f"Target: the fast tier's recovery + load at most {RECOVERY_TARGET} x the persistent "
        "tier's (medians of the launches above).",
        "",
        "| fast tier | persistent stand-in | fast, s | persistent, s | fast / persistent | "
        "verdict |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {f} | {p} | {fs:.2f} | {ps:.2f} | {fs / ps:.2f} | {verdict} |"
            for f, p, fs, ps, verdict in targets(rows)
        ),
        "",
        "Stand-ins: `persistent tier`: the shared directory on the same local disk as the "
        "nodes' own. "
        + (
            f"`{THROTTLED}`: {result['throttle']}."
            if result.get("throttle")
            else f"`{THROTTLED}`: not measured ({result.get('throttle_why') or 'not asked'})."
        )
        + " "
        + _s3_stand_in(result, rows)
        + " "
        + (
            f"`{SHM_ROW}`: the own copies' launch with {result['shm']}."
            if result.get("shm")
            else f"`{SHM_ROW}`: not measured ({result.get('shm_why') or 'not asked'})."
        ),
        "",
        *bounds_table(summary["bounds"]),
        "",
        "#### Blocking per save (the same run, side by side)",
        "",
        "| save | blocking, s (library) | `on_train_batch_end`, s (slowest rank) | "
        "total, s | write, s | replication, s | bytes per rank | saves |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| fast tier (`fast_blocking_time_s`, rank 0) | {_f(fast['blocking_time_s'], 3)} | "
        f"{_f(fast['hook_s'], 3)} | {_f(fast['total_time_s'])} | {_f(fast['write_time_s'])} | "
        f"{_f(fast['replication_time_s'])} | {_f((fast['size_bytes'] or 0) / MiB, 0)} MiB | "
        f"{summary['n_fast']} |",
        f"| persistent tier, async (`blocking_time_s`, slowest rank) | "
        f"{_f(pers['blocking_time_s'], 3)} | {_f(pers['hook_s'], 3)} | "
        f"{_f(pers['total_time_s'])} | {_f(pers['write_time_s'])} | — | "
        f"{_f((pers['size_bytes'] or 0) / NODES / MiB, 0)} MiB | {summary['n_persistent']} |",
    ]
    if fast["blocking_time_s"] and pers["blocking_time_s"] and fast["hook_s"] and pers["hook_s"]:
        lines += [
            "",
            f"Fast / persistent blocking: {fast['blocking_time_s'] / pers['blocking_time_s']:.2f}"
            f" (library figures), {fast['hook_s'] / pers['hook_s']:.2f} (the hook's wall "
            f"time). A step without a save: {_f(summary['step_s'], 3)} s of training, "
            f"{_f(summary['hook_without_save_s'], 4)} s in the hook. Medians of every save but "
            "the first of each tier (which allocates its host buffers: fast "
            f"{_f((summary['first_fast'] or {}).get('blocking_time_s'), 3)} s, persistent "
            f"{_f((summary['first_persistent'] or {}).get('blocking_time_s'), 3)} s); every "
            "save in flight was waited for before each save step, outside the figures.",
            "",
            "The fast save's time on the training thread, by part (medians, slowest rank, s): "
            + ", ".join(f"`{k}` {_f(v, 3)}" for k, v in summary["fast_parts"].items())
            + " (`fast save, in all`: the callback's `_fast_save`, the rest of the hook being "
            "Lightning's `ModelCheckpoint`; `writer.save`: what `fast_blocking_time_s` counts, "
            "and the wait for the save before; `after writer.save`: from its return to the "
            "hook's, the background thread running).",
        ]
    step_s = summary["step_s"] or 0.0
    d_fast = (fast["total_time_s"] or 0.0) / step_s if step_s else 0.0
    d_pers = (pers["total_time_s"] or 0.0) / step_s if step_s else 0.0
    lines += [
        "",
        "#### Steps lost at a failure (arithmetic)",
        "",
        "A failure at a uniformly random step loses, on average, half a cadence plus the save "
        "in flight: `C/2 + d`, where `d` is the time from a save's start until it counts, in "
        "steps (a failure during that time falls back to the save before). With both tiers, "
        "the fast tier's figure (the newest counted step of either is resumed). Here "
        f"`d` is this run's total save time over its step time ({_f(step_s, 3)} s, a small "
        f"model on CPU): fast {d_fast:.1f} steps, persistent {d_pers:.1f}; at scale a step "
        "takes seconds and `d` is a step or two.",
        "",
        "| fast / persistent cadence | lost, fast tier (d = 0) | lost, persistent only "
        "(d = 0) | ratio | lost, fast (this run's d) | lost, persistent (this run's d) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f, p in CADENCES:
        lf, lp = steps_lost(f, p, 0.0, 0.0)
        mf, mp = steps_lost(f, p, d_fast, d_pers)
        lines.append(f"| {f} / {p} | {lf:.0f} | {lp:.0f} | {lp / lf:.0f}x | {mf:.1f} | {mp:.1f} |")
    lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``--only-fast-tier``: the tables, written to ``--out``."""
    from lightning_mcore_ckpt.testing import nodes_unavailable

    size = "quick" if args.quick else (args.sizes or "1G")
    if size not in ("quick", "256M", "1G"):  # 4G: 2 GiB a rank, staged and copied, is too much
        print(
            f"python -m benchmarks --only-fast-tier: --sizes {args.sizes}: pass one state, "
            f"256M or 1G (or --quick)",
            file=sys.stderr,
        )
        return 2
    from benchmarks.load_rounds import OPTIMIZER_NAMES

    optimizer = args.optimizers or "adamw"
    if optimizer not in OPTIMIZER_NAMES:
        print(
            f"python -m benchmarks --only-fast-tier: --optimizers {optimizer}: pass one of "
            f"{', '.join(OPTIMIZER_NAMES)}",
            file=sys.stderr,
        )
        return 2
    why = nodes_unavailable()
    if why is not None:
        print(f"python -m benchmarks --only-fast-tier: {why}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE.parent))
    repeats = 1 if args.quick else args.repeats
    scratch = Path(args.dir).resolve() / "fast-tier"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    started = time.perf_counter()
    state_bytes = {"quick": 64 * MiB, "256M": 256 * MiB, "1G": 1024 * MiB}[size]
    # The S3 server first: outside the throttled directory's cgroup.
    s3, s3_why = S3Stand.open(scratch)
    if s3 is None:
        print(f"   {S3_ROW}: not measured: {s3_why}", flush=True)
    throttled, why = ThrottledDir.open(scratch, state_bytes)
    if throttled is None:
        print(f"   {THROTTLED}: not measured: {why}", flush=True)
    try:
        result = measure(
            scratch,
            size,
            repeats,
            600 if args.quick else 3600,
            throttled,
            s3,
            shm_root=SHM,
            optimizer=optimizer,
        )
        result["throttle_why"] = why or None
        result["s3_why"] = s3_why or None
    finally:
        if throttled is not None:
            throttled.close()
        if s3 is not None:
            s3.close()
        shutil.rmtree(scratch, ignore_errors=True)
    machine = machine_line(
        f"Python {platform.python_version()}; every node's directory and the shared one on "
        f"`{args.dir}`'s disk (the nodes' directories of `{SHM_ROW}` on `{SHM}`); gloo on "
        f"loopback; {time.perf_counter() - started:.0f} s in all."
    )
    command = "python -m benchmarks --only-fast-tier " + (
        "--quick" if args.quick else f"--sizes {size} --repeats {repeats}"
    )
    workload = "" if optimizer == "adamw" else f"-{optimizer}"
    if workload:
        command += f" --optimizers {optimizer}"
    summary = summarise(result)
    table = report(result, summary, machine, command)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (
        f"{time.strftime('%Y-%m-%d', time.gmtime())}-{socket.gethostname()}-fast-tier-{size}"
        f"{workload}"
    )
    (out / f"{stem}.md").write_text(table)
    raw = {"machine": machine, "command": command, "summary": summary, **result}
    (out / f"{stem}.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    print(table)
    print(f"results: {out / stem}.md / .json")
    return 0
