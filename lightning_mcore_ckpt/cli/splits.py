"""A model's dimensions against a parallel layout: every split Megatron-Core asserts when it
builds a GPT model, checked without building it (for ``inspect``).

The rules, and where Megatron-Core (0.16 to 0.19) asserts them:

- **layers / PP** (and virtual pipeline stages, uneven first and last stages, the embedding and
  the loss counted as layers): ``TransformerConfig.__post_init__`` and
  ``transformer_block.get_num_layers_to_build``, which runs on every pipeline rank when the
  model is built (``num_layers should be divisible by pipeline_model_parallel_size``);
- **attention heads and query groups / TP**: ``TransformerConfig.__post_init__``;
- **FFN hidden size / TP** (dense MLP and shared experts): the tensor-parallel linear layers
  (``divide(size, tp)``, on the real tensor-parallel group; the vocabulary's split, by
  ``VocabParallelEmbedding``, ``inspect`` checks on every vocabulary tensor itself);
- **experts / EP**: ``BaseMoELayer`` (``num_moe_experts % ep_size``, on the real group), and
  ``TransformerConfig`` (expert parallelism without experts); **the experts' FFN hidden size /
  expert TP**: the experts' linear layers; **biased experts / expert TP** (only ETP 1):
  ``TransformerConfig``.

:func:`shape_from_keys` reads the dimensions from a checkpoint's keys and global shapes;
:func:`shape_from_config` from the model's ``TransformerConfig``; :func:`check_splits` answers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "UNCHECKED_WITHOUT_CONFIG",
    "ModelShape",
    "SplitSizes",
    "check_splits",
    "shape_from_config",
    "shape_from_hf_config",
    "shape_from_keys",
    "unknown_dimensions",
]

EMBEDDING = "embedding.word_embeddings.weight"
"""The input embedding: one per GPT model (its rows: the padded vocabulary), locating its
prefix."""

UNCHECKED_WITHOUT_CONFIG = (
    "uneven first/last pipeline stages, virtual pipeline stages, a custom "
    "pipeline_model_parallel_layout and the embedding or loss counted in the pipeline split are "
    "options of the model's TransformerConfig, not recorded in the step: the layers were "
    "checked against an even split (give --config to check the model's own options)"
)
"""What a check from the step alone assumes about the pipeline split."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The dimensions of one GPT model that a parallel layout splits; ``None``: not known."""

    prefix: str = ""
    """The model's key prefix in the checkpoint (``"gpt."``)."""
    num_layers: int | None = None
    """Transformer layers (the stacked layer tensors' first dimension, or the numbered layers
    of a hybrid model)."""
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    """The dense MLP's hidden size; ``None`` where no layer has a dense MLP."""
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    add_bias_linear: bool | None = None
    """Whether the linear layers have biases (Megatron-Core splits biased experts only with
    expert TP 1)."""
    virtual_pipeline_model_parallel_size: int | None = None
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    custom_pipeline_layout: bool = False
    """A ``pipeline_model_parallel_layout`` is set: Megatron-Core's own check decides."""
    from_config: bool = False
    """The pipeline options above come from the model's config (else: an even split)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitSizes:
    """The model-parallel sizes a layout splits a model into."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    """Expert tensor-parallel size (Megatron-Core's default: ``tp``)."""

    @classmethod
    def of(cls, layout: Mapping[str, int]) -> SplitSizes:
        """From a layout by ``metadata.json``'s names (``expert_tensor_parallel_size``
        absent: the tensor-parallel size)."""
        tp = int(layout.get("tensor_model_parallel_size", 1))
        return cls(
            tp=tp,
            pp=int(layout.get("pipeline_model_parallel_size", 1)),
            ep=int(layout.get("expert_model_parallel_size", 1)),
            etp=int(layout.get("expert_tensor_parallel_size", tp)),
        )


def _layer_keys(prefix: str, suffix: str) -> re.Pattern[str]:
    """Keys of the decoder's layers ending in ``suffix``: stacked, or one by one (hybrid)."""
    return re.compile(re.escape(prefix) + r"decoder\.layers\.(?:\d+\.)?" + re.escape(suffix) + "$")


def shape_from_keys(keys: Mapping[str, tuple[int, ...]]) -> list[ModelShape]:
    """The dimensions of each GPT model in a checkpoint (one per input embedding), from its
    keys' global shapes: layers from the stacked layer tensors' first dimension, heads and query
    groups from the attention projections where query/key norms give the head size, the FFN
    sizes from the second MLP projections, the experts from the router."""
    shapes = []
    for prefix in sorted({k[: -len(EMBEDDING)] for k in keys if k.endswith(EMBEDDING)}):

        def last(suffix: str, axis: int = -1, _prefix: str = prefix) -> int | None:
            pattern = _layer_keys(_prefix, suffix)
            found = [shape[axis] for k, shape in keys.items() if pattern.match(k)]
            return max(found) if found else None

        layer = re.compile(re.escape(prefix) + r"decoder\.layers\.(\d+\.)?")
        numbered = {m.group(1) for k in keys if (m := layer.match(k)) and m.group(1)}
        stacked = [shape[0] for k, shape in keys.items() if (m := layer.match(k)) and not m[1]]
        proj = last("self_attention.linear_proj.weight")
        heads, groups = _heads(
            last("self_attention.q_layernorm.weight"),
            proj,
            last("self_attention.linear_qkv.weight", -2),
        )
        bias = _layer_keys(prefix, "self_attention.linear_proj.bias")
        shapes.append(
            ModelShape(
                prefix=prefix,
                num_layers=len(numbered) if numbered else max(stacked, default=None),
                num_attention_heads=heads,
                num_query_groups=groups,
                ffn_hidden_size=last("mlp.linear_fc2.weight"),
                num_moe_experts=last("mlp.router.weight", -2),
                moe_ffn_hidden_size=last("mlp.experts.experts.linear_fc2.weight"),
                moe_shared_expert_intermediate_size=last("mlp.shared_experts.linear_fc2.weight"),
                add_bias_linear=None if proj is None else any(bias.match(k) for k in keys),
            )
        )
    return shapes


def _heads(
    head_size: int | None, proj_in: int | None, qkv_rows: int | None
) -> tuple[int | None, int | None]:
    """Heads and query groups from the head size (the query norm's width), the output
    projection's input (heads x head size) and the fused QKV's rows ((heads + 2 x groups) x
    head size)."""
    if not head_size or proj_in is None or qkv_rows is None or proj_in % head_size:
        return None, None
    heads = proj_in // head_size
    groups, odd = divmod(qkv_rows // head_size - heads, 2)
    if qkv_rows % head_size or odd or groups <= 0:
        return None, None
    return heads, groups


def shape_from_hf_config(shape: ModelShape, config: Mapping[str, Any]) -> ModelShape:
    """``shape`` with the heads and query groups of the step's Hugging Face ``config.json``
    where the keys did not tell them."""
    heads = config.get("num_attention_heads")
    if shape.num_attention_heads is not None or not isinstance(heads, int):
        return shape
    groups = config.get("num_key_value_heads") or heads
    return dataclasses.replace(shape, num_attention_heads=heads, num_query_groups=int(groups))


def shape_from_config(shape: ModelShape, config: Any) -> ModelShape:
    """``shape`` with the dimensions and pipeline options of the model's ``TransformerConfig``
    (the model the load builds)."""
    experts = getattr(config, "num_moe_experts", None)
    freq = getattr(config, "moe_layer_freq", 1)
    dense = experts is None or (freq != 1 if isinstance(freq, int) else 0 in freq)
    return dataclasses.replace(
        shape,
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        ffn_hidden_size=config.ffn_hidden_size if dense else None,
        num_moe_experts=experts,
        moe_ffn_hidden_size=getattr(config, "moe_ffn_hidden_size", None) if experts else None,
        moe_shared_expert_intermediate_size=(
            getattr(config, "moe_shared_expert_intermediate_size", None) if experts else None
        ),
        add_bias_linear=bool(config.add_bias_linear),
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage,
        account_for_embedding_in_pipeline_split=bool(
            config.account_for_embedding_in_pipeline_split
        ),
        account_for_loss_in_pipeline_split=bool(config.account_for_loss_in_pipeline_split),
        custom_pipeline_layout=getattr(config, "pipeline_model_parallel_layout", None) is not None,
        from_config=True,
    )


def unknown_dimensions(shape: ModelShape) -> list[str]:
    """The splits :func:`check_splits` cannot check for want of a dimension."""
    missing = []
    if shape.num_layers is None:
        missing.append("layers against PP (no stacked or numbered layer tensors)")
    if shape.num_attention_heads is None:
        missing.append(
            "attention heads and query groups against TP (the step records them nowhere: no "
            "query/key norms give the head size, no huggingface/config.json)"
        )
    if shape.custom_pipeline_layout:
        missing.append(
            "the custom pipeline_model_parallel_layout against PP (Megatron-Core's config "
            "check alone decides)"
        )
    return missing


def check_splits(shape: ModelShape, sizes: SplitSizes) -> list[str]:
    """What Megatron-Core would refuse when it builds ``shape`` with ``sizes``: one sentence
    per broken rule, with Megatron-Core's own wording where it has one."""
    pipeline = _pipeline_problem(shape, sizes.pp)
    attention = _attention_problems(shape, sizes.tp)
    return [
        *([f"{pipeline}; {_PIPELINE_FIX}"] if pipeline else []),
        *[
            f"{problem} Choose a tensor-parallel size (--tp) that divides them"
            for problem in attention
        ],
        *_width_problems(shape, sizes),
    ]


_PIPELINE_FIX = (
    "choose a pipeline-parallel size (--pp) that splits the layers, or build the model with "
    "uneven first/last stages (TransformerConfig's num_layers_in_first/last_pipeline_stage)"
)
_FIXES = {
    "TP": "choose a tensor-parallel size (--tp) that divides it",
    "EP": "choose an expert-parallel size (--ep) that divides them",
    "expert TP": "choose an expert tensor-parallel size (--etp, MegatronStrategy's "
    "expert_tensor_parallel_size) that divides it",
}


def _pipeline_problem(shape: ModelShape, pp: int) -> str | None:
    """Megatron-Core's checks of the layers' split across pipeline (and virtual) stages."""
    layers, vpp = shape.num_layers, shape.virtual_pipeline_model_parallel_size
    if layers is None or shape.custom_pipeline_layout:
        return None
    first = shape.num_layers_in_first_pipeline_stage
    last = shape.num_layers_in_last_pipeline_stage
    extra = int(shape.account_for_embedding_in_pipeline_split) + int(
        shape.account_for_loss_in_pipeline_split
    )
    if first is not None or last is not None:
        if extra:
            return (
                "num_layers_in_first/last_pipeline_stage cannot be set with "
                "account_for_embedding/loss_in_pipeline_split"
            )
        return _uneven_problem(layers, pp, vpp, first, last)
    total = layers + extra
    counted = " (with the embedding/loss counted as layers)" if extra else ""
    if total % pp:
        return (
            f"num_layers={total}{counted} should be divisible by pipeline_model_parallel_size="
            f"{pp}: {layers} layers do not split into {pp} pipeline stages"
        )
    if vpp is not None and (pp > 1 or extra) and (total // pp) % vpp:
        return (
            f"num_layers_per_pipeline_rank {total // pp}{counted} should be divisible by "
            f"virtual_pipeline_model_parallel_size {vpp}"
        )
    return None


def _uneven_problem(
    layers: int, pp: int, vpp: int | None, first: int | None, last: int | None
) -> str | None:
    """``TransformerConfig``'s checks of uneven first and last pipeline stages."""
    middle_layers, middle_stages = layers, pp
    for name, count in (("first", first), ("last", last)):
        if count is None:
            continue
        if count <= 0:
            return f"num_layers_in_{name}_pipeline_stage must be larger than 0 (it is {count})"
        if vpp is not None and count % vpp:
            return (
                f"number of layers at {name} stage: {count} must be divisible by virtual "
                f"pipeline parallel degree {vpp}"
            )
        middle_layers -= count
        middle_stages -= 1
    if bool(middle_layers) != bool(middle_stages):
        return (
            f"Mismatch: {middle_layers} middle layers remaining but {middle_stages} middle PP "
            f"stages available ({layers} layers, PP={pp}, first stage {first}, last {last})"
        )
    if middle_stages and middle_layers % middle_stages:
        return (
            f"number of layers at middle stage: {middle_layers} must be divisible by the middle "
            f"pipeline model parallel size {middle_stages}"
        )
    if middle_stages and vpp is not None and (middle_layers // middle_stages) % vpp:
        return (
            f"number of layers on each middle pipeline rank: {middle_layers // middle_stages} "
            f"must be divisible by virtual pipeline parallel degree {vpp}"
        )
    return None


def _attention_problems(shape: ModelShape, tp: int) -> list[str]:
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    problems = []
    if heads is not None and heads % tp:
        problems.append(
            f"num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size "
            f"({tp})."
        )
    if groups is not None and groups % tp and tp % groups:
        problems.append(
            f"num_query_groups ({groups}) must be a multiple or divisor of "
            f"tensor_model_parallel_size ({tp})."
        )
    return problems


def _width_problems(shape: ModelShape, sizes: SplitSizes) -> list[str]:
    """The sizes the tensor-, expert- and expert-tensor-parallel layers divide."""
    if sizes.ep > 1 and shape.num_moe_experts is None and shape.num_layers is not None:
        return [
            f"num_moe_experts must be non None to use expert-parallel (EP={sizes.ep}): the "
            "model has no MoE layers; load it with --ep 1"
        ]
    if shape.num_moe_experts is not None and shape.add_bias_linear and sizes.etp != 1:
        return [
            f"Bias in Moe is only supported when ETP==1 (expert TP is {sizes.etp}; the model's "
            "linear layers have biases: add_bias_linear); load it with --etp 1"
        ]
    splits = (
        ("the FFN hidden size (ffn_hidden_size)", shape.ffn_hidden_size, "TP", sizes.tp),
        (
            "the shared experts' size (moe_shared_expert_intermediate_size)",
            shape.moe_shared_expert_intermediate_size,
            "TP",
            sizes.tp,
        ),
        ("the routed experts (num_moe_experts)", shape.num_moe_experts, "EP", sizes.ep),
        (
            "the experts' FFN hidden size (moe_ffn_hidden_size)",
            shape.moe_ffn_hidden_size,
            "expert TP",
            sizes.etp,
        ),
    )
    return [
        f"{what}: {size} is not divisible by {axis}={parts}; {_FIXES[axis]}"
        for what, size, axis, parts in splits
        if size is not None and size % parts
    ]
