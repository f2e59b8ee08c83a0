"""``MegatronCheckpoint``: when to save, what goes in, how a step commits, what is deleted."""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_mcore_ckpt import _atomic, _compat, layout, metrics, retention
from lightning_mcore_ckpt.strategy import (
    LOADED_FROM_KEY,
    CheckpointSaveError,
    MegatronStrategy,
    SaveOptions,
    SaveRecord,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport

__all__ = ["SAVE_CONTENTS", "MegatronCheckpoint"]

log = logging.getLogger(__name__)

SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")
"""Names accepted in ``save_contents``."""

# Lightning's own message when "last" finds nothing suggests ModelCheckpoint(save_last=True),
# which is wrong here: the callback logs one line of its own instead.
warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last")


_PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_HEARTBEAT_S = 60.0


def _check_writable(root: Path, given: Any) -> None:
    # The nearest existing directory must take a new file (root passes os.access everywhere).
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(
            f"MegatronCheckpoint(dirpath={str(given)!r}): cannot write under {existing} "
            f"({err.strerror or err}); pass a writable directory"
        ) from None


def _check_positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"MegatronCheckpoint({name}={value!r}): must be a positive int or None (disabled)"
        )


class MegatronCheckpoint(ModelCheckpoint):
    """Save Megatron-Core distributed checkpoints on a cadence, commit them, keep the right ones.

    Each save writes ``<dirpath>/global_step_<N>/`` through
    :class:`~lightning_mcore_ckpt.MegatronStrategy` (``model/``, ``optim/``, ``extra/``), then
    commits it: ``metadata.json`` is written last, atomically, once every rank has finished (for
    an async save: once the background write is finalised); only then is
    ``latest_checkpointed_iteration.txt`` updated and does retention run.
    ``trainer.fit(ckpt_path="last")`` resumes from the newest complete step, or starts from
    scratch, with one log line, when there is none.

    What each save cost is logged to every attached Lightning logger at the step of the save
    (``checkpoint/blocking_time_s``, ``total_time_s``, ``write_time_s``, ``size_bytes``,
    ``throughput_gbps``, ``hf_export_time_s``; see :mod:`lightning_mcore_ckpt.metrics`) and
    recorded in the step's ``metadata.json``. Rank 0 measures the step's size and commits it on a
    background thread, so neither the measurement nor retention stalls training.

    Args:
        dirpath: the directory of this run's steps.
        every_n_train_steps: save every N optimizer steps.
        train_time_interval: save when this much wall time passed since the last save (decided
            on rank 0 and broadcast, so every rank saves at the same step).
        every_n_epochs: save at the end of every N-th epoch (after validation when it runs).
            With no cadence at all, the default is every epoch, as in Lightning.
        save_contents: what each step holds: ``"model"`` (sharded weights), ``"optimizer"``
            (sharded optimizer state; LR schedulers are in Lightning's state), ``"extra"`` (RNG,
            every rank's dataloader state, loops and callbacks), ``"hf_model"`` (a Hugging Face
            copy of the weights, with ``hf_export``).
        max_to_keep: keep the newest N complete steps (``None``: keep all).
        monitor: a logged metric to rank steps by; the best ``save_top_k`` steps (by ``mode``)
            are kept on top of the newest ``max_to_keep``. Values are read back from each step's
            ``metadata.json``, so ranking survives restarts.
        save_top_k: how many of the best steps by ``monitor`` to keep (``-1``: all).
        mode: ``"min"`` or ``"max"``.
        save_last: also save the final step when ``fit`` ends, if the cadence did not.
        hf_export: :class:`~lightning_mcore_ckpt.HFExport`: when to write a Hugging Face copy
            of the weights into a step's ``huggingface/`` (default ``when="end"``: once, into the
            final step). Exports run on rank 0 in the background commit, reading the step from
            disk, so they do not stall training; a step with an export commits only once the
            export is complete. Required for ``"hf_model"`` (which exports every step).
        restore_dataloader: restore every rank's dataloader position on resume. A resume with a
            different data-parallel size is refused unless the loader uses
            :class:`~lightning_mcore_ckpt.ElasticSampler`, or this is ``False`` (the epoch's
            data order then restarts).
        on_save_error: ``"raise"`` (default): a failed save stops the run with
            :class:`~lightning_mcore_ckpt.CheckpointSaveError`. ``"warn"``: it is logged,
            counted in the ``checkpoint/failed`` metric, and training goes on. Either way the
            failed step never becomes complete, and the tracker, older steps and retention are
            untouched.
        save_on_train_epoch_end: as in Lightning's ``ModelCheckpoint``: with ``every_n_epochs``,
            save at the end of the training epoch (``True``) or after validation (``False``);
            ``None`` decides as Lightning does. Either way the step is written once the epoch is
            closed (its end hooks and per-epoch LR schedulers done), so it resumes at the next
            epoch's first batch.
        save_on_preemption: on SIGTERM or SIGUSR1 (what schedulers such as SLURM send before
            stopping or requeueing a job), finish the current step, save it synchronously, and
            end ``fit`` cleanly, so that ``fit(ckpt_path="last")`` continues exactly.

    Example::

        trainer = L.Trainer(
            strategy=MegatronStrategy(tensor_model_parallel_size=2),
            callbacks=[MegatronCheckpoint("checkpoints/run", every_n_train_steps=500,
                                          max_to_keep=3)],
        )
        trainer.fit(module, datamodule=dm, ckpt_path="last")
    """

    FILE_EXTENSION = ""

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_train_steps: int | None = None,
        train_time_interval: datetime.timedelta | None = None,
        every_n_epochs: int | None = None,
        save_contents: Sequence[str] = ("model", "optimizer", "extra"),
        max_to_keep: int | None = None,
        monitor: str | None = None,
        save_top_k: int = 1,
        mode: str = "min",
        save_last: bool = True,
        hf_export: HFExport | None = None,
        restore_dataloader: bool = True,
        on_save_error: str = "raise",
        save_on_preemption: bool = True,
        save_on_train_epoch_end: bool | None = None,
    ) -> None:
        if not isinstance(dirpath, str | os.PathLike) or not str(dirpath):
            raise ValueError(
                f"MegatronCheckpoint(dirpath={dirpath!r}): pass the directory for this run's "
                "checkpoints (a str or path)"
            )
        root = Path(dirpath).expanduser()
        if root.exists() and not root.is_dir():
            raise ValueError(
                f"MegatronCheckpoint(dirpath={str(dirpath)!r}): it is a file, not a directory; "
                "pass a directory (it is created if missing)"
            )
        _check_positive_int("every_n_train_steps", every_n_train_steps)
        _check_positive_int("every_n_epochs", every_n_epochs)
        _check_positive_int("max_to_keep", max_to_keep)
        if train_time_interval is not None and (
            not isinstance(train_time_interval, datetime.timedelta)
            or train_time_interval.total_seconds() <= 0
        ):
            raise ValueError(
                f"MegatronCheckpoint(train_time_interval={train_time_interval!r}): must be a "
                "positive datetime.timedelta or None"
            )
        cadences = [
            name
            for name, value in (
                ("every_n_train_steps", every_n_train_steps),
                ("train_time_interval", train_time_interval),
                ("every_n_epochs", every_n_epochs),
            )
            if value is not None
        ]
        if len(cadences) > 1:
            raise ValueError(
                f"MegatronCheckpoint: {' and '.join(cadences)} are both set, but a run saves on "
                "one cadence; keep one of them (use two callbacks with different dirpaths for two "
                "cadences)"
            )
        if isinstance(save_contents, str) or not isinstance(save_contents, Sequence):
            raise ValueError(
                f"MegatronCheckpoint(save_contents={save_contents!r}): pass a list of names "
                f"from {SAVE_CONTENTS}, e.g. ['model', 'optimizer', 'extra']"
            )
        unknown = [c for c in save_contents if c not in SAVE_CONTENTS]
        if unknown:
            raise ValueError(
                f"MegatronCheckpoint(save_contents={list(save_contents)!r}): unknown "
                f"{unknown}; choose from {list(SAVE_CONTENTS)}"
            )
        if len(set(save_contents)) != len(save_contents):
            raise ValueError(
                f"MegatronCheckpoint(save_contents={list(save_contents)!r}): names repeat; "
                "list each once"
            )
        if "model" not in save_contents:
            raise ValueError(
                f"MegatronCheckpoint(save_contents={list(save_contents)!r}): 'model' is "
                "required (a step without weights can be neither resumed nor exported)"
            )
        if "hf_model" in save_contents and hf_export is None:
            raise ValueError(
                f"MegatronCheckpoint(save_contents={list(save_contents)!r}): 'hf_model' needs "
                "hf_export=HFExport(hf_model_path=...) to know the Hugging Face model to mirror"
            )
        from lightning_mcore_ckpt.hf import HFExport

        if hf_export is not None and not isinstance(hf_export, HFExport):
            raise ValueError(
                f"MegatronCheckpoint(hf_export={hf_export!r}): pass "
                "lightning_mcore_ckpt.HFExport(hf_model_path=...) or None"
            )
        if mode not in ("min", "max"):
            raise ValueError(f"MegatronCheckpoint(mode={mode!r}): use 'min' or 'max'")
        if isinstance(save_top_k, bool) or not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(
                f"MegatronCheckpoint(save_top_k={save_top_k!r}): use an int >= 0, or -1 for all"
            )
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(
                f"MegatronCheckpoint(monitor={monitor!r}): the name of a logged metric, or None"
            )
        if not isinstance(save_last, bool):
            raise ValueError(f"MegatronCheckpoint(save_last={save_last!r}): must be True/False")
        if on_save_error not in ("raise", "warn"):
            raise ValueError(
                f"MegatronCheckpoint(on_save_error={on_save_error!r}): use 'raise' (stop the run) "
                "or 'warn' (log, count checkpoint/failed and keep training)"
            )
        if not isinstance(save_on_preemption, bool):
            raise ValueError(
                f"MegatronCheckpoint(save_on_preemption={save_on_preemption!r}): must be True/False"
            )
        if save_on_train_epoch_end is not None and not isinstance(save_on_train_epoch_end, bool):
            raise ValueError(
                f"MegatronCheckpoint(save_on_train_epoch_end={save_on_train_epoch_end!r}): must "
                "be True, False or None (decided as Lightning does)"
            )
        _check_writable(root, dirpath)
        if not isinstance(restore_dataloader, bool):
            raise ValueError(
                f"MegatronCheckpoint(restore_dataloader={restore_dataloader!r}): must be True/False"
            )
        super().__init__(
            dirpath=root,
            monitor=monitor,
            save_last=False,
            save_top_k=-1,
            mode=mode,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=False,
        )
        self.dirpath: Path = root  # type: ignore[assignment]
        self.save_contents = tuple(save_contents)
        self.max_to_keep = max_to_keep
        self.keep_top_k = save_top_k
        self.save_final = save_last
        self.hf_export = hf_export
        self.restore_dataloader = restore_dataloader
        self.on_save_error = on_save_error
        self.save_on_preemption = save_on_preemption
        self.failed_saves = 0
        self._resumed_step: int | None = None
        self._step_at_batch_start = -1
        self._stepped_at_load: int | None = None
        # An epoch-end save waiting for Lightning to close the epoch: its monitor candidates.
        self._deferred: dict[str, Any] | None = None
        self._closing_epoch = False
        self._lock: layout.DirectoryLock | None = None
        self._heartbeat: threading.Event | None = None
        self._preempted: int | None = None
        self._flag_group: Any = None
        self._previous_handlers: dict[int, Any] = {}
        # Rank 0: commits run in order on one background thread; their figures are logged from
        # the training thread when they are done.
        self._committer: ThreadPoolExecutor | None = None
        self._commits: list[tuple[Path, Future[dict[str, Any]]]] = []
        # Saves handed to the strategy, until it reports them durable or failed.
        self._in_flight: dict[Path, tuple[dict[str, Any], bool]] = {}
        self._trainer: pl.Trainer | None = None

    # --- identity, state ------------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self.dirpath),
            "last_global_step_saved": self._last_global_step_saved,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_global_step_saved = int(state_dict.get("last_global_step_saved", 0))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, MegatronStrategy):
            raise TypeError(
                f"MegatronCheckpoint needs Trainer(strategy=MegatronStrategy(...)), got "
                f"{type(trainer.strategy).__name__}"
            )
        problem = None
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            if stage == "fit":
                lock = layout.DirectoryLock(self.dirpath)
                try:
                    lock.acquire()
                except RuntimeError as err:
                    problem = str(err)
                else:
                    self._lock = lock
                    self._start_heartbeat(lock)
            metrics.define_wandb_metrics(trainer.loggers)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise RuntimeError(f"MegatronCheckpoint(dirpath={str(self.dirpath)!r}): {problem}")
        self._trainer = trainer
        trainer.strategy.add_save_listener(self)

    def _start_heartbeat(self, lock: layout.DirectoryLock) -> None:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(_HEARTBEAT_S):
                lock.heartbeat()

        threading.Thread(target=beat, name="checkpoint-lock-heartbeat", daemon=True).start()
        self._heartbeat = stop

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hf_export is None:
            return
        # A mismatch found at the end of training would waste the run: check the shapes now.
        from megatron.core.models.gpt import GPTModel

        from lightning_mcore_ckpt import hf

        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        prefixes = [f"{n}." for n, m in pl_module.named_modules() if isinstance(m, GPTModel)]
        hf.check_model_matches(
            hf.HFBridge(self.hf_export.path),
            strategy.model_sharded_state_dict(),
            prefixes,
            argument="HFExport(hf_model_path=...)",
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # when="end": the final step gets its one export, also when it was saved by the cadence
        # or by an earlier run that stopped before exporting.
        if self.hf_export is None or self.hf_export.when != "end" or trainer.global_step == 0:
            return
        if self._preempted is not None:
            return  # a preempted fit is not the end of training: the resumed run exports
        if not trainer.is_global_zero:
            return
        from lightning_mcore_ckpt import hf

        target = layout.step_dir(self.dirpath, trainer.global_step)
        if not layout.is_complete(target) or hf.is_exported(target):
            return
        self._submit(target, self._export_into_committed, target)
        self._log_commits(trainer, wait=True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        # After fit, or after an error (Lightning calls on_exception, not teardown, then).
        if self._trainer is not None and isinstance(self._trainer.strategy, MegatronStrategy):
            self._trainer.strategy.remove_save_listener(self)
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        self._restore_signal_handlers()
        if self._heartbeat is not None:
            self._heartbeat.set()
            self._heartbeat = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- preemption -----------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # starts the train_time_interval clock
        self._refuse_unresumable_loader(trainer)
        if not self.save_on_preemption or threading.current_thread() is not threading.main_thread():
            return
        # Installed after Lightning's own handlers (which raise at the next step): the run
        # finishes the step, saves, and ends cleanly instead.
        import torch.distributed as dist

        self._preempted = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Collective (every rank starts training here); the default group when it is gloo.
            cpu = dist.get_backend() == "gloo"
            self._flag_group = dist.group.WORLD if cpu else dist.new_group(backend="gloo")
        for signum in _PREEMPTION_SIGNALS:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_preemption_signal)

    def _refuse_unresumable_loader(self, trainer: pl.Trainer) -> None:
        # Resumed inside an epoch with a loader that cannot restore its position: Lightning
        # would replay the epoch from its first batch while counting on from the saved one.
        if self._resumed_step is None or not self.restore_dataloader:
            return
        from lightning.fabric.utilities.types import _Stateful

        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        loader = trainer.fit_loop._combined_loader
        # Saved at a batch end, the batch is processed but not yet completed; Lightning counts it
        # on restart, and a save after the epoch's last batch resumes at the next epoch.
        done = max(progress.completed, getattr(progress, "processed", 0))
        if loader is None or done == 0 or done >= trainer.num_training_batches:
            return
        plain = [type(dl).__name__ for dl in loader.flattened if not isinstance(dl, _Stateful)]
        if plain:
            raise ValueError(
                f"MegatronCheckpoint(dirpath={str(self.dirpath)!r}): step {self._resumed_step} "
                f"was saved inside an epoch (after {done} of its {trainer.num_training_batches} "
                f"batches), but the "
                f"train dataloader ({', '.join(plain)}) cannot restore its position: the rest "
                "of the epoch would not see the data the uninterrupted run sees. Use "
                "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in DataLoader), save "
                "only at epoch ends (every_n_epochs), or pass "
                "MegatronCheckpoint(restore_dataloader=False) to accept a restarted epoch"
            )

    def _on_preemption_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens on the training loop, at the end of the current step.
        self._preempted = signum

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_preemption_signal:
                signal.signal(signum, handler)
        self._previous_handlers = {}

    def _preemption_requested(self, trainer: pl.Trainer) -> bool:
        # Any rank's signal stops every rank at the same step. The flag travels over a CPU
        # (gloo) group: an all-reduce on the GPU would synchronise the device at every step.
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self._preempted is not None
        if self._flag_group is None:
            return self._preempted is not None
        flag = torch.tensor([0 if self._preempted is None else self._preempted])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flag_group)
        signum = int(flag.item())
        if signum and self._preempted is None:
            self._preempted = signum
        return bool(signum)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is not None:
            _close_epoch(fit)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        source = checkpoint.get(LOADED_FROM_KEY) or {}
        self._resumed_step = layout.step_number(source.get("path", ""))
        fit = checkpoint.get("loops", {}).get("fit_loop") or {}
        if _between_epochs(fit):
            # Lightning adds one to its stepped-batch counter on some restarts, assuming the
            # step was saved before the counter moved; a step saved between epochs was not.
            self._stepped_at_load = fit["epoch_loop.state_dict"].get("_batches_that_stepped")
        saved = source.get("parallel_layout") or {}
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        saved_dp = saved.get("data_parallel_size")
        current_dp = strategy.parallel_layout()["data_parallel_size"]
        if saved_dp is None or saved_dp == current_dp:
            return
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        loader_states = fit_state.get("combined_loader") or []
        if not loader_states:
            return
        if not self.restore_dataloader:
            fit_state["combined_loader"] = []
            log.warning(
                "data-parallel size changed (%s -> %s): dataloader state not restored "
                "(restore_dataloader=False); the epoch's data order restarts",
                saved_dp,
                current_dp,
            )
            return
        from lightning_mcore_ckpt.sampler import is_elastic_state

        if not all(is_elastic_state(s) for s in loader_states):
            raise ValueError(
                f"checkpoint {source.get('path')} was saved with data-parallel size {saved_dp}, "
                f"this run has {current_dp}: its dataloader positions are per rank and cannot "
                "be mapped. Use lightning_mcore_ckpt.ElasticSampler (continues at the exact next "
                "global sample), or MegatronCheckpoint(restore_dataloader=False) to restart the "
                "epoch's data order"
            )

    # --- cadence --------------------------------------------------------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._stepped_at_load is not None:
            trainer.fit_loop.epoch_loop._batches_that_stepped = self._stepped_at_load
            self._stepped_at_load = None

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._log_commits(trainer, wait=False)
        # Saves happen only where the optimizer has just stepped: inside a gradient-accumulation
        # window the accumulated gradients are in no checkpoint, so a step saved there would
        # resume with those micro-batches consumed but never applied.
        if trainer.global_step == self._step_at_batch_start:
            return
        # The epoch's last batch: the epoch-end hooks and per-epoch LR schedulers have not run
        # yet, and a step saved now would resume without them. Such saves wait until Lightning
        # has closed the epoch (the next epoch's start, or the end of fit).
        epoch_ends = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if self._previous_handlers and self._preemption_requested(trainer):
            name = signal.Signals(self._preempted or signal.SIGTERM).name
            if trainer.is_global_zero:
                log.warning(
                    "%s received: saving step %d synchronously and stopping",
                    name,
                    trainer.global_step,
                )
            trainer.should_stop = True
            self._restore_signal_handlers()
            if not epoch_ends:
                self._save_step(trainer, self._monitor_candidates(trainer), synchronous=True)
                self._log_commits(trainer, wait=True)
            return  # else on_train_end saves it, synchronously
        if (
            self.save_final
            and not epoch_ends
            and (trainer.should_stop or _max_steps_reached(trainer))
        ):
            # The run ends after this batch, inside an epoch. Save now, while the loops still say
            # so: once fit ends Lightning has closed the epoch, and a step saved then would
            # resume at the next epoch, skipping the rest of this one.
            self._save_step(trainer, self._monitor_candidates(trainer))
            return
        # When: Lightning's own triggers (every_n_train_steps, train_time_interval decided on
        # rank 0 and broadcast, a validation-only monitor deferred to validation end).
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        # Lightning's triggers (train batch end, epoch end, validation end) land here.
        if self.monitor is not None and self.monitor not in monitor_candidates:
            val_loop = trainer.fit_loop.epoch_loop.val_loop
            if val_loop._has_run or not _validation_enabled(trainer):
                # Lightning refuses a monitor missing after validation; without validation it
                # would never appear, and the ranking would keep arbitrary steps.
                raise ValueError(
                    f"MegatronCheckpoint(monitor={self.monitor!r}): no such metric was logged; "
                    f"logged metrics are {sorted(monitor_candidates)}. Log it with "
                    f"self.log({self.monitor!r}, value) in the LightningModule, or fix the name"
                )
        if self._closing_epoch:
            # Lightning's epoch-end triggers fire before its per-epoch LR schedulers step and
            # before the epoch counts as done: the step is saved once the epoch is closed.
            self._deferred = dict(monitor_candidates)
            return
        self._save_step(trainer, monitor_candidates)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._closing_epoch = True
        try:
            super().on_train_epoch_end(trainer, pl_module)
        finally:
            self._closing_epoch = False

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._closing_epoch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        try:
            super().on_validation_end(trainer, pl_module)
        finally:
            self._closing_epoch = False

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The previous epoch is closed (hooks, per-epoch schedulers, counters), the next one's
        # data not yet drawn: Lightning resumes a step saved here at the start of this epoch.
        self._save_deferred(trainer)

    def _save_deferred(self, trainer: pl.Trainer) -> None:
        if self._deferred is not None:
            candidates, self._deferred = self._deferred, None
            self._save_step(trainer, candidates)

    @override
    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        # "last" is the tracker file, updated at every commit.
        return None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        preempted = self._preempted is not None
        if self._deferred is not None:
            candidates, self._deferred = self._deferred, None
            self._save_step(trainer, candidates, synchronous=preempted)
        export_at_end = (
            self.hf_export is not None and self.hf_export.when == "end" and self._preempted is None
        )
        if (
            (self.save_final or export_at_end)
            and trainer.global_step > 0
            and not getattr(trainer, "fast_dev_run", False)
            and self._last_global_step_saved != trainer.global_step
        ):
            self._save_step(
                trainer,
                self._monitor_candidates(trainer),
                export_hf=export_at_end,
                synchronous=preempted,
            )
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        strategy.finalize_pending_save(blocking=True)
        self._log_commits(trainer, wait=True)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # A step whose write finished still commits; the run's own error is the one raised.
        try:
            self._log_commits(trainer, wait=True)
        except Exception as err:  # noqa: BLE001 - reported, the original exception propagates
            log.error("while handling %r: %s", exception, err)
        finally:
            self._release()

    # --- "last" ---------------------------------------------------------------------------

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Rank 0's choice is the one loaded (the strategy resolves and broadcasts it); only it
        # reads the steps' indexes to skip a damaged one.
        newest = layout.resolve_last(self.dirpath, verify=trainer.is_global_zero)
        if newest is None:
            if trainer.is_global_zero:
                log.warning(
                    'ckpt_path="last": no complete checkpoint in %s, starting from scratch',
                    self.dirpath,
                )
            return set()
        return {str(newest)}

    # --- save and commit ------------------------------------------------------------------

    def _save_step(
        self,
        trainer: pl.Trainer,
        monitor_candidates: dict[str, Any],
        export_hf: bool = False,
        synchronous: bool = False,
    ) -> None:
        step = trainer.global_step
        if step == self._last_global_step_saved and step != 0:
            return
        self._last_global_step_saved = step
        target = layout.step_dir(self.dirpath, step)
        strategy = trainer.strategy
        assert isinstance(strategy, MegatronStrategy)
        # A save still in flight commits first, so the state of the directory is settled.
        strategy.finalize_pending_save(blocking=True)
        self._log_commits(trainer, wait=True)
        started = time.perf_counter()
        decision = None
        if trainer.is_global_zero:
            if layout.is_complete(target):
                decision = "exists"
            elif target.exists() and not layout.is_ours(target):
                decision = (
                    f"{target} exists but was not written by lightning-mcore-ckpt; move it out "
                    f"of {self.dirpath} (it is never deleted)"
                )
            elif target.exists():
                # Left by a crashed save of this same step: it never committed.
                log.warning("removing incomplete %s before saving it again", target)
                retention.remove_step(target)
        decision = strategy.broadcast(decision)
        if decision == "exists":
            log.info("%s is already complete; not saving it again", target)
            return
        if decision is not None:
            self._on_save_failed(trainer, step, CheckpointSaveError(decision))
            return
        monitor = None
        if self.monitor is not None and self.monitor in monitor_candidates:
            value = monitor_candidates[self.monitor]
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
            monitor = {"name": self.monitor, "value": value if math.isfinite(value) else None}
        metadata = {
            "format_version": layout.METADATA_FORMAT_VERSION,
            "global_step": step,
            "epoch": trainer.current_epoch,
            "contents": list(self.save_contents),
            "monitor": monitor,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "host": socket.gethostname(),
            "versions": _compat.versions(),
            "writer": _compat.async_strategy(),
        }
        contents = [c for c in self.save_contents if c != "hf_model"]
        export = self.hf_export is not None and (
            export_hf or "hf_model" in self.save_contents or self.hf_export.when == "every_save"
        )
        metadata["contents"] = [*contents, "hf_model"] if export else contents

        self._in_flight[target] = (metadata, export)
        trainer.save_checkpoint(
            target,
            storage_options=SaveOptions(
                contents=contents, synchronous=synchronous, started_at=started
            ),
        )

    # --- the strategy's SaveListener --------------------------------------------------------

    def owns(self, path: Path) -> bool:
        return Path(path).parent == self.dirpath

    def saved(self, record: SaveRecord) -> None:
        metadata, export = self._in_flight.pop(record.path)
        assert self._trainer is not None
        self._commit(self._trainer, record.path, metadata, record, export)

    def failed(self, path: Path, error: CheckpointSaveError) -> None:
        self._in_flight.pop(Path(path), None)
        assert self._trainer is not None
        self._on_save_failed(self._trainer, layout.step_number(path) or -1, error)

    def _on_save_failed(self, trainer: pl.Trainer, step: int, error: BaseException) -> None:
        """A save or its commit failed (every rank): raise, or warn and count it."""
        if self.on_save_error == "raise":
            raise error
        self.failed_saves += 1
        log.error(
            "checkpoint of step %d failed (%d so far); training goes on (on_save_error='warn'): %s",
            step,
            self.failed_saves,
            error,
        )
        if trainer.is_global_zero:
            metrics.log_save_metrics(
                trainer.loggers, step, {"checkpoint/failed": float(self.failed_saves)}
            )

    def _commit(
        self,
        trainer: pl.Trainer,
        target: Path,
        metadata: dict[str, Any],
        record: SaveRecord,
        export: bool = False,
    ) -> None:
        # Every rank, once the save is durable everywhere. Rank 0 commits in the background.
        if not trainer.is_global_zero:
            return
        metadata = dict(metadata)
        metadata.update(
            {
                "async": record.asynchronous,
                "parallel_layout": record.parallel_layout,
                "blocking_time_s": record.blocking_time_s,
                "write_time_s": record.write_time_s,
                "hf_export_time_s": None,
            }
        )
        # Total time: until durable on every rank, then until committed here.
        started = record.finalized_at - record.total_time_s
        self._submit(target, self._commit_in_background, target, metadata, started, export)

    def _submit(self, target: Path, fn: Any, *args: Any) -> None:
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._commits.append((target, self._committer.submit(fn, *args)))

    def _export(self, target: Path) -> float:
        from lightning_mcore_ckpt import hf

        assert self.hf_export is not None
        start = time.perf_counter()
        log.info("exporting %s to Hugging Face format", target)
        hf.export_checkpoint(
            target,
            self.hf_export.path,
            target / hf.HF_DIR,
            dtype=self.hf_export.dtype,
            require_complete=False,
            overwrite=True,
            progress=False,
        )
        return time.perf_counter() - start

    def _commit_in_background(
        self, target: Path, metadata: dict[str, Any], started: float, export: bool
    ) -> dict[str, Any]:
        # Export, measure, then write metadata.json (the commit), the tracker, retention.
        if export:
            metadata["hf_export_time_s"] = self._export(target)
        data_bytes = metrics.tree_bytes(target, exclude=[layout.METADATA_FILE])
        metadata["total_time_s"] = time.perf_counter() - started
        text, metadata = metrics.encode_metadata(metadata, data_bytes)
        _atomic.write_text(target / layout.METADATA_FILE, text)
        layout.write_tracker(self.dirpath, metadata["global_step"])
        log.info(
            "committed %s: %.3f GB, blocked training %.3fs, %.3fs in all",
            target,
            metadata["size_bytes"] / 1e9,
            metadata["blocking_time_s"],
            metadata["total_time_s"],
        )
        try:
            self._apply_retention(metadata["global_step"])
        except Exception as err:
            raise RuntimeError(f"{target} is committed, but retention failed: {err}") from err
        return metadata

    def _export_into_committed(self, target: Path) -> dict[str, Any]:
        # A committed step stays complete throughout: huggingface/ appears by rename, then the
        # metadata is replaced atomically with the export's figures.
        seconds = self._export(target)
        metadata = layout.read_metadata(target) or {}
        metadata["hf_export_time_s"] = seconds
        contents = list(metadata.get("contents") or [])
        if "hf_model" not in contents:
            contents.append("hf_model")
        metadata["contents"] = contents
        data_bytes = metrics.tree_bytes(target, exclude=[layout.METADATA_FILE])
        text, metadata = metrics.encode_metadata(metadata, data_bytes)
        _atomic.write_text(target / layout.METADATA_FILE, text)
        log.info("exported %s/%s in %.1fs", target, "huggingface", seconds)
        # Only the export's figure: the save's own were logged at its commit.
        return {"global_step": metadata["global_step"], "hf_export_time_s": seconds}

    def _log_commits(self, trainer: pl.Trainer, wait: bool) -> None:
        """Log the figures of finished commits, in order (rank 0; others have none).

        With ``wait=True``, wait for every commit in flight first. A commit that failed is raised
        here, on the training thread, as :class:`CheckpointSaveError`.
        """
        while self._commits and (wait or self._commits[0][1].done()):
            target, future = self._commits.pop(0)
            try:
                metadata = future.result()
            except Exception as err:  # noqa: BLE001 - raised or counted by _on_save_failed
                failure = CheckpointSaveError(f"committing {target} failed: {err}")
                failure.__cause__ = err
                self._on_save_failed(trainer, layout.step_number(target) or -1, failure)
                continue
            metrics.log_save_metrics(
                trainer.loggers, metadata["global_step"], metrics.save_metrics(metadata)
            )

    def _apply_retention(self, committed: int) -> None:
        # Rank 0 only, after the commit. Scans the directory: nothing is kept only in memory.
        for stale in layout.incomplete_steps(self.dirpath):
            if stale.step < committed and layout.is_ours(stale.path):
                log.info("removing incomplete %s (a newer step is committed)", stale.path)
                retention.remove_step(stale.path)
        protect = {committed}
        if self._resumed_step is not None:
            newest = layout.complete_steps(self.dirpath)
            if newest and newest[-1].step == self._resumed_step:
                protect.add(self._resumed_step)
        doomed = retention.retention_plan(
            layout.complete_steps(self.dirpath),
            max_to_keep=self.max_to_keep,
            monitor=self.monitor,
            save_top_k=self.keep_top_k,
            mode=self.mode,
            protect=protect,
        )
        for old in doomed:
            log.info("retention: removing %s", old.path)
            retention.remove_step(old.path)


