"""The on-disk layout of a checkpoint directory: step names, the commit marker, the tracker.

::

    <dirpath>/
      latest_checkpointed_iteration.txt   # newest committed step, written last, atomically
      .lightning_mcore_ckpt.lock          # one writer per directory (host, pid)
      global_step_<N>/
        .lightning_mcore_ckpt             # written first: this package started this step
        model/ optim/ extra/ huggingface/
        metadata.json                     # written last, by rename: makes the step complete

A step directory without a readable ``metadata.json`` is *incomplete*: it does not exist for
``"last"``, listing or retention (other than being cleaned up once a newer step commits, when it
carries this package's start marker). Everything here is pure file-system logic, safe to call
from any one rank.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import socket
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_FILE",
    "METADATA_FILE",
    "METADATA_FORMAT_VERSION",
    "STARTED_MARKER",
    "TRACKER_FILE",
    "DirectoryLock",
    "StepDir",
    "complete_steps",
    "incomplete_steps",
    "is_complete",
    "is_ours",
    "mark_step_started",
    "read_metadata",
    "read_tracker",
    "remove_step",
    "resolve_checkpoint",
    "resolve_last",
    "retention_plan",
    "step_dir",
    "step_number",
    "verify_step",
    "write_json_atomic",
    "write_text_atomic",
    "write_tracker",
]

log = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
STARTED_MARKER = ".lightning_mcore_ckpt"
LOCK_FILE = ".lightning_mcore_ckpt.lock"
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


def step_number(path: str | os.PathLike[str]) -> int | None:
    """The step of a ``global_step_<N>`` directory, or ``None`` for any other name.

    Example::

        step_number("checkpoints/run/global_step_100")  # 100
    """
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


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
    """A step's ``metadata.json`` as a dict, or ``None`` when missing or unreadable.

    Example::

        read_metadata("checkpoints/run/global_step_100")["total_time_s"]
    """
    try:
        with open(Path(path) / METADATA_FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether a step directory was committed (its ``metadata.json`` is in place and valid).

    Example::

        is_complete("checkpoints/run/global_step_100")
    """
    return read_metadata(path) is not None


