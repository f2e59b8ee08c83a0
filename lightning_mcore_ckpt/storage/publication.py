"""A checkpoint ``dirpath`` in an object store (``s3://bucket/prefix``).

The store holds the same layout as a local ``dirpath`` (``global_step_<N>/model/...``,
``shared/``, the tracker), but there is no rename and no fsync there, so the commit is an
order of writes:

1. every file of the step is uploaded (multipart, bounded concurrency), the step's
   ``metadata.json`` excepted; the listing is then checked against the sizes the commit
   recorded;
2. ``metadata.json``, the commit marker, is written last: a step is *published* once it exists;
3. the tracker object follows it (never moved back to an older step).

A killed or failed upload leaves objects without a marker: an incomplete step, which "last",
loading and retention ignore, and which the next publication of that step overwrites.

A store is read through a *view*: a local directory with the step's small files (markers,
indexes, ``common.pt``, ``extra/``) downloaded and its large files (``*.distcp``, safetensors)
registered as remote files (:mod:`lightning_mcore_ckpt.storage.remote_files`), read by range when a load
or a check asks for their bytes. Every check and loader of a local ``dirpath`` then runs on it
unchanged.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format.layout import (
    EXTRA_DIR,
    LOCK_FILE,
    METADATA_FILE,
    SHARED_DIR,
    TRACKER_FILE,
    read_metadata,
    step_number,
)
from lightning_mcore_ckpt.storage import object_store, remote_files
from lightning_mcore_ckpt.storage.object_store import ObjectStore

__all__ = [
    "DURABILITY",
    "newest_intact",
    "open_url_arguments",
    "open_view",
    "publish_step",
    "published_steps",
    "remove_published",
    "resolve_url",
    "upload_tree",
]

log = logging.getLogger(__name__)

DURABILITY = ("store", "local")
"""When a step counts as saved ("last" may name it): once its marker is in the store, or once
it is committed on the local tier (its upload follows)."""
_LARGE = (".distcp", ".safetensors", ".bin")


def _is_large(name: str) -> bool:
    return name.endswith(_LARGE)


# --- publishing ------------------------------------------------------------------------------


def publish_step(
    store: ObjectStore, step: Path, *, tracker: bool = True, sent: dict[str, int] | None = None
) -> dict[str, Any]:
    """Upload a committed local step to ``store``; its marker last, then the tracker.

    ``sent``: the objects (name -> size) this process already uploaded for this commit of the
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
        raise ValueError(f"{step} is not committed ({METADATA_FILE} missing): nothing to publish")
    name = step.name
    files: dict[str, Path] = {}
    for path in sorted(step.rglob("*")):
        rel = path.relative_to(step).as_posix()
        if path.is_file() and rel != METADATA_FILE:
            files[f"{name}/{rel}"] = path
    shared = [n for n in meta.get("files") or {} if n.startswith(f"../{SHARED_DIR}/")]
    if shared:  # written once, referenced by several steps: uploaded once
        present = store.list(SHARED_DIR)
        for ref in shared:
            key = ref[3:]
            local = step.parent / key
            if present.get(key) != local.stat().st_size:
                files[key] = local
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
    marker = (step / METADATA_FILE).read_bytes()
    store.put_bytes(f"{name}/{METADATA_FILE}", marker)  # the commit, last
    total += len(marker)
    number = int(meta["global_step"]) if "global_step" in meta else step_number(step)
    if tracker and number is not None:
        current = _read_int(store.get_bytes(TRACKER_FILE))
        if current is None or current <= number:
            store.put_bytes(TRACKER_FILE, f"{number}\n".encode())
    elapsed = time.perf_counter() - started
    log.info("published %s to %s: %.3f GB in %.2fs", name, store.url, total / 1e9, elapsed)
    return {
        "upload_bytes": total,
        "upload_time_s": elapsed,
        "upload_throughput_gbps": total / 1e9 / elapsed if elapsed > 0 else None,
    }


def _read_int(data: bytes | None) -> int | None:
    text = (data or b"").decode("utf-8", "replace").strip()
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
    name = f"global_step_{step}"
    store.delete([f"{name}/{METADATA_FILE}"])
    store.delete(list(store.list(name)))
    collect_shared(store, keep_shared)


def collect_shared(store: ObjectStore, keep: Iterable[str] = ()) -> None:
    """Delete the ``shared/`` objects that no step in the store references (by its marker)."""
    objects = store.list()
    present = [k for k in objects if k.startswith(f"{SHARED_DIR}/")]
    if not present:
        return
    referenced = {f"{SHARED_DIR}/{Path(k).name}" for k in keep}
    writers = set()
    for name in objects:
        head, _, tail = name.partition("/")
        if step_number(head) is None:
            continue
        writers.add(head)
        if tail == METADATA_FILE:
            meta = json.loads(store.get_bytes(name) or b"{}")
            for ref in meta.get("files") or {}:
                if ref.startswith(f"../{SHARED_DIR}/"):
                    referenced.add(ref[3:])
    doomed = [
        k for k in present if k not in referenced and k.split("/")[1].split("-")[0] not in writers
    ]
    store.delete(doomed)


# --- views -----------------------------------------------------------------------------------

_views: list[Path] = []


def _remove_views() -> None:
    for view in _views:
        remote_files.forget_remote(view)
        shutil.rmtree(view, ignore_errors=True)


atexit.register(_remove_views)


