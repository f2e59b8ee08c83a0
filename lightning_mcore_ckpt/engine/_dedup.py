"""Unchanged tensors written once (``MegatronStrategy(ckpt_dedup=True)``).

Frozen parameters (``requires_grad=False``: a frozen base, the base of a LoRA fine-tune) do not
change between saves, yet every save would write them again. With dedup, our shard writer:

- writes the tensors of frozen parameters into files of the run directory's ``shared/`` store
  (``<dirpath>/shared/<step>-<part>-<file>``), not into the step; the step's dist-checkpoint
  index points at them (``../../shared/...``: torch DCP's readers, ours, Megatron-Core's and
  the Hugging Face export all follow such a path);
- at a later save (and at the first save after a load of a step that points at ``shared/``),
  hashes each such tensor's bytes (XXH3-128, faster than a memory copy) and,
  when they are the bytes already in ``shared/``, writes nothing: the new index points at the
  same place. A frozen tensor that did change (a ``.data`` write, a layer unfrozen) is written
  again. Trainable tensors and the optimizer state are written into the step as always.

What a step references is recorded in its ``metadata.json`` (``files`` and ``hashes`` list each
``../shared/...`` file with its size and digest): the step stays self-describing, ``fsck``
checks those files too, and retention deletes a shared file only once no step references it
(:func:`lightning_mcore_ckpt.format.retention.collect_shared`). Reuse is decided per rank and per
tensor from what this process saved or loaded before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.layout import SHARED_DIR

__all__ = ["Dedup", "frozen_storages"]


def frozen_storages(module: torch.nn.Module) -> set[int]:
    """The storages of ``module``'s frozen parameters (the candidates for reuse)."""
    return {
        p.untyped_storage().data_ptr()
        for p in module.parameters()
        if not p.requires_grad and p.device.type in ("cpu", "cuda")
    }


def _data_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor's bytes in memory, with its dtype (whatever view of them)."""
    hasher = integrity._new()
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.numel():
        hasher.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return f"{integrity.ALGORITHM}:{hasher.hexdigest()}:{data.dtype}:{data.numel()}"


@dataclasses.dataclass
class _Entry:
    """A tensor in ``shared/``: where it is and what it holds."""

    result: Any
    """Its write result (index, size, storage: the ``../../shared/...`` path and offset)."""
    data: str
    """The digest of its bytes in memory (with its dtype and element count)."""
    file: str
    """Its file, relative to a step (``../shared/<name>``)."""


