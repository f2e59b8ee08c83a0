"""Sharded state dicts of the model and its optimizers, as Megatron-Core dist-checkpointing
writes and reads them, and the rank-local view of a training run the engine works on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt import _cpu
from lightning_mcore_ckpt.engine import _param_groups
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.training import optim as _optim

__all__ = [
    "TrainingState",
    "distributed_optimizers",
    "megatron_optimizer_metadata",
    "module_sharded_state_dict",
    "optimizer_sharded_state_dict",
    "optimizers_to_save",
    "pickled_values",
    "refused_objects",
    "stateless_params",
    "to_module_keys",
]


@dataclass(frozen=True, kw_only=True)
class TrainingState:
    """This rank's side of a checkpoint: what it writes and reads into, and where it sits.

    Built by the strategy for each save or load; the engine never holds on to it past one call
    (an async save keeps only the device).
    """

    module: torch.nn.Module
    """The root module (the LightningModule): weights are loaded into it."""
    model_sharded_state_dict: Callable[[], dict[str, Any]]
    """A fresh sharded state dict of the weights (saving consumes one)."""
    optimizers: Sequence[torch.optim.Optimizer]
    """The torch (or Megatron-Core) optimizers, unwrapped, in the order they are saved."""
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where this rank's collectives place their tensors."""
    parallel_layout: dict[str, int]
    """The parallel sizes of this run, as recorded in checkpoints."""
    strict: bool = True
    """Whether loading the weights requires every key of the module."""
    optimizer_sharding: str = "dp_reshardable"
    """How a Megatron-Core distributed optimizer's state is saved (its
    ``distrib_optim_sharding_type``): ``"dp_reshardable"`` or ``"fully_reshardable"``."""


def module_sharded_state_dict(module: torch.nn.Module, prefix: str = "") -> dict[str, Any]:
    """``module``'s weights as a Megatron-Core sharded state dict, keys prefixed by ``prefix``.

    Megatron-Core modules contribute their own ``sharded_state_dict()``; any other parameter
    or persistent buffer is a replicated tensor (written once, by global rank 0's replica).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.module import MegatronModule

    out: dict[str, Any] = {}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    local = list(module._parameters.items()) + [
        (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
    ]
    for name, tensor in local:
        if tensor is not None:
            key = f"{prefix}{name}"
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=rank)
    for name, child in module.named_children():
        if isinstance(child, MegatronModule):
            inner, _ = _unwrap(child)
            out.update(inner.sharded_state_dict(prefix=f"{prefix}{name}."))
        else:
            out.update(module_sharded_state_dict(child, f"{prefix}{name}."))
    return out


def _unwrap(module: torch.nn.Module) -> tuple[Any, str]:
    """The model inside Megatron-Core's training wrappers (``DistributedDataParallel``,
    ``Float16Module``) and the attribute path to it (``"module.module."``), as Megatron-LM
    unwraps it before saving: checkpoint keys do not depend on how the model is wrapped."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    path = ""
    while isinstance(module, DistributedDataParallel | Float16Module):
        module, path = module.module, f"{path}module."
    return module, path


