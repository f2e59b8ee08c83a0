"""``lightning-mcore-ckpt fsck``: is every step of a run (or one step) whole and unchanged?

The fast check reads no tensor data: the commit marker and its own digest, every file's
presence and size at the commit, each dist-checkpoint's index against its shard files, one
``extra/`` file per rank. ``deep`` also reads every file and compares its digest with the one
recorded at the commit (see :mod:`lightning_mcore_ckpt.format.integrity`).

Example::

    from lightning_mcore_ckpt.cli import fsck

    result = fsck.check("checkpoints/run", deep=True)
    for step in result.damaged:
        print(step.path, step.problems)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.cli.failure import fail
from lightning_mcore_ckpt.format import layout, markers

__all__ = ["FsckResult", "StepCheck", "add_parsers", "check"]


@dataclass
class StepCheck:
    """One step's verdict.

    Example::

        for step in fsck.check("checkpoints/run").steps:
            print(step.path.name, step.problems or "OK", f"{step.hashed}/{step.files} hashed")
    """

    path: Path
    problems: list[str]
    """What is wrong (``[]``: whole and, with ``deep``, unchanged)."""
    files: int = 0
    """Files its commit recorded."""
    hashed: int = 0
    """Of those, files with a digest (``0`` for steps committed before digests were kept)."""


@dataclass
class FsckResult:
    """What :func:`check` found.

    Example::

        result = fsck.check("checkpoints/run", deep=True)
        print([s.path.name for s in result.damaged], result.incomplete, result.notes)
    """

    steps: list[StepCheck] = field(default_factory=list)
    incomplete: list[Path] = field(default_factory=list)
    """Step directories that never committed (``"last"`` ignores them; not damage)."""
    notes: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> list[StepCheck]:
        return [s for s in self.steps if s.problems]


def _check_step(path: Path, deep: bool) -> StepCheck:
    meta = markers.read_metadata(path) or {}
    hashes = meta.get("hashes") if isinstance(meta.get("hashes"), dict) else {}
    files = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    problems = layout.verify_step(path, deep=deep)
    return StepCheck(path, problems, len(files or {}), len(hashes or {}))


def check(path: str | os.PathLike[str], deep: bool = False) -> FsckResult:
    """Check one step directory, or every complete step of a run directory.

    Raises ``FileNotFoundError`` when ``path`` is neither. A step directory named explicitly
    that never committed is damaged (nothing can load it).

    Example::

        result = check("checkpoints/run/global_step_100", deep=True)
        assert not result.damaged
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist or is not a directory")
    result = FsckResult()
    if (root / markers.METADATA_FILE).exists() or (root / layout.MODEL_DIR).is_dir():
        if not layout.is_complete(root):
            missing = f"{root / markers.METADATA_FILE} is missing or not valid JSON"
            result.steps.append(StepCheck(root, [f"{missing}: the save never committed"]))
        else:
            result.steps.append(_check_step(root, deep))
        return result
    steps = layout.complete_steps(root)
    result.incomplete = [s.path for s in layout.incomplete_steps(root)]
    result.steps = [_check_step(s.path, deep) for s in steps]
    tracked = layout.read_tracker(root)
    if (root / layout.TRACKER_FILE).exists():
        newest = steps[-1].step if steps else None
        if tracked is None:
            result.notes.append(f"{root / layout.TRACKER_FILE} is unreadable")
        elif tracked != newest:
            result.notes.append(
                f"{root / layout.TRACKER_FILE} names {layout.step_name(tracked)}; the newest "
                f"complete step is {layout.step_name(newest) if newest is not None else 'none'}"
            )
    if not steps:
        result.notes.append(f"no complete step under {root}")
    return result


def add_parsers(commands: Any) -> None:
    """Add ``fsck`` to the command line's subparsers."""
    fsck = commands.add_parser(
        "fsck",
        help="check every step of a run (or one step) for missing, short or changed files",
        description="Check the complete steps of a MegatronCheckpoint directory, or one step "
        "directory, without loading tensors: the commit marker, every file's presence and "
        "size at the commit, the dist-checkpoint indexes and shard files, one extra/ file per "
        "rank. --deep also reads every file and compares its hash with the one recorded at the "
        "commit. Exit code 1 when any step is damaged (each step and file named), 0 otherwise.",
    )
    fsck.add_argument("path", help="a MegatronCheckpoint dirpath or one global_step_<N>/")
    fsck.add_argument(
        "--deep", action="store_true", help="also re-hash every file (reads the whole step)"
    )
    fsck.set_defaults(handler=_fsck)


def _fsck(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        result = check(args.path, deep=args.deep)
    except FileNotFoundError as err:
        return fail(err)
    for step in result.steps:
        if step.problems:
            print(f"{step.path.name}  DAMAGED")
            for problem in step.problems:
                print(f"    {problem}")
            continue
        if args.deep and step.hashed:
            how = f"{step.hashed} of {step.files} files re-hashed"
        elif args.deep:
            how = "no hashes recorded (committed before they were kept): sizes checked"
        else:
            how = f"{step.files} files: sizes and structure"
        print(f"{step.path.name}  OK ({how})")
    for stale in result.incomplete:
        print(f"{stale.name}  incomplete (never committed; ignored by 'last')")
    for note in result.notes:
        print(f"note: {note}")
    damaged = [s.path.name for s in result.damaged]
    if damaged:
        print(f"FAILED: {len(damaged)} damaged step(s): {', '.join(damaged)}")
        return 1
    if not result.steps:
        return 1
    print(f"OK: {len(result.steps)} step(s) checked{' (deep)' if args.deep else ''}")
    return 0
