"""Records' layouts parsed once per distinct head.

A record's layout (dtype, shape, strides, where its storage starts) is what ``torch.load`` onto
the meta device makes of it: the zip's central directory at the record's end, then the pickle
at its front. That parse costs about a quarter of a millisecond of CPU per record, and a step of
a model with many layers holds hundreds of records with a handful of layouts: every layer's
shard of one weight is pickled alike. The parse is the largest fixed cost of a load.

:class:`Layouts` parses a record whose head it has not seen, and keeps the layout under the
record's bytes in front of its storage, as the parse found where that storage starts: the local
headers and the pickle, the format version, the alignment and the byte order, everything the
layout is made of. A record whose bytes in front of its data are the same, byte for byte, up to
the same place, has that layout without a parse (nor a read of its tail). The place is the
parse's; a guess of it (:meth:`~._record_order.Record.data_start`) only names the key to look
up, so a wrong guess finds nothing and costs a parse, never a wrong layout.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from lightning_mcore_ckpt.engine._record_order import Record

__all__ = ["Layout", "Layouts"]


class Layout(NamedTuple):
    """A record's tensor on the meta device, and where its storage's bytes start in the record
    (``None`` when the parse did not say)."""

    tensor: torch.Tensor
    start: int | None


class Layouts:
    """The layouts of one load's records, each distinct head parsed once. Safe to share between
    reader threads (two threads may parse one head at once; both find the same layout)."""

    def __init__(self) -> None:
        self._parsed: dict[tuple[int, bytes], Layout] = {}
        self._lock = threading.Lock()

    def of(self, record: Record, data_start: int | None) -> Layout:
        """``record``'s layout. ``data_start`` is where its head says the data start (``None``:
        it does not say); the layout is looked up under the bytes in front of that place."""
        if data_start is not None:
            key = (data_start, record.serve(0, data_start))
            with self._lock:
                known = self._parsed.get(key)
            if known is not None:
                return known
        tensor = torch.load(record.view(), map_location="meta", weights_only=True)
        start = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
        layout = Layout(tensor, start)
        if start is not None and 0 < start <= record.length:
            key = (start, record.serve(0, start))
            with self._lock:
                self._parsed[key] = layout
        return layout
