"""Megatron-Core's save, with the failures that only rank 0 meets kept until every rank agrees.

In Megatron-Core's finalisation, global rank 0 writes a dist-checkpoint's ``.metadata`` (torch
DCP's ``finish``) and its ``metadata.json`` (``save_config``), each followed by a collective
the other ranks already wait in. Raised there, rank 0's error would leave them waiting until
the process group's timeout (tens of minutes on a cluster). Here those two errors are kept
instead, the collectives complete, and the writer shares them right after (``agree_on_failure``),
so that every rank raises the same error within seconds. ``metadata.json``'s barrier is left
out: that agreement orders every rank after rank 0's write as the barrier did.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from lightning_mcore_ckpt.engine._kept_conversions import KeptConversions
from lightning_mcore_ckpt.engine._metadata_ahead import KeptResults, SaveAhead, is_agreed

__all__ = ["defer_metadata_errors", "save_strategy"]


@functools.cache
def _strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class AgreeingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc]
        """Megatron-Core's ``torch_dist`` save; rank 0's ``.metadata`` error is kept in
        :attr:`deferred_errors` instead of raised before the collective that follows it."""

        deferred_errors: list[BaseException]
        own_writer = False
        """Our :class:`~._shards.ShardWriter` writes: results go to a queue of this process."""
        conversions: KeptConversions | None = None
        """With cached plans: the torch sharded tensors kept from the saves before."""
        kept_results: KeptResults | None = None
        """Our writer's: the write results of this part's last finalisation (``_metadata_ahead``)."""

        def async_save(self, *args: Any, **kwargs: Any) -> Any:
            with contextlib.ExitStack() as stack:
                if self.own_writer:
                    stack.enter_context(_local_results_queue())
                if self.use_cached_ckpt_structure:
                    if self.conversions is None:
                        self.conversions = KeptConversions()
                    stack.enter_context(self.conversions.in_use())
                return super().async_save(*args, **kwargs)

        def _get_save_and_finalize_callbacks(
            self, writer: Any, save_state_dict_ret: Any, *args: Any, **kwargs: Any
        ) -> Any:
            request = super()._get_save_and_finalize_callbacks(
                writer, save_state_dict_ret, *args, **kwargs
            )
            errors, finalizers = self.deferred_errors, list(request.finalize_fns)
            ahead = None
            if self.own_writer:  # .metadata may be written ahead (see _metadata_ahead)
                if self.kept_results is None:
                    self.kept_results = KeptResults()
                _, metadata, dist_wrapper = save_state_dict_ret
                coordinator = bool(dist_wrapper.is_coordinator)
                ahead = SaveAhead(self.kept_results, writer, metadata, coordinator)

            def finalize() -> None:
                if ahead is not None and is_agreed():
                    return  # every rank's results were the kept ones: .metadata written ahead
                finish, retrieve = writer.finish, writer.retrieve_write_results
                seen: dict[str, Any] = {"mine": None, "everyone": None}

                def finish_or_keep(metadata: Any, results: Any, *a: Any, **k: Any) -> Any:
                    try:
                        done = finish(metadata, results, *a, **k)
                    except Exception as err:  # noqa: BLE001 - shared by the writer, then raised
                        errors.append(err)
                        return None
                    seen["everyone"] = results
                    return done

                def retrieve_and_see(*a: Any, **k: Any) -> Any:
                    seen["mine"] = retrieve(*a, **k)
                    return seen["mine"]

                # Only while finalising, in this process: the request was handed to the
                # background writer (and pickled, for a persistent one) before.
                writer.finish = finish_or_keep
                writer.retrieve_write_results = retrieve_and_see
                try:
                    for fn in finalizers:
                        fn()
                finally:
                    del writer.finish, writer.retrieve_write_results
                    if ahead is not None:
                        ahead.finalized(seen["mine"], seen["everyone"])

            request.finalize_fns[:] = [finalize]
            return request

    return AgreeingTorchDistSaveStrategy


_swap_lock = threading.Lock()


@contextlib.contextmanager
def _local_results_queue() -> Iterator[None]:
    """While a save is planned: Megatron-Core's writer gets a results queue of this process
    (our writer threads fill it), not a ``multiprocessing.Manager`` queue (a process)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from lightning_mcore_ckpt.engine._shards import results_queue

    # megatron-core 0.16: _get_write_results_queue(); 0.19: get_write_results_queue().
    names = [
        n
        for n in ("_get_write_results_queue", "get_write_results_queue")
        if hasattr(filesystem_async, n)
    ]
    with _swap_lock:
        stock = {n: getattr(filesystem_async, n) for n in names}
        for name in names:
            setattr(filesystem_async, name, lambda *a, **k: results_queue())
        try:
            yield
        finally:
            for name, fn in stock.items():
                setattr(filesystem_async, name, fn)


def save_strategy(
    parallel_save: bool,
    errors: list[BaseException],
    *,
    thread_count: int | None = None,
    cache_plans: bool = False,
    own_writer: bool = False,
) -> Any:
    """Megatron-Core's default ``torch_dist`` save strategy, keeping rank 0's ``.metadata`` write
    error in ``errors``; with ``parallel_save``, the writes of replicated tensors are spread
    across the data-parallel ranks. ``thread_count``: files per rank (default: Megatron-Core's);
    ``cache_plans``: Megatron-Core reuses the plans of the previous saves (only for a state
    whose structure is known not to change: see ``_plans``); ``own_writer``: for
    :class:`~._shards.ShardWriter`."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    default = get_default_save_sharded_strategy("torch_dist")
    strategy = _strategy_class()(
        backend=default.backend,
        version=default.version,
        thread_count=thread_count or default.thread_count,
        cached_metadata=cache_plans,
    )
    strategy.deferred_errors = errors
    strategy.own_writer = own_writer
    if own_writer:
        # Its deprecation notice is about its async caller, which our writer replaces.
        from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

        if hasattr(torch_strategy, "_logged_mcore_async_deprecation"):
            torch_strategy._logged_mcore_async_deprecation = True
    if parallel_save and parallel_state.get_data_parallel_world_size() > 1:
        return FullyParallelSaveStrategyWrapper(
            strategy,
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            do_cache_distribution=cache_plans,
        )
    return strategy


def defer_metadata_errors(
    request: Any, errors: list[BaseException], strategy: Any, directory: str
) -> None:
    """In place: Megatron-Core's ``metadata_finalize_fn`` of the request that
    ``dist_checkpointing.save(..., sharded_strategy=strategy)`` returned for ``directory``
    (rank 0 writes ``metadata.json``, then every rank waits in a barrier), with rank 0's error
    kept in ``errors`` and without the barrier. The writer's agreement on rank 0's kept error,
    which every rank enters after the finalisers, orders every rank after the write as the
    barrier did: one collective a save instead of three. A request without it is left as it
    is."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    for index, fn in enumerate(request.finalize_fns):
        if getattr(fn, "__name__", "") == "metadata_finalize_fn":

            def finalize() -> None:
                if dist.get_rank() == 0:
                    try:
                        save_config(
                            CheckpointingConfig(strategy.backend, strategy.version), directory
                        )
                    except Exception as err:  # noqa: BLE001 - shared by the writer, then raised
                        errors.append(err)

            request.finalize_fns[index] = finalize
            return
