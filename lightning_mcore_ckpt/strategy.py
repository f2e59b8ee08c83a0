"""``MegatronStrategy``: Megatron-Core parallelism and dist-checkpointing inside a Lightning Trainer."""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
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
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from lightning_mcore_ckpt import _atomic, _compat, _cpu, _optim, _parallel, layout, retention
from lightning_mcore_ckpt._rng import RNGState
from lightning_mcore_ckpt.layout import EXTRA_DIR, EXTRA_FORMAT_VERSION, MODEL_DIR, OPTIM_DIR

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "EXTRA_DIR",
    "MODEL_DIR",
    "OPTIM_DIR",
    "CheckpointSaveError",
    "MegatronStrategy",
    "SaveListener",
    "SaveOptions",
    "SaveRecord",
]

log = logging.getLogger(__name__)

CONTENTS = ("model", "optimizer", "extra")
LOADED_FROM_KEY = "lightning_mcore_ckpt"
"""Key of the checkpoint dict ``load_checkpoint`` returns that says where it came from and the
parallel layout that saved it (callbacks read it in ``on_load_checkpoint``)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint write failed (raised on every rank, naming the step directory).

    Example::

        try:
            trainer.fit(module, ckpt_path="last")
        except CheckpointSaveError as err:
            log.error("%s", err)  # names the step, the failing rank and the cause
    """


@dataclass(frozen=True, kw_only=True)
class SaveRecord:
    """What one save did, once it is durable on every rank (the same on every rank).

    Passed to ``SaveOptions.on_finalized`` and to every registered :class:`SaveListener` that
    owns the path.
    """

    path: Path
    """The step directory."""
    contents: tuple[str, ...]
    """What was written: a subset of ``("model", "optimizer", "extra")``."""
    asynchronous: bool
    """Whether the shards were written in the background."""
    writer: str
    """The async writer (``"megatron"`` or ``"nvrx"``); see :func:`_compat.async_strategy`."""
    parallel_layout: dict[str, int]
    """The parallel sizes of the saving run."""
    blocking_time_s: float
    """How long training was blocked, on the slowest rank."""
    write_time_s: float
    """How long the shard writes lasted, on the slowest rank."""
    total_time_s: float
    """From the start of the save until it was durable everywhere, on the slowest rank."""
    finalized_at: float
    """``time.perf_counter()`` on this rank when the save became durable everywhere."""


@runtime_checkable
class SaveListener(Protocol):
    """Told, on every rank, how the saves of the paths it owns ended.

    Registered once with :meth:`MegatronStrategy.add_save_listener` (``MegatronCheckpoint``
    registers its committer), instead of handlers passed with each save. For a save whose path
    a listener owns, a failure goes to the listener instead of being raised.
    """

    def owns(self, path: Path) -> bool:
        """Whether saves to ``path`` are this listener's."""
        ...

    def saved(self, record: SaveRecord) -> None:
        """Every rank, in order: the save is durable on all ranks."""
        ...

    def failed(self, path: Path, error: CheckpointSaveError) -> None:
        """Every rank: the save to ``path`` failed (the same error everywhere)."""
        ...


