"""Promise 10: after a power cut, "last" never names a step with a file missing.

A real 2-rank training run saves, commits and applies retention under ``strace -f``; the
system calls of every process (both ranks, their background writers and commit threads) are
then checked for the order that makes a step survive a power cut:

1. every file of the step fsynced (directly, or as the temporary file renamed onto it);
2. then each of its directories fsynced, after the last entry was created or renamed into it,
   and the run directory (the step's own entry);
3. then the commit marker (``metadata.json``) renamed into place, and the step fsynced again;
4. then the tracker renamed into place and the run directory fsynced;
5. and only after that, retention deletes anything.

It does not cover a disk or file system that lies about fsync (write caches without
power-loss protection), or network file systems that cannot fsync a directory.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt import layout

pytestmark = pytest.mark.timeout(900)

STRACE = shutil.which("strace")
if STRACE is None and os.environ.get("CI"):
    raise RuntimeError("strace is required in CI (.ci/run installs it)")
needs_strace = pytest.mark.skipif(STRACE is None, reason="strace is not installed")

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")
_DURATION = re.compile(r"<(\d+\.\d+)>\s*$")
_FD_PATH = re.compile(r"^\w+\(\d+<([^>]*)>")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_DIRFD = re.compile(r"^\w+\((?:AT_FDCWD|\d+)(?:<([^>]*)>)?,")


@dataclass
class Call:
    name: str
    start: float
    end: float
    paths: list[str]


def _parse(trace: str) -> list[Call]:
    """The successful fsync/rename/unlink/rmdir/mkdir calls of an ``strace -f -y -ttt -T``."""
    calls, unfinished = [], {}
    for raw in trace.splitlines():
        match = _LINE.match(raw)
        if match is None:
            continue
        pid, when, text = match.group(1), float(match.group(2)), match.group(3)
        if text.endswith("<unfinished ...>"):
            unfinished[pid] = (when, text[: -len("<unfinished ...>")].rstrip())
            continue
        resumed = re.match(r"^<\.\.\. (\w+) resumed>(.*)$", text)
        if resumed is not None:
            if pid not in unfinished:
                continue
            start, head = unfinished.pop(pid)
            text, end = head + resumed.group(2), when
        else:
            start = when
            duration = _DURATION.search(text)
            end = start + (float(duration.group(1)) if duration else 0.0)
        name = text.split("(", 1)[0]
        if not re.search(r"\)\s+=\s+0\b", text):  # failed calls made nothing durable
            continue
        calls.append(Call(name, start, end, _paths(name, text)))
    return sorted(calls, key=lambda c: c.start)


def _paths(name: str, text: str) -> list[str]:
    if name in ("fsync", "fdatasync"):
        found = _FD_PATH.match(text)
        return [found.group(1)] if found else []
    strings = _STRING.findall(text)
    if name in ("unlinkat", "mkdirat") and strings and not strings[0].startswith("/"):
        base = _DIRFD.match(text)
        if base and base.group(1):
            return [os.path.join(base.group(1), strings[0])]
    return strings


def _traced_run(tmp: Path, async_save: bool) -> tuple[list[Call], Path]:
    options = {"tp": 2, "async_save": async_save, "max_to_keep": 2}
    code = (
        "import sys\n"
        "from _faulty import train\n"
        "from lightning_mcore_ckpt.testing import run_distributed\n"
        f"run_distributed(train, 2, {str(tmp)!r}, None, {options!r}, timeout=540)\n"
    )
    out = tmp / "strace.txt"
    syscalls = "fsync,fdatasync,rename,renameat,renameat2,unlink,unlinkat,rmdir,mkdir,mkdirat"
    command = [STRACE, "-f", "-qq", "-y", "-ttt", "-T", "--seccomp-bpf", "-e", f"trace={syscalls}"]
    command += ["-e", "signal=none", "-o", str(out), sys.executable, "-c", code]
    # The environment carries the test helpers' path (conftest.py).
    done = subprocess.run(command, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    return _parse(out.read_text()), tmp / "ckpt"


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def traced(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Call], Path]:
    if STRACE is None:
        pytest.skip("strace is not installed")
    return _traced_run(tmp_path_factory.mktemp("traced"), request.param)


def _first(calls: list[Call], name: tuple[str, ...], path: str, after: float = 0.0) -> Call:
    for call in calls:
        if call.name in name and call.start >= after and path in call.paths:
            return call
    raise AssertionError(f"no {'/'.join(name)} of {path} after {after}")


RENAMES = ("rename", "renameat", "renameat2")
FSYNCS = ("fsync", "fdatasync")


def _durable_at(calls: list[Call], file: str) -> float:
    """When ``file``'s contents were last made durable under its final name: its own fsync, or
    the fsync of the temporary file that was then renamed onto it."""
    best = None
    for call in calls:
        if call.name in FSYNCS and call.paths == [file]:
            best = call.end if best is None else min(best, call.end)
        if call.name in RENAMES and len(call.paths) >= 2 and call.paths[1] == file:
            synced = [c.end for c in calls if c.name in FSYNCS and c.paths == [call.paths[0]]]
            if synced and min(synced) <= call.start:
                best = call.end if best is None else min(best, call.end)
    assert best is not None, f"{file} was never fsynced"
    return best


@needs_strace
def test_a_step_is_durable_before_its_marker_and_the_tracker_before_retention(
    traced: tuple[list[Call], Path],
) -> None:
    calls, root = traced
    steps = [s for s in layout.complete_steps(root)]
    assert [s.step for s in steps] == [4, 6]  # max_to_keep=2: step 2 was deleted
    for step in steps:
        marker = str(step.path / layout.METADATA_FILE)
        commit = next(
            c for c in calls if c.name in RENAMES and len(c.paths) > 1 and c.paths[1] == marker
        )
        files = sorted(
            p for p in step.path.rglob("*") if p.is_file() and p.name != layout.METADATA_FILE
        )
        assert any(f.parent.name == "extra" and f.name.startswith("rank_00001") for f in files)
        # 1. Every file of every rank (shards, indexes, metadata.json of model/ and optim/,
        #    extra/, the start marker), durable before the marker.
        last_file = 0.0
        for file in files:
            durable = _durable_at(calls, str(file))
            assert durable <= commit.start, f"{file} fsynced after the commit marker"
            last_file = max(last_file, durable)
        # 2. Each directory after the entries in it, then the run directory's entry for the step.
        directories = sorted({f.parent for f in files} | {step.path}, key=lambda d: -len(d.parts))
        for directory in directories:
            inside = [f for f in files if f.parent == directory]
            entries = [_durable_at(calls, str(f)) for f in inside] or [0.0]
            synced = _first(calls, FSYNCS, str(directory), after=max(entries))
            assert synced.end <= commit.start, f"{directory} fsynced after the commit marker"
        own_entry = _first(calls, FSYNCS, str(root), after=last_file)
        assert own_entry.end <= commit.start, "the step's entry in the run directory"
        # 3. The marker itself durable (its directory fsynced after the rename) ...
        marker_durable = _first(calls, FSYNCS, str(step.path), after=commit.end)
        # 4. ... before the tracker moves to it; then the tracker durable.
        tracker = _first(calls, RENAMES, str(root / layout.TRACKER_FILE), after=commit.end)
        assert marker_durable.end <= tracker.start
        _first(calls, FSYNCS, str(root), after=tracker.end)
    # 5. Retention deleted step 2 only once a newer step's tracker update was durable.
    gone = str(layout.step_dir(root, 2))
    deletions = [
        c
        for c in calls
        if c.name in ("unlink", "unlinkat", "rmdir") and any(p.startswith(gone) for p in c.paths)
    ]
    assert deletions, "step 2 was never deleted"
    tracker_4 = _first(
        calls,
        RENAMES,
        str(root / layout.TRACKER_FILE),
        after=_first(calls, RENAMES, str(layout.step_dir(root, 4) / layout.METADATA_FILE)).end,
    )
    tracker_4_durable = _first(calls, FSYNCS, str(root), after=tracker_4.end)
    assert tracker_4_durable.end <= min(c.start for c in deletions)


@needs_strace
def test_the_damage_check_covers_every_file_of_a_step(traced: tuple[list[Call], Path]) -> None:
    # Each file of a real step (both ranks' shards and extra/, both dist-checkpoints' indexes
    # and metadata.json, the start marker), removed or cut short in turn, is named.
    _, root = traced
    step = layout.complete_steps(root)[-1].path
    assert layout.verify_step(step) == []
    manifest = layout.read_metadata(step)["files"]  # type: ignore[index]
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {layout.METADATA_FILE}
    for name in sorted(manifest):
        file = step / name
        data = file.read_bytes()
        file.unlink()
        assert any(str(file) in problem for problem in layout.verify_step(step)), name
        file.write_bytes(data[:-1])
        assert any(str(file) in problem for problem in layout.verify_step(step)), name
        file.write_bytes(data)
    assert layout.verify_step(step) == []