def to_module_keys(module: torch.nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (keys of :func:`module_sharded_state_dict`) with the keys ``module``'s
    own ``load_state_dict`` expects: wrapped models' attribute paths put back."""
    from megatron.core.transformer.module import MegatronModule

    renames: dict[str, str] = {}
    for name, child in module.named_modules():
        if isinstance(child, MegatronModule) and name:
            _, path = _unwrap(child)
            outer = f"{name}."
            if path and not any(outer.startswith(src) for src in renames):
                renames[outer] = f"{outer}{path}"
    if not renames:
        return state_dict
    out = {}
    for key, value in state_dict.items():
        src = next((s for s in renames if key.startswith(s)), None)
        out[renames[src] + key[len(src) :] if src else key] = value
    return out


_FORMAT_KEYS = ("distrib_optim_sharding_type", "chained_optim_avoid_prefix")
"""The keys of :func:`megatron_optimizer_metadata` that describe the saved format."""


def megatron_optimizer_metadata(sharding: str) -> dict[str, Any]:
    """What Megatron-Core's optimizers are told when their sharded state dict is built.

    The same as Megatron-LM's training loop passes (``_build_sharded_state_dict_metadata``):
    the distributed optimizer's sharding type, and no ``chained_<i>.`` key prefix for a
    fully reshardable state (both saved as the ``optim/`` directory's content metadata and read
    back from there on load: a step always loads with the format it was written in), and how
    this machine gathers it (:func:`_cpu.optimizer_metadata_overrides`, not saved).
    """
    return {
        "distrib_optim_sharding_type": sharding,
        "chained_optim_avoid_prefix": True,
        **_cpu.optimizer_metadata_overrides(),
    }


def distributed_optimizers(optimizers: Sequence[Any]) -> list[Any]:
    """The Megatron-Core ``DistributedOptimizer`` instances among ``optimizers`` (chained or not)."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found: list[Any] = []
    for opt in optimizers:
        inner = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
        found.extend(o for o in inner if isinstance(o, DistributedOptimizer))
    return found


def optimizer_sharded_state_dict(
    optimizers: Sequence[torch.optim.Optimizer],
    module: torch.nn.Module,
    model_ssd: dict[str, Any],
    is_loading: bool = False,
    metadata: dict[str, Any] | None = None,
    *,
    load_template: bool = False,
) -> dict[str, Any]:
    """The optimizers' state mapped onto ``model_ssd`` (``optimizer_<i>`` each).

    Parameters of ``module`` that no optimizer holds (frozen ones) are saved with the first
    torch optimizer, so that a later run that trains them finds their slots. Megatron-Core
    optimizers build theirs with ``metadata`` (:func:`megatron_optimizer_metadata`).
    ``load_template``: the torch optimizers' state was made from the step's saved keys, for
    the load this template is for (see ``training.optim.sharded_state_dict``).
    """
    from megatron.core.optimizer import MegatronOptimizer

    out: dict[str, Any] = {}
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    outside = [p for p in module.parameters() if id(p) not in held]
    metadata = megatron_optimizer_metadata("dp_reshardable") if metadata is None else metadata
    for idx, opt in enumerate(optimizers):
        if isinstance(opt, MegatronOptimizer):
            out[f"optimizer_{idx}"] = opt.sharded_state_dict(
                model_ssd, is_loading=is_loading, metadata=metadata
            )
        else:
            out[f"optimizer_{idx}"] = _optim.sharded_state_dict(
                opt, model_ssd, outside if idx == 0 else (), load_template=load_template
            )
    return out


def optimizers_to_save(
    state: TrainingState, model_ssd: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The optimizers' sharded state dict for a save, the content metadata saved with it, and
    the distributed optimizer's sharding type for ``metadata.json`` (``None``: there is none).

    ``model_ssd``: the model's sharded dict of the same save, not planned yet (its planning
    changes it), onto which the optimizers are mapped, as Megatron-LM maps them onto the dict
    it saves; mapping them leaves it as it was. ``None``: a new one is built. With a
    distributed optimizer, the common state also records which parameters each of its groups
    holds (:mod:`._param_groups`; collective).
    """
    metadata = megatron_optimizer_metadata(state.optimizer_sharding)
    if model_ssd is None:
        model_ssd = state.model_sharded_state_dict()
    # Which parameters each distributed optimizer group holds (collective): a load in another
    # layout (expert parallelism: other inner optimizers) maps the groups by parameter. It only
    # reads the model's dict, the same one.
    groups = _param_groups.record(state.optimizers, lambda: model_ssd)
    ssd = optimizer_sharded_state_dict(state.optimizers, state.module, model_ssd, False, metadata)
    if groups is not None:
        ssd[_param_groups.RECORD_KEY] = groups
    sharding = state.optimizer_sharding if distributed_optimizers(state.optimizers) else None
    # Saved: the format only, not how this machine gathers it.
    content = {key: metadata[key] for key in _FORMAT_KEYS}
    return ssd, content, sharding


def stateless_params(optimizers: Sequence[torch.optim.Optimizer]) -> list[list[int]]:
    """Per torch optimizer, which parameters had no state (frozen, or never given a gradient).

    Megatron-Core optimizers keep state for every parameter they hold: none listed."""
    from megatron.core.optimizer import MegatronOptimizer

    return [
        [] if isinstance(o, MegatronOptimizer) else _optim.stateless_params(o) for o in optimizers
    ]


def pickled_values(sharded_state_dict: Any, path: str) -> list[tuple[str, Any]]:
    """The values of a sharded state dict that Megatron-Core pickles, with where they sit.

    Each ``ShardedObject``'s data and every value outside the sharded ones (the common state);
    not tensors, nor plain numbers and strings (which any load accepts). Every save walks the
    whole dict: a child that is a sharded tensor, a tensor or plain data is passed over without
    building its path.
    """
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedBase,
        ShardedObject,
        ShardedTensor,
    )

    passed = (bool, int, float, str, torch.Tensor, ShardedTensor, type(None))
    found: list[tuple[str, Any]] = []
    stack: list[tuple[Any, str]] = [(sharded_state_dict, path)]
    while stack:
        value, where = stack.pop()
        kind = type(value)
        if kind is dict:
            children = [
                (c, f"{where}[{k!r}]") for k, c in value.items() if not isinstance(c, passed)
            ]
        elif kind is list or kind is tuple:
            children = [
                (c, f"{where}[{i}]") for i, c in enumerate(value) if not isinstance(c, passed)
            ]
        elif isinstance(value, ShardedObject):
            children = [(value.data, where)]
        elif isinstance(value, ShardedBase | LocalNonpersistentObject) or isinstance(value, passed):
            continue
        else:
            found.append((where, value))
            continue
        stack.extend(reversed(children))  # depth first, in the dict's order
    return found


def refused_objects(sharded_state_dict: Any, name: str) -> dict[str, list[str]]:
    """What of the objects Megatron-Core pickles in ``model/`` or ``optim/`` a load refuses.

    ``{where: [globals]}`` (see ``_safe_load.unsafe_parts``), for the warning at save time.
    """
    values = dict(pickled_values(sharded_state_dict, name))
    return _safe_load.unsafe_parts(values, name, named=True) if values else {}
