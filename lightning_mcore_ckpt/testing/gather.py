"""Assemble a Megatron-Core sharded state dict's global tensors on every rank, whatever the
parallel layout that produced it: how a test compares two layouts' tensors with ``torch.equal``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["gather_sharded"]


def gather_sharded(sharded_state_dict: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """Assemble the full (global) tensors of a Megatron-Core sharded state dict on every rank.

    Collective: every rank of ``group`` (default: the world) calls it with its own shards. Each
    ``ShardedTensor`` is placed at its global offset; replicas simply overwrite each other, so the
    result is the same whatever the parallel layout that produced it. Flattened optimizer shards
    (``flattened_range``) are placed into the flattened global tensor. Used to prove that a
    resharded load restored exactly the tensors that were saved.

    Example::

        full = gather_sharded(trainer.strategy.model_sharded_state_dict())
        torch.equal(full["gpt.embedding.word_embeddings.weight"], expected)
    """
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    local = []
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        data = sh.data.detach().to("cpu", copy=True)
        local.append(
            (
                sh.key,
                tuple(sh.global_shape),
                tuple(sh.global_offset),
                sh.prepend_axis_num,
                sh.flattened_range,
                tuple(sh.local_shape),
                data,
            )
        )
        assert len(sh.local_shape) + sh.prepend_axis_num == len(sh.global_shape), sh.key
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    full: dict[str, Any] = {}
    for shards in gathered:
        for key, gshape, goffset, prepend, frange, lshape, data in shards:
            if key not in full:
                full[key] = torch.zeros(gshape, dtype=data.dtype)
            target = full[key]
            index = tuple(slice(o, o + n) for o, n in zip(goffset[prepend:], lshape, strict=True))
            index = tuple(slice(o, o + 1) for o in goffset[:prepend]) + index
            if frange is None:
                target[index] = data.reshape(target[index].shape)
            else:
                region = target[index].clone().flatten()
                region[frange.start : frange.stop] = data.flatten()
                target[index] = region.reshape(target[index].shape)
    return full
