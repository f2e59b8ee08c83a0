"""Megatron-Core's save, with the failures that only rank 0 meets kept until every rank agrees.

In Megatron-Core's finalisation, global rank 0 writes a dist-checkpoint's ``.metadata`` (torch
DCP's ``finish``) and its ``metadata.json`` (``save_config``), each followed by a collective
the other ranks already wait in. Raised there, rank 0's error would leave them waiting until
the process group's timeout (tens of minutes on a cluster). Here those two errors are kept
instead, the collectives complete, and the writer shares them right after (``agree_on_failure``),
so that every rank raises the same error within seconds.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

__all__ = ["defer_metadata_errors", "save_strategy"]


@functools.cache
def _strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class AgreeingTorchDistSaveStrategy(TorchDistSaveShardedStrategy):  # type: ignore[misc]
        """Megatron-Core's ``torch_dist`` save; rank 0's ``.metadata`` error is kept in
        :attr:`deferred_errors` instead of raised before the collective that follows it."""

        deferred_errors: list[BaseException]

        def _get_save_and_finalize_callbacks(self, writer: Any, *args: Any, **kwargs: Any) -> Any:
            request = super()._get_save_and_finalize_callbacks(writer, *args, **kwargs)
            errors, finalizers = self.deferred_errors, list(request.finalize_fns)

            def finalize() -> None:
                finish = writer.finish

                def finish_or_keep(*a: Any, **k: Any) -> Any:
                    try:
                        return finish(*a, **k)
                    except Exception as err:  # noqa: BLE001 - shared by the writer, then raised
                        errors.append(err)
                        return None

                # Only while finalising, in this process: the request was handed to the
                # background writer (and pickled, for a persistent one) before.
                writer.finish = finish_or_keep
                try:
                    for fn in finalizers:
                        fn()
                finally:
                    del writer.finish

            request.finalize_fns[:] = [finalize]
            return request

    return AgreeingTorchDistSaveStrategy


def save_strategy(parallel_save: bool, errors: list[BaseException]) -> Any:
    """Megatron-Core's default ``torch_dist`` save strategy, keeping rank 0's ``.metadata`` write
    error in ``errors``; with ``parallel_save``, the writes of replicated tensors are spread
    across the data-parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    default = get_default_save_sharded_strategy("torch_dist")
    strategy = _strategy_class()(
        backend=default.backend, version=default.version, thread_count=default.thread_count
    )
    strategy.deferred_errors = errors
    if parallel_save and parallel_state.get_data_parallel_world_size() > 1:
        return FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    return strategy


def defer_metadata_errors(
    request: Any, errors: list[BaseException], strategy: Any, directory: str
) -> None:
    """In place: Megatron-Core's ``metadata_finalize_fn`` of the request that
    ``dist_checkpointing.save(..., sharded_strategy=strategy)`` returned for ``directory``
    (rank 0 writes ``metadata.json``, then every rank waits in a barrier), with rank 0's error
    kept in ``errors``. A request without it is left as it is."""
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
                dist.barrier()

            request.finalize_fns[index] = finalize
            return
