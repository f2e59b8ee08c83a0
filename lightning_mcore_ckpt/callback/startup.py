"""When a run starts, before any step is written: the checks, the directory's lock and the
tiers' hold."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_mcore_ckpt.errors import ConfigurationError
from lightning_mcore_ckpt.format import metrics
from lightning_mcore_ckpt.storage.lock import DirectoryLock

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.hf import HFExport
    from lightning_mcore_ckpt.storage.tier import Tier

__all__ = [
    "acquire_lock",
    "agree_on_last",
    "check_hf_export",
    "has_last",
    "open_tiers",
    "refuse_another_runs_steps",
    "refuse_uploading_loggers",
]


def acquire_lock(trainer: pl.Trainer, root: Path, stage: str) -> DirectoryLock | None:
    """Rank 0 creates ``root`` and, for ``fit``, takes its lock and starts its heartbeat
    (:class:`~lightning_mcore_ckpt.storage.lock.DirectoryLock`: a requeue of the same job takes over
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


def refuse_another_runs_steps(
    trainer: pl.Trainer, tiers: Sequence[Tier], own: Collection[int] = ()
) -> None:
    """A ``fit`` that starts from scratch (no checkpoint was loaded) in a directory (or a store:
    the persistent tier, the last of ``tiers``) holding complete steps. Collective: rank 0 looks, every rank raises the same error.

    ``own``: the steps this callback committed in earlier fits (rank 0). A Trainer fitted again
    (its ``global_step`` past 0) whose newest step there is one of them continues its run, as
    Lightning's does."""
    problem = None
    if trainer.is_global_zero:
        steps = tiers[-1].complete_steps()
        continues = bool(steps) and trainer.global_step > 0 and steps[-1].step in own
        newest = steps[-1].path.name if steps and not continues else None
        problem = None if newest is None else _another_run(tiers[-1].where, newest)
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise ConfigurationError(problem)


def _another_run(where: str, newest: str) -> str:
    return (
        f"MegatronCheckpoint(dirpath={where!r}): "
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
            raise ConfigurationError(
                f"{type(logger).__name__}(log_model={value!r}): Lightning's loggers upload "
                "checkpoint files, but MegatronCheckpoint writes each step as a directory of "
                "shards, which they skip: nothing would be uploaded. Pass log_model=False; the "
                f"steps stay in {dirpath} and each save's figures are still logged"
            )


def check_hf_export(export: HFExport, strategy: Any, pl_module: pl.LightningModule) -> None:
    """The Hugging Face model to export to must match the module's GPT models' shapes (a module
    without one, a hybrid model's, is refused)."""
    from lightning_mcore_ckpt import hf

    prefixes = hf.gpt_model_prefixes(
        pl_module,
        "MegatronCheckpoint(hf_export=HFExport(...))",
        "leave hf_export out (the steps are saved, resumed and resharded as they are)",
    )
    hf.check_model_matches(
        hf.HFBridge(export.path),
        strategy.model_sharded_state_dict(),
        prefixes,
        argument="HFExport(hf_model_path=...)",
    )


def open_tiers(trainer: pl.Trainer, tiers: Sequence[Tier], stage: str) -> None:
    """Rank 0 takes each tier's lock for ``fit`` (an object store's; every rank raises the same
    error when another run holds one); the strategy finds "last" through the tiers."""
    problem = None
    if trainer.is_global_zero and stage == "fit":
        for tier in tiers:
            try:
                tier.acquire()
            except Exception as err:  # noqa: BLE001 - the same error on every rank
                problem = f"MegatronCheckpoint(dirpath={tier.where!r}): {type(err).__name__}: {err}"
                break
    problem = trainer.strategy.broadcast(problem)
    if problem is not None:
        raise RuntimeError(problem)
    for tier in tiers:
        tier.register(trainer.strategy.checkpoint_sources)  # type: ignore[attr-defined]


def has_last(trainer: pl.Trainer, contents: tuple[str, ...], tiers: Sequence[Tier]) -> bool:
    """``fit(ckpt_path="last")``: whether there is a step to resume (every rank), in the
    persistent tier (the last of ``tiers``).

    Which step is decided once, when the strategy loads: rank 0 picks the newest step that is
    undamaged and every rank gets its choice (or its error). Here every rank only says whether
    there is one; :func:`agree_on_last` checks that all ranks agree.
    """
    from lightning.pytorch.trainer.states import TrainerFn

    missing = [c for c in ("optimizer", "extra") if c not in contents]
    if missing and trainer.state.fn == TrainerFn.FITTING:
        raise ConfigurationError(
            f"MegatronCheckpoint(save_contents={list(contents)!r}): "
            f'fit(ckpt_path="last") resumes training, which needs {missing} in every step. '
            "Add them to save_contents, or start a new run from the weights with "
            "MegatronStrategy(init_from=<step directory>)"
        )
    return tiers[-1].has_last()


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
