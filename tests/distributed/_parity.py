"""One configurable Trainer run for the Lightning-parity tests (runs inside each rank).

:func:`run_specs` runs several independent fits in one process (one process start for a whole
parametrised table) and returns, per fit, what the tests compare with Lightning's documented
``ModelCheckpoint`` behaviour: the complete steps on disk, the callback's bookkeeping attributes
and ``state_dict()``, what loggers were told, the monitor values and the epoch recorded in each
step, and any error the fit raised.

:func:`run_pairs` runs each fit twice, side by side: once with :class:`MegatronCheckpoint`, once
with Lightning's own ``ModelCheckpoint`` on a plain module that logs the same values at the same
steps (:func:`reference_fit`); both are reported by step (:func:`by_step`), so that a test can
compare what each kept, ranked and recorded.
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


def by_step(attrs: dict[str, Any], step_of: Any) -> dict[str, Any]:
    """A callback's bookkeeping with each path replaced by the step it holds (``None`` for no
    path) and each score as a float, so that two callbacks that name checkpoints differently
    (a ``.ckpt`` file, a step directory) can be compared."""

    def number(value: Any) -> float | None:
        return None if value is None else float(value)

    def step(path: Any) -> int | None:
        return step_of(str(path)) if path else None

    return {
        "best_k": {step(p): number(v) for p, v in attrs["best_k_models"].items()},
        "best": step(attrs["best_model_path"]),
        "best_score": number(attrs["best_model_score"]),
        "kth": step(attrs["kth_best_model_path"]),
        "kth_value": number(attrs["kth_value"]),
        "current_score": number(attrs["current_score"]),
        "last": step(attrs["last_model_path"]),
    }


TRAINERS = ("log", "log_dict")
"""What Lightning's Trainer attaches to every callback at each fit: the module's own logging
methods (a copy of a callback would carry the module)."""


def pickled_differences(obj: Any) -> list[str]:
    """The attributes of a callback that a pickled and unpickled copy does not have equal
    (none: ``vars`` of both compare equal, as Lightning tests its ``ModelCheckpoint``), the
    Trainer's :data:`TRAINERS` aside."""
    import pickle

    mine = {k: v for k, v in vars(obj).items() if k not in TRAINERS}
    alone = object.__new__(type(obj))
    alone.__dict__.update(mine)
    try:
        copy = pickle.loads(pickle.dumps(alone))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return [f"<not picklable: {err!r}>"]
    theirs = vars(copy)

    def same(a: Any, b: Any) -> bool:
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - e.g. tensors of several elements
            return False

    differ = [k for k in mine.keys() | theirs.keys() if not same(mine.get(k), theirs.get(k))]
    if not differ:
        assert mine == theirs
    return sorted(differ)


def _error(err: Exception) -> dict[str, Any]:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    return {
        "type": type(err).__name__,
        "message": str(err),
        "value_error": isinstance(err, ValueError),
        "misconfiguration": isinstance(err, MisconfigurationException),
    }


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


def _legacy_keyed_class() -> type:
    from lightning_mcore_ckpt import MegatronCheckpoint

    class LegacyKeyed(MegatronCheckpoint):  # type: ignore[misc, valid-type]
        """Saves its state as the previous release did: under a key naming the dirpath only."""

        @property
        def state_key(self) -> str:
            return "MegatronCheckpoint" + repr({"dirpath": self._key})

    return LegacyKeyed


def _recording_logger_class() -> type:
    from lightning.pytorch.loggers import Logger

    from lightning_mcore_ckpt import MegatronCheckpoint
    from lightning_mcore_ckpt.format import layout

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
    refit: dict[str, Any] | None = None,
    legacy_key: bool = False,
) -> dict[str, Any]:
    """Build a Trainer with one :class:`MegatronCheckpoint` and fit; report what happened.

    ``refit``: then raise the same Trainer's ``max_epochs``/``max_steps`` to these values and
    call ``fit`` on it again (its bookkeeping after the first fit is ``out["first"]``).
    ``legacy_key``: the callback's state is saved under the key the previous release used."""
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.format import layout, markers

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
        kind = _legacy_keyed_class() if legacy_key else MegatronCheckpoint
        ckpt = kind(dirpath, **(callback or {}))

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
        if refit is not None:
            out["first"] = callback_attrs(ckpt)
            for name, value in refit.items():
                setattr(run.fit_loop, name, value)
            val = loader(4, 2) if val_scores is not None or evaluate else None
            run.fit(module, train_dataloaders=loader(samples, 2), val_dataloaders=val)
        if evaluate is not None:
            getattr(run, evaluate)(module, dataloaders=loader(4, 2), ckpt_path="best")
            out["evaluated_from"] = run.ckpt_path
            out["weights_after_evaluate"] = gathered_weights(run)
    except Exception as err:  # noqa: BLE001 - reported to the test, which asserts on it
        out["error"] = _error(err)
    finally:
        if wandb_run:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    root = Path(dirpath)
    out["step_dirs"] = sorted(p.name for p in root.glob("global_step_*")) if root.is_dir() else []
    complete = layout.complete_steps(root) if root.is_dir() else []
    out["complete"] = [s.step for s in complete]
    out["monitor"] = {
        s.step: (markers.read_metadata(s.path) or {}).get("monitor") for s in complete
    }
    # The epoch each step records: in metadata.json, and in Lightning's state in extra/.
    out["epochs"] = {
        s.step: {
            "metadata": (markers.read_metadata(s.path) or {}).get("epoch"),
            "extra": torch.load(
                s.path / "extra" / "rank_00000.pt", weights_only=False, map_location="cpu"
            )["lightning"].get("epoch"),
        }
        for s in complete
    }
    if ckpt is not None:
        out["attrs"] = callback_attrs(ckpt)
        out["pickled_differences"] = pickled_differences(ckpt)
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


