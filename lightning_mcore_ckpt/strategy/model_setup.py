"""The model at ``MegatronStrategy.setup``: its Megatron-Core configs checked against the
strategy's options, its precision converted. Functions of the model; the strategy calls them."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mcore_ckpt.strategy.config import StrategyConfig
from lightning_mcore_ckpt.strategy.grads import megatron_modules

__all__ = [
    "check_model_configs",
    "check_moe_autocast",
    "check_moe_sequence_parallel",
    "convert_precision",
]


def check_model_configs(model: torch.nn.Module, config: StrategyConfig) -> None:
    """Refuse a model whose outermost Megatron-Core config disagrees with the strategy's
    tensor/pipeline-parallel sizes or sequence parallelism."""
    for module in megatron_modules(model):
        model_config = getattr(module, "config", None)
        if model_config is None:
            continue
        for attr in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "sequence_parallel",
        ):
            expected = getattr(config, attr)
            got = getattr(model_config, attr, expected)
            if got != expected:
                raise ValueError(
                    f"{type(module).__name__}.config.{attr}={got!r} but "
                    f"MegatronStrategy({attr}={expected!r}); build the model's "
                    "TransformerConfig from the strategy's settings"
                )
        break


def check_moe_sequence_parallel(model: torch.nn.Module, config: StrategyConfig) -> None:
    """Refuse to train a mixture of experts with tensor parallelism but without sequence
    parallelism, which Megatron-Core refuses only at the first forward of its MoE layer."""
    if config.tensor_model_parallel_size == 1 or config.sequence_parallel:
        return
    for module in megatron_modules(model):
        model_config = getattr(module, "config", None)
        if model_config is None:
            continue
        experts = getattr(model_config, "num_moe_experts", None)
        if experts:
            raise ValueError(
                f"{type(module).__name__} is a mixture of experts (num_moe_experts={experts}) "
                f"and MegatronStrategy(tensor_model_parallel_size="
                f"{config.tensor_model_parallel_size}, sequence_parallel=False): Megatron-Core "
                "trains MoE layers with tensor parallelism only with sequence parallelism. "
                "Use MegatronStrategy(sequence_parallel=True) (and build the model's "
                "TransformerConfig with sequence_parallel=True), or tensor_model_parallel_size=1"
            )
        return


def check_moe_autocast(model: torch.nn.Module, plugin: Any) -> None:
    """Refuse to train a mixture of experts under torch autocast (``"bf16-mixed"``,
    ``"16-mixed"``) without Transformer Engine. Megatron-Core's router computes its logits in
    an autograd function of its own (``RouterGatingLinearFunction``) whose backward, without
    Transformer Engine's GEMM, multiplies the half-precision gradient autocast gave its output
    by the fp32 weight: the first backward fails, on any device."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    if not isinstance(plugin, MixedPrecision):
        return
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # no MoE in this megatron-core
        return
    if getattr(moe_utils, "te_general_gemm", None) is not None:
        return
    for module in megatron_modules(model):
        experts = getattr(getattr(module, "config", None), "num_moe_experts", None)
        if experts:
            raise ValueError(
                f"{type(module).__name__} is a mixture of experts (num_moe_experts={experts}) "
                f"and Trainer(precision={plugin.precision!r}) trains it under torch autocast, "
                "which Megatron-Core's MoE router does not support without Transformer "
                "Engine (its backward multiplies the half-precision gradient by the fp32 "
                "weight). Use Megatron-Core's mixed precision instead: the model built with "
                "TransformerConfig(bf16=True, params_dtype=torch.bfloat16) in Float16Module, "
                "and OptimizerConfig(bf16=True), with precision='32-true' (docs/gpu.md); or "
                "install Transformer Engine"
            )
        return


def convert_precision(model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
    """``model`` converted by the precision plugin, as Lightning's ``Strategy.setup`` does.

    ``"bf16-true"`` / ``"16-true"`` convert every parameter: Megatron-Core modules are then
    told so (``config.pipeline_dtype``: pipeline stages exchange activations of that dtype).
    Refused for a model in Megatron DDP, whose fp32 gradient buffers and main parameters cannot
    follow: Megatron-Core's own mixed precision does that instead.
    """
    from lightning.pytorch.plugins.precision import HalfPrecision
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(plugin, HalfPrecision):
        if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
            raise ValueError(
                f"Trainer(precision={plugin.precision!r}) converts every parameter, which "
                "Megatron DDP's gradient buffers and a Megatron optimizer's fp32 main "
                "parameters cannot follow. Use Megatron-Core's mixed precision instead: the "
                "model built with TransformerConfig(bf16=True, params_dtype=torch.bfloat16) "
                "in Float16Module, and OptimizerConfig(bf16=True), with precision='32-true' "
                "(docs/gpu.md)"
            )
        for module in megatron_modules(model):
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "pipeline_dtype", None) is not None:
                config.pipeline_dtype = plugin._desired_input_dtype
    return plugin.convert_module(model)
