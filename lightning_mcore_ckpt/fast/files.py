"""What a node's fast-tier directory holds, and how each copy is found whole.

::

    <dir>/fast_step_<N>/
        state_<r>.pt          rank r's model and optimizer state (engine/_rank_state.py)
        extra/rank_<r>.pt     rank r's RNG and Lightning state, as in a persistent step
        seal_<r>.json         both files' sizes and digests, written last, with its own digest
        complete.json         written by the node's first rank once every rank's files were
                              sealed on 1 + replicas nodes: the step counts

A node holds the files of its own ranks and the copies of its peers' ranks, under the same
names: a copy is the same file on another node. A rank's files are whole on a node when its
seal is whole and names their sizes (:func:`present`); they are unchanged when their bytes
hash to the seal's digests (:func:`verify`, read in full: done for the step resumed only;
:func:`read_checked` keeps the bytes it read, so that they are loaded without a second read;
:func:`stream_checked` hands each piece on as it is read, keeping none).

A seal's file names are read from a node's disk or received from a peer: each must be one of
the files its rank may have (:func:`files_of`) before it becomes a path (:func:`sealed_paths`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol, cast

from lightning_mcore_ckpt.fast import media
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.layout import EXTRA_DIR
from lightning_mcore_ckpt.safety.names import UnsafeNameError, inside
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = [
    "COMPLETE",
    "STEP_PREFIX",
    "buffer",
    "files_of",
    "inventory",
    "is_complete",
    "mark_complete",
    "present",
    "read_checked",
    "read_seal",
    "remove_step",
    "seal_name",
    "sealed_paths",
    "step_dir",
    "step_number",
    "steps",
    "stream_checked",
    "verify",
    "write_seal",
]

STEP_PREFIX = "fast_step_"
COMPLETE = "complete.json"
_STEP = re.compile(rf"^{STEP_PREFIX}(\d+)$")
Progress = Callable[[int, Any, int], None]
"""``progress(index, data, done)``: file ``index``'s first ``done`` bytes are read and hashed
into ``data`` (:func:`read_checked`)."""


class Stream(Protocol):
    """Where :func:`stream_checked` reads a copy piece by piece (a copy on its way to a peer:
    :class:`~lightning_mcore_ckpt.fast.peers.Outgoing`)."""

    def window(self) -> memoryview:
        """Memory for the next piece, of the length it is to have."""
        ...

    def filled(self, index: int) -> None:
        """The next piece, of file ``index``, is read and hashed into that memory."""
        ...


_CHUNK = 8 << 20
_HUGE_PAGE = 2 << 20


def step_dir(root: Path, step: int) -> Path:
    """The directory of fast step ``step`` under ``root``."""
    return Path(root) / f"{STEP_PREFIX}{step}"


def step_number(path: str | Path) -> int | None:
    """The step a fast-step directory holds (``None``: not one)."""
    found = _STEP.match(Path(path).name)
    return int(found.group(1)) if found else None


def steps(root: Path) -> list[int]:
    """The fast steps with a directory under ``root``, oldest first."""
    if not Path(root).is_dir():
        return []
    found = (step_number(p) for p in Path(root).iterdir() if p.is_dir())
    return sorted(s for s in found if s is not None)


def files_of(rank: int) -> list[str]:
    """Rank ``rank``'s files in a step, relative to it."""
    return [f"state_{rank:05d}.pt", f"{EXTRA_DIR}/rank_{rank:05d}.pt"]


def seal_name(rank: int) -> str:
    return f"seal_{rank:05d}.json"


def sealed_paths(step: Path, record: dict[str, Any], rank: int) -> dict[str, Path]:
    """The paths in ``step`` of the files rank ``rank``'s seal ``record`` lists, by name.

    A seal is read from a node's disk or received from a peer, and its digest proves integrity,
    not origin: each name must be one of rank ``rank``'s own files (:func:`files_of`) and stay
    inside ``step``, else :class:`~lightning_mcore_ckpt.safety.names.UnsafeNameError` names
    the seal and the file (nothing is read or written for it).
    """
    allowed = files_of(rank)
    source = f"rank {rank}'s seal of {Path(step).name}"
    out = {}
    for name in record["files"]:
        if name not in allowed:
            raise UnsafeNameError(
                f"{source} names the file {name!r}, which is not one of rank {rank}'s files "
                f"({', '.join(allowed)}): refused; the seal was not written by this library"
            )
        out[name] = inside(step, name, source)
    return out


def write_seal(
    step: Path,
    rank: int,
    world_size: int,
    files: dict[str, tuple[int, str]],
    layout: dict[str, int] | None = None,
) -> bytes:
    """Seal rank ``rank``'s ``files`` (name -> size, digest) in ``step``, saved in ``layout``
    (the run's parallel sizes); the seal's bytes."""
    record: dict[str, Any] = {
        "step": step_number(step),
        "rank": rank,
        "world_size": world_size,
        "parallel_layout": layout,
        "files": {name: {"size": size, "digest": digest} for name, (size, digest) in files.items()},
    }
    record[integrity.METADATA_HASH] = integrity.json_digest(record)
    text = json.dumps(record, indent=1, sort_keys=True).encode()
    _atomic.write_bytes(step / seal_name(rank), text)
    return text


