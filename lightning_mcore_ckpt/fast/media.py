"""Which medium a fast-tier file is on (a file system held in memory: ``/dev/shm``'s tmpfs, a
ramfs; or a disk), and a copy kept mapped rather than read into memory of its own.

Reading a copy would copy every byte into fresh memory: hundreds of MiB whose pages the kernel
must find, zero and fault in, right after a crash filled memory with the tier's files (0.3 s
measured for 127 MiB on a 2-CPU VM, against 0.03 s for the read itself), and on a disk a second
copy of what the kernel has just read into its page cache. A copy is mapped instead
(:func:`map_file`): its pages are the file's own (on a disk, the page cache's, read in chunk by
chunk with the kernel's read-ahead: :func:`populate`), and nothing is copied until the load
copies each tensor into the live state.
"""

from __future__ import annotations

import mmap
import os
import re
import sys
from pathlib import Path
from typing import IO

__all__ = ["CAN_MAP", "IN_MEMORY", "file_system", "in_memory", "map_file", "populate"]

IN_MEMORY = frozenset({"tmpfs", "ramfs"})
"""File systems whose files live in memory."""

_ESCAPED = re.compile(r"\\([0-7]{3})")


def file_system(path: str | Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system ``path`` is on, as this process's mounts say
    (``/proc/self/mountinfo``: the mount namespace of a simulated node, a container's, is the
    one that counts); ``None`` where that cannot be told."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, kind = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the last of equal mount points is the one on top
            best, kind = len(point), right.split()[0]
    return kind


def in_memory(path: str | Path) -> bool:
    """Whether ``path`` is on a file system held in memory (:data:`IN_MEMORY`)."""
    return file_system(path) in IN_MEMORY


CAN_MAP = hasattr(mmap, "MAP_PRIVATE")
"""Whether a file can be mapped privately here (POSIX): else a copy is read into memory."""

# Linux >= 5.14 (22 where Python was built against older headers); no such advice elsewhere.
_MADV_POPULATE_READ: int | None = getattr(
    mmap, "MADV_POPULATE_READ", 22 if sys.platform.startswith("linux") else None
)


def map_file(f: IO[bytes], size: int, *, whole: bool = True) -> memoryview:
    """The first ``size`` bytes of the open file ``f``, mapped: private (writes to the view,
    e.g. a tensor made of it, never reach the file) and, with ``whole``, its pages mapped at
    once for reading (:func:`populate`; else the caller populates it part by part). The fast
    tier replaces its files by rename, never in place, so the bytes mapped stay the file's
    bytes checked."""
    area = mmap.mmap(
        f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    view = memoryview(area)
    if whole:
        populate(view, 0, size)
    return view


def populate(view: memoryview, start: int, length: int) -> None:
    """Map ``length`` bytes of the mapping ``view`` (:func:`map_file`) from ``start`` (a
    multiple of the page size) for reading, in one call (``MADV_POPULATE_READ``) instead of a
    fault per page: from a disk, the kernel reads them into its page cache, which the mapping
    shares. Not ``MAP_POPULATE``, which on a private writable mapping copies every page as if
    written (0.06 s against 0.014 s for 127 MiB in memory). On an older kernel, each page is
    mapped at its first read instead."""
    area = view.obj
    if length > 0 and _MADV_POPULATE_READ is not None and isinstance(area, mmap.mmap):
        try:
            area.madvise(_MADV_POPULATE_READ, start, length)
        except OSError:
            pass
