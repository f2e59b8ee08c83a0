"""A new run pointed at a directory that holds another run's steps: refused, or (opt-in)
replaces them; never mixes with them silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.format import layout, markers
from lightning_mcore_ckpt.storage.lock import LOCK_FILE
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _fit(rank: int, world_size: int, dirpath: str, steps: int, seed: int, **kwargs: Any) -> Any:
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    pl.seed_everything(seed)
    callback = MegatronCheckpoint(dirpath, every_n_train_steps=2, **kwargs)
    trainer = make_trainer(
        steps, MegatronStrategy(), world_size, callbacks=[callback], enable_checkpointing=True
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    except ValueError as err:
        return {"error": str(err)}
    return {"weights": gathered_weights(trainer)}


def _fit_overwriting(rank: int, world_size: int, dirpath: str, steps: int, seed: int) -> Any:
    return _fit(rank, world_size, dirpath, steps, seed, overwrite=True)


def _listing(root: Path) -> dict[str, str]:
    return {
        s.path.name: (markers.read_metadata(s.path) or {}).get("saved_at", "")
        for s in layout.complete_steps(root)
    }


def test_a_new_run_into_another_runs_directory_is_refused_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_distributed(_fit, 2, str(root), 4, 0, timeout=200)
    before = _listing(root)
    assert sorted(before) == ["global_step_2", "global_step_4"]
    results = run_distributed(_fit, 2, str(root), 2, 1, timeout=200)
    for result in results:  # every rank, before any work
        error = result["error"]
        assert f"MegatronCheckpoint(dirpath='{root}')" in error
        assert "holds complete steps of another run (newest: global_step_4)" in error
        assert 'ckpt_path="last"' in error and "overwrite=True" in error
    assert _listing(root) == before
    assert not (root / LOCK_FILE).exists()


def test_overwrite_replaces_the_other_runs_steps(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_distributed(_fit, 1, str(root), 6, 0, timeout=200)
    old = _listing(root)
    assert sorted(old) == ["global_step_2", "global_step_4", "global_step_6"]
    (new,) = run_distributed(_fit_overwriting, 1, str(root), 4, 1, timeout=200)
    assert "error" not in new
    now = _listing(root)
    # Only this run's steps: 2 and 4 replaced, 6 (the other run's) deleted; "last" is its 4.
    assert sorted(now) == ["global_step_2", "global_step_4"]
    assert all(now[name] != old[name] for name in now)
    assert layout.resolve_last(root) == layout.step_dir(root, 4)


def _fit_again(rank: int, world_size: int, dirpath: str) -> Any:
    """One callback: a Trainer fitted to step 4, fitted again to step 6 (it continues its own
    run), then a new Trainer with the same callback from scratch (another run: refused)."""
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.errors import ConfigurationError
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    callback = MegatronCheckpoint(dirpath, every_n_train_steps=2)
    first = make_trainer(
        4, MegatronStrategy(), world_size, callbacks=[callback], enable_checkpointing=True
    )
    module = TinyGPTModule()
    first.fit(module, train_dataloaders=loader(32, 2))
    first.fit_loop.epoch_loop.max_steps = 6
    first.fit(module, train_dataloaders=loader(32, 2))
    continued = first.global_step
    other = make_trainer(
        2, MegatronStrategy(), world_size, callbacks=[callback], enable_checkpointing=True
    )
    try:
        other.fit(TinyGPTModule(), train_dataloaders=loader(32, 2))
    except ConfigurationError as err:
        return {"continued_to": continued, "error": str(err)}
    return {"continued_to": continued, "error": None}


def test_a_trainer_fitted_again_continues_and_a_new_one_is_still_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_distributed(_fit_again, 2, str(root), timeout=280)
    for result in results:  # every rank
        assert result["continued_to"] == 6
        error = result["error"]
        assert error is not None, "a new Trainer from scratch was let into the directory"
        assert "holds complete steps of another run (newest: global_step_6)" in error
    assert sorted(_listing(root)) == ["global_step_2", "global_step_4", "global_step_6"]
    assert not (root / LOCK_FILE).exists()
