"""Training dataloaders made resumable: Lightning's injected sampler becomes an ElasticSampler."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["elastic_dataloader"]


def elastic_dataloader(dataloader: Any) -> Any:
    """``dataloader`` with an :class:`~lightning_mcore_ckpt.ElasticSampler`, where one fits.

    See ``MegatronStrategy.process_dataloader``: only a training ``StatefulDataLoader`` whose
    sampler is Lightning's ``DistributedSampler``, a ``DistributedSamplerWrapper`` around a
    shuffling or sequential sampler, or (one data-parallel rank) its own shuffling or sequential
    sampler is changed; any other loader is returned as it is.
    """
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
    from torch.utils.data import DistributedSampler

    # Lightning passes the batch sampler along when it injects its sampler.
    batch_size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
    if type(dataloader).__name__ != "StatefulDataLoader" or not isinstance(batch_size, int):
        return dataloader
    sampler = dataloader.sampler
    if not isinstance(sampler, DistributedSampler):
        sampler = getattr(dataloader.batch_sampler, "sampler", None)
    generator = getattr(dataloader, "generator", None)
    seed: int
    if type(sampler) is DistributedSampler:
        shuffle, seed = sampler.shuffle, sampler.seed
    elif type(sampler) is DistributedSamplerWrapper:
        wrapped = type(getattr(sampler.dataset, "_sampler", None)).__name__
        if wrapped not in ("RandomSampler", "SequentialSampler"):
            return dataloader  # the user's own sampler, sharded by Lightning: kept
        shuffle, seed = wrapped == "RandomSampler", sampler.seed
    elif type(sampler).__name__ in ("RandomSampler", "SequentialSampler") and not getattr(
        sampler, "replacement", False
    ):
        # One data-parallel rank: the loader's own shuffle. Seeded like the loader: its
        # generator's seed, else Lightning's (seed_everything).
        shuffle = type(sampler).__name__ == "RandomSampler"
        seed = (
            int(generator.initial_seed())
            if generator is not None
            else int(os.getenv("PL_GLOBAL_SEED", "0"))
        )
    else:
        return dataloader
    from lightning.pytorch.utilities.data import _update_dataloader

    from lightning_mcore_ckpt.training.sampler import ElasticSampler

    elastic = ElasticSampler(
        dataloader.dataset,
        micro_batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
    )
    return _update_dataloader(dataloader, elastic)
