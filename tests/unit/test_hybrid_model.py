"""Megatron-Core's hybrid model without a process group: which model a checkpoint's tensor names
are (a hybrid model's layer pattern, or a GPT), and the layer patterns the Transformer-Engine-free
spec refuses before any work."""

from __future__ import annotations

import pytest

from lightning_mcore_ckpt import _compat
from lightning_mcore_ckpt.hf._names import hybrid_layer_pattern

LAYER = "decoder.layers."
ATTENTION = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
MLP = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def _names(layers: list[list[str]]) -> list[str]:
    return ["embedding.word_embeddings.weight", "decoder.final_norm.weight"] + [
        f"{LAYER}{i}.{name}" for i, names in enumerate(layers) for name in names
    ]


@pytest.mark.parametrize(
    ("layers", "pattern"),
    [
        ([ATTENTION, MLP, ATTENTION, MLP], "*-*-"),
        ([["mixer.in_proj.weight"], ATTENTION, ["mlp.router.weight", "mlp.experts.fc1"]], "M*E"),
        # A layer of both kinds among layers of one kind each; a layer index never saved.
        ([ATTENTION, ATTENTION + MLP, [], MLP], "*T?-"),
    ],
    ids=["attention-and-mlp", "mamba-attention-moe", "mixed-and-missing"],
)
def test_a_hybrid_models_layer_pattern_is_read_from_its_names(
    layers: list[list[str]], pattern: str
) -> None:
    assert hybrid_layer_pattern(_names(layers)) == pattern


@pytest.mark.parametrize(
    "names",
    [
        # A GPT's transformer block: the layers stacked on a leading axis, one key per weight.
        [f"{LAYER}{name}" for name in ATTENTION + MLP] + ["decoder.final_layernorm.weight"],
        # A GPT saved one layer at a time (heterogeneous layers): each holds attention and MLP.
        _names([ATTENTION + MLP, [*ATTENTION, "mlp.experts.fc1"]]),
        ["embedding.word_embeddings.weight", "output_layer.weight"],
    ],
    ids=["stacked", "per-layer-transformer-layers", "no-layers"],
)
def test_a_gpt_model_has_no_hybrid_layer_pattern(names: list[str]) -> None:
    assert hybrid_layer_pattern(names) is None


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("*M-", "not 'M' (Mamba and the other layer kinds need Transformer Engine"),
        ("", "pass a non-empty pattern of '*' (attention) and '-' (MLP) layers"),
        ("*-|*-", "not '|'"),
    ],
    ids=["mamba", "empty", "stage-boundaries"],
)
def test_a_layer_pattern_the_local_spec_cannot_build_is_refused_at_construction(
    pattern: str, says: str
) -> None:
    from lightning_mcore_ckpt.tiny import TinyHybridModule

    with pytest.raises(ValueError, match=r"TinyHybridModule: layer_pattern=") as refused:
        TinyHybridModule(layer_pattern=pattern)
    assert f"layer_pattern={pattern!r}" in str(refused.value) and says in str(refused.value)


def test_the_hybrid_model_class_is_the_versions_own() -> None:
    name = _compat.hybrid_model_class().__name__
    assert name == ("HybridModel" if _compat._mcore_at_least("0.17") else "MambaModel")
    stack, submodules = _compat.hybrid_stack_classes()
    prefix = "Hybrid" if name == "HybridModel" else "Mamba"
    assert (stack.__name__, submodules.__name__) == (f"{prefix}Stack", f"{prefix}StackSubmodules")