def mark_step_started(path: str | os.PathLike[str]) -> None:
    """Create a step directory with this package's start marker (before anything is written)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        p / STARTED_MARKER,
        {
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        },
    )


def is_ours(path: str | os.PathLike[str]) -> bool:
    """Whether this package wrote a step directory (start marker, or its commit marker)."""
    p = Path(path)
    if (p / STARTED_MARKER).is_file():
        return True
    meta = read_metadata(p)
    return meta is not None and "format_version" in meta and "global_step" in meta


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
    """The complete ``global_step_<N>`` directories under ``dirpath``, oldest first.

    Example::

        [s.step for s in complete_steps("checkpoints/run")]  # e.g. [400, 500]
    """
    return [s for s in _step_dirs(Path(dirpath)) if is_complete(s.path)]


def incomplete_steps(dirpath: str | os.PathLike[str]) -> list[StepDir]:
    """The ``global_step_<N>`` directories without a commit marker, oldest first.

    Example::

        [s.path.name for s in incomplete_steps("checkpoints/run")]  # e.g. ["global_step_600"]
    """
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


def _verify_dist_checkpoint(directory: Path) -> list[str]:
    index = directory / ".metadata"
    if not index.is_file():
        return [f"{index} is missing"]
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unreadable index is a damaged checkpoint
        return [f"{index} is unreadable ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        shard = directory / name
        if not shard.is_file():
            problems.append(f"{shard} is missing")
        elif shard.stat().st_size < size:
            problems.append(f"{shard} is truncated ({shard.stat().st_size} of {size} bytes)")
    return problems


def verify_step(path: str | os.PathLike[str]) -> list[str]:
    """What is wrong with a step directory: missing or truncated files ([] when it is whole).

    Checks, without loading tensors: the commit marker; each dist-checkpoint's index and that
    every shard file it names exists with all the bytes it references; one readable
    ``extra/rank_<r>.pt`` per rank of the saving run.

    Example::

        problems = verify_step("checkpoints/run/global_step_100")
        # e.g. [".../model/__0_0.distcp is truncated (10 of 4096 bytes)"]
    """
    p = Path(path)
    meta = read_metadata(p)
    if meta is None:
        return [f"{p / METADATA_FILE} is missing or not valid JSON"]
    contents = meta.get("contents", ["model"])
    problems = []
    for sub, wanted in (("model", "model"), ("optim", "optimizer")):
        if wanted in contents:
            problems += _verify_dist_checkpoint(p / sub)
    if "extra" in contents:
        ranks = sorted((p / "extra").glob("rank_*.pt"))
        world = (meta.get("parallel_layout") or {}).get("world_size")
        if isinstance(world, int) and len(ranks) != world:
            problems.append(f"{p / 'extra'} has {len(ranks)} rank files, the save had {world}")
        for rank_file in ranks:
            if not zipfile.is_zipfile(rank_file):
                problems.append(f"{rank_file} is truncated or damaged")
    return problems


def resolve_last(dirpath: str | os.PathLike[str], verify: bool = True) -> Path | None:
    """The newest complete, undamaged step under ``dirpath``, or ``None`` when there is none.

    The tracker is trusted when it names a complete step that is the newest complete one; when
    it is missing, garbled, points at an incomplete or missing step, or lags behind a newer
    complete step, the directory scan decides (with a warning saying why). With ``verify``, a
    damaged step (see :func:`verify_step`) is skipped with a warning naming the file, and the
    previous complete step is taken.

    Example::

        step = resolve_last("checkpoints/run")  # .../global_step_<N>, or None
    """
    root = Path(dirpath)
    complete = complete_steps(root)
    newest = complete[-1] if complete else None
    tracked = read_tracker(root)
    if (root / TRACKER_FILE).exists() and not (
        tracked is not None and newest is not None and tracked == newest.step
    ):
        if tracked is None:
            why = f"{root / TRACKER_FILE} is unreadable"
        elif not is_complete(step_dir(root, tracked)):
            why = f"the tracker names global_step_{tracked}, which is incomplete or missing"
        else:
            why = f"the tracker names global_step_{tracked}, but a newer complete step exists"
        found = newest.path.name if newest is not None else "none"
        log.warning("%s; newest complete step by scan: %s", why, found)
    for candidate in reversed(complete):
        problems = verify_step(candidate.path) if verify else []
        if not problems:
            return candidate.path
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        log.warning(
            "skipping damaged %s: %s%s; trying the previous complete step",
            candidate.path,
            problems[0],
            more,
        )
    return None


def _describe_complete(root: Path) -> str:
    names = [s.path.name for s in complete_steps(root)]
    return ", ".join(names) if names else "none"


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """Resolve what a user passed as ``ckpt_path``: a step directory or a checkpoint ``dirpath``.

    A ``dirpath`` (no ``model/`` inside) resolves to its newest complete step. A step directory
    inside a managed ``dirpath`` (one with a tracker file or complete steps) must be complete.
    Raises ``FileNotFoundError`` naming the path and the complete steps that exist.

    Example::

        resolve_checkpoint("checkpoints/run")  # its newest complete step
        resolve_checkpoint("checkpoints/run/global_step_100")  # that step, if complete
    """
    p = Path(path)
    if not p.is_dir():
        parent = p.parent
        steps = _describe_complete(parent) if parent.is_dir() else f"{parent} does not exist"
        raise FileNotFoundError(
            f"checkpoint path {p} does not exist or is not a directory; complete steps in "
            f"{parent}: {steps}. Pass one of them, a checkpoint dirpath, or ckpt_path='last'"
        )
    if (p / "model").is_dir() or (p / METADATA_FILE).exists():
        parent = p.parent
        managed = (parent / TRACKER_FILE).exists() or bool(complete_steps(parent))
        if managed and _STEP_RE.match(p.name) and not is_complete(p):
            raise FileNotFoundError(
                f"checkpoint {p} is incomplete ({METADATA_FILE} missing or unreadable: its save "
                f"never finished); complete steps in {parent}: {_describe_complete(parent)}. "
                "Pass one of them, or ckpt_path='last'"
            )
        problems = verify_step(p) if is_complete(p) else _verify_dist_checkpoint(p / "model")
        if problems:
            listed = "\n  ".join(problems[:10])
            intact = [s.path.name for s in complete_steps(parent) if not verify_step(s.path)]
            raise FileNotFoundError(
                f"checkpoint {p} is damaged:\n  {listed}\ncomplete undamaged steps in {parent}: "
                f"{', '.join(intact) or 'none'}. Pass one of them, or ckpt_path='last' (which "
                "skips damaged steps)"
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
    if not is_ours(p):
        raise ValueError(
            f"refusing to delete {p}: it has no lightning-mcore-ckpt marker ({STARTED_MARKER} "
            f"or {METADATA_FILE}), so this package did not write it"
        )
    (p / METADATA_FILE).unlink(missing_ok=True)
    _fsync_dir(p)
    shutil.rmtree(p, ignore_errors=False)


class DirectoryLock:
    """One writer per checkpoint directory: ``<dirpath>/.lightning_mcore_ckpt.lock``.

    The lock file holds the owner's host, pid and process start time. A lock whose owner is
    gone is recovered with a warning: on the same host when the process no longer runs, on
    another host when its heartbeat (the file's mtime, refreshed by :meth:`heartbeat`) is older
    than ``stale_after_s``. Anything else is refused, naming the owner.

    Example::

        lock = DirectoryLock("checkpoints/run")
        lock.acquire()  # RuntimeError naming the owner if another run holds it
        try:
            ...
        finally:
            lock.release()
    """

    def __init__(self, dirpath: str | os.PathLike[str], stale_after_s: float = 300.0) -> None:
        self.path = Path(dirpath) / LOCK_FILE
        self.stale_after_s = stale_after_s
        self.owned = False

    @staticmethod
    def _me() -> dict[str, Any]:
        import psutil

        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "create_time": psutil.Process().create_time(),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }

    def _owner_alive(self, owner: Mapping[str, Any]) -> bool:
        import psutil

        if owner.get("host") == socket.gethostname():
            try:
                proc = psutil.Process(int(owner.get("pid", -1)))
                same = abs(proc.create_time() - float(owner.get("create_time", 0))) < 1.0
            except (psutil.Error, ValueError, TypeError):
                return False
            return same and proc.status() != psutil.STATUS_ZOMBIE
        try:
            import time

            return time.time() - self.path.stat().st_mtime < self.stale_after_s
        except OSError:
            return False

    def acquire(self) -> None:
        """Take the lock, or raise ``RuntimeError`` naming the run that holds it."""
        me = self._me()
        text = json.dumps(me, indent=2) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(self.path.read_text())
            except (OSError, ValueError):
                owner = {}
            if isinstance(owner, dict) and self._owner_alive(owner):
                raise RuntimeError(
                    f"{self.path.parent} is in use by another run (pid {owner.get('pid')} on "
                    f"{owner.get('host')}, since {owner.get('started_at')}): two runs writing "
                    "one directory would delete each other's checkpoints. Use another dirpath, "
                    f"or stop that run; if it is dead, delete {self.path}"
                ) from None
            log.warning(
                "recovering the stale lock %s of a run that is gone (pid %s on %s)",
                self.path,
                owner.get("pid") if isinstance(owner, dict) else "?",
                owner.get("host") if isinstance(owner, dict) else "?",
            )
            write_text_atomic(self.path, text)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        self.owned = True

    def heartbeat(self) -> None:
        """Refresh the lock's mtime (shows other hosts that the owner is alive)."""
        if self.owned:
            try:
                os.utime(self.path)
            except OSError as err:
                log.warning("could not refresh %s: %s", self.path, err)

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if not self.owned:
            return
        self.owned = False
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