def open_view(url: str, *, rank: int | None = None) -> Path:
    """A local, read-only view of a ``dirpath`` (or of one step) in an object store.

    ``url`` is ``s3://bucket/prefix`` (every step under it: the view is a ``dirpath``) or
    ``s3://bucket/prefix/global_step_<N>`` (that step: the view is a step directory; only its
    objects and ``shared/`` are listed). Small files are downloaded, large ones read from the
    store by range when read. ``rank``: a view for that rank's load, with its own and rank 0's
    ``extra/`` files (the others are only read by range if read). Removed when the process
    exits.

    Example::

        from lightning_mcore_ckpt.format import layout

        view = open_view("s3://ckpts/run1")
        layout.resolve_last(view)  # the newest published, undamaged step's view
    """
    store = ObjectStore.from_url(url)
    leaf = store.prefix.rsplit("/", 1)[-1]
    one = step_number(leaf)
    if one is not None:  # a step: a view of its dirpath, holding that step alone
        parent = store.prefix.rsplit("/", 1)[0] if "/" in store.prefix else ""
        store = ObjectStore(store.bucket, parent, store.concurrency, store.part_size)
        objects = {**store.list(leaf), **store.list(SHARED_DIR)}
    else:
        objects = store.list()
    base = Path(tempfile.mkdtemp(prefix="lmc-view-"))
    _views.append(base)
    root = base / (store.prefix.rsplit("/", 1)[-1] or store.bucket)
    root.mkdir()
    mine = None if rank is None else {f"rank_{rank:05d}.pt", "rank_00000.pt"}
    downloads = []
    for name, size in objects.items():
        if name == LOCK_FILE:
            continue
        local = root / name
        local.parent.mkdir(parents=True, exist_ok=True)
        parts = name.split("/")
        other_rank = mine is not None and parts[-2:-1] == [EXTRA_DIR] and parts[-1] not in mine
        if _is_large(name) or other_rank:
            remote_files.register_remote(local, store, name, size)
        else:
            downloads.append((name, local))
    with ThreadPoolExecutor(8, thread_name_prefix="lmc-view") as pool:
        list(pool.map(lambda item: item[1].write_bytes(store.get_bytes(item[0]) or b""), downloads))
    return root if one is None else root / leaf


def newest_intact(
    store: ObjectStore, reading: Iterable[str] | None = None, deep: bool = False
) -> Path | None:
    """The view of the store's newest published, undamaged step, or ``None`` when it has none.

    Newest first, each candidate's view lists and downloads that step alone: a resume does not
    read the small files of every kept step. A damaged step is skipped with a warning naming
    the file, as on disk (:func:`~lightning_mcore_ckpt.format.layout.resolve_last`).

    Example::

        newest_intact(ObjectStore.from_url("s3://ckpts/run1"))  # .../global_step_500, or None
    """
    from lightning_mcore_ckpt.format.layout import verify_step

    published = sorted(published_steps(store), reverse=True)
    tracked = _read_int(store.get_bytes(TRACKER_FILE))
    if published and tracked != published[0]:  # a hint only: the listing decides
        said = "is missing or unreadable" if tracked is None else f"names step {tracked}"
        where = store.child(TRACKER_FILE).url
        log.warning("%s %s; newest published step: %s", where, said, published[0])
    for step in published:
        view = open_view(store.child(f"global_step_{step}").url)
        problems = verify_step(view, reading, deep)
        if not problems:
            return view
        log.warning(
            "skipping damaged %s: %s; trying the previous published step",
            store.child(view.name).url,
            problems[0],
        )
    return None


def resolve_url(url: str, reading: Iterable[str] | None = None, deep: bool = False) -> str:
    """The step URL a load of ``url`` reads: ``url`` itself when it names a step (complete and
    undamaged, or ``FileNotFoundError``), else its newest published, undamaged step.

    Example::

        resolve_url("s3://ckpts/run1")  # e.g. 's3://ckpts/run1/global_step_500'
    """
    from lightning_mcore_ckpt.format.layout import resolve_checkpoint

    store = ObjectStore.from_url(url)
    if step_number(store.prefix.rsplit("/", 1)[-1]) is not None:
        resolve_checkpoint(open_view(url), reading, deep)  # complete and undamaged, or raises
        return url
    found = newest_intact(store, reading, deep)
    if found is None:
        steps = sorted(published_steps(store))
        what = "every published step is damaged" if steps else "no published step"
        raise FileNotFoundError(
            f"{url}: {what} (published: {steps or 'none'}); `lightning-mcore-ckpt fsck {url}` "
            "says what is wrong"
        )
    return store.child(found.name).url


def upload_tree(local: Path, url: str) -> int:
    """Upload every file under ``local`` to ``url`` (e.g. a Hugging Face export); the bytes.

    Example::

        upload_tree(Path("qwen-hf"), "s3://models/qwen-hf")
    """
    store = ObjectStore.from_url(url)
    files = [p for p in sorted(local.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(4, thread_name_prefix="lmc-upload") as pool:
        return sum(pool.map(lambda p: store.put_file(p, p.relative_to(local).as_posix()), files))


def open_url_arguments(args: Any, names: Iterable[str]) -> None:
    """The command line: each argument in ``names`` that is an object-store URL is replaced
    by a local view of it (see :func:`open_view`)."""
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, str) and object_store.is_url(value):
            object_store.require_client(name, value)
            setattr(args, name, str(open_view(value)))