def _zero(progress: dict[str, Any]) -> None:
    for key in progress:
        progress[key] = 0


def _close_epoch(fit: dict[str, Any]) -> None:
    """Write a step saved once an epoch is closed as "epoch done, next not started".

    A step saved after the epoch's last batch and its epoch-end work (hooks, per-epoch LR
    schedulers), e.g. at the next epoch's start or at the end of fit, carries the counters of
    that moment: the epoch's batches still counted as current, or the next epoch already
    "ready". Lightning resumes those inside the wrong epoch or at the wrong batch index. The
    counters are rewritten to what they are between two epochs, which Lightning resumes at
    batch 0 of the next epoch; mid-epoch steps are left as they are.
    """
    epochs = fit.get("epoch_progress")
    batches = fit.get("epoch_loop.batch_progress")
    if not epochs or not batches or not batches.get("is_last_batch"):
        return
    current = epochs["current"]
    if current["processed"] != current["started"] or current["completed"] != current["processed"]:
        return  # inside an epoch (its last batch done, its end not yet run)
    for scope in ("current", "total"):
        done = epochs[scope]["completed"]
        for key in ("ready", "started", "processed"):
            epochs[scope][key] = done
    _zero(batches["current"])
    batches["is_last_batch"] = False
    for key in (
        "epoch_loop.scheduler_progress",
        "epoch_loop.manual_optimization.optim_step_progress",
    ):
        if key in fit:
            _zero(fit[key]["current"])
    optim = fit.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {})
    for part in optim.values():
        _zero(part["current"])
    val = fit.get("epoch_loop.val_loop.batch_progress")
    if val is not None:
        _zero(val["current"])
        _zero(val["total"])
        val["is_last_batch"] = False


def _between_epochs(fit: dict[str, Any]) -> bool:
    """Whether a saved fit-loop state is the one :func:`_close_epoch` writes."""
    batches = fit.get("epoch_loop.batch_progress")
    if not batches or batches.get("is_last_batch") or any(batches["current"].values()):
        return False
    total = batches["total"]
    return bool(total["completed"]) and total["completed"] == total["processed"]


def _max_steps_reached(trainer: pl.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps


def _validation_enabled(trainer: pl.Trainer) -> bool:
    batches = trainer.num_val_batches
    total = sum(batches) if isinstance(batches, list) else batches
    return bool(trainer.enable_validation and total)
