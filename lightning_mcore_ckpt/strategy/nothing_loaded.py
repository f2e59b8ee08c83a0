"""What ``MegatronStrategy.load_checkpoint`` returns when ``ckpt_path="last"`` finds no step in
either tier of a ``MegatronCheckpoint`` with a fast tier.

Lightning decides whether to resume before the process group exists, from each rank's own view;
with a fast tier that view cannot know whether another node holds a fast step, so every rank
asks the strategy's (collective) load, which may find nothing. Lightning then reads the loaded
checkpoint's version (``_pl_migrate_checkpoint``) before it skips an empty one: a plain ``{}``
fails there (``KeyError: 'pytorch-lightning_version'``). :class:`NothingLoaded` is empty, so
every restore Lightning makes from it is skipped (the run starts from scratch), and answers the
version question with this Lightning's own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NothingLoaded"]

_VERSION = "pytorch-lightning_version"


class NothingLoaded(dict):  # type: ignore[type-arg]
    """An empty checkpoint that Lightning's version migration passes through unchanged."""

    def __missing__(self, key: str) -> Any:
        if key == _VERSION:
            import lightning.pytorch as pl

            return pl.__version__
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key != _VERSION:  # the migration stamps the version it found: nothing to keep
            super().__setitem__(key, value)
