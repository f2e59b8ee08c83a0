"""Build one run of a job on this rank (from a function or a LightningCLI config) and fit it."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mcore_ckpt.resume_check._failure import JobMisfit

__all__ = ["ConfigInfo", "ResumeJob", "read_config", "run_job"]

_CLI_EXTRA = "pip install 'lightning-mcore-ckpt[cli]'"


@dataclass
class ConfigInfo:
    """What the parent process needs from a config: its text, world size (``trainer.devices``
    x ``num_nodes``), ``max_steps``, its number of nodes and whether its checkpoint callback has
    a fast tier."""

    text: str
    world_size: int
    max_steps: int | None
    nodes: int = 1
    fast_tier: bool = False


@dataclass
class ResumeJob:
    """What one run of a job is: the Trainer, the module and the data passed to ``fit``.

    A resume check calls your ``build`` function on every rank of every run, and it returns one
    of these. The Trainer must have exactly one
    :class:`~lightning_mcore_ckpt.MegatronCheckpoint` (the check points it at a directory of
    its own for each run) and a :class:`~lightning_mcore_ckpt.MegatronStrategy`.

    Example::

        def build() -> ResumeJob:
            L.seed_everything(0)
            trainer = L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2),
                                callbacks=[MegatronCheckpoint("ckpt", every_n_train_steps=2)],
                                accelerator="cpu", devices=2, max_steps=8)
            return ResumeJob(trainer, MyModule(), datamodule=MyData())
    """

    trainer: Any
    model: Any
    datamodule: Any = None
    train_dataloaders: Any = None
    val_dataloaders: Any = None


def _load_yaml(text: str, where: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {where}: not a LightningCLI config (a YAML mapping)")
    return data


def read_config(path: str | os.PathLike[str]) -> ConfigInfo:
    """Read a LightningCLI config and check what the resume check needs from it."""
    try:
        import jsonargparse  # noqa: F401
    except ImportError:
        raise ImportError(f"check-resume with a config needs LightningCLI: {_CLI_EXTRA}") from None
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    text = file.read_text()
    data = _load_yaml(text, str(path))
    trainer = data.get("trainer") or {}
    for key in ("model", "data"):
        section = data.get(key)
        if section is not None and not (isinstance(section, dict) and "class_path" in section):
            raise ValueError(
                f"--config {path}: '{key}' must name its class with class_path (LightningCLI's "
                f"subclass mode), e.g. {key}: {{class_path: my_pkg.MyClass, init_args: {{...}}}}"
            )
    if data.get("model") is None:
        raise ValueError(f"--config {path}: it has no 'model' (class_path and init_args)")
    devices = trainer.get("devices", 1)
    nodes = trainer.get("num_nodes", 1)
    if isinstance(devices, list):
        devices = len(devices)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (devices, nodes)):
        raise ValueError(
            f"--config {path}: trainer.devices={devices!r}, num_nodes={nodes!r}; the resume "
            "check runs on this machine, on simulated nodes when num_nodes (or --nodes) is "
            "above 1: set trainer.devices to a number of processes per node and num_nodes to "
            "a number of nodes"
        )
    max_steps = trainer.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        max_steps = None
    return ConfigInfo(
        text=text,
        world_size=devices * nodes,
        max_steps=max_steps,
        nodes=nodes,
        fast_tier=_has_fast_tier(trainer.get("callbacks")),
    )


def _has_fast_tier(callbacks: Any) -> bool:
    """Whether a config's ``trainer.callbacks`` hold a MegatronCheckpoint with a fast tier."""
    if isinstance(callbacks, dict):
        callbacks = [callbacks]
    for callback in callbacks if isinstance(callbacks, list) else []:
        if not isinstance(callback, dict):
            continue
        if str(callback.get("class_path", "")).endswith("MegatronCheckpoint"):
            if (callback.get("init_args") or {}).get("fast_tier") is not None:
                return True
    return False


def _from_config(source: dict[str, Any], run_dir: Path, max_steps: int, nodes: int) -> Any:
    import yaml
    from lightning.pytorch.cli import LightningCLI

    from lightning_mcore_ckpt.storage import atomic as _atomic

    data = _load_yaml(source["text"], source["config"])
    data.pop("ckpt_path", None)  # the check chooses where each run starts
    trainer = dict(data.get("trainer") or {})
    trainer["max_steps"] = max_steps
    # The check's split of the processes into nodes (--nodes, default the config's own).
    total = _processes(trainer)
    trainer["num_nodes"], trainer["devices"] = nodes, total // nodes
    trainer["logger"] = False  # runs of the check do not add to the job's own logs
    trainer["enable_model_summary"] = False  # nor a model summary per run to the report
    trainer["default_root_dir"] = str(run_dir)
    data["trainer"] = trainer
    # Every rank writes the same file, another rank may be reading it: replaced whole, never
    # seen half-written.
    config = run_dir / "config.yaml"
    _atomic.write_text(config, yaml.safe_dump(data))
    # The config is the job's whole command line (not the check's own arguments in sys.argv).
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        cli = LightningCLI(
            args=["--config", str(config)],
            run=False,
            save_config_callback=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
        )
    finally:
        sys.argv = argv
    return ResumeJob(cli.trainer, cli.model, datamodule=cli.datamodule)


