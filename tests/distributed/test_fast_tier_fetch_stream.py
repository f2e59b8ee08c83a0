"""A copy fetched from a peer node is taken as it arrives: each file checked against its seal on
arrival, written into the node's directory by a thread of its own (fsynced, the seal last)
once the state is loaded from the bytes received; the write is joined after the load
(:meth:`Recovery.settle`).

Two gloo processes, two simulated nodes (a directory each): rank 0's node was replaced (its
directory is empty), rank 1's node holds both ranks' files of fast steps 10 and 5.

- the copy recovered is bit-identical to the holder's and, once settled, whole and sealed on
  the receiving node (seal bytes equal too);
- a byte altered in the holder's copy (on its disk, or on the way, after the holder checked
  it) still rules the step out on every rank and falls back to step 5, leaving no seal on the
  receiving node for step 10;
- a write that fails on the receiving node (a file's path blocked) leaves no seal over the
  files it has not written, and is told on every rank (with ``keep``, by ``settle``; without,
  the step is ruled out as before);
- the load does not wait for the write, nor shares the node with it: with ``keep`` the writer
  starts only when told (:meth:`Recovery.start_writes`, after the test has loaded the state
  from the received bytes), the state file's write held until that load (an ordering, not a
  time);
- the copy travels as its holder reads it: each piece sent right after the read that completed
  it, read into one of a few pieces of memory reused (the holder keeps none of the copy); a
  read that stops short still completes every piece announced, so the older step's copy then
  travels whole over the same link;
- one holder serving two replaced nodes at once (three processes, ``replicas=2``), a reading
  thread each: both copies arrive whole and sealed.
"""

from __future__ import annotations

import io
import itertools
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.fast.peers import NodeMap
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SIZE = 4 << 20
"""Bytes of each rank's state tensor."""
NEWEST, OLDER = 10, 5


