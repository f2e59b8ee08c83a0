"""A step's parts on nodes that share no file system, each uploaded by its own node.

On a cluster without a shared file system, an object store's local tier is node-local: each
node's ranks write their files of a step into their node's directory (the same path on every
node, different disks), and no process can read another node's. The step is then published in
parts:

1. each node's leader (the lowest rank that sees the directory) uploads its node's files of the
   step, checks their sizes in the store's listing, and writes its *confirmation*: an object
   ``<step>/.parts/rank_<leader>.json`` listing every object it uploaded with its size and
   digest (the digest each rank recorded while writing, else hashed now). The nodes upload at
   once: a step's upload is not capped by one node's network;
2. global rank 0 waits for every leader's confirmation (:func:`await_parts`), checks that the
   digests agree with those the ranks recorded (the commit record), and seals the step with
   every node's files (:func:`~lightning_mcore_ckpt.storage.seal.seal_step`'s ``parts``);
3. the publication writes the marker last, as on one node; the confirmations are then deleted.

A leader that fails writes a confirmation saying why, so that rank 0 fails the commit at once
instead of at the timeout; a node that dies leaves no confirmation (the timeout names it). Either
way the step never gets its marker: it is never "last", and the next save of that step number
deletes its objects before any node uploads again
(:meth:`~lightning_mcore_ckpt.storage.store_tier.StoreTier.before_write`).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import integrity
from lightning_mcore_ckpt.format.layout import SHARED_DIR
from lightning_mcore_ckpt.format.markers import METADATA_FILE, STARTED_MARKER
from lightning_mcore_ckpt.safety.names import inside
from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = ["PARTS_DIR", "await_parts", "merge_parts", "part_name", "upload_part"]

log = logging.getLogger(__name__)

PARTS_DIR = ".parts"
"""Under a step's prefix in the store: each node's confirmation of its part, until the marker."""

_POLL_S = (0.01, 0.5)
"""How often rank 0 lists the confirmations: from the first interval, doubling up to the last
(a confirmation that comes right after rank 0's own upload is seen at once; a slow node costs
two listings a second)."""


def part_name(step: str, leader: int) -> str:
    """The object that confirms the part of ``step`` uploaded by ``leader``'s node."""
    return f"{step}/{PARTS_DIR}/rank_{leader:05d}.json"


def upload_part(
    store: ObjectStore, step: Path, hashes: Mapping[str, str], leader: int
) -> dict[str, Any]:
    """Upload this node's part of the written step ``step`` (leader ``leader``), then its
    confirmation; the confirmation.

    ``hashes``: the digests every rank recorded while writing, by path relative to the step
    (``../shared/...`` for files written once, outside it). A node uploads what its ranks wrote:
    every file under ``step`` but the step's marker (and the start marker, but on global rank
    0's node: the step has one), and the ``shared/`` files the step references that are here and
    not in the store yet. Raises, after writing a confirmation that names the error, when
    anything could not be uploaded.
    """
    started = time.perf_counter()
    name = step.name
    try:
        files = _part_files(store, step, hashes, with_start_marker=leader == 0)
        with ThreadPoolExecutor(
            max(1, min(4, store.concurrency)), thread_name_prefix="lmc-upload"
        ) as pool:
            total = sum(pool.map(lambda item: store.put_file(item[1], item[0]), files.items()))
        listed = {**store.list(name), **store.list(SHARED_DIR)}
        objects = {}
        for key, path in files.items():
            size = path.stat().st_size
            if listed.get(key) != size:
                raise OSError(f"{store.url}/{key} is missing or short after its upload")
            digest = hashes.get(_relative(name, key)) or integrity.hash_file(path)
            objects[key] = {"size": size, "digest": digest}
    except Exception as err:
        _confirm(store, name, leader, {"error": f"{type(err).__name__}: {err}"})
        raise
    elapsed = time.perf_counter() - started
    figures = {"upload_bytes": total, "upload_time_s": elapsed}
    confirmation = {"objects": objects, **figures}
    _confirm(store, name, leader, confirmation)
    log.info("uploaded this node's part of %s: %.3f GB in %.2fs", name, total / 1e9, elapsed)
    return {"rank": leader, "host": socket.gethostname(), **confirmation}


