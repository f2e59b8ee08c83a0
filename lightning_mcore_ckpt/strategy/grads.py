"""Gradients under model parallelism: the pipeline schedule, their sync, clipping, Megatron
optimizer steps. Functions of the model and process groups; ``MegatronStrategy`` calls them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import _compat

__all__ = [
    "ScheduleGrads",
    "add_schedule_grads",
    "clip_grad_by_norm",
    "finalize_grads",
    "give_megatron_optimizers_defaults",
    "megatron_modules",
    "megatron_optimizer_step",
    "model_chunk",
    "refuse_loss_scaling",
    "run_schedule",
]

ScheduleGrads = list[tuple[torch.nn.Parameter, torch.Tensor | None]]
"""Gradients the pipeline schedule produced, kept aside until Lightning's backward."""


def megatron_modules(model: torch.nn.Module) -> list[Any]:
    """Every Megatron-Core module in ``model`` (itself included), outermost first."""
    from megatron.core.transformer.module import MegatronModule

    return [m for m in model.modules() if isinstance(m, MegatronModule)]


def model_chunk(module: torch.nn.Module) -> torch.nn.Module:
    """The LightningModule's only top-level Megatron-Core module (what the schedule runs)."""
    from megatron.core.transformer.module import MegatronModule

    chunks = [m for m in module.children() if isinstance(m, MegatronModule)]
    if len(chunks) != 1:
        raise ValueError(
            f"forward_backward(model=None) needs exactly one Megatron-Core module attribute "
            f"on the LightningModule, found {len(chunks)}; pass model=<the module to run>"
        )
    return chunks[0]


def give_megatron_optimizers_defaults(conf: Any) -> None:
    """Give each ``MegatronOptimizer`` in ``configure_optimizers``' output a ``defaults``."""
    from megatron.core.optimizer import MegatronOptimizer

    if isinstance(conf, MegatronOptimizer):
        if not hasattr(conf, "defaults"):
            conf.defaults = {}
    elif isinstance(conf, dict):
        give_megatron_optimizers_defaults(conf.get("optimizer"))
    elif isinstance(conf, list | tuple):
        for item in conf:
            give_megatron_optimizers_defaults(item)


def refuse_loss_scaling(optimizers: Sequence[Any]) -> None:
    """Refuse a Megatron-Core optimizer that expects a scaled loss (``OptimizerConfig(fp16=True)``:
    its grad scaler divides gradients by a loss scale this strategy does not apply)."""
    from megatron.core.optimizer import MegatronOptimizer

    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        if isinstance(inner, MegatronOptimizer) and getattr(inner.config, "fp16", False):
            raise ValueError(
                "a Megatron-Core optimizer with OptimizerConfig(fp16=True) expects the loss "
                "multiplied by its dynamic loss scale, which MegatronStrategy does not apply: "
                "its updates would be wrong. Train in bf16 (TransformerConfig(bf16=True, "
                "params_dtype=torch.bfloat16), OptimizerConfig(bf16=True)), which needs no "
                "loss scale"
            )


def megatron_optimizer_step(
    optimizer: Any,
    closure: Callable[[], Any],
    model: torch.nn.Module,
    sync_grads: Callable[[], None],
) -> Any:
    """Step a ``MegatronOptimizer``: closure, gradient sync, step, zero Megatron DDP buffers."""
    # A MegatronOptimizer steps without a closure and clips by its own config (clip_grad);
    # Megatron DDP keeps gradients in its buffers, zeroed once the step has used them.
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP

    result = closure()
    sync_grads()
    optimizer.step()
    for chunk in model.modules():
        if isinstance(chunk, MegatronDDP):
            chunk.zero_grad_buffer()
    return result


