"""Output heads: a causal LM, or a one-output value/reward head, in both formats.

RL runs train critics and reward models whose Megatron-Core output layer is one linear unit
(mbridge's ``make_value_model``: a replicated ``[1, hidden]`` weight without bias, the layer verl
builds). In Hugging Face those are the family's ``*ForTokenClassification`` (a value per token:
what verl's critic loads) and ``*ForSequenceClassification`` (a score per sequence, taken at
the last non-padding token: what TRL and OpenRLHF reward models load), both with
``num_labels=1`` and the weight named ``score.weight``. Token classification has a bias in
transformers; it is written as zeros, so every transformers version loads the exact function.

Imports nothing from the package.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "HEADS",
    "HEAD_ARG_CHOICES",
    "auto_model_class",
    "class_name",
    "config_for_head",
    "head_of",
    "resolve",
]

HEADS = ("lm", "value", "reward")
"""``lm``: a causal LM (``lm_head``); ``value``: ``*ForTokenClassification``, one value per
token; ``reward``: ``*ForSequenceClassification``, one score per sequence."""
HEAD_ARG_CHOICES = ("auto", *HEADS)
"""The values of ``HFExport(head=...)`` and ``export --head``."""

_MAPPINGS = {
    "lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "value": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "reward": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
_SUFFIXES = {"ForTokenClassification": "value", "ForSequenceClassification": "reward"}


def head_of(config: dict[str, Any]) -> str:
    """The head a Hugging Face ``config.json`` describes (from its ``architectures``)."""
    for arch in config.get("architectures") or []:
        for suffix, head in _SUFFIXES.items():
            if str(arch).endswith(suffix):
                return head
    return "lm"


def class_name(model_type: str, head: str) -> str:
    """The transformers class of ``model_type`` with ``head`` (``ValueError`` if it has none)."""
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, _MAPPINGS[head])
    if model_type not in names:
        raise ValueError(
            f"transformers has no {head} model ({_MAPPINGS[head]}) for model_type={model_type!r}"
        )
    return str(names[model_type])


def auto_model_class(head: str) -> Any:
    """The transformers ``AutoModelFor...`` class that loads a model with ``head``."""
    import transformers

    return {
        "lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[head]


def config_for_head(config: dict[str, Any], head: str) -> dict[str, Any]:
    """``config.json`` contents describing the same network with ``head``."""
    out = dict(config)
    out["architectures"] = [class_name(str(config.get("model_type")), head)]
    if head == "lm":
        for key in ("id2label", "label2id"):
            out.pop(key, None)
        return out
    out["id2label"] = {"0": "LABEL_0"}
    out["label2id"] = {"LABEL_0": 0}
    out["tie_word_embeddings"] = False  # no output embedding to tie: the head is score.weight
    if head == "value":
        out.pop("token_classification_bias", None)  # transformers 5: default True (zeros here)
    return out


def resolve(requested: str, source_head: str, output_rows: int | None, argument: str) -> str:
    """The head an export writes: ``requested``, or for ``"auto"`` the one the checkpoint has.

    ``output_rows`` is the checkpoint's output-layer rows (None: no output layer, e.g. tied).
    A one-row output layer is a value head (``reward`` when the source config says so); a
    vocabulary-sized one is a language model. A requested head the checkpoint cannot give is
    refused, naming both.
    """
    if requested not in HEAD_ARG_CHOICES:
        raise ValueError(
            f"{argument}={requested!r}: use one of {list(HEAD_ARG_CHOICES)} ('auto': what the "
            "checkpoint's output layer is; 'value': *ForTokenClassification; 'reward': "
            "*ForSequenceClassification)"
        )
    one = output_rows == 1
    if requested == "auto":
        if not one:
            return "lm"
        return source_head if source_head != "lm" else "value"
    if one != (requested != "lm"):
        has = "a one-output value head" if one else "a language-model head"
        raise ValueError(
            f"{argument}={requested!r}: the checkpoint's output layer is {has} "
            f"({output_rows} rows); pass {argument}='auto' or "
            f"{('value' if one else 'lm')!r}"
        )
    return requested
