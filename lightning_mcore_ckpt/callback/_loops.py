"""Lightning's loop and dataloader state at a save and at a resume: what must be rewritten or
refused so that a resumed run continues exactly where the saved one was."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format.loops import between_epochs

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "check_data_parallel_change",
    "max_steps_reached",
    "on_load",
    "refuse_unresumable_loader",
    "validation_due",
    "validation_enabled",
]

log = logging.getLogger(__name__)


def refuse_unresumable_loader(trainer: pl.Trainer, dirpath: str, resumed_step: int) -> None:
    """Refuse a resume inside an epoch with a loader that cannot restore its position.

    Lightning would replay the epoch from its first batch while counting on from the saved one.
    """
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
        raise ConfigurationError(
            f"MegatronCheckpoint(dirpath={dirpath!r}): step {resumed_step} was saved inside an "
            f"epoch (after {done} of its {trainer.num_training_batches} batches), but the "
            f"train dataloader ({', '.join(plain)}) cannot restore its position: the rest "
            "of the epoch would not see the data the uninterrupted run sees. Use "
            "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in DataLoader), save "
            "only at epoch ends (every_n_epochs), or pass "
            "MegatronCheckpoint(restore_dataloader=False) to accept a restarted epoch"
        )


def check_data_parallel_change(
    checkpoint: dict[str, Any], source: dict[str, Any], current_dp: int, restore: bool
) -> None:
    """A resume with another data-parallel size: map, drop or refuse the loaders' state."""
    saved_dp = (source.get("parallel_layout") or {}).get("data_parallel_size")
    if saved_dp is None or saved_dp == current_dp:
        return
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    loader_states = fit_state.get("combined_loader") or []
    if not loader_states:
        return
    if not restore:
        fit_state["combined_loader"] = []
        log.warning(
            "data-parallel size changed (%s -> %s): dataloader state not restored "
            "(restore_dataloader=False); the epoch's data order restarts",
            saved_dp,
            current_dp,
        )
        return
    from lightning_mcore_ckpt.training.sampler import is_elastic_state

    if not all(is_elastic_state(s) for s in loader_states):
        raise ConfigurationError(
            f"checkpoint {source.get('path')} was saved with data-parallel size {saved_dp}, "
            f"this run has {current_dp}: its dataloader positions are per rank and cannot "
            "be mapped. Use lightning_mcore_ckpt.ElasticSampler (continues at the exact next "
            "global sample), or MegatronCheckpoint(restore_dataloader=False) to restart the "
            "epoch's data order"
        )


def on_load(
    checkpoint: dict[str, Any], current_dp: int, restore_dataloader: bool
) -> tuple[int | None, int | None]:
    """At a resume: the step resumed from, and Lightning's stepped-batch counter to restore
    (``None`` when Lightning's own is right); refuses or drops unmappable loader state."""
    from lightning_mcore_ckpt.engine import LOADED_FROM_KEY
    from lightning_mcore_ckpt.fast import files as fast_files
    from lightning_mcore_ckpt.format import layout

    source = checkpoint.get(LOADED_FROM_KEY) or {}
    fit = checkpoint.get("loops", {}).get("fit_loop") or {}
    stepped = None
    if between_epochs(fit):
        # Lightning adds one to its stepped-batch counter on some restarts, assuming the
        # step was saved before the counter moved; a step saved between epochs was not.
        stepped = fit["epoch_loop.state_dict"].get("_batches_that_stepped")
    check_data_parallel_change(checkpoint, source, current_dp, restore_dataloader)
    path = source.get("path", "")
    # A persistent step (global_step_<N>), or a fast-tier one (fast_step_<N>).
    return layout.step_number(path) or fast_files.step_number(path), stepped


def max_steps_reached(trainer: pl.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps


def validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs validation right after this training batch."""
    loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    if fetcher is None:
        return False
    try:
        return bool(loop._should_check_val_fx(fetcher))
    except (AttributeError, TypeError):  # another Lightning: assume it does not
        return False


def validation_enabled(trainer: pl.Trainer) -> bool:
    """Whether validation runs during this fit (at some point: with
    ``check_val_every_n_epoch=2`` its loader is set up only at the first validation)."""
    if not trainer.enable_validation:
        return False
    if trainer.fit_loop.epoch_loop.val_loop._combined_loader is None:
        return True  # not set up yet: Lightning loads it where the first validation runs
    batches = trainer.num_val_batches
    return bool(sum(batches) if isinstance(batches, list) else batches)
