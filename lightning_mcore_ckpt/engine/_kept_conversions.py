"""Megatron-Core's torch ShardedTensors, kept from one save to the next while plans are kept.

At every save Megatron-Core's ``torch_dist`` strategy converts its sharded tensors into torch
DCP's (``mcore_to_pyt_state_dict``). A tensor with a prepended axis (every layer of a stacked
decoder) becomes a torch ``ShardedTensor`` built by
``ShardedTensor._init_from_local_shards_and_global_metadata``: it parses every shard's
placement and validates the global metadata, each save again. With cached plans that was the
largest fixed cost of an async save (about a quarter of it on CPU at width 64).

While its plans are kept (:class:`~._plans.SavePlans`: every rank's structure unchanged), a
strategy keeps each converted tensor, and the next save swaps the new data into it: each
shard's tensor is checked against the one it replaces (key, offsets, shapes, dtype, device,
replicas) and anything that differs is converted afresh by Megatron-Core. After the save's
planning, the kept tensors let go of the data (they hold only their metadata between saves,
so no state stays alive because it was saved).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KeptConversions"]

_swap_lock = threading.Lock()


def _signature(sh_ten: Any) -> tuple[Any, ...] | None:
    """What a converted shard depends on, apart from its data (``None``: never kept).

    Compared with ``==``, never hashed: the attributes as they are, no copies (every save
    computes it for every shard). One built differently (a list for a tuple) only differs,
    and is converted afresh."""
    data = sh_ten.data
    if not isinstance(data, torch.Tensor) or sh_ten.flattened_range is not None:
        return None
    return (
        sh_ten.key,
        sh_ten.global_shape,
        sh_ten.global_offset,
        sh_ten.local_shape,
        sh_ten.axis_fragmentations,
        sh_ten.prepend_axis_num,
        sh_ten.replica_id,
        data.dtype,
        data.device,
        data.shape,
    )


def _shard(shard_class: Any, tensor: torch.Tensor, metadata: Any) -> Any:
    """torch's ``Shard(tensor, metadata)`` (``shard_class``) without its checks of the tensor's
    size and placement: ``tensor``'s signature matched the kept shard's (shape, dtype and
    device), whose tensor passed them when it was converted."""
    shard = shard_class.__new__(shard_class)
    shard.tensor = tensor
    shard.metadata = metadata
    return shard


@dataclass
class _Kept:
    """One converted tensor: its shards' signatures, their metadata, and the torch tensor."""

    signatures: tuple[tuple[Any, ...], ...]
    metadata: list[Any]
    converted: Any


class KeptConversions:
    """The torch ``ShardedTensor`` of every stacked sharded tensor of one strategy's saves."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self.reused = 0
        """Tensors whose conversion the last save reused."""
        self.converted = 0
        """Tensors the last save converted afresh (Megatron-Core's conversion)."""

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """While a save is planned: Megatron-Core's conversion goes through :meth:`convert`;
        afterwards the kept tensors hold no data."""
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

        with _swap_lock:
            stock = torch_strategy.mcore_to_pyt_state_dict

            def convert(
                state_dict: Any, is_loading: bool = False, *args: Any, **kwargs: Any
            ) -> Any:
                if is_loading or args or kwargs:
                    return stock(state_dict, is_loading, *args, **kwargs)
                return self.convert(stock, state_dict)

            torch_strategy.mcore_to_pyt_state_dict = convert
            try:
                yield
            finally:
                torch_strategy.mcore_to_pyt_state_dict = stock
                self._let_go()

    def convert(self, stock: Callable[..., Any], state_dict: dict[str, list[Any]]) -> Any:
        """``stock(state_dict, False)``, with the kept tensors reused where their shards match."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

        reused: dict[str, Any] = {}
        fresh: dict[str, list[Any]] = {}
        for key, shards in state_dict.items():
            kept = self._kept.get(key)
            into = self._reuse(kept, shards) if kept is not None else None
            if into is None:
                fresh[key] = shards
            else:
                reused[key] = into
        # Before the conversion: it changes the shards' data (a view with the prepended axes).
        signatures = {
            key: tuple(_signature(s) if isinstance(s, ShardedTensor) else None for s in shards)
            for key, shards in fresh.items()
        }
        converted = stock(fresh, False) if fresh else {}
        for key in fresh:
            self._kept.pop(key, None)
            out = converted[key]
            if isinstance(out, TorchShardedTensor) and None not in signatures[key]:
                metadata = [shard.metadata for shard in out.local_shards()]
                self._kept[key] = _Kept(signatures[key], metadata, out)  # type: ignore[arg-type]
        self.reused, self.converted = len(reused), len(fresh)
        return {key: reused[key] if key in reused else converted[key] for key in state_dict}

    @staticmethod
    def _reuse(kept: _Kept, shards: list[Any]) -> Any:
        """``kept``'s torch tensor holding ``shards``' data, or ``None`` where they differ."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from torch.distributed._shard.sharded_tensor import Shard

        if len(shards) != len(kept.signatures):
            return None
        if not all(isinstance(s, ShardedTensor) for s in shards):
            return None
        if tuple(_signature(s) for s in shards) != kept.signatures:
            return None
        local = []
        for sh_ten, metadata in zip(shards, kept.metadata, strict=True):
            # What Megatron-Core's conversion does to each shard's data (it is used after).
            data = sh_ten.data.detach()
            if not data.is_contiguous():
                data = data.contiguous()
            sh_ten.data = data.view((1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape))
            local.append(_shard(Shard, sh_ten.data, metadata))
        kept.converted.local_shards()[:] = local
        return kept.converted

    def _let_go(self) -> None:
        """The kept tensors drop their shards' data (their metadata stays)."""
        for kept in self._kept.values():
            kept.converted.local_shards()[:] = []
