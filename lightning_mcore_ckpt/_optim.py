"""Sharded state of ordinary torch optimizers, so that moments reshard along with the weights.

Each per-parameter state tensor (``exp_avg``, ``exp_avg_sq``, momentum buffers, ...) is saved as a
``ShardedTensor`` with exactly the sharding of its parameter (Megatron-Core's
``optim_state_to_sharding_state``). Scalar per-parameter entries such as Adam's ``step`` cannot
be sharded like the parameter; they are saved once per parameter group, since every parameter of
a group is stepped together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["init_state", "load_sharded", "sharded_state_dict"]

_SCALAR_PREFIX = "scalar_"


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state without changing any parameter.

    A fresh optimizer has no state to load into; one step with zero gradients and a learning
    rate of zero creates it (AdamW, Adam, SGD with momentum: no parameter moves).
    """
    if optimizer.state:
        return
    saved_grads = {p: p.grad for p in _params(optimizer)}
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in saved_grads:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else group["lr"] * 0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


def sharded_state_dict(
    optimizer: torch.optim.Optimizer, model_sharded_state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """The optimizer's state as a Megatron-Core sharded state dict matching the model's sharding."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    scalar_keys: set[str] = set()
    for param_state in state["state"].values():
        for key, value in param_state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                scalar_keys.add(key)
    for group in state["param_groups"]:
        for key in scalar_keys:
            values = [state["state"][pid][key] for pid in group["params"] if pid in state["state"]]
            if values:
                value = values[0]
                group[_SCALAR_PREFIX + key] = (
                    value.item() if isinstance(value, torch.Tensor) else value
                )
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, _params(optimizer))
    optim_state_to_sharding_state(state, id_map, exclude_keys=tuple(scalar_keys))
    return state


def load_sharded(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Load a state produced by ``dist_checkpointing.load`` of :func:`sharded_state_dict`."""
    current = optimizer.state_dict()
    template = {pid: dict(s) for pid, s in current["state"].items()}
    groups = loaded["param_groups"]
    for group in groups:
        scalars = {
            k[len(_SCALAR_PREFIX) :]: group.pop(k)
            for k in list(group)
            if k.startswith(_SCALAR_PREFIX)
        }
        for pid in group["params"]:
            param_state = loaded["state"].setdefault(pid, {})
            for key, value in scalars.items():
                like = template.get(pid, {}).get(key)
                param_state[key] = (
                    torch.tensor(value, dtype=like.dtype, device=like.device)
                    if isinstance(like, torch.Tensor)
                    else value
                )
    optimizer.load_state_dict(loaded)
