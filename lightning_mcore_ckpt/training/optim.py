"""Sharded state of ordinary torch optimizers, so that moments reshard along with the weights.

Each per-parameter state tensor (``exp_avg``, ``exp_avg_sq``, momentum buffers, ...) is saved as a
``ShardedTensor`` with exactly the sharding of its parameter (Megatron-Core's
``optim_state_to_sharding_state``). Scalar per-parameter entries such as Adam's ``step`` cannot
be sharded like the parameter; they are saved once per parameter group, since every parameter of
a group is stepped together.

Only parameters that have state are saved: frozen parameters, and trainable ones that never
received a gradient, have none (torch optimizers skip a parameter whose ``grad`` is ``None``,
even when it is in a parameter group). On load, :func:`init_state` recreates state for exactly
the parameters whose state tensors the checkpoint holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_mcore_ckpt.training._kept_optim_tensors import kept_for

__all__ = [
    "init_state",
    "load_sharded",
    "loading_distributed_optimizers",
    "restore_steps_from_groups",
    "saved_state_keys",
    "sharded_state_dict",
]

_SCALAR_PREFIX = "scalar_"
_OUTSIDE = "outside_optimizer."


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def saved_state_keys(directory: str | os.PathLike[str]) -> set[str]:
    """The checkpoint keys of the optimizer state tensors saved in ``directory``.

    A parameter had optimizer state when it was saved exactly when its tensors (``exp_avg``,
    momentum buffers, ...) are in the checkpoint: :func:`sharded_state_dict` writes every
    parameter that has state, and only those. This holds for every checkpoint written with this
    module, whatever its parallel layout, so no extra record is needed.
    """
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(str(directory)))


def _built_keys(sharded: Any) -> set[str]:
    """The keys of the tensors a ``ShardedTensor`` or ``ShardedTensorFactory`` is saved as."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(sharded, ShardedTensorFactory):
        return {sharded.key}
    return {key for built in nested_values(sharded.build()) for key in _built_keys(built)}


def _params_with_saved_state(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Mapping[str, Any],
    saved_keys: Collection[str],
) -> list[torch.nn.Parameter]:
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    # Optimizer state keys are "optimizer.state.<state key>.<model tensor key>"; torch's state
    # keys (exp_avg, exp_avg_sq, momentum_buffer, ...) have no dots.
    prefix = "optimizer.state."
    saved_model_keys = {
        key[len(prefix) :].split(".", 1)[-1] for key in saved_keys if key.startswith(prefix)
    }
    params = _params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
    return [
        params[pid] for pid, sharded in id_map.items() if _built_keys(sharded) & saved_model_keys
    ]


def missing_state_keys(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Mapping[str, Any],
    saved_keys: Collection[str],
) -> list[str]:
    """The state tensors a load of ``saved_keys`` into ``optimizer`` would need and not find:
    of every parameter whose state was saved, each kind of state (``exp_avg``, ``exp_avg_sq``,
    ``step``, ``momentum_buffer``, ...) that the optimizer's other saved parameters have. A
    parameter with no saved state at all had none when saved (frozen, or it never received a
    gradient): it gets none, as :func:`init_state` makes it."""
    prefix = "optimizer.state."
    kinds_of: dict[str, set[str]] = {}
    for key in saved_keys:
        if key.startswith(prefix) and "." in key[len(prefix) :]:
            kind, model_key = key[len(prefix) :].split(".", 1)
            kinds_of.setdefault(model_key, set()).add(kind)
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, _params(optimizer))
    held = [
        model_key
        for sharded in id_map.values()
        for model_key in sorted(_built_keys(sharded))
        if model_key in kinds_of
    ]
    kinds = set().union(*(kinds_of[k] for k in held)) if held else set()
    return sorted(
        f"{prefix}{kind}.{model_key}"
        for model_key in held
        for kind in sorted(kinds - kinds_of[model_key])
    )


_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