def parse_seal(text: bytes | bytearray | memoryview) -> dict[str, Any] | None:
    """A seal's record, or ``None`` when it is torn or altered."""
    try:
        record = json.loads(bytes(text))
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return None
    if record.get(integrity.METADATA_HASH) != integrity.json_digest(record):
        return None
    return record


def read_seal(step: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s seal in ``step``, or ``None`` (missing, torn or altered)."""
    try:
        return parse_seal((step / seal_name(rank)).read_bytes())
    except OSError:
        return None


def present(step: Path, rank: int) -> bool:
    """Whether ``step`` holds rank ``rank``'s files, sealed, at their sealed sizes (cheap: no
    file is read)."""
    record = read_seal(step, rank)
    if record is None or record.get("rank") != rank or record.get("step") != step_number(step):
        return False
    try:
        paths = sealed_paths(step, record, rank)
        return all(paths[n].stat().st_size == f["size"] for n, f in record["files"].items())
    except (OSError, UnsafeNameError):
        return False


def verify(step: Path, rank: int) -> str | None:
    """What is wrong with rank ``rank``'s copy in ``step`` (``None``: whole and unchanged).
    Reads every byte once, keeping none (:func:`read_checked` keeps them)."""
    found = _checked(step, rank, None, lambda index, path, size: _read_hashed(path, size, False))
    return found if isinstance(found, str) else None


def read_checked(
    step: Path, rank: int, seal: bytes | None = None, progress: Progress | None = None
) -> tuple[bytes, list[bytearray | memoryview]] | str:
    """Rank ``rank``'s seal in ``step`` and its files' bytes, in the seal's order, each file
    read once into memory and hashed as it is read; or what is wrong (as :func:`verify` says
    it). The bytes returned are the bytes that matched the seal: a load that uses them reads
    nothing again, and nothing that changed on disk since.

    ``seal``: the seal's bytes, already read (else read here). ``progress(index, data, done)``
    is called as each chunk of file ``index`` is read and hashed: its first ``done`` bytes are
    in ``data`` (the file's whole buffer), e.g. to send them on while the rest is read."""

    def read(index: int, path: Path, size: int) -> Hashed | str:
        told = None if progress is None else functools.partial(progress, index)
        return _read_hashed(path, size, True, told)

    return _checked(step, rank, seal, read)


def stream_checked(step: Path, rank: int, seal: bytes, stream: Stream) -> str | None:
    """Rank ``rank``'s copy in ``step`` read once, each piece into the memory ``stream`` gives
    and handed on as soon as it is read and hashed; what is wrong with it (as :func:`verify`
    says it), or ``None``: every byte matched the seal ``seal`` (the seal's bytes, already read
    and announced). Nothing is kept: memory for :data:`~lightning_mcore_ckpt.fast.peers.RING`
    pieces, not the copy's bytes."""

    def read(index: int, path: Path, size: int) -> Hashed | str:
        return _stream_hashed(path, size, stream.window, functools.partial(stream.filled, index))

    found = _checked(step, rank, seal, read)
    return found if isinstance(found, str) else None


Hashed = tuple[bytearray | memoryview, str]
"""A file's bytes (empty where they are not kept) and their digest."""


def _checked(
    step: Path, rank: int, seal: bytes | None, read: Callable[[int, Path, int], Hashed | str]
) -> tuple[bytes, list[bytearray | memoryview]] | str:
    """Rank ``rank``'s seal (``seal``: its bytes, already read; else read here) and its files'
    bytes as ``read(index, path, size)`` gives them, each file's digest compared with the
    seal's; or what is wrong."""
    if seal is None:
        try:
            seal = (step / seal_name(rank)).read_bytes()
        except OSError:
            seal = b""
    record = parse_seal(seal)
    if record is None:
        return f"{step / seal_name(rank)} is missing, torn or altered"
    if record.get("rank") != rank or record.get("step") != step_number(step):
        return f"{step / seal_name(rank)} seals another rank's or step's files"
    try:
        paths = sealed_paths(step, record, rank)
    except UnsafeNameError as err:
        return str(err)
    contents = []
    for index, (name, entry) in enumerate(record["files"].items()):
        found = read(index, paths[name], entry["size"])
        if isinstance(found, str):
            return found
        data, digest = found
        if digest != entry["digest"]:
            return f"{paths[name]} does not match its seal's digest (altered)"
        contents.append(data)
    return seal, contents


def _opened(path: Path, size: int, body: Callable[[IO[bytes]], Hashed | str]) -> Hashed | str:
    """``body(f)`` on ``path`` opened for reading, once it holds the ``size`` bytes sealed; or
    why not (a file missing, unreadable, or not of that size: torn)."""
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                return f"{path} has {actual} bytes, its seal says {size} (torn)"
            return body(f)
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:
        return f"{path} cannot be read: {err}"


def _read_hashed(
    path: Path, size: int, keep: bool, progress: Callable[[Any, int], None] | None = None
) -> Hashed | str:
    """``path``'s bytes (``keep``; else an empty buffer) and their digest, read once in chunks
    and hashed chunk by chunk while the chunk is fresh in the cache; or why not. Bytes kept are
    the file's, mapped, not copied (:mod:`.media`), and hashed where they are: a file in memory
    (``/dev/shm``) mapped whole, a file on a disk read into the page cache chunk by chunk.
    ``progress(data, done)`` after each chunk (``keep`` only): the first ``done`` bytes of
    ``data`` are read and hashed."""

    def body(f: IO[bytes]) -> Hashed | str:
        hasher = integrity.HashingWriter(cast(IO[bytes], _Discard()))
        mapped = keep and size > 0 and media.CAN_MAP
        in_memory = mapped and media.in_memory(path)  # its pages there: mapped at once
        data = (
            media.map_file(f, size, whole=in_memory)
            if mapped
            else buffer(size if keep else min(size, _CHUNK))
        )
        view = memoryview(data)
        done = 0
        while done < size:
            chunk = min(_CHUNK, size - done)
            window = view[done : done + chunk] if keep else view[:chunk]
            if mapped and not in_memory:
                media.populate(view, done, chunk)  # the disk read into the page cache
            read = chunk if mapped else f.readinto(window)  # type: ignore[attr-defined]
            if not read:
                return f"{path} ended after {done} of {size} bytes (torn)"
            hasher.write(window[:read])
            done += read
            if progress is not None and keep:
                progress(data, done)
        return (data if keep else bytearray()), hasher.digest

    return _opened(path, size, body)


def _stream_hashed(
    path: Path, size: int, window: Callable[[], memoryview], filled: Callable[[], None]
) -> Hashed | str:
    """The digest of ``path``'s ``size`` bytes (beside an empty buffer: none is kept), each
    piece read whole into ``window()``, hashed, then handed on (``filled()``); or why not."""

    def body(f: IO[bytes]) -> Hashed | str:
        hasher = integrity.HashingWriter(cast(IO[bytes], _Discard()))
        done = 0
        while done < size:
            piece = window()
            got = 0
            while got < len(piece):
                read = f.readinto(piece[got:])  # type: ignore[attr-defined]
                if not read:
                    return f"{path} ended after {done + got} of {size} bytes (torn)"
                got += read
            hasher.write(piece)
            filled()
            done += got
        return bytearray(), hasher.digest

    return _opened(path, size, body)


def buffer(size: int) -> bytearray | memoryview:
    """``size`` writable bytes to read or receive a copy into, held until the load took it.

    A copy of a rank's state is hundreds of MiB of memory never touched before: each page of
    it costs the kernel a fault when first written, and with 4 KiB pages those faults take
    longer than reading the bytes (32,500 for 127 MiB: 0.05-0.2 s measured on a 2-CPU VM, more
    while another process faults too). Where the kernel offers transparent huge pages for
    memory that asks for them (Linux, ``madvise`` or ``always``), a large buffer is anonymous
    memory that asks for 2 MiB pages (a few hundred faults); else, and for a small buffer, a
    ``bytearray``. Either way zeroed, as the kernel gives memory."""
    if size < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return bytearray(size)
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # not offered: 4 KiB pages, as a bytearray has
        area.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(area)  # compares with bytes, as a bytearray does; keeps the mapping


class _Discard:
    """Where :class:`~lightning_mcore_ckpt.format.integrity.HashingWriter` writes what it only
    hashes (the seal's digest, computed the same way as when the file was written)."""

    def write(self, data: Any) -> int:
        return len(data)


def mark_complete(step: Path, record: dict[str, Any]) -> None:
    """Record that every rank's files of ``step`` were sealed on enough nodes."""
    _atomic.write_bytes(step / COMPLETE, json.dumps(record, indent=1, sort_keys=True).encode())


def is_complete(step: Path) -> bool:
    try:
        json.loads((step / COMPLETE).read_bytes())
    except (OSError, ValueError):
        return False
    return True


def inventory(
    root: Path, world_size: int, layout: dict[str, int] | None = None
) -> dict[int, dict[str, Any]]:
    """What this node holds: per fast step, whether it is marked complete, whose files it holds
    (sealed, at their sizes), and whether any of them was saved in another world size or
    parallel ``layout`` than this run's (``foreign``: such a step cannot be resumed here)."""
    out: dict[int, dict[str, Any]] = {}
    for step in steps(root):
        path = step_dir(root, step)
        held, foreign = [], False
        for name in sorted(path.glob("seal_*.json")):
            number = name.stem.split("_", 1)[1]
            if not number.isdigit() or not present(path, int(number)):
                continue  # not a seal of ours, or not whole
            record = read_seal(path, int(number))
            if record is None:
                continue
            same = record.get("world_size") == world_size and (
                layout is None or record.get("parallel_layout") == layout
            )
            foreign = foreign or not same
            if same:
                held.append(record["rank"])
        out[step] = {"complete": is_complete(path), "held": held, "foreign": foreign}
    return out


def remove_step(path: Path) -> None:
    """Delete a fast step's directory: its marker first, so a half-deleted step never
    counts."""
    (path / COMPLETE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
