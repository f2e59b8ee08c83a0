"""One rank's whole training state in one file: the format of the node-local fast tier.

A step of the persistent tier is Megatron-Core's ``torch_dist`` format: each tensor written once,
by one of the ranks that hold it, and read back by any rank in any layout. That needs every
rank's files to load any one rank. A fast-tier step is read back by the same ranks, in the
same layout, from their own node (or the peer node that holds a copy): each rank's file must
hold *everything that rank loads*, replicated tensors included. This is what Megatron-Core's
``MCoreTensorAwareStateDict`` holds with its ``"atomic"`` algorithm (Megatron-LM's local
checkpoints); it is built here from the same Megatron-Core steps (``save_preprocess``: the
factories applied, the common state split off; ``load_preprocess`` and ``apply_factory_merges``
on the way back), without the NVIDIA Resiliency Extension that class needs.

The payload: per state dict (``"model"``, ``"optimizers"``), its common state and every
``ShardedTensor``'s and ``ShardedObject``'s local data keyed by its shard id. Tensors are
copied to host memory by :func:`stage` (the only part an async save blocks on) and written by
:func:`write` (``torch.save``, hashed on the way to the file).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import IO, Any, cast

import torch

from lightning_mcore_ckpt.engine._state_dicts import (
    TrainingState,
    distributed_optimizers,
    megatron_optimizer_metadata,
    optimizer_sharded_state_dict,
    to_module_keys,
)
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import atomic as _atomic
from lightning_mcore_ckpt.training import optim as _optim

__all__ = [
    "RANK_STATE_VERSION",
    "NotInRankState",
    "StagingCache",
    "load",
    "read",
    "stage",
    "state_name",
    "write",
]

RANK_STATE_VERSION = 2
"""The format of a rank's state file; a reader refuses a newer one. 2: a distributed optimizer's
state held as :data:`SHARDING` says, and named in the file (1: as the run's persistent tier
saved it)."""

SHARDING = "dp_reshardable"
"""How a rank's file holds a distributed optimizer's state: this rank's own shard of each
buffer, as the optimizer holds it (Megatron-Core's ``dp_reshardable``). Its save gathers
nothing and its load exchanges nothing, and each rank's file holds what that rank loads. A
fully reshardable state would be gathered over the data-parallel ranks at every save, and a
load of it asks every rank for the whole of it: all of that for a reshard the fast tier never
does (it resumes the layout that saved it)."""


def state_name(rank: int) -> str:
    """The name of ``rank``'s state file in a fast-tier step directory."""
    return f"state_{rank:05d}.pt"


class NotInRankState(KeyError):
    """A tensor or object a load asks for that the rank's state file does not hold."""


CreateState = Callable[[torch.optim.Optimizer, Mapping[str, Any] | None, set[str] | None], None]
"""Makes an optimizer's state for a load to overwrite whole: ``(optimizer, the model's sharded
state dict, the saved state keys)``, the last two ``None`` for a distributed optimizer's."""


class StagingCache:
    """Host buffers reused by every fast save of a run: a tensor is copied into the buffer
    the previous save used for it (pinned host memory for device tensors), so a save
    allocates nothing once the run's first save has."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in host memory that training will not change."""
        source = tensor.detach()
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.shape != source.shape
            or buffer.dtype != source.dtype
            or buffer.layout != source.layout
        ):
            pinned = source.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
            self._buffers[name] = buffer
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer

    @property
    def nbytes(self) -> int:
        """Host bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _shard_ids() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    from megatron.core.dist_checkpointing.utils import (
        _sharded_object_id,
        _sharded_tensor_shard_id,
    )

    return _sharded_tensor_shard_id, _sharded_object_id


def _part(sharded_state_dict: dict[str, Any], prefix: str, cache: StagingCache) -> dict[str, Any]:
    """One sharded state dict, whole on this rank: common state, tensors and objects."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    tensor_id, object_id = _shard_ids()
    sharded, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    keys: set[str] = set()
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor):
            name = repr(tensor_id(item))
            tensors[name] = cache.copy(f"{prefix}/{name}", item.data)
            keys.add(item.key)
        else:
            objects[repr(object_id(item))] = _host_copy(item.data)
    return {
        "common": _host_copy(common),
        "tensors": tensors,
        "objects": objects,
        "keys": sorted(keys),
    }


