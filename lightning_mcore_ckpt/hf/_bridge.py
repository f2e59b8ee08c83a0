"""The converter: mbridge's name maps and tensor formats for one Hugging Face model family.

Adds what a checkpoint-level converter needs on top of mbridge: layer-indexed names,
vocabulary padding, shapes of the Hugging Face model, and a GPT model builder that works without
Transformer Engine (mbridge's ``get_model`` hard-codes Transformer Engine and ``.cuda()``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import lightning_mcore_ckpt.hf._heads as _heads
from lightning_mcore_ckpt import _compat, _cpu
from lightning_mcore_ckpt.hf._names import VOCAB_KEYS
from lightning_mcore_ckpt.hf._refused import refused

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

__all__ = ["HFBridge", "has_transformer_engine", "supported_model_types"]

_OUTPUT = "output_layer.weight"


def supported_model_types() -> list[str]:
    """Hugging Face ``model_type`` values mbridge can convert.

    Example::

        >>> "qwen2" in supported_model_types()
        True
    """
    import mbridge  # noqa: F401 - registers the model families
    from mbridge.core.bridge import _MODEL_REGISTRY

    return sorted(_MODEL_REGISTRY)


def has_transformer_engine() -> bool:
    """Whether Transformer Engine layers can be used: it is installed and CUDA is available."""
    try:
        import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return not _cpu.on_cpu()


class HFBridge:
    """mbridge's conversion for the model family of one Hugging Face directory.

    Name maps and tensor formats (fused QKV, gate/up) come from mbridge; this class adds what a
    checkpoint-level converter needs: layer-stacked checkpoint names, vocabulary padding, shape
    checks against the Hugging Face config, and a model builder that works without Transformer
    Engine.

    Example::

        bridge = HFBridge("/models/Qwen2.5-0.5B")  # in LightningModule.configure_model
        self.model = bridge.gpt_model(bridge.transformer_config())
    """

    def __init__(
        self,
        hf_model_path: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        argument: str = "hf_model_path",
        head: str | None = None,
    ) -> None:
        path = Path(hf_model_path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise FileNotFoundError(
                f"{argument}: {str(hf_model_path)!r} {what}; pass a local Hugging Face model "
                "directory (config.json, tokenizer files, safetensors weights)"
            )
        try:
            raw = json.loads((path / "config.json").read_text())
        except ValueError as err:
            raise ValueError(
                f"{argument}: {path / 'config.json'} is not valid JSON: {err}"
            ) from err
        model_type = raw.get("model_type")
        supported = supported_model_types()
        if model_type not in supported:
            raise refused(
                f"{argument}: {path} has model_type={model_type!r}, which mbridge does not "
                f"convert; supported model types: {', '.join(supported)}"
            )
        from mbridge.core.bridge import _MODEL_REGISTRY
        from mbridge.core.parallel_states import ParallelStates
        from transformers import AutoConfig

        self.path = path
        self.raw_config: dict[str, Any] = raw
        self.head: str = head or _heads.head_of(raw)
        if self.head not in _heads.HEADS:
            raise ValueError(f"{argument}: head={head!r}; use one of {list(_heads.HEADS)}")
        if self.head != "lm":
            _heads.class_name(model_type, self.head)  # a clear error for a family without one
        self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        if self.head != "lm":
            self.hf_config.num_labels = 1
        _fill_head_dim(self.hf_config)
        named = raw.get("torch_dtype") or raw.get("dtype")
        config_dtype = getattr(torch, named, None) if isinstance(named, str) else None
        self.config_dtype: torch.dtype = (
            config_dtype if isinstance(config_dtype, torch.dtype) else torch.float32
        )
        self.dtype = dtype or self.config_dtype
        base = _MODEL_REGISTRY[model_type]
        # mbridge edits class-level name maps for tied embeddings; give this instance its own.
        maps = {
            name: dict(getattr(base, name))
            for name in ("_DIRECT_MAPPING", "_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING")
            if isinstance(getattr(base, name, None), dict)
        }
        self.tied = self.head == "lm" and bool(
            getattr(self.hf_config, "tie_word_embeddings", False)
        )
        if "_DIRECT_MAPPING" in maps and not self.tied:
            output = "lm_head.weight" if self.head == "lm" else "score.weight"
            maps["_DIRECT_MAPPING"]["output_layer.weight"] = output
        cls = type(f"_{base.__name__}", (base,), maps)
        self.bridge = cls(
            _compat.mbridge_hf_config(self.hf_config),
            dtype=self.dtype,
            parallel_states=ParallelStates(),
        )
        self.model_type: str = model_type
        self.vocab_size: int = int(self.hf_config.vocab_size)
        self._expected: dict[str, tuple[int, ...]] | None = None

    # names and formats

    def hf_names(self, mcore_name: str) -> list[str]:
        """Hugging Face names of one Megatron-Core tensor (layer-indexed, no module prefix)."""
        if self.head != "lm" and mcore_name == _OUTPUT:
            return ["score.weight", *(["score.bias"] if self._score_bias else [])]
        try:
            return list(self.bridge._weight_name_mapping_mcore_to_hf(mcore_name))
        except (NotImplementedError, KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"Megatron-Core tensor {mcore_name!r} has no Hugging Face counterpart in "
                f"mbridge's {self.model_type} mapping ({err})"
            ) from err

    def to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One full (tensor-parallel merged) Megatron-Core tensor as Hugging Face tensors."""
        if self.head != "lm" and mcore_name == _OUTPUT:
            bias = [("score.bias", tensor.new_zeros(tensor.shape[0]))] if self._score_bias else []
            return [("score.weight", tensor), *bias]
        if mcore_name.endswith(VOCAB_KEYS) and tensor.shape[0] > self.vocab_size:
            tensor = tensor[: self.vocab_size]  # Megatron-Core's vocabulary padding
        names, tensors = self.bridge._weight_to_hf_format(mcore_name, tensor)
        if self.tied and mcore_name == "output_layer.weight":
            return []  # the same tensor as the embedding
        return list(zip(names, tensors, strict=True))

    def to_mcore(
        self, mcore_name: str, hf_tensors: Sequence[torch.Tensor], rows: int | None = None
    ) -> torch.Tensor:
        """Hugging Face tensors as one full Megatron-Core tensor (``rows``: padded vocabulary)."""
        if self.head != "lm" and mcore_name == _OUTPUT:
            weight, *bias = hf_tensors
            if bias and not bias[0].is_meta and bool(bias[0].any()):
                raise ValueError(
                    f"{self.path}: score.bias is not zero; a Megatron-Core value head has no "
                    "bias, so this model cannot be converted exactly"
                )
            return weight
        out = self.bridge._weight_to_mcore_format(mcore_name, list(hf_tensors))
        if rows is not None and mcore_name.endswith(VOCAB_KEYS) and rows > out.shape[0]:
            pad = out.new_zeros((rows - out.shape[0], *out.shape[1:]))
            out = torch.cat([out, pad])
        return out

    def expected_hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the Hugging Face model's tensors (built on the meta device: free)."""
        if self._expected is None:
            with torch.device("meta"):
                model = _heads.auto_model_class(self.head).from_config(self.hf_config)
            shapes = {k: tuple(v.shape) for k, v in _saved_state_dict(model).items()}
            if self.tied:
                shapes.pop("lm_head.weight", None)
            self._expected = {
                k: v for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")
            }
        return dict(self._expected)

    @property
    def _score_bias(self) -> bool:
        return "score.bias" in self.expected_hf_shapes()

    def export_config(self, dtype: torch.dtype) -> dict[str, Any] | None:
        """The ``config.json`` an export in ``dtype`` writes, or None where it is the source's."""
        config = self.raw_config
        if _heads.head_of(config) != self.head:
            config = _heads.config_for_head(config, self.head)
        if dtype != self.config_dtype:
            config = dict(config)
            name = str(dtype).removeprefix("torch.")
            for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
                config[key] = name
        return None if config is self.raw_config else config

    # the model

    def transformer_config(self, **overrides: Any) -> TransformerConfig:
        """The Megatron-Core ``TransformerConfig`` of this model for the current parallel layout.

        mbridge's config, made runnable where it is not by default: sequence parallelism only
        with tensor parallelism, and on CPU what :mod:`lightning_mcore_ckpt._cpu` requires.
        ``overrides`` win.
        """
        from megatron.core import parallel_state

        settings: dict[str, Any] = {}
        if parallel_state.model_parallel_is_initialized():
            settings.update(
                tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=(
                    parallel_state.get_pipeline_model_parallel_world_size()
                ),
                context_parallel_size=parallel_state.get_context_parallel_world_size(),
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=(
                    parallel_state.get_expert_tensor_parallel_world_size()
                ),
                # mbridge's default is 1, which Megatron-Core reads as a virtual pipeline.
                virtual_pipeline_model_parallel_size=(
                    parallel_state.get_virtual_pipeline_model_parallel_world_size()
                ),
            )
        else:
            settings["virtual_pipeline_model_parallel_size"] = None
        settings["sequence_parallel"] = settings.get("tensor_model_parallel_size", 1) > 1
        settings["pipeline_dtype"] = self.dtype
        settings["params_dtype"] = self.dtype
        settings["bf16"] = self.dtype is torch.bfloat16
        settings["fp16"] = self.dtype is torch.float16
        settings.update(_cpu.transformer_config_overrides())
        if getattr(self.bridge.config, "num_moe_experts", None) and not has_transformer_engine():
            settings.update(_LOCAL_MOE)
        if self.model_type == "qwen2_moe":  # mbridge leaves out Qwen2-MoE's shared-expert gate
            settings["moe_shared_expert_gate"] = True
        settings.update(_router_as_hf(self.model_type, self.hf_config))
        settings.update(overrides)
        config = self.bridge.config
        return dataclasses.replace(config, **settings)

    def gpt_model(
        self,
        config: TransformerConfig | None = None,
        pre_process: bool | None = None,
        post_process: bool | None = None,
    ) -> torch.nn.Module:
        """A Megatron-Core ``GPTModel`` of this architecture for the current parallel layout.

        Transformer Engine layers when it is installed, Megatron-Core's local layers otherwise
        (CPU). Weights are randomly initialised: load them with :func:`load_hf_weights` or from a
        checkpoint.
        """
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config = config or self.transformer_config()
        if has_transformer_engine():
            spec = self.bridge._get_transformer_layer_spec()
        else:
            spec = get_gpt_layer_local_spec(
                qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                normalization=config.normalization,
                **_local_moe_spec_args(config),
            )
            _moe_norm_named_as_with_te(spec, config)
            spec = _cpu.local_spec_norms(spec, config)
        initialized = parallel_state.model_parallel_is_initialized()
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage() if initialized else True
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage() if initialized else True
        args = self.bridge._get_gptmodel_args()
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.tied,
            **args,
        )
        if self.head != "lm":
            # mbridge's (and verl's) value head: a replicated [1, hidden] linear, no bias.
            from mbridge.utils.post_creation_callbacks import make_value_model

            make_value_model(model, pre_process, post_process, config, self.hf_config)
        return model


