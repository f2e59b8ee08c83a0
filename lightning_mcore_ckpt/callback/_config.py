"""``CheckpointConfig``: every option of :class:`MegatronCheckpoint`, checked in one place.

The options that take one of a few strings have ``Literal`` types (:data:`Mode`,
:data:`OnSaveError`, :data:`Durability`, :data:`Content`): a type checker and LightningCLI
refuse other values, and :class:`CheckpointConfig` refuses them at run time with the fix.
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.storage import object_store
from lightning_mcore_ckpt.storage.object_store import ObjectStore

if TYPE_CHECKING:
    from lightning_mcore_ckpt.fast import FastTier
    from lightning_mcore_ckpt.hf import HFExport

__all__ = [
    "SAVE_CONTENTS",
    "CheckpointConfig",
    "Content",
    "Durability",
    "Mode",
    "OnSaveError",
]

Content = Literal["model", "optimizer", "extra", "hf_model"]
"""A name in ``save_contents``."""
Mode = Literal["min", "max"]
"""Which ``monitor`` values are best."""
OnSaveError = Literal["raise", "warn"]
"""What a failed save does to the run."""
Durability = Literal["store", "local"]
"""When a step of an object-store ``dirpath`` counts as saved."""

SAVE_CONTENTS: tuple[Content, ...] = get_args(Content)
"""Names accepted in ``save_contents``."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_DEFAULTS = {"local_dir": None, "durability": "store"}


def _fail(name: str, value: Any, why: str) -> ConfigurationError:
    return ConfigurationError(f"MegatronCheckpoint({name}={value!r}): {why}")


def _check_count(name: str, value: Any, *, zero_disables: bool) -> None:
    if value is None:
        return
    low = 0 if zero_disables else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "an int >= 0 (0 disables it) or None" if zero_disables else "a positive int or None"
        raise _fail(name, value, f"must be {what}")


