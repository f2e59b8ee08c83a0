"""One rank's unexpected error in its background fast save stops the fast saves of every rank at
once, and training goes on with the persistent tier.

Two simulated nodes of one rank each, a fast save every :data:`FAST` steps with one copy on the
other node, a persistent save every :data:`PERSIST` steps. Rank 1's write of fast step
:data:`BROKEN` raises a ``TypeError`` (a bug, not a disk's failure). Before the fix, rank 0 then
waited for rank 1's copy until the group's timeout, and its training thread with it at the next
fast save; here the timeout (``MegatronStrategy(timeout=...)``, which bounds ``FastTier``'s) is
:data:`GROUP_TIMEOUT_S`, and the rest of the run must take far less.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _node_dirs import node_local

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.format import layout
from lightning_mcore_ckpt.launch.namespaces import node_storage
from lightning_mcore_ckpt.testing import run_nodes

pytestmark = pytest.mark.timeout(600)

NODES = 2
FAST = 2
PERSIST = 5
BROKEN = 4
END = 8
GROUP_TIMEOUT_S = 60.0
"""The strategy's timeout, and so the fast tier's (its own ``timeout_s`` is the default 600)."""
WITHIN_S = 30.0
"""From the end of step :data:`BROKEN` to the end of the run, on every rank: well below the
timeout that a rank waiting for the broken one would have spent."""


def _job(rank: int, world_size: int, shared: str, fast_dir: str) -> dict[str, Any]:
    import datetime

    import lightning.pytorch as pl
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.fast import writer
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    if rank == 1:  # an unexpected error in this rank's background write of fast step BROKEN
        original = writer.write_payload

        def write_payload(path: Path, payload: Any) -> Any:
            if f"fast_step_{BROKEN}" in str(path):
                raise TypeError(f"injected into rank {rank}'s write of {path.name}")
            return original(path, payload)

        writer.write_payload = write_payload  # type: ignore[assignment]
    ended: dict[int, float] = {}
    fast: list[Any] = []

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            fast.append(checkpoint._fast)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ended[trainer.global_step] = time.monotonic()

    checkpoint = MegatronCheckpoint(
        f"{shared}/ckpt",
        every_n_train_steps=PERSIST,
        fast_tier=FastTier(fast_dir, every_n_train_steps=FAST, replicas=1),
    )
    trainer = make_trainer(
        END,
        MegatronStrategy(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)),
        1,
        num_nodes=NODES,
        callbacks=[checkpoint, Watch()],
        enable_checkpointing=True,
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(256), ckpt_path=None)
    return {
        "end": trainer.global_step,
        "after_broken_s": ended[END] - ended[BROKEN],
        "stopped": fast[0].writer._broken,
    }


def test_one_ranks_unexpected_error_stops_every_ranks_fast_saves_and_training_goes_on(
    tmp_path: Path,
) -> None:
    local = node_local(tmp_path / "local")
    shared = tmp_path / "shared"
    got = run_nodes(_job, NODES, 1, str(shared), str(local / "fast"), node_dir=local, timeout=500)
    for rank, result in enumerate(got):
        assert result["end"] == END, (rank, result)  # training went on
        assert result["after_broken_s"] < WITHIN_S, (rank, result)  # nobody waited for rank 1
        # Every rank stopped its fast saves, told why: rank 1's error.
        assert result["stopped"] is not None, (rank, result)
        assert "rank 1" in result["stopped"] and "TypeError" in result["stopped"], result
    saves = [
        json.loads(line) for line in (shared / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    ]
    by_step = {r["step"]: r for r in saves if r["kind"] == "fast_save"}
    assert sorted(by_step) == [2, BROKEN], by_step  # no fast save after the broken one
    assert by_step[2]["complete"] and not by_step[BROKEN]["complete"]
    assert any("injected into rank 1" in e for e in by_step[BROKEN]["errors"]), by_step
    for node in range(NODES):
        fast = node_storage(local, node) / "fast"
        assert files.is_complete(fast / "fast_step_2")
        assert not files.is_complete(fast / f"fast_step_{BROKEN}")
        assert files.steps(fast) == [2, BROKEN], node
    # The persistent tier went on: its save at step PERSIST, and the last one at the end.
    assert layout.read_tracker(shared / "ckpt") == END
