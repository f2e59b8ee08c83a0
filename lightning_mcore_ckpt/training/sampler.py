"""``ElasticSampler``: a data-parallel sampler that counts consumed samples globally.

Every epoch has one global order (a permutation seeded by ``seed + epoch``). Step by step, the
data-parallel ranks take consecutive micro-batches of it: rank ``r`` of ``D`` takes samples
``[g + r*m, g + (r+1)*m)`` of global batch ``g`` (``m`` = ``micro_batch_size``). The state is the
number of samples of the global order consumed so far, so a run resumed with another
data-parallel size continues at the exact next global sample: none repeated, none skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ElasticSampler", "is_elastic_state"]

_MARKER = "elastic_sampler_version"
_VERSION = 1


def _data_parallel() -> tuple[int, int]:
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank(),
            )
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        pass
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class ElasticSampler(DistributedSampler):  # type: ignore[type-arg]
    """Sample this data-parallel rank's share of one global order, resumable across DP sizes.

    Use it as the ``sampler`` of a ``torchdata.stateful_dataloader.StatefulDataLoader`` with
    ``batch_size=micro_batch_size``. The data-parallel size and rank are read from Megatron-Core
    when iteration starts (or pass ``num_replicas``/``rank``). Incomplete global batches at the
    end of an epoch are dropped. Being a ``DistributedSampler``, Lightning uses it as is.

    Example::

        sampler = ElasticSampler(dataset, micro_batch_size=4, seed=0)
        loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler)
    """

    def __init__(
        self,
        dataset: Sized,
        micro_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
            raise ValueError(
                f"ElasticSampler(micro_batch_size={micro_batch_size!r}): must be a positive int "
                "(the DataLoader's batch_size)"
            )
        if micro_batch_size < 1:
            raise ValueError(
                f"ElasticSampler(micro_batch_size={micro_batch_size!r}): must be a positive int "
                "(the DataLoader's batch_size)"
            )
        # DistributedSampler.__init__ needs a process group; sizes are resolved lazily instead.
        self.dataset = dataset  # type: ignore[assignment]
        self.micro_batch_size = micro_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.drop_last = True
        self._num_replicas = num_replicas
        self._rank = rank
        self.consumed_samples = 0
        self._resume_at: int | None = None

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return self._num_replicas if self._num_replicas is not None else _data_parallel()[0]

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self._rank if self._rank is not None else _data_parallel()[1]

    def _global_batch(self) -> int:
        return self.micro_batch_size * self.num_replicas

    def _usable(self) -> int:
        size = len(self.dataset)  # type: ignore[arg-type]
        return (size // self._global_batch()) * self._global_batch()

    def __len__(self) -> int:
        return (self._usable() // self._global_batch()) * self.micro_batch_size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            # A new epoch starts at its first sample, also in a state saved before it began.
            self._resume_at = None
            self.consumed_samples = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self.consumed_samples = start
        size = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=g).tolist()
        else:
            order = list(range(size))
        mbs, gb, rank = self.micro_batch_size, self._global_batch(), self.rank
        # Only whole global batches: every rank yields the same number of micro-batches.
        for first in range(start, size - gb + 1, gb):
            chunk = order[first + rank * mbs : first + (rank + 1) * mbs]
            for i, index in enumerate(chunk):
                if i == len(chunk) - 1:
                    # The micro-batch is complete once its last index is taken.
                    self.consumed_samples = first + gb
                yield index

    def state_dict(self) -> dict[str, Any]:
        """The global position: samples of this epoch's order consumed by all ranks."""
        return {
            _MARKER: _VERSION,
            "epoch": self.epoch,
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict.get(_MARKER) != _VERSION:
            raise ValueError(
                f"ElasticSampler.load_state_dict: not an ElasticSampler state ({dict(state_dict)!r})"
            )
        if state_dict["seed"] != self.seed or state_dict["shuffle"] != self.shuffle:
            raise ValueError(
                "ElasticSampler: the checkpoint was saved with "
                f"seed={state_dict['seed']}, shuffle={state_dict['shuffle']}, this run has "
                f"seed={self.seed}, shuffle={self.shuffle}; use the same to continue the order"
            )
        epoch, consumed = int(state_dict["epoch"]), int(state_dict["consumed_samples"])
        if consumed >= self._usable():
            # Saved once its epoch was used up (between two epochs): what follows is the next
            # epoch's first sample, whether or not the loop has announced that epoch yet.
            self.epoch, self.consumed_samples, self._resume_at = epoch + 1, 0, None
            return
        self.epoch = epoch
        self.consumed_samples = consumed
        self._resume_at = consumed


def is_elastic_state(state: Any) -> bool:
    """Whether a (nested) dataloader state holds an :class:`ElasticSampler` position."""
    if isinstance(state, Mapping):
        if _MARKER in state:
            return True
        return any(is_elastic_state(v) for v in state.values())
    if isinstance(state, list | tuple):
        return any(is_elastic_state(v) for v in state)
    return False
