"""Reading a torch_dist (``torch.distributed.checkpoint``) directory without running code from it.

Its ``.metadata`` index is a plain pickle that torch reads with ``pickle.load``:
:func:`read_dcp_metadata` reads it with an unpickler that resolves only what such an index is
made of. The non-tensor objects inside its shard files (``torch.save`` bytes that torch unpickles
with ``weights_only=False`` while Megatron-Core loads) and megatron-core 0.16's ``common.pt`` are
scanned, without unpickling them, by :func:`check_dist_checkpoint` (see ``_safe_load``).

Imports nothing from the package but ``_safe_load`` (``layout`` reads indexes through it).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import pickle
from pathlib import Path
from typing import IO, Any

from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import remote_files

__all__ = ["COMMON_FILE", "check_dist_checkpoint", "read_dcp_metadata"]

COMMON_FILE = "common.pt"
"""Megatron-Core 0.16's common (non-sharded) state of a torch_dist directory."""

# What a torch.distributed.checkpoint index is made of: its dataclasses and enums (plain data,
# wherever they are defined in these modules), torch.Size, dtypes and the layout helper.
_DCP_MODULES = frozenset(
    f"torch.distributed.checkpoint.{name}" for name in ("metadata", "planner", "filesystem")
)
_INDEX_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _IndexUnpickler(pickle.Unpickler):
    """Resolves only what a torch.distributed.checkpoint ``.metadata`` index is made of."""

    refused: list[str]

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _INDEX_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if (
                isinstance(found, type)
                and found.__module__ == module
                and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
            ):
                return found
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in an index")


def read_dcp_metadata(directory: str | os.PathLike[str], *, trusted: bool = False) -> Any:
    """A torch_dist directory's ``.metadata`` index, read without running code from it.

    Raises ``UnsafeCheckpointError`` when it names anything else than what such an index is
    made of; any other error when it is missing or garbled, as ``FileSystemReader`` would. With
    ``trusted``, read as torch reads it (a plain ``pickle.load``).
    """
    index = Path(directory) / ".metadata"
    with open(index, "rb") as f:
        if trusted:
            return pickle.load(f)
        unpickler = _IndexUnpickler(f)
        unpickler.refused = []
        try:
            metadata = unpickler.load()
        except pickle.UnpicklingError as err:
            if not unpickler.refused:
                raise
            raise _safe_load.UnsafeCheckpointError(
                f"refusing to load {index}: this torch.distributed.checkpoint index names "
                f"{', '.join(unpickler.refused)}, which is not part of such an index (its "
                "metadata classes, torch.Size, dtypes), so unpickling it could run code. Nothing "
                "of it was unpickled. A checkpoint written by a newer torch may need a newer "
                f"lightning-mcore-ckpt. {_safe_load.TRUST_ALL}. See {_safe_load.SECURITY_DOC}"
            ) from err
    return metadata


class _Window(remote_files.SeekableReader):
    """A read-only view of ``length`` bytes at ``offset`` of an open file."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        super().__init__(length)
        self._f, self._start = f, offset

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        data = self._f.read(size)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def check_dist_checkpoint(directory: str | os.PathLike[str]) -> None:
    """Refuse a torch_dist directory that loading would run code from (reads no tensor).

    Checks the index, every non-tensor object in the shard files (torch.distributed.checkpoint
    unpickles them with ``weights_only=False``) and ``common.pt`` when there is one. Raises
    ``UnsafeCheckpointError`` naming the first file, its keys and globals.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = Path(directory)
    metadata = read_dcp_metadata(root)
    objects = {
        key
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, BytesStorageMetadata)
    }
    refused: dict[str, list[str]] = {}
    for index, info in sorted(
        (metadata.storage_data or {}).items(), key=lambda item: str(item[0].fqn)
    ):
        if index.fqn not in objects:
            continue
        where = f"{root / info.relative_path} (object {index.fqn!r})"
        if getattr(info, "transform_descriptors", None):
            raise _safe_load.refuse(
                where,
                [],
                f"it is stored through transforms {list(info.transform_descriptors)}, which "
                "lightning-mcore-ckpt cannot check before they are unpickled",
            )
        with remote_files.open_read(root / info.relative_path) as f:  # local, or a view's
            unsafe = _safe_load.scan(_Window(f, int(info.offset), int(info.length)), where)  # type: ignore[arg-type]
        if unsafe:
            refused[index.fqn] = unsafe
    if refused:
        keys = ", ".join(f"{k!r} ({', '.join(g)})" for k, g in sorted(refused.items())[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        everything = sorted({g for found in refused.values() for g in found})
        raise _safe_load.refuse(
            f"{root}",
            everything,
            f"its objects {keys}{more} would import globals that the weights_only allowlist "
            "does not hold, so unpickling them could run code",
        )
    common = root / COMMON_FILE
    if common.is_file():
        unsafe = _safe_load.scan(str(common), str(common))
        if unsafe:
            raise _safe_load.refuse(str(common), unsafe)
