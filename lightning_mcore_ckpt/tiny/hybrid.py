"""A Megatron-Core ``HybridModel`` without Transformer Engine: attention and MLP layers from a
pattern, built from Megatron-Core's local (pure PyTorch) modules, as for the tiny GPT.

Megatron-Core 0.19 deprecates ``GPTModel`` in favour of ``HybridModel``, whose layers come from a
pattern string (``"*"`` attention, ``"-"`` MLP, ``"M"`` Mamba, ...). Its shipped layer spec uses
Transformer Engine throughout, and its stack builds the final norm with Transformer Engine
whatever the spec says; Mamba layers need CUDA kernels. :func:`hybrid_local_stack_spec` gives
attention and MLP layers from the local spec and a stack whose final norm is the local one, so
the model builds and trains on a CPU. Its checkpoint keys are those of the Transformer Engine
spec (a layer norm is saved as ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``),
so a step loads into either.

Re-exported by :mod:`lightning_mcore_ckpt.tiny`, whose :func:`~lightning_mcore_ckpt.tiny.tiny_hybrid`
builds the model.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt import _compat, _cpu

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["TINY_HYBRID_PATTERN", "check_layer_pattern", "hybrid_local_stack_spec"]

TINY_HYBRID_PATTERN = "*-*-"
"""Attention, MLP, attention, MLP: a GPT's two layers, as a hybrid model lays them out."""

_LAYERS_WITHOUT_CUDA = frozenset("*-")
"""The pattern symbols :func:`hybrid_local_stack_spec` builds (attention, MLP)."""


@functools.cache
def _local_stack() -> type:
    stack, _ = _compat.hybrid_stack_classes()

    class LocalHybridStack(stack):  # type: ignore[misc,valid-type]
        """The hybrid stack with a local final norm (Megatron-Core builds it with Transformer
        Engine unconditionally); everything else is Megatron-Core's own."""

        def __init__(self, config: Any, *args: Any, post_layer_norm: bool = True, **kwargs: Any):
            from megatron.core.models.backends import LocalSpecProvider

            super().__init__(config, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                norm = _cpu.local_spec_norms(LocalSpecProvider().layer_norm(), config)
                self.final_norm = norm(
                    config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                )

    return LocalHybridStack


def hybrid_local_stack_spec() -> ModuleSpec:
    """The decoder spec of a Transformer-Engine-free hybrid model: attention (``"*"``) and MLP
    (``"-"``) layers from Megatron-Core's local GPT layer spec, split into the two layer kinds a
    hybrid pattern names, with TE-compatible checkpoint keys.

    Example::

        from lightning_mcore_ckpt import _compat
        model = _compat.hybrid_model(config, hybrid_local_stack_spec(), "*-*-", 1,
                                     vocab_size=128, max_sequence_length=16)
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = get_gpt_layer_local_spec().submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm,
        self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm,
        mlp=gpt.mlp,
        mlp_bda=gpt.mlp_bda,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    )
    _, submodules = _compat.hybrid_stack_classes()
    return ModuleSpec(
        module=_local_stack(),
        submodules=submodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def check_layer_pattern(layer_pattern: str, argument: str = "layer_pattern") -> None:
    """Refuse a pattern :func:`hybrid_local_stack_spec` cannot build, before any work."""
    if not isinstance(layer_pattern, str) or not layer_pattern:
        raise ValueError(
            f"{argument}={layer_pattern!r}: pass a non-empty pattern of '*' (attention) and "
            "'-' (MLP) layers, e.g. '*-*-'"
        )
    other = sorted(set(layer_pattern) - _LAYERS_WITHOUT_CUDA)
    if other:
        raise ValueError(
            f"{argument}={layer_pattern!r}: the local (Transformer-Engine-free) spec builds "
            f"attention ('*') and MLP ('-') layers only, not {', '.join(map(repr, other))} "
            "(Mamba and the other layer kinds need Transformer Engine and CUDA kernels); "
            "use a pattern of '*' and '-', e.g. '*-*-'"
        )
