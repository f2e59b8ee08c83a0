"""Megatron-Core ``TransformerConfig`` fields given by a user (a module's
``transformer_config=...``, from Python or a LightningCLI YAML), checked before anything is
built: the router, the auxiliary loss, ``expert_bias``, the capacity factor and every other
field, without subclassing the module.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

__all__ = ["check_transformer_config"]

_PARALLEL = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "sequence_parallel",
)
"""Set from the strategy (``MegatronStrategy(...)``), never from a model's fields."""


def check_transformer_config(value: Mapping[str, Any] | None, argument: str) -> dict[str, Any]:
    """``value`` as a dict of ``TransformerConfig`` fields (``{}`` for ``None``), or
    ``ValueError`` naming ``argument``, the field and the fix: a name that is no field of this
    Megatron-Core's ``TransformerConfig`` (the closest one named), or a parallel size (those
    come from the strategy).

    Example::

        check_transformer_config({"num_moe_experts": 4, "moe_router_topk": 2}, "transformer_config")
    """
    from megatron.core.transformer import TransformerConfig

    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{argument}: {value!r} is not a mapping of TransformerConfig fields; pass e.g. "
            "{'num_moe_experts': 4, 'moe_router_topk': 2}"
        )
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in value:
        if name in _PARALLEL:
            raise ValueError(
                f"{argument}: {name}={value[name]!r} is a parallel size, which the strategy "
                f"sets: pass MegatronStrategy({name}={value[name]!r}) instead"
            )
        if name not in fields:
            close = difflib.get_close_matches(str(name), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{argument}: {name!r} is not a field of Megatron-Core's TransformerConfig{hint}"
            )
    return dict(value)
