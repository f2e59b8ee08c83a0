"""Integrity: every file of a step hashed while it is written, checked without loading.

The hash is XXH3-128 (``xxhash``): 20-30 GB/s on one core, well above any disk, so hashing in
the threads that write costs no second read and next to no time. Each rank hashes what it
writes (its shard files, its ``extra/`` file); rank 0 gathers the digests at the save's
finalisation, and the commit records them in ``metadata.json`` next to each file's size
(``hashes``), made durable before the commit marker. Small files written by Megatron-Core
itself (``.metadata``, its ``metadata.json``, ``common.pt``) and the Hugging Face copy (written
out of order, tensor by tensor) are hashed at the commit from what was just written.

- :class:`HashingWriter`: a binary file that hashes what goes through it.
- :func:`record` / :func:`take`: the digests a rank wrote, by step directory.
- :func:`hash_file`: a file's digest, read whole.
- :func:`complete`: the digests of a step's files at its commit.
- :func:`check_hashes`: the files of a committed step whose bytes changed since the commit.

Example::

    from lightning_mcore_ckpt.format import integrity

    meta = markers.read_metadata("checkpoints/run/global_step_100")
    problems = integrity.check_hashes("checkpoints/run/global_step_100", meta["hashes"])
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from lightning_mcore_ckpt.safety.names import UnsafeNameError, in_step
from lightning_mcore_ckpt.storage import remote_files

__all__ = [
    "ALGORITHM",
    "METADATA_HASH",
    "PLACEHOLDER",
    "HashingWriter",
    "check_hashes",
    "complete",
    "hash_file",
    "json_digest",
    "record",
    "record_references",
    "seal",
    "take",
]

ALGORITHM = "xxh3-128"
"""The prefix of every digest (``"xxh3-128:<32 hex digits>"``): the algorithm is in the value."""

_CHUNK = 8 << 20


def _new() -> Any:
    import xxhash

    return xxhash.xxh3_128()


def _digest(hasher: Any) -> str:
    return f"{ALGORITHM}:{hasher.hexdigest()}"


class HashingWriter:
    """Wraps a binary file open for writing: what is written through it is hashed on the way.

    Only sequential writes (no ``seek``): a digest is of the bytes in file order.

    Example::

        with open("shard.distcp", "wb") as f:
            out = HashingWriter(f)
            torch.save(tensor, out)
        print(out.digest)  # "xxh3-128:..."
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._hasher = _new()

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        self._hasher.update(data)
        return written

    @property
    def name(self) -> str:
        """The file's name (as the file object it wraps names it)."""
        return str(getattr(self._file, "name", ""))

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def writable(self) -> bool:
        return True

    @property
    def digest(self) -> str:
        """``"xxh3-128:<hex>"`` of everything written so far."""
        return _digest(self._hasher)


def hash_file(path: str | os.PathLike[str]) -> str:
    """The digest of a whole file (read in 8 MiB chunks).

    Example::

        hash_file("checkpoints/run/global_step_100/model/__0_0.distcp")  # "xxh3-128:..."
    """
    hasher = _new()
    with remote_files.open_read(path) as f:  # a local file, or a view's file in an object store
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := f.readinto(buffer):
            hasher.update(view[:read])
    return _digest(hasher)


class Hasher:
    """The digest of bytes given piece by piece, in order (as :func:`hash_bytes` of them all)."""

    def __init__(self) -> None:
        self._hasher = _new()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hasher.update(data)

    @property
    def digest(self) -> str:
        return _digest(self._hasher)


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """The digest of ``data`` (as :func:`hash_file` of a file holding it)."""
    hasher = _new()
    hasher.update(data)
    return _digest(hasher)


# --- the commit marker's own digest ---------------------------------------------------------

METADATA_HASH = "metadata_hash"
"""The field of ``metadata.json`` that holds the digest of the rest of it."""
PLACEHOLDER = f"{ALGORITHM}:{'0' * 32}"
"""As long as a digest: written first, then replaced in the text (its size is in the text)."""


