"""Which steps to delete, and the one safe way to delete a step."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format.layout import (
    MODEL_DIR,
    OPTIM_DIR,
    SHARED_DIR,
    StepDir,
    step_number,
)
from lightning_mcore_ckpt.format.markers import (
    METADATA_FILE,
    STARTED_MARKER,
    is_ours,
    read_metadata,
)
from lightning_mcore_ckpt.safety import safe_dcp as _safe_dcp
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = [
    "collect_shared",
    "remove_step",
    "retention_plan",
    "shared_references",
    "unreferenced_shared",
]


def retention_plan(
    steps: Iterable[StepDir],
    *,
    max_to_keep: int | None,
    remove: Iterable[str | os.PathLike[str]] = (),
    keep: Iterable[str | os.PathLike[str]] = (),
    protect: Iterable[int] = (),
) -> list[StepDir]:
    """Which complete steps to delete, oldest first.

    A step is deleted when it was asked for in ``remove`` (Lightning's top-k and "last"
    bookkeeping let it go) or is older than the newest ``max_to_keep`` (``None``: no limit),
    unless it is kept: among the newest ``max_to_keep``, in ``keep`` (the steps Lightning's
    bookkeeping still names) or its number is in ``protect``.

    Example::

        retention_plan(complete_steps(root), max_to_keep=2)  # all but the newest two
    """
    ordered = sorted(steps)
    kept_paths = {Path(p) for p in keep}
    kept = set(protect)
    if max_to_keep is not None:
        kept |= {s.step for s in ordered[-max_to_keep:]} if max_to_keep > 0 else set()
    asked = {Path(p) for p in remove}
    doomed = []
    for s in ordered:
        if s.step in kept or s.path in kept_paths:
            continue
        beyond = max_to_keep is not None and s.step not in kept
        if beyond or s.path in asked:
            doomed.append(s)
    return doomed


def remove_step(path: str | os.PathLike[str], *, any_name: bool = False) -> None:
    """Delete a step directory so that a crash midway leaves it *incomplete*, never damaged.

    The commit marker goes first (atomically), then the rest. Refuses (``ValueError``) a
    directory not named ``global_step_<N>`` (unless ``any_name``: a path Lightning's
    ``ModelCheckpoint`` named, such as ``epoch=0-step=12.ckpt``) or without this package's
    markers.

    Example::

        remove_step("checkpoints/run/global_step_100")
    """
    p = Path(path)
    if p.is_symlink():
        raise ValueError(f"refusing to delete {p}: it is a symbolic link, not a step directory")
    if step_number(p) is None and not any_name:
        raise ValueError(f"refusing to delete {p}: not a global_step_<N> directory")
    if not is_ours(p):
        raise ValueError(
            f"refusing to delete {p}: it has no lightning-mcore-ckpt marker ({STARTED_MARKER} "
            f"or {METADATA_FILE}), so this package did not write it"
        )
    (p / METADATA_FILE).unlink(missing_ok=True)
    _atomic.fsync_dir(p)
    shutil.rmtree(p, ignore_errors=False)
    collect_shared(p.parent)


def shared_references(metadata: dict[str, Any]) -> set[str]:
    """The names of the ``shared/`` files a step's commit marker (its ``metadata.json``) lists."""
    prefix = f"../{SHARED_DIR}/"
    return {n.rsplit("/", 1)[1] for n in metadata.get("files") or {} if n.startswith(prefix)}


def unreferenced_shared(names: Iterable[str], referenced: set[str], writers: set[str]) -> list[str]:
    """Of the ``shared/`` file names ``names``, those to delete: none of the ``referenced``,
    and not written by a step that still exists (a file's name starts with its writer's
    directory name, one of ``writers``): a save in flight writes its new shared files before
    its index names them. Used for a directory and for a store alike."""
    return [n for n in names if n not in referenced and n.split("-", 1)[0] not in writers]


def _references(step: Path) -> set[str]:
    """The names of the ``shared/`` files a step directory points at (committed or not)."""
    names = shared_references(read_metadata(step) or {})
    for part in (MODEL_DIR, OPTIM_DIR):  # a save not committed yet has no metadata.json
        if (step / part / ".metadata").is_file():
            try:
                index = _safe_dcp.read_dcp_metadata(step / part)
            except Exception:  # noqa: BLE001 - unreadable: it references nothing loadable
                continue
            for info in (index.storage_data or {}).values():
                if info.relative_path.startswith(f"../../{SHARED_DIR}/"):
                    names.add(info.relative_path.rsplit("/", 1)[1])
    return names


def collect_shared(dirpath: str | os.PathLike[str]) -> list[Path]:
    """Delete the files of ``dirpath``'s ``shared/`` store (tensors written once, see
    ``MegatronStrategy(ckpt_dedup=True)``) that no step directory references any more.

    A file is kept while a step directory points at it, or while the step that wrote it (its
    name starts with that step's directory name) still exists: a save in flight writes its new
    shared files before its index names them. Returns the deleted files.

    Example::

        collect_shared("checkpoints/run")  # [] when every shared file is still referenced
    """
    root = Path(dirpath)
    shared = root / SHARED_DIR
    if not shared.is_dir():
        return []
    steps = [d for d in root.iterdir() if d.is_dir() and step_number(d) is not None]
    keep = set().union(*(_references(d) for d in steps)) if steps else set()
    writers = {d.name for d in steps}
    files = {file.name: file for file in sorted(shared.iterdir())}
    deleted = [files[name] for name in unreferenced_shared(files, keep, writers)]
    for file in deleted:
        file.unlink()
    if deleted:
        _atomic.fsync_dir(shared)
    return deleted
