"""The publication of a sealed step to an object store (``s3://bucket/prefix``), and its removal.

The store holds the same layout as a local ``dirpath`` (``global_step_<N>/model/...``,
``shared/``, the tracker), but there is no rename and no fsync there, so a step's publication
is an order of writes (:func:`publish_step`):

1. every file of the step is uploaded (multipart, bounded concurrency), the step's
   ``metadata.json`` excepted; the listing is then checked against the sizes its seal
   recorded;
2. ``metadata.json``, the commit marker, is written last: a step is *published* once it exists;
3. the tracker object follows it (never moved back to an older step).

A killed or failed upload leaves objects without a marker: an incomplete step, which "last",
loading and retention ignore, and which the next publication of that step overwrites. A store
is read through views (:mod:`lightning_mcore_ckpt.storage.store_views`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import retention
from lightning_mcore_ckpt.format.layout import SHARED_DIR, TRACKER_FILE, step_dir, step_number
from lightning_mcore_ckpt.format.markers import METADATA_FILE, read_metadata
from lightning_mcore_ckpt.safety.names import inside
from lightning_mcore_ckpt.storage.node_parts import PARTS_DIR
from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = [
    "collect_shared",
    "publish_parts",
    "publish_step",
    "published_steps",
    "remove_published",
    "tracked_step",
    "upload_tree",
]

log = logging.getLogger(__name__)


def publish_step(
    store: ObjectStore, step: Path, *, tracker: bool = True, sent: dict[str, int] | None = None
) -> dict[str, Any]:
    """Upload a sealed local step to ``store``; its marker last, then the tracker.

    ``sent``: the objects (name -> size) this process already uploaded for this seal of the
    step, skipped, and updated (a second publication after a Hugging Face export sends the
    export only).

    Returns the upload's figures: ``upload_bytes``, ``upload_time_s``,
    ``upload_throughput_gbps``. Raises (``OSError`` or the client's error) with nothing
    published when any object could not be written.

    Example::

        publish_step(ObjectStore.from_url("s3://ckpts/run1"), Path("stage/global_step_100"))
    """
    started = time.perf_counter()
    meta = read_metadata(step)
    if meta is None:
        raise ValueError(f"{step} is not sealed ({METADATA_FILE} missing): nothing to publish")
    name = step.name
    files, shared = _objects_of(store, step, meta)
    sent = {} if sent is None else sent
    if not sent:  # objects an earlier, unfinished attempt at this step left (another layout)
        store.delete([k for k in store.list(name) if k not in files])
    files = {k: p for k, p in files.items() if sent.get(k) != p.stat().st_size}
    total = 0
    with ThreadPoolExecutor(
        max(1, min(4, store.concurrency)), thread_name_prefix="lmc-upload"
    ) as pool:
        for size in pool.map(lambda item: store.put_file(item[1], item[0]), files.items()):
            total += size
    listed = {**store.list(name), **(store.list(SHARED_DIR) if shared else {})}
    wrong = [k for k, p in files.items() if listed.get(k) != p.stat().st_size]
    sent.update({k: p.stat().st_size for k, p in files.items() if k not in wrong})
    if wrong:
        raise OSError(
            f"{store.url}: {len(wrong)} objects of {name} are missing or short after their "
            f"upload (e.g. {wrong[0]}); the step is not published"
        )
    total += _commit_marker(store, step, meta, tracker)
    elapsed = time.perf_counter() - started
    log.info("published %s to %s: %.3f GB in %.2fs", name, store.url, total / 1e9, elapsed)
    return {
        "upload_bytes": total,
        "upload_time_s": elapsed,
        "upload_throughput_gbps": total / 1e9 / elapsed if elapsed > 0 else None,
    }


def publish_parts(
    store: ObjectStore,
    step: Path,
    parts: list[dict[str, Any]],
    *,
    tracker: bool = True,
    since: float | None = None,
) -> dict[str, Any]:
    """Publish a step sealed from parts that each node uploaded
    (:mod:`~lightning_mcore_ckpt.storage.node_parts`): every file its seal lists is checked in
    the store's listing, then the marker is written, then the tracker; the nodes'
    confirmations are deleted. Returns the upload's figures: the bytes of every node, the time
    from ``since`` (a ``time.perf_counter()`` value: when the nodes' uploads began; else the
    slowest node's upload) to the tracker, and how many nodes uploaded (``upload_nodes``)."""
    started = time.perf_counter()
    meta = read_metadata(step)
    if meta is None:
        raise ValueError(f"{step} is not sealed ({METADATA_FILE} missing): nothing to publish")
    name = step.name
    files = meta.get("files") or {}
    listed = {**store.list(name), **store.list(SHARED_DIR)}
    wrong = [
        rel
        for rel, size in files.items()
        if listed.get(rel[3:] if rel.startswith("../") else f"{name}/{rel}") != size
    ]
    if wrong:
        raise OSError(
            f"{store.url}: {len(wrong)} files of {name} are missing or short in the store (e.g. "
            f"{wrong[0]}); the step is not published"
        )
    total = sum(int(p["upload_bytes"]) for p in parts) + _commit_marker(store, step, meta, tracker)
    store.delete([k for k in store.list(name) if k.startswith(f"{name}/{PARTS_DIR}/")])
    if since is not None:  # the nodes' uploads, the wait for their confirmations, the seal
        elapsed = time.perf_counter() - since
    else:
        elapsed = max(float(p["upload_time_s"]) for p in parts) + time.perf_counter() - started
    log.info(
        "published %s to %s from %d nodes: %.3f GB in %.2fs",
        name,
        store.url,
        len(parts),
        total / 1e9,
        elapsed,
    )
    return {
        "upload_bytes": total,
        "upload_time_s": elapsed,
        "upload_throughput_gbps": total / 1e9 / elapsed if elapsed > 0 else None,
        "upload_nodes": len(parts),
    }


def _commit_marker(store: ObjectStore, step: Path, meta: dict[str, Any], tracker: bool) -> int:
    # The commit: the marker, last; then the tracker (never moved back). Its bytes.
    marker = (step / METADATA_FILE).read_bytes()
    store.put_bytes(f"{step.name}/{METADATA_FILE}", marker)
    number = int(meta["global_step"]) if "global_step" in meta else step_number(step)
    if tracker and number is not None:
        current = tracked_step(store)
        if current is None or current <= number:
            store.put_bytes(TRACKER_FILE, f"{number}\n".encode())
    return len(marker)


def _objects_of(
    store: ObjectStore, step: Path, meta: dict[str, Any]
) -> tuple[dict[str, Path], bool]:
    # The objects a step's publication writes (name -> local file), its marker excepted, and
    # whether it references shared/ files (written once: uploaded when not there yet).
    files: dict[str, Path] = {}
    for path in sorted(step.rglob("*")):
        rel = path.relative_to(step).as_posix()
        if path.is_file() and rel != METADATA_FILE:
            files[f"{step.name}/{rel}"] = path
    shared = [n for n in meta.get("files") or {} if n.startswith(f"../{SHARED_DIR}/")]
    if shared:
        present = store.list(SHARED_DIR)
        for ref in shared:
            key = ref[3:]
            local = inside(step.parent, key, f"{step / METADATA_FILE}'s file list")
            if present.get(key) != local.stat().st_size:
                files[key] = local
    return files, bool(shared)


def tracked_step(store: ObjectStore) -> int | None:
    """The step the store's tracker names, or ``None`` when it is missing or garbled (a hint
    only: the markers decide)."""
    text = (store.get_bytes(TRACKER_FILE) or b"").decode("utf-8", "replace").strip()
    return int(text) if text.isdigit() else None


def published_steps(store: ObjectStore) -> dict[int, int]:
    """The steps whose marker is in the store: step number -> marker size.

    Example::

        sorted(published_steps(ObjectStore.from_url("s3://ckpts/run1")))  # e.g. [400, 500]
    """
    found = {}
    for name, size in store.list().items():
        head, _, tail = name.partition("/")
        number = step_number(head)
        if number is not None and tail == METADATA_FILE:
            found[number] = size
    return found


def remove_published(store: ObjectStore, step: int, keep_shared: Iterable[str] = ()) -> None:
    """Delete a step from the store: its marker first (it is then incomplete), then the rest,
    then the ``shared/`` objects no published step references any more."""
    name = step_dir(".", step).name
    store.delete([f"{name}/{METADATA_FILE}"])
    store.delete(list(store.list(name)))
    collect_shared(store, keep_shared)


def collect_shared(store: ObjectStore, keep: Iterable[str] = ()) -> None:
    """Delete the ``shared/`` objects that no step in the store references (by its marker), by
    the rule of a directory's (:func:`lightning_mcore_ckpt.format.retention.collect_shared`)."""
    objects = store.list()
    present = [k[len(SHARED_DIR) + 1 :] for k in objects if k.startswith(f"{SHARED_DIR}/")]
    if not present:
        return
    referenced = {Path(k).name for k in keep}
    writers = set()
    for name in objects:
        head, _, tail = name.partition("/")
        if step_number(head) is None:
            continue
        writers.add(head)
        if tail == METADATA_FILE:
            referenced |= retention.shared_references(json.loads(store.get_bytes(name) or b"{}"))
    doomed = retention.unreferenced_shared(present, referenced, writers)
    store.delete([f"{SHARED_DIR}/{n}" for n in doomed])


def upload_tree(local: Path, url: str) -> int:
    """Upload every file under ``local`` to ``url`` (e.g. a Hugging Face export); the bytes.

    Example::

        upload_tree(Path("qwen-hf"), "s3://models/qwen-hf")
    """
    store = ObjectStore.from_url(url)
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(4, thread_name_prefix="lmc-upload") as pool:
        return sum(pool.map(lambda p: store.put_file(p, p.relative_to(local).as_posix()), files))