class _Uninitialised(torch.overrides.TorchFunctionMode):
    """Within: ``torch.zeros_like`` makes ``torch.empty_like`` (this thread only): state that a
    load overwrites whole is not zeroed first (0.1-0.2 s per GiB of Adam state on CPU)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.zeros_like:
            func = torch.empty_like
        return func(*args, **(kwargs or {}))


def _init_adam_state(optimizer: torch.optim.Optimizer, overwritten: bool) -> bool:
    """torch's Adam/AdamW: the state their step would create for the parameters with a gradient,
    made by the step's own ``_init_group`` without the step's arithmetic (a third of a load's
    time for a large model on CPU). ``overwritten``: every state tensor is about to be loaded
    whole, so its memory is left uninitialised. ``False`` for any other optimizer."""
    if type(optimizer) not in _ADAMS:
        return False
    with _Uninitialised() if overwritten else contextlib.nullcontext():
        for group in optimizer.param_groups:
            lists: list[list[Any]] = [[] for _ in range(6)]
            optimizer._init_group(group, *lists)  # type: ignore[attr-defined]
    return True


def init_state(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Mapping[str, Any] | None = None,
    saved_keys: Collection[str] | None = None,
    *,
    overwritten: bool | None = None,
) -> None:
    """Create the per-parameter state a checkpoint holds, without changing any parameter.

    A fresh optimizer has no state to load into; one step with zero gradients and a learning
    rate of zero creates it (AdamW, Adam, SGD with momentum: no parameter moves). With
    ``saved_keys`` (:func:`saved_state_keys` of the checkpoint), state is created for exactly the
    parameters whose state was saved: frozen parameters, and trainable ones that never received
    a gradient, have none, and a template asking for theirs would fail the load. Without it,
    every parameter of the optimizer gets state. Any state the optimizer had is replaced.

    ``overwritten``: every state tensor made is about to be loaded whole (the default with
    ``saved_keys``; a Megatron-Core distributed optimizer's load copies every element of each
    moment), so torch Adam's and AdamW's are left uninitialised: no memset, their pages first
    touched by the load's reads. A caller whose load then fails empties the state again.
    """
    if saved_keys is None:
        params = _params(optimizer)
    else:
        if model_sharded_state_dict is None:
            raise ValueError("init_state: saved_keys needs the model's sharded state dict")
        params = _params_with_saved_state(optimizer, model_sharded_state_dict, saved_keys)
    optimizer.state.clear()
    if not params:
        return
    saved_grads = {p: p.grad for p in _params(optimizer)}
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    stepped = {id(p) for p in params}
    adam = type(optimizer) in _ADAMS
    try:
        for p in saved_grads:
            # Adam's _init_group only asks whether a gradient is there: a zero broadcast to the
            # parameter's shape takes no memory. A step reads every element: real zeros.
            zero = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p) if adam else None
            p.grad = (torch.zeros_like(p) if zero is None else zero) if id(p) in stepped else None
        # With saved_keys, every state tensor made here is in the checkpoint: the load
        # overwrites it whole. Without, some may stay as made (zeros, as a step makes them),
        # unless the caller says the load overwrites it all (a distributed optimizer's).
        if overwritten is None:
            overwritten = saved_keys is not None
        if not _init_adam_state(optimizer, overwritten=overwritten):
            for group in optimizer.param_groups:
                lr = group["lr"]
                group["lr"] = 0.0 if not isinstance(lr, torch.Tensor) else lr * 0
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


def sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: Mapping[str, Any],
    outside: Sequence[torch.nn.Parameter] = (),
    *,
    load_template: bool = False,
) -> dict[str, Any]:
    """The optimizer's state as a Megatron-Core sharded state dict matching the model's sharding.

    ``outside``: the model's parameters that no optimizer holds (frozen ones left out of
    ``configure_optimizers``); they contribute zero slices where they share a stacked tensor
    with parameters that have state (see :func:`_fill_partial_keys`).

    ``load_template``: the template of a load whose state :func:`init_state` made from the
    step's saved keys. Nothing is agreed over the ranks then (no collective, so a rank whose
    weights were read first goes on to its optimizer's reads while another still reads): each
    rank's state already holds every parameter whose state the step saved, what the agreement
    would give it; the scalar values go to the groups, which a load takes from the step; and
    the slices of ``outside`` parameters, which a load discards, are not asked for.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    params = _params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
    # Per group, the scalar entries (Adam's "step"): every parameter of a group is stepped
    # together. Agreed over all ranks, like everything below: rank 0 writes the groups, and it
    # may hold no stateful parameter at all (a pipeline stage of frozen layers).
    scalars: list[dict[str, Any]] = [{} for _ in state["param_groups"]]
    for index, group in enumerate(state["param_groups"]):
        for pid in group["params"]:
            for key, value in state["state"].get(pid, {}).items():
                if key in scalars[index]:
                    continue  # the group's first parameter gave it (a tensor's .item() once)
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    scalars[index][key] = value.item() if isinstance(value, torch.Tensor) else value
    stateful = {id_map[pid].key for pid in state["state"] if pid in id_map}
    names = {
        key
        for param_state in state["state"].values()
        for key, value in param_state.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }
    if not load_template:
        scalars, stateful, names = _agree(scalars, stateful, names)
    for group, found in zip(state["param_groups"], scalars, strict=True):
        for key, value in found.items():
            group[_SCALAR_PREFIX + key] = value
    _fill_partial_keys(state, id_map, params, stateful, names)
    if outside and not load_template:
        others = get_param_id_to_sharded_param_map(model_sharded_state_dict, list(outside))
        for i, sharded in others.items():
            if sharded.key in stateful:
                key = f"{_OUTSIDE}{i}"
                id_map[key] = sharded  # type: ignore[index]
                state["state"][key] = {name: torch.zeros_like(outside[i]) for name in sorted(names)}
    scalar_keys = sorted({key for found in scalars for key in found})
    with kept_for(optimizer).in_use():
        optim_state_to_sharding_state(state, id_map, exclude_keys=tuple(scalar_keys))
    return state


