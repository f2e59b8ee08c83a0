"""Build one run of a job on this rank (from a function or a LightningCLI config) and fit it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ConfigInfo", "ResumeJob", "read_config", "run_job"]

_CLI_EXTRA = "pip install 'lightning-mcore-ckpt[cli]'"


@dataclass
class ConfigInfo:
    """What the parent process needs from a config: its text, world size and ``max_steps``."""

    text: str
    world_size: int
    max_steps: int | None


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
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1 or nodes != 1:
        raise ValueError(
            f"--config {path}: trainer.devices={devices!r}, num_nodes={nodes!r}; the resume "
            "check runs on this machine: set trainer.devices to a number of processes and "
            "num_nodes to 1"
        )
    max_steps = trainer.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        max_steps = None
    return ConfigInfo(text=text, world_size=devices, max_steps=max_steps)


def _from_config(source: dict[str, Any], run_dir: Path, max_steps: int) -> Any:
    import yaml
    from lightning.pytorch.cli import LightningCLI

    from lightning_mcore_ckpt.storage import atomic as _atomic

    data = _load_yaml(source["text"], source["config"])
    data.pop("ckpt_path", None)  # the check chooses where each run starts
    trainer = dict(data.get("trainer") or {})
    trainer["max_steps"] = max_steps
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


def run_job(
    source: Any,
    run_dir: Path,
    ckpt_dir: Path,
    max_steps: int,
    ckpt_path: str | None,
    how: str | None,
    stop_at: int,
) -> None:
    """Build the job on this rank, point its checkpoints at ``ckpt_dir``, probe it and fit it."""
    from lightning_mcore_ckpt.callback import MegatronCheckpoint
    from lightning_mcore_ckpt.resume_check._probe import ResumeProbe
    from lightning_mcore_ckpt.strategy import MegatronStrategy

    run_dir.mkdir(parents=True, exist_ok=True)
    job = _from_config(source, run_dir, max_steps) if isinstance(source, dict) else source()
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
    ckpts[0].dirpath = ckpt_dir
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
