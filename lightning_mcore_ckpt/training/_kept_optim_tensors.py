"""The optimizer state's sharded tensors, kept from one save to the next.

At every save, :func:`~.optim.sharded_state_dict` turns each optimizer state tensor (Adam's
``exp_avg`` and ``exp_avg_sq`` of every parameter) into a Megatron-Core ``ShardedTensor`` with
its parameter's sharding (``make_sharded_optimizer_tensor``: a dataclass ``replace`` of the
parameter's sharded tensor, which validates the sharding twice). The result depends only on the
parameter's sharded tensor apart from its data, on the state tensor itself, and on the prefix;
from one step to the next none of them changes (the state is updated in place). Made afresh,
the 176 state tensors of the benchmark's fixed-cost state took 1.84 ms of a save on CPU; kept,
1.21 ms (``docs/performance.md``).

:class:`KeptOptimizerTensors` remembers, for each state tensor, what it was made from and the
result without its data. The next save reuses the result when the parameter's sharded tensor
has the same value in every field but its data, the state tensor is the same object with the
same shape and dtype, and the prefix is the same: a copy of the kept fields with the tensor
put back, equal field by field to what Megatron-Core would make. Anything else (a factory, a
``DTensor``, a state tensor replaced by a load, a resharded parameter) is made by Megatron-Core
and kept in place of the old. Entries not used by a save are dropped with it, and the kept
results hold no tensor (a state tensor is referred to weakly), so nothing stays alive because
it was saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["KeptOptimizerTensors", "kept_for"]

_swap_lock = threading.Lock()


@dataclasses.dataclass
class _Kept:
    """One state tensor's result: what it was made from, and its fields but the data."""

    made_from: tuple[Any, ...]
    state: weakref.ref[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    fields: dict[str, Any]


class KeptOptimizerTensors:
    """The sharded tensors one optimizer's saves made, by state tensor (``id``)."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}
        self.reused = 0
        """State tensors whose sharded tensor the last :meth:`in_use` block reused."""
        self.made = 0
        """State tensors whose sharded tensor it made afresh (Megatron-Core's function)."""

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """While Megatron-Core turns this optimizer's state into sharded tensors: its
        ``make_sharded_optimizer_tensor`` goes through :meth:`make`. Entries the block did not
        use are dropped at its end."""
        from megatron.core.dist_checkpointing import optimizer as mcore_optimizer

        with _swap_lock:
            stock = mcore_optimizer.make_sharded_optimizer_tensor
            used: dict[int, _Kept] = {}
            self.reused = self.made = 0

            def make(model_param: Any, optim_param: Any, prefix: str) -> Any:
                return self.make(stock, model_param, optim_param, prefix, used)

            mcore_optimizer.make_sharded_optimizer_tensor = make
            try:
                yield
            finally:
                mcore_optimizer.make_sharded_optimizer_tensor = stock
                self._kept = used

    def make(
        self,
        stock: Callable[[Any, Any, str], Any],
        model_param: Any,
        optim_param: Any,
        prefix: str,
        used: dict[int, _Kept],
    ) -> Any:
        """``stock(model_param, optim_param, prefix)``, or the kept result where nothing it
        depends on changed; the result is remembered in ``used``."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if type(model_param) is not ShardedTensor or type(optim_param) not in (
            torch.Tensor,
            torch.nn.Parameter,
        ):
            return stock(model_param, optim_param, prefix)
        made_from = (prefix, _made_from_fields()(model_param))
        kept = self._kept.get(id(optim_param))
        if (
            kept is not None
            and kept.shape == tuple(optim_param.shape)
            and kept.dtype == optim_param.dtype
            and kept.state() is optim_param
            and kept.made_from == made_from
        ):
            out = object.__new__(ShardedTensor)
            out.__dict__.update(kept.fields)
            out.data = optim_param
            self.reused += 1
        else:
            out = stock(model_param, optim_param, prefix)
            fields = {k: v for k, v in out.__dict__.items() if k != "data"}
            kept = _Kept(
                made_from,
                weakref.ref(optim_param),
                tuple(optim_param.shape),
                optim_param.dtype,
                fields,
            )
            self.made += 1
        used[id(optim_param)] = kept
        return out


@functools.cache
def _made_from_fields() -> Callable[[Any], tuple[Any, ...]]:
    """A getter of every field of Megatron-Core's ``ShardedTensor`` but its data, as a tuple
    (``operator.attrgetter``: every save reads them for every state tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    names = [f.name for f in dataclasses.fields(ShardedTensor) if f.name != "data"]
    return operator.attrgetter(*names)


_by_optimizer: weakref.WeakKeyDictionary[Any, KeptOptimizerTensors] = weakref.WeakKeyDictionary()


def kept_for(optimizer: torch.optim.Optimizer) -> KeptOptimizerTensors:
    """The kept sharded tensors of ``optimizer``'s state (they go with it)."""
    kept = _by_optimizer.get(optimizer)
    if kept is None:
        kept = _by_optimizer[optimizer] = KeptOptimizerTensors()
    return kept
