"""Which nodes hold a copy of each rank's files, and the copies sent between them.

The nodes are found at setup by looking at the fast-tier directory (the ranks that see the
same directory share a node: ``callback/nodes.py``). Rank ``r``, the ``i``-th rank of node
``n``, has its copies on the ``i``-th ranks of nodes ``n+1 .. n+replicas`` (modulo the node
count): a ring, so that each node sends and receives the same bytes, and a step survives the
loss of any ``replicas`` nodes.

Copies travel over a process group of their own (gloo, on the host), point to point: a header
with the files' sizes, then each file in pieces (:data:`PIECE`), which a holder reading a copy
from its disk sends as soon as each is read (:class:`Outgoing`), through a few pieces of memory
reused (:data:`RING`) where it does not keep the copy, and the receiver has posted receives for
all at once (:class:`Incoming`). The receiver takes each file as it arrives
(:class:`Landing`): checks it against the sender's seal (size and digest) at once, and hands
it to a thread that writes it into its own node's directory under the same name; the seal is
written last, once every file is checked and written: a copy torn on the way never counts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.storage import atomic as _atomic

__all__ = [
    "Bundle",
    "Incoming",
    "Landing",
    "NodeMap",
    "Outgoing",
    "exchange",
    "handshake",
    "header",
    "receive",
    "send",
]

_MAX_FILES = 8

Data = bytes | bytearray | memoryview
"""A file's bytes, held once: read into a ``bytearray``, received as a view of the tensor."""


@dataclass(frozen=True)
class NodeMap:
    """The job's nodes: the ranks of each, in order."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_leaders(cls, leaders: list[int]) -> NodeMap:
        """From each rank's directory leader (the lowest rank that sees its directory)."""
        groups: dict[int, list[int]] = {}
        for rank, leader in enumerate(leaders):
            groups.setdefault(leader, []).append(rank)
        return cls(tuple(tuple(groups[k]) for k in sorted(groups)))

    @property
    def size(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's first rank (it marks and prunes the node's steps)."""
        return self.nodes[self.node_of(rank)][0] == rank

    def uniform(self) -> bool:
        return len({len(ranks) for ranks in self.nodes}) == 1

    def _shifted(self, rank: int, by: int) -> int:
        node = self.node_of(rank)
        index = self.nodes[node].index(rank)
        return self.nodes[(node + by) % self.size][index]

    def peers(self, rank: int, replicas: int) -> list[int]:
        """The ranks that hold copies of ``rank``'s files, one per other node."""
        return [self._shifted(rank, k) for k in range(1, replicas + 1)]

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose files ``rank`` holds copies of (``peers`` in reverse)."""
        return [self._shifted(rank, -k) for k in range(1, replicas + 1)]


@dataclass
class Bundle:
    """A rank's files of one step, as sent: its seal, then each file it names."""

    seal: Data
    contents: list[Data]

    @classmethod
    def read(cls, step: Path, rank: int) -> Bundle:
        seal = (step / files.seal_name(rank)).read_bytes()
        record = files.parse_seal(seal)
        if record is None or record.get("rank") != rank:
            raise ValueError(f"{step / files.seal_name(rank)} is torn, altered or another rank's")
        return cls(seal, [_read(path) for path in files.sealed_paths(step, record, rank).values()])

    def named(self) -> dict[str, Data]:
        """The files' bytes by their names in the seal (``{}`` for a torn seal)."""
        record = files.parse_seal(self.seal)
        if record is None or len(record["files"]) != len(self.contents):
            return {}
        return dict(zip(record["files"], self.contents, strict=True))

    def write(self, step: Path, rank: int) -> int:
        """Write the files into ``step`` (this node), checked against the seal, then the seal;
        the bytes written. Raises ``ValueError`` for a copy that does not match its seal, and
        :class:`~lightning_mcore_ckpt.safety.names.UnsafeNameError` (before anything is written)
        for a seal that names a file the rank may not have. (:class:`Landing`, all at once.)"""
        landing = Landing(step, rank, len(self.contents))
        for index, data in enumerate((self.seal, *self.contents)):
            landing.arrived(index, data)
        try:
            landing.finish()
        except ValueError:
            with contextlib.suppress(OSError):  # what is wrong with the copy is what is told
                landing.join(None)
            raise
        landing.join(None)
        return landing.written


