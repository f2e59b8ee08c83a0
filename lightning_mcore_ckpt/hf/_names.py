"""Tensor names of a Megatron-Core GPT model that the Hugging Face conversion relies on.

Imports nothing from the package.
"""

from __future__ import annotations

__all__ = ["ADAPTER", "EMBEDDING", "EXPERTS", "LAYERS", "VOCAB_KEYS", "expert_name"]

LAYERS = "decoder.layers."
"""Prefix of the transformer layers; checkpoints stack them on a leading layer axis."""
EMBEDDING = "embedding.word_embeddings.weight"
"""The input embedding: exactly one per GPT model, so it locates the model's key prefix."""
VOCAB_KEYS = (EMBEDDING, "output_layer.weight")
"""Tensors with one row per (padded) vocabulary entry."""
EXPERTS = "mlp.experts.experts."
"""Routed MoE experts in a checkpoint: one key per weight, experts stacked on the axis after the
layer axis (Megatron-Core's sequential and grouped expert layers save alike)."""
ADAPTER = ".adapter."
"""In a tensor name: a LoRA adapter's (``<layer>.adapter.linear_in.weight``), not a model weight."""


def expert_name(name: str, expert: int) -> str:
    """mbridge's name of one expert's slice of a layer-indexed, expert-stacked tensor.

    Example::

        >>> expert_name("decoder.layers.0.mlp.experts.experts.linear_fc1.weight", 3)
        'decoder.layers.0.mlp.experts.linear_fc1.weight3'
    """
    head, _, weight = name.partition(EXPERTS)
    return f"{head}mlp.experts.{weight}{expert}"
