"""Lightning's own ``ModelCheckpoint`` (no ``MegatronCheckpoint``) with ``MegatronStrategy``.

A user who keeps ``enable_checkpointing=True`` (or brings a ``ModelCheckpoint`` configuration)
gets Lightning's names (``epoch=0-step=2.ckpt``, ``last.ckpt``), each a step directory: the
strategy saves them, deletes those ``save_top_k`` lets go, replaces ``last.ckpt`` in place, and a
run resumed from such a path (``fit(ckpt_path=<that path>)``) continues exactly as the
uninterrupted run.

Matrix: Lightning's configuration {the default (top-1, no monitor), top-2 by a monitor, the
default with ``save_last=True``} x {sync, async save}: every pair.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(600)

STEPS_PER_EPOCH = 2
BATCH = 2
EPOCHS = 3
CONFIGS = ("default", "top2_monitor", "save_last")


def _callbacks(config: str) -> list[object]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    if config == "default":
        return []  # the Trainer adds Lightning's default ModelCheckpoint
    if config == "top2_monitor":
        return [ModelCheckpoint(monitor="train_loss", mode="min", save_top_k=2)]
    return [ModelCheckpoint(save_last=True)]


def _state(trainer: object) -> dict[str, object]:
    callback = trainer.checkpoint_callback  # type: ignore[attr-defined]
    named = {callback.best_model_path, callback.last_model_path, *callback.best_k_models}
    return {
        "best_model_path": callback.best_model_path,
        "best_k_models": sorted(callback.best_k_models),
        "last_model_path": callback.last_model_path,
        "named": sorted(p for p in named if p),
    }


def _runs(rank: int, world_size: int, tmp: str, config: str, async_save: bool) -> dict[str, object]:
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    samples = STEPS_PER_EPOCH * BATCH * world_size

    def fit(root: str, epochs: int, ckpt_path: str | None = None) -> tuple[object, pl.Trainer]:
        module = TinyGPTModule(dropout=0.1)
        trainer = pl.Trainer(
            strategy=MegatronStrategy(ckpt_async_save=async_save),
            accelerator="cpu",
            devices=world_size,
            max_epochs=epochs,
            default_root_dir=root,
            callbacks=_callbacks(config),  # type: ignore[arg-type]
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(
            module, train_dataloaders=loader(samples, BATCH, shuffle=True), ckpt_path=ckpt_path
        )
        return module, trainer

    full, full_trainer = fit(f"{tmp}/full", EPOCHS)
    _, interrupted_trainer = fit(f"{tmp}/interrupted", EPOCHS - 1)
    callback = interrupted_trainer.checkpoint_callback
    assert callback is not None
    # The interrupted run's last epoch, as Lightning's bookkeeping names it.
    (resume_from,) = [
        p
        for p in _state(interrupted_trainer)["named"]  # type: ignore[attr-defined]
        if f"epoch={EPOCHS - 2}-" in p or (config == "save_last" and p.endswith("last.ckpt"))
    ][-1:]
    interrupted_state = _state(interrupted_trainer)
    resume_step = _global_step(resume_from)  # last.ckpt: replaced by the resumed run
    resumed, resumed_trainer = fit(f"{tmp}/interrupted", EPOCHS, ckpt_path=resume_from)
    return {
        "full_losses": full.step_losses,  # type: ignore[attr-defined]
        "resumed_losses": resumed.step_losses,  # type: ignore[attr-defined]
        "full_weights": gathered_weights(full_trainer),
        "resumed_weights": gathered_weights(resumed_trainer),
        "full_state": _state(full_trainer),
        "interrupted_state": interrupted_state,
        "resumed_state": _state(resumed_trainer),
        "resume_from": resume_from,
        "resume_step": resume_step,
        "resumed_global_step": resumed_trainer.global_step,
    }


def _on_disk(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "checkpoints").iterdir())


def _global_step(path: str) -> int:
    meta = json.loads((Path(path) / "metadata.json").read_text(encoding="utf-8"))
    return int(meta["global_step"])


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("config", CONFIGS)
def test_lightning_model_checkpoint_saves_prunes_and_resumes_exactly(
    tmp_path: Path, config: str, async_save: bool
) -> None:
    results = run_distributed(_runs, 2, str(tmp_path), config, async_save, timeout=560)
    r = results[0]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    step = STEPS_PER_EPOCH
    names = [str(full / "checkpoints" / f"epoch={e}-step={(e + 1) * step}.ckpt") for e in range(3)]
    full_state, resumed_state = r["full_state"], r["resumed_state"]
    # What is on disk is exactly what Lightning's bookkeeping names: the rest was removed.
    assert _on_disk(full) == full_state["named"]
    if config == "default":
        assert _on_disk(full) == [names[2]]
    elif config == "top2_monitor":
        assert len(full_state["best_k_models"]) == 2  # of 3 epoch-end saves: one removed
        assert full_state["best_model_path"] in full_state["best_k_models"]
    else:
        last = str(full / "checkpoints" / "last.ckpt")
        assert _on_disk(full) == [names[2], last]
        assert full_state["last_model_path"] == last
        assert _global_step(last) == EPOCHS * step  # replaced at every epoch's end
    for path in _on_disk(full):
        if not path.endswith("last.ckpt"):  # epoch=<e>-step=<s>.ckpt holds step <s>
            assert _global_step(path) == int(path.rsplit("step=", 1)[1].removesuffix(".ckpt"))
    # Resumed from the saved path: the resumed-from checkpoint stays (Lightning never removes
    # it), and the resumed run saved its own last epoch.
    resume_from = r["resume_from"]
    assert resume_from in _on_disk(interrupted)
    assert r["resume_step"] == (EPOCHS - 1) * step
    new = str(interrupted / "checkpoints" / f"epoch={EPOCHS - 1}-step={EPOCHS * step}.ckpt")
    assert new in _on_disk(interrupted)
    # Lightning's bookkeeping was restored and went on as in the uninterrupted run.
    assert resume_from in r["interrupted_state"]["named"]
    assert resumed_state["named"] == [
        p.replace(str(full), str(interrupted)) for p in full_state["named"]
    ]
    for rank, out in enumerate(results):
        assert out["resumed_global_step"] == EPOCHS * step
        tail = out["full_losses"][(EPOCHS - 1) * step :]
        assert len(out["resumed_losses"]) == step, f"rank {rank} resumed at the wrong step"
        for i, (a, b) in enumerate(zip(out["resumed_losses"], tail, strict=True)):
            assert torch.equal(a, b), f"rank {rank}, step {(EPOCHS - 1) * step + i + 1}"
        for key, tensor in out["full_weights"].items():
            assert torch.equal(tensor, out["resumed_weights"][key]), key


def _remove(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    import lightning.pytorch as pl
    from _trainer import loader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = pl.Trainer(
        strategy=MegatronStrategy(),
        accelerator="cpu",
        devices=world_size,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(8, 2))
    errors = {}
    for name in ("foreign.ckpt", "link.ckpt", "mine.ckpt", "missing.ckpt"):
        if name == "mine.ckpt":
            trainer.save_checkpoint(f"{tmp}/{name}")
        try:
            trainer.strategy.remove_checkpoint(f"{tmp}/{name}")
        except ValueError as err:
            errors[name] = str(err)
    return errors


def test_remove_checkpoint_deletes_only_what_this_package_wrote(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.ckpt"
    (foreign / "model").mkdir(parents=True)
    (foreign / "model" / "data.bin").write_bytes(b"user data")
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link.ckpt").symlink_to(target)
    errors = run_distributed(_remove, 2, str(tmp_path), timeout=200)
    # Every rank raises the same error for the foreign directory; nothing of it is deleted.
    assert errors[0] == errors[1]
    assert list(errors[0]) == ["foreign.ckpt"]
    assert "has no lightning-mcore-ckpt marker" in errors[0]["foreign.ckpt"]
    assert (foreign / "model" / "data.bin").read_bytes() == b"user data"
    assert (tmp_path / "link.ckpt").is_symlink() and target.is_dir()  # links are never deleted
    assert not (tmp_path / "mine.ckpt").exists()


def _dedup(rank: int, world_size: int, tmp: str) -> None:
    import lightning.pytorch as pl
    from _trainer import loader

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = pl.Trainer(
        strategy=MegatronStrategy(ckpt_dedup=True),
        accelerator="cpu",
        devices=world_size,
        max_steps=1,
        default_root_dir=tmp,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(8, 2))


def test_dedup_with_lightnings_model_checkpoint_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(
        DistributedFailure,
        match=r"ConfigurationError: MegatronStrategy\(ckpt_dedup=True\) with Lightning's ModelCheckpoint",
    ):
        run_distributed(_dedup, 1, str(tmp_path), timeout=200)
    assert not (tmp_path / "checkpoints").exists()
