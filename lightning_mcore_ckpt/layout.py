"""The on-disk layout of a checkpoint directory: step names, the commit marker, the tracker.

::

    <dirpath>/
      latest_checkpointed_iteration.txt   # newest committed step, written last, atomically
      global_step_<N>/
        model/ optim/ extra/ huggingface/
        metadata.json                     # written last, by rename: makes the step complete

A step directory without a readable ``metadata.json`` is *incomplete*: it does not exist for
``"last"``, listing or retention (other than being cleaned up once a newer step commits).
Everything here is pure file-system logic, safe to call from any one rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "METADATA_FILE",
    "METADATA_FORMAT_VERSION",
    "TRACKER_FILE",
    "StepDir",
    "complete_steps",
    "incomplete_steps",
    "is_complete",
    "read_metadata",
    "read_tracker",
    "remove_step",
    "resolve_checkpoint",
    "resolve_last",
    "retention_plan",
    "step_dir",
    "write_json_atomic",
    "write_text_atomic",
    "write_tracker",
]

log = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^global_step_(\d+)$")


@dataclass(frozen=True, order=True)
class StepDir:
    """A ``global_step_<N>`` directory: its step number and path."""

    step: int
    path: Path


def step_dir(dirpath: str | os.PathLike[str], step: int) -> Path:
    """The directory of ``step`` under ``dirpath``."""
    return Path(dirpath) / f"global_step_{step}"


def _fsync_dir(path: Path) -> None:
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


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` durably: temporary file, fsync, rename, fsync of the directory.

    A reader sees either the old file or the whole new one, never a partial write.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """:func:`write_text_atomic` of ``data`` as indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A step's ``metadata.json`` as a dict, or ``None`` when missing or unreadable."""
    try:
        with open(Path(path) / METADATA_FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether a step directory was committed (its ``metadata.json`` is in place and valid)."""
    return read_metadata(path) is not None


def _step_dirs(dirpath: Path) -> list[StepDir]:
    if not dirpath.is_dir():
        return []
    out = []
    for entry in dirpath.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir():
            out.append(StepDir(int(match.group(1)), entry))
    return sorted(out)


def complete_steps(dirpath: str | os.PathLike[str]) -> list[StepDir]:
    """The complete ``global_step_<N>`` directories under ``dirpath``, oldest first."""
    return [s for s in _step_dirs(Path(dirpath)) if is_complete(s.path)]


def incomplete_steps(dirpath: str | os.PathLike[str]) -> list[StepDir]:
    """The ``global_step_<N>`` directories without a commit marker, oldest first."""
    return [s for s in _step_dirs(Path(dirpath)) if not is_complete(s.path)]


def read_tracker(dirpath: str | os.PathLike[str]) -> int | None:
    """The step in ``latest_checkpointed_iteration.txt``, or ``None`` if missing or garbled."""
    try:
        text = (Path(dirpath) / TRACKER_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_tracker(dirpath: str | os.PathLike[str], step: int) -> None:
    """Point the tracker at ``step`` (atomically)."""
    write_text_atomic(Path(dirpath) / TRACKER_FILE, f"{step}\n")


def resolve_last(dirpath: str | os.PathLike[str]) -> Path | None:
    """The newest complete step under ``dirpath``, or ``None`` when there is none.

    The tracker is trusted when it names a complete step that is the newest complete one; when
    it is missing, garbled, points at an incomplete or missing step, or lags behind a newer
    complete step, the directory scan decides (with a warning saying why).
    """
    root = Path(dirpath)
    complete = complete_steps(root)
    newest = complete[-1] if complete else None
    tracked = read_tracker(root)
    if tracked is not None and newest is not None and tracked == newest.step:
        return newest.path
    if (root / TRACKER_FILE).exists():
        if tracked is None:
            why = f"{root / TRACKER_FILE} is unreadable"
        elif not is_complete(step_dir(root, tracked)):
            why = f"the tracker names global_step_{tracked}, which is incomplete or missing"
        else:
            why = f"the tracker names global_step_{tracked}, but a newer complete step exists"
        found = newest.path.name if newest is not None else "none"
        log.warning("%s; newest complete step by scan: %s", why, found)
    return newest.path if newest is not None else None


def _describe_complete(root: Path) -> str:
    names = [s.path.name for s in complete_steps(root)]
    return ", ".join(names) if names else "none"


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Resolve what a user passed as ``ckpt_path``: a step directory or a checkpoint ``dirpath``.

    A ``dirpath`` (no ``model/`` inside) resolves to its newest complete step. A step directory
    inside a managed ``dirpath`` (one with a tracker file or complete steps) must be complete.
    Raises ``FileNotFoundError`` naming the path and the complete steps that exist.
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path {p} does not exist or is not a directory")
    if (p / "model").is_dir() or (p / METADATA_FILE).exists():
        parent = p.parent
        managed = (parent / TRACKER_FILE).exists() or bool(complete_steps(parent))
        if managed and _STEP_RE.match(p.name) and not is_complete(p):
            raise FileNotFoundError(
                f"checkpoint {p} is incomplete ({METADATA_FILE} missing or unreadable: its save "
                f"never finished); complete steps in {parent}: {_describe_complete(parent)}. "
                "Pass one of them, or ckpt_path='last'"
            )
        return p
    newest = resolve_last(p)
    if newest is None:
        incomplete = [s.path.name for s in incomplete_steps(p)]
        extra = f" (incomplete, ignored: {', '.join(incomplete)})" if incomplete else ""
        raise FileNotFoundError(
            f"no complete checkpoint under {p}{extra}; pass a step directory, "
            "or ckpt_path='last' to start from scratch when there is none"
        )
    return newest


def _monitor_value(meta: Mapping[str, Any] | None, monitor: str) -> float | None:
    if not meta:
        return None
    entry = meta.get("monitor")
    if not isinstance(entry, Mapping) or entry.get("name") != monitor:
        return None
    value = entry.get("value")
    if not isinstance(value, int | float) or value != value:  # NaN never ranks
        return None
    return float(value)


def retention_plan(
    steps: Iterable[StepDir],
    *,
    max_to_keep: int | None,
    monitor: str | None = None,
    save_top_k: int = 1,
    mode: str = "min",
    protect: Iterable[int] = (),
) -> list[StepDir]:
    """Which complete steps to delete: all but the newest ``max_to_keep``, the top-k by
    ``monitor`` (read from each step's metadata) and the ``protect``-ed steps.

    With ``max_to_keep=None`` nothing is deleted. ``save_top_k=-1`` keeps every step that has a
    value for ``monitor``.
    """
    ordered = sorted(steps)
    if max_to_keep is None:
        return []
    keep = {s.step for s in ordered[-max_to_keep:]} if max_to_keep > 0 else set()
    keep |= set(protect)
    if monitor is not None and save_top_k != 0:
        scored = [
            (v, s.step)
            for s in ordered
            if (v := _monitor_value(read_metadata(s.path), monitor)) is not None
        ]
        scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], -vs[1]))
        ranked = scored if save_top_k < 0 else scored[:save_top_k]
        keep |= {step for _, step in ranked}
    return [s for s in ordered if s.step not in keep]


def remove_step(path: str | os.PathLike[str]) -> None:
    """Delete a step directory so that a crash midway leaves it *incomplete*, never damaged.

    The commit marker goes first (atomically), then the rest.
    """
    p = Path(path)
    if not _STEP_RE.match(p.name):
        raise ValueError(f"refusing to delete {p}: not a global_step_<N> directory")
    (p / METADATA_FILE).unlink(missing_ok=True)
    _fsync_dir(p)
    shutil.rmtree(p, ignore_errors=False)