def _host_copy(value: Any) -> Any:
    """A copy of ``value`` training cannot change, its tensors in host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_host_copy(v) for v in value]
        return items if isinstance(value, list) else type(value)(items)
    return copy.deepcopy(value)


def stage(state: TrainingState, cache: StagingCache) -> dict[str, Any]:
    """This rank's model and optimizer state, copied to host memory: the payload to write.
    Called on every rank together: a torch optimizer's state keys are agreed over the ranks,
    as for the persistent tier."""
    metadata = megatron_optimizer_metadata(SHARDING)
    optimizers = optimizer_sharded_state_dict(
        state.optimizers, state.module, state.model_sharded_state_dict(), False, metadata
    )
    payload = {
        "version": RANK_STATE_VERSION,
        "rank": state.rank,
        "parallel_layout": state.parallel_layout,
        "optimizer_sharding": SHARDING,
        "model": _part(state.model_sharded_state_dict(), "model", cache),
        "optimizers": _part(optimizers, "optimizers", cache),
    }
    if state.device.type == "cuda":
        torch.cuda.synchronize()  # the copies into pinned buffers are done
    return payload


def write(path: Any, payload: dict[str, Any]) -> tuple[int, str]:
    """Write ``payload`` to ``path`` durably and atomically; its size and digest."""
    written: list[tuple[int, str]] = []

    def save(f: IO[bytes]) -> None:
        hashed = integrity.HashingWriter(f)
        torch.save(payload, cast(IO[bytes], hashed))
        written.append((hashed.tell(), hashed.digest))

    _atomic.write_with(path, save)
    return written[-1]


def read(path: Any, *, trusted: bool = False, data: Any = None) -> dict[str, Any]:
    """A rank's state file, checked before it is unpickled (unless ``trusted``); ``data``: its
    bytes, already read (loaded from memory: its tensors are views of ``data``, not copies; the
    load copies each into the tensor it restores, :func:`load`)."""
    payload = cast(
        "dict[str, Any]",
        _safe_load.load_torch_file(path, trusted=trusted, data=data, share=data is not None),
    )
    version = payload.get("version")
    if not isinstance(version, int) or version > RANK_STATE_VERSION:
        raise ValueError(
            f"{path} is a rank state in format {version!r}; this lightning-mcore-ckpt reads "
            f"format {RANK_STATE_VERSION} and older. Upgrade lightning-mcore-ckpt to load it"
        )
    return payload


def _restore(template: dict[str, Any], part: dict[str, Any], device: torch.device) -> Any:
    """``template`` (a sharded state dict to load into) filled from ``part``: what
    Megatron-Core's ``dist_checkpointing.load`` returns for it."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        merge,
        nested_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factory_merges,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    tensor_id, object_id = _shard_ids()
    sharded, nonpersistent, factories = load_preprocess(template)
    sharded, _ = extract_sharded_base(sharded)
    tensors, objects = part["tensors"], part["objects"]

    def found(item: Any) -> Any:
        if isinstance(item, ShardedTensor):
            name = repr(tensor_id(item))
            if name not in tensors:
                raise NotInRankState(f"the rank state has no tensor {item.key!r} (shard {name})")
            return tensors[name]
        name = repr(object_id(item))
        if name not in objects:
            raise NotInRankState(f"the rank state has no object {item.key!r} ({name})")
        return objects[name]

    # Every item found before any is loaded: a rank state that lacks one changes nothing.
    for item in nested_values(sharded):
        if isinstance(item, (ShardedTensor, ShardedObject)):
            found(item)

    def value(item: Any) -> Any:
        if isinstance(item, ShardedTensor):
            return _into(item.data, found(item), device)
        if isinstance(item, ShardedObject):
            return _host_copy(found(item))  # its own: nothing of the payload is kept
        return item

    with torch.no_grad():  # a parameter is a leaf that requires a gradient
        dict_list_map_inplace(value, sharded)
    sharded = apply_factory_merges(sharded, factories)
    result = copy.deepcopy(part["common"])
    merge(result, nonpersistent)
    merge(result, sharded)
    return result