AFTER_LOAD = "lmc-fast-fetch-after-load"
"""The name of the thread that writes a copy the state was loaded from (a deferred
:class:`Landing`'s); a copy of a fast save received from a peer is written by
``lmc-fast-fetch``."""


class Landing:
    """A rank's copy of one step as it arrives from a peer (:func:`exchange`'s ``arrived``),
    checked on arrival and written into this node's directory in a thread of its own.

    The seal comes first: it must be whole, this rank's and this step's, and name only files
    this rank may have, as many as are coming (else the copy is refused before anything is
    written). Each file, as it arrives, is checked against the seal (size, digest: on the
    receiving thread, so a copy is known good or bad as soon as its last byte is in) and queued
    for the writer thread, which removes any old seal first, then writes each file durably
    (:func:`~lightning_mcore_ckpt.storage.atomic.write_bytes`, fsynced). :meth:`finish` says
    whether the whole copy matched its seal; only then is the seal queued, last: the writer
    writes it only after every file was written, so a copy torn on the way or on the disk
    never counts. The durable write is off the receiver's path: :meth:`join` waits for it.

    ``deferred``: the writer thread starts at :meth:`start` (or :meth:`join`), not with the
    seal: a copy the state is loaded from is written once that load is done, so that the write
    does not compete with it for the node's cores and memory. The files queued meanwhile are
    the bytes received, which the load holds anyway.
    """

    def __init__(self, step: Path, rank: int, count: int, deferred: bool = False) -> None:
        self.step, self.rank, self.count = step, rank, count
        self.deferred = deferred
        self.seal: Data | None = None
        self.contents: list[Data] = []
        self.refused: ValueError | None = None
        """What is wrong with the copy (nothing more is written for it, and no seal)."""
        self.written = 0
        """Bytes written so far (files, then the seal)."""
        self._entries: list[tuple[str, dict[str, Any], Path]] = []
        self._queue: queue.SimpleQueue[tuple[Path, Data | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: Exception | None = None

    def arrived(self, index: int, data: Data, digest: str | None = None) -> None:
        """Piece ``index`` of the copy (``0``: the seal, then each file in the seal's order)
        has arrived (``digest``: its digest, where it was hashed as it came in). A problem
        with the copy is kept in :attr:`refused`, not raised."""
        if self.refused is not None:
            return
        try:
            if index == 0:
                self._take_seal(data)
            else:
                self._take_file(index - 1, data, digest)
        except ValueError as err:  # UnsafeNameError too
            self.refused = err

    def _take_seal(self, seal: Data) -> None:
        step, rank = self.step, self.rank
        record = files.parse_seal(seal)
        if record is None or record.get("rank") != rank:
            raise ValueError(f"the copy of rank {rank}'s seal for {step.name} is torn or altered")
        if record.get("step") != files.step_number(step):
            raise ValueError(f"the copy of rank {rank}'s seal for {step.name} seals another step")
        paths = files.sealed_paths(step, record, rank)
        if self.count != len(paths):
            raise ValueError(
                f"the copy of rank {rank}'s files for {step.name} holds {self.count} "
                f"files, its seal names {len(paths)}"
            )
        self.seal = seal
        self._entries = [(name, entry, paths[name]) for name, entry in record["files"].items()]
        # A daemon thread: a process whose peers are gone is not kept alive by a write.
        name = AFTER_LOAD if self.deferred else "lmc-fast-fetch"
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._queue.put((step / files.seal_name(rank), None))  # the old seal goes first
        if not self.deferred:
            self.start()

    def _take_file(self, index: int, data: Data, digest: str | None) -> None:
        if self.seal is None or index >= len(self._entries):
            raise ValueError(f"the copy of rank {self.rank}'s files for {self.step.name} is torn")
        name, entry, path = self._entries[index]
        digest = digest if digest is not None else integrity.hash_bytes(data)
        if len(data) != entry["size"] or digest != entry["digest"]:
            raise ValueError(
                f"the copy of {self.step.name}/{name} does not match rank {self.rank}'s seal "
                f"({len(data)} bytes, {entry['size']} sealed)"
            )
        self.contents.append(data)
        self._queue.put((path, data))

    def finish(self) -> Bundle:
        """Every piece has arrived: the copy, checked whole against its seal, whose seal is
        then queued to be written last; or raises what is wrong with it (``ValueError``: no
        seal is written)."""
        if self.refused is None and (self.seal is None or len(self.contents) != self.count):
            self.refused = ValueError(
                f"the copy of rank {self.rank}'s files for {self.step.name} did not all arrive"
            )
        if self.refused is not None or self.seal is None:
            self.abandon()
            raise self.refused or ValueError("no seal")
        self._queue.put((self.step / files.seal_name(self.rank), self.seal))
        self._queue.put(None)
        return Bundle(self.seal, self.contents)

    def abandon(self) -> None:
        """Write nothing more, and no seal (the files already queued are still written)."""
        self._queue.put(None)

    @property
    def started(self) -> bool:
        """Whether the writer thread has started."""
        return self._thread is not None and self._thread.ident is not None

    def start(self) -> None:
        """Start writing what is queued (once the seal has arrived; once)."""
        if self._thread is not None and not self.started:
            self._thread.start()

    def join(self, timeout: float | None) -> None:
        """Wait for the write (started here if it was not: at most ``timeout`` seconds);
        raises its error (``OSError``), or ``TimeoutError`` where it has not finished."""
        self.start()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"writing rank {self.rank}'s copy into {self.step} took over {timeout} s"
                )
        if isinstance(self._failed, OSError):
            raise self._failed
        if self._failed is not None:
            raise OSError(f"writing rank {self.rank}'s copy into {self.step}: {self._failed!r}")

    def _write(self) -> None:
        """The writer thread: each queued file in order, until ``None``; after a failure,
        nothing more (no seal)."""
        while (item := self._queue.get()) is not None:
            if self._failed is not None:
                continue
            path, data = item
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    _atomic.write_bytes(path, data)
                    self.written += len(data)
            except Exception as err:  # noqa: BLE001 - told by join
                self._failed = err


def _read(path: Path) -> bytearray | memoryview:
    """A file's bytes, read once into memory a tensor can be sent from without a copy
    (:func:`files.buffer`)."""
    with open(path, "rb") as f:
        data = files.buffer(os.fstat(f.fileno()).st_size)
        view = memoryview(data)
        done = 0
        while done < len(data):
            read = f.readinto(view[done:])
            if not read:
                raise OSError(f"{path} ended after {done} of {len(data)} bytes")
            done += read
    return data


def _as_tensor(data: Data) -> torch.Tensor:
    """``data`` as a tensor to send: its own memory (a file read, :func:`files.buffer`, or a
    received tensor's), or a copy where it is read-only (the seal: small)."""
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    return torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8)


