"""*Remote files*: local paths whose bytes are read by range from an object store.

A local view of a step in a store (see :mod:`lightning_mcore_ckpt.storage.publication`) registers
its large files here instead of downloading them; :func:`open_read` and :func:`size_of` serve a
local file or a remote one alike, and :func:`routed_filesystem` lets torch DCP's reader open
them. The registry is process-wide.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any

from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = [
    "MemoryFile",
    "RangeReader",
    "SeekableReader",
    "forget_remote",
    "open_read",
    "register_remote",
    "remote_size",
    "routed_filesystem",
    "size_of",
]


class SeekableReader(io.RawIOBase):
    """A read-only, seekable raw file of ``length`` bytes: subclasses implement ``readinto``
    from ``_pos``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self._length, self._pos = length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class MemoryFile(SeekableReader):
    """A read-only, seekable file over bytes already in memory (a ``bytearray``, a tensor's
    view): read without a copy of them."""

    def __init__(self, data: Any, name: str = "<memory>") -> None:
        self._view = memoryview(data).cast("B")
        super().__init__(len(self._view))
        self.name = name

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        count = max(0, min(len(out), self._length - self._pos))
        out[:count] = self._view[self._pos : self._pos + count]
        self._pos += count
        return count


class RangeReader(SeekableReader):
    """A seekable, read-only file over one object: each read is a ranged GET."""

    def __init__(self, store: ObjectStore, name: str, size: int) -> None:
        super().__init__(size)
        self.store, self.object_name, self.size = store, name, size
        self.name = store.child(name).url

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        length = min(len(view), self.size - self._pos)
        if length <= 0:
            return 0
        done = 0
        while done < length:  # at most part_size per request
            step = min(length - done, self.store.part_size)
            data = self.store.get_range(self.object_name, self._pos + done, step)
            if not data:
                raise OSError(f"{self.name}: the object ends at byte {self._pos + done}")
            view[done : done + len(data)] = data
            done += len(data)
        self._pos += done
        return done


# --- remote files: local paths whose bytes are read from the store --------------------------

_remote: dict[str, tuple[ObjectStore, str, int]] = {}
_remote_lock = threading.Lock()


def register_remote(path: str | os.PathLike[str], store: ObjectStore, name: str, size: int) -> None:
    """Make ``path`` (which does not exist locally) read ``name`` of ``store``, ``size`` bytes."""
    with _remote_lock:
        _remote[os.path.abspath(path)] = (store, name, size)


def forget_remote(under: str | os.PathLike[str]) -> None:
    """Forget every remote file at or below ``under`` (a view being removed)."""
    base = os.path.abspath(under)
    with _remote_lock:
        for path in [p for p in _remote if p == base or p.startswith(base + os.sep)]:
            del _remote[path]


def remote_size(path: str | os.PathLike[str]) -> int | None:
    """The size of a remote file, or ``None`` when ``path`` is not one."""
    entry = _remote.get(os.path.abspath(path))
    return None if entry is None else entry[2]


def size_of(path: str | os.PathLike[str]) -> int | None:
    """A local or remote file's size, or ``None`` when it is neither."""
    size = remote_size(path)
    if size is not None:
        return size
    try:
        return os.stat(path).st_size if os.path.isfile(path) else None
    except OSError:
        return None


def open_read(path: str | os.PathLike[str]) -> io.BufferedIOBase:
    """Open a local or remote file for reading (binary, seekable)."""
    entry = _remote.get(os.path.abspath(path))
    if entry is None:
        return open(path, "rb")
    store, name, size = entry
    return io.BufferedReader(RangeReader(store, name, size), buffer_size=1 << 20)


def routed_filesystem() -> Any:
    """torch DCP's local ``FileSystem``, opening remote files (see :func:`open_read`) from the
    store: a ``FileSystemReader`` given it reads a view of a step in an object store."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class RoutedFileSystem(FileSystem):  # type: ignore[misc]
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if "r" in mode and remote_size(path) is not None:
                with open_read(path) as stream:
                    yield stream
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream

    return RoutedFileSystem()
