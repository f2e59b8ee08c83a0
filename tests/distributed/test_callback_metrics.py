"""Save-time metrics: a real Trainer with real WandbLogger (offline) and CSVLogger, read back."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import pytest
from _wandb import read_wandb_history, read_wandb_metric_definitions

from lightning_mcore_ckpt.cli.entry import main as cli_main
from lightning_mcore_ckpt.cli.report import human_bytes
from lightning_mcore_ckpt.engine import BLOCKING_PARTS
from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SAVE_EVERY = 2
MAX_STEPS = 6
SAVED_STEPS = [2, 4, 6]
TRAINING_BETWEEN_S = 0.3
WRITE_TAKES_S = 1.0
"""Sleep at every batch start: training the loop does while an async save is in flight."""
LOGGED = (
    "blocking_time_s",
    "total_time_s",
    "write_time_s",
    "size_bytes",
    "throughput_gbps",
)


def _train_with_loggers(rank: int, world_size: int, tmp: str, async_save: bool) -> dict[str, Any]:
    import time

    import wandb
    from _trainer import loader, make_trainer
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    class StepTakesTime(TinyGPTModule):  # type: ignore[misc]
        # Runs before the strategy looks for a finished async save at each batch start, so the
        # training loop does this much work between a save and its finalisation.
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            time.sleep(TRAINING_BETWEEN_S)

    if async_save:
        # The background write takes longer than a training step whatever the machine's speed,
        # so training goes on before the save is finalised.
        from lightning_mcore_ckpt.engine import _shards

        stock = _shards._write_file

        def slow_write(*args: Any, **kwargs: Any) -> Any:
            time.sleep(WRITE_TAKES_S)  # each shard file, in the writer's threads
            return stock(*args, **kwargs)

        _shards._write_file = slow_write

    loggers = [
        WandbLogger(project="metrics-test", save_dir=tmp, offline=True),
        CSVLogger(tmp, name="csv", version=0),
    ]
    trainer = make_trainer(
        MAX_STEPS,
        MegatronStrategy(tensor_model_parallel_size=2, ckpt_async_save=async_save),
        world_size,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), every_n_train_steps=SAVE_EVERY)],
        enable_checkpointing=True,
        logger=loggers,
        log_every_n_steps=1,
    )
    trainer.fit(StepTakesTime(), train_dataloaders=loader(32, 2))
    if rank == 0:
        wandb.finish()
    return {"rank": rank}


def _on_disk_bytes(path: Path) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(path)
        for name in files
    )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_save_is_logged_at_its_step_and_recorded(
    tmp_path: Path, async_save: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    run_distributed(_train_with_loggers, 2, str(tmp_path), async_save, timeout=280)
    ckpt = tmp_path / "ckpt"
    metadata = {
        step: json.loads((ckpt / f"global_step_{step}" / "metadata.json").read_text())
        for step in SAVED_STEPS
    }

    # --- figures in metadata.json: present and consistent ------------------------------------
    for step, meta in metadata.items():
        assert meta["async"] is async_save
        for key in LOGGED:
            assert isinstance(meta[key], int | float) and meta[key] > 0, (step, key, meta)
        assert meta["hf_export_time_s"] is None  # no Hugging Face export configured
        assert meta["blocking_time_s"] <= meta["total_time_s"]
        assert meta["write_time_s"] <= meta["total_time_s"]
        # Exactly the bytes of the committed step directory, metadata.json included.
        assert meta["size_bytes"] == _on_disk_bytes(ckpt / f"global_step_{step}")
        assert meta["throughput_gbps"] == pytest.approx(
            meta["size_bytes"] / meta["write_time_s"] / 1e9, rel=1e-4
        )
        if async_save and step != MAX_STEPS:
            # The training loop ran (at least one batch start) while this save was in flight;
            # that time is in the total, not in the blocking time.
            assert meta["total_time_s"] - meta["blocking_time_s"] >= TRAINING_BETWEEN_S
        if not async_save:
            # A sync save blocks for its whole write.
            assert meta["blocking_time_s"] >= meta["write_time_s"]
        # The blocking time by part, each the slowest rank's: no part exceeds the whole, and
        # the whole (the slowest rank's sum) is at most the sum of the parts' slowest.
        parts = meta["blocking_parts_s"]
        assert sorted(parts) == sorted(BLOCKING_PARTS)
        assert all(value >= 0 for value in parts.values()), parts
        assert max(parts.values()) <= meta["blocking_time_s"] + 1e-6
        assert meta["blocking_time_s"] <= sum(parts.values()) + 1e-6
        if async_save:  # handed to the writer's thread: nothing written inline, finalised later
            assert parts["write_inline"] == 0 and parts["schedule"] > 0, parts
            assert parts["finalize"] > 0 and parts["staging"] > 0, parts
        else:  # written inline: no thread, no later finalisation
            assert parts["schedule"] == parts["finalize"] == 0, parts
            assert parts["write_inline"] + parts["extra"] >= meta["write_time_s"] - 1e-6, parts

    # --- W&B: read the offline run back ------------------------------------------------------
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    definitions = read_wandb_metric_definitions(run_file)
    assert {"name": "", "glob_name": "checkpoint/*", "step_metric": "trainer/global_step"} in (
        definitions
    )
    history = read_wandb_history(run_file)
    rows = [r for r in history if any(k.startswith("checkpoint/") for k in r)]
    assert [r["trainer/global_step"] for r in rows] == SAVED_STEPS
    for row in rows:
        meta = metadata[row["trainer/global_step"]]
        for key in LOGGED:
            assert row[f"checkpoint/{key}"] == pytest.approx(meta[key], rel=1e-12), key
        assert "checkpoint/hf_export_time_s" not in row
    if async_save:
        # Finalised after training went on (the loss of a batch trained after the save was
        # logged first), yet charted at the step of the save.
        first = history.index(rows[0])
        losses_before = [r for r in history[:first] if "train_loss" in r]
        assert len(losses_before) > SAVED_STEPS[0], history[: first + 1]
    losses = [r for r in history if "train_loss" in r]
    assert len(losses) == MAX_STEPS

    # --- CSVLogger: every attached logger gets them, at the step of the save -----------------
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        csv_rows = [r for r in csv.DictReader(f) if r.get("checkpoint/size_bytes")]
    assert [int(r["step"]) for r in csv_rows] == SAVED_STEPS
    assert [float(r["checkpoint/size_bytes"]) for r in csv_rows] == [
        metadata[s]["size_bytes"] for s in SAVED_STEPS
    ]

    # --- report: the complete steps, not the crashed one -------------------------------------
    crashed = ckpt / "global_step_8" / "model"
    crashed.mkdir(parents=True)
    (crashed / "__0_0.distcp").write_bytes(b"half written")
    png = tmp_path / "saves.png"
    capsys.readouterr()
    assert cli_main(["report", str(ckpt), "--plot", str(png)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": 3 complete step(s)")
    table = [line.split() for line in out[3:6]]
    assert [row[0] for row in table] == ["2", "4", "6*"]  # 6 is "last"
    mode = "async" if async_save else "sync"
    for row, step in zip(table, SAVED_STEPS, strict=True):
        meta = metadata[step]
        assert row[3] == "model,optimizer,extra"
        assert " ".join(row[4:6]) == human_bytes(meta["size_bytes"])  # e.g. "1.3 MiB"
        assert float(row[6]) == pytest.approx(meta["blocking_time_s"], abs=1e-3)
        assert float(row[7]) == pytest.approx(meta["total_time_s"], abs=1e-3)
        assert float(row[8]) == pytest.approx(meta["throughput_gbps"], rel=1e-2)
        assert row[9:] == [mode, "tp2", "pp1", "cp1", "ep1", "dp1"]
    assert out[-2] == "incomplete (never committed, not resumable): global_step_8"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
