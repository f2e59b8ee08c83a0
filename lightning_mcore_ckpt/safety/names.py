"""A name read from outside becomes a path only after it is checked.

Names reach us from places we do not control: an object store's listing (anyone who can write
to the bucket chose them), a commit marker's or a fast-tier seal's file list, a peer's message,
a Hugging Face index's ``weight_map``. Joined onto a directory unchecked, ``../x`` or ``a//abs``
(``pathlib`` makes the second absolute) writes or reads outside it.

A name is accepted when it is a relative POSIX path whose every segment is a plain name: not
empty, not ``.`` or ``..``, without a backslash or a NUL; and when the path it makes, symbolic
links resolved, stays inside its directory (a link planted in a view cannot lead out). Anything
else raises :class:`UnsafeNameError`, which names where the name came from.

Imports nothing from the package.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["UnsafeNameError", "check_name", "in_step", "inside", "inside_all"]


class UnsafeNameError(ValueError):
    """A name read from outside (a listing, a marker, a seal, a peer, an index) would leave
    the directory it names a file of."""


def check_name(name: object, source: str) -> str:
    """``name`` itself when it is a plain relative name (see the module); else
    :class:`UnsafeNameError` naming ``source`` (where the name was read)."""
    if not isinstance(name, str):
        raise UnsafeNameError(f"{source} names a file by {name!r}, which is not a string")
    bad = _what_is_wrong(name)
    if bad is not None:
        raise UnsafeNameError(
            f"{source} names the file {name!r}, which {bad}: refused (nothing was read or "
            "written for it). A checkpoint's names are relative paths inside it; someone may "
            "have altered this listing or file"
        )
    return name


def inside(root: str | os.PathLike[str], name: object, source: str) -> Path:
    """``root / name`` once ``name`` is checked (:func:`check_name`) and the path, links
    resolved, stays inside ``root``; else :class:`UnsafeNameError` naming ``source``.

    Example::

        inside(view, "global_step_100/metadata.json", "s3://ckpts/run1's listing")
        inside(view, "../etc/passwd", "s3://ckpts/run1's listing")  # UnsafeNameError
    """
    base = Path(root)
    path = base / check_name(name, source)
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if os.path.commonpath([real_base, real]) != real_base:
        raise UnsafeNameError(
            f"{source} names the file {name!r}, which resolves to {real}, outside {real_base} "
            "(a symbolic link on the way leads out): refused"
        )
    return path


def inside_all(root: str | os.PathLike[str], names: Iterable[object], source: str) -> list[Path]:
    """:func:`inside` for every name, all checked before any is used."""
    return [inside(root, name, source) for name in list(names)]


def _what_is_wrong(name: str) -> str | None:
    if not name:
        return "is empty"
    if "\x00" in name or "\\" in name:
        return "holds a NUL or a backslash"
    if name.startswith("/"):
        return "is absolute"
    for segment in name.split("/"):
        if segment == "":
            return "has an empty segment ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"has a '{segment}' segment"
    return None


def in_step(
    step: str | os.PathLike[str], name: object, source: str, shared: str = "shared"
) -> Path:
    """The path of a file a step's records name (its commit marker's ``files`` and
    ``hashes``): inside the step, or ``../<shared>/<one name>`` (a file written once for the
    run, beside the steps); else :class:`UnsafeNameError` naming ``source``."""
    prefix = f"../{shared}/"
    if isinstance(name, str) and name.startswith(prefix) and "/" not in name[len(prefix) :]:
        return inside(Path(step).parent / shared, name[len(prefix) :], source)
    return inside(step, name, source)
