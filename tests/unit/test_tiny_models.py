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


def test_tiny_modules_read_their_arguments_from_attributes_not_hparams(tmp_path: Path) -> None:
    from lightning.fabric.utilities.data import AttributeDict

    from lightning_mcore_ckpt.tiny import HFGPTModule, TinyGPTModule

    class Narrow(TinyGPTModule):  # a user's subclass forwarding one argument of the base's
        def __init__(self, width: int = 3) -> None:
            super().__init__(lr=0.005)

    module = Narrow()
    # What LightningCLI leaves in hparams: the arguments of the class it built, only.
    module._hparams = AttributeDict(width=3)
    module.gpt = torch.nn.Linear(2, 2)
    configured = module.configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.AdamW)
    assert configured["optimizer"].param_groups[0]["lr"] == 0.005
    assert (module.dropout, module.num_layers, module.optimizer_name) == (0.1, 2, "adamw")
    assert module.megatron_bf16 is False
    hf_module = HFGPTModule(tmp_path / "hf", dropout=0.2)
    assert (hf_module.hf_model_path, hf_module.dropout) == (tmp_path / "hf", 0.2)
