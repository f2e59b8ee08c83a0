"""The seal of a written step: everything in it made durable, then its commit marker.

A step is *written* (every rank, its files), *sealed* (here: one process, once every rank has
written) and *published* (each tier's, :mod:`lightning_mcore_ckpt.storage.tier`). A power cut
at any point of the seal leaves either no ``metadata.json`` (the step is incomplete: ``"last"``
never names it) or a step whose every file and directory entry survived: each file is fsynced,
then each directory (deepest first, then the step's own entry in the run directory), and only
then is ``metadata.json`` written (durably and atomically), listing every file, its size and
its digest, so that a later check (:func:`lightning_mcore_ckpt.format.layout.verify_step`)
finds any that went missing, short or changed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.format import integrity, layout, metrics
from lightning_mcore_ckpt.format.markers import METADATA_FILE
from lightning_mcore_ckpt.storage import atomic

__all__ = ["seal_step"]


def seal_step(
    path: str | Path,
    metadata: dict[str, Any],
    *,
    started: float | None = None,
    parts: dict[str, tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """Make the step at ``path`` durable, then write its ``metadata.json`` (the seal).

    ``metadata`` gets ``files`` (every file's size, by path relative to the step),
    ``hashes`` (each file's digest: ``metadata["hashes"]``, hashed while written, completed by
    :func:`lightning_mcore_ckpt.format.integrity.complete`), ``size_bytes``, ``throughput_gbps``
    and, when ``started`` (a ``time.perf_counter()`` value) is given, ``total_time_s``. Returns
    the metadata as written. Call it on one rank, off the training thread: it walks and fsyncs
    the whole step. ``parts``: the files of the step written on other nodes, whose directories
    this one cannot read (:mod:`~lightning_mcore_ckpt.storage.node_parts`), each with its size
    and digest as its node confirmed them; the step in ``path`` is then this node's part. Sealing a sealed step again (it gained files: a Hugging Face export)
    replaces its marker.

    Example::

        seal_step("checkpoints/run/global_step_100", {"format_version": 2, "global_step": 100})
    """
    step = Path(path)
    elsewhere = parts or {}
    sizes = atomic.fsync_tree(step)
    sizes.pop(METADATA_FILE, None)  # a previous seal's, replaced below (an export added)
    # Files outside the step it points at (tensors written once: ../shared/...), fsynced by
    # their writer; their directory entries here.
    shared = {
        n: (step / n).stat().st_size
        for n in metadata.get("hashes") or {}
        if n[:3] == "../" and n not in elsewhere
    }
    if shared:
        atomic.fsync_dir(step.parent / layout.SHARED_DIR)
    sizes.update(shared)
    sizes.update({n: size for n, (size, _) in elsewhere.items()})
    atomic.fsync_dir(step.parent)  # the step's own entry in the run directory
    filled = dict(metadata)
    filled["files"] = dict(sorted(sizes.items()))
    # Digests: those hashed while written (on every rank), the rest read now if small.
    known = {**(filled.get("hashes") or {}), **{n: d for n, (_, d) in elsewhere.items()}}
    filled["hashes"] = integrity.complete(step, sizes, known)
    if started is not None:
        filled["total_time_s"] = time.perf_counter() - started
    filled[integrity.METADATA_HASH] = integrity.PLACEHOLDER
    text, filled = metrics.encode_metadata(filled, sum(sizes.values()))
    text = integrity.seal(text)  # the marker's own digest: a changed byte in it is caught too
    atomic.write_text(step / METADATA_FILE, text)
    return json.loads(text)  # type: ignore[no-any-return]
