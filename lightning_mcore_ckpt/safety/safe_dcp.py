"""Reading a torch_dist (``torch.distributed.checkpoint``) directory without running code from it.

Its ``.metadata`` index is a plain pickle that torch reads with ``pickle.load``:
:func:`read_dcp_metadata` reads it with an unpickler that resolves only what such an index is
made of. The non-tensor objects inside its shard files (``torch.save`` bytes that torch unpickles
with ``weights_only=False`` while Megatron-Core loads) and megatron-core 0.16's ``common.pt`` are
scanned, without unpickling them, by :func:`check_dist_checkpoint` (see ``_safe_load``).

:func:`index_extents` reads what an index references without torch (each name it holds made
inert data): how ``ls``, ``report`` and ``"last"`` check that a step's shards are whole, in the
time it takes to read the file.

Imports nothing from the package but ``_safe_load`` (``layout`` reads indexes through it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import importlib
import io
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from lightning_mcore_ckpt.safety import safe_load as _safe_load
from lightning_mcore_ckpt.storage import remote_files

__all__ = [
    "COMMON_FILE",
    "check_dist_checkpoint",
    "check_reads",
    "checked_readers",
    "index_extents",
    "indexes_kept",
    "read_dcp_metadata",
]

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


class _Inert:
    """An object of an index read without torch: the arguments it was made with and its state,
    as data (nothing of the class it names runs)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        if not all(p is None or isinstance(p, dict) for p in parts):  # a custom state
            self.__dict__["state"] = state
            return
        for part in parts:  # a __dict__, or (a __dict__, the slots)
            self.__dict__.update(part or {})


@functools.cache
def _inert(name: str) -> type[_Inert]:
    return type(name, (_Inert,), {})


_PLAIN = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")})


