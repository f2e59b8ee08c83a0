"""A distributed optimizer's parameter groups, recorded by parameter at a save and mapped onto
the live optimizer's at a load.

Megatron-Core's ``get_megatron_optimizer`` builds one ``DistributedOptimizer`` per kind of
parameter: with expert parallelism (EP > 1), a ``ChainedOptimizer`` of a dense and an expert
optimizer; with EP = 1, one optimizer for all. Saved ``fully_reshardable``, their tensors
(Adam's moments, the fp32 main parameters) are keyed by parameter and load into any layout; but
their parameter groups (learning rate, Adam's ``step``, betas, weight decay...) are kept per
inner optimizer, by position, without their parameters. So a step saved at EP = 2 holds two
inner optimizers' groups and a run at EP = 1 has one: nothing said which saved group is whose.

This module records, at each save, which parameters (by their sharded keys, the same on every
layout) each saved group held (:func:`record`, in ``optim/``'s common state under
:data:`RECORD_KEY`), and at a load gives each live group the saved group of its own parameters
(:func:`regroup`), whatever position either has. Loads of steps written before the record fall
back to Megatron-Core's own matching when the structure is unchanged, and are refused (before
anything is read) when the expert-parallel size changed: see
:func:`~._reader.CheckpointReader.check_optimizer_layout`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt.engine._collectives import cpu_group, distributed

__all__ = ["RECORD_KEY", "inner_counts", "record", "regroup", "this_ranks_groups"]

RECORD_KEY = "distributed_optimizer_param_groups"
"""The key of the record in ``optim/``'s common state: ``{"optimizer_<i>": [per inner
optimizer: [per group: sorted parameter keys]]}``. Readers that predate it ignore it."""


def _inner(opt: Any) -> list[Any]:
    from megatron.core.optimizer import ChainedOptimizer

    return list(opt.chained_optimizers) if isinstance(opt, ChainedOptimizer) else [opt]


def _is_distributed(opt: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = _inner(opt)
    return bool(inner) and all(isinstance(o, DistributedOptimizer) for o in inner)


def _param_keys(model_ssd: dict[str, Any]) -> dict[int, str]:
    """The sharded key of each parameter of the model, by the parameter's identity."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return {
        id(sh.data): sh.key
        for sh in nested_values(model_ssd)
        if isinstance(sh, ShardedBase) and isinstance(getattr(sh, "data", None), torch.Tensor)
    }


def _groups_of(dist_opt: Any, keys: dict[int, str]) -> list[list[str]]:
    """The sharded keys of the parameters of each of ``dist_opt``'s groups (this rank's)."""
    groups: list[list[str]] = [[] for _ in dist_opt.optimizer.param_groups]
    for param, (group, _) in dist_opt.model_param_group_index_map.items():
        key = keys.get(id(param))
        if key is None:
            raise ValueError(
                f"a parameter of shape {list(param.shape)} held by the distributed optimizer is "
                "not in the model's sharded state dict: its optimizer state has no key"
            )
        groups[group].append(key)
    return groups


def inner_counts(optimizers: Sequence[Any]) -> list[int] | None:
    """How many inner distributed optimizers each optimizer has (``None``: no distributed
    optimizer), as ``metadata.json`` records it (``distributed_optimizer_parts``)."""
    counts = [len(_inner(o)) if _is_distributed(o) else 0 for o in optimizers]
    return counts if any(counts) else None


def record(
    optimizers: Sequence[Any], model_ssd: Callable[[], dict[str, Any]]
) -> dict[str, Any] | None:
    """Which parameters each group of each distributed optimizer holds, whole: the keys of
    every rank's shard of it (collective when the process group is up: every rank calls it, in
    the same order, and gets the same answer, merged on rank 0 and broadcast from there).
    ``None``: no distributed optimizer. ``model_ssd`` builds the model's sharded state dict
    (only called when there is one: it is a fixed cost of every save)."""
    mine = this_ranks_groups(optimizers, model_ssd)
    if mine is None:
        return None
    if not (distributed() and dist.get_world_size() > 1):
        return _merged(mine, [mine])
    # Gathered on rank 0 alone and the union broadcast from there: a rank other than 0
    # receives the record, whose size does not grow with the ranks, never the others' lists.
    group = cpu_group()
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    union: list[Any] = [None if gathered is None else _merged(mine, gathered)]
    dist.broadcast_object_list(union, src=0, group=group)
    out: dict[str, Any] = union[0]
    return out


