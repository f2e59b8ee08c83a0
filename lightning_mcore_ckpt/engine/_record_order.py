"""A shard file's records read in file order: head, data, tail.

A torch DCP shard file is a sequence of records, each one ``torch.save`` zip: a head (the local
headers and the pickle naming the tensor's dtype, shape and strides, then the storage's own
header), the storage's bytes, and a tail (two small records and the zip's central directory).
``torch.load`` onto the meta device finds a record's layout without reading its data, but it
starts at the tail (the central directory), then reads the head: each record costs a jump
forward over its data and one back, and the disk's read-ahead restarts at every record.

:class:`Record` reads a record forward instead. The head first; where the storage's bytes
start is taken from the head's local header for ``<archive>/data/0``, and the data are read
from there straight into the tensor they are loaded into; then the tail. The layout is then
parsed by ``torch.load`` onto the meta device, as before, from a view serving the head and the
tail from memory (:meth:`Record.view`): it is the authority, and the caller compares it with
the place the data were read from. A guess it does not confirm (a record written otherwise, a
transposed or sliced tensor) costs a wasted read, never a wrong value: the caller reads again
from where the layout says.
"""

from __future__ import annotations

import os
import struct
from typing import IO, Any, cast

import torch

from lightning_mcore_ckpt.storage import remote_files

__all__ = ["HEAD", "TAIL", "Record"]

HEAD = 4096
"""Bytes of a record read first: its local headers and pickle (a few hundred bytes for one
tensor) and the start of its data."""
TAIL = 4096
"""Bytes at a record's end read after its data: the ``version`` and ``serialization_id``
records and the central directory (under 2 KiB for one tensor)."""

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
_STORED = 0


class Record:
    """One record of a local shard file, ``length`` bytes at ``offset``, read in file order."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        self.stream, self.offset, self.length = stream, offset, length
        self._pieces: list[tuple[int, bytes]] = []

    def data_start(self) -> int | None:
        """Where the storage's bytes start in the record, as its head says (reading the head):
        the first local header named ``*/data/0``, stored uncompressed; ``None`` without one."""
        head = self._read(0, min(HEAD, self.length))
        at = head.find(b"PK\x03\x04")
        while 0 <= at <= len(head) - _LOCAL_HEADER.size:
            fields = _LOCAL_HEADER.unpack_from(head, at)
            signature, compression, name_length, extra_length = (
                fields[0],
                fields[3],
                fields[9],
                fields[10],
            )
            name_end = at + _LOCAL_HEADER.size + name_length
            if signature == _LOCAL_SIGNATURE and name_end <= len(head):
                name = head[at + _LOCAL_HEADER.size : name_end]
                if name.endswith(b"/data/0") and compression == _STORED:
                    return name_end + extra_length
            at = head.find(b"PK\x03\x04", at + 1)
        return None

    def view(self) -> IO[bytes]:
        """The record as a seekable stream for ``torch.load``: the head and the tail served from
        memory (the tail read now, after the data), any other byte read from the file."""
        if self.length > HEAD:
            tail = min(TAIL, self.length - HEAD)
            self._read(self.length - tail, tail)
        return cast(IO[bytes], _View(self))

    def _read(self, start: int, size: int) -> bytes:
        data = os.pread(self.stream.fileno(), size, self.offset + start)
        if len(data) != size:
            raise OSError(
                f"{self.stream.name}: the file ends inside a record (at byte "
                f"{self.offset + start + len(data)})"
            )
        self._pieces.append((start, data))
        return data

    def serve(self, start: int, size: int) -> bytes:
        """``size`` bytes from ``start`` in the record: from memory when a piece read holds them."""
        for begin, data in self._pieces:
            if begin <= start and start + size <= begin + len(data):
                return data[start - begin : start - begin + size]
        data = os.pread(self.stream.fileno(), size, self.offset + start)
        if len(data) != size:
            raise OSError(f"{self.stream.name}: the file ends inside a record")
        return data


class _View(remote_files.SeekableReader):
    """A record as a file of its own (positions from its first byte), served by :class:`Record`."""

    def __init__(self, record: Record) -> None:
        super().__init__(record.length)
        self._record = record

    def readinto(self, buffer: Any) -> int:
        size = max(0, min(len(buffer), self._length - self._pos))
        if size:
            memoryview(buffer).cast("B")[:size] = self._record.serve(self._pos, size)
            self._pos += size
        return size


def whole_chunk(planner: Any, item: Any) -> bool:
    """Whether ``item`` reads a saved chunk whole (a load in the layout that saved it), so that
    its record's data can be read before its layout is parsed. A partial read (a reshard) is
    not guessed at: its bytes need not be contiguous in the record."""
    if any(item.storage_offsets):
        return False
    metadata = getattr(planner, "metadata", None)
    entry = getattr(metadata, "state_dict_metadata", {}).get(item.storage_index.fqn)
    chunks = getattr(entry, "chunks", None)
    if not chunks:
        return False
    index = item.storage_index.index
    candidates = [chunks[index]] if index is not None and index < len(chunks) else chunks
    for chunk in candidates:
        if torch.Size(chunk.offsets) == item.storage_index.offset:
            return torch.Size(chunk.sizes) == item.lengths
    return False
