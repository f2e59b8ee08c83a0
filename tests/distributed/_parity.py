"""One configurable Trainer run for the Lightning-parity tests (runs inside each rank).

:func:`run_specs` runs several independent fits in one process (one process start for a whole
parametrised table) and returns, per fit, what the tests compare with Lightning's documented
``ModelCheckpoint`` behaviour: the complete steps on disk, the callback's bookkeeping attributes
and ``state_dict()``, what loggers were told, the monitor values recorded in each step's
``metadata.json``, and any error the fit raised.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

SCORES = {1: 5.0, 2: 2.0, 3: 7.0, 4: 1.0, 5: 6.0, 6: 3.0}
"""``train_metric`` logged by the batch that ends at step N: not monotonic in the step, so
neither the best nor the top-2 (under ``min`` or ``max``) is simply the newest step."""
VAL_SCORES = {2: 4.0, 4: 9.0, 6: 0.5}
"""``val_loss`` logged by the validation that runs at step N (differs between validations)."""
ATTRS = (
    "best_model_path",
    "best_model_score",
    "best_k_models",
    "kth_best_model_path",
    "kth_value",
    "current_score",
    "last_model_path",
    "_last_checkpoint_saved",
)
MISSING = "<attribute missing>"


def step_path(dirpath: str | os.PathLike[str], step: int) -> str:
    """What Lightning-style bookkeeping names a step: ``str(<dirpath>/global_step_<N>)``."""
    return str(Path(dirpath) / f"global_step_{step}")


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def callback_attrs(callback: Any) -> dict[str, Any]:
    return {name: _snapshot(getattr(callback, name, MISSING)) for name in ATTRS}


def _module_class() -> type:
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class ScoredModule(TinyGPTModule):  # type: ignore[misc, valid-type]
        """Logs ``train_metric`` (from ``scores``) and, with ``val_scores``, ``val_loss``."""

        def __init__(
            self,
            scores: dict[int, float] | None,
            val_scores: dict[int, float] | None,
            sleep_s: float,
        ) -> None:
            super().__init__()
            self.scores = scores
            self.val_scores = val_scores
            self.sleep_s = sleep_s
            self.val_by_step: dict[int, float] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if self.scores is not None:
                # The save after this batch is the save of step global_step + 1.
                value = self.scores[self.trainer.global_step + 1]
                self.log("train_metric", torch.tensor(value))
            if self.sleep_s:
                time.sleep(self.sleep_s)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.val_scores is None:
                return super().validation_step(batch, batch_idx)  # type: ignore[no-any-return]
            step = self.trainer.global_step
            value = self.val_scores[step]
            self.val_by_step[step] = value
            self.log("val_loss", torch.tensor(value))
            return torch.tensor(value)

        def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self(*batch)
            self.log("test_loss", loss)
            return loss  # type: ignore[no-any-return]

    return ScoredModule


def _recording_logger_class() -> type:
    from lightning.pytorch.loggers import Logger

    from lightning_mcore_ckpt import MegatronCheckpoint, layout

    class RecordingLogger(Logger):  # type: ignore[misc]
        """Records every ``after_save_checkpoint`` call and what was on disk at that moment."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[dict[str, Any]] = []

        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            pass

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
            # The newest committed step (save_last=True); else the one Lightning just saved.
            last = str(getattr(checkpoint_callback, "last_model_path", "") or "")
            saved = str(getattr(checkpoint_callback, "_last_checkpoint_saved", "") or "")
            path = last or saved
            self.calls.append(
                {
                    "is_megatron_checkpoint": isinstance(checkpoint_callback, MegatronCheckpoint),
                    "dirpath": str(checkpoint_callback.dirpath),
                    "path": path,
                    "complete": bool(path) and layout.is_complete(path),
                    "last_model_path": last,
                    "_last_checkpoint_saved": saved,
                }
            )

    return RecordingLogger