def _merged(mine: dict[str, Any], gathered: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's groups (``gathered``, in the structure of ``mine``) merged by position."""
    out: dict[str, Any] = {}
    for name, inners in mine.items():
        merged = [[set[str]() for _ in groups] for groups in inners]
        for other in gathered:
            for i, groups in enumerate(other[name]):
                for j, group in enumerate(groups):
                    merged[i][j].update(group)
        out[name] = [[sorted(g) for g in groups] for groups in merged]
    return out


def this_ranks_groups(
    optimizers: Sequence[Any], model_ssd: Callable[[], dict[str, Any]]
) -> dict[str, Any] | None:
    """:func:`record`'s answer for this rank's parameters alone (local: no collective): what a
    load maps its groups by. Each rank's live groups are its own optimizer's, so the keys of
    its own parameters find their saved groups; gathering every rank's keys to every rank at a
    load would grow with the ranks. ``None``: no distributed optimizer."""
    if inner_counts(optimizers) is None:
        return None
    keys = _param_keys(model_ssd())
    return {
        f"optimizer_{idx}": [[sorted(g) for g in _groups_of(o, keys)] for o in _inner(opt)]
        for idx, opt in enumerate(optimizers)
        if _is_distributed(opt)
    }


def _saved_parts(state: dict[Any, Any]) -> list[dict[str, Any]]:
    """The saved inner optimizers' common state, in order, from a loaded state dict."""
    if "optimizer" in state:
        return [state]
    return [state[k] for k in sorted(k for k in state if isinstance(k, int))]


def regroup(
    state: dict[Any, Any], opt: Any, saved: list[list[list[str]]], live: list[list[list[str]]]
) -> dict[Any, Any]:
    """``state`` (one Megatron-Core optimizer's, as a fully reshardable load returns it: the
    saved inner optimizers' groups, the live ones' tensors) rebuilt in the live structure: each
    live group with the saved group of its parameters (``saved``: the step's record for this
    optimizer), each live inner optimizer with its own tensors.

    Raises ``ValueError`` naming the parameters no saved group held, or a live group whose
    parameters were saved in groups of different hyperparameters (they cannot become one).
    """
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    parts = _saved_parts(state)
    if len(parts) != len(saved):
        raise ValueError(
            f"the step's optimizer holds {len(parts)} inner optimizer(s) but its record of "
            f"parameter groups names {len(saved)}: the step is inconsistent"
        )
    where = {
        key: (i, j)
        for i, groups in enumerate(saved)
        for j, group in enumerate(groups)
        for key in group
    }
    inners = _inner(opt)
    rebuilt: list[dict[str, Any]] = []
    for index, dist_opt in enumerate(inners):
        tensors = state if len(inners) == 1 else state[index]
        groups: list[dict[str, Any]] = []
        first: tuple[int, int] | None = None
        for group, live_group in zip(live[index], dist_opt.optimizer.param_groups, strict=True):
            missing = sorted(k for k in group if k not in where)
            if missing:
                raise ValueError(
                    f"no saved parameter group holds {', '.join(missing[:5])}"
                    + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                    + ": the step's optimizer was saved for another model"
                )
            sources = sorted({where[k] for k in group})
            chosen = [parts[i]["optimizer"]["param_groups"][j] for i, j in sources]
            values = [
                {k: v for k, v in g.items() if not _identifies(k, param_group_identifier_keys)}
                for g in chosen
            ]
            if any(v != values[0] for v in values[1:]):
                raise ValueError(
                    f"the parameters of one live parameter group were saved in groups with "
                    f"different hyperparameters ({values}); they cannot be loaded as one group"
                )
            if not sources:
                raise ValueError(f"live parameter group {len(groups)} holds no parameter")
            if first is None:
                first = sources[0]
            # Megatron-Core pairs saved and live groups by these: the live group's own.
            merged = {
                **values[0],
                **{
                    k: v
                    for k, v in live_group.items()
                    if _identifies(k, param_group_identifier_keys)
                },
            }
            merged.pop("params", None)
            groups.append(merged)
        source = parts[first[0] if first is not None else 0]
        inner = {k: v for k, v in source.items() if k != "param_state"}
        inner["optimizer"] = {**source["optimizer"], "param_groups": groups}
        inner["param_state"] = tensors["param_state"]
        rebuilt.append(inner)
    return rebuilt[0] if len(inners) == 1 else dict(enumerate(rebuilt))


def _identifies(key: str, identifiers: Sequence[str]) -> bool:
    """Whether a group's ``key`` is one Megatron-Core identifies groups by (NeMo's
    ``pre_<key>`` aliases included)."""
    return key in identifiers or (key.startswith("pre_") and key[4:] in identifiers)
