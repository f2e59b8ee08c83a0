"""Which medium a fast-tier file is on: a file system held in memory (``/dev/shm``'s tmpfs, a
ramfs) or a disk.

A copy on a disk is read into memory of its own, once. A copy already in memory is not: reading
it would copy every byte into fresh memory, and a fresh allocation of hundreds of MiB right
after a crash filled memory with the tier's files can stall on the kernel compacting memory
for it (0.3 s measured for 127 MiB on a 2-CPU VM, against 0.03 s for the read itself). It is
mapped instead (:func:`map_file`): its pages are the file's own, and nothing is copied until
the load copies each tensor into the live state.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import IO

__all__ = ["IN_MEMORY", "file_system", "in_memory", "map_file"]

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


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def map_file(f: IO[bytes], size: int) -> memoryview:
    """The first ``size`` bytes of the open file ``f``, mapped: private (writes to the view,
    e.g. a tensor made of it, never reach the file) and its pages mapped at once for reading
    (``MADV_POPULATE_READ``, one call instead of a fault per page; not ``MAP_POPULATE``, which
    on a private writable mapping copies every page as if written: 0.06 s against 0.014 s for
    127 MiB). The fast tier replaces its files by rename, never in place, so the bytes mapped
    stay the file's bytes checked."""
    area = mmap.mmap(
        f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    if hasattr(area, "madvise"):
        try:
            area.madvise(_MADV_POPULATE_READ)
        except OSError:  # an older kernel: each page is mapped at its first read instead
            pass
    return memoryview(area)
