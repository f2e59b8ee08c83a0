"""Staging: the host copies of a save's tensors, unbounded or bounded in bytes
(``MegatronStrategy(ckpt_max_staging_bytes=...)``).

Unbounded (the default), :class:`StagingBuffers` copies every tensor of a save into a
host buffer of its own before the first file is written: one copy, then the whole write in the
background, at the cost of host memory as large as the rank's state.

Bounded, :class:`BoundedStaging` copies the tensors into one host buffer of
``max(min(cap, bytes to copy), largest tensor)`` bytes (pinned for CUDA tensors), used as a ring
and reused by every later save. The save's shard files are handed to the writer threads first;
the training thread then copies the tensors in the order the files are written (file after file,
each file's tensors in order). A writer writes each tensor as soon as it is copied and gives its
bytes back; a copy waits until the bytes it needs are free and until the bytes copied but not yet
written, its own included, are at most the cap (a tensor larger than the cap alone). So at most
the cap is staged at once (one tensor larger than the cap is a bucket of its own), and training
resumes once the last tensor is copied: after every byte but the last cap's has been written.

No deadlock: the copies follow the order the files are queued in the writers' pool, so the
oldest copied, unwritten tensor belongs to a file whose predecessors are all copied, which gets
a thread and reaches it.

Any failure (a copy, a write, an abort) stops the whole save: every waiting writer raises, the
copying stops, and the save fails as any failed write does (on every rank, at its save).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "BoundedStaging",
    "Slot",
    "StagingBuffers",
    "StagingSession",
    "StagingStopped",
    "WriteAborted",
    "copy_to_host",
]

_ALIGN = 64
"""Every tensor starts at a multiple of this many bytes of the ring (any dtype's alignment)."""
_POLL_S = 0.1
"""How often a wait looks at the abort flag."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def copy_to_host(buffer: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
    """Every copy a save stages goes through here (``non_blocking``: into pinned memory)."""
    buffer.copy_(source, non_blocking=non_blocking)


class WriteAborted(RuntimeError):
    """The run stopped while this write was in flight (see ``ShardWriter.abort``)."""


class StagingStopped(RuntimeError):
    """This file's write stopped because another part of the save failed (named here)."""


@dataclasses.dataclass(eq=False)
class _Span:
    offset: int
    size: int
    released: bool = False


class Slot:
    """A tensor of a save, to be copied into the ring; what a shard file holds in its place
    until then. The writer of its file waits for it (:meth:`wait`), writes it, then gives its
    bytes back (:meth:`written`)."""

    def __init__(self, session: StagingSession, source: torch.Tensor) -> None:
        self.session = session
        self.source: torch.Tensor | None = source
        self.shape, self.dtype = source.shape, source.dtype
        self.nbytes = source.numel() * source.element_size()
        self.on_cuda = source.device.type == "cuda"
        self.tensor: torch.Tensor | None = None
        self._span: _Span | None = None
        self._event: Any = None

    def wait(self, abort: threading.Event) -> torch.Tensor:
        """The staged copy, once made (the device-to-host copy complete)."""
        self.session.wait_for(self, abort)
        assert self.tensor is not None
        if self._event is not None:
            self._event.synchronize()
        return self.tensor

    def written(self) -> None:
        """Its bytes are on their way to the file: the ring may reuse them."""
        if self._span is not None:
            self.session.release(self._span)
            self._span = None
        self.tensor = None


class StagingSession:
    """One save's copies through the ring: :meth:`stage` on the training thread, the writers'
    :meth:`Slot.wait` and :meth:`Slot.written` on theirs."""

    def __init__(
        self, ring: torch.Tensor, cap: int, parts: Sequence[Sequence[Any]], snapshot: bool
    ):
        self._ring = ring
        self._host = ring.numpy()
        self._pinned = ring.is_pinned()
        self._cap = cap
        self._cond = threading.Condition()
        self._spans: collections.deque[_Span] = collections.deque()
        self._head = 0
        self._used = 0
        self.error: BaseException | None = None
        self.peak_bytes = 0
        """The most bytes held by copied, unwritten tensors at once."""
        self.slots: list[Slot] = []
        self.parts = [self._wrap(buckets, snapshot) for buckets in parts]
        """Each part's buckets, every tensor to copy replaced by its :class:`Slot`."""

    def _wrap(self, buckets: Sequence[Any], snapshot: bool) -> list[Any]:
        wrapped = []
        for file_name, storage_key, (bytes_data, tensor_data) in buckets:
            tensors: list[tuple[Any, Any]] = []
            for item, tensor in tensor_data:
                tensor = tensor.detach()
                if snapshot or tensor.device.type != "cpu":
                    slot = Slot(self, tensor)
                    self.slots.append(slot)
                    tensors.append((item, slot))
                else:  # a sync save of a CPU tensor: written where it is
                    tensors.append((item, tensor))
            wrapped.append((file_name, storage_key, (bytes_data, tensors)))
        return wrapped

    # --- the training thread ----------------------------------------------------------------

    def stage(self, abort: threading.Event) -> None:
        """Copy every slot's tensor, in order, as the ring frees up. A failure is not raised:
        it stops the save, whose writers report it."""
        cuda = False
        try:
            for slot in self.slots:
                source = slot.source
                assert source is not None
                if slot.nbytes == 0:
                    self._ready(slot, torch.empty(slot.shape, dtype=slot.dtype), None, None)
                    continue
                span = self._alloc(_aligned(slot.nbytes), abort)
                if span is None:
                    return
                end = span.offset + slot.nbytes
                # Copied into the ring itself (the pinned allocation: an asynchronous copy);
                # written through a tensor of its own bytes only (torch.save writes a tensor's
                # whole storage).
                copy_to_host(
                    self._ring[span.offset : end].view(slot.dtype).view(slot.shape),
                    source,
                    self._pinned and slot.on_cuda,
                )
                buffer = torch.from_numpy(self._host[span.offset : end])
                buffer = buffer.view(slot.dtype).view(slot.shape)
                event = None
                if slot.on_cuda:
                    cuda = True
                    event = torch.cuda.Event()
                    event.record()
                self._ready(slot, buffer, span, event)
            if cuda:
                torch.cuda.synchronize()  # every device-to-host copy complete: the snapshot
        except BaseException as err:  # stops the save; its writers report it
            self.fail(err)
            if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: goes on up
                raise
        finally:
            for slot in self.slots:
                slot.source = None  # the training state is not held after the save's copies

    def _alloc(self, size: int, abort: threading.Event) -> _Span | None:
        with self._cond:
            while True:
                if self.error is not None or abort.is_set():
                    return None
                offset = self._fit(size)
                if offset is not None:
                    span = _Span(offset, size)
                    self._spans.append(span)
                    self._head = offset + size
                    self._used += size
                    self.peak_bytes = max(self.peak_bytes, self._used)
                    return span
                self._cond.wait(_POLL_S)

    def _fit(self, size: int) -> int | None:
        """Where in the ring ``size`` bytes fit now, if they may be staged now."""
        if not self._spans:
            self._head = 0
            return 0
        if self._used + size > self._cap:
            return None
        tail = self._spans[0].offset
        if self._head > tail:  # free: [head, end) and [0, tail)
            if self._head + size <= self._ring.numel():
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None  # wrapped: [head, tail)

    def _ready(self, slot: Slot, tensor: torch.Tensor, span: _Span | None, event: Any) -> None:
        with self._cond:
            slot.tensor, slot._span, slot._event = tensor, span, event
            self._cond.notify_all()

    # --- the writers ------------------------------------------------------------------------

    def wait_for(self, slot: Slot, abort: threading.Event) -> None:
        with self._cond:
            while slot.tensor is None:
                if abort.is_set():
                    raise WriteAborted("the run stopped while this save was being staged")
                if self.error is not None:
                    raise StagingStopped(str(self.error)) from self.error
                self._cond.wait(_POLL_S)

    def release(self, span: _Span) -> None:
        with self._cond:
            span.released = True
            while self._spans and self._spans[0].released:
                self._used -= self._spans.popleft().size
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Stop the save: waiting writers raise, copying stops (the first error is kept)."""
        with self._cond:
            if self.error is None and not isinstance(error, StagingStopped):
                self.error = error
            self._cond.notify_all()


class StagingBuffers:
    """Host buffers the tensors of a save are copied into, allocated once and reused.

    Keyed by the shard's place in the checkpoint (directory and index); a tensor whose shape or
    dtype changed gets a new buffer, and buffers no save used any more are freed.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}
        self.allocations = 0
        """Buffers allocated so far (a reused buffer is not counted again)."""
        self.allocated_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, name: str, buckets: Sequence[Any], snapshot: bool) -> list[Any]:
        """``buckets`` with every tensor on the host: copied into this rank's buffers when
        ``snapshot`` (training goes on while they are written) or when not on the CPU; else the
        tensors themselves (a sync save of CPU tensors: nothing changes them meanwhile)."""
        staged, used, cuda = [], set(), False
        for file_name, storage_key, (bytes_data, tensor_data) in buckets:
            tensors = []
            for item, tensor in tensor_data:
                tensor = tensor.detach()
                if snapshot or tensor.device.type != "cpu":
                    key = (name, item.index)
                    used.add(key)
                    tensor = self._copy(key, tensor)
                    cuda = cuda or tensor.is_pinned()
                tensors.append((item, tensor))
            staged.append((file_name, storage_key, (bytes_data, tensors)))
        if cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        for key in [k for k in self._buffers if k[0] == name and k not in used]:
            del self._buffers[key]
        return staged

    def reserve(self, name: str, buckets: Sequence[Any], snapshot: bool) -> None:
        """Allocate now the buffers :meth:`stage` would allocate for ``buckets``, and fault in
        their pages, copying nothing: the first save's allocations (pinned memory for device
        tensors: about 0.6 s a GiB) made before it (``CheckpointWriter.plan_ahead``)."""
        for _, _, (_, tensor_data) in buckets:
            for item, tensor in tensor_data:
                if snapshot or tensor.device.type != "cpu":
                    self._buffer((name, item.index), tensor.detach(), fault_in=True)

    def _copy(self, key: tuple[str, Any], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer(key, tensor)
        copy_to_host(buffer, tensor, buffer.is_pinned())
        return buffer

    def _buffer(
        self, key: tuple[str, Any], tensor: torch.Tensor, fault_in: bool = False
    ) -> torch.Tensor:
        """The buffer of ``key``, allocated when it has none of ``tensor``'s shape and dtype."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            if fault_in and not pin:  # pinned memory is resident once allocated
                buffer.zero_()
            self._buffers[key] = buffer
            self.allocations += 1
            self.allocated_bytes += buffer.numel() * buffer.element_size()
        return buffer


class BoundedStaging:
    """The ring of a rank, allocated at the first save that copies and reused by later ones
    (allocated again, larger, only when a save needs more: a tensor larger than any before)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._ring: torch.Tensor | None = None
        self.allocations = 0
        """Rings allocated so far."""
        self.latest: StagingSession | None = None
        """The latest save's session (its ``peak_bytes``: the most it held at once)."""

    @property
    def nbytes(self) -> int:
        """Bytes held now (between saves too)."""
        return 0 if self._ring is None else self._ring.numel()

    def session(self, parts: Sequence[Sequence[Any]], snapshot: bool) -> StagingSession | None:
        """A session for the tensors of ``parts`` (each a list of Megatron-Core's write
        buckets) that must be copied: all with ``snapshot``, else those not on the CPU. ``None``
        when none must."""
        ring = self._ring_for(parts, snapshot)
        if ring is None:
            return None
        self.latest = StagingSession(ring, self.max_bytes, parts, snapshot)
        return self.latest

    def reserve(self, parts: Sequence[Sequence[Any]], snapshot: bool) -> None:
        """Allocate now the ring :meth:`session` would need for ``parts``, its pages faulted
        in, copying nothing (the first save's allocation made before it, as
        :meth:`StagingBuffers.reserve`)."""
        self._ring_for(parts, snapshot, fault_in=True)

    def _ring_for(
        self, parts: Sequence[Sequence[Any]], snapshot: bool, fault_in: bool = False
    ) -> torch.Tensor | None:
        sources = [
            t.detach()
            for buckets in parts
            for _, _, (_, tensor_data) in buckets
            for _, t in tensor_data
            if snapshot or t.device.type != "cpu"
        ]
        if not sources:
            return None
        sizes = [_aligned(t.numel() * t.element_size()) for t in sources]
        capacity = max(min(self.max_bytes, sum(sizes)), max(sizes), _ALIGN)
        pin = any(t.device.type == "cuda" for t in sources)
        ring = self._ring
        if ring is None or ring.numel() < capacity or (pin and not ring.is_pinned()):
            self._ring = None  # freed before its successor is allocated
            ring = self._ring = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
            if fault_in and not pin:  # pinned memory is resident once allocated
                ring.zero_()
            self.allocations += 1
        return ring
