"""Reading a dist-checkpoint slice by slice (one layer of one tensor), without a process group.

:class:`SliceReader` lists the tensors of a step's model directory and loads chosen slices
into fresh buffers through ``torch.distributed.checkpoint`` with :class:`SlicePlanner`, so no
process ever holds more of the model than it asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_mcore_ckpt.hf._names import (
    EMBEDDING,
    EXPERTS,
    LAYERS,
    expert_name,
    hybrid_layer_pattern,
)
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import remote_files

__all__ = ["Slice", "SlicePlanner", "SliceReader", "module_prefix"]


@dataclasses.dataclass(frozen=True)
class Slice:
    """One tensor, one layer of a layer-stacked tensor, or one expert of one layer of an MoE
    expert weight, of a dist-checkpoint."""

    key: str
    """The checkpoint key (module prefix included)."""
    layer: int | None
    """Index on the stacked layer axis, or None for an unstacked tensor."""
    shape: tuple[int, ...]
    """Shape of the slice (without the layer and expert axes)."""
    dtype: torch.dtype
    expert: int | None = None
    """Index on the expert axis (after the layer axis) of a routed expert's weight, or None."""


class SliceReader:
    """Reads the tensors of one dist-checkpoint directory (``model/``) on one process."""

    def __init__(self, model_dir: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

        class IndexReadOnce(FileSystemReader):
            # dcp.load reads the index at every call; an export makes one call per tensor. It is
            # read without running code from it (torch's own read is a plain pickle.load), and
            # SlicePlanner refuses every non-tensor object, so an export unpickles nothing.
            _index: Any = None

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if self._index is None:
                    trusted = _safe_load.trusted_by_user()
                    index = _safe_dcp.read_dcp_metadata(self.path, trusted=trusted)
                    if getattr(index, "storage_meta", None) is None:
                        index.storage_meta = StorageMeta()
                    index.storage_meta.load_id = self.load_id
                    self._index = index
                return self._index

        self.dir = model_dir
        self.reader = IndexReadOnce(str(model_dir))
        self.reader.fs = remote_files.routed_filesystem()  # a view of a step in an object store
        metadata = self.reader.read_metadata()
        self.tensors = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }

    def slices(self, prefix: str) -> list[tuple[str, Slice]]:
        """``(mcore_name, slice)`` for every tensor under ``prefix``: one per layer if stacked,
        one per layer and expert for routed experts (named as mbridge names them)."""
        out = []
        for key, md in self.tensors.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            shape = tuple(md.size)
            dtype = md.properties.dtype
            if name.startswith(LAYERS):
                rest = name[len(LAYERS) :]
                for layer in range(shape[0]):
                    layer_name = f"{LAYERS}{layer}.{rest}"
                    if not rest.startswith(EXPERTS):
                        out.append((layer_name, Slice(key, layer, shape[1:], dtype)))
                        continue
                    for expert in range(shape[1]):
                        piece = Slice(key, layer, shape[2:], dtype, expert)
                        out.append((expert_name(layer_name, expert), piece))
            else:
                out.append((name, Slice(key, None, shape, dtype)))
        return out

    def read(self, wanted: Mapping[str, Slice]) -> dict[str, torch.Tensor]:
        """Load the given slices (``{request id: slice}``) in one pass over the files."""
        import torch.distributed.checkpoint as dcp

        if not wanted:
            return {}
        out = {rid: torch.empty(s.shape, dtype=s.dtype) for rid, s in wanted.items()}
        planner = SlicePlanner({rid: (s, out[rid]) for rid, s in wanted.items()})
        dcp.load({}, storage_reader=self.reader, planner=planner, no_dist=True)
        return out


class SlicePlanner(LoadPlanner):
    """Load slices of checkpoint tensors into given buffers, with or without a process group."""

    def __init__(self, requests: Mapping[str, tuple[Slice, torch.Tensor]]) -> None:
        self.requests = dict(requests)

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for rid, (piece, _) in self.requests.items():
            md = self.metadata.state_dict_metadata[piece.key]
            axes = _stacked(piece)
            offsets = [*axes, *([0] * len(piece.shape))]
            sizes = [*([1] * len(axes)), *piece.shape]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            for item in create_read_items_for_chunk_list(piece.key, md, [chunk]):
                # Requests are keyed by id: one checkpoint key may be read for several layers.
                index = MetadataIndex(rid, item.dest_index.offset, item.dest_index.index)
                items.append(dataclasses.replace(item, dest_index=index))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise RuntimeError(f"unexpected non-tensor read of {read_item.storage_index}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece, dest = self.requests[read_item.dest_index.fqn]
        view = dest.view(*([1] * len(_stacked(piece))), *dest.shape)
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None


def _stacked(piece: Slice) -> list[int]:
    """The slice's indices on the stacked axes (layer, then expert) it is read from."""
    return [i for i in (piece.layer, piece.expert) if i is not None]


def module_prefix(keys: Iterable[str], source: Path) -> str:
    """The key prefix of the one GPT model in a checkpoint (``"model."``), found by its embedding."""
    prefixes = sorted({k[: -len(EMBEDDING)] for k in keys if k.endswith(EMBEDDING)})
    if len(prefixes) != 1:
        found = "no" if not prefixes else f"{len(prefixes)} ({', '.join(prefixes)})"
        raise ValueError(
            f"{source}: found {found} GPT embedding tensors (*{EMBEDDING}); the Hugging Face "
            "bridge converts a checkpoint of exactly one Megatron-Core GPT model"
        )
    refuse_hybrid(keys, prefixes[0], source)
    return prefixes[0]


def refuse_hybrid(keys: Iterable[str], prefix: str, source: Any) -> None:
    """Refuse, before any tensor is read, a hybrid model (``HybridModel``): mbridge maps none."""
    pattern = hybrid_layer_pattern(k[len(prefix) :] for k in keys if k.startswith(prefix))
    if pattern is None:
        return
    from lightning_mcore_ckpt.hf._bridge import supported_model_types

    raise ValueError(
        f"{source}: its model ({prefix!r}) is a Megatron-Core HybridModel (layers {pattern!r}, "
        "saved one by one), and the Hugging Face conversion goes through mbridge, which maps "
        "no hybrid architecture: it converts GPTModel checkpoints of the model types "
        f"{', '.join(supported_model_types())}. The step itself resumes and reshards, and "
        "`inspect` and `diff` read it; for a Hugging Face model, train a GPTModel of one of "
        "those families"
    )
