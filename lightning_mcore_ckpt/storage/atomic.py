"""Durable, atomic writes: the one helper every writer of this package uses.

A reader sees either the old file (or directory) or the whole new one, never a partial write,
and what a rename made visible survives a power cut: file contents are fsynced before the
rename, the parent directory after it.

- :func:`write_bytes` / :func:`write_text` / :func:`write_json`: one file.
- :func:`staged_directory`: a directory written under a temporary sibling name, fsynced, and
  renamed into place (replacing an existing one only when asked).
- :func:`leftovers`: the temporary files of :func:`write_with` that a killed writer left.

Imports nothing from the package.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = [
    "fsync_dir",
    "fsync_tree",
    "leftovers",
    "staged_directory",
    "write_bytes",
    "write_json",
    "write_text",
    "write_with",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that renames and new entries in it are durable.

    Filesystems that cannot fsync a directory (some network filesystems) are tolerated.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> dict[str, int]:
    """Make everything under ``path`` durable: every file, then every directory, deepest first.

    Symbolic links are neither followed nor synced. Returns the size in bytes of each file, by
    its path relative to ``path`` (``/``-separated), as it was when synced.

    Example::

        sizes = fsync_tree("checkpoints/run/global_step_100")  # {"model/.metadata": 1234, ...}
    """
    root = Path(path)
    directories: list[Path] = []
    sizes: dict[str, int] = {}
    for current, dirs, files in os.walk(root):
        here = Path(current)
        directories.append(here)
        dirs.sort()
        for name in sorted(files):
            file = here / name
            if file.is_symlink():
                continue
            with open(file, "rb") as f:
                os.fsync(f.fileno())
                sizes[file.relative_to(root).as_posix()] = os.fstat(f.fileno()).st_size
    for directory in reversed(directories):
        fsync_dir(directory)
    return sizes


def write_with(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` durably and atomically: ``write(f)`` into a temporary sibling, fsync,
    rename over ``path``, fsync of the directory. On any error the temporary file is removed and
    ``path`` is untouched."""
    target = Path(path)
    tmp = target.with_name(f"{_temporary_prefix(target)}{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.tmp."


def leftovers(path: str | os.PathLike[str]) -> list[Path]:
    """The temporary siblings of ``path`` that :func:`write_with` made and never renamed: a
    writer killed between its write and its rename (an error removes its own). Only whoever
    knows that nobody else is writing ``path`` now may delete them."""
    target = Path(path)
    prefix = _temporary_prefix(target)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return sorted(target.parent / n for n in names if n.startswith(prefix))


def write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> None:
    """:func:`write_with` of ``data``."""
    write_with(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`write_with` of ``text`` as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """:func:`write_text` of ``data`` as indented, key-sorted JSON."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def staged_directory(target: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary sibling name; on success it becomes ``target``.

    Yields the temporary directory to write into. When the block ends without an error, every
    file and directory in it is fsynced, it is renamed to ``target`` and the parent directory is
    fsynced: ``target`` appears whole or not at all. With ``replace=True`` an existing
    ``target`` is swapped out (renamed aside, then removed once the new one is in place);
    without it an existing ``target`` is an error, raised before anything is written. On an
    error the temporary directory is removed and ``target`` is untouched.

    Example::

        with staged_directory("out/huggingface", replace=True) as tmp:
            (tmp / "config.json").write_text("{}")
    """
    final = Path(target)
    if final.exists() and not replace:
        raise FileExistsError(f"{final} already exists; remove it or pass replace=True")
    final.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    partial = final.with_name(f".{final.name}.partial.{tag}")
    partial.mkdir()
    try:
        yield partial
        fsync_tree(partial)
        if final.exists():
            old = final.with_name(f".{final.name}.old.{tag}")
            final.rename(old)
            partial.rename(final)
            fsync_dir(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
