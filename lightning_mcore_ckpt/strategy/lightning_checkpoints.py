"""Lightning's own ``ModelCheckpoint`` with ``MegatronStrategy``: the paths it names, their
removal (only what this package wrote), and what the strategy cannot serve with it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format import retention

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["check_callbacks", "lightning_checkpoints", "named_paths", "remove", "replace_named"]

log = logging.getLogger(__name__)


def lightning_checkpoints(trainer: pl.Trainer) -> list[Any]:
    """The Trainer's Lightning ``ModelCheckpoint`` callbacks that are not a
    ``MegatronCheckpoint``: they save through ``trainer.save_checkpoint(path)`` and remove
    through ``MegatronStrategy.remove_checkpoint``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    # By module, not isinstance: the strategy does not import the callback (the callback
    # imports the strategy).
    return [
        callback
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint)
        and not any(
            c.__module__.startswith("lightning_mcore_ckpt.callback") for c in type(callback).__mro__
        )
    ]


def check_callbacks(trainer: pl.Trainer, *, dedup: bool) -> None:
    """Refuse, before any work, a Lightning ``ModelCheckpoint`` the strategy cannot serve."""
    if not dedup:
        return
    for callback in lightning_checkpoints(trainer):
        raise ConfigurationError(
            f"MegatronStrategy(ckpt_dedup=True) with Lightning's {type(callback).__name__}"
            f"(dirpath={callback.dirpath!r}): tensors written once go to the run's shared/ "
            "store, which only MegatronCheckpoint's global_step_<N> steps reference and clean "
            "up. Use lightning_mcore_ckpt.MegatronCheckpoint in its place, or ckpt_dedup=False"
        )


def named_paths(trainer: pl.Trainer | None) -> set[Path]:
    """The checkpoint paths a Lightning ``ModelCheckpoint`` of ``trainer`` names now (its best,
    top-k and last): Lightning sets them before it saves there."""
    if trainer is None:
        return set()
    paths: set[Path] = set()
    for callback in lightning_checkpoints(trainer):
        named = [callback.best_model_path, callback.last_model_path, *callback.best_k_models]
        paths.update(Path(p) for p in named if p)
    return paths


def remove(path: Path, rank: int, broadcast: Callable[[Any], Any]) -> None:
    """``MegatronStrategy.remove_checkpoint``: rank 0 deletes ``path``, every rank learns how
    it went (collective).

    A ``global_step_<N>`` step or a path Lightning's ``ModelCheckpoint`` named
    (``epoch=0-step=12.ckpt``, ``last.ckpt``: it calls this for what its ``save_top_k`` lets go)
    is deleted commit marker first, so that a crash midway leaves it incomplete, never damaged.
    Nothing else is ever deleted: a symbolic link is left in place (with a warning), and a path
    without this package's markers is refused with the same ``ValueError`` on every rank. A
    missing path is a no-op, as for Lightning's own checkpoints.
    """
    problem: str | None = None
    if rank == 0:
        if path.is_symlink():
            log.warning(
                "%s is a symbolic link: left in place (links are never followed or deleted)", path
            )
        elif path.exists():
            try:
                retention.remove_step(path, any_name=True)
            except (ValueError, OSError) as err:
                problem = str(err)
    problem = broadcast(problem)
    if problem is not None:
        raise ValueError(f"MegatronStrategy.remove_checkpoint({str(path)!r}): {problem}")


def replace_named(strategy: Any, path: Path) -> None:
    """Before a save no listener owns (collective): when a Lightning ``ModelCheckpoint`` saves
    again at a path it names — ``last.ckpt`` with ``save_last=True``, a ``filename`` without
    epoch or step — what it saved there is replaced, as Lightning replaces its own files."""
    module = strategy.lightning_module
    if path in named_paths(None if module is None else module._trainer):
        strategy.finalize_pending_save(blocking=True)
        remove(path, strategy.global_rank, strategy.broadcast)