def _write_step(root: Path, step: int, ranks: list[int], world: int) -> None:
    directory = files.step_dir(root, step)
    (directory / "extra").mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        state, extra = files.files_of(rank)
        payload = {"version": 1, "rank": rank, "w": torch.full((SIZE // 4,), step + rank * 0.5)}
        torch.save(payload, directory / state)
        torch.save({"rng": torch.arange(16) + step}, directory / extra)
        sealed = {
            n: ((directory / n).stat().st_size, integrity.hash_file(directory / n))
            for n in (state, extra)
        }
        files.write_seal(directory, rank, world, sealed)
    files.mark_complete(directory, {"step": step})


def _copy(root: Path, step: int, rank: int) -> dict[str, bytes] | None:
    """Rank ``rank``'s seal and files of ``step`` on a node, as bytes (``None``: no seal)."""
    directory = files.step_dir(root, step)
    if not (directory / files.seal_name(rank)).exists():
        return None
    names = [files.seal_name(rank), *files.files_of(rank)]
    return {n: (directory / n).read_bytes() for n in names if (directory / n).exists()}


def _replaced_node(rank: int, world_size: int, tmp: str, case: str) -> dict[str, Any]:
    """Rank 0's node replaced; ``case`` says what else goes wrong (see the tests)."""
    import torch.distributed as dist

    from lightning_mcore_ckpt.fast import peers, recovery

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    group = dist.group.WORLD
    root = Path(tmp) / f"node{rank}"
    root.mkdir(parents=True, exist_ok=True)
    if rank == 1:
        _write_step(root, NEWEST, [0, 1], world_size)
        _write_step(root, OLDER, [0, 1], world_size)
        if case == "altered-on-disk":
            path = files.step_dir(root, NEWEST) / files.files_of(0)[0]
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        if case == "altered-on-the-way":  # after the holder hashed it: the receiver must see
            filled = peers.Outgoing.filled

            def altering(self: Any, index: int) -> None:
                if index == 0:  # the first file's first piece, read and hashed
                    self._ring[self._sent % peers.RING][self.piece // 2] ^= 0x01
                    peers.Outgoing.filled = filled  # type: ignore[method-assign]
                filled(self, index)  # the older step's copy goes unaltered

            peers.Outgoing.filled = altering  # type: ignore[method-assign]
    events: list[tuple[str, int, int]] = []
    if case in ("streamed", "stops-short"):  # pieces and reads of 1 MiB: 4 in a state file
        peers.PIECE = files._CHUNK = 1 << 20
    if rank == 1 and case == "streamed":  # the holder's reads and sends, in order
        send, progress = peers.Outgoing._send, peers.Outgoing.filled
        buffer = files.buffer
        peers.RING = 2
        done: dict[int, int] = {}

        def sent(self: Any, data: Any, waited_here: bool = True) -> Any:
            events.append(("sent", self.dst, len(data)))
            return send(self, data, waited_here)

        def read(self: Any, index: int) -> None:
            done[index] = done.get(index, 0) + self.piece
            events.append(("read", index, done[index]))
            progress(self, index)

        def allocated(size: int) -> Any:
            events.append(("buffer", size, 0))
            return buffer(size)

        peers.Outgoing._send = sent  # type: ignore[method-assign]
        peers.Outgoing.filled = read  # type: ignore[method-assign]
        files.buffer = allocated  # type: ignore[assignment]
    if rank == 1 and case == "stops-short":  # the state file's read fails after 1 MiB
        stream_hashed = files._stream_hashed

        def failing(path: Path, size: int, window: Any, filled: Any) -> Any:
            if path.name != files.files_of(0)[0] or f"_{NEWEST}" not in str(path):
                return stream_hashed(path, size, window, filled)
            window()  # the copy streams to rank 0: one piece goes
            filled()
            return f"{path} ended after {1 << 20} of {size} bytes (torn)"

        files._stream_hashed = failing  # type: ignore[assignment]
    out: dict[str, Any] = {"events": events}
    if rank == 0 and case.startswith("write-blocked"):
        # ``extra`` is a file where the copy's ``extra/`` directory goes: the state file is
        # written, the extra file cannot be.
        files.step_dir(root, NEWEST).mkdir(parents=True)
        (files.step_dir(root, NEWEST) / "extra").write_bytes(b"in the way")
    loaded = threading.Event()
    order: list[str] = []
    if rank == 0 and case == "ordering":
        write = peers._atomic.write_bytes

        def held_until_loaded(path: Any, data: Any) -> None:
            if Path(path).name == files.files_of(0)[0]:
                # Bounded: where the load waited for this write, the order shows it.
                order.append("load done" if loaded.wait(20) else "load not started")
            write(path, data)
            order.append(f"wrote {Path(path).name}")

        peers._atomic.write_bytes = held_until_loaded  # type: ignore[assignment]
    dist.barrier()
    keep = not case.endswith("without-keep")
    found = recovery.recover(root, NodeMap(((0,), (1,))), rank, 1, None, group, keep=keep)
    events.append(("recovered", 0, 0))
    seal_at_load = (files.step_dir(root, NEWEST) / files.seal_name(0)).exists()
    writing_at_load = [landing.started for _, landing in found.writing]
    if found.held is not None:  # the load, from the bytes received and checked
        state = torch.load(io.BytesIO(bytes(found.held.named()[files.files_of(rank)[0]])))
        out["loaded"] = float(state["w"][0])
        order.append("loaded")
        loaded.set()
    if case == "ordering":  # as the callback does once training starts
        found.start_writes()
        order.append("writes started")
    out["settled"] = found.settle(group)
    dist.barrier()
    out.update(
        step=found.step,
        sources=found.sources,
        skipped=found.skipped,
        seal_at_load=seal_at_load,
        writing_at_load=writing_at_load,
        order=order,
        mine={s: _copy(root, s, rank) for s in (NEWEST, OLDER)},
        sent={s: _copy(root, s, 1 - rank) for s in (NEWEST, OLDER)},
        verified={s: files.verify(files.step_dir(root, s), rank) for s in (NEWEST, OLDER)},
    )
    return out


def test_a_fetched_copy_is_bit_identical_and_sealed_on_the_receiving_node(tmp_path: Path) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "whole")
    assert zero["step"] == one["step"] == NEWEST
    assert zero["sources"] == {0: 1, 1: 1}
    assert zero["settled"] is None and one["settled"] is None
    # Every byte, the seal's too, as on the holder's node; and it verifies against its seal.
    assert zero["mine"][NEWEST] == one["sent"][NEWEST]
    assert zero["verified"][NEWEST] is None
    assert zero["loaded"] == NEWEST and one["loaded"] == NEWEST + 0.5


@pytest.mark.parametrize("case", ["altered-on-disk", "altered-on-the-way"])
def test_an_altered_byte_in_the_holders_copy_falls_back_on_every_rank(
    case: str, tmp_path: Path
) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), case)
    for got in (zero, one):
        assert got["step"] == OLDER, got["skipped"]
        assert len(got["skipped"]) == 1 and got["skipped"][0].startswith(f"fast step {NEWEST}: ")
        assert got["settled"] is None
    assert zero["skipped"] == one["skipped"]
    why = "does not match its seal's digest" if case == "altered-on-disk" else "does not match"
    assert why in zero["skipped"][0], zero["skipped"]
    # The altered copy was never sealed on the receiving node; the older step's is whole.
    assert zero["mine"][NEWEST] is None
    assert zero["verified"][OLDER] is None and zero["mine"][OLDER] == one["sent"][OLDER]
    assert zero["loaded"] == OLDER


def test_the_holder_sends_each_piece_as_soon_as_it_has_read_it(tmp_path: Path) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "streamed")
    assert zero["step"] == one["step"] == NEWEST
    assert zero["mine"][NEWEST] == one["sent"][NEWEST] and zero["loaded"] == NEWEST
    # The state file (4 MiB and torch.save's zip around it, read 1 MiB at a time) goes as it
    # is read: a whole piece is sent after each read, before the next; not the file after.
    name = files.files_of(0)[0]
    seal = files.parse_seal(one["sent"][NEWEST][files.seal_name(0)])
    assert seal is not None
    index, size = list(seal["files"]).index(name), len(one["sent"][NEWEST][name])
    reads = [e for e in one["events"] if e[0] == "read" and e[1] == index]
    assert [done for _, _, done in reads] == [*range(1 << 20, size, 1 << 20), size]
    events = one["events"]
    for before, after in itertools.pairwise(reads):
        between = events[events.index(before) + 1 : events.index(after)]
        assert ("sent", 0, 1 << 20) in between, events
    # The holder keeps none of the copy it sends: its memory for it is 2 pieces (peers.RING,
    # set to 2 here), reused, where the copy's state file alone is over 4; its own copy, kept
    # for its load, is mapped (no buffer).
    recovering = events[: events.index(("recovered", 0, 0))]
    buffers = [size for what, size, _ in recovering if what == "buffer"]
    assert buffers == [1 << 20, 1 << 20], buffers


