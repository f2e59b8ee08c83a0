"""A recovery reads each byte of the copies it uses once: hashed against the seal as it is read,
and those same bytes are what is checked for NaNs, sent to a peer, and handed to the load.

Counted with the kernel's own counter of the bytes a process reads (``rchar`` in
``/proc/self/io``: every ``read``, by Python or by torch's C++ alike, page cache or not), plus
the bytes a mapped copy has the kernel read in (``media.populate``: a copy kept is mapped, not
read), around the recovery alone. A rank's files here are a state of :data:`SIZE` bytes and a small extra
file, so the few kilobytes of seals and markers read besides are lost in the slack.

- one node, the rank's own copy (with and without the content check): read once, and the bytes
  kept (``keep``) are the file's;
- a damaged newest step (a flipped byte, a NaN) still falls back to the older step, naming the
  step and why; each step's copy is read once;
- a replaced node (with and without the content check): the holder reads its own copy and the
  copy it sends once each (the bytes it checked are the bytes it sends), and the rank that
  fetched keeps what it received.

Before one pass, the recovery read a copy once to hash it, again to check its values, and the
holder again to send it: these counts were 2x and 3x.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.fast import files, media
from lightning_mcore_ckpt.fast.peers import NodeMap
from lightning_mcore_ckpt.fast.recovery import recover
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SIZE = 24 << 20
"""Bytes of each rank's state tensor."""
SLACK = 1 << 20
"""Bytes read besides the copies (seals, markers, a directory listing)."""


_MAPPED_IN = [0]
"""Bytes this process's mappings of copies were asked to read in (``media.populate``)."""


def _count_mapped_in() -> None:
    """Count the bytes a mapped copy reads in (the kernel reads them into its page cache on
    ``media.populate``'s behalf: no ``read``, so not in ``rchar``), once per process."""
    populate = media.populate
    if getattr(populate, "counted", False):
        return

    def counted(view: memoryview, start: int, length: int) -> None:
        _MAPPED_IN[0] += max(0, min(length, len(view) - start))
        populate(view, start, length)

    counted.counted = True  # type: ignore[attr-defined]
    media.populate = counted  # type: ignore[assignment]


def _read_bytes() -> int:
    """Bytes this process has read so far: passed to ``read`` (the kernel's ``rchar``) or read
    in for a mapping of a copy."""
    _count_mapped_in()
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1]) + _MAPPED_IN[0]
    raise AssertionError("/proc/self/io has no rchar")


