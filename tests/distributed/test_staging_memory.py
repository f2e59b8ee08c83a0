"""Host memory of a save, measured: ``MegatronStrategy(ckpt_max_staging_bytes=...)``.

Real Trainers on 2 gloo ranks (TP=2: each rank saves its own shards, about 36 MiB of weights
and Adam moments), real files. At step 2 each rank saves the same state twice: synchronously
(a sync save of CPU tensors copies nothing: the reference bytes, and the save's own memory,
measured: the allowance), then asynchronously, changing every weight as soon as the save
returns (the weights and the Adam moments). The peak extra resident memory of each save is the kernel's high-water mark above
the level before it.

Axes: the cap (None: unbounded; smaller than the largest tensor; between the largest tensor and
the state; larger than the state) x sync/async (both in every run) x write threads (1 or 4,
alternating over the caps; every pair of cap and thread count, with failures and aborts, is in
``tests/unit/test_staging_cap.py``, without processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

MiB = 2**20
CELLS = {  # cap -> write threads
    "unbounded": (None, 4),
    "below-largest-tensor": (1 * MiB, 1),
    "between": (8 * MiB, 4),
    "above-state": (1024 * MiB, 1),
}


def _measure(rank: int, world_size: int, root: str, cap: int | None, threads: int) -> Any:
    import lightning.pytorch as pl
    from _staging import PeakRSS
    from _trainer import loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy, SaveOptions
    from lightning_mcore_ckpt.format import markers
    from lightning_mcore_ckpt.tiny import TinyGPTModule, tiny_gpt

    class Wider(TinyGPTModule):  # type: ignore[misc]
        def _language_model(self, **config: Any) -> Any:
            return tiny_gpt(hidden_size=512, ffn_hidden_size=2048, num_attention_heads=8, **config)

    seen: dict[str, Any] = {}

    class SaveTwice(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            step, writer = trainer.global_step, trainer.strategy._writer
            sync = SaveOptions(synchronous=True)
            if step == 1:  # the first save of the run: thread pool, plans
                trainer.save_checkpoint(f"{root}/warm_up", storage_options=sync)
                return
            if step != 2:
                return
            with PeakRSS() as copies_nothing:
                trainer.save_checkpoint(f"{root}/reference", storage_options=sync)
            with PeakRSS() as async_save:
                trainer.save_checkpoint(f"{root}/global_step_2")
                assert writer.pending_path is not None
                with torch.no_grad():  # training goes on while the write is in flight
                    moments = [
                        t
                        for state in trainer.optimizers[0].state.values()
                        for t in state.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0
                    ]
                    for tensor in [*module.parameters(), *moments]:
                        tensor.add_(1.0)
                writer.finalize(blocking=True)
            staging = writer.shards.bounded or writer.shards.staging
            seen.update(
                sync_extra=copies_nothing.extra,
                async_extra=async_save.extra,
                held=staging.nbytes,
                largest=max(p.numel() * p.element_size() for p in module.parameters()),
            )

    strategy = MegatronStrategy(
        tensor_model_parallel_size=2,
        ckpt_async_save=True,
        ckpt_max_staging_bytes=cap,
        ckpt_write_threads=threads,
    )
    trainer = make_trainer(3, strategy, world_size, callbacks=[SaveTwice()])
    trainer.fit(Wider(dropout=0.0), train_dataloaders=loader(16, 2))
    step = Path(root, "global_step_2")
    files = [f for d in ("model", "optim") for f in (step / d).glob(f"__{rank}_*.distcp")]
    seen["state_bytes"] = sum(f.stat().st_size for f in files)
    seen["metadata"] = markers.read_metadata(step)
    return seen


@pytest.mark.parametrize("cell", list(CELLS))
def test_a_save_holds_at_most_the_cap_plus_one_bucket_and_writes_the_same_bytes(
    tmp_path: Path, cell: str
) -> None:
    cap, threads = CELLS[cell]
    results = run_distributed(_measure, 2, str(tmp_path), cap, threads, timeout=240)
    for rank, out in enumerate(results):
        state, largest = out["state_bytes"], out["largest"]
        assert state > 30 * MiB and largest >= 2 * MiB, out  # large enough to see
        # A sync save of CPU tensors copies nothing, whatever the cap: what it holds is the
        # save's own memory (planning, extra/, pickling), the allowance of the bounds below.
        allowance = out["sync_extra"]
        assert allowance < state / 4, (rank, out)  # it cannot hide the staging
        if cap is None or cap >= state:
            # Every tensor staged at once (less shows where the allocator reuses memory that
            # training freed).
            assert out["held"] >= state * 0.95, (rank, out)
            assert out["async_extra"] <= 1.1 * state, (rank, out)
        else:
            # At most the cap at once, plus one tensor larger than the cap on its own.
            assert out["held"] <= cap + largest, (rank, out)
            assert out["async_extra"] <= cap + largest + allowance, (rank, out)
        assert out["metadata"].get("max_staging_bytes") == cap, out["metadata"]
    # What the async save wrote is the state at the save, byte for byte: the reference,
    # written from the tensors themselves, before any weight changed.
    for name in ("model", "optim"):
        reference = sorted((tmp_path / "reference" / name).glob("*.distcp"))
        written = sorted((tmp_path / "global_step_2" / name).glob("*.distcp"))
        assert [f.name for f in written] == [f.name for f in reference] != []
        for ref, got in zip(reference, written, strict=True):
            assert got.read_bytes() == ref.read_bytes(), got
