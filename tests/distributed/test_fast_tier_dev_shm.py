"""``/dev/shm`` as the fast tier's directory, for process-crash recovery: a job whose ranks are
all SIGKILLed after a fast step resumes exactly from the copies in ``/dev/shm``.

A RAM disk outlives the processes that wrote to it, not the node: this is the failure it is
for (a crash, an OOM kill, a hung job killed and restarted on the same hosts), with
``replicas=0`` on one node. The run's directory is a fresh subdirectory of ``/dev/shm``, removed
afterwards. Skipped where ``/dev/shm`` is missing or not writable.

The job (2 ranks, one node) saves a fast step every :data:`FAST` steps and nothing to the
persistent tier; once fast step :data:`KILLED_AT` is complete on both ranks, each rank sends
itself SIGKILL (no exit handler, no flush, no cleanup runs). ``fit(ckpt_path="last")`` then
resumes step :data:`KILLED_AT` from ``/dev/shm`` and trains to :data:`END`, its losses from there
and its final weights and optimizer state equal to an uninterrupted run's; the load reads none
of the files' bytes into memory of its own (counted by the kernel): they are mapped, hashed
against the seal and loaded where they are.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.fast import files
from lightning_mcore_ckpt.testing import DistributedFailure, run_distributed

pytestmark = pytest.mark.timeout(600)

FAST = 2
KILLED_AT = 4
END = 7
SHM = Path("/dev/shm")
WIDE = {"hidden_size": 256, "ffn_hidden_size": 1024, "num_attention_heads": 4}


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory under ``/dev/shm``, removed afterwards."""
    if not SHM.is_dir() or not os.access(SHM, os.W_OK | os.X_OK):
        pytest.skip("/dev/shm is missing or not writable here")
    path = Path(tempfile.mkdtemp(prefix="lmc-fast-tier-test-", dir=SHM))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _job(
    rank: int, world_size: int, tmp: str, fast_dir: str, ckpt_path: str | None, kill: bool
) -> dict[str, Any]:
    import signal

    import lightning.pytorch as pl
    import torch.distributed as dist
    from _trainer import gathered_optimizer, gathered_weights, loader, make_trainer, record_losses

    from lightning_mcore_ckpt import FastTier, MegatronCheckpoint, MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    # Wide enough that a rank's files (~20 MB) dwarf what else a load reads (seals, markers).
    module = TinyGPTModule(optimizer="adamw", transformer_config=WIDE)
    losses = record_losses(module)
    seen: dict[str, Any] = {}

    class Kill(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["resumed"] = trainer.global_step

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if kill and trainer.global_step == KILLED_AT:
                checkpoint._fast.report(wait=True)  # fast step KILLED_AT counted
                dist.barrier()  # on every rank
                Path(tmp, f"losses_{rank}.json").write_text(json.dumps(losses))
                os.kill(os.getpid(), signal.SIGKILL)

    checkpoint = MegatronCheckpoint(
        f"{tmp}/ckpt",
        every_n_train_steps=1000,
        save_last=False,
        fast_tier=FastTier(fast_dir, every_n_train_steps=FAST, replicas=0),
    )
    strategy = MegatronStrategy()
    load = strategy.load_checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:  # the bytes the load read (rchar)
        before = _read_bytes()
        try:
            return load(*args, **kwargs)
        finally:
            seen["load_read"] = _read_bytes() - before

    strategy.load_checkpoint = counted  # type: ignore[method-assign]
    trainer = make_trainer(
        END,
        strategy,
        world_size,
        callbacks=[checkpoint, Kill()],
        enable_checkpointing=True,
    )
    trainer.fit(module, train_dataloaders=loader(64), ckpt_path=ckpt_path)
    return {
        "losses": losses,
        "weights": gathered_weights(trainer),
        "optim": gathered_optimizer(trainer),
        "resumed": seen.get("resumed"),
        "load_read": seen.get("load_read"),
    }


def _read_bytes() -> int:
    """Bytes this process has passed to ``read`` so far (the kernel's ``rchar``: Python's and
    torch's C++ reads alike)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")


def test_a_killed_job_resumes_exactly_from_its_copies_in_dev_shm(
    tmp_path: Path, shm_dir: Path
) -> None:
    reference = run_distributed(
        _job, 2, str(tmp_path / "reference"), str(shm_dir / "ref"), None, False
    )
    killed, fast = tmp_path / "killed", shm_dir / "run"
    with pytest.raises(DistributedFailure):  # every rank SIGKILLed
        run_distributed(_job, 2, str(killed), str(fast), None, True)
    assert files.is_complete(files.step_dir(fast, KILLED_AT))
    assert not list((killed / "ckpt").glob("global_step_*"))  # only the fast tier holds it
    resumed = run_distributed(_job, 2, str(killed), str(fast), "last", False)
    for rank, (ref, got) in enumerate(zip(reference, resumed, strict=True)):
        assert got["resumed"] == KILLED_AT
        before = json.loads((killed / f"losses_{rank}.json").read_text())
        assert {int(k): v for k, v in before.items()} == {
            k: v for k, v in ref["losses"].items() if k < KILLED_AT
        }
        assert got["losses"] == {k: v for k, v in ref["losses"].items() if k >= KILLED_AT}
        for name in ("weights", "optim"):
            assert got[name].keys() == ref[name].keys()
            for key, tensor in got[name].items():
                assert torch.equal(tensor, ref[name][key]), (rank, name, key)
    records = (killed / "ckpt" / "fast_tier.jsonl").read_text().splitlines()
    recovery = [r for r in map(json.loads, records) if r["kind"] == "recovery"][-1]
    assert recovery["tier"] == "fast" and recovery["step"] == KILLED_AT, recovery
    assert recovery["ranks_from_peers"] == 0
    # Not even one pass: each rank's files, already in memory, are mapped, hashed against the
    # seal where they are and loaded from there; none of their bytes is read into memory of
    # its own (a read of them would count them once, as from a disk; twice before that).
    step = files.step_dir(fast, KILLED_AT)
    for rank, got in enumerate(resumed):
        held = sum((step / name).stat().st_size for name in files.files_of(rank))
        assert got["load_read"] < 0.05 * held, (rank, held, got["load_read"])
