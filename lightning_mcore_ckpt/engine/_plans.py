"""Save plans kept from one save to the next while the state's structure does not change.

Megatron-Core plans every save collectively (every rank's plan is gathered to build the global
metadata; replicated tensors are assigned to writers). With ``cached_metadata`` its strategy
reuses the plans once two saves planned the same; from then on it assumes the structure never
changes (Megatron-LM's ``--ckpt-assume-constant-structure``): a tensor added or reshaped later
would be missing or misplaced. :class:`SavePlans` keeps that strategy only while every rank's
state has the structure it was planned for: each save compares a fingerprint of the sharded
state dicts (keys, dtypes, shapes, offsets, replicas; no data) and one all-reduce makes every
rank drop the kept plans when any rank's changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SavePlans", "fingerprint"]


def fingerprint(sharded_state_dict: dict[str, Any]) -> int:
    """The structure of a sharded state dict: what a save plan depends on (no data)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    parts: list[tuple[Any, ...]] = []
    append = parts.append
    for value in nested_values(sharded_state_dict):
        kind = type(value)
        if kind is ShardedTensor or kind is ShardedObject:
            append(_sharded_part(value))
        else:
            append(_other_part(value))
    try:
        return hash(tuple(parts))
    except TypeError:  # an attribute built unhashable (a list for a tuple): each made hashable
        return hash(tuple(_other_part(v) for v in nested_values(sharded_state_dict)))


def _sharded_part(value: Any) -> tuple[Any, ...]:
    """A Megatron-Core sharded tensor's or object's part of :func:`fingerprint`: its
    attributes as they are (tuples, ints, a dtype), no copies; every save walks every one."""
    data = value.data
    flattened = getattr(value, "flattened_range", None)
    return (
        type(value),
        value.key,
        getattr(value, "dtype", None),
        value.global_shape,
        value.global_offset,
        getattr(value, "local_shape", None),
        getattr(value, "axis_fragmentations", None),
        value.replica_id,
        None if flattened is None else (flattened.start, flattened.stop, flattened.step),
        (data.shape, data.dtype) if isinstance(data, torch.Tensor) else None,
    )


def _other_part(value: Any) -> tuple[Any, ...]:
    """Any other value's part of :func:`fingerprint` (a factory, a common-state value):
    whatever of the same attributes it has, made hashable."""
    data = getattr(value, "data", None)
    return (
        type(value).__name__,
        getattr(value, "key", None),
        str(getattr(value, "dtype", "")),
        tuple(getattr(value, "global_shape", None) or ()),
        tuple(getattr(value, "global_offset", None) or ()),
        tuple(getattr(value, "local_shape", None) or ()),
        tuple(getattr(value, "axis_fragmentations", None) or ()),
        repr(getattr(value, "replica_id", None)),
        repr(getattr(value, "flattened_range", None)),
        (tuple(data.shape), str(data.dtype)) if isinstance(data, torch.Tensor) else None,
    )


class SavePlans:
    """The save strategies of each part of a step (``model``, ``optim``), kept across saves.

    ``make(cache_plans)`` builds a strategy. With ``enabled=False`` every save gets fresh ones
    (Megatron-Core plans from scratch each time).
    """

    def __init__(self, make: Callable[[bool], Any], enabled: bool = True) -> None:
        self._make = make
        self.enabled = enabled
        self._kept: dict[str, tuple[int, Any]] = {}
        self.planned_fresh = 0
        """Saves whose plans were (re)built from scratch because the structure changed."""
        self.reused = False
        """Whether the last :meth:`strategies` kept the plans: the sharding of every rank is
        the one validated when they were made, so the save need not validate it again (a
        gather of every rank's shard metadata)."""

    @property
    def kept(self) -> bool:
        """Whether plans are kept (a save, or planning ahead, made them)."""
        return bool(self._kept)

    def strategies(
        self, parts: Sequence[tuple[str, dict[str, Any]]], device: torch.device
    ) -> dict[str, Any]:
        """Collective (every rank, at every save): a strategy per part."""
        self.reused = False
        if not self.enabled:
            return {name: self._make(False) for name, _ in parts}
        prints = {name: fingerprint(ssd) for name, ssd in parts}
        kept = {name: entry[0] for name, entry in self._kept.items()}
        changed = torch.tensor([int(kept != prints)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        if int(changed.item()):
            self._kept = {name: (value, self._make(True)) for name, value in prints.items()}
            self.planned_fresh += 1
        else:
            self.reused = True
        return {name: self._kept[name][1] for name, _ in parts}

    def forget(self) -> None:
        """Plan the next save from scratch (after a failed save: its plan may be half-kept)."""
        self._kept = {}
