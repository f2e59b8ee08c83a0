"""Reading a store: local views of an object-store ``dirpath`` or step, and which step a URL
names.

A store is read through a *view*: a local directory with the step's small files (markers,
indexes, ``common.pt``, ``extra/``) downloaded and its large files (``*.distcp``, safetensors)
registered as remote files (:mod:`lightning_mcore_ckpt.storage.remote_files`), read by range
when a load or a check asks for their bytes. Every check and loader of a local ``dirpath`` then
runs on it unchanged. How steps get into a store: :mod:`lightning_mcore_ckpt.storage.publication`.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format.layout import (
    EXTRA_DIR,
    SHARED_DIR,
    TRACKER_FILE,
    resolve_checkpoint,
    step_name,
    step_number,
    verify_step,
)
from lightning_mcore_ckpt.safety.names import inside
from lightning_mcore_ckpt.storage import object_store, remote_files
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.storage.object_store import ObjectStore
from lightning_mcore_ckpt.storage.publication import published_steps, tracked_step

__all__ = ["newest_intact", "open_url_arguments", "open_view", "resolve_url"]

log = logging.getLogger(__name__)

_LARGE = (".distcp", ".safetensors", ".bin")
"""Files a view reads by range from the store; the others are downloaded."""

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

    Every listed name is checked before anything is written
    (:func:`~lightning_mcore_ckpt.safety.names.inside`): a name that would leave the view
    (``../x``, ``a//abs``) raises :class:`~lightning_mcore_ckpt.safety.names.UnsafeNameError`
    naming the object, and nothing is downloaded.

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
    listing = f"the listing of {store.url}"
    checked = {name: inside(root, name, listing) for name in objects if name != LOCK_FILE}
    downloads = []
    for name, local in checked.items():
        size = objects[name]
        local.parent.mkdir(parents=True, exist_ok=True)
        parts = name.split("/")
        other_rank = mine is not None and parts[-2:-1] == [EXTRA_DIR] and parts[-1] not in mine
        if name.endswith(_LARGE) or other_rank:
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
    published = sorted(published_steps(store), reverse=True)
    tracked = tracked_step(store)
    if published and tracked != published[0]:  # a hint only: the listing decides
        said = "is missing or unreadable" if tracked is None else f"names step {tracked}"
        where = store.child(TRACKER_FILE).url
        log.warning("%s %s; newest published step: %s", where, said, published[0])
    for step in published:
        view = open_view(store.child(step_name(step)).url)
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


def open_url_arguments(args: Any, names: Iterable[str]) -> None:
    """The command line: each argument in ``names`` that is an object-store URL is replaced
    by a local view of it (see :func:`open_view`)."""
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, str) and object_store.is_url(value):
            object_store.require_client(name, value)
            setattr(args, name, str(open_view(value)))