def _into(target: Any, saved: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``saved`` loaded into ``target``, the template's tensor, in place, as Megatron-Core's
    ``dist_checkpointing.load`` loads a ``ShardedTensor`` (one copy, into memory the model or
    the optimizer already holds); where ``target`` cannot take it as it is (none, another
    shape or dtype), a copy of ``saved`` of its own on ``target``'s device. Either way nothing
    of ``saved`` (a view of the file's bytes, :func:`read`) is kept."""
    if (
        isinstance(target, torch.Tensor)
        and type(target) in (torch.Tensor, torch.nn.Parameter)
        and target.device.type != "meta"
        and target.shape == saved.shape
        and target.dtype == saved.dtype
    ):
        if not _copy_bytes(target, saved):
            target.copy_(saved)
        return target
    where = target.device if isinstance(target, torch.Tensor) else device
    return saved.to(where, copy=True)


def _copy_bytes(target: torch.Tensor, saved: torch.Tensor) -> bool:
    """Copy ``saved`` into ``target``, both dense and contiguous in host memory, as one
    ``memcpy`` on this thread; ``False`` (nothing done) for any other pair.

    ``Tensor.copy_`` splits a large copy over torch's intra-op threads: where the ranks of a
    machine run more of those than it has free cores (2 ranks of 2 threads on 2 cores), each
    split copy waits for a thread that is not running, and a 42 MiB copy took 0.05-2 s instead
    of 3 ms (measured, 2-CPU VM). A load's copies are memory-bound: one thread moves them at
    memory speed and waits for no other."""
    if (
        target.device.type != "cpu"
        or saved.device.type != "cpu"
        or target.layout != torch.strided
        or saved.layout != torch.strided
        or target.is_quantized
        or saved.is_quantized
        or not target.numel()
        or not target.is_contiguous()
        or not saved.is_contiguous()
        or target.is_conj()
        or saved.is_conj()
        or target.is_neg()
        or saved.is_neg()
    ):
        return False
    into = target.detach().reshape(-1).view(torch.uint8).numpy()
    into[...] = saved.detach().reshape(-1).view(torch.uint8).numpy()
    return True


def load(
    payload: dict[str, Any],
    state: TrainingState,
    stateless: list[list[int]] | None,
    create_state: CreateState,
) -> None:
    """Load a rank's state into ``state``'s model and optimizers (local: no collective). The
    layout must be the one that saved it; ``stateless``: the saving rank's record of the
    parameters that had no optimizer state (``extra/``).

    The optimizers' state is made for the load to overwrite whole, as the persistent tier's
    load makes it (uninitialised where it can be; for a torch optimizer, for exactly the
    parameters whose state the file holds), by ``create_state`` (the reader's, which empties it
    again if the load fails). Its template agrees nothing over the ranks: each rank's file
    holds what the agreement gave it at save. :class:`NotInRankState`: the file lacks
    something this load asks for."""
    from megatron.core.optimizer import MegatronOptimizer

    if payload.get("parallel_layout") != state.parallel_layout:
        raise ValueError(
            f"rank {state.rank}'s fast-tier state was saved in layout "
            f"{payload.get('parallel_layout')}, not this run's {state.parallel_layout}: a "
            "fast-tier step resumes only the layout that saved it"
        )
    model = _restore(state.model_sharded_state_dict(), payload["model"], state.device)
    state.module.load_state_dict(to_module_keys(state.module, model), strict=state.strict)
    model_ssd = state.model_sharded_state_dict()
    saved_keys = set(payload["optimizers"]["keys"])
    for opt in state.optimizers:
        if not isinstance(opt, MegatronOptimizer):
            create_state(opt, model_ssd, saved_keys)
    for dist_opt in distributed_optimizers(state.optimizers):
        # Megatron reads the state's step count before loading into it, and then copies every
        # element of each moment: its state as a step makes it, not zeroed.
        if not dist_opt.optimizer.state:
            create_state(dist_opt.optimizer, None, None)
    # A file of format 1 holds it as the run's persistent tier saved it.
    metadata = megatron_optimizer_metadata(
        payload.get("optimizer_sharding", state.optimizer_sharding)
    )
    template = optimizer_sharded_state_dict(
        state.optimizers, state.module, model_ssd, True, metadata, load_template=True
    )
    loaded = _restore(template, payload["optimizers"], state.device)
    apply_optimizer_state(state, loaded, stateless)


def apply_optimizer_state(
    state: TrainingState, loaded: dict[str, Any], stateless: list[list[int]] | None
) -> None:
    """Load ``loaded`` (``optimizer_<i>`` each, as a sharded load returns it) into the
    optimizers; ``stateless``: the parameters saved without state, dropped again."""
    from megatron.core.optimizer import MegatronOptimizer

    for idx, opt in enumerate(state.optimizers):
        if isinstance(opt, MegatronOptimizer):
            with _optim.loading_distributed_optimizers(distributed_optimizers([opt])):
                opt.load_state_dict(loaded[f"optimizer_{idx}"])
        else:
            _optim.load_sharded(opt, loaded[f"optimizer_{idx}"])
            if stateless is not None and idx < len(stateless):
                # Slices saved as zeros only to complete a stacked tensor: no state again.
                _optim.drop_state(opt, stateless[idx])
