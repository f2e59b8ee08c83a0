"""Tiny Hugging Face models for tests, examples and laptops (re-exported by :mod:`.tiny`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["TINY_SEQ_LEN", "TINY_VOCAB", "tiny_hf_model", "tiny_hf_qwen2"]

TINY_VOCAB = 128
"""Vocabulary size of :func:`tiny_gpt` (divisible by any tensor-parallel size up to 8)."""
TINY_SEQ_LEN = 16
"""Maximum sequence length of :func:`tiny_gpt`."""


def _tiny_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {tok: i for i, tok in enumerate(specials + letters)}
    word = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{word}", len(vocab))
        word += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Words are joined by spaces when decoding (transformers 5 no longer adds them itself).
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_hf_model(
    path: str | os.PathLike[str],
    family: str = "qwen2",
    *,
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_experts: int = 4,
    experts_per_token: int = 2,
) -> Path:
    """Write a randomly initialised Hugging Face causal LM (with tokenizer) to ``path``.

    ``family`` is ``"qwen2"`` (biased QKV), ``"llama"``, or a mixture of ``num_experts``
    experts of ``intermediate_size``, ``experts_per_token`` routed per token, in every layer:
    ``"qwen2_moe"`` (plus a gated shared expert of ``intermediate_size``), ``"qwen3_moe"``
    (query/key norms, routing weights renormalised over the chosen experts as the published
    Qwen3-MoE models do) or ``"mixtral"``. ``max_shard_size`` (e.g. ``"100KB"``)
    splits the weights into shards with an index, as large models are published. The directory
    loads with ``transformers.AutoModelForCausalLM.from_pretrained(path)`` offline. Returns
    ``path``.

    Example::

        path = tiny_hf_model("/tmp/llama", "llama", tie_word_embeddings=True)
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    families = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
    }
    if family not in families:
        raise ValueError(f"tiny_hf_model(family={family!r}): use one of {sorted(families)}")
    config_cls, model_cls = families[family]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    moe = _moe_config(family, num_experts, experts_per_token, intermediate_size)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=TINY_SEQ_LEN * 8,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        **moe,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    tokenizer = _tiny_tokenizer(vocab_size)
    tokenizer.save_pretrained(out)
    return out


def _moe_config(
    family: str, num_experts: int, experts_per_token: int, intermediate_size: int
) -> dict[str, Any]:
    """The config fields of a tiny mixture of experts of ``family`` ({} for a dense one)."""
    routed = {"num_experts_per_tok": experts_per_token}
    if family == "qwen2_moe":
        return routed | {
            "num_experts": num_experts,
            "moe_intermediate_size": intermediate_size,
            "shared_expert_intermediate_size": intermediate_size,
        }
    if family == "qwen3_moe":
        return routed | {
            "num_experts": num_experts,
            "moe_intermediate_size": intermediate_size,
            "norm_topk_prob": True,  # as Qwen3-30B-A3B and Qwen3-235B-A22B publish it
        }
    if family == "mixtral":
        return routed | {"num_local_experts": num_experts}  # experts of intermediate_size
    return {}


def tiny_hf_qwen2(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """:func:`tiny_hf_model` of the Qwen2 family."""
    return tiny_hf_model(path, "qwen2", **kwargs)
