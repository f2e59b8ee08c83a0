"""The collectives a checkpoint save or load runs outside Megatron-Core: rank 0's answer for
everyone, and one failure agreed on by every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt.engine._records import CheckpointSaveError
from lightning_mcore_ckpt.format import integrity

__all__ = [
    "agree_on_failure",
    "broadcast",
    "cpu_group",
    "describe_error",
    "distributed",
    "first_failure",
]


def distributed() -> bool:
    """Whether the default process group is up."""
    return dist.is_available() and dist.is_initialized()


_CPU_GROUPS: dict[Any, Any] = {}


def cpu_group() -> Any:
    """A gloo group of every rank, for small flags exchanged at every step: the default group
    when it is gloo, else one created once per default group (collective the first time: every
    rank calls it at the same point). On the GPU, the same exchange over NCCL would synchronise
    the device."""
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    if world not in _CPU_GROUPS:
        # The default group's timeout: torch's default for a new group is 30 minutes.
        _CPU_GROUPS[world] = dist.new_group(backend="gloo", timeout=_default_timeout())
    return _CPU_GROUPS[world]


def _default_timeout() -> Any:
    """The default group's timeout (``MegatronStrategy(timeout=...)``), or ``None`` (torch's
    default) where this torch does not say it."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def broadcast(obj: Any) -> Any:
    """Global rank 0's ``obj`` on every rank (as is, without a process group). Collective."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def gather_hashes(step: Path, everywhere: bool = False) -> dict[str, str]:
    """Collective: the digests every rank recorded for files under ``step``, on rank 0 (``{}``
    on the others), or on every rank with ``everywhere`` (where each node's leader uploads its
    ranks' files and confirms them against these); each rank forgets its own."""
    mine = integrity.take(step)
    if not distributed():
        return mine
    gathered: list[Any] | None
    if everywhere:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    return {k: v for part in gathered or () for k, v in sorted(part.items())}


def first_failure(message: str | None, rank: int, device: torch.device) -> tuple[int, str] | None:
    """Collective: the lowest rank whose ``message`` is not ``None``, and its message.

    ``None`` on every rank when no rank failed. Without a process group, this rank's.
    """
    if not distributed():
        return None if message is None else (rank, message)
    world = dist.get_world_size()
    mine = torch.tensor([world if message is None else rank], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    failed_rank = int(mine.item())
    if failed_rank >= world:
        return None
    why = [message or ""]
    dist.broadcast_object_list(why, src=failed_rank)
    return failed_rank, why[0]


def on_every_rank(flag: bool, device: torch.device) -> bool:
    """Collective: whether ``flag`` holds on every rank (this rank's without a process group)."""
    if not distributed():
        return flag
    mine = torch.tensor([int(flag)], device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return bool(mine.item())


def agree_on_failure(
    error: BaseException | None,
    path: Path,
    phase: str,
    rank: int,
    device: torch.device,
    headline: str | None = None,
) -> CheckpointSaveError | None:
    """Collective: every rank learns whether any rank failed, so none waits for it.

    The error reported everywhere is the lowest failing rank's (for a shard write error,
    rank 0 is the one that holds every rank's details).
    """
    found = first_failure(None if error is None else describe_error(error), rank, device)
    if found is None:
        return None
    failed_rank, why = found
    headline = headline or f"checkpoint save to {path} failed while {phase}"
    failure = CheckpointSaveError(f"{headline} (rank {failed_rank}): {why}")
    failure.__cause__ = error
    return failure


def describe_error(error: BaseException) -> str:
    """An error's message, with the per-rank causes a torch ``CheckpointException`` hides."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            while getattr(cause, "__cause__", None) is not None:
                cause = cause.__cause__
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"