def _part_files(
    store: ObjectStore, step: Path, hashes: Mapping[str, str], with_start_marker: bool
) -> dict[str, Path]:
    skipped = {METADATA_FILE} if with_start_marker else {METADATA_FILE, STARTED_MARKER}
    files = {
        f"{step.name}/{path.relative_to(step).as_posix()}": path
        for path in sorted(step.rglob("*"))
        if path.is_file() and path.relative_to(step).as_posix() not in skipped
    }
    shared = [n[3:] for n in hashes if n.startswith(f"../{SHARED_DIR}/")]
    if shared:
        present = store.list(SHARED_DIR)
        for key in shared:
            local = inside(step.parent, key, f"the digests recorded for {step.name}")
            if local.is_file() and present.get(key) != local.stat().st_size:
                files[key] = local
    return files


def _relative(step: str, key: str) -> str:
    # An object's name as a step's records name its file: relative to the step.
    return key[len(step) + 1 :] if key.startswith(f"{step}/") else f"../{key}"


def _confirm(store: ObjectStore, step: str, leader: int, body: dict[str, Any]) -> None:
    text = json.dumps({"rank": leader, "host": socket.gethostname(), **body}, sort_keys=True)
    try:
        store.put_bytes(part_name(step, leader), text.encode())
    except Exception as err:  # noqa: BLE001 - rank 0 then names this node at its timeout
        log.error("could not confirm this node's part of %s to %s: %s", step, store.url, err)


def await_parts(
    store: ObjectStore, step: str, leaders: Sequence[int], timeout_s: float
) -> list[dict[str, Any]]:
    """Global rank 0: every other leader's confirmation of its part of ``step``, once all are in
    the store. Raises naming the node when one failed, or the leaders still missing after
    ``timeout_s`` (a node lost mid-upload)."""
    deadline = time.monotonic() + timeout_s
    wanted = {part_name(step, r): r for r in leaders}
    found: dict[int, dict[str, Any]] = {}
    pause = _POLL_S[0]
    while True:
        listed = store.list(f"{step}/{PARTS_DIR}")
        for key in sorted(set(listed) & set(wanted)):
            rank = wanted[key]
            if rank not in found:
                found[rank] = json.loads(store.get_bytes(key) or b"{}")
                if "error" in found[rank]:
                    host = found[rank].get("host", "?")
                    raise OSError(
                        f"the node of rank {rank} ({host}) failed to upload its part of {step}: "
                        f"{found[rank]['error']}"
                    )
        missing = [r for r in leaders if r not in found]
        if not missing:
            return [found[r] for r in leaders]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the nodes of ranks {missing} did not confirm their parts of {step} within "
                f"{timeout_s:.0f} s (a node lost, or its upload stalled)"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])


def merge_parts(
    step: str, parts: Sequence[Mapping[str, Any]], recorded: Mapping[str, str]
) -> dict[str, tuple[int, str]]:
    """The files of ``step`` that the ``parts`` confirm, by path relative to the step: (size,
    digest). Raises when a confirmed digest differs from the one its rank ``recorded`` while
    writing, or when two nodes uploaded one object."""
    merged: dict[str, tuple[int, str]] = {}
    for part in parts:
        for key, found in part["objects"].items():
            rel = _relative(step, key)
            if rel in merged and not rel.startswith("../"):
                raise OSError(f"{key} of {step} was uploaded by two nodes")
            wanted = recorded.get(rel)
            if wanted is not None and wanted != found["digest"]:
                raise OSError(
                    f"{key} of {step}: the node of rank {part['rank']} uploaded a file whose "
                    f"digest {found['digest']} differs from the one recorded at its write "
                    f"({wanted}); the step is not published"
                )
            merged[rel] = (int(found["size"]), str(found["digest"]))
    return merged