def _processes(trainer: dict[str, Any]) -> int:
    devices = trainer.get("devices", 1)
    devices = len(devices) if isinstance(devices, list) else devices
    return int(devices) * int(trainer.get("num_nodes", 1))


@dataclass(frozen=True)
class Placement:
    """Where the check puts one run's checkpoints: the persistent tier's directory (shared by
    every node), the fast tier's directory (each node's own: ``node_dir`` of
    :func:`~lightning_mcore_ckpt.testing.run_nodes`), the number of nodes, and whether the job
    must have a fast tier (``how="wipe-node"``)."""

    ckpt_dir: Path
    fast_dir: Path
    nodes: int = 1
    needs_fast_tier: bool = False


def run_job(
    source: Any,
    run_dir: Path,
    place: Placement,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
) -> None:
    """Build the job on this rank, point its checkpoints (both tiers) where ``place`` says,
    probe it and fit it."""
    from lightning_mcore_ckpt.callback import MegatronCheckpoint
    from lightning_mcore_ckpt.resume_check._probe import ResumeProbe
    from lightning_mcore_ckpt.strategy import MegatronStrategy

    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(source, dict):
        job = _from_config(source, run_dir, max_steps, place.nodes)
    else:
        job = source()
    if not isinstance(job, ResumeJob):
        raise TypeError(
            f"check_resume: build() returned {type(job).__name__}; return "
            "lightning_mcore_ckpt.ResumeJob(trainer, model, datamodule=... or train_dataloaders=...)"
        )
    trainer = job.trainer
    if not isinstance(trainer.strategy, MegatronStrategy):
        raise ValueError(
            f"check_resume: the job's Trainer uses {type(trainer.strategy).__name__}; use "
            "Trainer(strategy=MegatronStrategy(...))"
        )
    ckpts = [c for c in trainer.callbacks if isinstance(c, MegatronCheckpoint)]
    if len(ckpts) != 1:
        raise ValueError(
            f"check_resume: the job's Trainer has {len(ckpts)} MegatronCheckpoint callbacks; "
            "it needs exactly one (the one whose steps are resumed)"
        )
    if trainer.num_nodes != place.nodes:
        raise JobMisfit(
            f"check_resume(nodes={place.nodes}): the job's Trainer has num_nodes="
            f"{trainer.num_nodes}; build it with Trainer(num_nodes={place.nodes}, devices="
            f"{trainer.world_size // place.nodes}), as on a cluster of {place.nodes} nodes, or "
            f"pass nodes={trainer.num_nodes}"
        )
    checkpoint = ckpts[0]
    fast = checkpoint.config.fast_tier
    if fast is None and place.needs_fast_tier:
        raise JobMisfit(
            "check_resume(how='wipe-node'): the job's MegatronCheckpoint has no fast tier, so "
            "there is no fast step to resume from a peer's copy; give it MegatronCheckpoint(..., "
            "fast_tier=FastTier(dir, every_n_train_steps=..., replicas=1)), or drop 'wipe-node' "
            "from how"
        )
    checkpoint.dirpath = place.ckpt_dir
    if fast is not None:
        # As the persistent tier's directory: one of the run's own, here on each node's own
        # disk (the job's own fast-tier directory is never touched).
        checkpoint.config = dataclasses.replace(
            checkpoint.config, fast_tier=dataclasses.replace(fast, dir=str(place.fast_dir))
        )
    trainer.fit_loop.epoch_loop.max_steps = max_steps
    # Before the checkpoint callback: a stop it asks for is seen by the save of the same batch.
    position = trainer.callbacks.index(ckpts[0])
    trainer.callbacks.insert(position, ResumeProbe(run_dir / "probe", how=how, stop_at=stop_at))
    trainer.fit(
        job.model,
        train_dataloaders=job.train_dataloaders,
        val_dataloaders=job.val_dataloaders,
        datamodule=job.datamodule,
        ckpt_path=ckpt_path,
    )