@dataclass(kw_only=True)
class SaveOptions:
    """What :meth:`MegatronStrategy.save_checkpoint` writes, passed as ``storage_options``.

    Example::

        trainer.save_checkpoint(
            "checkpoints/global_step_100",
            storage_options=SaveOptions(contents=["model"], synchronous=True),
        )
    """

    contents: Sequence[str] = CONTENTS
    """Subset of ``("model", "optimizer", "extra")`` to write."""
    on_finalized: list[Callable[[SaveRecord], None]] = field(default_factory=list)
    """Called on every rank, in order, once the whole save is durable on all ranks, with its
    :class:`SaveRecord`. For an async save this happens at finalisation."""
    synchronous: bool = False
    """Write synchronously even with ``ckpt_async_save=True`` (e.g. before a preempted exit)."""
    on_error: Callable[[CheckpointSaveError], None] | None = None
    """Called on every rank instead of raising when this save fails (sync: from
    ``save_checkpoint``; async: at finalisation). Default: a :class:`SaveListener` that owns
    the path, else raise."""
    started_at: float | None = None
    """``time.perf_counter()`` when the caller began this save's work on the training thread
    (its own preparation then counts as blocking time). Default: when ``save_checkpoint``
    starts."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.contents) - set(CONTENTS))
        if unknown:
            raise ValueError(
                f"SaveOptions(contents=...): unknown {unknown}; choose from {list(CONTENTS)}"
            )


@dataclass
class _PendingSave:
    path: Path
    call_ids: list[int]
    timings: dict[str, float]
    base: dict[str, Any]
    options: SaveOptions
    write_timer: torch.Tensor
    """Shared memory the background writer stores its write duration in."""


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MegatronStrategy({name}={value!r}): must be a positive int")
    return value


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

    Example::

        trainer = L.Trainer(
            strategy=MegatronStrategy(tensor_model_parallel_size=2),
            accelerator="cpu", devices=2, max_steps=100,
        )
        trainer.fit(module)
        trainer.save_checkpoint("checkpoints/global_step_100")

    Args:
        tensor_model_parallel_size: ranks each layer's tensors are split across.
        pipeline_model_parallel_size: ranks the layers are split across.
        context_parallel_size: ranks the sequence is split across.
        expert_model_parallel_size: ranks the MoE experts are split across.
        sequence_parallel: Megatron sequence parallelism (must match the model's config).
        seed: seeds Python, NumPy, torch and Megatron's RNG tracker (offset per pipeline stage
            and tensor-parallel rank as Megatron-LM does).
        ckpt_async_save: write checkpoints in the background after staging them.
        ckpt_parallel_save: spread the writes of replicated tensors across data-parallel ranks.
        ckpt_parallel_load: spread the reads across data-parallel ranks (CUDA only; ignored with
            an info message on CPU).
        process_group_backend: ``"nccl"`` or ``"gloo"``; default nccl with CUDA, gloo without.
        timeout: timeout of the process groups' collectives.
        init_from: initial weights for a ``fit`` that does not resume from a checkpoint: a
            Hugging Face model directory (converted on the fly through mbridge; every rank reads
            only its own shards) or a step directory (e.g. from ``lightning-mcore-ckpt import``;
            any layout). When ``fit`` resumes (``ckpt_path="last"`` finds a step), resuming wins
            and this is ignored, with a log line.
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
        process_group_backend: str | None = None,
        timeout: datetime.timedelta = default_pg_timeout,
        init_from: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        self.tensor_model_parallel_size = _check_size(
            "tensor_model_parallel_size", tensor_model_parallel_size
        )
        self.pipeline_model_parallel_size = _check_size(
            "pipeline_model_parallel_size", pipeline_model_parallel_size
        )
        self.context_parallel_size = _check_size("context_parallel_size", context_parallel_size)
        self.expert_model_parallel_size = _check_size(
            "expert_model_parallel_size", expert_model_parallel_size
        )
        for name, flag in (
            ("sequence_parallel", sequence_parallel),
            ("ckpt_async_save", ckpt_async_save),
            ("ckpt_parallel_save", ckpt_parallel_save),
            ("ckpt_parallel_load", ckpt_parallel_load),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"MegatronStrategy({name}={flag!r}): must be True or False")
        if sequence_parallel and tensor_model_parallel_size == 1:
            raise ValueError(
                "MegatronStrategy(sequence_parallel=True) needs tensor_model_parallel_size > 1; "
                "set sequence_parallel=False or raise tensor_model_parallel_size"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"MegatronStrategy(seed={seed!r}): must be a non-negative int")
        if process_group_backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"MegatronStrategy(process_group_backend={process_group_backend!r}): "
                "use 'nccl', 'gloo' or None (nccl with CUDA, gloo without)"
            )
        if init_from is not None:
            source = Path(init_from).expanduser()
            if not ((source / "config.json").is_file() or (source / MODEL_DIR).is_dir()):
                what = "does not exist" if not source.exists() else "has neither"
                raise ValueError(
                    f"MegatronStrategy(init_from={str(init_from)!r}): {what} config.json (a "
                    f"Hugging Face model directory) nor {MODEL_DIR}/ (a step directory); pass "
                    "one of those"
                )
            if (source / "config.json").is_file():
                from lightning_mcore_ckpt.hf import HFBridge

                HFBridge(source, argument="MegatronStrategy(init_from=...)")
        self.init_from = None if init_from is None else Path(init_from).expanduser()
        self.sequence_parallel = sequence_parallel
        self.seed = seed
        self.ckpt_async_save = ckpt_async_save
        self.ckpt_parallel_save = ckpt_parallel_save
        self.ckpt_parallel_load = ckpt_parallel_load
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._async_queue: Any = None
        self._pending: _PendingSave | None = None
        self._listeners: list[SaveListener] = []
        self._schedule_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] | None = None
        self._rng_at_load: dict[str, Any] | None = None

    # --- topology -------------------------------------------------------------------------

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
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
        from torch.utils.data import DistributedSampler

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        # Lightning passes the batch sampler along when it injects its sampler.
        batch_size = getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
        if (
            trainer is None
            or not trainer.training
            or type(dataloader).__name__ != "StatefulDataLoader"
            or not isinstance(batch_size, int)
        ):
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

        from lightning_mcore_ckpt.sampler import ElasticSampler

        elastic = ElasticSampler(
            dataloader.dataset,
            micro_batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
        )
        return _update_dataloader(dataloader, elastic)

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Optimizer state is loaded, sharded, in load_checkpoint.
        return False

    @override
    def _configure_launcher(self) -> None:
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
        backend = self._process_group_backend or _parallel.default_backend()
        self._process_group_backend = backend
        _cpu.install()
        if not _distributed_is_initialized():
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        _parallel.initialize(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            seed=self.seed,
            timeout=self._timeout,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._check_model_configs()
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
        if self.init_from is None:
            return
        if trainer.ckpt_path is not None:
            if self.global_rank == 0:
                log.info(
                    "resuming from %s; init_from=%s not used", trainer.ckpt_path, self.init_from
                )
            return
        start = time.perf_counter()
        if (self.init_from / "config.json").is_file():
            from megatron.core.models.gpt import GPTModel

            from lightning_mcore_ckpt import hf

            assert self.lightning_module is not None
            prefixes = [
                f"{name}."
                for name, m in self.lightning_module.named_modules()
                if isinstance(m, GPTModel)
            ]
            if not prefixes:
                raise ValueError(
                    f"MegatronStrategy(init_from={self.init_from}): a Hugging Face model "
                    "initialises a Megatron-Core GPTModel, and the LightningModule has none"
                )
            hf.load_hf_weights(prefixes, self.init_from, self.model_sharded_state_dict)
        else:
            self._load_weights(layout.resolve_checkpoint(self.init_from))
        self.barrier("MegatronStrategy.init_from")
        if self.global_rank == 0:
            log.info(
                "no checkpoint to resume from: initialised the weights from %s in %.1fs",
                self.init_from,
                time.perf_counter() - start,
            )

    def _megatron_modules(self) -> list[Any]:
        from megatron.core.transformer.module import MegatronModule

        assert self.model is not None
        return [m for m in self.model.modules() if isinstance(m, MegatronModule)]

    def _check_model_configs(self) -> None:
        for module in self._megatron_modules():
            config = getattr(module, "config", None)
            if config is None:
                continue
            for attr, expected in (
                ("tensor_model_parallel_size", self.tensor_model_parallel_size),
                ("pipeline_model_parallel_size", self.pipeline_model_parallel_size),
                ("sequence_parallel", self.sequence_parallel),
            ):
                got = getattr(config, attr, expected)
                if got != expected:
                    raise ValueError(
                        f"{type(module).__name__}.config.{attr}={got!r} but "
                        f"MegatronStrategy({attr}={expected!r}); build the model's "
                        "TransformerConfig from the strategy's settings"
                    )
            break

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- collectives ----------------------------------------------------------------------

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

    # --- gradients ------------------------------------------------------------------------

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
            return self._megatron_optimizer_step(inner, closure)

        def closure_then_sync_grads() -> Any:
            result = closure()
            self.finalize_grads()
            return result

        return super().optimizer_step(optimizer, closure_then_sync_grads, model, **kwargs)

    def _megatron_optimizer_step(self, optimizer: Any, closure: Callable[[], Any]) -> Any:
        # A MegatronOptimizer steps without a closure and clips by its own config (clip_grad);
        # Megatron DDP keeps gradients in its buffers, zeroed once the step has used them.
        from megatron.core.distributed import DistributedDataParallel as MegatronDDP

        result = closure()
        self.finalize_grads()
        optimizer.step()
        assert self.model is not None
        for chunk in self.model.modules():
            if isinstance(chunk, MegatronDDP):
                chunk.zero_grad_buffer()
        return result

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Lightning accepts objects that look like torch optimizers; a MegatronOptimizer lacks
        # only `defaults`. Give it one, so configure_optimizers may return it as it is.
        module = self.lightning_module
        assert module is not None
        configure = module.configure_optimizers

        def configure_optimizers() -> Any:
            conf = configure()
            _give_megatron_optimizers_defaults(conf)
            return conf

        module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        try:
            super().setup_optimizers(trainer)
        finally:
            del module.configure_optimizers

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
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunk = model if model is not None else self._model_chunk()
        accumulate = 1
        if not forward_only and self.lightning_module is not None:
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
        losses: list[torch.Tensor] = []

        def step(data: Any, module: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            output, loss_func = forward_step_func(data, module)

            def recorded_loss(out: torch.Tensor) -> Any:
                loss, *rest = loss_func(out)
                if len(rest) == 2:  # (loss_sum, num_tokens, logged): the mean is per token
                    losses.append(loss.detach() / torch.clamp(rest[0], min=1))
                else:
                    losses.append(loss.detach().clone())
                # Lightning divides by accumulate_grad_batches before its backward; do the same.
                return (loss / accumulate, *rest) if accumulate > 1 else (loss, *rest)

            return output, recorded_loss

        # Lightning's automatic optimisation zeroes gradients *after* training_step and before
        # its backward: keep the schedule's gradients aside and add them in backward(), so
        # accumulation and zero_grad behave exactly as with an ordinary loss.backward().
        stash = (
            not forward_only
            and self.lightning_module is not None
            and self.lightning_module.automatic_optimization
        )
        params = [p for p in chunk.parameters() if p.requires_grad]
        previous = [p.grad for p in params] if stash else []
        if stash:
            for p in params:
                p.grad = None
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data_iterator,
            model=[chunk],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        mean = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            mean = mean.to(self.root_device)
            dist.broadcast(
                mean,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        if stash:
            self._schedule_grads = [(p, p.grad) for p in params]
            for p, grad in zip(params, previous, strict=True):
                p.grad = grad
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
            # forward_backward already ran the backward pass of this loss: add its gradients.
            for p, grad in self._schedule_grads:
                if grad is None:
                    continue
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)
            self._schedule_grads = None
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _model_chunk(self) -> torch.nn.Module:
        from megatron.core.transformer.module import MegatronModule

        assert self.lightning_module is not None
        chunks = [m for m in self.lightning_module.children() if isinstance(m, MegatronModule)]
        if len(chunks) != 1:
            raise ValueError(
                f"forward_backward(model=None) needs exactly one Megatron-Core module attribute "
                f"on the LightningModule, found {len(chunks)}; pass model=<the module to run>"
            )
        return chunks[0]

    def finalize_grads(self) -> None:
        """Average gradients over the data-parallel group; sum sequence-parallel norms over TP.

        Called by :meth:`optimizer_step` after the (last accumulated) backward. With Megatron-Core
        ``DistributedDataParallel`` model chunks (the GPU path with a ``MegatronOptimizer``),
        Megatron's own ``finalize_model_grads`` does it instead.
        """
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel as MegatronDDP

        assert self.model is not None
        chunks = [m for m in self.model.modules() if isinstance(m, MegatronDDP)]
        if chunks:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(chunks)
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_size = dist.get_world_size(dp_group)
        if dp_size > 1:
            _all_reduce_flat(grads, dp_group, scale=1.0 / dp_size)
        if self.pipeline_model_parallel_size > 1:
            _all_reduce_tied_embedding_grads(self._megatron_modules())
        if self.sequence_parallel and self.tensor_model_parallel_size > 1:
            sp = [
                g
                for p, g in zip(params, grads, strict=True)
                if getattr(p, "sequence_parallel", False)
            ]
            _all_reduce_flat(sp, parallel_state.get_tensor_model_parallel_group())

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip gradients by the norm of the whole model's gradient (``gradient_clip_val``).

        Each rank holds a shard of the gradient: the norm is summed over the tensor- and
        pipeline-parallel ranks, counting tensor-parallel duplicates (layer norms) and the
        pipeline's second copy of tied embeddings once, so every rank scales by the same
        coefficient and the update equals the unsharded model's. Returns the total norm.
        """
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.precision_plugin.main_params(optimizer) if p.grad is not None]
        grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
        counted = [
            g
            for p, g in zip(params, grads, strict=True)
            if not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p)
        ]
        device = grads[0].device if grads else self.root_device
        square = torch.zeros((), dtype=torch.float32, device=device)
        for grad in counted:
            square += grad.detach().float().pow(2).sum()
        model_parallel = parallel_state.get_model_parallel_group()
        if dist.get_world_size(model_parallel) > 1:
            dist.all_reduce(square, group=model_parallel)
        total = square.sqrt()
        # Same coefficient as torch.nn.utils.clip_grad_norm_.
        coefficient = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coefficient.to(g.dtype))

    # --- checkpoint: state dicts ----------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Weights are written sharded by save_checkpoint, never as a full state dict.
        return {}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        # Loaded in load_checkpoint, sharded.
        return None

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        return None

    def model_sharded_state_dict(self) -> dict[str, Any]:
        """The LightningModule's weights as a Megatron-Core sharded state dict.

        Megatron-Core modules contribute their own ``sharded_state_dict()``; any other parameter
        or persistent buffer is a replicated tensor (written once, by global rank 0's replica).
        """
        assert self.lightning_module is not None
        return _module_sharded_state_dict(self.lightning_module, "")

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        out = []
        for opt in self.optimizers:
            out.append(opt._optimizer if isinstance(opt, LightningOptimizer) else opt)
        return out

    def _optimizer_sharded_state_dict(
        self, model_ssd: dict[str, Any], is_loading: bool = False
    ) -> dict[str, Any]:
        from megatron.core.optimizer import MegatronOptimizer

        out: dict[str, Any] = {}
        optimizers = self._torch_optimizers()
        held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
        assert self.lightning_module is not None
        outside = [p for p in self.lightning_module.parameters() if id(p) not in held]
        for idx, opt in enumerate(optimizers):
            if isinstance(opt, MegatronOptimizer):
                out[f"optimizer_{idx}"] = opt.sharded_state_dict(model_ssd, is_loading=is_loading)
            else:
                out[f"optimizer_{idx}"] = _optim.sharded_state_dict(
                    opt, model_ssd, outside if idx == 0 else ()
                )
        return out

    # --- checkpoint: save -----------------------------------------------------------------

    def _save_strategy(self) -> Any:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        strategy = get_default_save_sharded_strategy("torch_dist")
        if self.ckpt_parallel_save and parallel_state.get_data_parallel_world_size() > 1:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        return strategy

    def _load_strategy(self, path: Path) -> Any:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
        )

        strategy = get_default_load_sharded_strategy(str(path))
        if self.ckpt_parallel_load and parallel_state.get_data_parallel_world_size() > 1:
            if _cpu.parallel_load_supported():
                strategy = FullyParallelLoadStrategyWrapper(
                    strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
                )
            else:
                log.info("ckpt_parallel_load needs CUDA; loading without it on CPU")
        return strategy

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
        from megatron.core import dist_checkpointing

        if storage_options is None:
            options = SaveOptions()
        elif isinstance(storage_options, SaveOptions):
            options = storage_options
        else:
            raise TypeError(
                f"MegatronStrategy.save_checkpoint(storage_options={storage_options!r}): "
                "pass a lightning_mcore_ckpt.strategy.SaveOptions or None"
            )
        self.finalize_pending_save(blocking=True)
        start = time.perf_counter() if options.started_at is None else options.started_at
        path = Path(self.broadcast(str(filepath)))
        contents = list(options.contents)
        problem = None
        if self.global_rank == 0:
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                problem = (
                    f"checkpoint directory {path} exists and is not empty; "
                    "save each step to a new directory"
                )
            else:
                try:
                    layout.mark_step_started(path)
                    for sub, wanted in (
                        (MODEL_DIR, "model"),
                        (OPTIM_DIR, "optimizer"),
                        (EXTRA_DIR, "extra"),
                    ):
                        if wanted in contents:
                            (path / sub).mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    problem = f"cannot create checkpoint directory {path}: {err}"
        # Every rank raises the same error instead of waiting for rank 0 in a barrier.
        problem = self.broadcast(problem)
        if problem is not None:
            if problem.startswith("cannot create"):
                return self._failed(path, CheckpointSaveError(problem), options)
            raise FileExistsError(problem)
        async_save = self.ckpt_async_save and not options.synchronous
        requests = []
        model_ssd = self.model_sharded_state_dict()
        # Sync and async saves take the same path (as dist_checkpointing.save does internally):
        # plan and stage here, write (inline or in the background), then finalise. So both
        # measure the same phases.
        if "model" in contents:
            requests.append(
                dist_checkpointing.save(
                    model_ssd,
                    str(path / MODEL_DIR),
                    sharded_strategy=self._save_strategy(),
                    async_sharded_save=True,
                    **_compat.save_kwargs(),
                )
            )
        if "optimizer" in contents and self.optimizers:
            requests.append(
                dist_checkpointing.save(
                    # save() consumes the model's sharded dict; map the optimizer onto a new one.
                    self._optimizer_sharded_state_dict(self.model_sharded_state_dict()),
                    str(path / OPTIM_DIR),
                    sharded_strategy=self._save_strategy(),
                    async_sharded_save=True,
                    **_compat.save_kwargs(),
                )
            )
        write_timer = torch.zeros(1, dtype=torch.float64).share_memory_()
        request = _combine_async_requests([r for r in requests if r is not None], write_timer)
        extra_write_s = 0.0
        error: BaseException | None = None
        if "extra" in contents:
            extra_start = time.perf_counter()
            try:
                self._save_extra(path / EXTRA_DIR, checkpoint)
            except OSError as err:
                error = err
            extra_write_s = time.perf_counter() - extra_start
        failure = self._agree_on_failure(error, path, "writing extra/")
        if failure is not None:
            return self._failed(path, failure, options)
        base: dict[str, Any] = {
            "path": path,
            "contents": tuple(contents),
            "asynchronous": async_save,
            "writer": _compat.async_strategy(),
            "parallel_layout": self.parallel_layout(),
        }
        timings = {"start": start, "extra_write_s": extra_write_s}
        if async_save:
            call_id = self._get_async_queue().schedule_async_request(request)
            timings["call_s"] = time.perf_counter() - start
            self._pending = _PendingSave(path, [call_id], timings, base, options, write_timer)
            return None
        try:
            _run_in_order(*request.async_fn_args)
        except Exception as err:  # noqa: BLE001 - any write error: shared, then raised
            error = err
        failure = self._agree_on_failure(error, path, "writing model/ and optim/")
        if failure is None:
            # Collective: shard writers report their errors here (the failing rank's names the
            # cause; the others only learn that a rank failed): share the failing rank's.
            try:
                for finalize in request.finalize_fns:
                    finalize()
            except (Exception, CheckpointException) as err:  # noqa: BLE001 - shared, re-raised
                error = err
            failure = self._agree_on_failure(error, path, "finishing model/ and optim/")
        if failure is not None:
            return self._failed(path, failure, options)
        timings["call_s"] = time.perf_counter() - start
        self._complete(base, timings, write_timer, options)
        return None

    def _agree_on_failure(
        self, error: BaseException | None, path: Path, phase: str
    ) -> CheckpointSaveError | None:
        """Collective: every rank learns whether any rank failed, so none waits for it.

        The error reported everywhere is the lowest failing rank's (for a shard write error,
        rank 0 is the one that holds every rank's details).
        """
        world = dist.get_world_size()
        mine = torch.tensor([world if error is None else self.global_rank], device=self.root_device)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        failed_rank = int(mine.item())
        if failed_rank >= world:
            return None
        why = [_describe_error(error) if error is not None else ""]
        dist.broadcast_object_list(why, src=failed_rank)
        failure = CheckpointSaveError(
            f"checkpoint save to {path} failed while {phase} (rank {failed_rank}): {why[0]}"
        )
        failure.__cause__ = error
        return failure

    def add_save_listener(self, listener: SaveListener) -> None:
        """Register ``listener`` to be told how the saves of the paths it owns end."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_save_listener(self, listener: SaveListener) -> None:
        """Undo :meth:`add_save_listener` (a no-op when not registered)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _owners(self, path: Path) -> list[SaveListener]:
        return [listener for listener in self._listeners if listener.owns(path)]

    def _failed(self, path: Path, failure: CheckpointSaveError, options: SaveOptions) -> None:
        handled = False
        if options.on_error is not None:
            options.on_error(failure)
            handled = True
        for listener in self._owners(path):
            listener.failed(path, failure)
            handled = True
        if not handled:
            raise failure

    def _save_extra(self, directory: Path, checkpoint: dict[str, Any]) -> None:
        payload = {
            "version": EXTRA_FORMAT_VERSION,
            "rank": self.global_rank,
            "parallel_layout": self.parallel_layout(),
            "rng": RNGState().state_dict(),
            # Which parameters had no optimizer state (frozen, or never given a gradient).
            "optimizer_stateless": [_optim.stateless_params(o) for o in self._torch_optimizers()],
            "lightning": {
                k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
            },
        }
        target = directory / f"rank_{self.global_rank:05d}.pt"
        _atomic.write_with(target, lambda f: torch.save(payload, f))

    def _complete(
        self,
        base: dict[str, Any],
        timings: dict[str, float],
        write_timer: torch.Tensor,
        options: SaveOptions,
    ) -> None:
        # Collective (every rank finalises the same save at the same point): the job was
        # blocked, and the write lasted, as long as on its slowest rank.
        # The save's total time runs from the first rank's start (clocks of different hosts
        # are not compared: each rank measures its own elapsed time).
        now = time.perf_counter()
        mine = [
            timings["call_s"] + timings.get("finalize_s", 0.0),
            float(write_timer[0]) + timings["extra_write_s"],
            now - timings["start"],
        ]
        slowest = torch.tensor(mine, dtype=torch.float64, device=self.root_device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        blocking, write, elapsed = (float(x) for x in slowest.cpu())
        record = SaveRecord(
            **base,
            blocking_time_s=blocking,
            write_time_s=write,
            total_time_s=elapsed,
            finalized_at=now,
        )
        for fn in options.on_finalized:
            fn(record)
        for listener in self._owners(record.path):
            listener.saved(record)

    def _get_async_queue(self) -> Any:
        if self._async_queue is None:
            async_calls_queue, _ = _compat.async_classes()
            self._async_queue = async_calls_queue()
        return self._async_queue

    def finalize_pending_save(self, blocking: bool = False) -> bool:
        """Finalise an async save whose background write has finished on every rank.

        Collective: every rank calls it at the same point (the strategy does so at each training
        batch start, before each save, and at the end of training). With ``blocking=True`` it
        waits for the write. Returns ``True`` when no save is in flight afterwards. A failure in
        the background write is raised here as :class:`CheckpointSaveError` naming the step.
        """
        pending = self._pending
        if pending is None:
            return True
        start = time.perf_counter()

        try:
            finalized = self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        # CheckpointException is a BaseException; either is re-raised as CheckpointSaveError.
        except (Exception, CheckpointException) as err:  # noqa: BLE001
            self._pending = None
            failure = CheckpointSaveError(
                f"async checkpoint save to {pending.path} failed in the background write: {err}"
            )
            failure.__cause__ = err
            self._failed(pending.path, failure, pending.options)
            return True
        pending.call_ids = [c for c in pending.call_ids if c not in finalized]
        if pending.call_ids:
            return False
        self._pending = None
        pending.timings["finalize_s"] = time.perf_counter() - start
        self._complete(pending.base, pending.timings, pending.write_timer, pending.options)
        return True

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._rng_at_load is not None:
            state, self._rng_at_load = self._rng_at_load, None
            if batch_idx > 0:
                # Resumed inside an epoch: undo the draws made since the load (the loader's new
                # iterator), so the next batch sees the RNG exactly as the uninterrupted run.
                RNGState().load_state_dict(state)
        if self._pending is not None:
            self.finalize_pending_save(blocking=False)

    @override
    def on_train_end(self) -> None:
        self.finalize_pending_save(blocking=True)

    # --- checkpoint: load -----------------------------------------------------------------

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint directory into the current layout, whatever layout saved it.

        Collective. Weights always; the optimizer only when fitting (so evaluation and export
        read no optimizer bytes); RNG and Lightning's state from ``extra/`` (this rank's file when
        the layout is unchanged, else rank 0's, and RNG is then re-derived from the seed).
        """

        problem = resolved = None
        if self.global_rank == 0:
            try:
                resolved = str(layout.resolve_checkpoint(checkpoint_path))
            except FileNotFoundError as err:
                problem = str(err)
        resolved, problem = self.broadcast((resolved, problem))
        if problem is not None:
            raise FileNotFoundError(problem)
        path = Path(resolved)
        if self.global_rank == 0 and str(path) != str(checkpoint_path):
            log.info("resuming from %s", path)
        if not (path / MODEL_DIR).is_dir():
            raise FileNotFoundError(
                f"{path} is not a lightning-mcore-ckpt step directory: it has no {MODEL_DIR}/ "
                "(expected model/, optim/, extra/)"
            )
        layout.check_format(path)
        _compat.check_readable(path)
        self._load_weights(path)
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and self.optimizers and _weights_only(path):
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
            self._load_optimizers(path / OPTIM_DIR)
        return self._load_extra(path / EXTRA_DIR)

    def _check_shapes(self, model_dir: Path) -> None:
        """Name the first tensor whose shape differs between the checkpoint and the model."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
        from torch.distributed.checkpoint import FileSystemReader

        saved = {
            key: tuple(md.size)
            for key, md in FileSystemReader(str(model_dir))
            .read_metadata()
            .state_dict_metadata.items()
            if hasattr(md, "size")
        }
        ssd = self.model_sharded_state_dict()
        apply_factories(ssd)
        for sh in nested_values(ssd):
            if not isinstance(sh, ShardedTensor):
                continue
            want, got = tuple(sh.global_shape), saved.get(sh.key)
            if got is None:
                raise ValueError(
                    f"checkpoint {model_dir.parent} does not fit the model: it has no tensor "
                    f"{sh.key!r} (shape {list(want)} in the model); load it into the model it "
                    "was saved from (same attribute names and config)"
                )
            if got != want:
                raise ValueError(
                    f"checkpoint {model_dir.parent} does not fit the model: {sh.key} has shape "
                    f"{list(got)} in the checkpoint but {list(want)} in the model; load it into "
                    "a model with the configuration it was saved with"
                )

    def _load_weights(self, path: Path) -> None:
        from megatron.core import dist_checkpointing

        self._check_shapes(path / MODEL_DIR)

        loaded = dist_checkpointing.load(
            self.model_sharded_state_dict(),
            str(path / MODEL_DIR),
            sharded_strategy=self._load_strategy(path / MODEL_DIR),
        )
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(loaded, strict=self.lightning_module.strict_loading)

    def _load_optimizers(self, directory: Path) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer import MegatronOptimizer

        model_ssd = self.model_sharded_state_dict()
        saved_keys: set[str] | None = None
        for opt in self._torch_optimizers():
            if not isinstance(opt, MegatronOptimizer):
                if saved_keys is None:
                    saved_keys = _optim.saved_state_keys(directory)
                # State for exactly the parameters that had it when saved (not frozen ones).
                _optim.init_state(opt, model_ssd, saved_keys)
        loaded = dist_checkpointing.load(
            self._optimizer_sharded_state_dict(model_ssd, is_loading=True),
            str(directory),
            sharded_strategy=self._load_strategy(directory),
        )
        stateless = self._saved_stateless(directory.parent / EXTRA_DIR)
        for idx, opt in enumerate(self._torch_optimizers()):
            if isinstance(opt, MegatronOptimizer):
                opt.load_state_dict(loaded[f"optimizer_{idx}"])
            else:
                _optim.load_sharded(opt, loaded[f"optimizer_{idx}"])
                if stateless is not None and idx < len(stateless):
                    # Slices saved as zeros only to complete a stacked tensor: no state again.
                    _optim.drop_state(opt, stateless[idx])

    def _saved_stateless(self, extra: Path) -> list[list[int]] | None:
        # This rank's record, when the layout is the one that saved it.
        own = extra / f"rank_{self.global_rank:05d}.pt"
        if not own.is_file():
            return None
        payload = torch.load(own, map_location="cpu", weights_only=False)
        if payload.get("parallel_layout") != self.parallel_layout():
            return None
        return payload.get("optimizer_stateless")

    def _load_extra(self, directory: Path) -> dict[str, Any]:
        if not directory.is_dir():
            log.warning("%s is missing: loops, callbacks and RNG start fresh", directory)
            return {}
        own = directory / f"rank_{self.global_rank:05d}.pt"
        first = directory / "rank_00000.pt"
        source = own if own.is_file() else first
        payload = torch.load(source, map_location="cpu", weights_only=False)
        saved_layout = payload.get("parallel_layout")
        lightning = dict(payload.get("lightning", {}))
        if saved_layout == self.parallel_layout() and source == own:
            RNGState().load_state_dict(payload.get("rng", {}))
        else:
            step = int(lightning.get("global_step", 0))
            if self.global_rank == 0:
                log.warning(
                    "parallel layout changed since the save (%s -> %s): RNG is re-derived per "
                    "rank from seed=%d + global_step=%d instead of restored",
                    saved_layout,
                    self.parallel_layout(),
                    self.seed,
                    step,
                )
            _parallel.seed_all(self.seed + step)
        # Creating the resumed dataloader's iterator draws from the global RNG, which the
        # uninterrupted run did at the start of the epoch: re-apply this state at the first
        # resumed batch when it falls inside an epoch (see on_train_batch_start).
        self._rng_at_load = RNGState().state_dict()
        lightning[LOADED_FROM_KEY] = {
            "path": str(directory.parent),
            "parallel_layout": saved_layout,
        }
        return lightning

    # --- checkpoint: remove, teardown -----------------------------------------------------

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a step directory. Collective: rank 0 deletes, every rank waits for it."""
        path = Path(filepath)
        if self._pending is not None and self._pending.path == path:
            self.finalize_pending_save(blocking=True)
        if self.global_rank == 0 and path.exists():
            retention.remove_step(path)
        self.barrier()

    @override
    def teardown(self) -> None:
        if self._pending is not None and _distributed_is_initialized():
            self.finalize_pending_save(blocking=True)
        if self._async_queue is not None:
            self._async_queue.close()
            self._async_queue = None
        # A load whose run never reached a training batch must not reach into the next run.
        self._rng_at_load = None
        # Parallel state stays up so that the model can still be used (and saved) after fit;
        # the next strategy to set up re-initialises it.
        super().teardown()

    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        return nullcontext()


def _describe_error(error: BaseException) -> str:
    """An error's message, with the per-rank causes a torch ``CheckpointException`` hides."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            while getattr(cause, "__cause__", None) is not None:
                cause = cause.__cause__
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def _weights_only(path: Path) -> bool:
    """A step with weights and nothing to resume (no optimizer, no training state)."""
    metadata = layout.read_metadata(path) or {}
    return (
        not (path / OPTIM_DIR).is_dir()
        and not (path / EXTRA_DIR).is_dir()
        and metadata.get("contents", ["model"]) == ["model"]
    )


def _run_in_order(
    calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
    write_timer: torch.Tensor,
    writer: str,
) -> None:
    # Runs in the background writer process for an async save: write_timer is shared memory.
    start = time.perf_counter()
    for fn, args, kwargs in calls:
        if writer == _compat.BUILTIN:
            with _compat.write_errors_keep_their_cause(args) as args:
                fn(*args, **kwargs)
        else:
            fn(*args, **kwargs)
    write_timer[0] = time.perf_counter() - start


def _combine_async_requests(requests: Sequence[Any], write_timer: torch.Tensor) -> Any:
    """One async request that stages, writes and finalises ``requests`` in order.

    Megatron-Core's async writer returns its write results through one process-wide queue, so
    two saves in flight at once (model/ and optim/) can pick up each other's results. Written by
    one background process, one after the other, their results arrive in the order their
    finalisers read them. Staging (``preload_fn``) happens here, on the training thread: it is
    the snapshot the background writes from.
    """
    _, async_request = _compat.async_classes()
    calls = []
    finalize_fns: list[Callable[[], None]] = []
    for req in requests:
        args = list(req.async_fn_args)
        if req.preload_fn is not None:
            args[1] = req.preload_fn()
        if req.async_fn is not None:
            calls.append((req.async_fn, tuple(args), dict(req.async_fn_kwargs)))
        finalize_fns.extend(req.finalize_fns)
    return async_request(
        _run_in_order, (calls, write_timer, _compat.async_strategy()), finalize_fns
    )


def _all_reduce_flat(
    tensors: Sequence[torch.Tensor], group: Any, scale: float | None = None
) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(group_tensors)
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        for t, synced in zip(
            group_tensors,
            torch._utils._unflatten_dense_tensors(flat, group_tensors),
            strict=True,
        ):
            t.copy_(synced)


def _give_megatron_optimizers_defaults(conf: Any) -> None:
    from megatron.core.optimizer import MegatronOptimizer

    if isinstance(conf, MegatronOptimizer):
        if not hasattr(conf, "defaults"):
            conf.defaults = {}
    elif isinstance(conf, dict):
        _give_megatron_optimizers_defaults(conf.get("optimizer"))
    elif isinstance(conf, list | tuple):
        for item in conf:
            _give_megatron_optimizers_defaults(item)


def _all_reduce_tied_embedding_grads(modules: Sequence[Any]) -> None:
    # With pipeline parallelism, tied input embeddings (first stage) and output layer (last
    # stage) are two copies of one weight: sum their gradients so both apply the same update.
    from megatron.core import parallel_state

    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    for module in modules:
        if not getattr(module, "share_embeddings_and_output_weights", False):
            continue
        if not (getattr(module, "pre_process", False) or getattr(module, "post_process", False)):
            continue
        weight = module.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())
        return


def _module_sharded_state_dict(module: torch.nn.Module, prefix: str) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.module import MegatronModule

    out: dict[str, Any] = {}
    rank = dist.get_rank() if _distributed_is_initialized() else 0
    local = list(module._parameters.items()) + [
        (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
    ]
    for name, tensor in local:
        if tensor is not None:
            key = f"{prefix}{name}"
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=rank)
    for name, child in module.named_children():
        if isinstance(child, MegatronModule):
            out.update(child.sharded_state_dict(prefix=f"{prefix}{name}."))
        else:
            out.update(_module_sharded_state_dict(child, f"{prefix}{name}."))
    return out