class _InertUnpickler(pickle.Unpickler):
    """Reads an index without torch: each name of torch's or of its checkpoint modules becomes
    an inert class (:class:`_Inert`); any other name is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module in ("torch", "torch.serialization") or module in _DCP_MODULES:
            return _inert(f"{module}.{name}")
        raise _safe_load.UnsafeCheckpointError(
            f"{module}.{name} is not part of a torch.distributed.checkpoint index"
        )


def index_extents(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The files a torch_dist directory's ``.metadata`` index references (relative to the
    directory), each with the bytes the index needs of it (its largest offset + length).

    Read without importing torch, and without running code from the file: every name the index
    holds is made inert data. Raises ``UnsafeCheckpointError`` when it names anything else
    than torch's or its checkpoint modules' (whether such a step may be loaded is decided when
    it is loaded), any other error when it is missing or garbled. During a load
    (:func:`indexes_kept`), which reads the index checked anyway, it is read checked (a name
    outside what an index is made of is refused the same way), and that read is the load's.

    Example::

        index_extents("checkpoints/run/global_step_100/model")
        # {"__0_0.distcp": 57666, "__0_1.distcp": 56405, ...}
    """
    index = Path(directory) / ".metadata"
    if _kept_indexes.get() is not None:  # in a load: the index it reads, checked, read once
        metadata = _checked_index(index, lambda: open(index, "rb"))
    else:
        with open(index, "rb") as f:
            try:
                metadata = _InertUnpickler(f).load()
            except _safe_load.UnsafeCheckpointError as err:
                raise _safe_load.UnsafeCheckpointError(f"{index}: {err}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def read_dcp_metadata(directory: str | os.PathLike[str], *, trusted: bool = False) -> Any:
    """A torch_dist directory's ``.metadata`` index, read without running code from it.

    Raises ``UnsafeCheckpointError`` when it names anything else than what such an index is
    made of; any other error when it is missing or garbled, as ``FileSystemReader`` would. With
    ``trusted``, read as torch reads it (a plain ``pickle.load``).
    """
    index = Path(directory) / ".metadata"
    if trusted:
        with open(index, "rb") as f:
            return pickle.load(f)
    return _checked_index(index, lambda: open(index, "rb"))


_kept_indexes: contextvars.ContextVar[dict[str, tuple[tuple[int, ...], Any]] | None] = (
    contextvars.ContextVar("lmc_kept_indexes", default=None)
)
"""The indexes read checked in this context, by path, each with its file's identity."""


@contextlib.contextmanager
def indexes_kept() -> Iterator[None]:
    """Meanwhile (one load), each local ``.metadata`` index read checked
    (:func:`read_dcp_metadata`, :func:`check_reads`) is unpickled once: a later read of it
    takes the object the first read checked, while the file is the one that was read (its
    device, inode, size and modification time; another file is read and checked afresh). A
    load reads each of its two indexes several times: our checks (objects, shapes, the
    optimizer's layout and keys), then Megatron-Core and torch DCP themselves. What is used is
    what was checked: the object itself, not the file read again. Trusted reads (a plain
    ``pickle.load``, the user's choice) are not kept."""
    token = _kept_indexes.set({})
    try:
        yield
    finally:
        _kept_indexes.reset(token)


def _identity(path: str | os.PathLike[str]) -> tuple[int, ...] | None:
    """A local file's device, inode, size and modification time; ``None``: not a local file
    (a view's file in an object store, or none)."""
    if remote_files.remote_size(path) is not None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


def _checked_index(path: str | os.PathLike[str], opener: Callable[[], IO[bytes]]) -> Any:
    """The index at ``path`` read with :func:`_load_index` (``opener`` opens it), or what a
    read of the same file made, where this context keeps them (:func:`indexes_kept`)."""
    kept = _kept_indexes.get()
    identity = _identity(path) if kept is not None else None
    found = kept.get(str(path)) if kept is not None and identity is not None else None
    if found is not None and found[0] == identity:
        return found[1]
    with opener() as f:
        metadata = _load_index(f, path)
    if kept is not None and identity is not None:
        kept[str(path)] = (identity, metadata)
    return metadata


def _load_index(f: IO[bytes], where: Any) -> Any:
    """The index pickled in ``f`` (named ``where`` in errors), with :class:`_IndexUnpickler`."""
    unpickler = _IndexUnpickler(f)
    unpickler.refused = []
    try:
        return unpickler.load()
    except pickle.UnpicklingError as err:
        if not unpickler.refused:
            raise
        raise _safe_load.UnsafeCheckpointError(
            f"refusing to load {where}: this torch.distributed.checkpoint index names "
            f"{', '.join(unpickler.refused)}, which is not part of such an index (its "
            "metadata classes, torch.Size, dtypes), so unpickling it could run code. Nothing "
            "of it was unpickled. A checkpoint written by a newer torch may need a newer "
            f"lightning-mcore-ckpt. {_safe_load.TRUST_ALL}. See {_safe_load.SECURITY_DOC}"
        ) from err


def check_reads(reader: Any, refused: list[BaseException] | None = None) -> Any:
    """``reader`` (a torch DCP ``FileSystemReader`` of a load, changed in place) unpickling
    only what it has checked, from the bytes it unpickles.

    :func:`check_dist_checkpoint` checks a directory before anything of it is loaded; a file
    replaced after that check would otherwise be unpickled unchecked (torch reads the index
    with ``pickle.load``, and unpickles each object record with ``weights_only=False``). Here
    the index is read with the unpickler of :func:`read_dcp_metadata`, and each object record is
    scanned (``_safe_load.scan``) from the bytes read, right before the planner unpickles them.
    A refusal raises ``UnsafeCheckpointError`` naming the file or record, and is appended to
    ``refused``: torch DCP turns an index it cannot read into an ``AssertionError``, and gathers
    the ranks' read errors into a ``CheckpointException``.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    read_data = reader.read_data
    verdicts = _Verdicts()

    def read_metadata(*args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if hasattr(reader, "_get_metadata_path"):  # torch 2.13: an index per rank, optionally
            path = reader._get_metadata_path(rank)
        else:
            path = reader.fs.concat_path(reader.path, ".metadata")
        with _kept_in(refused):
            metadata = _checked_index(path, lambda: reader.fs.create_stream(path, "rb"))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata

    def checked_data(plan: Any, planner: Any) -> Any:
        load_bytes = planner.load_bytes

        def load_checked(item: Any, value: Any) -> Any:
            where = f"{reader.path} (object {item.storage_index.fqn!r})"
            with _kept_in(refused):
                unsafe = verdicts.unsafe(value, value.getbuffer().nbytes, where)
                if unsafe:
                    raise _safe_load.refuse(where, unsafe)
            value.seek(0)
            return load_bytes(item, value)

        own = vars(planner).get("load_bytes")
        planner.load_bytes = load_checked
        try:
            return read_data(plan, planner)
        finally:
            if own is None:
                del planner.load_bytes
            else:
                planner.load_bytes = own

    reader.read_metadata = read_metadata
    reader.read_data = checked_data
    return reader


@contextlib.contextmanager
def checked_readers() -> Iterator[list[BaseException]]:
    """Meanwhile, every torch DCP reader Megatron-Core makes (``_get_filesystem_reader``) reads
    through :func:`check_reads`. Yields the list its refusals go to; an error a refusal caused
    (torch DCP's ``AssertionError`` for an index, its ``CheckpointException`` gathering the
    ranks' read errors) is raised as the refusal, the lowest rank's, naming it. Not
    thread-safe: it swaps Megatron-Core's module attribute, for one load at a time."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint import FileSystemReader

    stock = torch_strategy._get_filesystem_reader
    refused: list[BaseException] = []

    def reader(*args: Any, **kwargs: Any) -> Any:
        made = stock(*args, **kwargs)
        return check_reads(made, refused) if isinstance(made, FileSystemReader) else made

    modules = [m for m in (torch_strategy, serialization) if hasattr(m, "_get_filesystem_reader")]
    for module in modules:
        module._get_filesystem_reader = reader
    try:
        yield refused
    except BaseException as err:
        refusal = _first_refusal(err, refused)
        if refusal is None:
            raise
        raise refusal from err
    finally:
        for module in modules:
            module._get_filesystem_reader = stock


def _first_refusal(err: BaseException, refused: list[BaseException]) -> BaseException | None:
    """The refusal behind ``err``: the lowest rank's that torch DCP gathered into it, else
    this rank's own (``refused``); ``None``: it was no refusal (or is one, raised as it is)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, _safe_load.UnsafeCheckpointError):
        return None
    if isinstance(err, CheckpointException):
        for rank, failure in sorted(err.failures.items()):
            cause: BaseException | None = failure[0] if isinstance(failure, tuple) else failure
            while cause is not None and not isinstance(cause, _safe_load.UnsafeCheckpointError):
                cause = cause.__cause__
            if cause is not None:
                return _safe_load.UnsafeCheckpointError(f"{cause} (found on rank {rank})")
    return _safe_load.UnsafeCheckpointError(str(refused[0])) if refused else None


@contextlib.contextmanager
def _kept_in(refused: list[BaseException] | None) -> Iterator[None]:
    """An ``UnsafeCheckpointError`` raised meanwhile is also appended to ``refused``."""
    try:
        yield
    except _safe_load.UnsafeCheckpointError as err:
        if refused is not None:
            refused.append(err)
        raise


_REMEMBERED = 1 << 20
"""Records up to this size have their verdict kept by their bytes (:class:`_Verdicts`)."""


class _Verdicts:
    """Each distinct object record scanned once per check: a verdict depends on the record's
    bytes alone (a model's ``_extra_state`` records are mostly alike: 29 records, 2 distinct,
    in a small GPT). Kept for one check only: the allowlist may change between two."""

    def __init__(self) -> None:
        self._seen: dict[bytes, list[str]] = {}

    def unsafe(self, record: Any, length: int, where: str) -> list[str]:
        """The globals of ``record`` (a seekable binary file of ``length`` bytes, read from its
        current position) that are not allowed; see ``_safe_load.scan``."""
        if length > _REMEMBERED:
            return _safe_load.scan(record, where)
        data = record.read(length)
        if data not in self._seen:
            self._seen[data] = _safe_load.scan(io.BytesIO(data), where)
        return self._seen[data]


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
    verdicts = _Verdicts()
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
            record = _Window(f, int(info.offset), int(info.length))  # type: ignore[arg-type]
            unsafe = verdicts.unsafe(record, int(info.length), where)
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