def fit(
    rank: int,
    world_size: int,
    dirpath: str,
    *,
    max_steps: int = 6,
    samples: int = 64,
    callback: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    strategy: dict[str, Any] | None = None,
    scores: dict[int, float] | None = SCORES,
    val_scores: dict[int, float] | None = None,
    sleep_s: float = 0.0,
    ckpt_path: str | None = None,
    capture_weights: bool = False,
    probe: bool = False,
    logger: Any = None,
    evaluate: str | None = None,
    chdir: str | None = None,
    home: str | None = None,
) -> dict[str, Any]:
    """Build a Trainer with one :class:`MegatronCheckpoint` and fit; report what happened."""
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy, layout

    if chdir is not None:
        os.chdir(chdir)
    if home is not None:
        os.environ["HOME"] = home
    out: dict[str, Any] = {"rank": rank, "error": None, "start": None, "captured": {}}
    loggers: list[Any] = []
    wandb_run = False
    ckpt: Any = None
    module: Any = None
    try:
        ckpt = MegatronCheckpoint(dirpath, **(callback or {}))

        class Probe(pl.Callback):
            def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
                if probe:
                    out["start"] = callback_attrs(ckpt)

            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                if capture_weights:
                    out["captured"][trainer.global_step] = gathered_weights(trainer)

        if logger == "recording":
            loggers = [_recording_logger_class()()]
        elif isinstance(logger, tuple) and logger[0] == "wandb":
            from lightning.pytorch.loggers import WandbLogger

            os.environ["WANDB_MODE"] = "offline"
            loggers = [WandbLogger(project="parity", save_dir=logger[2], log_model=logger[1])]
            wandb_run = True
        module = _module_class()(scores, val_scores, sleep_s)
        options: dict[str, Any] = dict(trainer or {})
        if loggers:
            options.update(logger=loggers, log_every_n_steps=1)
        run = make_trainer(
            max_steps,
            MegatronStrategy(**(strategy or {})),
            world_size,
            callbacks=[ckpt, Probe()],
            enable_checkpointing=True,
            **options,
        )
        val = loader(4, 2) if val_scores is not None or evaluate else None
        run.fit(
            module, train_dataloaders=loader(samples, 2), val_dataloaders=val, ckpt_path=ckpt_path
        )
        if evaluate is not None:
            getattr(run, evaluate)(module, dataloaders=loader(4, 2), ckpt_path="best")
            out["evaluated_from"] = run.ckpt_path
            out["weights_after_evaluate"] = gathered_weights(run)
    except Exception as err:  # noqa: BLE001 - reported to the test, which asserts on it
        from lightning.pytorch.utilities.exceptions import MisconfigurationException

        out["error"] = {
            "type": type(err).__name__,
            "message": str(err),
            "value_error": isinstance(err, ValueError),
            "misconfiguration": isinstance(err, MisconfigurationException),
        }
    finally:
        if wandb_run:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    root = Path(dirpath)
    out["step_dirs"] = sorted(p.name for p in root.glob("global_step_*")) if root.is_dir() else []
    complete = layout.complete_steps(root) if root.is_dir() else []
    out["complete"] = [s.step for s in complete]
    out["monitor"] = {s.step: (layout.read_metadata(s.path) or {}).get("monitor") for s in complete}
    if ckpt is not None:
        out["attrs"] = callback_attrs(ckpt)
        try:
            out["state"] = _snapshot(dict(ckpt.state_dict()))
        except Exception as err:  # noqa: BLE001 - reported to the test
            out["state"] = {"<state_dict raised>": repr(err)}
    if module is not None:
        out["val_by_step"] = dict(module.val_by_step)
    out["log_calls"] = list(loggers[0].calls) if logger == "recording" else None
    return out


def run_specs(rank: int, world_size: int, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run each spec (keyword arguments of :func:`fit`) in order, in this one process."""
    return {name: fit(rank, world_size, **spec) for name, spec in specs.items()}