def _router_as_hf(model_type: str, hf_config: Any) -> dict[str, Any]:
    """The router's ``TransformerConfig`` fields that weigh the chosen experts as transformers
    does: renormalised over them (a softmax of their logits: ``moe_router_pre_softmax=False``)
    or not (a softmax over every expert: ``True``).

    mbridge 0.15 hard-codes one per family: ``True`` for Mixtral, whose transformers model
    renormalises (a tiny Mixtral's logits then differed by 5% of their size), and one value
    each for Qwen2-MoE and Qwen3-MoE, whose configs say which (``norm_topk_prob``).
    """
    if model_type == "mixtral":
        return {"moe_router_pre_softmax": False}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return {"moe_router_pre_softmax": not getattr(hf_config, "norm_topk_prob", False)}
    return {}


def _fill_head_dim(hf_config: Any) -> None:
    """Give ``head_dim`` its value where the config leaves it ``None`` (Mixtral's does).

    transformers then computes ``hidden_size // num_attention_heads``; mbridge 0.15 reads
    ``hf_config.head_dim`` and multiplies it, failing on ``None``. Only the bridge's copy of the
    config changes: an export writes the source's ``config.json``.
    """
    if getattr(hf_config, "head_dim", 0) is None:
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads


# Mixtures of experts with Megatron-Core's local layers (no Transformer Engine: CPU).