def test_a_read_that_stops_short_still_completes_every_piece_and_falls_back(
    tmp_path: Path,
) -> None:
    # The holder's read of the copy it streams fails after its first piece: the pieces it
    # never read go as zeros (the receiver's receives complete; nothing is left in flight to
    # be taken for the next copy), the step is ruled out on every rank for the holder's reason,
    # and the older step's copy, fetched next over the same link, arrives whole.
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "stops-short")
    for got in (zero, one):
        assert got["step"] == OLDER, got["skipped"]
        assert len(got["skipped"]) == 1 and "(torn)" in got["skipped"][0]
    assert zero["mine"][NEWEST] is None
    assert zero["verified"][OLDER] is None and zero["mine"][OLDER] == one["sent"][OLDER]
    assert zero["loaded"] == OLDER


def test_a_write_that_fails_is_told_on_every_rank_and_leaves_no_seal(tmp_path: Path) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "write-blocked")
    # The state is loaded from the bytes that matched the seal; the write's failure is told by
    # settle, the same on every rank, and the node holds no seal over the files not written.
    assert zero["step"] == one["step"] == NEWEST
    assert zero["loaded"] == NEWEST
    assert zero["settled"] is not None and zero["settled"] == one["settled"]
    assert "rank 0" in zero["settled"] and "fetched from rank 1" in zero["settled"]
    assert zero["mine"][NEWEST] is None
    assert zero["verified"][NEWEST] is not None


