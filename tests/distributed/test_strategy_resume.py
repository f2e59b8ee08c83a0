"""Save with MegatronStrategy during a run; a new Trainer resumes bit-identically.

The uninterrupted run saves at the end of its first epoch (as a checkpoint callback would, from
``on_train_batch_end``) and keeps going; a fresh Trainer in the same processes then resumes from
that directory. Per-step losses after the save and the final weights must match exactly, with
dropout on and a shuffling sampler. (Mid-epoch resume needs per-rank dataloader state: that is
the checkpoint callback's job and is tested with it.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mcore_ckpt.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS_PER_EPOCH = 3
BATCH = 2


def _exact_resume(rank: int, world_size: int, tmp: str, tp: int) -> dict[str, object]:
    import lightning.pytorch as pl
    from _trainer import gathered_weights, loader, make_trainer

    from lightning_mcore_ckpt import MegatronStrategy
    from lightning_mcore_ckpt.tiny import TinyGPTModule

    samples = STEPS_PER_EPOCH * BATCH * (world_size // tp)
    step_dir = str(Path(tmp) / f"global_step_{STEPS_PER_EPOCH}")

    class SaveOnce(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == STEPS_PER_EPOCH:
                trainer.save_checkpoint(step_dir)

    def run(
        ckpt_path: str | None = None, callbacks: list[pl.Callback] | None = None
    ) -> tuple[TinyGPTModule, pl.Trainer]:
        module = TinyGPTModule(dropout=0.1)
        strategy = MegatronStrategy(tensor_model_parallel_size=tp)
        trainer = make_trainer(2 * STEPS_PER_EPOCH, strategy, world_size, callbacks=callbacks or [])
        trainer.fit(
            module, train_dataloaders=loader(samples, BATCH, shuffle=True), ckpt_path=ckpt_path
        )
        return module, trainer

    full, full_trainer = run(callbacks=[SaveOnce()])
    resumed, resumed_trainer = run(ckpt_path=step_dir)
    return {
        "full": full.step_losses,
        "resumed": resumed.step_losses,
        "resumed_global_step": resumed_trainer.global_step,
        "full_weights": gathered_weights(full_trainer),
        "resumed_weights": gathered_weights(resumed_trainer),
        "files": sorted(str(p.relative_to(tmp)) for p in Path(tmp).glob("*/*")),
    }


@pytest.mark.parametrize(
    ("world_size", "tp"),
    [(2, 2), (2, 1), (4, 2)],
    ids=["tp2", "dp2", "tp2xdp2"],
)
def test_resume_from_saved_step_is_bit_identical(tmp_path: Path, world_size: int, tp: int) -> None:
    results = run_distributed(_exact_resume, world_size, str(tmp_path), tp, timeout=280)
    assert results[0]["files"] == [
        "global_step_3/.lightning_mcore_ckpt",  # the start marker
        "global_step_3/extra",
        "global_step_3/metadata.json",  # a save by hand commits itself
        "global_step_3/model",
        "global_step_3/optim",
    ]
    for rank, r in enumerate(results):
        assert len(r["full"]) == 2 * STEPS_PER_EPOCH
        assert r["resumed_global_step"] == 2 * STEPS_PER_EPOCH
        assert len(r["resumed"]) == STEPS_PER_EPOCH, f"rank {rank} resumed at the wrong step"
        for i, (a, b) in enumerate(zip(r["resumed"], r["full"][STEPS_PER_EPOCH:], strict=True)):
            assert torch.equal(a, b), f"rank {rank}, step {STEPS_PER_EPOCH + i + 1}: {a} != {b}"
        assert r["full_weights"].keys() == r["resumed_weights"].keys()
        for key, tensor in r["full_weights"].items():
            assert torch.equal(tensor, r["resumed_weights"][key]), key
    # Losses really change from step to step (dropout and learning are live).
    assert len({float(x) for x in results[0]["full"]}) == 2 * STEPS_PER_EPOCH
    # Tensor-parallel peers see the same batch; data-parallel ranks see different batches.
    assert all(
        torch.equal(a, b) for a, b in zip(results[0]["full"], results[tp - 1]["full"], strict=True)
    )
    if world_size // tp > 1:
        assert not torch.equal(results[0]["full"][0], results[tp]["full"][0])
