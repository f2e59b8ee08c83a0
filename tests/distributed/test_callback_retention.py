"""MegatronCheckpoint with real Trainer runs: retention across restarts, top-k, "last"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _fit(dirpath: str, max_steps: int, ckpt_path: str | None, **kwargs: Any) -> dict[str, Any]:
    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    start: dict[str, int] = {}

    class Start(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            start["step"] = trainer.global_step

    kwargs.setdefault("every_n_train_steps", 1)
    trainer = make_trainer(
        max_steps,
        MegatronStrategy(),
        1,
        callbacks=[MegatronCheckpoint(dirpath, **kwargs), Start()],
        enable_checkpointing=True,
    )
    module = TinyGPTModule()
    trainer.fit(module, train_dataloaders=loader(64, 2), ckpt_path=ckpt_path)
    return {
        "start": start["step"],
        "end": trainer.global_step,
        "losses": [float(x) for x in module.step_losses],
        "dir": sorted(p.name for p in Path(dirpath).iterdir()),
    }


def _retention_across_restarts(rank: int, world_size: int, tmp: str) -> list[dict[str, Any]]:
    runs = [_fit(tmp, 3, "last", max_to_keep=2)]
    # Left behind: a crashed save of an old step (it has the start marker), a directory named
    # like a step that this package did not write, and files not in the layout.
    from lightning_mcore_ckpt.format import markers

    markers.mark_step_started(Path(tmp, "global_step_1"))
    Path(tmp, "global_step_1", "model").mkdir(parents=True)
    Path(tmp, "global_step_0", "data").mkdir(parents=True)
    Path(tmp, "notes").mkdir()
    Path(tmp, "global_step_7.tar").write_text("not a step directory")
    runs.append(_fit(tmp, 5, "last", max_to_keep=2))
    return runs


def test_retention_is_restart_safe_and_touches_only_its_layout(tmp_path: Path) -> None:
    first, second = run_distributed(_retention_across_restarts, 1, str(tmp_path), timeout=250)[0]
    assert first["start"] == 0  # nothing to resume: started from scratch
    assert first["dir"] == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    assert second["start"] == 3
    # The resumed-from step went once two newer ones committed; the crashed global_step_1 was
    # cleaned up; what this package did not write was left alone.
    assert second["dir"] == [
        "global_step_0",
        "global_step_4",
        "global_step_5",
        "global_step_7.tar",
        "latest_checkpointed_iteration.txt",
        "notes",
    ]


def _top_k(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    return _fit(tmp, 5, None, max_to_keep=1, monitor="train_loss", save_top_k=2)


def test_top_k_by_monitor_on_top_of_max_to_keep(tmp_path: Path) -> None:
    run = run_distributed(_top_k, 1, str(tmp_path), timeout=250)[0]
    losses = run["losses"]  # loss of step k+1 is logged before the save of step k+1
    best_two = sorted(range(5), key=lambda i: losses[i])[:2]
    expected = {f"global_step_{i + 1}" for i in best_two} | {"global_step_5"}
    assert set(run["dir"]) - {"latest_checkpointed_iteration.txt"} == expected
    for name in expected:
        meta = json.loads((tmp_path / name / "metadata.json").read_text())
        assert meta["monitor"]["name"] == "train_loss"
        assert meta["monitor"]["value"] == pytest.approx(losses[meta["global_step"] - 1])


def _last_resolution(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"fresh": _fit(tmp, 2, "last")["start"]}
    tracker = Path(tmp, "latest_checkpointed_iteration.txt")
    tracker.unlink()
    out["no_tracker"] = _fit(tmp, 3, "last")["start"]
    # A crash left step 7 half-written and a tracker pointing at it.
    Path(tmp, "global_step_7", "model").mkdir(parents=True)
    tracker.write_text("7\n")
    out["tracker_on_incomplete"] = _fit(tmp, 4, "last")["start"]
    out["dirpath"] = _fit(tmp, 5, tmp)["start"]
    out["step_dir"] = _fit(tmp, 5, str(Path(tmp, "global_step_2")))["start"]
    try:
        _fit(tmp, 9, str(Path(tmp, "global_step_7")))
    except FileNotFoundError as err:
        out["incomplete_error"] = str(err)
    return out


def test_last_resolves_through_tracker_scan_dirpath_and_step_dir(tmp_path: Path) -> None:
    out = run_distributed(_last_resolution, 1, str(tmp_path), timeout=250)[0]
    assert out["fresh"] == 0
    assert out["no_tracker"] == 2
    assert out["tracker_on_incomplete"] == 3
    assert out["dirpath"] == 4
    assert out["step_dir"] == 2
    assert "global_step_7 is incomplete" in out["incomplete_error"]
    assert "global_step_2" in out["incomplete_error"]
