"""Tensor names of a Megatron-Core GPT model that the Hugging Face conversion relies on.

Imports nothing from the package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "ADAPTER",
    "EMBEDDING",
    "EXPERTS",
    "LAYERS",
    "VOCAB_KEYS",
    "expert_name",
    "hybrid_layer_pattern",
]

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


_ONE_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
"""A layer saved under its own index (``decoder.layers.3.mlp...``): a hybrid stack's layers are
saved one by one, where a GPT model's transformer block stacks them on a layer axis."""


def _layer_kinds(rest: str) -> set[str]:
    # Megatron-Core's hybrid pattern symbols (megatron.core.models.hybrid's Symbols).
    if rest.startswith("mixer."):
        return {"M"}  # Mamba
    if rest.startswith("self_attention."):
        return {"*"}
    if rest.startswith(("mlp.router.", "mlp.experts.", "mlp.shared_experts.")):
        return {"E"}  # mixture of experts
    if rest.startswith("mlp."):
        return {"-"}
    return set()  # a layer norm of its own, an adapter: no kind of its own


def hybrid_layer_pattern(names: Iterable[str]) -> str | None:
    """The layer pattern of a hybrid model (Megatron-Core's ``HybridModel``; ``MambaModel``
    before megatron-core 0.17) from its tensor names, without the model's prefix; ``None`` for a
    GPT model.

    A hybrid model's layers each hold one kind of block (``"*"`` attention, ``"-"`` MLP, ``"E"``
    mixture of experts, ``"M"`` Mamba) and are saved one by one; a GPT model's layers hold
    attention and MLP together. A layer of several kinds is shown as ``"T"``, a layer index with
    no tensor as ``"?"``.

    Example::

        >>> hybrid_layer_pattern(["decoder.layers.0.self_attention.linear_qkv.weight",
        ...                       "decoder.layers.1.mlp.linear_fc1.weight"])
        '*-'
    """
    kinds: dict[int, set[str]] = {}
    for name in names:
        match = _ONE_LAYER.fullmatch(name)
        if match:
            kinds.setdefault(int(match[1]), set()).update(_layer_kinds(match[2]))
    if not kinds or all(len(k) != 1 for k in kinds.values()):
        return None
    symbols = (kinds.get(i, set()) for i in range(max(kinds) + 1))
    return "".join(next(iter(k)) if len(k) == 1 else ("T" if k else "?") for k in symbols)