_LOCAL_MOE: dict[str, Any] = {
    "moe_grouped_gemm": False,  # grouped GEMM needs Transformer Engine: one MLP per expert
    "moe_shared_expert_overlap": False,  # overlaps on CUDA streams
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    "moe_token_dispatcher_type": "alltoall",  # all_to_all runs on gloo
    "persist_layer_norm": False,  # Apex's kernel; local layers use torch's norm
}
"""``TransformerConfig`` fields of an MoE model built with local layers."""


def _local_moe_spec_args(config: TransformerConfig) -> dict[str, Any]:
    experts = getattr(config, "num_moe_experts", None)
    return {"num_experts": experts, "moe_grouped_gemm": False} if experts else {}


def _moe_norm_named_as_with_te(spec: Any, config: TransformerConfig) -> None:
    """Save an MoE layer's pre-MLP norm as ``pre_mlp_layernorm.weight``, as Transformer Engine
    layers do (there is no ``linear_fc1`` to fuse it into) and mbridge maps it."""
    if not getattr(config, "num_moe_experts", None):
        return
    keys = dict(spec.submodules.sharded_state_dict_keys_map)
    keys.pop("pre_mlp_layernorm.", None)
    spec.submodules.sharded_state_dict_keys_map = keys


def _saved_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as ``save_pretrained`` writes it: transformers 5 holds an MoE
    layer's experts fused (``experts.gate_up_proj``) and writes them one per expert."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the module holds the saved layout
        return state
    if not any(".experts." in k for k in state):
        return state
    return dict(revert_weight_conversion(model, state))
