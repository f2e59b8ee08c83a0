"""``MegatronStrategy``: Megatron-Core parallelism and dist-checkpointing inside a Lightning Trainer."""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_mcore_ckpt.engine import (
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
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.strategy import _model_checkpoint as model_checkpoint
from lightning_mcore_ckpt.strategy._config import StrategyConfig
from lightning_mcore_ckpt.strategy._data import elastic_dataloader
from lightning_mcore_ckpt.strategy._training import MegatronTrainingBase
from lightning_mcore_ckpt.training.rng import RNGState

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MegatronStrategy"]

log = logging.getLogger(__name__)


class MegatronStrategy(MegatronTrainingBase):
    """Train Megatron-Core models in Lightning with TP/PP/CP/EP/DP and dist-checkpoints.

    The world size must be divisible by ``tensor_model_parallel_size`` x
    ``pipeline_model_parallel_size`` x ``context_parallel_size``; the rest is data parallelism.
    Build Megatron-Core modules in ``LightningModule.configure_model()``: parallel state and
    Megatron's RNG tracker are ready by then. Gradients are averaged over the data-parallel group
    by the strategy.

    Checkpoints are directories: ``model/`` and ``optim/`` are Megatron-Core dist-checkpoints
    (torch_dist), reshardable to any other layout; ``extra/`` holds, per rank, the RNG state and
    Lightning's own checkpoint content (loops, callbacks, schedulers, hyperparameters).

    The arguments are the fields of :class:`~lightning_mcore_ckpt.strategy.StrategyConfig`
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

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        seed: int = 1234,
        ckpt_async_save: bool = False,
        ckpt_parallel_save: bool = True,
        ckpt_parallel_load: bool = False,
        ckpt_optimizer_sharding: str = "dp_reshardable",
        ckpt_writer: str = "threads",
        ckpt_write_threads: int | None = None,
        ckpt_read_threads: int | None = None,
        ckpt_verify_hashes: bool = False,
        ckpt_dedup: bool = False,
        ckpt_cache_plans: bool = True,
        ckpt_max_staging_bytes: int | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta = default_pg_timeout,
        init_from: str | os.PathLike[str] | None = None,
    ) -> None:
        # Every argument is a StrategyConfig field of the same name.
        arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        config = StrategyConfig(**arguments)
        super().__init__(config)
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
        self._rng_at_load: dict[str, Any] | None = None

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
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return elastic_dataloader(dataloader)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        model_checkpoint.check_callbacks(trainer, dedup=self.config.ckpt_dedup)
        self.accelerator.setup(trainer)
        self._check_model_configs()
        self._convert_precision()
        self.model_to_device()
        self.barrier("MegatronStrategy.setup")
        if trainer.state.fn == TrainerFn.FITTING:
            self._initialize_weights(trainer)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning clips by the norm of this rank's gradients; with model parallelism that norm
        # must be the model's (see clip_grad_by_norm).
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign,assignment]

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
            trusted = _safe_load.trusted_by_user()
            self._load_weights(layout.resolve_checkpoint(init_from), trusted=trusted)
        self.barrier("MegatronStrategy.init_from")
        if self.global_rank == 0:
            log.info(
                "no checkpoint to resume from: initialised the weights from %s in %.1fs",
                init_from,
                time.perf_counter() - start,
            )

    # --- checkpoint: state dicts ----------------------------------------------------------

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """The LightningModule's weights as a Megatron-Core sharded state dict.

        Megatron-Core modules contribute their own ``sharded_state_dict()``; any other parameter
        or persistent buffer is a replicated tensor (written once, by global rank 0's replica).
        """
        assert self.lightning_module is not None
        return module_sharded_state_dict(self.lightning_module)

    def parallel_layout(self) -> dict[str, int]:
        """The parallel sizes of this run, as recorded in checkpoints."""
        from megatron.core import parallel_state

        return {
            "world_size": dist.get_world_size(),
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        }

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

    # --- checkpoint: save -----------------------------------------------------------------

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
            model_checkpoint.replace_named(self, Path(filepath))  # Lightning's last.ckpt
        elif isinstance(storage_options, SaveOptions):
            options = storage_options
        else:
            raise TypeError(
                f"MegatronStrategy.save_checkpoint(storage_options={storage_options!r}): "
                "pass a lightning_mcore_ckpt.strategy.SaveOptions or None"
            )
        self._writer.save(checkpoint, filepath, options, self._training_state())

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

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.abandon_pending_save()
        super().on_exception(exception)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._rng_at_load is not None:
            state, self._rng_at_load = self._rng_at_load, None
            if batch_idx > 0:
                # Resumed inside an epoch: undo the draws made since the load (the loader's new
                # iterator), so the next batch sees the RNG exactly as the uninterrupted run.
                RNGState().load_state_dict(state)
        if self._writer.pending_path is not None:
            self.finalize_pending_save(blocking=False)

    @override
    def on_train_end(self) -> None:
        self.finalize_pending_save(blocking=True)

    # --- checkpoint: load -----------------------------------------------------------------

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
        trusted = _safe_load.trusted_by_user(weights_only)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # Evaluation reads no optimizer bytes: damage there does not stop it.
        reading = None if fitting else ("model", "extra")
        path = self._reader.resolve(checkpoint_path, self.global_rank, reading)
        if trusted and self.global_rank == 0:
            log.info("loading %s as trusted by the user: its pickles are not checked", path)
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

    def _load_weights(self, path: Path, *, trusted: bool = False) -> None:
        self._reader.load_weights(path, self._training_state(), trusted=trusted)

    def _load_optimizers(self, directory: Path, *, trusted: bool = False) -> None:
        self._reader.load_optimizers(directory, self._training_state(), trusted=trusted)

    def _load_extra(self, directory: Path, *, trusted: bool = False) -> dict[str, Any]:
        lightning, rng = self._reader.load_extra(
            directory, self._training_state(), seed=self.seed, trusted=trusted
        )
        if rng is not None:
            # Re-applied at the first resumed batch when it falls inside an epoch (see
            # on_train_batch_start).
            self._rng_at_load = rng
        return lightning

    # --- checkpoint: remove, teardown -----------------------------------------------------

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a directory this package wrote, whatever its name (``epoch=0-step=12.ckpt``
        too): collective, see :func:`~._model_checkpoint.remove`."""
        if self._writer.pending_path == Path(filepath):
            self.finalize_pending_save(blocking=True)
        model_checkpoint.remove(Path(filepath), self.global_rank, self.broadcast)

    @override
    def teardown(self) -> None:
        self._writer.close()
        # A load whose run never reached a training batch must not reach into the next run.
        self._rng_at_load = None
        # Parallel state stays up so that the model can still be used (and saved) after fit;
        # the next strategy to set up re-initialises it.
        super().teardown()