def _agree(
    scalars: list[dict[str, Any]], stateful: set[str], names: set[str]
) -> tuple[list[dict[str, Any]], set[str], set[str]]:
    """Collective over the default group: the union of every rank's findings (first value wins,
    in rank order).

    Where the ranks' findings differ (pipeline stages hold different keys), they are gathered on
    rank 0 alone, merged there, and the union broadcast: a rank other than 0 receives the
    union, whose size does not grow with the ranks, never the other ranks' lists.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return scalars, stateful, names
    if _same_everywhere(scalars, stateful, names):
        # Every rank found the same keys (no pipeline stage without state): the union is
        # rank 0's, values included; one broadcast instead of a gather that grows with ranks.
        box = [scalars]
        dist.broadcast_object_list(box, src=0)
        return box[0], stateful, names
    # The ranks' findings differ: gathered on rank 0 alone, the union broadcast from there. On
    # NCCL both go through torch.cuda.current_device(), as _same_everywhere's all-reduce and
    # every object collective of the engine (each rank's device, set with its process group).
    found = (scalars, sorted(stateful), sorted(names))
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(found, gathered, dst=0)
    union: list[Any] = [found]  # as in the fast path, each rank's own until rank 0's arrives
    if gathered is not None:
        merged: list[dict[str, Any]] = [{} for _ in scalars]
        all_stateful: set[str] = set()
        all_names: set[str] = set()
        for rank_scalars, rank_stateful, rank_names in gathered:
            for mine, theirs in zip(merged, rank_scalars, strict=True):
                for key, value in theirs.items():
                    mine.setdefault(key, value)
            all_stateful |= set(rank_stateful)
            all_names |= set(rank_names)
        union[0] = (merged, sorted(all_stateful), sorted(all_names))
    dist.broadcast_object_list(union, src=0)
    agreed_scalars, agreed_stateful, agreed_names = union[0]
    return agreed_scalars, set(agreed_stateful), set(agreed_names)


def _same_everywhere(scalars: list[dict[str, Any]], stateful: set[str], names: set[str]) -> bool:
    """Collective: whether every rank found the same keys (its digest's lowest and highest over
    the ranks agree)."""
    import hashlib

    import torch.distributed as dist

    keys = ([sorted(found) for found in scalars], sorted(stateful), sorted(names))
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=7).digest()
    value = int.from_bytes(digest, "big")
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    bounds = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    return int(bounds[0]) == value and int(bounds[1]) == -value


def _fill_partial_keys(
    state: dict[str, Any],
    id_map: Mapping[int, Any],
    params: list[torch.nn.Parameter],
    stateful: set[str],
    names: set[str],
) -> None:
    """Give zero state to stateless parameters that share a checkpoint tensor with stateful ones.

    Megatron-Core stores the layers of a stack as one tensor (``decoder.layers.<name>``, one slice
    per layer, spread over pipeline stages), so the optimizer state of a parameter is a slice of
    a tensor too. When some layers are frozen and others train, that tensor would miss the
    frozen layers' slices and the save would fail. Those slices are written as zeros; which
    parameters had no state is recorded per rank (:func:`stateless_params`) and restored on
    load. ``stateful`` and ``names`` are every rank's (see :func:`_agree`). Parameters frozen in
    every layer (a LoRA base) get nothing.
    """
    for pid, sharded in id_map.items():
        if pid not in state["state"] and sharded.key in stateful:
            # Moments have their parameter's shape and dtype (torch's optimizers).
            state["state"][pid] = {name: torch.zeros_like(params[pid]) for name in sorted(names)}


def stateless_params(optimizer: torch.optim.Optimizer) -> list[int]:
    """Positions (in ``param_groups`` order) of the parameters without optimizer state."""
    return [i for i, p in enumerate(_params(optimizer)) if not optimizer.state.get(p)]


def drop_state(optimizer: torch.optim.Optimizer, positions: list[int]) -> None:
    """Remove the state of the parameters at ``positions`` (as :func:`stateless_params`)."""
    params = _params(optimizer)
    for i in positions:
        if i < len(params):
            optimizer.state.pop(params[i], None)


def load_sharded(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Load a state produced by ``dist_checkpointing.load`` of :func:`sharded_state_dict`."""
    for key in [k for k in loaded["state"] if isinstance(k, str) and k.startswith(_OUTSIDE)]:
        del loaded["state"][key]  # slices of parameters no optimizer holds
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
            if pid not in template:  # no state was saved for it (frozen, or never stepped)
                continue
            param_state = loaded["state"].setdefault(pid, {})
            for key, value in scalars.items():
                like = template[pid].get(key)
                param_state[key] = (
                    torch.tensor(value, dtype=like.dtype, device=like.device)
                    if isinstance(like, torch.Tensor)
                    else value
                )
    optimizer.load_state_dict(loaded)