def run_schedule(
    forward_step_func: Callable[[Any, Any], tuple[torch.Tensor, Callable[..., Any]]],
    data_iterator: Any,
    chunk: torch.nn.Module,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    accumulate: int,
    stash: bool,
    device: torch.device,
) -> tuple[torch.Tensor, ScheduleGrads | None]:
    """Megatron-Core's pipeline schedule over ``chunk``; see ``MegatronStrategy.forward_backward``.

    Returns the mean micro-batch loss (on every pipeline stage) and, with ``stash``, the
    gradients the schedule produced, while ``.grad`` holds again what it held before.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

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
        mean = mean.to(device)
        dist.broadcast(
            mean,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    stashed: ScheduleGrads | None = None
    if stash:
        stashed = [(p, p.grad) for p in params]
        for p, grad in zip(params, previous, strict=True):
            p.grad = grad
    return mean, stashed


def add_schedule_grads(stashed: ScheduleGrads) -> None:
    """Add the gradients :func:`run_schedule` kept aside to ``.grad``."""
    for p, grad in stashed:
        if grad is None:
            continue
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)


def finalize_grads(
    model: torch.nn.Module, *, pipeline_parallel: bool, sequence_parallel: bool
) -> None:
    """Average gradients over the data-parallel group (MoE experts' over the expert
    data-parallel group: expert-parallel ranks hold different experts); sum sequence-parallel
    norms, and the query/key norms of ``qk_layernorm``, over TP.

    With Megatron-Core ``DistributedDataParallel`` chunks in ``model``, Megatron's own
    ``finalize_model_grads`` does it instead. ``sequence_parallel`` means sequence parallelism
    with more than one tensor-parallel rank.
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP

    chunks = [m for m in model.modules() if isinstance(m, MegatronDDP)]
    if chunks:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(chunks)
        if any(getattr(c.config, "moe_router_enable_expert_bias", False) for c in chunks):
            _compat.reset_router_token_counts(chunks)  # after its expert-bias update
        return
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    params = [p for _, p in named]
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_size = dist.get_world_size(dp_group)
    dense = [g for p, g in zip(params, grads, strict=True) if getattr(p, "allreduce", True)]
    experts = [g for p, g in zip(params, grads, strict=True) if not getattr(p, "allreduce", True)]
    if dp_size > 1:
        _all_reduce_flat(dense, dp_group, scale=1.0 / dp_size)
    if experts:
        # An expert's gradient already sums the tokens every expert-parallel rank routed to it:
        # summed over its data-parallel copies and divided by the data-parallel size, it is the
        # same mean as the dense gradients' (Megatron-Core's DDP scales them alike).
        expert_dp = parallel_state.get_expert_data_parallel_group()
        if dist.get_world_size(expert_dp) > 1:
            _all_reduce_flat(experts, expert_dp)
        if dp_size > 1:
            torch._foreach_mul_(experts, 1.0 / dp_size)
    if pipeline_parallel:
        _all_reduce_tied_embedding_grads(megatron_modules(model))
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        # As Megatron-Core's finalize_model_grads: each TP rank's gradient of a replicated norm
        # covers only its part of the sequence (sequence parallelism) or of the heads (the
        # query/key norms of qk_layernorm): summed over TP.
        summed = [
            g
            for (name, p), g in zip(named, grads, strict=True)
            if (sequence_parallel and getattr(p, "sequence_parallel", False))
            or ".q_layernorm." in f".{name}"
            or ".k_layernorm." in f".{name}"
        ]
        _all_reduce_flat(summed, tp_group)
    _update_expert_bias(model)


def _update_expert_bias(model: torch.nn.Module) -> None:
    # Aux-loss-free load balancing: each router's expert_bias (a buffer, fp32, no gradient)
    # moves towards the experts that got fewer tokens in this global batch, as Megatron-Core's
    # finalize_model_grads does after the gradients (Megatron DDP runs that path itself).
    for chunk in megatron_modules(model):
        config = getattr(chunk, "config", None)
        if config is not None and getattr(config, "moe_router_enable_expert_bias", False):
            _compat.update_router_expert_bias([chunk], config)
        return  # the outermost Megatron-Core module holds every router


def clip_grad_by_norm(
    main_params: Iterable[torch.nn.Parameter], clip_val: float, device: torch.device
) -> None:
    """Clip gradients by the norm of the whole model's gradient (collective over TP and PP).

    The norm is summed over the model-parallel ranks, counting tensor-parallel duplicates and
    the pipeline's second copy of tied embeddings once, so every rank scales by the same
    coefficient. ``device`` holds the norm when this rank has no gradient.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in main_params if p.grad is not None]
    grads: list[torch.Tensor] = [p.grad for p in params]  # type: ignore[misc]
    counted = [
        (p, g)
        for p, g in zip(params, grads, strict=True)
        if not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p)
    ]
    at = grads[0].device if grads else device
    square = torch.zeros((), dtype=torch.float32, device=at)
    expert_square = torch.zeros((), dtype=torch.float32, device=at)
    for p, grad in counted:
        if getattr(p, "allreduce", True):
            square += grad.detach().float().pow(2).sum()
        else:  # an MoE expert's: the other expert-parallel ranks hold the other experts
            expert_square += grad.detach().float().pow(2).sum()
    model_parallel = parallel_state.get_model_parallel_group()
    if dist.get_world_size(model_parallel) > 1:
        dist.all_reduce(square, group=model_parallel)
    # Experts are split over expert, expert-tensor and pipeline parallelism (at EP=1 that is
    # the model-parallel group's tensor and pipeline parts).
    # Every rank of the group takes part (zero without experts): pipeline stages agree.
    expert_group = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_world_size(expert_group) > 1:
        dist.all_reduce(expert_square, group=expert_group)
    total = (square + expert_square).sqrt()
    # Same coefficient as torch.nn.utils.clip_grad_norm_.
    coefficient = torch.clamp(clip_val / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coefficient.to(g.dtype))


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
