"""Which ranks share the checkpoint directory, found at setup: one directory for the whole job,
or one per node (nodes that share no file system).

Every rank must name the same path (the step a rank writes is named by rank 0). Whether the
ranks also see the same *directory* there is found by looking: each node's local rank 0 writes a
probe file in it, and every rank looks for the probes. A rank's directory leader is the lowest
of those whose probe it sees. One leader for the job is a shared directory, as on one node or
on a shared file system. One per node is a node-local directory: the local tier of an
``s3://`` ``dirpath`` on a cluster without a shared file system, where each node writes its
ranks' files and uploads them itself (:mod:`~lightning_mcore_ckpt.storage.node_parts`); what
cannot work that way is refused here, on every rank, before anything is written.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.storage.store_tier import StoreTier

if TYPE_CHECKING:
    from collections.abc import Sequence

    import lightning.pytorch as pl

    from lightning_mcore_ckpt.callback._config import CheckpointConfig
    from lightning_mcore_ckpt.storage.tier import Tier

__all__ = ["Sharing", "leaders_of", "probe_sharing", "share_directory"]

_PROBE = ".lmc-probe-"


def share_directory(
    trainer: pl.Trainer, root: Path, config: CheckpointConfig, tiers: Sequence[Tier], stage: str
) -> None:
    """Collective, at the setup of ``fit``: check that every rank names ``root`` (the local directory), find
    which ranks share it, refuse what a node-local directory cannot do, and tell the writer and
    the store's tier who writes and uploads on each node. Every rank raises the same error."""
    import torch.distributed as dist

    if stage != "fit":  # nothing is written: the directory is only read
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    argument = "local_dir" if config.store is not None else "dirpath"
    _same_path(root, argument, config)
    leaders = leaders_of(trainer, root)
    if len(set(leaders)) == 1:
        return
    _refuse_node_local(config, root, argument, leaders)
    store = tiers[-1]
    assert isinstance(store, StoreTier)
    rank = trainer.global_rank
    timeout = trainer.strategy.config.timeout.total_seconds()  # type: ignore[attr-defined]
    store.share_nodes(leaders, rank, timeout)
    trainer.strategy.set_directory_leader(leaders[rank] == rank)  # type: ignore[attr-defined]


def _gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    from lightning_mcore_ckpt.engine import cpu_group

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=cpu_group())
    return out


def _same_path(root: Path, argument: str, config: CheckpointConfig) -> None:
    paths = _gather((str(root), socket.gethostname()))
    if len({p for p, _ in paths}) == 1:
        return
    first: dict[str, tuple[int, str]] = {}
    for rank, (path, host) in enumerate(paths):
        first.setdefault(path, (rank, host))
    named = "; ".join(f"rank {r} ({h}): {p}" for p, (r, h) in first.items())
    given = config.local_dir if argument == "local_dir" else config.dirpath
    default = argument == "local_dir" and given is None
    fix = (
        "the default staging directory follows each node's TMPDIR: pass "
        "MegatronCheckpoint(local_dir=...) with one path that exists on every node"
        if default
        else f"pass one {argument} for every rank (a node-local disk may be at the same path on "
        "each node; do not put the host name in it)"
    )
    raise ConfigurationError(
        f"MegatronCheckpoint({argument}={given!r}): the ranks resolve it to different "
        f"directories ({named}); every rank writes each step under one path: {fix}"
    )


@dataclass(frozen=True)
class Sharing:
    """Who sees which directory, per rank (found by :func:`probe_sharing`)."""

    leaders: list[int]
    """The lowest rank that sees the same directory."""
    hosts: list[str]
    """The host name (``socket.gethostname()``)."""
    paths: list[str]
    """The path the rank was given (``root``)."""


def leaders_of(trainer: pl.Trainer, root: Path) -> list[int]:
    """Per rank, the lowest rank that sees the same directory at ``root`` (collective; every
    node's local rank 0 writes a probe there). One value for a shared directory, one per node
    for a node-local one."""
    return probe_sharing(trainer, root).leaders


def probe_sharing(trainer: pl.Trainer, root: Path) -> Sharing:
    """:func:`leaders_of`, with each rank's host name and path, gathered with the probe
    (collective): what a check of the ranks of one host needs."""
    import torch.distributed as dist

    from lightning_mcore_ckpt.engine import cpu_group

    rank = trainer.global_rank
    token = trainer.strategy.broadcast(uuid.uuid4().hex)
    writers = [r for r, first in enumerate(_gather(trainer.local_rank == 0)) if first]
    probe = root / f"{_PROBE}{token}-{rank:05d}"
    problem = None
    if rank in writers:
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        except OSError as err:
            problem = (rank, socket.gethostname(), f"{type(err).__name__}: {err}")
    failed = [p for p in _gather(problem) if p is not None]  # every rank, after every write
    if failed:
        probe.unlink(missing_ok=True)
        who, host, why = failed[0]
        raise ConfigurationError(
            f"MegatronCheckpoint: rank {who} ({host}) cannot write in {root}: {why}; give "
            "every node a writable directory at that path"
        )
    # A lookup of each name (not a listing: a network file system may list a directory from a
    # stale cache, but it looks up a name never seen before at the server).
    seen = [r for r in writers if (root / f"{_PROBE}{token}-{r:05d}").exists()]
    dist.barrier(group=cpu_group())
    if rank in writers:
        probe.unlink(missing_ok=True)
    every = _gather((seen, socket.gethostname(), str(root)))
    return Sharing(
        leaders=[min(found) if found else r for r, (found, _, _) in enumerate(every)],
        hosts=[host for _, host, _ in every],
        paths=[path for _, _, path in every],
    )


def _refuse_node_local(
    config: CheckpointConfig, root: Path, argument: str, leaders: list[int]
) -> None:
    apart = sorted(set(leaders) - {0})
    where = f"{argument}={str(root)!r}"
    seen = f"ranks {apart} (and their nodes' ranks) do not see the files rank 0 writes there"
    if config.store is None:
        raise ConfigurationError(
            f"MegatronCheckpoint({where}): the directory is not shared by every node: {seen}. "
            "A run on several nodes needs dirpath on a file system every node mounts (Lustre, "
            "GPFS, NFS), or dirpath='s3://bucket/prefix' with a node-local local_dir, from "
            "which each node uploads its own ranks' files"
        )
    if config.durability == "local":
        raise ConfigurationError(
            f"MegatronCheckpoint({where}, durability='local'): {seen}, so each node holds "
            "only its part of every step, and no node-local copy can be resumed from. Pass "
            "durability='store' (a step counts once every node's part and its marker are in "
            "the store), or put local_dir on a file system every node shares"
        )
    if config.hf_export is not None:
        raise ConfigurationError(
            f"MegatronCheckpoint({where}, hf_export=...): {seen}, and the export reads every "
            "rank's shards on rank 0. Leave hf_export out and export a step from the store "
            "after training (`lightning-mcore-ckpt export s3://.../global_step_<N> "
            "--hf-model ... --out ...`), or put local_dir on a file system every node shares"
        )
