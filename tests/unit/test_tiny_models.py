"""The tiny Hugging Face model is created locally and loads offline with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def test_tiny_hf_qwen2_loads_offline_with_its_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_mcore_ckpt.tiny import TINY_VOCAB, tiny_hf_qwen2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny_hf_qwen2(tmp_path / "qwen2")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == TINY_VOCAB
    ids = tokenizer("a b c", return_tensors="pt").input_ids
    assert ids.shape == (1, 3)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 3, TINY_VOCAB)

    # Same seed, same weights: the model is reproducible.
    again = AutoModelForCausalLM.from_pretrained(
        tiny_hf_qwen2(tmp_path / "again"), local_files_only=True
    )
    for (name, a), (_, b) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
