"""``fast_tier.jsonl``: the fast tier's record of its saves and recoveries, kept in the
persistent tier, where ``lightning-mcore-ckpt report`` reads it.

Rank 0 adds one JSON line per fast save and per recovery. With a local ``dirpath`` it appends
them to ``<dirpath>/fast_tier.jsonl``. With an ``s3://`` ``dirpath`` the record is the object
``<prefix>/fast_tier.jsonl``: an object store cannot append, so rank 0 reads the object once
(the record of the runs before this one), then writes it whole after each new line, in one
``PUT`` (a few hundred bytes a line). A ``PUT`` replaces the object whole or not at all, and the
run's lock keeps a second job from writing it; a ``PUT`` that fails is logged and its lines are
sent with the next one. Nothing of the record is kept on a node's own disk, so it is not lost
with a node.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = ["RECORDS", "FastRecords"]

log = logging.getLogger(__name__)

RECORDS = "fast_tier.jsonl"
"""The name of the record in the persistent tier: ``<dirpath>/fast_tier.jsonl``, or the object
``<prefix>/fast_tier.jsonl`` of an ``s3://`` ``dirpath``."""


class FastRecords:
    """Where rank 0 adds the fast tier's records (see the module): the file ``dirpath /
    RECORDS``, or, when ``store`` is given, the object ``RECORDS`` under its prefix.

    Example::

        FastRecords(Path("checkpoints/run")).append({"kind": "fast_save", "step": 20})
    """

    def __init__(self, dirpath: Path, store: ObjectStore | None = None) -> None:
        self._path = dirpath / RECORDS
        self._store = store
        self._sent: str | None = None  # the object's text as last written (None: not read yet)
        self._pending: list[str] = []  # lines not in the store yet

    @property
    def where(self) -> str:
        """The file or the object's URL."""
        return str(self._path) if self._store is None else self._store.child(RECORDS).url

    def append(self, record: dict[str, Any]) -> None:
        """Add one record (rank 0). A failure is logged as a warning: the records are figures,
        and a save or a recovery does not fail for them."""
        line = json.dumps(record, sort_keys=True) + "\n"
        try:
            if self._store is None:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                with open(self._path, "a", encoding="utf-8") as f:
                    f.write(line)
            else:
                self._pending.append(line)
                self._upload(self._store)
        except Exception as err:  # noqa: BLE001 - OSError, or the S3 client's errors
            log.warning("could not record the fast tier's figures in %s: %s", self.where, err)

    def _upload(self, store: ObjectStore) -> None:
        if self._sent is None:  # the runs before this one: kept, never overwritten
            old = store.get_bytes(RECORDS)
            text = "" if old is None else old.decode("utf-8", errors="replace")
            # A last line cut short stays one malformed line of its own (report skips it).
            self._sent = text if not text or text.endswith("\n") else text + "\n"
        text = self._sent + "".join(self._pending)
        store.put_bytes(RECORDS, text.encode("utf-8"))
        self._sent, self._pending = text, []