def test_without_keep_a_write_that_fails_rules_the_step_out_as_before(tmp_path: Path) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "write-blocked-without-keep")
    for got in (zero, one):
        assert got["step"] == OLDER and got["settled"] is None
        assert got["skipped"] == zero["skipped"] and len(got["skipped"]) == 1
    assert "rank 0" in zero["skipped"][0] and "fetched from rank 1" in zero["skipped"][0]
    assert zero["mine"][NEWEST] is None
    assert zero["verified"][OLDER] is None


def test_the_state_is_loaded_before_the_fetched_copy_is_written(tmp_path: Path) -> None:
    zero, one = run_distributed(_replaced_node, 2, str(tmp_path), "ordering")
    assert zero["step"] == one["step"] == NEWEST
    # With keep, the copy's write starts once the state is loaded from the bytes received (not
    # beside that load): the recovery returned without waiting for it, its writer not started,
    # no seal on the node at the load; every file written after, the seal last.
    assert zero["seal_at_load"] is False
    assert zero["writing_at_load"] == [False]
    assert zero["order"] == [
        "loaded",
        "writes started",
        f"wrote {files.files_of(0)[1].split('/')[-1]}",
        "load done",
        f"wrote {files.files_of(0)[0]}",
        f"wrote {files.seal_name(0)}",
    ], zero["order"]
    assert zero["settled"] is None and zero["verified"][NEWEST] is None
    assert zero["mine"][NEWEST] == one["sent"][NEWEST]


def _one_holder_for_two(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Three nodes of one rank, each rank's copies on the next two nodes (``replicas=2``);
    nodes 0 and 1 replaced: rank 2 holds all three ranks' files and serves two copies at once
    (a reading thread each, pieces of 1 MiB), while checking its own."""
    import torch.distributed as dist

    from lightning_mcore_ckpt.fast import peers, recovery

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    peers.PIECE = files._CHUNK = 1 << 20
    root = Path(tmp) / f"node{rank}"
    root.mkdir(parents=True, exist_ok=True)
    if rank == 2:
        _write_step(root, NEWEST, [0, 1, 2], world_size)
    dist.barrier()
    nodes = NodeMap(((0,), (1,), (2,)))
    found = recovery.recover(root, nodes, rank, 2, None, dist.group.WORLD, keep=True)
    assert found.held is not None
    state = torch.load(io.BytesIO(bytes(found.held.named()[files.files_of(rank)[0]])))
    settled = found.settle(dist.group.WORLD)
    dist.barrier()
    return {
        "step": found.step,
        "sources": found.sources,
        "loaded": float(state["w"][0]),
        "settled": settled,
        "copies": {r: _copy(root, NEWEST, r) for r in range(world_size)},
        "verified": files.verify(files.step_dir(root, NEWEST), rank),
    }


def test_one_holder_serves_two_replaced_nodes_at_once(tmp_path: Path) -> None:
    got = run_distributed(_one_holder_for_two, 3, str(tmp_path))
    holder = got[2]
    for rank, mine in enumerate(got):
        assert mine["step"] == NEWEST and mine["settled"] is None
        assert mine["sources"] == {0: 2, 1: 2, 2: 2}
        assert mine["loaded"] == NEWEST + rank * 0.5
        # Each replaced node's copy is the holder's, byte for byte, sealed on its node.
        assert mine["copies"][rank] == holder["copies"][rank] and mine["verified"] is None