def _reference_module_class() -> type:
    import lightning.pytorch as pl

    class Reference(pl.LightningModule):  # type: ignore[misc]
        """A plain module that logs what ``ScoredModule`` logs, at the same steps."""

        def __init__(self, scores: dict[int, float] | None, val_scores: dict[int, float] | None):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.scores, self.val_scores = scores, val_scores

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.scores is not None:
                self.log("train_metric", torch.tensor(self.scores[self.trainer.global_step + 1]))
            return self.layer(batch[0]).sum()  # type: ignore[no-any-return]

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.val_scores is not None:
                self.log("val_loss", torch.tensor(self.val_scores[self.trainer.global_step]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Reference


def reference_fit(
    dirpath: str,
    *,
    max_steps: int = 6,
    samples: int = 64,
    callback: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    scores: dict[int, float] | None = SCORES,
    val_scores: dict[int, float] | None = None,
    ckpt_path: str | None = None,
    refit: dict[str, Any] | None = None,
    probe: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """:func:`fit`'s run with Lightning's own ``ModelCheckpoint`` (same options, same batches
    per epoch, same validation, same logged values) on one CPU process: what Lightning does."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    out: dict[str, Any] = {"error": None, "start": None}
    ckpt = ModelCheckpoint(dirpath=dirpath, **(callback or {}))

    def files() -> dict[str, dict[str, int]]:
        found = {}
        for path in sorted(Path(dirpath).glob("*.ckpt")):
            saved = torch.load(path, weights_only=False, map_location="cpu")
            found[str(path)] = {"step": saved["global_step"], "epoch": saved["epoch"]}
        return found

    def bookkeeping() -> dict[str, Any]:
        # By step, with the files of this moment ("last.ckpt" is rewritten at every save).
        now = files()
        return by_step(callback_attrs(ckpt), lambda path: now.get(path, {}).get("step", -1))

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if probe:
                out["start"] = callback_attrs(ckpt)
                out["start_by_step"] = bookkeeping()

    def data(n: int) -> Any:
        return DataLoader(TensorDataset(torch.zeros(n, 2)), batch_size=2)

    run = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ckpt, Probe()],
        **(trainer or {}),
    )
    module = _reference_module_class()(scores, val_scores)
    val = data(4) if val_scores is not None else None
    try:
        run.fit(module, train_dataloaders=data(samples), val_dataloaders=val, ckpt_path=ckpt_path)
        if refit is not None:
            out["first"] = callback_attrs(ckpt)
            out["first_by_step"] = bookkeeping()
            for name, value in refit.items():
                setattr(run.fit_loop, name, value)
            run.fit(module, train_dataloaders=data(samples), val_dataloaders=val)
    except Exception as err:  # noqa: BLE001 - reported to the test
        out["error"] = _error(err)
    out["files"] = files()
    out["attrs"] = callback_attrs(ckpt)
    out["pickled_differences"] = pickled_differences(ckpt)
    out["by_step"] = bookkeeping()
    return out


def run_pairs(rank: int, world_size: int, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each spec run twice: ``"ours"`` (:func:`fit`, in ``<dirpath>``) and ``"lightning"``
    (:func:`reference_fit`, in ``<dirpath>-lightning``), with their bookkeeping by step."""
    from lightning_mcore_ckpt.format import layout

    results = {}
    for name, spec in specs.items():
        ours = fit(rank, world_size, **spec)
        for key in ("attrs", "first", "start"):
            if ours.get(key) is not None:
                prefix = "" if key == "attrs" else f"{key}_"
                ours[f"{prefix}by_step"] = by_step(ours[key], layout.step_number)
        lightning = reference_fit(**{**spec, "dirpath": f"{spec['dirpath']}-lightning"})
        results[name] = {"ours": ours, "lightning": lightning}
    return results
