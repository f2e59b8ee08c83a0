"""``FastTier``: the options of the node-local, peer-replicated fast tier."""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.errors import ConfigurationError

__all__ = ["FastTier"]


def _fail(name: str, value: Any, why: str) -> ConfigurationError:
    return ConfigurationError(f"FastTier({name}={value!r}): {why}")


def _positive(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(name, value, f"must be an int >= {low}")
    return value


def _seconds(name: str, value: Any) -> float:
    """A finite number of seconds > 0 that a process group's timeout can hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, value, "must be a number of seconds > 0, e.g. 600")
    if not math.isfinite(value):
        # nan compares False with everything (it would pass "> 0"); inf has no timedelta.
        raise _fail(
            name,
            value,
            "must be a finite number of seconds > 0, e.g. 600; a peer that never answers must "
            "end the wait, so there is no unlimited timeout",
        )
    if value <= 0:
        raise _fail(name, value, "must be a number of seconds > 0, e.g. 600")
    try:
        datetime.timedelta(seconds=value)
    except OverflowError:
        raise _fail(
            name, value, "is too large for a process group's timeout; pass seconds, e.g. 600"
        ) from None
    return float(value)


@dataclass(frozen=True)
class FastTier:
    """A second, fast checkpoint tier of :class:`~lightning_mcore_ckpt.MegatronCheckpoint`:
    each rank writes its whole state to a node-local directory (NVMe, or a RAM disk) on its own
    cadence, and copies it to ``replicas`` other nodes. ``fit(ckpt_path="last")`` resumes the
    newest complete step of either tier; a node that lost its directory reads its ranks' files
    from a peer (see ``docs/fast-tier.md``).

    Example::

        MegatronCheckpoint(
            "s3://bucket/run", every_n_train_steps=500,
            fast_tier=FastTier("/local_nvme/run", every_n_train_steps=20, replicas=1),
        )
    """

    dir: str | os.PathLike[str]
    """The node-local directory, the same path on every node (e.g. ``/local_nvme/run``,
    ``/dev/shm/run``). Each node holds its own ranks' files there, and the copies of its
    peers'."""
    every_n_train_steps: int = 20
    """A fast save every this many optimizer steps (skipped when the persistent tier saves the
    same step)."""
    replicas: int = 1
    """How many other nodes hold a copy of each rank's files: a step survives the loss of any
    ``replicas`` nodes. 0 keeps one copy (the node's own); the run needs more nodes than
    ``replicas``."""
    max_to_keep: int = 2
    """Complete fast steps kept on each node (older ones are deleted once a newer one is
    complete)."""
    timeout_s: float = 600.0
    """How long a rank waits for its peers in the fast tier's process group (a copy, the count
    of a step, a recovery). A copy that times out leaves its step uncounted and stops the fast
    saves for the rest of the run (the group is no longer usable); the persistent tier goes
    on."""

    check_finite: bool = False
    """Check that every floating tensor of a rank's state is finite: at each fast save, in the
    background before its files are written (a rank with a NaN or an infinity leaves the step
    uncounted on every node, with a warning naming the tensors; training goes on), and at a
    recovery, for the copy each rank would load (a copy holding one is passed over for the next
    holder, then for the next older step). Costs one read of the staged state per save and one
    load of each copy at a recovery (``docs/fast-tier.md``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir):
            raise _fail("dir", self.dir, "must be a path (the node-local directory)")
        if "://" in str(self.dir):
            raise _fail("dir", self.dir, "must be a local path on each node, not a URL")
        _positive("every_n_train_steps", self.every_n_train_steps, 1)
        _positive("replicas", self.replicas, 0)
        _positive("max_to_keep", self.max_to_keep, 1)
        if not isinstance(self.check_finite, bool):
            raise _fail("check_finite", self.check_finite, "must be True or False")
        _seconds("timeout_s", self.timeout_s)

    @property
    def root(self) -> Path:
        """The directory, with ``~`` expanded."""
        return Path(os.path.expanduser(str(self.dir)))