def json_digest(metadata: Mapping[str, Any]) -> str:
    """The digest of a ``metadata.json`` without its own :data:`METADATA_HASH` (canonical JSON:
    sorted keys, no blanks, so the same whatever the file's formatting).

    Example::

        meta = markers.read_metadata("checkpoints/run/global_step_100")
        assert json_digest(meta) == meta["metadata_hash"]  # the marker is as committed
    """
    rest = {k: v for k, v in metadata.items() if k != METADATA_HASH}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    hasher = _new()
    hasher.update(text.encode("utf-8"))
    return _digest(hasher)


def seal(text: str) -> str:
    """``metadata.json``'s text (holding :data:`PLACEHOLDER`) with its own digest filled in."""
    return text.replace(PLACEHOLDER, json_digest(json.loads(text)), 1)


# --- what this rank wrote --------------------------------------------------------------------

_lock = threading.Lock()
_written: dict[str, str] = {}


def record(path: str | os.PathLike[str], digest: str) -> None:
    """Remember the digest of a file this process has just written (thread-safe)."""
    with _lock:
        _written[os.path.abspath(path)] = digest


_references: dict[str, dict[str, str]] = {}


def record_references(step: str | os.PathLike[str], files: Mapping[str, str]) -> None:
    """Remember files outside ``step`` that it points at (by path relative to it, e.g.
    ``../shared/x.distcp``) and their digests (thread-safe)."""
    with _lock:
        _references.setdefault(os.path.abspath(step), {}).update(files)


def take(step: str | os.PathLike[str]) -> dict[str, str]:
    """The digests recorded for files under ``step`` and for the files it references, by path
    relative to it; forgotten here."""
    root = os.path.abspath(step) + os.sep
    with _lock:
        mine = {p: d for p, d in _written.items() if p.startswith(root)}
        for p in mine:
            del _written[p]
        references = _references.pop(os.path.abspath(step), {})
    return {**{Path(p[len(root) :]).as_posix(): d for p, d in mine.items()}, **references}


def complete(
    step: Path, sizes: Mapping[str, int], known: Mapping[str, str], read_limit: int = 1 << 20
) -> dict[str, str]:
    """Digests for every file of ``sizes``: ``known`` ones (hashed while written), and the
    others read now when they are small (Megatron-Core's index files) or the Hugging Face copy
    (written out of order). Large files nobody hashed while writing (Megatron-Core's own writer)
    get none: their size is still checked."""
    out = {}
    for name, size in sizes.items():
        if name in known:
            out[name] = known[name]
        elif size <= read_limit or name.startswith("huggingface/"):
            out[name] = hash_file(step / name)
    return dict(sorted(out.items()))


def check_hashes(
    step: str | os.PathLike[str],
    hashes: Mapping[str, str],
    skipped: Iterable[str] = (),
    threads: int = 4,
) -> list[str]:
    """The files of a committed step whose bytes differ from their digest at the commit.

    ``hashes`` is the ``hashes`` of the step's ``metadata.json``. Reads every hashed file
    whole, ``threads`` files at a time. ``skipped``: top-level directories not to read (e.g.
    ``optim`` for a load without the optimizer).

    Example::

        meta = markers.read_metadata(step)
        check_hashes(step, meta["hashes"])  # [] when no byte changed
    """
    root = Path(step)
    skip = set(skipped)
    names = [n for n in sorted(hashes) if n.split("/", 1)[0] not in skip]

    def check(name: str) -> str | None:
        try:
            file = in_step(root, name, f"{root / 'metadata.json'}'s hashes")
        except UnsafeNameError as err:
            return str(err)
        if remote_files.size_of(file) is None:
            return f"{file} is missing"
        actual = hash_file(file)
        if actual != hashes[name]:
            return (
                f"{file} is damaged: its bytes changed since the commit ({actual}, "
                f"{hashes[name]} when committed)"
            )
        return None

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="lmc-hash") as pool:
        return [problem for problem in pool.map(check, names) if problem is not None]
