"""The ``lightning-mcore-ckpt`` command line: ``entry`` parses and dispatches, and each command's
logic lives beside it (``checks``: fsck, inspect, diff, check-resume; ``fsck``, ``inspect``,
``diff``, ``report``)."""

from lightning_mcore_ckpt.cli.entry import main

__all__ = ["main"]