@contextlib.contextmanager
def loading_distributed_optimizers(optimizers: Sequence[Any]) -> Iterator[None]:
    """Around ``load_state_dict`` of Megatron-Core optimizers holding ``DistributedOptimizer``s
    (``optimizers``): what their torch-Adam path (no Apex or Transformer Engine) needs.

    * Their fp32 main parameters are views of the model's parameters (leaves that need a
      gradient): the state is copied in under ``torch.no_grad()``.
    * A fully reshardable state holds no per-parameter ``step``, which their setter expects of
      torch Adam's state: it is given the current one to copy (the count comes from the groups).
    * Afterwards, :func:`restore_steps_from_groups`.
    """
    for opt in optimizers:
        stock = opt._set_main_param_and_optimizer_states

        def setter(
            model_param: Any, tensors: dict[str, Any], _stock: Any = stock, _opt: Any = opt
        ) -> Any:
            if "step" not in tensors:
                # The count stays as it is (its own tensor copied onto itself).
                group, order = _opt.model_param_group_index_map[model_param]
                main_param = _opt.optimizer.param_groups[group]["params"][order]
                step = _opt.optimizer.state.get(main_param, {}).get("step")
                if step is not None:
                    tensors = {**tensors, "step": step}
            return _stock(model_param, tensors)

        opt._set_main_param_and_optimizer_states = setter
    try:
        with torch.no_grad():
            yield
    finally:
        for opt in optimizers:
            del opt._set_main_param_and_optimizer_states  # the class's method again
    for opt in optimizers:
        restore_steps_from_groups(opt.optimizer)


def restore_steps_from_groups(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter its own ``step`` again after Megatron-Core's distributed optimizer
    loaded torch Adam's state.

    Without Apex or Transformer Engine, Megatron's ``DistributedOptimizer`` steps a torch
    ``AdamW`` and saves its step count in the parameter groups (``group["step"]``). Its
    ``load_state_dict`` then gives every parameter the same ``step`` tensor, which each
    parameter's update increments (the count then grows by the number of parameters at every
    step, and bias correction is wrong), and the count it loads is not always the saved one.
    This sets each parameter's ``step`` to a tensor of its own holding the saved count, and
    removes the count from the groups, as an uninterrupted run has them. Optimizers that keep
    no per-parameter step (fused Adam) are left as they are.
    """
    for group in optimizer.param_groups:
        states = [
            optimizer.state[p] for p in group["params"] if "step" in optimizer.state.get(p, {})
        ]
        if "step" not in group or not states:
            continue  # e.g. Transformer Engine's FusedAdam: the group's count is its own
        count = float(group.pop("step"))
        for state in states:
            state["step"] = torch.tensor(count, dtype=torch.float32)
