"""Jobs on simulated nodes that share one checkpoint directory (run inside each rank): one that
holds the directory's lock while a second job tries to start."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

HOLD_S = 240.0
"""How long the first job waits, at most, for the test to let it go on."""


def _fit(rank: int, world_size: int, tmp: str, callbacks: list[Any], max_steps: int) -> Any:
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    trainer = make_trainer(
        max_steps,
        MegatronStrategy(),
        1,
        num_nodes=world_size,
        enable_checkpointing=True,
        callbacks=[MegatronCheckpoint(Path(tmp, "ckpt"), every_n_train_steps=1), *callbacks],
    )
    trainer.fit(TinyGPTModule(num_layers=1), train_dataloaders=loader(8, 2))
    return trainer


def hold_the_lock(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """One rank per node. After step 1, rank 0 says ``holding`` (with the lock file as it is
    then) and every rank waits until the test says ``release``; then the fit goes on to step 2.
    Returns this rank's pid and what it saw."""
    import lightning.pytorch as pl

    from lightning_mcore_ckpt.storage.lock import LOCK_FILE

    seen: dict[str, Any] = {"pid": os.getpid()}
    here = Path(tmp)

    class Hold(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step != 1:
                return
            lock = here / "ckpt" / LOCK_FILE
            seen["lock"] = json.loads(lock.read_text())
            # What this node's own directory holds: no lock of its own.
            seen["local_locks"] = [
                str(p) for p in Path(os.environ["TMPDIR"]).parent.rglob(LOCK_FILE)
            ]
            (here / f"holding-{rank}").touch()
            deadline = time.monotonic() + HOLD_S
            while not (here / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    trainer = _fit(rank, world_size, tmp, [Hold()], max_steps=2)
    seen["end"] = trainer.global_step
    return seen


def start_another_job(rank: int, world_size: int, tmp: str) -> str:
    """A second job on the same directory: what its fit raised on this rank."""
    try:
        _fit(rank, world_size, tmp, [], max_steps=2)
    except RuntimeError as err:
        return str(err)
    return "started"