PIECE = 16 << 20
"""Bytes of each piece a file travels in: the receiver posts every piece's receive at once, and
a holder sends each piece as soon as it has read it (:class:`Outgoing`)."""


RING = 4
"""Pieces of memory a holder reads a copy it sends and does not keep into (:meth:`Outgoing.window`),
each reused once the receiver has taken the piece it held: a node serving a replaced node's
copies holds ``RING`` pieces for each, not the copies' bytes."""


def _pieces(size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each piece of a file of ``size`` bytes."""
    return [_piece(size, k) for k in range(_count(size))]


def _piece(size: int, k: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``k`` of a file of ``size`` bytes."""
    begin = k * PIECE
    return begin, min(PIECE, size - begin)


def _count(size: int) -> int:
    """How many pieces a file of ``size`` bytes travels in."""
    return -(-size // PIECE)


def header(seal: Data | None, sizes: list[int]) -> torch.Tensor:
    """``[1, file count, seal bytes, file bytes...]``, or zeros (``seal`` ``None``): nothing
    follows. Raises ``ValueError`` for more files than a header holds."""
    out = torch.zeros(3 + _MAX_FILES, dtype=torch.int64)
    if seal is not None:
        if len(sizes) > _MAX_FILES:
            raise ValueError(f"a bundle holds at most {_MAX_FILES} files")
        out[0], out[1], out[2] = 1, len(sizes), len(seal)
        for i, size in enumerate(sizes):
            out[3 + i] = size
    return out


def handshake(
    group: Any, outgoing: list[tuple[int, torch.Tensor]], incoming: list[int]
) -> dict[int, torch.Tensor]:
    """Send each ``(peer, header)`` and receive one header from each rank of ``incoming``, at
    once (point to point over ``group``): the headers received, by source."""
    headers = {src: torch.zeros(3 + _MAX_FILES, dtype=torch.int64) for src in incoming}
    ops = [dist.P2POp(dist.isend, h, dst, group) for dst, h in outgoing]
    ops += [dist.P2POp(dist.irecv, h, src, group) for src, h in headers.items()]
    _run(ops)
    return headers


class Outgoing:
    """A copy on its way to ``dst`` (its header sent): the seal at once, then each file's
    pieces in order, each sent as soon as its bytes are in memory: read into the file's whole
    buffer (:meth:`ready`; the bytes sent must stay as they are until :meth:`wait` returns),
    or piece by piece into memory reused (:meth:`window`, :meth:`filled`). What was never
    sent (a read that stopped short: a torn or unreadable file) is sent as zeros by
    :meth:`close`, so that every receive the header announced completes; the receiver's
    check against the seal refuses such a copy."""

    def __init__(self, group: Any, dst: int, seal: Data, sizes: list[int]) -> None:
        self.group, self.dst, self.seal, self.sizes = group, dst, seal, sizes
        self._file, self._piece = 0, 0
        self._works: list[Any] = []
        self._ring: list[memoryview] = []
        self._ring_sends: list[Any] = []
        self._sent = 0
        self._send(seal)
        self._skip_empty()

    @property
    def piece(self) -> int:
        """The length of the next piece (0: every piece was sent)."""
        if self._file >= len(self.sizes):
            return 0
        return _piece(self.sizes[self._file], self._piece)[1]

    def window(self) -> memoryview:
        """Memory for the next piece (:attr:`piece` bytes): one of :data:`RING` pieces, taken
        once the receiver has taken the piece it held before. Fill it, then :meth:`filled`."""
        slot = self._sent % RING
        if slot == len(self._ring):
            self._ring.append(memoryview(files.buffer(min(PIECE, max(self.sizes)))))
            self._ring_sends.append(None)
        elif self._ring_sends[slot] is not None:
            self._ring_sends[slot].wait()  # a gloo send is waited for once: not again by wait
            self._ring_sends[slot] = None
        return self._ring[slot][: self.piece]

    def filled(self, index: int) -> None:
        """The next piece, of file ``index``, is in the memory :meth:`window` gave: sent."""
        if index != self._file:
            raise ValueError(f"piece of file {index} filled, file {self._file} is next")
        slot = self._sent % RING
        self._ring_sends[slot] = self._send(self._ring[slot][: self.piece], waited_here=False)
        self._sent += 1
        self._advance()

    def ready(self, index: int, data: Data, done: int) -> None:
        """File ``index``'s first ``done`` bytes are in ``data`` (its whole buffer): each of
        its whole pieces among them not sent yet is sent."""
        view = memoryview(data)
        while self._file == index:
            begin, length = _piece(self.sizes[index], self._piece)
            if begin + length > done:
                return
            self._send(view[begin : begin + length])
            self._advance()

    def close(self) -> None:
        """Zeros in place of every piece not sent yet, in order."""
        zeros = None
        while self._file < len(self.sizes):
            _, length = _piece(self.sizes[self._file], self._piece)
            zeros = zeros if zeros is not None else bytearray(min(PIECE, max(self.sizes)))
            self._send(memoryview(zeros)[:length])
            self._advance()

    def wait(self) -> None:
        """Wait until every piece sent has been taken by the receiver."""
        works = [*self._works, *(w for w in self._ring_sends if w is not None)]
        self._works, self._ring_sends = [], [None] * len(self._ring_sends)
        for work in works:
            work.wait()

    def _send(self, data: Data, waited_here: bool = True) -> Any:
        """Send ``data``; its work is kept for :meth:`wait` where ``waited_here`` (else the
        caller keeps it: a gloo send is waited for once)."""
        if not len(data):
            return None
        work = dist.isend(_as_tensor(data), self.dst, self.group)
        if waited_here:
            self._works.append(work)
        return work

    def _advance(self) -> None:
        self._piece += 1
        if self._piece == _count(self.sizes[self._file]):
            self._file, self._piece = self._file + 1, 0
            self._skip_empty()

    def _skip_empty(self) -> None:
        while self._file < len(self.sizes) and not self.sizes[self._file]:
            self._file += 1


class Incoming:
    """A copy coming from ``src``, as its ``header`` announced it: the receive of every piece
    of the seal and of each file posted at once, into memory of each file's size."""

    def __init__(self, group: Any, src: int, header: torch.Tensor) -> None:
        self.src = src
        count = int(header[1])
        sizes = [int(n) for n in header[2 : 3 + count]]
        if not 0 <= count <= _MAX_FILES or min(sizes) < 0:
            raise ValueError(f"rank {src} announced a copy of {count} files of {sizes} bytes")
        self._buffers = [_receiving(n) for n in sizes]
        self._digests: list[str] = []
        self._works: list[list[Any]] = [
            [dist.irecv(t[b : b + n], src, group) for b, n in _pieces(t.numel())]
            for t in self._buffers
        ]

    def take(self) -> None:
        """Wait for the copy piece by piece (the group's timeout bounds each wait), hashing
        each piece as it is in, while the later ones still travel: :meth:`digest` then names
        each file's digest (of the bytes received, which nothing writes to after)."""
        for buffer, works in zip(self._buffers, self._works, strict=True):
            hasher = integrity.Hasher()
            view = _bytes(buffer)
            for (begin, length), work in zip(_pieces(len(view)), works, strict=True):
                work.wait()
                hasher.update(view[begin : begin + length])
            self._digests.append(hasher.digest)
        self._works = [[] for _ in self._buffers]

    def digest(self, index: int) -> str | None:
        """Piece ``index``'s digest (``0``: the seal, then each file), where :meth:`take` has
        hashed it; else ``None``."""
        return self._digests[index] if index < len(self._digests) else None

    def arrive(self, arrived: Callable[[int, int, Data], None] | None = None) -> Bundle:
        """Wait for the copy, piece by piece (the group's timeout bounds each wait); as each
        file is whole, ``arrived(index, count, data)`` (``index`` ``0``: the seal, then each of
        the ``count`` files), while the later ones still travel. The copy, as received."""
        count = len(self._buffers) - 1
        for index, (buffer, works) in enumerate(zip(self._buffers, self._works, strict=True)):
            for work in works:
                work.wait()
            if arrived is not None:
                arrived(index, count, _bytes(buffer))
        self._works = []
        return Bundle(_bytes(self._buffers[0]), [_bytes(t) for t in self._buffers[1:]])

    def drain(self) -> None:
        """Wait for the copy and let it go (a copy not wanted after all)."""
        for works in self._works:
            for work in works:
                work.wait()
        self._works, self._buffers = [], []


def exchange(
    group: Any,
    outgoing: list[tuple[int, Bundle | None]],
    incoming: list[int],
    arrived: Callable[[int, int, int, Data], None] | None = None,
) -> dict[int, Bundle | None]:
    """Send each ``(peer, bundle)`` of ``outgoing`` (``None``: this rank has nothing to send)
    and receive one bundle from each rank of ``incoming`` (``None`` where that rank had
    nothing), all at once, point to point over ``group`` (global ranks).

    ``arrived(source, index, count, data)`` is called for each piece of each bundle received,
    as soon as it is in (``index`` ``0``: the seal, then each of its ``count`` files), in
    order, while the later ones still travel; it must not raise (a bundle's problem is kept,
    see :class:`Landing`)."""
    headers = handshake(group, [(dst, _header_of(b)) for dst, b in outgoing], incoming)
    sends = []
    for dst, bundle in outgoing:
        if bundle is not None:
            going = Outgoing(group, dst, bundle.seal, [len(d) for d in bundle.contents])
            for index, data in enumerate(bundle.contents):
                going.ready(index, data, len(data))
            sends.append(going)
    coming = {src: Incoming(group, src, h) for src, h in headers.items() if int(h[0]) == 1}
    out: dict[int, Bundle | None] = {}
    for src in incoming:
        told = None if arrived is None else functools.partial(arrived, src)
        out[src] = coming[src].arrive(told) if src in coming else None
    for going in sends:
        going.wait()
    return out


def _header_of(bundle: Bundle | None) -> torch.Tensor:
    if bundle is None:
        return header(None, [])
    return header(bundle.seal, [len(data) for data in bundle.contents])


def _receiving(size: int) -> torch.Tensor:
    """A tensor to receive ``size`` bytes into (:func:`files.buffer`: large copies in 2 MiB
    pages)."""
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(files.buffer(size), dtype=torch.uint8)


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The received bytes, without a copy (the view keeps the tensor's memory)."""
    return tensor.numpy().data


def _run(ops: list[Any]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def send(group: Any, dst: int, bundle: Bundle | None) -> None:
    """One bundle to ``dst`` (see :func:`exchange`)."""
    exchange(group, [(dst, bundle)], [])


def receive(group: Any, src: int) -> Bundle | None:
    """One bundle from ``src`` (see :func:`exchange`)."""
    return exchange(group, [], [src])[src]
