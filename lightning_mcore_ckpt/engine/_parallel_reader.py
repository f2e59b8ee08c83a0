"""Loads that read a step's shard files in parallel.

Megatron-Core's ``torch_dist`` load reads through torch DCP's ``FileSystemReader``: one file
after the other, each record deserialised before the next is read, so the disk waits for the
CPU and the CPU for the disk. :class:`ParallelFileSystemReader` reads the files a rank needs
with a thread pool (each file sequentially, in offset order; each record forward, head, data,
tail: :mod:`._record_order`). A record whose bytes lie in the file as they will in memory (the
usual case) is read straight into the tensor it is loaded into: no temporary tensor, no copy.
Its layout comes from torch.load onto the meta device, which parses the record without
reading its data, once per distinct head in a load (:mod:`._record_layouts`). A record loaded
into a device tensor (a run on GPUs) is read in chunks into two pinned host buffers of its
thread, each chunk copied to the device while the next is read: no pageable copy of the
record, and no second copy on the device. Any other record goes through torch.load and a copy.
The planner (where each tensor goes) is called under a lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
import os
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.futures import Future

from lightning_mcore_ckpt.engine import _record_order
from lightning_mcore_ckpt.engine._record_layouts import Layout, Layouts
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.storage import remote_files

__all__ = ["ParallelFileSystemReader", "load_strategy", "views_readable"]


class ParallelFileSystemReader(FileSystemReader):  # type: ignore[misc]
    """torch DCP's ``FileSystemReader``, reading ``threads`` files at once."""

    def __init__(self, path: Any, threads: int) -> None:
        super().__init__(path)
        self.fs = remote_files.routed_filesystem()  # a view of a step in an object store
        self.threads = threads

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        from torch.distributed.checkpoint.planner import LoadItemType

        infos = self.storage_data
        if any(infos[item.storage_index].transform_descriptors for item in plan.items):
            return super().read_data(plan, planner)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(infos[item.storage_index].relative_path, []).append(item)
        lock = threading.Lock()
        layouts = Layouts()

        def read_file(relative_path: str, items: list[Any]) -> None:
            items.sort(key=lambda item: infos[item.storage_index].offset)
            path = self.fs.concat_path(self.path, relative_path)
            # A view of a step in an object store reads its shard files by range.
            local = remote_files.remote_size(path) is None
            with remote_files.open_read(path) as stream:
                if hasattr(os, "posix_fadvise") and local:
                    os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for item in items:
                    info = infos[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        stream.seek(info.offset)
                        record = io.BytesIO(stream.read(info.length))
                        with lock:
                            planner.load_bytes(item, record)
                        continue
                    with lock:
                        target = planner.resolve_tensor(item).detach()
                    self._read_tensor(
                        stream, info, item, target, planner if local else None, layouts
                    )
                    with lock:
                        planner.commit_tensor(item, target)

        with ThreadPoolExecutor(self.threads, thread_name_prefix="lmc-shard-reader") as pool:
            for future in [pool.submit(read_file, p, items) for p, items in per_file.items()]:
                future.result()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_tensor(
        self,
        stream: Any,
        info: Any,
        item: Any,
        target: torch.Tensor,
        planner: Any | None,
        layouts: Layouts,
    ) -> None:
        """``item``'s bytes into ``target``. From a local file (``planner`` given) the record is
        read forward (:mod:`._record_order`): its data straight into ``target`` from where its
        head says they start, when it is saved whole and lies as ``target`` does, then its
        tail; the layout parsed from the record (torch.load onto the meta device, or the layout
        of a record with the same head, :mod:`._record_layouts`) decides, and
        data read from elsewhere are read again from its place. Any other record goes through
        torch.load and a copy."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        record = _record_order.Record(stream, info.offset, info.length) if planner else None
        start = record.data_start() if record is not None else None
        guessed = None
        if start is not None and _direct(target) and _record_order.whole_chunk(planner, item):
            if start + _nbytes(target) <= info.length:
                guessed = info.offset + start
                _read_at(stream, guessed, target)
        if record is not None:
            layout = layouts.of(record, start)
        else:
            parsed = torch.load(
                self._slice_file(stream, info), map_location="meta", weights_only=True
            )
            layout = Layout(parsed, getattr(parsed.untyped_storage(), "_checkpoint_offset", None))
        tensor = narrow_tensor_by_index(layout.tensor, item.storage_offsets, item.lengths)
        if target.size() != tensor.size():
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}"
            )
        position = _place(info.offset, Layout(tensor, layout.start), target)
        if position is None:
            whole = torch.load(
                self._slice_file(stream, info), map_location="cpu", weights_only=True
            )
            target.copy_(narrow_tensor_by_index(whole, item.storage_offsets, item.lengths))
        elif position != guessed:
            _read_at(stream, position, target)


def _direct(target: torch.Tensor) -> bool:
    """Whether ``target`` can be read into straight from a file: a contiguous host or device
    tensor with bytes to read, on a little-endian host (the files' byte order)."""
    return (
        sys.byteorder == "little"
        and target.device.type in ("cpu", "cuda")
        and target.is_contiguous()
        and target.numel() > 0
    )


def _nbytes(target: torch.Tensor) -> int:
    return target.numel() * target.element_size()


def _place(record_offset: int, layout: Layout, target: torch.Tensor) -> int | None:
    """Where ``target``'s bytes start in the file when they lie there as they will in memory.

    ``layout`` is the record's tensor on the meta device (its offset, strides and dtype) and
    where its storage starts in the record. ``None`` for any other case (a strided or
    differently typed tensor): torch.load and a copy do those.
    """
    tensor = layout.tensor
    if layout.start is None or not _direct(target) or tensor.dtype != target.dtype:
        return None
    if not tensor.is_contiguous():
        return None
    return record_offset + layout.start + int(tensor.storage_offset()) * tensor.element_size()


def _read_at(stream: Any, position: int, target: torch.Tensor) -> None:
    """``target``'s bytes from ``position`` of ``stream``: a host tensor read into directly, a
    device one through pinned host buffers (:class:`DeviceBounce`)."""
    flat = target.reshape(-1).view(torch.uint8)
    if target.device.type == "cpu":
        _read_exactly(stream, position, flat.numpy().data)
    else:
        DeviceBounce.for_this_thread(target.device).read(stream, position, flat)


def _read_exactly(stream: Any, position: int, buffer: memoryview) -> None:
    """``len(buffer)`` bytes of ``stream`` from ``position`` into ``buffer``: ``preadv`` on a local
    file, one ranged read on a remote one (a view of a step in an object store)."""
    if not (hasattr(os, "preadv") and isinstance(getattr(stream, "raw", None), io.FileIO)):
        stream.seek(position)
        if stream.readinto(buffer) != len(buffer):
            raise OSError(f"{stream.name}: the object ends inside a record")
        return
    done = 0
    while done < len(buffer):
        read = os.preadv(stream.fileno(), [buffer[done:]], position + done)
        if read <= 0:
            raise OSError(
                f"{stream.name}: the file ends inside a record (at byte {position + done})"
            )
        done += read


class DeviceBounce:
    """A reader thread's way to a device tensor: two pinned host buffers of :attr:`CHUNK`
    bytes and a copy stream. A chunk is read into one buffer while the other's copy to the
    device runs; a buffer is read into again only once its copy is done. :meth:`read` returns
    when the record is on the device."""

    CHUNK = 32 * 1024 * 1024
    _local = threading.local()

    def __init__(self, device: torch.device, chunk: int, pinned: bool = True) -> None:
        self.device = device
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        on_device = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_device else None
        self.copied: list[Any] = [torch.cuda.Event() if on_device else None for _ in range(2)]

    @classmethod
    def for_this_thread(cls, device: torch.device) -> DeviceBounce:
        """The calling thread's bounce for ``device`` (made at its first device record)."""
        made = getattr(cls._local, "bounces", None)
        if made is None:
            made = cls._local.bounces = {}
        if device not in made:
            made[device] = cls(device, cls.CHUNK)
        return made[device]

    def read(self, stream: Any, position: int, dest: torch.Tensor) -> None:
        """``dest.numel()`` bytes of ``stream`` from ``position`` into ``dest`` (uint8, flat)."""
        chunk = self.buffers[0].numel()
        if self.stream is not None:  # after what the thread's stream has queued for dest
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for i, begin in enumerate(range(0, dest.numel(), chunk)):
            n = min(chunk, dest.numel() - begin)
            buffer, copied = self.buffers[i % 2], self.copied[i % 2]
            if copied is not None:
                copied.synchronize()  # this buffer's previous chunk has reached the device
            _read_exactly(stream, position + begin, buffer[:n].numpy().data)
            if self.stream is None:  # a host destination (tests): a plain copy
                dest[begin : begin + n].copy_(buffer[:n])
                continue
            with torch.cuda.stream(self.stream):
                dest[begin : begin + n].copy_(buffer[:n], non_blocking=True)
                copied.record(self.stream)
        if self.stream is not None:
            self.stream.synchronize()


_swap_lock = threading.RLock()


_checked: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "lmc_checked_reads", default=None
)
"""Where the torch DCP readers made meanwhile (checked: ``safe_dcp.check_reads``) keep their
refusals; ``None``: not checked."""


@contextlib.contextmanager
def views_readable(checked: bool = False) -> Iterator[None]:
    """Every torch DCP reader Megatron-Core creates meanwhile reads a view's remote files
    from its object store (e.g. the common state it reads before the sharded load). With
    ``checked`` (a load the user did not trust whole), each reads its index and object records
    through ``safe_dcp.check_reads`` (``safe_dcp.checked_readers``): what is unpickled is what
    was checked, even where a file is replaced after the check before the load; a refusal is
    raised as ``UnsafeCheckpointError`` on every rank that learns of it."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    stock = torch_strategy._get_filesystem_reader

    def reader(*args: Any, **kwargs: Any) -> Any:
        made = stock(*args, **kwargs)
        if isinstance(made, FileSystemReader):
            made.fs = remote_files.routed_filesystem()
        return made

    # Megatron-Core 0.16 reads the common state from common.pt, without a DCP reader.
    modules = [m for m in (torch_strategy, serialization) if hasattr(m, "_get_filesystem_reader")]
    with _swap_lock:
        for module in modules:
            module._get_filesystem_reader = reader
        try:
            with _safe_dcp.checked_readers() if checked else contextlib.nullcontext() as refused:
                token = _checked.set(refused)
                try:
                    yield
                finally:
                    _checked.reset(token)
        finally:
            for module in modules:
                module._get_filesystem_reader = stock


@contextlib.contextmanager
def _parallel_reader(threads: int) -> Iterator[None]:
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    stock = torch_strategy._get_filesystem_reader

    def reader(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        made = ParallelFileSystemReader(checkpoint_dir, threads)
        refused = _checked.get()
        return made if refused is None else _safe_dcp.check_reads(made, refused)

    with _swap_lock:
        torch_strategy._get_filesystem_reader = reader
        try:
            yield
        finally:
            torch_strategy._get_filesystem_reader = stock


@functools.cache
def _strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class ParallelReadStrategy(TorchDistLoadShardedStrategy):  # type: ignore[misc]
        """Megatron-Core's ``torch_dist`` load, reading with :class:`ParallelFileSystemReader`."""

        threads = 2

        def load(self, *args: Any, **kwargs: Any) -> Any:
            with _parallel_reader(self.threads):
                return super().load(*args, **kwargs)

    return ParallelReadStrategy


def load_strategy(default: Any, threads: int) -> Any:
    """``default`` (Megatron-Core's load strategy for a step) reading ``threads`` files at once,
    when it is the ``torch_dist`` one; else ``default`` itself."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    if type(default) is not TorchDistLoadShardedStrategy:
        return default
    strategy = _strategy_class()()
    strategy.threads = threads
    return strategy
