"""The callback's state: the key Lightning keeps it under, what each step carries (Lightning's
state, its loops, its epoch), a step of the previous release, a pickled copy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_mcore_ckpt.callback import _loops
from lightning_mcore_ckpt.callback._when import StepTriggers

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CheckpointState", "adopt_legacy_state", "ranked_mode"]


class CheckpointState(StepTriggers):
    """Lightning's ``ModelCheckpoint`` state, as a step of this package carries it."""

    _key: str
    """The dirpath as given (see :attr:`state_key`)."""
    _writing: tuple[Path, int] | None
    """The step being written and the epoch it records, while it is written."""

    @property
    @override
    def state_key(self) -> str:
        # Lightning's key (monitor, mode, cadence: a run resumed with other ones starts its
        # bookkeeping afresh), and the dirpath (two callbacks alike but for it, in one Trainer).
        return self._generate_state_key(
            dirpath=self._key,
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    @property
    def _legacy_key(self) -> str:
        """The key of this callback's state in steps saved before :attr:`state_key` named the
        configuration: the dirpath alone."""
        return self._generate_state_key(dirpath=self._key)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "last_global_step_saved": self._last_global_step_saved}
        if self._writing is not None and self.save_last:
            # Lightning's trigger names this step "last" right after its top-k save (here one
            # step, not a copy): the state it carries says so, as Lightning's last.ckpt does.
            state["last_model_path"] = str(self._writing[0])
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_global_step_saved = int(state_dict.get("last_global_step_saved", 0))
        if "best_model_path" in state_dict:  # steps written before 0.2 carry only the above
            super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled copy equals the original (as Lightning's ModelCheckpoint does: the same
        # attributes), also after a fit: what belongs to a fit in progress (the committer,
        # the directory's lock) is not carried; the next fit's setup creates its own.
        return {**vars(self), "_committer": None, "_lock": None, "_filters": None}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        fit = checkpoint.get("loops", {}).get("fit_loop")
        if fit is not None:
            _loops.close_epoch(fit)
        if self._writing is not None:
            # A step written once Lightning has closed its epoch records the epoch of its
            # trigger (Lightning's checkpoint would have been written there), not the next.
            checkpoint["epoch"] = self._writing[1]

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        callbacks = checkpoint.get("callbacks")
        if isinstance(callbacks, dict):  # before Lightning's load_state_dict looks it up
            key, legacy = self.state_key, self._legacy_key
            adopt_legacy_state(callbacks, key, legacy, self.monitor, self.mode)


def ranked_mode(state: dict[str, Any]) -> str | None:
    """The ``mode`` a saved state ranked its steps with, where its scores tell (``None`` where
    they do not: one score, or equal ones)."""
    kth = state.get("kth_value")
    if isinstance(kth, torch.Tensor) and kth.numel() == 1 and torch.isinf(kth):
        return "min" if float(kth) > 0 else "max"  # Lightning's start value: top-k not yet full
    values = [float(v) for v in (state.get("best_k_models") or {}).values()]
    best = state.get("best_model_score")
    if best is None or len(set(values)) < 2:
        return None
    if float(best) == min(values):
        return "min"
    return "max" if float(best) == max(values) else None


def adopt_legacy_state(
    callbacks: dict[Any, Any], key: str, legacy_key: str, monitor: str | None, mode: str
) -> None:
    """A step written before the state key named the monitor, mode and cadence holds this
    callback's state under ``legacy_key`` (the dirpath alone). Taken as this callback's state
    when it was ranked by the same monitor (and, where its scores tell, mode); else only what
    does not depend on the metric (the last step saved) is, as for a changed configuration
    Lightning takes none of it."""
    if key in callbacks or legacy_key not in callbacks:
        return
    old = callbacks[legacy_key]
    if not isinstance(old, dict):
        return
    same = old.get("monitor") == monitor and ranked_mode(old) in (None, mode)
    if same:
        callbacks[key] = old
    elif "last_global_step_saved" in old:
        callbacks[key] = {"last_global_step_saved": old["last_global_step_saved"]}
