"""Promise 10: after a power cut, "last" never names a step with a file missing.

A real 2-rank training run saves, commits and applies retention under ``strace -f``; the
system calls of every process (both ranks, their background writers and commit threads) are
then checked for the order that makes a step survive a power cut:

1. every file of the step fsynced after the last write to it (``write``, ``pwrite64``,
   ``writev``, ``ftruncate``, an ``open`` with ``O_TRUNC``... through any descriptor, in any
   process), directly or as the temporary file renamed onto it: its *last* write precedes
   its *last* fsync, which precedes the commit marker;
2. then each of its directories fsynced, after the last entry was created or renamed into it,
   and the run directory (the step's own entry);
3. then the commit marker (``metadata.json``) renamed into place, and the step fsynced again;
4. then the tracker renamed into place and the run directory fsynced;
5. and only after that, retention deletes anything.

Which file a call touched is followed by name, as the kernel follows an inode: ``strace -y``
names each descriptor's file at the time of the call, and a rename carries the file's history
(its writes and fsyncs) to its new name. The checker itself is tested on crafted traces: a
file written again after its fsync, by any of those calls, is caught.

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

from lightning_mcore_ckpt.format import layout, markers

pytestmark = pytest.mark.timeout(900)

STRACE = shutil.which("strace")
if STRACE is None and os.environ.get("CI"):
    raise RuntimeError("strace is required in CI (.ci/run installs it)")
needs_strace = pytest.mark.skipif(STRACE is None, reason="strace is not installed")

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")
_DURATION = re.compile(r"<(\d+\.\d+)>\s*$")
_FD_PATHS = re.compile(r"(?:^\w+\(|,\s*)\d+<([^>]*)>")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_DIRFD = re.compile(r"^\w+\((?:AT_FDCWD|\d+)(?:<([^>]*)>)?,")
_RETURNED_PATH = re.compile(r"\)\s+=\s+\d+<([^>]*)>")
_SUCCEEDED = re.compile(r"\)\s+=\s+\d+")  # failed calls return -1 (and changed nothing)

RENAMES = ("rename", "renameat", "renameat2")
FSYNCS = ("fsync", "fdatasync")
OPENS = ("open", "openat", "openat2", "creat")
WRITES = (
    "write",
    "pwrite64",
    "writev",
    "pwritev",
    "pwritev2",
    "ftruncate",
    "truncate",
    "fallocate",
    "sendfile",
    "copy_file_range",
)
"""Calls that change a file's contents (an ``open`` with ``O_TRUNC`` too: it is parsed as
``"truncating-open"``)."""
DELETIONS = ("unlink", "unlinkat", "rmdir")
TRACED = (*FSYNCS, *RENAMES, *DELETIONS, "mkdir", "mkdirat", *OPENS, *WRITES)


@dataclass
class Call:
    name: str
    start: float
    end: float
    paths: list[str]


def _parse(trace: str, under: str = "/") -> list[Call]:
    """The successful calls of an ``strace -f -y -ttt -T`` (names in :data:`TRACED`) that touch
    a path under ``under``, in the order they started."""
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
        if name not in TRACED or not _SUCCEEDED.search(text):
            continue
        if name in OPENS:
            if "O_TRUNC" not in text:
                continue  # opening changes nothing; creating is the directory's business
            name = "truncating-open"
        paths = _paths(name, text)
        if any(path.startswith(under) for path in paths):
            calls.append(Call(name, start, end, paths))
    return sorted(calls, key=lambda c: c.start)


def _paths(name: str, text: str) -> list[str]:
    if name == "truncating-open":  # the file the returned descriptor names
        found = _RETURNED_PATH.search(text)
        return [found.group(1)] if found else []
    if name in FSYNCS or (name in WRITES and name != "truncate"):
        fds = _FD_PATHS.findall(text)
        # copy_file_range(in, off, out, ...) writes its second descriptor; the others the first.
        return fds[1:2] if name == "copy_file_range" else fds[:1]
    strings = _STRING.findall(text)
    if name in ("unlinkat", "mkdirat") and strings and not strings[0].startswith("/"):
        base = _DIRFD.match(text)
        if base and base.group(1):
            return [os.path.join(base.group(1), strings[0])]
    return strings


@dataclass
class History:
    """What happened to one file (an inode, followed through renames): its writes and fsyncs."""

    writes: list[Call]
    fsyncs: list[Call]


def _histories(calls: list[Call]) -> dict[str, History]:
    """The file each path names at the end of ``calls``, with everything done to it under any
    name: a rename moves a history to its new name (replacing what was there; a directory's
    rename moves what is under it), a deletion forgets it; a path first seen in a write or
    fsync starts one."""
    at: dict[str, History] = {}
    for call in calls:
        if call.name in RENAMES and len(call.paths) >= 2:
            source, target = call.paths[0], call.paths[1]
            for path in [p for p in at if p == target or p.startswith(target + "/")]:
                del at[path]  # replaced
            for path in [p for p in at if p == source or p.startswith(source + "/")]:
                at[target + path[len(source) :]] = at.pop(path)
        elif call.name in ("unlink", "unlinkat") and call.paths:
            at.pop(call.paths[0], None)
        elif call.name in WRITES or call.name == "truncating-open":
            if call.paths:
                at.setdefault(call.paths[0], History([], [])).writes.append(call)
        elif call.name in FSYNCS and call.paths:
            at.setdefault(call.paths[0], History([], [])).fsyncs.append(call)
    return at


def _durable_at(histories: dict[str, History], file: str) -> float:
    """When ``file``'s contents became durable: the end of its last fsync (under this name or a
    name it was renamed from), which must follow its last write."""
    history = histories.get(file)
    assert history is not None and history.fsyncs, f"{file} was never fsynced"
    last_fsync = max(history.fsyncs, key=lambda c: c.end)
    if history.writes:
        last_write = max(history.writes, key=lambda c: c.end)
        assert last_write.end <= last_fsync.start, (
            f"{file} was written ({last_write.name}) after its last fsync: "
            f"{last_write.end:.6f} > {last_fsync.start:.6f}"
        )
    return last_fsync.end


def _traced_run(tmp: Path, async_save: bool) -> tuple[list[Call], Path]:
    options = {"tp": 2, "async_save": async_save, "max_to_keep": 2}
    code = (
        "import sys\n"
        "from _faulty import train\n"
        "from lightning_mcore_ckpt.testing import run_distributed\n"
        f"run_distributed(train, 2, {str(tmp)!r}, None, {options!r}, timeout=540)\n"
    )
    out = tmp / "strace.txt"
    syscalls = ",".join(TRACED)
    command = [STRACE, "-f", "-qq", "-y", "-ttt", "-T", "--seccomp-bpf", "-e", f"trace={syscalls}"]
    command += ["-e", "signal=none", "-o", str(out), sys.executable, "-c", code]
    # The environment carries the test helpers' path (conftest.py).
    done = subprocess.run(command, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    root = tmp / "ckpt"
    return _parse(out.read_text(), under=str(root)), root


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


@needs_strace
def test_a_step_is_durable_before_its_marker_and_the_tracker_before_retention(
    traced: tuple[list[Call], Path],
) -> None:
    calls, root = traced
    histories = _histories(calls)
    steps = [s for s in layout.complete_steps(root)]
    assert [s.step for s in steps] == [4, 6]  # max_to_keep=2: step 2 was deleted
    for step in steps:
        marker = str(step.path / markers.METADATA_FILE)
        commit = next(
            c for c in calls if c.name in RENAMES and len(c.paths) > 1 and c.paths[1] == marker
        )
        files = sorted(
            p for p in step.path.rglob("*") if p.is_file() and p.name != markers.METADATA_FILE
        )
        assert any(f.parent.name == "extra" and f.name.startswith("rank_00001") for f in files)
        # 1. Every file of every rank (shards, indexes, metadata.json of model/ and optim/,
        #    extra/, the start marker), written, then fsynced, before the marker.
        last_file = 0.0
        for file in files:
            assert histories[str(file)].writes, f"{file}: no write traced"
            durable = _durable_at(histories, str(file))
            assert durable <= commit.start, f"{file} fsynced after the commit marker"
            last_file = max(last_file, durable)
        # 2. Each directory after the entries in it, then the run directory's entry for the step.
        directories = sorted({f.parent for f in files} | {step.path}, key=lambda d: -len(d.parts))
        for directory in directories:
            inside = [f for f in files if f.parent == directory]
            entries = [_durable_at(histories, str(f)) for f in inside] or [0.0]
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
        c for c in calls if c.name in DELETIONS and any(p.startswith(gone) for p in c.paths)
    ]
    assert deletions, "step 2 was never deleted"
    tracker_4 = _first(
        calls,
        RENAMES,
        str(root / layout.TRACKER_FILE),
        after=_first(calls, RENAMES, str(layout.step_dir(root, 4) / markers.METADATA_FILE)).end,
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
    manifest = markers.read_metadata(step)["files"]  # type: ignore[index]
    on_disk = {p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file()}
    assert set(manifest) == on_disk - {markers.METADATA_FILE}
    for name in sorted(manifest):
        file = step / name
        data = file.read_bytes()
        file.unlink()
        assert any(str(file) in problem for problem in layout.verify_step(step)), name
        file.write_bytes(data[:-1])
        assert any(str(file) in problem for problem in layout.verify_step(step)), name
        file.write_bytes(data)
    assert layout.verify_step(step) == []


# --- the checker itself, on crafted traces ---------------------------------------------------

_FILE = "/r/ckpt/global_step_2/model/__0_0.distcp"
_TMP = _FILE + ".tmp"
_WRITTEN = [  # created, written and fsynced by one process
    f'7 1.0 openat(AT_FDCWD</r>, "{_FILE}", O_WRONLY|O_CREAT|O_TRUNC|O_CLOEXEC, 0666) = 5<{_FILE}>',
    f'7 1.1 write(5<{_FILE}>, "PK\\3\\4"..., 4096) = 4096 <0.000010>',
    f"7 1.2 fsync(5<{_FILE}>) = 0 <0.001000>",
]
# Each a write of the file after its fsync, as a call of the file's writer or of another
# process (pid 8), then its name in the test's ids.
_LATE_WRITES = {
    "pwrite64": [f'7 1.3 pwrite64(5<{_FILE}>, "x", 1, 0) = 1 <0.000010>'],
    "write-by-another-process": [
        f'8 1.3 openat(AT_FDCWD</r>, "{_FILE}", O_WRONLY|O_CLOEXEC) = 3<{_FILE}> <0.000010>',
        f'8 1.4 write(3<{_FILE}>, "x", 1) = 1 <0.000010>',
    ],
    "writev": [f'7 1.3 writev(5<{_FILE}>, [{{iov_base="x", iov_len=1}}], 1) = 1 <0.000010>'],
    "ftruncate": [f"7 1.3 ftruncate(5<{_FILE}>, 3) = 0 <0.000010>"],
    "open-O_TRUNC": [
        f'8 1.3 openat(AT_FDCWD</r>, "{_FILE}", O_WRONLY|O_TRUNC) = 3<{_FILE}> <0.000010>'
    ],
    "copy_file_range": [
        f"8 1.3 copy_file_range(3</r/other>, NULL, 4<{_FILE}>, NULL, 10, 0) = 10 <0.000010>"
    ],
    "unfinished-write": [
        f'7 1.3 write(5<{_FILE}>, "x", 1 <unfinished ...>',
        "9 1.35 fsync(6</r/ckpt/global_step_2/model>) = 0 <0.000100>",
        "7 1.4 <... write resumed>) = 1",
    ],
}
_COMMIT = [
    '7 2.0 rename("/r/ckpt/global_step_2/metadata.json.tmp", "/r/ckpt/global_step_2/metadata.json")'
    " = 0 <0.000010>"
]


def _check(lines: list[str]) -> float:
    return _durable_at(_histories(_parse("\n".join(lines), under="/r/ckpt")), _FILE)


@pytest.mark.parametrize("late", list(_LATE_WRITES))
def test_the_checker_catches_a_file_written_after_its_last_fsync(late: str) -> None:
    assert _check(_WRITTEN + _COMMIT) == pytest.approx(1.201)  # the control: durable at 1.201
    with pytest.raises(AssertionError, match=r"written .* after its last fsync"):
        _check(_WRITTEN + _LATE_WRITES[late] + _COMMIT)
    # Written again, then fsynced again: durable again, at the second fsync.
    again = [f"7 1.5 fsync(5<{_FILE}>) = 0 <0.000100>"]
    assert _check(_WRITTEN + _LATE_WRITES[late] + again + _COMMIT) == pytest.approx(1.5001)


def test_the_checker_follows_a_file_through_renames() -> None:
    written = [
        f'7 1.0 openat(AT_FDCWD</r>, "{_TMP}", O_WRONLY|O_CREAT|O_TRUNC, 0666) = 5<{_TMP}>',
        f'7 1.1 write(5<{_TMP}>, "{{}}", 2) = 2 <0.000010>',
        f"7 1.2 fsync(5<{_TMP}>) = 0 <0.001000>",
    ]
    renamed = [f'7 1.3 rename("{_TMP}", "{_FILE}") = 0 <0.000010>']
    assert _check(written + renamed + _COMMIT) == pytest.approx(1.201)
    # The temporary file written after its fsync, then renamed onto the file.
    late = [f'7 1.25 write(5<{_TMP}>, "x", 1) = 1 <0.000010>']
    with pytest.raises(AssertionError, match="after its last fsync"):
        _check(written + late + renamed + _COMMIT)
    # Written through a descriptor opened before the rename (strace names its new path).
    late = [f'7 1.4 pwrite64(5<{_FILE}>, "x", 1, 0) = 1 <0.000010>']
    with pytest.raises(AssertionError, match="after its last fsync"):
        _check(written + renamed + late + _COMMIT)
    # A file renamed onto it that was never fsynced; a file never fsynced; a failed fsync.
    unsynced = [f'7 1.1 write(5<{_TMP}>, "{{}}", 2) = 2 <0.000010>']
    with pytest.raises(AssertionError, match="never fsynced"):
        _check(_WRITTEN + unsynced + renamed + _COMMIT)
    with pytest.raises(AssertionError, match="never fsynced"):
        _check(_WRITTEN[:2] + _COMMIT)
    failed = [f"7 1.2 fsync(5<{_FILE}>) = -1 EIO (Input/output error) <0.000010>"]
    with pytest.raises(AssertionError, match="never fsynced"):
        _check(_WRITTEN[:2] + failed + _COMMIT)
    # A directory renamed: what is under it keeps its history under the new name.
    moved = ['7 1.3 rename("/r/ckpt/global_step_2/model", "/r/ckpt/global_step_2/m2") = 0']
    histories = _histories(_parse("\n".join(_WRITTEN + moved), under="/r/ckpt"))
    assert _FILE not in histories
    assert _durable_at(histories, _FILE.replace("/model/", "/m2/")) == pytest.approx(1.201)