def _write_step(
    root: Path, step: int, ranks: list[int], world: int, value: float = 1.0
) -> dict[int, dict[str, bytes]]:
    """Fast step ``step`` under ``root`` with ``ranks``' files, sealed, marked complete; each
    rank's files' bytes."""
    directory = files.step_dir(root, step)
    (directory / "extra").mkdir(parents=True, exist_ok=True)
    out: dict[int, dict[str, bytes]] = {}
    for rank in ranks:
        state, extra = files.files_of(rank)
        payload = {"version": 1, "rank": rank, "w": torch.full((SIZE // 4,), value + rank)}
        torch.save(payload, directory / state)
        torch.save({"rng": torch.arange(16)}, directory / extra)
        names = files.files_of(rank)
        sealed = {
            n: ((directory / n).stat().st_size, integrity.hash_file(directory / n)) for n in names
        }
        files.write_seal(directory, rank, world, sealed)
        out[rank] = {n: (directory / n).read_bytes() for n in names}
    files.mark_complete(directory, {"step": step})
    return out


def _copy_bytes(copy: dict[str, bytes]) -> int:
    return sum(len(data) for data in copy.values())


def _recover_counted(root: Path, *, keep: bool, check_finite: bool) -> tuple[Any, int]:
    before = _read_bytes()
    found = recover(root, NodeMap(((0,),)), 0, 0, None, None, keep=keep, check_finite=check_finite)
    return found, _read_bytes() - before


@pytest.mark.parametrize("check_finite", [False, True], ids=["hash", "hash+finite"])
def test_the_own_copy_is_read_once_and_its_checked_bytes_kept(
    tmp_path: Path, check_finite: bool
) -> None:
    written = _write_step(tmp_path, 10, [0], 1)[0]
    found, read = _recover_counted(tmp_path, keep=True, check_finite=check_finite)
    assert found.step == 10 and found.skipped == []
    total = _copy_bytes(written)
    assert total <= read <= total + SLACK, f"read {read} bytes for a copy of {total}"
    assert found.held is not None and found.held.named() == written


def test_without_keep_nothing_is_held_and_the_copy_is_read_once(tmp_path: Path) -> None:
    written = _write_step(tmp_path, 10, [0], 1)[0]
    found, read = _recover_counted(tmp_path, keep=False, check_finite=False)
    assert found.step == 10 and found.held is None
    total = _copy_bytes(written)
    assert total <= read <= total + SLACK


@pytest.mark.parametrize("damage", ["byte flipped", "not finite"])
def test_a_damaged_newest_step_falls_back_reading_each_copy_once(
    tmp_path: Path, damage: str
) -> None:
    older = _write_step(tmp_path, 10, [0], 1)[0]
    newest = _write_step(tmp_path, 12, [0], 1, value=float("nan") if damage == "not finite" else 2)
    state = files.step_dir(tmp_path, 12) / files.files_of(0)[0]
    if damage == "byte flipped":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))
    found, read = _recover_counted(tmp_path, keep=True, check_finite=True)
    assert found.step == 10
    why = "(altered)" if damage == "byte flipped" else "holds non-finite values in w"
    assert len(found.skipped) == 1, found.skipped
    assert found.skipped[0].startswith("fast step 12: no whole copy of rank(s) [0]'s files")
    assert why in found.skipped[0], found.skipped
    total = _copy_bytes(older) + _copy_bytes(newest[0])
    assert total <= read <= total + SLACK, f"read {read} bytes for copies of {total}"
    assert found.held is not None and found.held.named() == older


def _replaced_node(rank: int, world_size: int, tmp: str, check_finite: bool) -> dict[str, Any]:
    """Rank 0's node was replaced (its directory empty); node 1 holds both ranks' files."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    root = Path(tmp) / f"node{rank}"
    written = {}
    if rank == 1:
        written = _write_step(root, 10, [0, 1], world_size)
    root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    before = _read_bytes()
    found = recover(
        root,
        NodeMap(((0,), (1,))),
        rank,
        1,
        None,
        dist.group.WORLD,
        keep=True,
        check_finite=check_finite,
    )
    read = _read_bytes() - before
    assert found.settle(dist.group.WORLD) is None  # the fetched copy written (after the load)
    dist.barrier()
    return {
        "step": found.step,
        "sources": found.sources,
        "read": read,
        "held": {n: bytes(d) for n, d in found.held.named().items()} if found.held else None,
        "written": written,
        "fetched": files.verify(files.step_dir(root, 10), rank),
    }


@pytest.mark.parametrize("check_finite", [False, True], ids=["hash", "hash+finite"])
def test_a_copy_fetched_from_a_peer_is_read_once_by_its_holder(
    tmp_path: Path, check_finite: bool
) -> None:
    # Sent piece by piece through memory reused, or, to check its values, read whole and sent
    # from there: once either way.
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), check_finite)
    written = one["written"]
    assert zero["step"] == one["step"] == 10
    assert zero["sources"] == {0: 1, 1: 1}
    # The holder read its own copy and the copy it sent, each once.
    total = _copy_bytes(written[0]) + _copy_bytes(written[1])
    assert total <= one["read"] <= total + SLACK, (one["read"], total)
    # The fetching rank keeps the bytes it received and checked, and wrote them to its node.
    assert zero["held"] == written[0] and one["held"] == written[1]
    assert zero["fetched"] is None
    # It read nothing of its files back (at most the bytes received over the socket).
    assert zero["read"] <= _copy_bytes(written[0]) + SLACK, zero["read"]
