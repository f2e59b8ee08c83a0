"""The training-step hooks of ``MegatronStrategy``: pipeline schedule, gradient sync, clipping.

The arithmetic is in :mod:`._grads`; here is where Lightning's loop reaches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from lightning_mcore_ckpt.strategy import _grads
from lightning_mcore_ckpt.strategy._base import MegatronParallelBase
from lightning_mcore_ckpt.strategy._config import StrategyConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MegatronTrainingBase"]


class MegatronTrainingBase(MegatronParallelBase):
    """Gradients under Megatron-Core parallelism, in Lightning's training loop."""

    def __init__(self, config: StrategyConfig) -> None:
        super().__init__(config)
        self._schedule_grads: _grads.ScheduleGrads | None = None

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
            assert self.model is not None
            return _grads.megatron_optimizer_step(inner, closure, self.model, self.finalize_grads)

        def closure_then_sync_grads() -> Any:
            result = closure()
            self.finalize_grads()
            return result

        return super().optimizer_step(optimizer, closure_then_sync_grads, model, **kwargs)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Lightning accepts objects that look like torch optimizers; a MegatronOptimizer lacks
        # only `defaults`. Give it one, so configure_optimizers may return it as it is.
        module = self.lightning_module
        assert module is not None
        configure = module.configure_optimizers

        def configure_optimizers() -> Any:
            conf = configure()
            _grads.give_megatron_optimizers_defaults(conf)
            return conf

        module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
        try:
            super().setup_optimizers(trainer)
        finally:
            del module.configure_optimizers
        _grads.refuse_loss_scaling(self.optimizers)

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
            model = _grads.model_chunk(lightning_module)
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
        mean, stashed = _grads.run_schedule(
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
            # forward_backward already ran the backward pass of this loss: add its gradients.
            _grads.add_schedule_grads(self._schedule_grads)
            self._schedule_grads = None
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def finalize_grads(self) -> None:
        """Average gradients over the data-parallel group; sum sequence-parallel norms over TP.

        Called by :meth:`optimizer_step` after the (last accumulated) backward. With Megatron-Core
        ``DistributedDataParallel`` model chunks (the GPU path with a ``MegatronOptimizer``),
        Megatron's own ``finalize_model_grads`` does it instead.
        """
        assert self.model is not None
        _grads.finalize_grads(
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
        _grads.clip_grad_by_norm(params, clip_val, self.root_device)
