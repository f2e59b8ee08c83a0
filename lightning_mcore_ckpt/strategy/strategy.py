"""``MegatronStrategy``: Megatron-Core parallelism and dist-checkpointing inside a Lightning Trainer.

One class: Lightning's hooks, in the order a run reaches them (options, topology and setup,
the training step, save, load, removal and teardown, collectives). What they compute is in
functions beside it: :mod:`.grads` (gradients under model parallelism), :mod:`.model_setup`,
:mod:`.dataloader`, :mod:`.lightning_checkpoints`; checkpoints are read and written by
:mod:`lightning_mcore_ckpt.engine`'s ``CheckpointWriter`` and ``CheckpointReader``, which the
strategy holds.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed import distributed_c10d
from typing_extensions import override

from lightning_mcore_ckpt import _cpu
from lightning_mcore_ckpt._options import keyword_options
from lightning_mcore_ckpt.engine import (
    CONTENTS,
    CheckpointReader,
    CheckpointWriter,
    SaveListener,
    SaveOptions,
    TrainingState,
    frozen_storages,
    holds_weights_only,
    module_sharded_state_dict,
)
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.format.layout import EXTRA_DIR, OPTIM_DIR
from lightning_mcore_ckpt.safety import safe_load
from lightning_mcore_ckpt.strategy import grads, lightning_checkpoints, roll_call
from lightning_mcore_ckpt.strategy.config import (
    DEFAULT_TIMEOUT,
    ProcessGroupBackend,
    StrategyConfig,
)
from lightning_mcore_ckpt.strategy.dataloader import elastic_dataloader
from lightning_mcore_ckpt.strategy.model_setup import (
    check_model_configs,
    check_moe_autocast,
    check_moe_sequence_parallel,
    convert_precision,
)
from lightning_mcore_ckpt.strategy.nothing_loaded import NothingLoaded
from lightning_mcore_ckpt.training import parallel
from lightning_mcore_ckpt.training.rng import RNGState

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.engine import OptimizerSharding, WriterKind

__all__ = ["MegatronStrategy"]

log = logging.getLogger(__name__)


class MegatronStrategy(ParallelStrategy):
    """Train Megatron-Core models in Lightning with TP/PP/CP/EP/DP and dist-checkpoints.

    The world size must be divisible by ``tensor_model_parallel_size`` x
    ``pipeline_model_parallel_size`` x ``context_parallel_size``; the rest is data parallelism.
    Build Megatron-Core modules in ``LightningModule.configure_model()``: parallel state and
    Megatron's RNG tracker are ready by then. Gradients are averaged over the data-parallel group
    by the strategy.

    Checkpoints are directories: ``model/`` and ``optim/`` are Megatron-Core dist-checkpoints
    (torch_dist), reshardable to any other layout; ``extra/`` holds, per rank, the RNG state and
    Lightning's own checkpoint content (loops, callbacks, schedulers, hyperparameters).

    The keyword arguments are the fields of :class:`~lightning_mcore_ckpt.strategy.StrategyConfig`
    (same names and defaults; each is documented there), checked at construction and kept as
    ``strategy.config``.

    Example::

        trainer = L.Trainer(
            strategy=MegatronStrategy(tensor_model_parallel_size=2),
            accelerator="cpu", devices=2, max_steps=100,
        )
        trainer.fit(module)
        trainer.save_checkpoint("checkpoints/global_step_100")
    """

    strategy_name = "megatron"

    @keyword_options(StrategyConfig)
    def __init__(
        self,
        *,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        sequence_parallel: bool = False,
        seed: int = 1234,
        ckpt_async_save: bool = False,
        ckpt_parallel_save: bool = True,
        ckpt_parallel_load: bool = False,
        ckpt_optimizer_sharding: OptimizerSharding = "dp_reshardable",
        ckpt_writer: WriterKind = "threads",
        ckpt_write_threads: int | None = None,
        ckpt_read_threads: int | None = None,
        ckpt_verify_hashes: bool = False,
        ckpt_dedup: bool = False,
        ckpt_cache_plans: bool = True,
        ckpt_max_staging_bytes: int | None = None,
        process_group_backend: ProcessGroupBackend | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        init_from: str | os.PathLike[str] | None = None,
    ) -> None:
        """Check the options (the fields of ``StrategyConfig``) and keep them as ``config``."""
        # The arguments are the config's fields, one for one, spelled out so that a type checker
        # checks a call (the Literal options); the decorator refuses any other name, naming the
        # closest, and documents each from its field.
        options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self.config = StrategyConfig(**options)
        """The strategy's options, as given (checked): the only place they are kept."""
        config = self.config
        self.num_nodes = 1
        self._chosen_backend: str | None = None
        self._roll_calls = 0
        self._writer = CheckpointWriter(
            async_save=config.ckpt_async_save,
            parallel_save=config.ckpt_parallel_save,
            writer=config.ckpt_writer,
            write_threads=config.ckpt_write_threads,
            cache_plans=config.ckpt_cache_plans,
            dedup=config.ckpt_dedup,
            max_staging_bytes=config.ckpt_max_staging_bytes,
        )
        self._reader = CheckpointReader(
            parallel_load=config.ckpt_parallel_load,
            read_threads=config.ckpt_read_threads,
            verify_hashes=config.ckpt_verify_hashes,
        )
        self._schedule_grads: grads.ScheduleGrads | None = None
        """Gradients ``forward_backward`` produced, added at Lightning's backward."""
        self._rng_at_load: dict[str, Any] | None = None
        """The RNG state a load restored, re-applied at the first resumed batch."""

    # --- options (read-only views of the config) ----------------------------------------------

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.config.context_parallel_size

    @property
    def expert_model_parallel_size(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def expert_tensor_parallel_size(self) -> int:
        """As given, or ``tensor_model_parallel_size`` (Megatron-Core's default)."""
        given = self.config.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if given is None else given

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def ckpt_async_save(self) -> bool:
        return self.config.ckpt_async_save

    @property
    def ckpt_parallel_save(self) -> bool:
        return self.config.ckpt_parallel_save

    @property
    def ckpt_parallel_load(self) -> bool:
        return self.config.ckpt_parallel_load

    @property
    def init_from(self) -> Path | None:
        """``init_from`` as a path (``~`` expanded), or ``None``."""
        return self.config.init_path

    @property
    def process_group_backend(self) -> str | None:
        """The backend given, else (once set up) the one chosen: nccl with CUDA, gloo without."""
        return self._chosen_backend or self.config.process_group_backend

    # --- topology ------------------------------------------------------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        from megatron.core import parallel_state

        return {
            "num_replicas": parallel_state.get_data_parallel_world_size(),
            "rank": parallel_state.get_data_parallel_rank(),
        }

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide whether to inject a DistributedSampler
        # (keyed by distributed_sampler_kwargs: the data-parallel rank, not the global rank).
        # With one data-parallel rank and one pipeline stage there is nothing to split, and the
        # loader's own sampler (e.g. torchdata's stateful RandomSampler, which saves its
        # generator) is kept as is. Pipeline stages are seeded differently (as in Megatron-LM),
        # so with PP > 1 a seeded DistributedSampler keeps every stage on the same batch.
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return bool(
                parallel_state.get_data_parallel_world_size() > 1
                or parallel_state.get_pipeline_model_parallel_world_size() > 1
            )
        return True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Optimizer state is loaded, sharded, in load_checkpoint.
        return False

    # --- setup ---------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        # The backend follows the devices the ranks train on, not what the machine has:
        # accelerator="cpu" on a GPU machine is a gloo group.
        backend = parallel.backend_for(self.root_device.type, self.config.process_group_backend)
        self._chosen_backend = backend
        _cpu.install(self.root_device.type)  # CPU ranks: also on a machine with GPUs
        if not _distributed_is_initialized():
            _init_dist_connection(self.cluster_environment, backend, timeout=self.config.timeout)
        parallel.initialize(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            seed=self.seed,
            timeout=self.config.timeout,
            device_type=self.root_device.type,
        )
        if self.world_size > 1 and self.local_rank == 0:
            roll_call.register_host(distributed_c10d._get_default_store(), self.node_rank)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Make a training ``StatefulDataLoader`` resumable over data-parallel ranks.

        Lightning shards a loader over data-parallel ranks by injecting a ``DistributedSampler``
        (or, around torchdata's own shuffling sampler, a ``DistributedSamplerWrapper``, which
        re-draws the whole order from an RNG that no checkpoint holds). Neither position can be
        restored exactly. For a shuffled or sequential ``StatefulDataLoader`` that sampler is
        replaced by :class:`~lightning_mcore_ckpt.ElasticSampler` (same ``shuffle`` and ``seed``:
        Lightning's, from ``seed_everything``), which saves its exact position.

        On one data-parallel rank the loader's shuffling (or sequential) sampler becomes an
        ``ElasticSampler`` too, seeded with the loader's ``generator`` seed, else Lightning's: the
        saved position then also holds after a change of the data-parallel size, and no draw
        outside the checkpoint (torchdata's sampler shares the loader's generator with every
        new iterator's base seed) changes the epochs after a resume. Like ``drop_last=True``, an
        epoch's last incomplete global batch is skipped. A sampler of your own is kept as it is.
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return elastic_dataloader(dataloader)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Not super().setup(): Lightning's converts the precision before the model's configs
        # can be checked against the strategy's, and builds the optimizers before init_from's
        # weights are loaded. Its steps are here, in the order Megatron-Core needs (no
        # _setup_model wrapper: the strategy syncs gradients itself).
        assert self.model is not None
        assert self.accelerator is not None
        lightning_checkpoints.check_callbacks(trainer, dedup=self.config.ckpt_dedup)
        self.accelerator.setup(trainer)
        check_model_configs(self.model, self.config)
        self.model = convert_precision(self.model, self.precision_plugin)
        self.model_to_device()
        self.barrier("MegatronStrategy.setup")
        if trainer.state.fn == TrainerFn.FITTING:
            check_moe_sequence_parallel(self.model, self.config)
            check_moe_autocast(self.model, self.precision_plugin)
            self._initialize_weights(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning clips by the norm of this rank's gradients; with model parallelism that norm
        # must be the model's (see clip_grad_by_norm).
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign,assignment]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Lightning accepts objects that look like torch optimizers; a MegatronOptimizer lacks
        # only `defaults`. Give it one, so configure_optimizers may return it as it is.
        module = self.lightning_module
        assert module is not None
        configure = module.configure_optimizers

        def configure_optimizers() -> Any:
            conf = configure()
            grads.give_megatron_optimizers_defaults(conf)
            return conf

        module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        try:
            super().setup_optimizers(trainer)
        finally:
            del module.configure_optimizers
        grads.refuse_loss_scaling(self.optimizers)

    def _initialize_weights(self, trainer: pl.Trainer) -> None:
        """Load ``init_from`` when this fit does not resume from a checkpoint (collective)."""
        init_from = self.init_from
        if init_from is None:
            return
        if trainer.ckpt_path is not None:
            if self.global_rank == 0:
                log.info("resuming from %s; init_from=%s not used", trainer.ckpt_path, init_from)
            return
        start = time.perf_counter()
        if (init_from / "config.json").is_file():
            from lightning_mcore_ckpt import hf

            assert self.lightning_module is not None
            prefixes = hf.gpt_model_prefixes(
                self.lightning_module,
                f"MegatronStrategy(init_from={str(init_from)!r})",
                "initialise it from a step of this package's format instead",
            )
            hf.load_hf_weights(prefixes, init_from, self.model_sharded_state_dict)
        else:
            trusted = safe_load.trusted_by_user()
            self._load_weights(layout.resolve_checkpoint(init_from), trusted=trusted)
        self.barrier("MegatronStrategy.init_from")
        if self.global_rank == 0:
            log.info(
                "no checkpoint to resume from: initialised the weights from %s in %.1fs",
                init_from,
                time.perf_counter() - start,
            )

    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        # Not Lightning's (the root device and the precision's dtype as defaults): Megatron-Core
        # modules take both from their own config; setup converts and moves the model.
        return nullcontext()

    # --- the training step ---------------------------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._rng_at_load is not None:
            state, self._rng_at_load = self._rng_at_load, None
            if batch_idx > 0:
                # Resumed inside an epoch: undo the draws made since the load (the loader's new
                # iterator), so the next batch sees the RNG exactly as the uninterrupted run.
                RNGState().load_state_dict(state)
        if self._writer.pending_path is not None:
            self.finalize_pending_save(blocking=False)

    def forward_backward(
        self,
        forward_step_func: Callable[[Any, Any], tuple[torch.Tensor, Callable[..., Any]]],
        data_iterator: Any,
        *,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        model: torch.nn.Module | None = None,
        forward_only: bool = False,
    ) -> torch.Tensor:
        """Run Megatron-Core's pipeline schedule over ``num_microbatches`` micro-batches.

        This is how a LightningModule trains with ``pipeline_model_parallel_size > 1``: call it
        from ``training_step`` (or ``validation_step`` with ``forward_only=True``) and return
        what it returns. The schedule runs forward and backward itself, passing activations
        between stages; under automatic optimisation its gradients are applied where Lightning
        would have run ``loss.backward()``, so zero_grad, gradient accumulation, clipping and LR
        schedulers behave as usual. Under manual optimisation, the gradients are in ``.grad``
        when it returns. It also works with ``pipeline_model_parallel_size=1``.

        ``forward_step_func(data_iterator, model)`` follows Megatron-LM's contract: it takes the
        next micro-batch from the iterator, runs ``model`` (this stage's chunk: pass the
        activations it was given, Megatron sets them) and returns ``(output, loss_func)``, where
        ``loss_func(output)`` returns ``(loss, logged_dict)``. ``model`` defaults to the
        LightningModule's only top-level Megatron-Core module.

        Returns the mean micro-batch loss, detached, on every rank (pipeline stages other than
        the last receive it from the last).

        Example::

            def training_step(self, batch, batch_idx):
                micro = iter(zip(batch[0].split(2), batch[1].split(2)))
                return self.trainer.strategy.forward_backward(
                    self._forward_step, micro, num_microbatches=2,
                    seq_length=batch[0].shape[1], micro_batch_size=2)
        """
        lightning_module = self.lightning_module
        if model is None:
            assert lightning_module is not None
            model = grads.model_chunk(lightning_module)
        accumulate = 1
        if not forward_only and lightning_module is not None:
            accumulate = lightning_module.trainer.accumulate_grad_batches
        # Lightning's automatic optimisation zeroes gradients *after* training_step and before
        # its backward: keep the schedule's gradients aside and add them in backward(), so
        # accumulation and zero_grad behave exactly as with an ordinary loss.backward().
        stash = (
            not forward_only
            and lightning_module is not None
            and lightning_module.automatic_optimization
        )
        mean, stashed = grads.run_schedule(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
            accumulate=accumulate,
            stash=stash,
            device=self.root_device,
        )
        if stashed is not None:
            self._schedule_grads = stashed
        return mean

    @override
    def backward(
        self,
        closure_loss: torch.Tensor,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self._schedule_grads is not None:
            # forward_backward already ran the backward pass of this loss: add its gradients
            # (Lightning's backward would run it a second time).
            grads.add_schedule_grads(self._schedule_grads)
            self._schedule_grads = None
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        from megatron.core.optimizer import MegatronOptimizer

        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, MegatronOptimizer):
            # Not Lightning's: a MegatronOptimizer steps without a closure (see grads).
            assert self.model is not None
            return grads.megatron_optimizer_step(inner, closure, self.model, self.finalize_grads)

        def closure_then_sync_grads() -> Any:
            result = closure()
            self.finalize_grads()
            return result

        return super().optimizer_step(optimizer, closure_then_sync_grads, model, **kwargs)

    def finalize_grads(self) -> None:
        """Average gradients over the data-parallel group; sum sequence-parallel norms over TP.

        Called by :meth:`optimizer_step` after the (last accumulated) backward. With Megatron-Core
        ``DistributedDataParallel`` model chunks (the GPU path with a ``MegatronOptimizer``),
        Megatron's own ``finalize_model_grads`` does it instead.
        """
        assert self.model is not None
        grads.finalize_grads(
            self.model,
            pipeline_parallel=self.pipeline_model_parallel_size > 1,
            sequence_parallel=self.sequence_parallel and self.tensor_model_parallel_size > 1,
        )

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip gradients by the norm of the whole model's gradient (``gradient_clip_val``).

        Each rank holds a shard of the gradient: the norm is summed over the tensor- and
        pipeline-parallel ranks, counting tensor-parallel duplicates (layer norms) and the
        pipeline's second copy of tied embeddings once, so every rank scales by the same
        coefficient and the update equals the unsharded model's.
        """
        params = self.precision_plugin.main_params(optimizer)
        grads.clip_grad_by_norm(params, clip_val, self.root_device)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.finalize_pending_save(blocking=True)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.abandon_pending_save()
        super().on_exception(exception)
        self._answer_roll_call(exception)

    def _answer_roll_call(self, exception: BaseException) -> None:
        """Every rank leaving with an error answers the roll call; one whose error is a peer's
        silence then names the nodes that did not answer, in a note on its error and in the log
        (:mod:`.roll_call`)."""
        if self.world_size < 2 or not _distributed_is_initialized():
            return
        self._roll_calls += 1
        finding = roll_call.answer(
            distributed_c10d._get_default_store(),
            generation=self._roll_calls,
            rank=self.global_rank,
            world_size=self.world_size,
            ranks_per_node=self.num_processes,
            wait=roll_call.is_peer_silence(exception),
            # A later survivor's wait for the silent node ends within one timeout of this one's.
            linger_s=self.config.timeout.total_seconds(),
        )
        if finding is not None:
            note = f"rank {self.global_rank} ({socket.gethostname()}): {finding}"
            log.error("%s", note)
            exception.add_note(note)

    # --- checkpoint: state dicts ---------------------------------------------------------------

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """The LightningModule's weights as a Megatron-Core sharded state dict.

        Megatron-Core modules contribute their own ``sharded_state_dict()``; any other parameter
        or persistent buffer is a replicated tensor (written once, by global rank 0's replica).
        """
        assert self.lightning_module is not None
        return module_sharded_state_dict(self.lightning_module)

    def parallel_layout(self) -> dict[str, int]:
        """The parallel sizes of this run, as recorded in checkpoints.

        ``expert_tensor_parallel_size`` is recorded only where it differs from
        ``tensor_model_parallel_size`` (absent: equal, Megatron-Core's default), so that steps
        saved before it was recorded compare equal to the same layout today."""
        from megatron.core import parallel_state

        layout = {
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        }
        if self.expert_tensor_parallel_size != self.tensor_model_parallel_size:
            layout["expert_tensor_parallel_size"] = self.expert_tensor_parallel_size
        return layout

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _training_state(self) -> TrainingState:
        """This rank's model, optimizers and place, as the checkpoint engine reads them."""
        module = self.lightning_module
        assert module is not None
        return TrainingState(
            module=module,
            model_sharded_state_dict=self.model_sharded_state_dict,
            optimizers=self._torch_optimizers(),
            rank=self.global_rank,
            device=self.root_device,
            parallel_layout=self.parallel_layout(),
            strict=module.strict_loading,
            optimizer_sharding=self.config.ckpt_optimizer_sharding,
        )

    # Lightning's full state dicts: none. Weights and optimizer state are written sharded by
    # save_checkpoint and loaded sharded by load_checkpoint, never gathered whole.

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        return None

    # --- checkpoint: save (Lightning's goes through checkpoint_io on rank 0: not used) ----------

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint directory. Collective: every rank calls it, in the same order.

        A write error on any rank fails the save on every rank (no rank is left waiting) as
        :class:`CheckpointSaveError`, passed to ``storage_options.on_error`` and to the
        :class:`SaveListener` that owns ``filepath``, or raised when there is neither; the
        directory then never gets a commit.

        1) (all ranks) finalise a previous async save still in flight (one at a time)
        2) (rank 0) create ``filepath`` and its ``model/``, ``optim/``, ``extra/``
        3) (all ranks) write their shards of model and optimizer with dist-checkpointing
           (sync: durable on return; async: staged on return, written in the background)
        4) (all ranks) write ``extra/rank_<r>.pt``: RNG and Lightning's non-tensor state
        5) (all ranks) once durable everywhere, pass the :class:`SaveRecord` to
           ``storage_options.on_finalized`` and to the listener that owns ``filepath``
        """
        if storage_options is None:
            options = SaveOptions()
            lightning_checkpoints.replace_named(self, Path(filepath))  # Lightning's last.ckpt
        elif isinstance(storage_options, SaveOptions):
            options = storage_options
        else:
            raise TypeError(
                f"MegatronStrategy.save_checkpoint(storage_options={storage_options!r}): "
                "pass a lightning_mcore_ckpt.strategy.SaveOptions or None"
            )
        self._writer.save(checkpoint, filepath, options, self._training_state())

    def plan_saves_ahead(self, contents: Sequence[str] = CONTENTS) -> bool:
        """Plan the first save of ``contents`` now, so that it costs what the later ones do.

        Collective: every rank calls it at the same point, after an optimizer step (the
        optimizer's state exists). ``MegatronCheckpoint`` calls it once, after the first
        optimizer step of a fit that saved nothing at that step. Writes nothing; does nothing
        with ``ckpt_cache_plans=False`` or once plans are kept. Returns whether it planned; the
        seconds it took are logged (rank 0). See ``CheckpointWriter.plan_ahead``.
        """
        if not self._writer.may_plan_ahead:  # every step after the first: nothing to build
            return False
        planned = self._writer.plan_ahead(contents, self._training_state())
        if planned and self.global_rank == 0:
            log.info(
                "planned the first checkpoint save ahead in %.3f s", self._writer.planned_ahead_s
            )
        return planned

    def add_save_listener(self, listener: SaveListener) -> None:
        """Register ``listener`` to be told how the saves of the paths it owns end."""
        self._writer.add_listener(listener)

    def remove_save_listener(self, listener: SaveListener) -> None:
        """Undo :meth:`add_save_listener` (a no-op when not registered)."""
        self._writer.remove_listener(listener)

    def finalize_pending_save(self, blocking: bool = False) -> bool:
        """Finalise an async save whose background write has finished on every rank.

        Collective: every rank calls it at the same point (the strategy does so at each training
        batch start, before each save, and at the end of training). With ``blocking=True`` it
        waits for the write. Returns ``True`` when no save is in flight afterwards. A failure in
        the background write is raised here as :class:`CheckpointSaveError` naming the step.
        """
        return self._writer.finalize(blocking=blocking)

    def abandon_pending_save(self) -> None:
        """Stop the async save in flight, if any, and leave its step uncommitted. Local.

        For an error path, where the other ranks cannot be waited for: this rank's background
        writer is stopped, nothing is finalised, so the step never gets its commit marker (it
        stays incomplete, ignored by ``"last"`` and cleaned up by a later run). Called from
        :meth:`on_exception` and by ``MegatronCheckpoint`` before it releases its lock.
        """
        self._writer.abandon()

    def set_directory_leader(self, leader: bool | None) -> None:
        """Whether this rank creates each step's directories where its node's ranks write them.
        ``None`` (the default): global rank 0 alone, in a directory every rank shares.
        ``MegatronCheckpoint`` sets it at setup when its local directory is node-local (an
        object store's ``local_dir`` on nodes that share no file system): one leader per node.
        Local."""
        self._writer.directory_leader = leader

    # --- checkpoint: load (Lightning's reads one file through checkpoint_io: not used) ---------

    @property
    def checkpoint_sources(self) -> dict[str, Any]:
        """Where "last" of a checkpoint directory is found when it is not the directory itself
        (the local tier of an object-store ``dirpath``: the callback registers it)."""
        return self._reader.sources

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint directory into the current layout, whatever layout saved it.

        Collective. Weights always; the optimizer only when fitting (so evaluation and export
        read no optimizer bytes); RNG and Lightning's state from ``extra/`` (this rank's file when
        the layout is unchanged, else rank 0's, and RNG is then re-derived from the seed).

        Every pickle read is checked before it is unpickled, and one that would import a type
        outside torch's ``weights_only`` allowlist is refused on every rank with
        ``UnsafeCheckpointError``. ``weights_only=False``, or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
        in the environment when Lightning passes ``None``, loads it as trusted: unchecked.
        """
        trusted = safe_load.trusted_by_user(weights_only)
        with self._reader.one_load():  # what this load checked is not the next one's
            return self._load_checkpoint(checkpoint_path, trusted)

    def _load_checkpoint(self, checkpoint_path: Any, trusted: bool) -> dict[str, Any]:
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        source = self._reader.sources.get(str(checkpoint_path))
        recover = getattr(source, "recover", None)
        if recover is not None:  # a fast tier: which tier and which step, decided together
            # keep: this rank's files, read once and checked against their seal, are loaded
            # from those bytes (one pass over them).
            found = recover(self._training_state(), keep=True)
            if found is None:
                if self.global_rank == 0:
                    log.warning(
                        'ckpt_path="last": no complete checkpoint in either tier, '
                        "starting from scratch"
                    )
                return NothingLoaded()
            tier, checkpoint_path = found
            if tier == "fast":
                held = getattr(source, "take_held", lambda: None)() or {}
                checked = {checkpoint_path / name: data for name, data in held.items()}
                # A copy fetched from a peer was checked against its seal as it arrived and is
                # loaded from those bytes; a thread writes it into this node's directory once
                # training starts: training does not wait for that write (the first fast save
                # settles it).
                try:
                    return self._load_rank_files(checkpoint_path, trusted=trusted, held=checked)
                except BaseException:
                    getattr(source, "settle", lambda **_: None)(together=False)  # the load's error
                    raise
        # Evaluation reads no optimizer bytes: damage there does not stop it.
        reading = None if fitting else ("model", "extra")
        path = self._reader.resolve(checkpoint_path, self.global_rank, reading)
        if trusted and self.global_rank == 0:
            log.info("loading %s as trusted by the user: its pickles are not checked", path)
        if fitting and self.optimizers and (path / OPTIM_DIR).is_dir():
            # An optimizer state that cannot load into this layout: refused from the step's
            # record on every rank, before any of its files is read.
            self._reader.check_optimizer_layout(path, self._training_state(), trusted=trusted)
        self._reader.check_extra(path / EXTRA_DIR, self._training_state(), trusted=trusted)
        self._load_weights(path, trusted=trusted)
        if self._writer.shards.dedup is not None:  # the frozen tensors just loaded: reusable
            frozen = frozen_storages(self.lightning_module)
            self._writer.shards.dedup.seed(path, self.model_sharded_state_dict(), frozen)
        if fitting and self.optimizers and holds_weights_only(path):
            # Weights and nothing else (e.g. from `lightning-mcore-ckpt import`): training
            # starts from them, with a fresh optimizer and step 0.
            if self.global_rank == 0:
                log.warning(
                    "%s holds weights only: training starts from them at step 0 with a fresh "
                    "optimizer",
                    path,
                )
            return {}
        if fitting and self.optimizers:
            if not (path / OPTIM_DIR).is_dir():
                raise FileNotFoundError(
                    f"{path} has no {OPTIM_DIR}/ to resume the optimizer from; it was saved "
                    "without 'optimizer' in its contents"
                )
            self._load_optimizers(path / OPTIM_DIR, trusted=trusted)
        return self._load_extra(path / EXTRA_DIR, trusted=trusted)

    def _load_rank_files(
        self, path: Path, *, trusted: bool = False, held: dict[Path, Any] | None = None
    ) -> dict[str, Any]:
        """Load a fast-tier step: each rank its own files, in the layout that saved them;
        ``held``: their bytes as the recovery read and checked them (by path), not read again."""
        state = self._training_state()
        self._reader.check_extra(path / EXTRA_DIR, state, trusted=trusted, held=held)
        self._reader.load_rank_state(path, state, trusted=trusted, held=held)
        return self._load_extra(path / EXTRA_DIR, trusted=trusted, held=held)

    def newest_step(self, checkpoint_path: str) -> int | None:
        """The step ``fit(ckpt_path=checkpoint_path)`` would load now from a directory of steps
        (or its store), undamaged; ``None``: none. Local (one rank asks)."""
        return self._reader.newest_step(checkpoint_path)

    def _load_weights(self, path: Path, *, trusted: bool = False) -> None:
        self._reader.load_weights(path, self._training_state(), trusted=trusted)

    def _load_optimizers(self, directory: Path, *, trusted: bool = False) -> None:
        self._reader.load_optimizers(directory, self._training_state(), trusted=trusted)

    def _load_extra(
        self, directory: Path, *, trusted: bool = False, held: dict[Path, Any] | None = None
    ) -> dict[str, Any]:
        lightning, rng = self._reader.load_extra(
            directory, self._training_state(), seed=self.seed, trusted=trusted, held=held
        )
        if rng is not None:
            # Re-applied at the first resumed batch when it falls inside an epoch (see
            # on_train_batch_start).
            self._rng_at_load = rng
        return lightning

    # --- checkpoint: removal (Lightning's removes one file on rank 0: not used); teardown ------

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a directory this package wrote, whatever its name (``epoch=0-step=12.ckpt``
        too): collective, see :func:`~.lightning_checkpoints.remove`."""
        if self._writer.pending_path == Path(filepath):
            self.finalize_pending_save(blocking=True)
        lightning_checkpoints.remove(Path(filepath), self.global_rank, self.broadcast)

    @override
    def teardown(self) -> None:
        self._writer.close()
        # A load whose run never reached a training batch must not reach into the next run.
        self._rng_at_load = None
        # Parallel state stays up so that the model can still be used (and saved) after fit;
        # the next strategy to set up re-initialises it.
        super().teardown()

    # --- collectives ---------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: torch.Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> torch.Tensor | Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
