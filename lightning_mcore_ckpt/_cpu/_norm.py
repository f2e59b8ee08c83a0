"""Layer norms for Megatron-Core's local layer specs that allow sequence parallelism.

Without Transformer Engine or Apex, Megatron-Core's local specs build their norms with
``WrappedTorchNorm``, which refuses ``config.sequence_parallel``. Megatron-Core refuses to train
a mixture of experts with tensor parallelism unless sequence parallelism is on, so on a CPU an
MoE model could not train with TP > 1. :class:`TorchNorm` is the same torch ``LayerNorm`` /
``RMSNorm`` (same parameters, same checkpoint keys) that marks its parameters
``sequence_parallel = config.sequence_parallel``, as Megatron-Core's Apex and Transformer Engine
norms do: each tensor-parallel rank then normalises its part of the sequence, and the gradients
of the norm's parameters are summed over the tensor-parallel group where Megatron-Core sums
them (``finalize_model_grads``, or ``MegatronStrategy.finalize_grads`` without Megatron DDP).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

__all__ = ["TorchNorm", "replace_norms"]


class TorchNorm:
    """``WrappedTorchNorm`` that allows sequence parallelism: builds a ``torch.nn.LayerNorm`` or
    ``torch.nn.RMSNorm`` (``config.normalization``) whose parameters carry
    ``sequence_parallel = config.sequence_parallel``."""

    def __new__(  # type: ignore[misc]  # returns the torch module, as WrappedTorchNorm does
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        for unsupported in (
            "layernorm_zero_centered_gamma",
            "persist_layer_norm",
            "memory_efficient_layer_norm",
        ):
            if getattr(config, unsupported, False):
                raise ValueError(
                    f"TransformerConfig({unsupported}=True) needs Apex or Transformer Engine "
                    f"norms; torch's norm (the local layer spec on CPU) has no such option: set "
                    f"{unsupported}=False"
                )
        norm: torch.nn.Module
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"TransformerConfig(normalization={config.normalization!r}): the local layer "
                "spec's torch norm is 'LayerNorm' or 'RMSNorm'"
            )
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


def replace_norms(spec: Any) -> Any:
    """``spec`` (a ``ModuleSpec``, a submodules dataclass, a list of them or a module class)
    with every ``WrappedTorchNorm`` replaced by :class:`TorchNorm`; ``spec`` is not changed."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def walk(node: Any) -> Any:
        if node is WrappedTorchNorm:
            return TorchNorm
        if isinstance(node, list | tuple):
            items = [walk(item) for item in node]
            changed = any(a is not b for a, b in zip(items, node, strict=True))
            return type(node)(items) if changed else node
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            new = {f.name: walk(getattr(node, f.name)) for f in dataclasses.fields(node)}
            if all(new[name] is getattr(node, name) for name in new):
                return node
            out = copy.copy(node)
            for name, value in new.items():
                object.__setattr__(out, name, value)  # also a frozen dataclass's copy
            return out
        return node

    return walk(spec)