class Dedup:
    """One rank's record of the frozen tensors in ``shared/``, kept from save to save."""

    def __init__(self) -> None:
        self.frozen: set[int] = set()
        """Storages of frozen parameters at the save being planned (set by the writer)."""
        self._kept: dict[tuple[str, str, Any], _Entry] = {}
        self._staged: dict[tuple[str, str, Any], _Entry] = {}
        self._file_digests: dict[str, str] = {}
        self._pending: dict[str, list[tuple[tuple[str, str, Any], str]]] = {}
        self.reused_bytes = 0
        """Bytes the last save did not write (referenced instead)."""

    def split(
        self, name: str, step: Path, buckets: Sequence[Any], pool: Any = None
    ) -> tuple[list[Any], list[int], dict[int, list[Any]]]:
        """This save's files of part ``name``: the buckets to write (the step's own, then new
        shared ones), the original bucket each comes from, and the reused write results of each
        original bucket. ``pool`` (an executor) hashes the frozen tensors in parallel (XXH3
        releases the GIL)."""
        shared = (step.parent / SHARED_DIR).resolve()
        frozen = [
            tensor
            for _f, _k, (_b, tensor_data) in buckets
            for _item, tensor in tensor_data
            if tensor.untyped_storage().data_ptr() in self.frozen
        ]
        digests = iter(list((pool.map if pool is not None else map)(_data_digest, frozen)))
        own: list[Any] = []
        extra: list[Any] = []
        origin_own: list[int] = []
        origin_extra: list[int] = []
        reused: dict[int, list[Any]] = {}
        if name == "model":
            self.reused_bytes = 0
        for index, (file_name, storage_key, (bytes_data, tensor_data)) in enumerate(buckets):
            keep, fresh = [], []
            for item, tensor in tensor_data:
                if tensor.untyped_storage().data_ptr() not in self.frozen:
                    keep.append((item, tensor))
                    continue
                chunk = item.tensor_data.chunk
                place = (item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
                key = (str(shared), name, place)
                digest = next(digests)
                entry = self._kept.get(key)
                if entry is not None and entry.data == digest:
                    reused.setdefault(index, []).append(entry.result)
                    self._staged[key] = entry
                    self.reused_bytes += tensor.numel() * tensor.element_size()
                else:
                    fresh.append((item, tensor, key, digest))
            own.append((file_name, storage_key, (bytes_data, keep)))
            origin_own.append(index)
            if fresh:
                shared.mkdir(exist_ok=True)
                file = f"{step.name}-{name}-{storage_key}"
                self._pending[file] = [(key, digest) for _, _, key, digest in fresh]
                extra.append(
                    (
                        shared / file,
                        f"../../{SHARED_DIR}/{file}",
                        ([], [(item, tensor) for item, tensor, _, _ in fresh]),
                    )
                )
                origin_extra.append(index)
        return own + extra, origin_own + origin_extra, reused

    def begin(self) -> None:
        """A save starts: nothing staged yet."""
        self._staged = {}
        self._pending = {}

    def written(self, results: Iterable[Any], shared: Path) -> None:
        """The write results of this save's files; the new shared files' digests are taken
        from what the writer threads recorded."""
        file_digests = integrity.take(shared)
        by_index = {(r.index.fqn, tuple(r.index.offset or ())): r for r in results}
        for file, entries in self._pending.items():
            digest = file_digests.get(file)
            if digest is None:
                continue
            self._file_digests[f"../{SHARED_DIR}/{file}"] = digest
            for key, data in entries:
                result = by_index.get(key[2][:2])
                if result is not None:
                    self._staged[key] = _Entry(result, data, f"../{SHARED_DIR}/{file}")

    def references(self) -> dict[str, str]:
        """The shared files this save's steps point at, by path relative to the step, with
        their digests."""
        return {e.file: self._file_digests[e.file] for e in self._staged.values()}

    def saved(self) -> None:
        """The save committed on every rank: what it references is what the next one reuses."""
        self._kept, self._staged = self._staged, {}

    def seed(self, step: Path, model_sharded_state_dict: Any, frozen: set[int]) -> int:
        """After a load of ``step``: its frozen tensors that live in ``shared/`` (just loaded,
        so their bytes are the stored ones) are what the next save may point at. Returns how
        many tensors were recorded."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
        from torch.distributed.checkpoint.storage import WriteResult

        from lightning_mcore_ckpt.format import layout, markers
        from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp

        digests = (markers.read_metadata(step) or {}).get("hashes") or {}
        index = _safe_dcp.read_dcp_metadata(step / layout.MODEL_DIR)
        stored = {(k.fqn, tuple(k.offset or ())): (k, v) for k, v in index.storage_data.items()}
        sizes = {
            (key, tuple(c.offsets)): tuple(c.sizes)
            for key, md in index.state_dict_metadata.items()
            for c in getattr(md, "chunks", ())
        }
        shared = str((step.parent / SHARED_DIR).resolve())
        apply_factories(model_sharded_state_dict)
        seeded = 0
        for sh in nested_values(model_sharded_state_dict):
            if not isinstance(sh, ShardedTensor) or sh.data is None:
                continue
            if sh.data.untyped_storage().data_ptr() not in frozen:
                continue
            where = (sh.key, tuple(sh.global_offset))
            # The stored chunk must be this rank's piece exactly (another layout saved it
            # otherwise: its pieces are other ones).
            local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            if sizes.get(where) != local:
                continue
            found = stored.get(where)
            file = found[1].relative_path[3:] if found else ""  # ../../shared/x -> ../shared/x
            if not file.startswith(f"../{SHARED_DIR}/") or file not in digests:
                continue
            index_key, info = found  # type: ignore[misc]
            result = WriteResult(index=index_key, size_in_bytes=info.length, storage_data=info)
            place = (*where, local)
            self._kept[(shared, "model", place)] = _Entry(result, _data_digest(sh.data), file)
            self._file_digests[file] = digests[file]
            seeded += 1
        return seeded

    def forget(self) -> None:
        """The save failed: the next one reuses what the last committed save referenced."""
        self._staged = {}
