"""Checks made when a run starts, before any step is written."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt import layout, metrics
from lightning_mcore_ckpt._lock import DirectoryLock

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport

__all__ = [
    "acquire_lock",
    "agree_on_last",
    "check_hf_export",
    "refuse_another_runs_steps",
    "refuse_uploading_loggers",
]


def acquire_lock(trainer: pl.Trainer, root: Path, stage: str) -> DirectoryLock | None:
    """Rank 0 creates ``root`` and, for ``fit``, takes its lock and starts its heartbeat
    (:class:`~lightning_mcore_ckpt.layout.DirectoryLock`: a requeue of the same job takes over
    at once). Collective: every rank raises the same error when the directory is in use by
    another run."""
    problem, lock = None, None
    if trainer.is_global_zero:
        root.mkdir(parents=True, exist_ok=True)
        if stage == "fit":
            lock = DirectoryLock(root)
            try:
                lock.acquire()
            except RuntimeError as err:
                problem, lock = str(err), None
            else:
                lock.start_heartbeat()
        metrics.define_wandb_metrics(trainer.loggers)
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise RuntimeError(f"MegatronCheckpoint(dirpath={str(root)!r}): {problem}")
    return lock


def refuse_another_runs_steps(trainer: pl.Trainer, root: Path) -> None:
    """A ``fit`` that starts from scratch (no checkpoint was loaded) in a directory holding
    complete steps. Collective: rank 0 looks, every rank raises the same ``ValueError``."""
    problem = None
    if trainer.is_global_zero:
        steps = layout.complete_steps(root)
        problem = _another_run(root, steps[-1].path.name) if steps else None
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise ValueError(problem)


def _another_run(root: Path, newest: str) -> str:
    return (
        f"MegatronCheckpoint(dirpath={str(root)!r}): "
        f"it holds complete steps of another run (newest: {newest}), and this "
        'fit starts from scratch (no ckpt_path): its saves would mix with them and "last" '
        'could serve theirs. Resume that run with trainer.fit(..., ckpt_path="last"), choose '
        "a new dirpath, or pass MegatronCheckpoint(overwrite=True) to replace them (they are "
        "deleted once this run's first step is committed)"
    )


def refuse_uploading_loggers(loggers: Iterable[Any], dirpath: str) -> None:
    """Refuse loggers told to upload checkpoints (``WandbLogger(log_model=...)``, MLflow's).

    They upload checkpoint *files* and skip directories; a step here is a directory of shards,
    so nothing would be uploaded while the run looks configured to.
    """
    for logger in loggers:
        value = getattr(logger, "_log_model", False)
        if value:
            raise ValueError(
                f"{type(logger).__name__}(log_model={value!r}): Lightning's loggers upload "
                "checkpoint files, but MegatronCheckpoint writes each step as a directory of "
                "shards, which they skip: nothing would be uploaded. Pass log_model=False; the "
                f"steps stay in {dirpath} and each save's figures are still logged"
            )


def check_hf_export(export: HFExport, strategy: Any, pl_module: pl.LightningModule) -> None:
    """The Hugging Face model to export to must match the module's GPT models' shapes."""
    from megatron.core.models.gpt import GPTModel

    from lightning_mcore_ckpt import hf

    prefixes = [f"{n}." for n, m in pl_module.named_modules() if isinstance(m, GPTModel)]
    hf.check_model_matches(
        hf.HFBridge(export.path),
        strategy.model_sharded_state_dict(),
        prefixes,
        argument="HFExport(hf_model_path=...)",
    )


def agree_on_last(trainer: pl.Trainer, root: Path, found: bool | None) -> None:
    """``ckpt_path="last"``: every rank must see a step to resume, or none must. Collective
    (``found`` is ``None`` on every rank when the fit was not given ``"last"``: a no-op).

    Ranks that disagree (a ``dirpath`` that is not on a file system shared by all hosts) would
    load on some ranks only and wait for each other forever: every rank raises instead.
    """
    import torch.distributed as dist

    if found is None or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        return
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, bool(found))
    if len(set(seen)) > 1:
        without = [rank for rank, flag in enumerate(seen) if not flag]
        raise RuntimeError(
            f'MegatronCheckpoint(dirpath={str(root)!r}): ckpt_path="last" found complete steps '
            f"on some ranks but none on ranks {without}: the directory must be the same one, "
            "on a file system every host shares. Put dirpath on shared storage"
        )
