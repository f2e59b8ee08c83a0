"""A fast-tier copy is checked and kept where it is, mapped, not read into memory of its own: in
memory (``/dev/shm``) its pages are the file's; on a disk, the page cache's, read in as it is
hashed.

Axes: the medium (tmpfs, the disk under the test's temporary directory) x what the copy is
(whole; a byte altered; torn) x what happens after the check (the kept bytes written to, as a
tensor made of them may be; the file replaced by rename, as the tier replaces its files). And
the mount table read as the kernel writes it: nested mounts, a mount on top of another at the
same point, an escaped space, a path outside every listed mount.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_mcore_ckpt.fast import files, media
from lightning_mcore_ckpt.format import integrity

STEP = 7
RANK = 1
MOUNTINFO = """\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:21 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
24 22 0:22 / /mnt/fast rw shared:3 - xfs /dev/nvme0n1 rw
25 24 0:23 / /mnt/fast/ram rw shared:4 - ramfs ramfs rw
26 22 0:24 / /mnt/with\\040space rw shared:5 - tmpfs tmpfs rw
27 24 0:25 / /mnt/fast rw shared:6 - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/", "ext4"),
        ("/work/run/fast", "ext4"),
        ("/dev/shm", "tmpfs"),
        ("/dev/shm/run/fast_step_7/state_00001.pt", "tmpfs"),
        ("/dev/shmother", "ext4"),  # a prefix of a name is not a parent directory
        ("/mnt/fast/ram/x", "ramfs"),  # the deeper mount
        ("/mnt/fast/x", "tmpfs"),  # mounted over the xfs at the same point: the later one
        ("/mnt/with space/x", "tmpfs"),
    ],
)
def test_the_mount_table_names_the_file_system_of_a_path(path: str, kind: str) -> None:
    assert media.file_system(path, MOUNTINFO) == kind


def test_an_unreadable_mount_table_says_nothing() -> None:
    assert media.file_system("/x", "") is None
    assert media.file_system("/x", "garbage without a separator\n") is None


def _shm() -> Path | None:
    root = Path("/dev/shm")
    if not root.is_dir() or not os.access(root, os.W_OK) or not media.in_memory(root):
        return None
    return root


@pytest.fixture(params=["tmpfs", "disk"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    if request.param == "disk":
        if media.in_memory(tmp_path):
            pytest.skip("the temporary directory is in memory here")
        yield "disk", tmp_path
        return
    shm = _shm()
    if shm is None:
        pytest.skip("no writable tmpfs at /dev/shm")
    made = Path(tempfile.mkdtemp(prefix="lmc-test-media-", dir=shm))
    try:
        yield "tmpfs", made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _mapped_files() -> set[str]:
    """The files this process has mapped (``/proc/self/maps``)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6}


def _sealed_step(root: Path) -> tuple[Path, dict[str, bytes]]:
    step = files.step_dir(root, STEP)
    (step / "extra").mkdir(parents=True)
    contents = {name: os.urandom(3 << 20) + name.encode() for name in files.files_of(RANK)}
    sealed = {}
    for name, data in contents.items():
        (step / name).write_bytes(data)
        sealed[name] = (len(data), integrity.hash_bytes(data))
    files.write_seal(step, RANK, 2, sealed)
    return step, contents


def test_a_whole_copy_is_kept_where_it_is_on_either_medium(medium: tuple[str, Path]) -> None:
    _, root = medium
    step, contents = _sealed_step(root)
    found = files.read_checked(step, RANK)
    assert not isinstance(found, str), found
    seal, kept = found
    assert seal == (step / files.seal_name(RANK)).read_bytes()
    names = list(files.parse_seal(seal)["files"])  # the seal's order
    assert sorted(names) == sorted(contents)
    assert [bytes(k) for k in kept] == [contents[n] for n in names]
    # The kept bytes are the file's pages (this process maps the file), on either medium.
    mapped = _mapped_files()
    assert all(str(step / n) in mapped for n in names), names
    # Nothing a load does to the kept bytes reaches the file (a tensor made of them is
    # writable), and a file replaced by rename leaves the kept bytes as they were checked.
    state = names.index(files.files_of(RANK)[0])
    name, held = names[state], kept[state]
    held[0] ^= 0xFF
    assert (step / name).read_bytes() == contents[name]
    replacement = step / f"{name}.new"
    replacement.write_bytes(b"\0" * len(contents[name]))
    replacement.replace(step / name)
    assert bytes(held[1:]) == contents[name][1:]
    assert files.verify(step, RANK) is not None  # the file now differs from its seal


@pytest.mark.parametrize("damage", ["altered", "torn"])
def test_a_damaged_copy_is_refused_on_either_medium(medium: tuple[str, Path], damage: str) -> None:
    _, root = medium
    step, contents = _sealed_step(root)
    name = files.files_of(RANK)[0]
    data = bytearray(contents[name])
    if damage == "altered":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    (step / name).write_bytes(bytes(data))
    found = files.read_checked(step, RANK)
    assert isinstance(found, str)
    assert damage in found and name in found


def _anonymous_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``): what a copy of a file costs."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("/proc/self/status has no RssAnon")


def test_a_copy_costs_no_memory_of_its_own(medium: tuple[str, Path]) -> None:
    _, made = medium
    try:
        step = files.step_dir(made, STEP)
        (step / "extra").mkdir(parents=True)
        state, extra = files.files_of(RANK)
        big = os.urandom(64 << 20)
        (step / state).write_bytes(big)
        (step / extra).write_bytes(b"extra")
        sealed = {
            n: (len(d), integrity.hash_bytes(d)) for n, d in ((state, big), (extra, b"extra"))
        }
        files.write_seal(step, RANK, 2, sealed)
        del big
        before = _anonymous_bytes()
        found = files.read_checked(step, RANK)
        grown = _anonymous_bytes() - before
        assert not isinstance(found, str), found
        # Mapped for reading, its pages the file's (on a disk, the page cache's): not copied
        # into memory of this process's own (a read, or a mapping populated as if written,
        # would add its 64 MiB).
        assert grown < 8 << 20, grown
        del found
    finally:
        shutil.rmtree(files.step_dir(made, STEP), ignore_errors=True)
