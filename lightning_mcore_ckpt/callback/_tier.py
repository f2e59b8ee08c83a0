"""A ``dirpath``'s tiers (:mod:`lightning_mcore_ckpt.storage.tier`), and retention across them.

A local ``dirpath`` has one tier, its directory; an ``s3://`` one has its local tier and the
store behind it, the persistent tier (see :mod:`lightning_mcore_ckpt.storage.store_tier`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_mcore_ckpt.callback._config import CheckpointConfig
from lightning_mcore_ckpt.format import layout, markers, retention
from lightning_mcore_ckpt.storage.local_tier import LocalTier
from lightning_mcore_ckpt.storage.store_tier import StoreTier
from lightning_mcore_ckpt.storage.tier import Tier

__all__ = ["retain", "tiers_of"]

log = logging.getLogger(__name__)


def tiers_of(config: CheckpointConfig, root: Path) -> tuple[Tier, ...]:
    """The tiers of a checked config's ``dirpath``, innermost (the local directory, ``root``)
    first."""
    local = LocalTier(root)
    if config.store is None:
        return (local,)
    store = StoreTier(config.store, root, config.durability, config.local_dir is None)
    return (local, store)


def retain(
    tiers: Sequence[Tier],
    max_to_keep: int | None,
    removals: list[Path],
    keep: set[Path],
    replaced: Iterable[Path],
    uploading: Iterable[int],
) -> None:
    """Retention after a commit (rank 0, commit thread), by the steps of the persistent tier
    (the last of ``tiers``); a step leaves the outermost tier first. Scans the directory (or
    the store): nothing is kept only in memory. Never deletes the newest committed step (also
    when it is the one this run resumed from), nor one being uploaded to the Hub."""
    for other in replaced:  # another run's steps, replaced by this one (overwrite=True)
        if layout.is_complete(other) and markers.is_managed(other):
            log.info("overwrite: removing %s of the replaced run", other)
            retention.remove_step(other)
    complete = tiers[-1].managed_steps()
    if not complete:
        return
    newest = complete[-1].step
    outermost_first = list(reversed(tiers))
    for tier in outermost_first:
        tier.tidy(newest)
    doomed = retention.retention_plan(
        complete, max_to_keep=max_to_keep, remove=removals, keep=keep, protect={newest, *uploading}
    )
    for old in doomed:
        log.info("retention: removing %s", old.path)
        for tier in outermost_first:
            tier.remove(old)
