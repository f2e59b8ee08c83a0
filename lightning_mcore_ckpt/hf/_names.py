"""Tensor names of a Megatron-Core GPT model that the Hugging Face conversion relies on.

Imports nothing from the package.
"""

from __future__ import annotations

__all__ = ["EMBEDDING", "LAYERS", "VOCAB_KEYS"]

LAYERS = "decoder.layers."
"""Prefix of the transformer layers; checkpoints stack them on a leading layer axis."""
EMBEDDING = "embedding.word_embeddings.weight"
"""The input embedding: exactly one per GPT model, so it locates the model's key prefix."""
VOCAB_KEYS = (EMBEDDING, "output_layer.weight")
"""Tensors with one row per (padded) vocabulary entry."""