def _check_writable(root: Path, given: Any) -> None:
    # The nearest existing directory must take a new file (root passes os.access everywhere).
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise _fail(
            "dirpath",
            str(given),
            f"cannot write under {existing} ({err.strerror or err}); pass a writable directory",
        ) from None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The options of :class:`~lightning_mcore_ckpt.MegatronCheckpoint`.

    ``MegatronCheckpoint(**options)`` builds one, ``checkpoint.config``: the one place the
    callback reads its options from (Lightning's ``ModelCheckpoint`` keeps its own copy of the
    options it shares). Every check, including those across fields, runs in ``__post_init__``,
    before anything is created on disk; the fields cannot be changed afterwards.

    Example::

        config = CheckpointConfig(dirpath="checkpoints/run", every_n_train_steps=500)
        config.top_k  # -1: every step is kept (no monitor)
    """

    dirpath: str | os.PathLike[str]
    """The directory of this run's steps (created if missing). A leading ``~`` is expanded;
    a relative path is taken from the working directory. Or an S3-compatible object store,
    ``s3://bucket/prefix`` (needs ``pip install 'lightning-mcore-ckpt[s3]'``; see
    [object storage](object-storage.md)); any other URL is refused."""
    every_n_train_steps: int | None = None
    """Save every N optimizer steps; ``0`` or ``None`` disables it."""
    train_time_interval: datetime.timedelta | None = None
    """Save when this much wall time passed since the last save (decided on rank 0 and
    broadcast, so every rank saves at the same step); ``timedelta(0)`` or ``None`` disables it."""
    every_n_epochs: int | None = None
    """Save at the end of every N-th epoch (after validation when it runs); ``0`` disables it.
    With none of the three set, the default is every epoch, as in Lightning."""
    save_contents: Sequence[Content] = ("model", "optimizer", "extra")
    """What each step holds: ``"model"`` (sharded weights), ``"optimizer"`` (sharded optimizer
    state; LR schedulers are in Lightning's state), ``"extra"`` (RNG, every rank's dataloader
    state, loops and callbacks), ``"hf_model"`` (a Hugging Face copy of the weights, with
    ``hf_export``). Kept as a tuple."""
    max_to_keep: int | None = None
    """Keep the newest N complete steps, on top of the ones Lightning's bookkeeping keeps
    (``best_k_models``, ``best_model_path``, ``last_model_path``); ``None``: no limit."""
    monitor: str | None = None
    """A logged metric to rank steps by, as in Lightning."""
    save_top_k: int | None = None
    """As in Lightning: keep the best k steps by ``monitor`` (``-1``: all, ``0``: none). Without
    ``monitor``, ``1`` keeps only the newest step. Default: ``1`` with a ``monitor`` (Lightning's
    default), and every step without one (Lightning would keep one)."""
    mode: Mode = "min"
    """``"min"`` or ``"max"``: which ``monitor`` values are best."""
    save_last: bool = True
    """As in Lightning, the newest step is kept as ``last_model_path`` at every save; also, the
    final step is saved when ``fit`` ends, if the cadence did not."""
    hf_export: HFExport | None = None
    """When to write a Hugging Face copy of the weights into a step's ``huggingface/``
    (:class:`~lightning_mcore_ckpt.HFExport`; default ``when="end"``: once, into the final
    step). Required for ``"hf_model"``."""
    restore_dataloader: bool = True
    """Restore every rank's dataloader position on resume. A resume with a different
    data-parallel size is refused unless the loader uses
    :class:`~lightning_mcore_ckpt.ElasticSampler`, or this is ``False`` (the epoch's data order
    then restarts)."""
    on_save_error: OnSaveError = "raise"
    """``"raise"``: a failed save stops the run with
    :class:`~lightning_mcore_ckpt.CheckpointSaveError`. ``"warn"``: it is logged, counted in the
    ``checkpoint/failed`` metric, and training goes on. Either way the failed step never becomes
    complete, and the tracker and older steps are untouched."""
    save_on_preemption: bool = True
    """On SIGTERM or SIGUSR1, finish the current step, save it synchronously and end ``fit``
    cleanly, so that ``fit(ckpt_path="last")`` continues exactly. Under SLURM with Lightning's
    auto-requeue, its requeue signal also requeues the job, once the step is committed.
    ``MegatronCheckpoint.preempted`` and ``exit_code`` tell the script. ``False``: Lightning's
    own handling (its SLURM handler saves an ``hpc_ckpt`` from inside the signal handler)."""
    save_on_exception: bool = False
    """Lightning's option to save when training raises: only ``False`` is accepted (its default).
    A step is written by every rank together, and an exception reaches the ranks at different
    points, or one rank only: a save started from it would wait forever for the ranks it did not
    reach. Nor is the state at an arbitrary exception a step that resumes exactly (a batch drawn
    and not trained on, a save half written), and ``"last"`` would resume from it. What is not
    lost without it: a step whose write had finished still commits when training fails;
    ``save_on_preemption`` saves on SIGTERM/SIGUSR1; ``every_n_train_steps`` or
    ``train_time_interval`` bound the work a crash can cost."""
    save_on_train_epoch_end: bool | None = None
    """As in Lightning: with ``every_n_epochs``, save at the end of the training epoch
    (``True``) or after validation (``False``); ``None`` decides as Lightning does."""
    verbose: bool = False
    """As in Lightning: log each save's ranking (``monitor``, ``save_top_k``)."""
    overwrite: bool = False
    """A new run (``fit`` without ``ckpt_path``) into a ``dirpath`` that holds complete steps is
    refused before any work. ``True`` replaces them: a step this run saves replaces the one of
    the same number, and the other run's steps are deleted once this run's first step is
    committed (so "last" is always this run's)."""
    local_dir: str | os.PathLike[str] | None = None
    """With an object-store ``dirpath``: the local tier, where each step is written and
    committed first, then published to the store in the background; its steps follow the same
    retention. ``None``: a staging directory under the system's temporary directory, from which
    each step is removed once published."""
    durability: Durability = "store"
    """With an object-store ``dirpath``, when a step counts as saved (``"last"`` may name it,
    its save metrics are logged): ``"store"``, once its marker is in the store; ``"local"``,
    once it is committed in ``local_dir`` (its upload follows; needs ``local_dir``)."""
    upload_concurrency: int = 8
    """With an object-store ``dirpath``: requests in flight per uploaded file."""
    upload_part_mb: int = 64
    """With an object-store ``dirpath``: the multipart part size (MiB). One file's upload holds
    at most ``upload_concurrency * upload_part_mb`` MiB in memory."""
    fast_tier: FastTier | None = None
    """A node-local, peer-replicated tier saved on its own cadence
    (:class:`~lightning_mcore_ckpt.FastTier`): ``"last"`` resumes the newer of its newest
    complete step and the persistent tier's. ``None``: the persistent tier alone."""
    root: Path = field(init=False)
    """``dirpath`` resolved: ``~`` expanded, absolute, symlinks resolved (as Lightning does);
    with an object-store ``dirpath``, the local tier."""
    store: ObjectStore | None = field(init=False, default=None)
    """The object store of an ``s3://`` ``dirpath``, else ``None``."""

    def __post_init__(self) -> None:
        self._check_dirpath()
        _check_count("every_n_train_steps", self.every_n_train_steps, zero_disables=True)
        _check_count("every_n_epochs", self.every_n_epochs, zero_disables=True)
        _check_count("max_to_keep", self.max_to_keep, zero_disables=False)
        interval = self.train_time_interval
        if interval is not None and (
            not isinstance(interval, datetime.timedelta) or interval.total_seconds() < 0
        ):
            raise _fail(
                "train_time_interval",
                interval,
                "must be a datetime.timedelta >= 0 (0 disables it) or None",
            )
        self._check_one_cadence()
        self._check_contents()
        self._check_fast_tier()
        self._check_ranking()
        names = ("save_last", "restore_dataloader", "save_on_preemption", "save_on_exception")
        for name in (*names, "overwrite"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                hint = (
                    " ('link' is not supported: steps are directories)" if value == "link" else ""
                )
                raise _fail(name, value, f"must be True/False{hint}")
        if self.save_on_exception:
            raise _fail(
                "save_on_exception",
                True,
                "is not supported: a step is written by every rank together, and an exception "
                "reaches the ranks at different points (or one rank only), where a save would "
                "wait forever for the others; nor would the state it saved resume exactly. "
                "Steps whose write had finished still commit when training fails; "
                "save_on_preemption=True saves on SIGTERM/SIGUSR1; save more often with "
                "every_n_train_steps or train_time_interval. Pass save_on_exception=False",
            )
        if self.on_save_error not in get_args(OnSaveError):
            raise _fail(
                "on_save_error",
                self.on_save_error,
                "use 'raise' (stop the run) or 'warn' (log, count checkpoint/failed and keep "
                "training)",
            )
        if self.save_on_train_epoch_end is not None and not isinstance(
            self.save_on_train_epoch_end, bool
        ):
            raise _fail(
                "save_on_train_epoch_end",
                self.save_on_train_epoch_end,
                "must be True, False or None (decided as Lightning does)",
            )
        _check_writable(self.root, self.dirpath)

    def _check_dirpath(self) -> None:
        given = self.dirpath
        if not isinstance(given, str | os.PathLike) or not str(given):
            raise _fail("dirpath", given, "pass the directory for this run's checkpoints")
        if object_store.is_url(given):
            self._check_store(str(given))
            return
        if _URL.match(str(given)):
            raise _fail(
                "dirpath",
                str(given),
                "only local directories and s3://bucket/prefix are supported",
            )
        for name in ("local_dir", "durability"):
            if getattr(self, name) != _DEFAULTS[name]:
                raise _fail(name, getattr(self, name), "only applies to an s3:// dirpath")
        # Only a leading "~" is the home directory ("./~/ckpts" is a directory named "~").
        self._set("root", Path(os.path.realpath(os.path.expanduser(str(given)))))
        if self.root.exists() and not self.root.is_dir():
            raise _fail(
                "dirpath",
                str(given),
                "it is a file, not a directory; pass a directory (it is created if missing)",
            )

    def _check_store(self, url: str) -> None:
        object_store.require_client("MegatronCheckpoint(dirpath", url)
        if self.durability not in get_args(Durability):
            raise _fail("durability", self.durability, f"use one of {list(get_args(Durability))}")
        if self.durability == "local" and self.local_dir is None:
            raise _fail(
                "durability",
                self.durability,
                "needs local_dir (the local tier that holds each step until it is published)",
            )
        _check_count("upload_concurrency", self.upload_concurrency, zero_disables=False)
        _check_count("upload_part_mb", self.upload_part_mb, zero_disables=False)
        if self.upload_part_mb < 5:
            raise _fail("upload_part_mb", self.upload_part_mb, "S3 parts are at least 5 MiB")
        try:
            store = ObjectStore.from_url(
                url, concurrency=self.upload_concurrency, part_size=self.upload_part_mb << 20
            )
        except ValueError as err:
            raise _fail("dirpath", url, str(err)) from None
        if self.overwrite:
            raise _fail("overwrite", True, "is not supported with an s3:// dirpath yet")
        self._set("store", store)
        local = self.local_dir
        if local is None:
            local = Path(tempfile.gettempdir(), "lightning-mcore-ckpt", store.bucket)
            local = local / (store.prefix or "_")
        self._set("root", Path(os.path.realpath(os.path.expanduser(str(local)))))
        if self.root.exists() and not self.root.is_dir():
            raise _fail("local_dir", str(local), "it is a file, not a directory")

    def _check_one_cadence(self) -> None:
        interval = self.train_time_interval
        active = [
            name
            for name, on in (
                ("every_n_train_steps", bool(self.every_n_train_steps)),
                ("train_time_interval", interval is not None and interval.total_seconds() > 0),
                ("every_n_epochs", bool(self.every_n_epochs)),
            )
            if on
        ]
        if len(active) > 1:
            raise ConfigurationError(
                f"MegatronCheckpoint: {' and '.join(active)} are both set, but a run saves on "
                "one cadence; keep one of them (set the others to None or 0; use two callbacks "
                "with different dirpaths for two cadences)"
            )

    def _check_contents(self) -> None:
        contents = self.save_contents
        if isinstance(contents, str) or not isinstance(contents, Sequence):
            raise _fail(
                "save_contents",
                contents,
                f"pass a list of names from {SAVE_CONTENTS}, e.g. ['model', 'optimizer', 'extra']",
            )
        listed = list(contents)
        unknown = [c for c in listed if c not in SAVE_CONTENTS]
        if unknown:
            raise _fail(
                "save_contents", listed, f"unknown {unknown}; choose from {list(SAVE_CONTENTS)}"
            )
        if len(set(listed)) != len(listed):
            raise _fail("save_contents", listed, "names repeat; list each once")
        self._set("save_contents", tuple(listed))
        if "model" not in listed:
            raise _fail(
                "save_contents",
                listed,
                "'model' is required (a step without weights can be neither resumed nor exported)",
            )
        if "hf_model" in listed and self.hf_export is None:
            raise _fail(
                "save_contents",
                listed,
                "'hf_model' needs hf_export=HFExport(hf_model_path=...) to know the Hugging Face "
                "model to mirror",
            )
        from lightning_mcore_ckpt.hf import HFExport

        if self.hf_export is not None and not isinstance(self.hf_export, HFExport):
            raise _fail(
                "hf_export",
                self.hf_export,
                "pass lightning_mcore_ckpt.HFExport(hf_model_path=...) or None",
            )

    def _check_fast_tier(self) -> None:
        from lightning_mcore_ckpt.fast import FastTier

        fast = self.fast_tier
        if fast is None:
            return
        if not isinstance(fast, FastTier):
            raise _fail("fast_tier", fast, "pass lightning_mcore_ckpt.FastTier(dir=...) or None")
        mine = Path(os.path.realpath(fast.root))
        if mine == self.root or self.root in mine.parents or mine in self.root.parents:
            raise _fail(
                "fast_tier",
                fast,
                f"its directory {str(mine)!r} overlaps the persistent tier's {str(self.root)!r}; "
                "give the fast tier a directory of its own (a node-local disk)",
            )

    def _check_ranking(self) -> None:
        if self.mode not in get_args(Mode):
            raise _fail("mode", self.mode, "use 'min' or 'max'")
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise _fail("monitor", self.monitor, "the name of a logged metric, or None")
        k = self.save_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1):
            raise _fail("save_top_k", k, "use an int >= 0, or -1 for all")
        if self.monitor is None and k not in (None, -1, 0, 1):
            raise _fail(
                "save_top_k",
                k,
                "without a monitor there is nothing to rank by: use -1 (keep all), 1 (keep the "
                "newest), 0 (none), or pass monitor=",
            )

    def _set(self, name: str, value: Any) -> None:
        # The fields are frozen once checked; __post_init__ resolves and normalises them first.
        object.__setattr__(self, name, value)

    @property
    def top_k(self) -> int:
        """``save_top_k`` as Lightning takes it (the default resolved)."""
        if self.save_top_k is not None:
            return self.save_top_k
        return 1 if self.monitor is not None else -1

    @property
    def interval(self) -> datetime.timedelta | None:
        """``train_time_interval`` as Lightning takes it (``timedelta(0)`` is disabled)."""
        interval = self.train_time_interval
        return interval if interval is not None and interval.total_seconds() > 0 else None

    @property
    def epochs(self) -> int | None:
        """``every_n_epochs`` as Lightning takes it: a disabled ``train_time_interval``
        (``timedelta(0)``) is still a choice of cadence, so no ``every_n_epochs`` is 0 then, not
        "every epoch"."""
        if self.train_time_interval is not None and self.interval is None:
            return 0 if self.every_n_epochs is None else self.every_n_epochs
        return self.every_n_epochs
