"""A save's ``.metadata`` written ahead with its shards, instead of gathered at its finalisation.

Megatron-Core finalises each part of a save (``model/``, ``optim/``) collectively: every rank's
write results (which tensor lies in which file, at which offset, how long) are gathered to
rank 0, which writes the part's ``.metadata`` (torch DCP's index of the files) and fsyncs it.
For an async save that runs on the training thread, at a later step; at scale the gather is
what rank 0 receives most of, each save.

While a part's plan is kept (its structure unchanged), each rank writes the same files with the
same records: its write results are those of the part's save before. So each rank keeps its own
results of the part's last finalisation (:class:`KeptResults`), and rank 0 every rank's (what
that gather returned). Once this rank's files are written (by the background write of an async
save, inline for a sync one), the write compares their results with the kept ones
(:meth:`SaveAhead.written`); rank 0, when its own are the kept ones, also writes ``.metadata``
there from every rank's kept results. The ranks agree on whether every rank's results were its
kept ones (an async save: in the all-reduce that already tells them every write is done,
``BackgroundWrites``; a sync one: one all-reduce after the write's agreement), and the
finalisation runs under that verdict (:func:`agreed`):

- every rank's results were the kept ones: the ``.metadata`` written ahead is byte for byte the
  one the gather would have produced, and the finalisation skips the gather and the write;
- any rank's differ (a first save, a record whose size changed, a failed write ahead): the
  finalisation gathers and writes ``.metadata`` as Megatron-Core does, and every rank keeps the
  results of that save.

What is kept changes only at a finalisation every rank runs (the same verdict everywhere), so
rank 0's record of every rank's results and each rank's own always come from the same save;
rank 0 forgets its record when that finalisation fails. Megatron-Core's own writer is
finalised as before (the verdict defaults to "not agreed").
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["KeptResults", "SaveAhead", "WriteResults", "agreed", "collecting", "is_agreed"]

log = logging.getLogger(__name__)

_AGREED: contextvars.ContextVar[bool] = contextvars.ContextVar("lmc_metadata_ahead", default=False)
_COLLECTING: contextvars.ContextVar[list[SaveAhead] | None] = contextvars.ContextVar(
    "lmc_metadata_ahead_collecting", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[list[SaveAhead]]:
    """The :class:`SaveAhead` of every part planned inside (one save's), in order."""
    found: list[SaveAhead] = []
    token = _COLLECTING.set(found)
    try:
        yield found
    finally:
        _COLLECTING.reset(token)


@contextlib.contextmanager
def agreed(everywhere: bool) -> Iterator[None]:
    """While finalising a save whose ranks agreed that every rank's write results were the
    kept ones (``everywhere``): its finalisers skip the gather and the ``.metadata`` write."""
    token = _AGREED.set(everywhere)
    try:
        yield
    finally:
        _AGREED.reset(token)


def is_agreed() -> bool:
    """Whether the save being finalised was agreed by every rank (see :func:`agreed`)."""
    return _AGREED.get()


class WriteResults(queue.Queue):  # type: ignore[type-arg]
    """Megatron-Core's write results queue of one part of a save, in this process (our writer
    fills it); it remembers what was put last, for :meth:`SaveAhead.written`."""

    def __init__(self) -> None:
        super().__init__()
        self.last: Any = None

    def _put(self, item: Any) -> None:
        self.last = item
        super()._put(item)


class KeptResults:
    """One part's write results at its last finalisation: this rank's own, and on the
    coordinator (rank 0) every rank's. Kept by the part's save strategy, with its plans."""

    def __init__(self) -> None:
        self.mine: list[Any] | None = None
        self.everyone: list[list[Any]] | None = None


class SaveAhead:
    """One part of one save: compares this rank's write results with the kept ones once its
    files are written and, on the coordinator, writes ``.metadata`` ahead; then keeps the
    results the finalisation settles on. Registered with :func:`collecting` when made."""

    def __init__(
        self, kept: KeptResults, storage_writer: Any, metadata: Any, coordinator: bool
    ) -> None:
        self._kept = kept
        self._writer = storage_writer
        self._metadata = metadata
        self._coordinator = coordinator
        found = _COLLECTING.get()
        if found is not None:
            found.append(self)

    def written(self) -> bool:
        """Background write, once this rank's files of every part are written: whether this
        part's results are the kept ones (on the coordinator: and ``.metadata`` was written
        from every rank's kept results). Raises nothing: a failure here only means "not the
        kept ones", and the finalisation does what it always did."""
        if self._kept.mine is None:
            return False
        results = self._writer.results_queue
        collected = {} if results is None else getattr(results, "last", None)
        if not isinstance(collected, Mapping):  # the write's error, or nothing written
            return False
        mine = [result for part in collected.values() for result in part]
        if mine != self._kept.mine:
            return False
        if not self._coordinator:
            return True
        everyone = self._kept.everyone
        if everyone is None or self._metadata is None:
            return False
        try:
            self._writer.finish(self._metadata, everyone)
        except Exception as err:  # noqa: BLE001 - the finalisation writes it again, and reports
            log.debug("writing .metadata ahead failed: %s", err)
            return False
        return True

    def finalized(self, mine: Any, everyone: list[list[Any]] | None) -> None:
        """Megatron-Core's finalisation ran (not agreed): this rank's results of the save
        (``mine``: a list, else the write's wrapped error) and, on the coordinator, every rank's
        when ``.metadata`` was written from them (``None``: it was not)."""
        self._kept.mine = list(mine) if isinstance(mine, list) else None
        if self._coordinator:
            self._kept.everyone = everyone
